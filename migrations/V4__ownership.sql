-- Ownership: customer accounts and the deposit addresses assigned to them over time.
--
-- wallet_address is versioned: an address belongs to an account for a half-open range of block
-- heights [valid_from_height, valid_to_height), null meaning open-ended. Deposits are attributed
-- by joining on the deposit block's height at projection time, never by a lookup at parse time,
-- so a reassignment cannot misattribute a deposit already in flight. The exclusion constraint
-- forbids two owners for one address at any height. The table is append-only except for closing
-- an open range once, on reassignment.

create extension if not exists btree_gist;

create table account (
    id           bigserial   primary key,
    external_ref text        not null unique check (length(external_ref) > 0),
    created_at   timestamptz not null default now()
);

create table wallet_address (
    chain             text        not null check (chain in ('eth', 'btc')),
    address           text        not null check (is_valid_address(chain, address)),
    account_id        bigint      not null references account (id),
    valid_from_height bigint      not null default 0 check (valid_from_height >= 0),
    -- exclusive end; null = still assigned
    valid_to_height   bigint      null,
    -- BIP-32 child index under the deposit xpub; null for addresses imported from elsewhere
    derivation_index  integer     null check (derivation_index >= 0),
    assigned_at       timestamptz not null default now(),
    primary key (chain, address, valid_from_height),
    check (valid_to_height is null or valid_to_height > valid_from_height),
    constraint wallet_address_no_overlap exclude using gist (
        chain with =,
        address with =,
        int8range(valid_from_height, valid_to_height) with &&
    )
);

create index wallet_address_account on wallet_address (account_id);

create trigger wallet_address_append_only
    before update or delete on wallet_address
    for each row execute function reject_mutation_except_set_once('valid_to_height');
create trigger wallet_address_no_truncate
    before truncate on wallet_address
    for each statement execute function reject_mutation();
