-- The rules of the rows every allocation writes, one CHECK per table instead of one per rule (#13,
-- #14). Each rule still refuses what it refused, with its own constraint name and SQLSTATE.
--
-- PostgreSQL prepares a table's CHECK expressions again for every statement that writes the table:
-- it reads each one back from its stored text (stringToNode), runs it through the planner and
-- compiles it, before the first row. An ETH allocation of one withdrawal writes withdrawal (13
-- rules), withdrawal_attempt (10), hot_wallet (6), withdrawal_event and nonce_allocation in one
-- statement: 32 expressions prepared to check five rows. Profiled under the allocation bench's
-- four lanes (perf, 2 kHz), ExecConstraints was 12.9% of all CPU on the machine, 8.7% of it
-- preparing the expressions (stringToNode 5.4%), the largest single cost after the executor itself.
--
-- Here each such table has one CHECK calling one PL/pgSQL function with the row's columns. The
-- function is compiled once per connection and its rules are one CASE expression, planned once and
-- kept: the statement prepares a single function call. The CASE names the first rule the row
-- breaks (NULL passes, as it does in a CHECK: `(rule) is false`), and the function raises
-- check_violation with that rule's name, so a refused row reads as before.
--
-- Only the tables whose rules are prepared per allocated row are folded: withdrawal,
-- withdrawal_attempt, hot_wallet and btc_attempt. withdrawal_event and utxo_reservation keep their
-- few CHECKs: a BTC batch writes fifty and about twenty of their rows in one statement, and a
-- function call per row would cost more than the preparation it saves.

create function check_violated(tbl text, rule text) returns void
language plpgsql as $$
begin
    raise exception 'new row for relation "%" violates check constraint "%"', tbl, rule
        using errcode = 'check_violation', table = tbl, constraint = rule;
end;
$$;

create function withdrawal_broken_rule(
    chain text, external_id text, destination text, amount numeric, state text, from_address text, nonce bigint,
    tx_hash text, mined_block_hash text, last_seq integer, requested_by text
) returns boolean
language plpgsql immutable parallel safe as $$
declare
    broken text := case
        when (length(external_id) > 0) is false then 'withdrawal_external_id_nonempty'
        when (chain in ('eth', 'btc')) is false then 'withdrawal_chain_known'
        when is_valid_address(chain, destination) is false then 'withdrawal_destination_format'
        when (amount > 0) is false then 'withdrawal_amount_positive'
        when is_u256(amount) is false then 'withdrawal_amount_u256'
        when (state in ('requested', 'awaiting_approval', 'rejected', 'signed', 'broadcast', 'mined', 'confirmed',
                        'failed_onchain', 'cancel_requested', 'cancelled', 'needs_review')) is false
            then 'withdrawal_state_known'
        when is_valid_address(chain, from_address) is false then 'withdrawal_from_address_format'
        when (nonce >= 0) is false then 'withdrawal_nonce_nonnegative'
        when is_valid_hash(chain, tx_hash) is false then 'withdrawal_tx_hash_format'
        when is_valid_hash(chain, mined_block_hash) is false then 'withdrawal_mined_block_hash_format'
        when (last_seq >= 1) is false then 'withdrawal_last_seq_positive'
        when (length(requested_by) between 1 and 64) is false then 'withdrawal_requested_by_length'
    end;
begin
    if broken is not null then
        perform check_violated('withdrawal', broken);
    end if;
    return true;
end;
$$;

create function withdrawal_attempt_broken_rule(
    chain text, tx_hash text, kind text, max_fee numeric, priority_fee numeric, intent text, intent_to text,
    intent_value numeric, intent_data bytea
) returns boolean
language plpgsql immutable parallel safe as $$
declare
    broken text := case
        when (chain in ('eth', 'btc')) is false then 'withdrawal_attempt_chain_known'
        when (kind in ('original', 'bump', 'cancel')) is false then 'withdrawal_attempt_kind_known'
        when is_u256(max_fee) is false then 'withdrawal_attempt_max_fee_u256'
        when is_u256(priority_fee) is false then 'withdrawal_attempt_priority_fee_u256'
        when is_valid_hash(chain, tx_hash) is false then 'withdrawal_attempt_tx_hash_format'
        when (priority_fee <= max_fee) is false then 'withdrawal_attempt_priority_fee_within_max_fee'
        when (intent in ('payout', 'cancel')) is false then 'withdrawal_attempt_intent_known'
        when is_valid_address(chain, intent_to) is false then 'withdrawal_attempt_intent_to_format'
        when is_u256(intent_value) is false then 'withdrawal_attempt_intent_value_u256'
        when ((intent_to is null) = (intent_value is null) and (intent_to is null) = (intent_data is null)) is false
            then 'withdrawal_attempt_intent_whole'
    end;
begin
    if broken is not null then
        perform check_violated('withdrawal_attempt', broken);
    end if;
    return true;
end;
$$;

create function hot_wallet_broken_rule(
    chain text, address text, lane text, next_nonce bigint, paused_at timestamptz, pause_reason text,
    shortage text, shortage_since timestamptz
) returns boolean
language plpgsql immutable parallel safe as $$
declare
    broken text := case
        when (chain in ('eth', 'btc')) is false then 'hot_wallet_chain_known'
        when is_valid_address(chain, address) is false then 'hot_wallet_address_format'
        when (lane ~ '^[A-Za-z0-9_-]+$') is false then 'hot_wallet_lane_name'
        when (next_nonce >= 0) is false then 'hot_wallet_next_nonce_nonnegative'
        when (paused_at is not null or pause_reason is null) is false then 'hot_wallet_pause_reason'
        when ((shortage is null) = (shortage_since is null)) is false then 'hot_wallet_shortage_since'
    end;
begin
    if broken is not null then
        perform check_violated('hot_wallet', broken);
    end if;
    return true;
end;
$$;

create function btc_attempt_broken_rule(
    tx_hash text, kind text, fee numeric, vsize integer, change_output integer, change_index integer
) returns boolean
language plpgsql immutable parallel safe as $$
declare
    broken text := case
        when is_valid_hash('btc', tx_hash) is false then 'btc_attempt_tx_hash_format'
        when (kind in ('original', 'bump', 'cancel')) is false then 'btc_attempt_kind_known'
        when (fee > 0) is false then 'btc_attempt_fee_positive'
        when (vsize > 0) is false then 'btc_attempt_vsize_positive'
        when (change_output >= 0) is false then 'btc_attempt_change_output_nonnegative'
        when ((change_output is null) = (change_index is null)) is false then 'btc_attempt_change_whole'
    end;
begin
    if broken is not null then
        perform check_violated('btc_attempt', broken);
    end if;
    return true;
end;
$$;

alter table withdrawal
    drop constraint withdrawal_external_id_nonempty,
    drop constraint withdrawal_chain_known,
    drop constraint withdrawal_destination_format,
    drop constraint withdrawal_amount_positive,
    drop constraint withdrawal_amount_u256,
    drop constraint withdrawal_state_known,
    drop constraint withdrawal_from_address_format,
    drop constraint withdrawal_nonce_nonnegative,
    drop constraint withdrawal_tx_hash_format,
    drop constraint withdrawal_mined_block_hash_format,
    drop constraint withdrawal_last_seq_positive,
    drop constraint withdrawal_requested_by_length,
    add constraint withdrawal_rules check (withdrawal_broken_rule(
        chain, external_id, destination, amount, state, from_address, nonce, tx_hash, mined_block_hash, last_seq,
        requested_by));

alter table withdrawal_attempt
    drop constraint withdrawal_attempt_chain_known,
    drop constraint withdrawal_attempt_kind_known,
    drop constraint withdrawal_attempt_max_fee_u256,
    drop constraint withdrawal_attempt_priority_fee_u256,
    drop constraint withdrawal_attempt_tx_hash_format,
    drop constraint withdrawal_attempt_priority_fee_within_max_fee,
    drop constraint withdrawal_attempt_intent_known,
    drop constraint withdrawal_attempt_intent_to_format,
    drop constraint withdrawal_attempt_intent_value_u256,
    drop constraint withdrawal_attempt_intent_whole,
    add constraint withdrawal_attempt_rules check (withdrawal_attempt_broken_rule(
        chain, tx_hash, kind, max_fee, priority_fee, intent, intent_to, intent_value, intent_data));

alter table hot_wallet
    drop constraint hot_wallet_chain_known,
    drop constraint hot_wallet_address_format,
    drop constraint hot_wallet_lane_name,
    drop constraint hot_wallet_next_nonce_nonnegative,
    drop constraint hot_wallet_pause_reason,
    drop constraint hot_wallet_shortage_since,
    add constraint hot_wallet_rules check (hot_wallet_broken_rule(
        chain, address, lane, next_nonce, paused_at, pause_reason, shortage, shortage_since));

alter table btc_attempt
    drop constraint btc_attempt_tx_hash_format,
    drop constraint btc_attempt_kind_known,
    drop constraint btc_attempt_fee_positive,
    drop constraint btc_attempt_vsize_positive,
    drop constraint btc_attempt_change_output_nonnegative,
    drop constraint btc_attempt_change_whole,
    add constraint btc_attempt_rules check (btc_attempt_broken_rule(
        tx_hash, kind, fee, vsize, change_output, change_index));

-- The request columns' guard fires on the updates that name them, not on every state change: what
-- an UPDATE does not name it does not change (no other trigger on withdrawal rewrites a row), and
-- the service may not name them at all (V8's column privileges). The allocators' projection
-- updates, fifty rows a BTC batch, no longer call it row by row.
drop trigger withdrawal_request_immutable on withdrawal;
create trigger withdrawal_request_immutable
    before update of account_id, external_id, chain, asset, destination, amount, requested_by on withdrawal
    for each row execute function reject_withdrawal_request_change();
