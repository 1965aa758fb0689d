-- API tokens: who may call the gRPC API, and with which scopes.
--
-- A token is 32 random bytes shown to the operator once, when it is created; only its SHA-256 is
-- stored, so a copy of this table cannot be used to call the API. The API hashes the presented
-- token and compares the hashes in constant time. Scopes: 'read' (balances, history, withdrawal
-- status), 'withdraw' (the client's writes: accounts, deposit addresses, withdrawal requests and
-- cancels), 'admin' (approvals and lanes).
--
-- A token is never changed or deleted, only revoked: revoked_at may be set once, from null, and
-- every other column stays as created, so the table remains the record of who held which access
-- and when it ended. Names stay unique after revocation for the same reason.

create table api_token (
    id         bigserial   primary key,
    name       text        not null unique check (length(name) between 1 and 64),
    -- SHA-256 of the raw 32 token bytes
    token_hash bytea       not null unique check (length(token_hash) = 32),
    scopes     text[]      not null check (scopes <@ array['read', 'withdraw', 'admin']::text[])
                                    check (cardinality(scopes) > 0),
    created_at timestamptz not null default now(),
    revoked_at timestamptz null
);

create trigger api_token_append_only
    before update or delete on api_token
    for each row execute function reject_mutation_except_set_once('revoked_at');
create trigger api_token_no_truncate
    before truncate on api_token
    for each statement execute function reject_mutation();

-- the permitted change: revoke once
grant select, insert on api_token to custodian_service;
grant update (revoked_at) on api_token to custodian_service;
grant usage on sequence api_token_id_seq to custodian_service;
