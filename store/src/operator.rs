//! Operator actions as facts: every change an operator makes outside a withdrawal's stream
//! (limits and policy, API tokens, lanes, asset registration, webhook subscribers) is appended to `operator_action`
//! with the authenticated principal, in the same transaction as the change itself, and appears in
//! the audit history as `operator_<action>`.

use deadpool_postgres::GenericClient;

/// What an operator did. The stored names are checked by the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// An asset's approval limit, approvers or daily limit changed.
    LimitSet,
    /// A confirmation tier was set.
    PolicySet,
    /// An API token was created.
    TokenCreated,
    /// An API token was revoked.
    TokenRevoked,
    /// A hot wallet (lane) was registered.
    LaneAdded,
    /// A lane was paused.
    LanePaused,
    /// A lane was resumed.
    LaneResumed,
    /// A lane's nonce cursor was re-synced with the chain.
    LaneResynced,
    /// An ERC-20 contract was registered.
    AssetRegistered,
    /// A lane was retired: no new withdrawals hash to it.
    LaneRetired,
    /// A withdrawal in `needs_review` was resolved with evidence.
    WithdrawalResolved,
    /// A webhook subscriber was added.
    WebhookAdded,
    /// A webhook subscriber was paused by an operator.
    WebhookPaused,
    /// A webhook subscriber was resumed.
    WebhookResumed,
    /// A webhook subscriber was removed.
    WebhookRemoved,
}

impl Action {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::LimitSet => "limit_set",
            Action::PolicySet => "policy_set",
            Action::TokenCreated => "token_created",
            Action::TokenRevoked => "token_revoked",
            Action::LaneAdded => "lane_added",
            Action::LanePaused => "lane_paused",
            Action::LaneResumed => "lane_resumed",
            Action::LaneRetired => "lane_retired",
            Action::WithdrawalResolved => "withdrawal_resolved",
            Action::LaneResynced => "lane_resynced",
            Action::AssetRegistered => "asset_registered",
            Action::WebhookAdded => "webhook_added",
            Action::WebhookPaused => "webhook_paused",
            Action::WebhookResumed => "webhook_resumed",
            Action::WebhookRemoved => "webhook_removed",
        }
    }
}

/// Appends `action` by `principal` with what changed. Call it inside the transaction that makes
/// the change, so the fact and the change commit together or not at all.
pub async fn record<C: GenericClient>(
    client: &C,
    action: Action,
    principal: &str,
    details: &serde_json::Value,
) -> Result<(), tokio_postgres::Error> {
    client
        .execute(
            "insert into operator_action (action, principal, details) values ($1, $2, $3)",
            &[&action.as_str(), &principal, details],
        )
        .await?;
    Ok(())
}
