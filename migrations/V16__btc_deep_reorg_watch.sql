-- What the BTC worker reads each pass to notice a confirmed payout whose block a reorg deeper than
-- the confirmation depth took away (as the ETH worker notices a nonce no longer counted): the
-- orphaned blocks of a chain by height, and the confirmed withdrawals by the block they were mined
-- in. Both are small (orphaned blocks are few; a withdrawal enters the second only when it is
-- confirmed), so neither the scan nor the allocation pays for them.
create index chain_block_orphaned_height on chain_block (chain, height) where orphaned_at is not null;
create index withdrawal_confirmed_block on withdrawal (mined_block_hash) where state = 'confirmed';
