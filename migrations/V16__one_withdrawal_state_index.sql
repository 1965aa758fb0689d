-- One index on a withdrawal's state instead of two.
--
-- withdrawal_state (state) served listings by state and withdrawal_lane_state (chain, lane,
-- state) the worker's per-lane queries. Every state change is a non-HOT update that inserts into
-- each index, so the pair cost two insertions per event. With state leading, one index answers
-- both: the worker's queries are equalities on all three columns (state = any(...) included),
-- and a listing by state uses its prefix.

drop index withdrawal_state;
drop index withdrawal_lane_state;
create index withdrawal_state_lane on withdrawal (state, chain, lane);
