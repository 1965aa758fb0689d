-- A lane's queue: its requested withdrawals, oldest first. The BTC allocator takes the first
-- `batch_max` of them under the lane's lock (`withdrawals/src/btc/mod.rs`); the ETH worker reads a
-- pass's worth of them before it prices and locks (`withdrawals/src/sql.rs`, `IN_STATE`).
--
-- Ordered by id, that read could be answered by walking withdrawal_pkey and filtering on the
-- state, and whenever the statistics said requested withdrawals were common (taken during a
-- burst, say) the plan did exactly that: it read past every withdrawal the lane had ever
-- signed, inside the lane lock, and grew with the history (the BTC allocation bench removed 2,142
-- rows by filter to find one batch of 50: 1.0 of the lock's 1.6 ms).
--
-- The queue is now ordered by (requested_at, id), an order only this index gives: its first n
-- entries are the batch, whatever the statistics and however long the history. It holds only
-- requested withdrawals, so an entry is written when a withdrawal becomes requested (its request,
-- its approval) and moving on from requested writes none.

create index withdrawal_requested on withdrawal (chain, lane, requested_at, id) where state = 'requested';
