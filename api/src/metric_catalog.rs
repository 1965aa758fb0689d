//! Every metric the service exports, with its HELP text: one list that `serve` and `work`
//! describe to the Prometheus exporter at start-up, and that the shipped dashboard and alert
//! rules are checked against (`tests/it/ops.rs`).

/// What kind of metric a name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// A current value.
    Gauge,
    /// A distribution (`_bucket`, `_sum`, `_count`).
    Histogram,
}

/// Name, kind and HELP text of every metric.
pub const CATALOG: &[(&str, Kind, &str)] = &[
    (
        "custodian_api_pool_timeouts_total",
        Kind::Counter,
        "gRPC requests answered UNAVAILABLE because no database connection was free in time",
    ),
    (
        "custodian_api_refused_total",
        Kind::Counter,
        "gRPC requests refused, by reason (unauthenticated, scope, rate limit)",
    ),
    (
        "custodian_blocks_reinstated_total",
        Kind::Counter,
        "orphaned blocks that became canonical again (a flip-back), per chain",
    ),
    ("custodian_btc_batch_size", Kind::Histogram, "withdrawals paid by one signed BTC transaction"),
    (
        "custodian_btc_broadcast_refused_total",
        Kind::Counter,
        "signed BTC transactions the node refused for a reason other than their fee, per lane (alert)",
    ),
    (
        "custodian_btc_input_lost_total",
        Kind::Counter,
        "BTC spends whose input can never exist (its parent replaced on chain), per lane (alert)",
    ),
    (
        "custodian_btc_inputs_spent_total",
        Kind::Counter,
        "BTC broadcasts answered 'inputs missing or spent', per lane; settlement decides from the chain",
    ),
    ("custodian_bumps_total", Kind::Counter, "replacements signed with higher fees, per lane or kind"),
    (
        "custodian_deep_reorg_alerts_total",
        Kind::Counter,
        "confirmed payments a reorg deeper than the confirmation depth took back, per lane (alert)",
    ),
    (
        "custodian_deposit_discrepancies_opened_total",
        Kind::Counter,
        "discrepancy rounds opened for credited deposits the chain lost, per chain",
    ),
    (
        "custodian_deposit_posting_mismatches_total",
        Kind::Counter,
        "confirmed deposits whose booked amount or account differs from the chain's, per chain (alert)",
    ),
    ("custodian_deposits_observed_total", Kind::Counter, "deposit observations stored by the scanner, per chain"),
    ("custodian_deposits_posted_total", Kind::Counter, "deposit credits posted to the ledger, per chain"),
    (
        "custodian_fee_cap_reached_total",
        Kind::Counter,
        "attempts that could not be replaced within the configured fee cap, per lane (alert)",
    ),
    (
        "custodian_hot_wallet_balance",
        Kind::Gauge,
        "each hot wallet's balance of its native coin, smallest units (ETH at the node's latest block, BTC its spendable coins), per chain and lane",
    ),
    ("custodian_hot_wallet_low", Kind::Gauge, "1 while a lane's hot wallet is below its [metrics] low_balance threshold, per lane"),
    (
        "custodian_hot_wallet_short",
        Kind::Gauge,
        "1 while a lane's hot wallet cannot cover its next withdrawal, per lane",
    ),
    ("custodian_hot_wallet_shortages_total", Kind::Counter, "times a lane's hot wallet became short, per lane (alert)"),
    ("custodian_lane_errors_total", Kind::Counter, "lane passes that failed transiently and were backed off, per chain and lane"),
    (
        "custodian_node_failovers_total",
        Kind::Counter,
        "calls that moved to the next configured node because the current one did not answer, per chain",
    ),
    (
        "custodian_node_refused_total",
        Kind::Counter,
        "configured nodes refused because their chain identity differs from the other nodes' (alert), per chain",
    ),
    (
        "custodian_nonce_gap_alerts_total",
        Kind::Counter,
        "lanes whose chain nonce fell below ours with nothing in flight, per lane (alert)",
    ),
    ("custodian_nonce_too_low_total", Kind::Counter, "broadcasts answered 'nonce too low', per hot-wallet address"),
    ("custodian_paused_lanes", Kind::Gauge, "hot-wallet lanes currently paused"),
    (
        "custodian_posting_passes_total",
        Kind::Counter,
        "posting passes after scan steps, per chain and scope (whole: every key; since: what changed since the previous pass)",
    ),
    (
        "custodian_reconciliation_difference",
        Kind::Gauge,
        "1 while an asset's ledger and chain disagree at the last reconciliation, per asset",
    ),
    ("custodian_reorg_last_depth_blocks", Kind::Gauge, "depth of the last reorg, per chain"),
    ("custodian_reorgs_total", Kind::Counter, "reorgs handled by the scanner, per chain"),
    ("custodian_scanner_height", Kind::Gauge, "height of the scanner's canonical tip, per chain"),
    ("custodian_scanner_lag_blocks", Kind::Gauge, "blocks between the node's tip and the scanner's, per chain"),
    (
        "custodian_scanner_node_inconsistencies_total",
        Kind::Counter,
        "node answers that contradicted each other (a tip that went backwards, a block that changed), per chain",
    ),
    ("custodian_scanner_node_tip", Kind::Gauge, "the node's tip height as last read, per chain"),
    (
        "custodian_scanner_retries_total",
        Kind::Counter,
        "scanner steps retried after a transient failure, per chain and reason",
    ),
    (
        "custodian_scanner_up",
        Kind::Gauge,
        "1 while the chain's scanner is scanning, 0 while it is stopped or failing, per chain",
    ),
    (
        "custodian_token_payout_mismatch_total",
        Kind::Counter,
        "token payouts mined paying less than asked (failed on chain), per asset (alert)",
    ),
    (
        "custodian_unknown_spend_total",
        Kind::Counter,
        "reserved BTC coins spent by a transaction that is none of ours, per lane (alert)",
    ),
    (
        "custodian_unknown_transaction_alerts_total",
        Kind::Counter,
        "nonces consumed by transactions this service did not sign, per hot-wallet address (alert)",
    ),
    (
        "custodian_webhook_backlog",
        Kind::Gauge,
        "facts of its kinds waiting after a webhook subscriber's cursor (counted up to 10,000), per subscriber",
    ),
    ("custodian_webhook_deliveries_total", Kind::Counter, "webhook requests, by outcome (delivered, failed)"),
    (
        "custodian_webhook_paused",
        Kind::Gauge,
        "1 while a webhook subscriber is paused (by an operator, or after failing for longer than max_age_ms)",
    ),
    ("custodian_webhook_request_seconds", Kind::Histogram, "how long one webhook request took, answered or not"),
    (
        "custodian_withdrawal_tampered_total",
        Kind::Counter,
        "withdrawal rows found disagreeing with their event streams (alert)",
    ),
    ("custodian_request_batch_size", Kind::Histogram, "withdrawal requests of the API recorded by one transaction"),
    ("custodian_withdrawals", Kind::Gauge, "withdrawals per state, from the projection"),
    ("custodian_withdrawals_total", Kind::Counter, "withdrawal events recorded, per state reached"),
];

/// Describes every metric of [`CATALOG`] to the installed recorder, so each is exported with its
/// HELP text.
pub fn describe_all() {
    for (name, kind, help) in CATALOG {
        match kind {
            Kind::Counter => metrics::describe_counter!(*name, *help),
            Kind::Gauge => metrics::describe_gauge!(*name, *help),
            Kind::Histogram => metrics::describe_histogram!(*name, *help),
        }
    }
}
