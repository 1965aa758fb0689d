-- Finance sees every deposit discrepancy round (DESIGN §6): what the ledger held beyond the
-- canonical chain for a deposit key, and how it was settled — approved (the customer debited),
-- rejected (the loss booked to treasury), closed (the money was re-mined first) or still open.

create view deposit_discrepancy as
select r.id, r.deposit_key, r.round, r.chain, r.tx_hash, r.kind, r.output_index, r.ledger_account, r.asset, r.amount,
       r.reason, r.proposed_at, d.proposal_id is null as open, d.decision, d.decided_by, d.decided_at,
       d.reason as decision_reason, d.compensating_transfer_id
  from reversal_proposal r
  left join reversal_decision d on d.proposal_id = r.id;

grant select on deposit_discrepancy to custodian_reader, custodian_service;
