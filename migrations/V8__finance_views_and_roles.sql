-- The read side for finance, and what each database role may do.
--
-- Balances, confirmation counts and withdrawal states are never stored as such (user_balance is a
-- checked projection of the postings); views derive them from the appended facts on every read.
-- Finance reads through the read-only login custodian_reader: the views, user_balance and the
-- BTC spend records (spends, payouts, attempts, reservations, change addresses), and no other
-- base table. The views run with their owner's privileges (security_invoker is left at its
-- default, false), so the role needs none on the tables behind them.
--
-- The roles are cluster-wide and created outside the migrations, by scripts/roles.sql (which also
-- says what each one is); the grants here are per database. custodian_owner owns the schema and
-- is the only role migrations run as. The service connects as custodian_app, a member of
-- custodian_service. custodian_service can append to append-only tables but holds no UPDATE or
-- DELETE on them (beyond the column-level updates the set-once triggers also permit, and pruning
-- raw_block), so a bug meets the privilege check before the trigger; it may update only the moving
-- columns of projections and operational state.
--
-- What the service role can never do, whatever the code says: update or delete a fact (the
-- append-only triggers, and no such privilege), set session_replication_role (superuser only),
-- alter or drop a trigger (owner only), change an API token's scopes or hash (only revoked_at is
-- granted, and the trigger permits only that), move a block's standing other than by appending a
-- verdict, or change what a withdrawal pays (no privilege on the request columns, and the trigger).
--
-- This file comes last because account_balance reads every concern (ledger, withdrawals, deposit
-- lifecycle) and the grants name every object.

-- ------------------------------------------------------------------ finance views

-- Balances per account and asset, customers only: the treasury's account (which owns the hot
-- wallets) shows no row. Its money is the `treasury` ledger account; its rebalances in flight and
-- its unconfirmed top-ups are not a customer's held or pending.
--   held      = amounts of the account's withdrawals still holding funds (in flight): every
--               withdrawal in a holding state, except one in review whose hold was settled or
--               released already (a confirmed withdrawal whose block was orphaned deeper than the
--               confirmation depth goes back to needs_review, holding nothing).
--   confirmed = posted funds: the net of the account's user:{id} postings plus held. A
--               withdrawal request already debits user:{id} into withdrawal_holds, so the
--               ledger balance alone is what remains spendable; adding the holds back keeps
--               "available = confirmed - held" from subtracting a withdrawal twice.
--   available = confirmed - held, i.e. the net of the user:{id} postings.
--   pending   = observed deposits attributed to the account, on a canonical block, not yet
--               confirmed and holding nothing in the ledger, counted once per deposit key.
create view account_balance as
select b.* from (
with ledger as (
    select substr(p.ledger_account, 6)::bigint as account_id,
           p.asset,
           sum(case p.direction when 'credit' then p.amount else -p.amount end) as net
      from ledger_posting p
     where p.ledger_account like 'user:%'
     group by 1, 2
), held as (
    select w.account_id, w.asset, sum(w.amount) as held
      from withdrawal w
     where w.account_id is not null
       and w.state in ('requested', 'awaiting_approval', 'signed', 'broadcast', 'mined',
                       'cancel_requested', 'needs_review')
       and (w.state <> 'needs_review'
            or not exists (select 1 from ledger_transfer t
                            where t.idempotency_key in ('withdrawal:' || w.id || ':settle',
                                                        'withdrawal:' || w.id || ':release')))
     group by 1, 2
), pending as (
    select u.account_id, u.asset, sum(u.amount) as pending
      from (select distinct on (s.deposit_key) s.account_id, s.asset, s.amount
              from deposit_status s
             where s.account_id is not null and not s.orphaned and s.custody_posted = 0
             order by s.deposit_key, s.height desc) u
     group by 1, 2
)
select account_id,
       asset,
       coalesce(l.net, 0) + coalesce(h.held, 0) as confirmed,
       coalesce(p.pending, 0) as pending,
       coalesce(h.held, 0) as held,
       coalesce(l.net, 0) as available
  from ledger l
  full join held h using (account_id, asset)
  full join pending p using (account_id, asset)
) b
 where b.account_id <> all (select id from account where treasury);

-- Every posting with its transfer, for auditors and the ledger-entries API.
create view ledger_entries as
select t.id as transfer_id,
       t.idempotency_key,
       t.kind,
       t.reference,
       t.created_at,
       p.ledger_account,
       p.asset,
       p.direction,
       p.amount,
       p.id as posting_id
  from ledger_transfer t
  join ledger_posting p on p.transfer_id = t.id;

