-- The observations of one block, by block. The posting pass between two whole passes derives the
-- observations on the canonical blocks still within reach of a confirmation count, a reach that
-- starts below any block a verdict moved since the previous pass (projections/src/posting.rs,
-- `CHANGED`); deposit_lost (V12) derives the observations on orphaned blocks. Without this index
-- each read every observation the chain ever had.
create index deposit_event_block on deposit_event (chain, block_hash);
