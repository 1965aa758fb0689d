-- Withdrawal edges (DESIGN §7 items 11–14).
--
-- Every attempt carries its intent: `payout` (what the requested event pays) or `cancel` (a
-- zero-value transfer to ourselves), with the destination, value and calldata it was signed for.
-- A bump copies the intent of the attempt it replaces; settlement decodes the mined bytes and
-- compares them with the intents instead of trusting a label. Attempts from before this migration
-- take their intent from their kind (their destination, value and calldata stay unrecorded; their
-- bytes still say them).
alter table withdrawal_attempt
    add column intent       text          null check (intent in ('payout', 'cancel')),
    add column intent_to    text          null check (is_valid_address(chain, intent_to)),
    add column intent_value numeric(78,0) null check (is_u256(intent_value)),
    add column intent_data  bytea         null,
    add constraint withdrawal_attempt_intent_whole
        check ((intent_to is null) = (intent_value is null) and (intent_to is null) = (intent_data is null));

alter table withdrawal_attempt disable trigger withdrawal_attempt_append_only;
update withdrawal_attempt set intent = case kind when 'cancel' then 'cancel' else 'payout' end;
alter table withdrawal_attempt enable trigger withdrawal_attempt_append_only;
alter table withdrawal_attempt alter column intent set not null;

-- `fee_cap_reached`: the lowest open nonce cannot be bumped within the configured maximum fee (an
-- alert, shown as `stuck_at_cap` until a bump or the chain moves it on). `resolved`: an operator
-- settled a `needs_review` withdrawal with the evidence (`paid` by a transaction checked on chain,
-- or `not_paid`, releasing the hold).
alter table withdrawal_event drop constraint withdrawal_event_event_type_check;
alter table withdrawal_event add constraint withdrawal_event_event_type_check check (event_type in (
    'requested', 'awaiting_approval', 'approved', 'rejected', 'signed', 'broadcast', 'bumped', 'mined',
    'unmined', 'confirmed', 'failed_onchain', 'cancel_requested', 'cancelled', 'needs_review',
    'fee_cap_reached', 'resolved'));

alter table withdrawal add column stuck_at_cap boolean not null default false;
grant update (stuck_at_cap) on withdrawal to custodian_service;

-- A lane short of money (ETH for gas and value, or a token) signs nothing until it is topped up:
-- its withdrawals wait, never rejected for our own shortage. The worker sets and clears this on
-- every pass; it is not an operator pause.
alter table hot_wallet
    add column shortage       text        null,
    add column shortage_since timestamptz null,
    add constraint hot_wallet_shortage_since check ((shortage is null) = (shortage_since is null));
grant update (shortage, shortage_since) on hot_wallet to custodian_service;

-- A retired lane takes no new withdrawals (requests hash over the lanes still open) while its
-- in-flight ones finish.
alter table hot_wallet add column retired_at timestamptz null;
grant update (retired_at) on hot_wallet to custodian_service;

alter table operator_action drop constraint operator_action_known;
alter table operator_action add constraint operator_action_known check (action in (
    'limit_set', 'policy_set', 'token_created', 'token_revoked', 'lane_added',
    'lane_paused', 'lane_resumed', 'lane_resynced', 'lane_retired', 'asset_registered',
    'withdrawal_resolved'));
