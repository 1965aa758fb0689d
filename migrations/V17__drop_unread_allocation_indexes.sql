-- Two indexes that no query reads, each an insertion on every allocation.
--
-- nonce_allocation_withdrawal (withdrawal_id): a withdrawal's nonce is on its projection row.
--
-- withdrawal_attempt_nonce (chain, from_address, nonce): settlement is keyed on
-- (from_address, nonce), and the key is answered by nonce_allocation's primary key. The foreign
-- key (chain, from_address, nonce, withdrawal_id) → nonce_allocation ties every attempt at a
-- nonce to the one withdrawal that nonce was allocated to, so "every sibling at a nonce" is
-- "every attempt of that withdrawal", which withdrawal_attempt_withdrawal serves. Neither table
-- allows updates or deletes, so no referential action needs the referencing side indexed.

drop index nonce_allocation_withdrawal;
drop index withdrawal_attempt_nonce;
