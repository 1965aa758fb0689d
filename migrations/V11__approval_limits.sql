-- Per-asset approval limits for withdrawals: a request above the limit waits in
-- awaiting_approval until a named person approves it. Configuration, so it is an ordinary column
-- an operator may change; the requested and approved events keep what applied at the time.

alter table asset add column approval_limit numeric(78,0) null check (approval_limit is null or approval_limit >= 0);
