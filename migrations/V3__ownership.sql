-- Ownership: customer accounts, the deposit addresses assigned to them over time, and our own
-- hot wallets.
--
-- wallet_address is versioned: an address belongs to an account for a half-open range of block
-- heights [valid_from_height, valid_to_height), null meaning open-ended. Deposits are attributed
-- by joining on the deposit block's height at projection time, never by a lookup at parse time,
-- so a reassignment cannot misattribute a deposit already in flight. The exclusion constraint
-- forbids two owners for one address at any height. The table is append-only except for closing
-- an open range once, on reassignment.
--
-- Each chain's deposit addresses are children 0/i of one account-level extended public key (see
-- domain::hd). The next index is allocated in deposit_address_counter, in the transaction that
-- records the address, so concurrent requests never share an index and a rolled-back request
-- consumes none.
--
-- Hot wallets are ours, and watched: money arriving at a hot-wallet address from outside (a
-- top-up, the arrival of a rebalance) is a deposit credited to the `treasury` ledger account, so
-- custody equals what our addresses hold. One account, the treasury's, owns every hot-wallet
-- address from the block after its registration; the posting pass credits its deposits to
-- `treasury` instead of a customer's ledger account. A hot wallet whose address is also a
-- customer's deposit address is refused by the exclusion constraint: its top-ups would be credited
-- to that customer. A hot_wallet row is also a withdrawal lane (V5__withdrawals.sql): its row lock
-- serialises every withdrawal leaving the address.

create extension if not exists btree_gist;

-- ------------------------------------------------------------------ accounts

create table account (
    id           bigserial   not null,
    external_ref text        not null,
    created_at   timestamptz not null default now(),
    -- the one account that owns our hot wallets; it has no customer balance (account_balance)
    treasury     boolean     not null default false,
    constraint account_pkey primary key (id),
    constraint account_external_ref_key unique (external_ref),
    constraint account_external_ref_nonempty check (length(external_ref) > 0)
);

create unique index account_one_treasury on account (treasury) where treasury;

-- id 0, outside the sequence, so customers' ids start at 1
insert into account (id, external_ref, treasury) values (0, '@treasury', true);

-- ------------------------------------------------------------------ deposit addresses

create table wallet_address (
    chain             text        not null,
    address           text        not null,
    account_id        bigint      not null,
    valid_from_height bigint      not null default 0,
    -- exclusive end; null = still assigned
    valid_to_height   bigint      null,
    -- BIP-32 child index under the deposit xpub; null for addresses imported from elsewhere and
    -- for hot wallets. A reassignment of a derived address opens its new range without an index,
    -- so the index stays with the row that first received it.
    derivation_index  integer     null,
    assigned_at       timestamptz not null default now(),
    constraint wallet_address_pkey primary key (chain, address, valid_from_height),
    constraint wallet_address_account_id_fkey foreign key (account_id) references account (id),
    constraint wallet_address_chain_known check (chain in ('eth', 'btc')),
    constraint wallet_address_address_format check (is_valid_address(chain, address)),
    constraint wallet_address_valid_from_height_nonnegative check (valid_from_height >= 0),
    constraint wallet_address_valid_range check (valid_to_height is null or valid_to_height > valid_from_height),
    constraint wallet_address_derivation_index_nonnegative check (derivation_index >= 0),
    constraint wallet_address_no_overlap exclude using gist (
        chain with =,
        address with =,
        int8range(valid_from_height, valid_to_height) with &&
    )
);

create index wallet_address_account on wallet_address (account_id);

-- Attribution (which account owned an address at a height) is a lookup here for every deposit.
-- As a plain range match the planner probes the exclusion constraint's GiST index, about ten
-- times slower per probe than a btree (measured: 35 µs against 4 µs). So the lookup asks for the
-- latest range starting at or below the height (at most one matches: the exclusion constraint
-- guarantees it), answered by this covering btree index without touching the table.
create index wallet_address_lookup
    on wallet_address (chain, address, valid_from_height desc) include (account_id, valid_to_height);

-- A derivation index is assigned to at most one address per chain (imported addresses carry none).
create unique index wallet_address_derivation_index
    on wallet_address (chain, derivation_index)
    where derivation_index is not null;

call append_only('wallet_address', set_once => 'valid_to_height');