-- The withdrawal projection with its signed attempts: how many, and the most recent hash. The
-- columns are listed: the view shows the request and its progress, not who requested it
-- (requested_by) or the fee-cap alert (stuck_at_cap).
create view withdrawal_status as
select w.id, w.account_id, w.external_id, w.chain, w.asset, w.destination, w.amount, w.state, w.lane,
       w.from_address, w.nonce, w.tx_hash, w.mined_block_hash, w.last_seq, w.requested_at, w.updated_at,
       coalesce(a.attempt_count, 0) as attempt_count,
       a.latest_attempt_tx_hash
  from withdrawal w
  left join lateral (
        select count(*) as attempt_count,
               (array_agg(wa.tx_hash order by wa.created_at desc, wa.tx_hash desc))[1]
                   as latest_attempt_tx_hash
          from withdrawal_attempt wa
         where wa.withdrawal_id = w.id
  ) a on true;

-- ------------------------------------------------------------------ custodian_reader: finance

grant usage on schema public to custodian_reader;
grant select on
    account_balance, deposit_status, withdrawal_status, ledger_entries, deposit_lost, deposit_discrepancy,
    audit_event, unspent_output, btc_lane_coin
    to custodian_reader;
grant select on user_balance, btc_change_address, btc_spend, btc_spend_payout, btc_attempt, utxo_reservation
    to custodian_reader;
grant execute on function available(bigint, text) to custodian_reader;

-- ------------------------------------------------------------------ custodian_service: the service

grant usage on schema public to custodian_service;
grant usage on all sequences in schema public to custodian_service;
-- `custodian status` reports the schema version as the service's login
grant select on refinery_schema_history to custodian_service;

-- the read side
grant select on
    chain_tip, account_balance, deposit_status, withdrawal_status, ledger_entries, deposit_lost,
    deposit_discrepancy, audit_event, unspent_output, btc_lane_coin, user_balance
    to custodian_service;

-- append-only: read and append only
grant select, insert on
    chain_identity, chain_block, raw_block, block_verdict, orphan_mark, deposit_event, output_spend,
    wallet_address, btc_change_address,
    ledger_transfer, ledger_posting, reversal_proposal, reversal_decision,
    withdrawal_event, nonce_allocation, withdrawal_attempt, btc_spend, btc_spend_payout, btc_attempt,
    utxo_reservation,
    api_token, operator_action, fact_seal
    to custodian_service;
-- the permitted changes: close an ownership range, revoke a token, release a reservation, prune
-- raw blocks (a block's standing moves by appending a verdict, through the owner's trigger)
grant update (valid_to_height) on wallet_address to custodian_service;
grant update (revoked_at) on api_token to custodian_service;
grant update (released_at) on utxo_reservation to custodian_service;
grant delete on raw_block to custodian_service;

-- mutable state and configuration
grant select, insert, update on scan_cursor, confirmation_policy, deposit_address_counter to custodian_service;
grant select, insert, update, delete on webhook_subscriber to custodian_service;

-- Rows whose identity never changes: the service updates only their moving columns. A
-- withdrawal's request columns, a lane's address and key, an asset's chain, contract and decimals
-- are not among them.
grant select, insert on withdrawal, hot_wallet, btc_hot_wallet, asset, account to custodian_service;
grant update (state, from_address, nonce, tx_hash, mined_block_hash, last_seq, updated_at, stuck_at_cap)
    on withdrawal to custodian_service;
grant update (next_nonce, paused_at, pause_reason, needs_resync, shortage, shortage_since, retired_at)
    on hot_wallet to custodian_service;
grant update (next_change_index) on btc_hot_wallet to custodian_service;
grant update (approval_limit, approvals_required, daily_limit) on asset to custodian_service;
-- accounts are never changed; the column-level update exists only because PostgreSQL requires
-- UPDATE privilege for `select ... for update`, which locks the account row while a withdrawal
-- request computes its available balance
grant update (external_ref) on account to custodian_service;

grant execute on function
    available(bigint, text), ledger_account_of(bigint), withdrawal_request_check(bigint, text, text, numeric),
    seal_facts(integer), verify_seals(), fact_digest(text, bigint, jsonb)
    to custodian_service;

-- user_balance is written only by its trigger, as the owner
revoke all on function user_balance_add() from public;
