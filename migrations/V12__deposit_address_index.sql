-- Deposit addresses derived from an extended public key: the allocator of derivation indexes.
--
-- Each chain's deposit addresses are children 0/i of one account-level extended public key (see
-- domain::hd). The next index is allocated here, in the transaction that records the address, so
-- concurrent requests never share an index and a rolled-back request consumes none.
-- deposit_address_counter is operational state, not an observation: one mutable row per chain,
-- locked by the allocating transaction. It remembers the fingerprint of the key its indexes were
-- counted under, so a changed key is refused instead of silently restarting the count from an
-- index some other key already used, or continuing one that means nothing under the new key.
--
-- A derivation index is assigned to at most one address per chain, guarded by a partial unique
-- index on wallet_address (imported addresses carry no index). Nothing wrote derivation_index
-- before this migration, so existing rows cannot violate it. A reassignment of a derived address
-- opens its new range without an index, so the index stays with the row that first received it.

create table deposit_address_counter (
    chain            text    primary key check (chain in ('eth', 'btc')),
    -- lowercase hex SHA-256 of the key's chain code and public key (domain::hd::DepositKey)
    xpub_fingerprint text    not null check (xpub_fingerprint ~ '^[0-9a-f]{64}$'),
    -- the index the next address receives; every lower index has been assigned
    next_index       integer not null check (next_index >= 0)
);

create unique index wallet_address_derivation_index
    on wallet_address (chain, derivation_index)
    where derivation_index is not null;

-- mutable state, like scan_cursor and hot_wallet
grant select, insert, update on deposit_address_counter to custodian_service;
