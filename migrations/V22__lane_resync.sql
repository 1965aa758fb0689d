-- A lane paused because its key was used outside the service (the chain's nonce passed ours, or a
-- nonce of ours was consumed by a transaction we never signed) cannot simply resume: its nonce
-- cursor no longer matches the chain. It needs a resync (DESIGN §7 item 14): an operator action
-- recording the chain's and our nonces, after which it may resume.

alter table hot_wallet add column needs_resync boolean not null default false;
grant update (needs_resync) on hot_wallet to custodian_service;

alter table operator_action drop constraint operator_action_known;
alter table operator_action add constraint operator_action_known check (action in (
    'limit_set', 'policy_set', 'token_created', 'token_revoked', 'lane_added',
    'lane_paused', 'lane_resumed', 'lane_resynced', 'asset_registered'));
