-- Bitcoin withdrawals (DESIGN §7b): the scarce resource is the unspent output, so the
-- reservation plays the part of the nonce allocation.
--
-- btc_change_address: the change addresses of a BTC hot wallet (…/1/i), allocated in order under
-- the lane lock like deposit addresses. They belong to no account: the scanner watches them, and
-- what arrives there is our own coin coming back, never a deposit.
-- btc_spend: one spend of a set of our coins paying a batch of withdrawals; its attempts (the
-- original, replacements with higher fees, a cancel) are siblings that spend the same coins, so at
-- most one of them can ever be mined.
-- btc_spend_payout: which withdrawal each customer output of the spend pays, with that output's
-- weight (the fee of the mined sibling is split by it).
-- utxo_reservation: the coins a spend uses, inserted in the same transaction that stores its
-- signed bytes. Unique per coin among live reservations: the database, not the code, makes
-- spending one of our coins twice impossible. A reservation is only released by an operator
-- resolving a spend that can never be mined.

create table btc_change_address (
    chain            text        not null default 'btc' check (chain = 'btc'),
    lane             text        not null,
    derivation_index integer     not null check (derivation_index >= 0),
    address          text        not null check (is_valid_address('btc', address)),
    created_at       timestamptz not null default now(),
    primary key (chain, lane, derivation_index),
    unique (chain, address),
    foreign key (chain, lane) references btc_hot_wallet (chain, lane)
);

create table btc_spend (
    id         bigserial   primary key,
    chain      text        not null default 'btc' check (chain = 'btc'),
    lane       text        not null,
    created_at timestamptz not null default now(),
    foreign key (chain, lane) references btc_hot_wallet (chain, lane)
);

create table btc_spend_payout (
    spend_id      bigint  not null references btc_spend (id),
    -- a withdrawal is paid by one spend only
    withdrawal_id bigint  not null unique references withdrawal (id),
    output_index  integer not null check (output_index >= 0),
    weight        integer not null check (weight > 0),
    primary key (spend_id, withdrawal_id),
    unique (spend_id, output_index)
);

create table btc_attempt (
    tx_hash       text          primary key check (is_valid_hash('btc', tx_hash)),
    spend_id      bigint        not null references btc_spend (id),
    kind          text          not null check (kind in ('original', 'bump', 'cancel')),
    raw_tx        bytea         not null,
    -- inputs minus outputs, satoshis
    fee           numeric(78,0) not null check (fee > 0),
    vsize         integer       not null check (vsize > 0),
    -- the output paying us back (change, or everything for a cancel), if any
    change_output integer       null check (change_output >= 0),
    change_index  integer       null,
    created_at    timestamptz   not null default now(),
    check ((change_output is null) = (change_index is null))
);

create index btc_attempt_spend on btc_attempt (spend_id, created_at);

create table utxo_reservation (
    chain        text          not null default 'btc' check (chain = 'btc'),
    tx_hash      text          not null check (is_valid_hash('btc', tx_hash)),
    output_index integer       not null check (output_index >= 0),
    spend_id     bigint        not null references btc_spend (id),
    amount       numeric(78,0) not null check (amount > 0),
    -- which key spends it: null for the funding address …/0/0, else change …/1/change_index
    change_index integer       null check (change_index >= 0),
    reserved_at  timestamptz   not null default now(),
    released_at  timestamptz   null,
    primary key (spend_id, tx_hash, output_index)
);

create unique index utxo_reservation_live on utxo_reservation (chain, tx_hash, output_index)
    where released_at is null;

create trigger btc_change_address_append_only
    before update or delete on btc_change_address
    for each row execute function reject_mutation();
create trigger btc_spend_append_only
    before update or delete on btc_spend
    for each row execute function reject_mutation();
create trigger btc_spend_payout_append_only
    before update or delete on btc_spend_payout
    for each row execute function reject_mutation();
create trigger btc_attempt_append_only
    before update or delete on btc_attempt
    for each row execute function reject_mutation();
create trigger utxo_reservation_release_once
    before update or delete on utxo_reservation
    for each row execute function reject_mutation_except_set_once('released_at');

create trigger btc_change_address_no_truncate
    before truncate on btc_change_address for each statement execute function reject_mutation();
create trigger btc_spend_no_truncate
    before truncate on btc_spend for each statement execute function reject_mutation();
create trigger btc_spend_payout_no_truncate
    before truncate on btc_spend_payout for each statement execute function reject_mutation();
create trigger btc_attempt_no_truncate
    before truncate on btc_attempt for each statement execute function reject_mutation();
create trigger utxo_reservation_no_truncate
    before truncate on utxo_reservation for each statement execute function reject_mutation();

grant select, insert on btc_change_address, btc_spend, btc_spend_payout, btc_attempt, utxo_reservation
    to custodian_service;
grant update (released_at) on utxo_reservation to custodian_service;
grant usage on sequence btc_spend_id_seq to custodian_service;
grant select on btc_change_address, btc_spend, btc_spend_payout, btc_attempt, utxo_reservation to custodian_reader;
