-- Covering indexes for one account's balance. The query reads the account's postings and the
-- deposits to its addresses; with these indexes both are answered from the index alone once
-- vacuum has marked the pages all-visible, instead of one random heap read per row (measured:
-- p99 of one account's balance over 1,000,000 deposits, see benches/ledger.rs).

create index ledger_posting_account_covering
    on ledger_posting (ledger_account, asset) include (direction, amount);
drop index ledger_posting_account;

create index deposit_event_address_covering
    on deposit_event (chain, address) include (block_hash, tx_hash, output_index, asset, amount);
drop index deposit_event_address;
