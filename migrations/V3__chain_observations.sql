-- Chain observations: what each chain told us, stored as facts and never rewritten.
--
-- chain_block records blocks and their lineage. A reorg marks the retracted blocks orphaned
-- (orphaned_at, set once) instead of deleting them, so everything derived from them drops out
-- of projections by the join and the evidence survives for the incident review.
-- deposit_event records each payment to a watched address found in a block. The block hash is
-- part of its key because one transaction can appear in two competing blocks and both
-- observations are real. raw_block keeps the exact node payload for the confirmation window so a
-- parser fix can re-derive events without the node; pruning it is the only deletion in the
-- system. scan_cursor is operational state, not an observation: rewinding it is the routine
-- recovery, and replaying a range is idempotent.

create table chain_block (
    chain       text        not null check (chain in ('eth', 'btc')),
    height      bigint      not null check (height >= 0),
    block_hash  text        not null,
    parent_hash text        not null,
    seen_at     timestamptz not null default now(),
    orphaned_at timestamptz,
    primary key (chain, block_hash),
    check (is_valid_hash(chain, block_hash)),
    check (is_valid_hash(chain, parent_hash))
);

-- One canonical block per height. The scanner must orphan the old block before ingesting its
-- replacement; this index also serves "our tip" and the parent-hash check.
create unique index chain_block_canonical_height
    on chain_block (chain, height) where orphaned_at is null;

create trigger chain_block_append_only
    before update or delete on chain_block
    for each row execute function reject_mutation_except_set_once('orphaned_at');
create trigger chain_block_no_truncate
    before truncate on chain_block
    for each statement execute function reject_mutation();

create table raw_block (
    chain      text        not null,
    block_hash text        not null,
    payload    bytea       not null,
    seen_at    timestamptz not null default now(),
    primary key (chain, block_hash),
    foreign key (chain, block_hash) references chain_block (chain, block_hash)
);

-- Rows are never changed; deleting them (pruning past the window) is allowed, truncating is not.
create trigger raw_block_append_only
    before update on raw_block
    for each row execute function reject_mutation();
create trigger raw_block_no_truncate
    before truncate on raw_block
    for each statement execute function reject_mutation();

create table deposit_event (
    id           bigserial     primary key,
    chain        text          not null check (chain in ('eth', 'btc')),
    block_hash   text          not null,
    tx_hash      text          not null check (is_valid_hash(chain, tx_hash)),
    -- BTC: the output's vout. ERC-20: the log index.
    output_index integer       not null check (output_index >= 0),
    address      text          not null check (is_valid_address(chain, address)),
    asset        text          not null,
    amount       numeric(78,0) not null check (amount > 0) check (is_u256(amount)),
    observed_at  timestamptz   not null default now(),
    unique (chain, tx_hash, output_index, block_hash),
    foreign key (chain, block_hash) references chain_block (chain, block_hash),
    -- the asset must exist and belong to the deposit's chain
    foreign key (chain, asset) references asset (chain, asset)
);

create index deposit_event_address on deposit_event (chain, address);

create trigger deposit_event_append_only
    before update or delete on deposit_event
    for each row execute function reject_mutation();
create trigger deposit_event_no_truncate
    before truncate on deposit_event
    for each statement execute function reject_mutation();

create table scan_cursor (
    chain       text        primary key check (chain in ('eth', 'btc')),
    next_height bigint      not null check (next_height >= 0),
    updated_at  timestamptz not null default now()
);
