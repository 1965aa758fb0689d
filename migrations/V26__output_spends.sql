-- Our coins are observations (DESIGN §7b): for every output the scanner stored for a watched
-- address, the transaction that spends it, block-scoped and append-only like deposits, orphaned
-- by the same join on chain_block. A hot wallet's spendable set is a query over these.
create table output_spend (
    chain        text    not null check (chain = 'btc'),
    -- the spent output
    tx_hash      text    not null,
    output_index integer not null check (output_index >= 0),
    -- what spent it, and where
    spending_tx  text    not null,
    input_index  integer not null check (input_index >= 0),
    block_hash   text    not null,
    recorded_at  timestamptz not null default now(),
    primary key (chain, tx_hash, output_index, block_hash),
    foreign key (chain, block_hash) references chain_block (chain, block_hash)
);

create index output_spend_spending on output_spend (chain, spending_tx);

create trigger output_spend_append_only
    before update or delete on output_spend
    for each row execute function reject_mutation();
create trigger output_spend_no_truncate
    before truncate on output_spend
    for each statement execute function reject_mutation();

grant select, insert on output_spend to custodian_service;

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

grant select on unspent_output to custodian_service, custodian_reader;