-- The allocator of derivation indexes: operational state, not an observation; one mutable row per
-- chain, locked by the allocating transaction. It remembers the fingerprint of the key its
-- indexes were counted under, so a changed key is refused instead of silently restarting the
-- count from an index some other key already used, or continuing one that means nothing under
-- the new key.
create table deposit_address_counter (
    chain            text    not null,
    -- lowercase hex SHA-256 of the key's chain code and public key (domain::hd::DepositKey)
    xpub_fingerprint text    not null,
    -- the index the next address receives; every lower index has been assigned
    next_index       integer not null,
    constraint deposit_address_counter_pkey primary key (chain),
    constraint deposit_address_counter_chain_known check (chain in ('eth', 'btc')),
    constraint deposit_address_counter_xpub_fingerprint_format check (xpub_fingerprint ~ '^[0-9a-f]{64}$'),
    constraint deposit_address_counter_next_index_nonnegative check (next_index >= 0)
);

-- ------------------------------------------------------------------ hot wallets

-- One row per hot wallet, which is also one withdrawal lane. The address is the key's and never
-- changes; the other columns are the lane's state, moved by the withdrawal worker and operators.
create table hot_wallet (
    chain          text        not null,
    address        text        not null,
    lane           text        not null,
    -- the nonce the lane's next ETH transaction takes (0, unused, on a BTC lane)
    next_nonce     bigint      not null,
    -- an operator's pause; a reason only describes a current pause, so resuming clears both
    paused_at      timestamptz,
    pause_reason   text,
    created_at     timestamptz not null default now(),
    -- A lane paused because its key was used outside the service (the chain's nonce passed ours,
    -- or a nonce of ours was consumed by a transaction we never signed) cannot simply resume: its
    -- nonce cursor no longer matches the chain. It needs a resync, an operator action recording
    -- the chain's and our nonces, after which it may resume.
    needs_resync   boolean     not null default false,
    -- A lane short of money (ETH for gas and value, or a token) signs nothing until it is topped
    -- up: its withdrawals wait, never rejected for our own shortage. The worker sets and clears
    -- this on every pass; it is not an operator pause.
    shortage       text        null,
    shortage_since timestamptz null,
    -- A retired lane takes no new withdrawals (requests hash over the lanes still open) while its
    -- in-flight ones finish.
    retired_at     timestamptz null,
    constraint hot_wallet_pkey primary key (chain, address),
    constraint hot_wallet_chain_lane_key unique (chain, lane),
    constraint hot_wallet_chain_known check (chain in ('eth', 'btc')),
    constraint hot_wallet_address_format check (is_valid_address(chain, address)),
    -- the rule of domain::LaneName, so every stored name reads back as one
    constraint hot_wallet_lane_name check (lane ~ '^[A-Za-z0-9_-]+$'),
    constraint hot_wallet_next_nonce_nonnegative check (next_nonce >= 0),
    constraint hot_wallet_pause_reason check (paused_at is not null or pause_reason is null),
    constraint hot_wallet_shortage_since check ((shortage is null) = (shortage_since is null))
);

-- A BTC lane: its hot_wallet row holds the funding address (…/0/0 of a BIP-84 account); the
-- account's extended public key is kept here, to derive change addresses (…/1/i, allocated in
-- order like deposit addresses). The private key stays in its file.
create table btc_hot_wallet (
    chain             text        not null default 'btc',
    lane              text        not null,
    address           text        not null,
    account_xpub      text        not null,
    next_change_index integer     not null default 0,
    created_at        timestamptz not null default now(),
    constraint btc_hot_wallet_pkey primary key (chain, lane),
    constraint btc_hot_wallet_account_xpub_key unique (account_xpub),
    constraint btc_hot_wallet_chain_address_fkey foreign key (chain, address) references hot_wallet (chain, address),
    constraint btc_hot_wallet_chain_btc check (chain = 'btc'),
    constraint btc_hot_wallet_account_xpub_length check (length(account_xpub) between 100 and 120),
    constraint btc_hot_wallet_next_change_index_nonnegative check (next_change_index >= 0)
);

-- The change addresses of a BTC hot wallet (…/1/i), allocated in order under the lane lock like
-- deposit addresses. They belong to no account: the scanner watches them, and what arrives there
-- is our own coin coming back, never a deposit.
create table btc_change_address (
    chain            text        not null default 'btc',
    lane             text        not null,
    derivation_index integer     not null,
    address          text        not null,
    created_at       timestamptz not null default now(),
    constraint btc_change_address_pkey primary key (chain, lane, derivation_index),
    constraint btc_change_address_chain_address_key unique (chain, address),
    constraint btc_change_address_chain_lane_fkey foreign key (chain, lane) references btc_hot_wallet (chain, lane),
    constraint btc_change_address_chain_btc check (chain = 'btc'),
    constraint btc_change_address_derivation_index_nonnegative check (derivation_index >= 0),
    constraint btc_change_address_address_format check (is_valid_address('btc', address))
);

call append_only('btc_change_address');
