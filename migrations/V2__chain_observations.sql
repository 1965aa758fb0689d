-- Chain observations: what each chain told us, stored as facts and never rewritten, and the
-- configuration that says how to read them.
--
-- An asset is native ETH, native BTC, or an ERC-20 contract on ethereum registered by an operator
-- with its decimals. The asset key is text: 'ETH', 'BTC', or 'eth:0x<contract>'. It comes first
-- because deposits, postings, withdrawals and policy all reference it. confirmation_policy makes
-- the confirmation depth a function of value, so small deposits are fast and large ones wait
-- (how a deposit's tier is chosen: deposit_status, V4__ledger.sql). Both tables are configuration
-- and mutable.
--
-- chain_identity pins the network a database scans: the first scan records it, and a node on any
-- other network is refused.
--
-- chain_block records blocks and their lineage. A block's standing is its latest appended
-- block_verdict (`orphaned`, `reinstated`); chain_block.orphaned_at is the projection of that
-- standing and changes only through a verdict, so a block that comes back (a flip-back, a
-- load-balanced node) is recorded, never a reason to stop. A reorg marks the retracted blocks
-- orphaned instead of deleting them, so everything derived from them drops out of projections by
-- the join on chain_block and the evidence survives for the incident review.
--
-- deposit_event records each payment to a watched address found in a block. The block hash is
-- part of its key because one transaction can appear in two competing blocks and both
-- observations are real. Deposit kinds make keys stable: `native` (index 0), `log` (the log's
-- position in its transaction's receipt, not the block-wide index, which moves when the
-- transaction is re-mined elsewhere), `internal` (the call's position in the call tree) and
-- `output` (BTC vout). output_spend records, for every stored output, the transaction that spends
-- it, so our coins are observations too. raw_block keeps the exact node payload for the
-- confirmation window so a parser fix can re-derive events without the node; pruning it is the
-- only deletion of an observation. scan_cursor is operational state, not an observation:
-- rewinding it is the routine recovery, and replaying a range is idempotent.

-- ------------------------------------------------------------------ assets and policy

create table asset (
    asset              text          not null,
    chain              text          not null,
    contract           text          null,
    symbol             text          not null,
    decimals           smallint      not null,
    created_at         timestamptz   not null default now(),
    -- The approval policy of withdrawals (V5__withdrawals.sql). Above approval_limit a withdrawal
    -- waits in awaiting_approval for approvals_required distinct principals, none of them its
    -- requester. daily_limit is a rolling 24-hour total per account and asset; a request that
    -- would pass it waits for approval too instead of being refused. Configuration, so these are
    -- ordinary columns an operator may change; the requested and approved events keep what
    -- applied at the time. An asset's identity (chain, contract, decimals) never changes.
    approval_limit     numeric(78,0) null,
    approvals_required smallint      not null default 1,
    daily_limit        numeric(78,0) null,
    constraint asset_pkey primary key (asset),
    constraint asset_chain_symbol_key unique (chain, symbol),
    constraint asset_chain_contract_key unique (chain, contract),
    -- target for composite foreign keys that also pin the asset to the row's chain
    constraint asset_chain_asset_key unique (chain, asset),
    constraint asset_chain_known check (chain in ('eth', 'btc')),
    constraint asset_symbol_nonempty check (length(symbol) > 0),
    constraint asset_decimals_range check (decimals between 0 and 77),
    constraint asset_key_matches_kind check (
        (asset = 'ETH' and chain = 'eth' and contract is null)
        or (asset = 'BTC' and chain = 'btc' and contract is null)
        or (chain = 'eth'
            and contract is not null
            and is_valid_address('eth', contract)
            and asset = 'eth:' || contract)),
    constraint asset_approval_limit_nonnegative check (approval_limit is null or approval_limit >= 0),
    constraint asset_approvals_required_range check (approvals_required between 1 and 16),
    constraint asset_daily_limit_range check (daily_limit is null or (daily_limit >= 0 and is_u256(daily_limit)))
);

-- Out of the box, large payouts need two people: above 10 ETH or 1 BTC.
insert into asset (asset, chain, contract, symbol, decimals, approval_limit, approvals_required) values
    ('ETH', 'eth', null, 'ETH', 18, 10000000000000000000, 2),
    ('BTC', 'btc', null, 'BTC', 8,  100000000,            2);

-- A deposit needs the confirmations of the tier with the largest min_amount not above what it
-- pays (see deposit_status for what counts as paid).
create table confirmation_policy (
    chain         text          not null,
    asset         text          not null,
    min_amount    numeric(78,0) not null,
    confirmations integer       not null,
    constraint confirmation_policy_pkey primary key (chain, asset, min_amount),
    constraint confirmation_policy_chain_asset_fkey foreign key (chain, asset)
        references asset (chain, asset),
    constraint confirmation_policy_chain_known check (chain in ('eth', 'btc')),
    constraint confirmation_policy_min_amount_nonnegative check (min_amount >= 0),
    constraint confirmation_policy_min_amount_u256 check (is_u256(min_amount)),
    constraint confirmation_policy_confirmations_nonnegative check (confirmations >= 0)
);

-- Shipped defaults. Amounts in wei and satoshi.
insert into confirmation_policy (chain, asset, min_amount, confirmations) values
    ('eth', 'ETH', 0,                       12),
    ('eth', 'ETH', 1000000000000000000,     32),   -- 1 ETH
    ('eth', 'ETH', 100000000000000000000,   64),   -- 100 ETH
    ('btc', 'BTC', 0,                        1),
    ('btc', 'BTC', 10000000,                 3),   -- 0.1 BTC
    ('btc', 'BTC', 100000000,                6);   -- 1 BTC

-- ------------------------------------------------------------------ chain identity

create table chain_identity (
    chain        text        not null,
    network      text        not null,
    genesis_hash text        not null,
    -- the EIP-155 chain id; ethereum only
    chain_id     bigint      null,
    recorded_at  timestamptz not null default now(),
    constraint chain_identity_pkey primary key (chain),
    constraint chain_identity_chain_known check (chain in ('eth', 'btc')),
    constraint chain_identity_network_nonempty check (length(network) > 0),
    constraint chain_identity_chain_id_positive check (chain_id > 0),
    constraint chain_identity_genesis_hash_format check (is_valid_hash(chain, genesis_hash)),
    constraint chain_identity_chain_id_iff_eth check ((chain = 'eth') = (chain_id is not null))
);

call append_only('chain_identity');

-- ------------------------------------------------------------------ blocks and their verdicts

create table chain_block (
    chain         text        not null,
    height        bigint      not null,
    block_hash    text        not null,
    parent_hash   text        not null,
    seen_at       timestamptz not null default now(),
    -- the standing of the block's latest verdict: its time when `orphaned`, else null
    orphaned_at   timestamptz,
    fact_position bigint      not null default nextval('fact_position_seq'),
    fact_xid      xid8        not null default pg_current_xact_id(),
    constraint chain_block_pkey primary key (chain, block_hash),
    constraint chain_block_chain_known check (chain in ('eth', 'btc')),
    constraint chain_block_height_nonnegative check (height >= 0),
    constraint chain_block_block_hash_format check (is_valid_hash(chain, block_hash)),
    constraint chain_block_parent_hash_format check (is_valid_hash(chain, parent_hash))
);

-- One canonical block per height. The scanner must orphan the old block before ingesting its
-- replacement; this index also serves "our tip" and the parent-hash check.
create unique index chain_block_canonical_height
    on chain_block (chain, height) where orphaned_at is null;

create table raw_block (
    chain      text        not null,
    block_hash text        not null,
    payload    bytea       not null,
    seen_at    timestamptz not null default now(),
    constraint raw_block_pkey primary key (chain, block_hash),
    constraint raw_block_chain_block_hash_fkey foreign key (chain, block_hash)
        references chain_block (chain, block_hash)
);

-- Rows are never changed; deleting them (pruning past the window) is allowed, truncating is not.
create trigger raw_block_append_only
    before update on raw_block
    for each row execute function reject_mutation();
create trigger raw_block_no_truncate
    before truncate on raw_block
    for each statement execute function reject_mutation();

-- Verdicts on a block are numbered per block; the latest one is its standing.
create table block_verdict (
    chain         text        not null,
    block_hash    text        not null,
    seq           integer     not null,
    verdict       text        not null,
    reason        text        not null,
    recorded_at   timestamptz not null default now(),
    fact_position bigint      not null default nextval('fact_position_seq'),
    fact_xid      xid8        not null default pg_current_xact_id(),
    constraint block_verdict_pkey primary key (chain, block_hash, seq),
    constraint block_verdict_chain_block_hash_fkey foreign key (chain, block_hash)
        references chain_block (chain, block_hash),
    constraint block_verdict_seq_positive check (seq >= 1),
    constraint block_verdict_verdict_known check (verdict in ('orphaned', 'reinstated')),
    constraint block_verdict_reason_nonempty check (length(reason) > 0)
);

call append_only('block_verdict');

-- The seq the next verdict on a block takes (its verdicts are numbered 1, 2, …): what every
-- verdict insert writes, so the numbering rule has one home. Inlined by the planner.
create function next_verdict_seq(chain text, block_hash text) returns integer
language sql stable parallel safe
return coalesce((select max(v.seq) from block_verdict v
                  where v.chain = next_verdict_seq.chain and v.block_hash = next_verdict_seq.block_hash), 0) + 1;

-- chain_block is immutable but for orphaned_at, and orphaned_at always equals the standing of the
-- block's latest verdict: set to its time when it is `orphaned`, null when it is `reinstated` or
-- there is none. The owner cannot break the pairing either.
create function chain_block_follows_verdicts() returns trigger
language plpgsql as $$
declare
    latest block_verdict;
begin
    if tg_op = 'UPDATE' and to_jsonb(new) - 'orphaned_at' = to_jsonb(old) - 'orphaned_at'
       and new.orphaned_at is distinct from old.orphaned_at then
        select * into latest from block_verdict v
         where v.chain = new.chain and v.block_hash = new.block_hash order by v.seq desc limit 1;
        if (latest.verdict = 'orphaned' and new.orphaned_at = latest.recorded_at)
           or (coalesce(latest.verdict, 'reinstated') = 'reinstated' and new.orphaned_at is null) then
            return new;
        end if;
        raise exception 'chain_block %: orphaned_at must reflect the latest block_verdict', new.block_hash
            using errcode = 'P0001', table = tg_table_name;
    end if;
    raise exception 'append-only table %: % rejected', tg_table_name, tg_op
        using errcode = 'P0001', table = tg_table_name,
              detail = 'only orphaned_at changes, and only through a block_verdict';
end;
$$;

create trigger chain_block_append_only
    before update or delete on chain_block
    for each row execute function chain_block_follows_verdicts();
create trigger chain_block_no_truncate
    before truncate on chain_block
    for each statement execute function reject_mutation();

-- Appending a verdict moves the projection in the same transaction. Security definer: the
-- service appends verdicts and cannot update chain_block itself.
create function block_verdict_project() returns trigger
language plpgsql security definer set search_path = public, pg_temp as $$
begin
    update chain_block
       set orphaned_at = case new.verdict when 'orphaned' then new.recorded_at end
     where chain = new.chain and block_hash = new.block_hash
       and orphaned_at is distinct from case new.verdict when 'orphaned' then new.recorded_at end;
    return null;
end;
$$;

create trigger block_verdict_projects
    after insert on block_verdict
    for each row execute function block_verdict_project();

-- orphan_mark, an append-only record of blocks being orphaned, and record_orphan_mark(), which
-- appended to it, are not used: block_verdict records every change of a block's standing, and no
-- trigger calls the function. They stay, empty, until they are dropped on purpose.
create table orphan_mark (
    chain         text        not null,
    block_hash    text        not null,
    orphaned_at   timestamptz not null,
    fact_position bigint      not null default nextval('fact_position_seq'),
    fact_xid      xid8        not null default pg_current_xact_id(),
    constraint orphan_mark_pkey primary key (chain, block_hash),
    constraint orphan_mark_chain_block_hash_fkey foreign key (chain, block_hash)
        references chain_block (chain, block_hash)
);

call append_only('orphan_mark');

create function record_orphan_mark() returns trigger
language plpgsql as $$
begin
    insert into orphan_mark (chain, block_hash, orphaned_at) values (new.chain, new.block_hash, new.orphaned_at);
    return null;
end;
$$;

-- ------------------------------------------------------------------ deposits and spends

-- A deposit's key: what it is, independent of the block it was seen in, so the same payment seen
-- in two competing blocks is one deposit. The ledger books deposits under it
-- (ledger_transfer.deposit_key, '{key}:credit:1', ...), reconciliation works per key, and every
-- query that joins observations to the ledger builds the key with this function. Strict and one
-- expression (output_index is cast explicitly so it stays immutable): it is inlined wherever it
-- is called.
create function deposit_key(chain text, tx_hash text, kind text, output_index integer) returns text
language sql immutable strict parallel safe
return 'deposit:' || chain || ':' || tx_hash || ':' || kind || ':' || output_index::text;

create table deposit_event (
    id            bigserial     not null,
    chain         text          not null,
    block_hash    text          not null,
    tx_hash       text          not null,
    -- BTC: the output's vout. ERC-20: the log's position in its transaction's receipt. Native
    -- ETH: 0. Internal: the call's position in the call tree.
    output_index  integer       not null,
    address       text          not null,
    asset         text          not null,
    amount        numeric(78,0) not null,
    observed_at   timestamptz   not null default now(),
    fact_position bigint        not null default nextval('fact_position_seq'),
    fact_xid      xid8          not null default pg_current_xact_id(),
    kind          text          not null,
    -- a BTC coinbase output: spendable, so confirmable, only after 100 blocks
    coinbase      boolean       not null default false,
    constraint deposit_event_pkey primary key (id),
    constraint deposit_event_key unique (chain, tx_hash, kind, output_index, block_hash),
    constraint deposit_event_chain_block_hash_fkey foreign key (chain, block_hash)
        references chain_block (chain, block_hash),
    -- the asset must exist and belong to the deposit's chain
    constraint deposit_event_chain_asset_fkey foreign key (chain, asset) references asset (chain, asset),
    constraint deposit_event_chain_known check (chain in ('eth', 'btc')),
    constraint deposit_event_tx_hash_format check (is_valid_hash(chain, tx_hash)),
    constraint deposit_event_output_index_nonnegative check (output_index >= 0),
    constraint deposit_event_address_format check (is_valid_address(chain, address)),
    constraint deposit_event_amount_positive check (amount > 0),
    constraint deposit_event_amount_u256 check (is_u256(amount)),
    constraint deposit_event_kind_known check (kind in ('native', 'log', 'internal', 'output')),
    constraint deposit_event_kind_matches_chain check (
        (chain = 'btc') = (kind = 'output')
        and (kind <> 'native' or output_index = 0)
        and (not coinbase or chain = 'btc'))
);

-- Covering index for one account's balance: the deposits to its addresses are answered from the
-- index alone once vacuum has marked the pages all-visible, instead of one random heap read per
-- row (measured: p99 of one account's balance over 1,000,000 deposits, see benches/ledger.rs).
create index deposit_event_address_covering
    on deposit_event (chain, address) include (block_hash, tx_hash, output_index, asset, amount);

call append_only('deposit_event');

-- For every output the scanner stored for a watched address, the transaction that spends it,
-- block-scoped and append-only like deposits, orphaned by the same join on chain_block. A hot
-- wallet's spendable set is a query over these (unspent_output below, btc_lane_coin in
-- V5__withdrawals.sql).
create table output_spend (
    chain        text        not null,
    -- the spent output
    tx_hash      text        not null,
    output_index integer     not null,
    -- what spent it, and where
    spending_tx  text        not null,
    input_index  integer     not null,
    block_hash   text        not null,
    recorded_at  timestamptz not null default now(),
    constraint output_spend_pkey primary key (chain, tx_hash, output_index, block_hash),
    constraint output_spend_chain_block_hash_fkey foreign key (chain, block_hash)
        references chain_block (chain, block_hash),
    constraint output_spend_chain_btc check (chain = 'btc'),
    constraint output_spend_output_index_nonnegative check (output_index >= 0),
    constraint output_spend_input_index_nonnegative check (input_index >= 0)
);

create index output_spend_spending on output_spend (chain, spending_tx);

call append_only('output_spend');

create table scan_cursor (
    chain       text        not null,
    next_height bigint      not null,
    updated_at  timestamptz not null default now(),
    constraint scan_cursor_pkey primary key (chain),
    constraint scan_cursor_chain_known check (chain in ('eth', 'btc')),
    constraint scan_cursor_next_height_nonnegative check (next_height >= 0)
);

-- ------------------------------------------------------------------ derived views

-- Our tip per chain: the highest non-orphaned block we hold, not the node's answer, so a node
-- that lags or resyncs never moves projections backwards. One index probe per chain.
create view chain_tip as
select c.chain, t.height
  from (values ('eth'), ('btc')) as c (chain)
  cross join lateral (
        select max(b.height) as height
          from chain_block b
         where b.chain = c.chain
           and b.orphaned_at is null
  ) t
 where t.height is not null;

-- Stored outputs on canonical blocks that no canonical block spends, with the height they were
-- mined at: the coins we hold (customers' deposit addresses and hot wallets alike).
create view unspent_output as
select d.chain, d.tx_hash, d.output_index, d.address, d.amount, d.coinbase, b.height, b.block_hash
  from deposit_event d
  join chain_block b on b.chain = d.chain and b.block_hash = d.block_hash and b.orphaned_at is null
 where d.chain = 'btc' and d.kind = 'output'
   and not exists (select 1 from output_spend s
                     join chain_block sb on sb.chain = s.chain and sb.block_hash = s.block_hash
                                        and sb.orphaned_at is null
                    where s.chain = d.chain and s.tx_hash = d.tx_hash and s.output_index = d.output_index);
