//! `Withdrawals`: request (idempotent per account and external id), read, cancel and approve.
//! Requests go through `custodian_withdrawals::request` exactly as the CLI's do; reads go through
//! `custodian_withdrawals::listing`, as the CLI's do.

use std::sync::Arc;

use custodian_domain::{AccountId, ExternalId, Nonce};
use custodian_withdrawals::actions;
use custodian_withdrawals::listing::{self, Listed};
use custodian_withdrawals::request::{self, Request as WithdrawalRequest};
use deadpool_postgres::GenericClient;
use tonic::{Request, Response, Status};

use crate::pb::{self, request_withdrawal_request::Amount as WireAmount};
use crate::services::accounts::account_by_id;
use crate::tokens::Scope;
use crate::{status, time, wire, State};

/// The `Withdrawals` service.
#[derive(Debug)]
pub(crate) struct WithdrawalsService {
    state: Arc<State>,
}

impl WithdrawalsService {
    pub(crate) fn new(state: Arc<State>) -> Self {
        WithdrawalsService { state }
    }
}

/// A listed withdrawal as a message.
fn withdrawal(listed: Listed) -> pb::Withdrawal {
    let Listed { withdrawal: w, symbol, decimals, requested_at, updated_at, attempts } = listed;
    pb::Withdrawal {
        id: w.id().get(),
        account_id: Some(w.account_id().get()),
        external_id: w.external_id().to_string(),
        asset: w.asset().key(),
        symbol,
        destination: w.destination().to_string(),
        amount: w.amount().to_string(),
        amount_display: w.amount().to_decimal_string(decimals),
        state: wire::state_to_pb(w.state()),
        lane: w.lane().to_string(),
        from_address: w.from_address().map(ToString::to_string),
        nonce: w.nonce().map(Nonce::get),
        tx_hash: w.tx_hash().map(|h| h.to_string()),
        mined_block_hash: w.mined_block_hash().map(|h| h.to_string()),
        attempts: attempts
            .into_iter()
            .map(|a| pb::Attempt {
                tx_hash: a.tx_hash,
                kind: a.kind.as_str().to_owned(),
                max_fee_per_gas_wei: a.max_fee_per_gas_wei.map(|f| f.to_string()).unwrap_or_default(),
                intent: a.intent.as_str().to_owned(),
                fee_sat: a.fee_sat.map(|f| f.to_string()).unwrap_or_default(),
            })
            .collect(),
        requested_at: time::format(requested_at),
        updated_at: time::format(updated_at),
        stuck_at_cap: w.stuck_at_cap(),
    }
}

/// The withdrawal `id` with its attempts, or `NOT_FOUND`.
async fn load<C: GenericClient>(client: &C, id: i64) -> Result<pb::Withdrawal, Status> {
    listing::one(client, id)
        .await
        .map_err(|e| status::database("reading the withdrawal", &e))?
        .map(withdrawal)
        .ok_or_else(|| Status::not_found(format!("no withdrawal has id {id}")))
}

/// The amount text and the decimals to read it with: whole units with the asset's decimals, or
/// smallest units as an integer.
fn amount_input(amount: Option<&WireAmount>, asset_decimals: u8) -> Result<(&str, u8), Status> {
    match amount {
        Some(WireAmount::AmountDecimal(text)) => Ok((text, asset_decimals)),
        Some(WireAmount::AmountUnits(text)) => {
            let digits = text.trim();
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                return Err(Status::invalid_argument(format!(
                    "amount_units {text:?} must be a whole number of the asset's smallest unit \
                     (use amount_decimal for an amount in whole units such as \"1.5\")"
                )));
            }
            Ok((digits, 0))
        }
        None => Err(Status::invalid_argument("an amount is required: set amount_units or amount_decimal")),
    }
}

#[tonic::async_trait]
impl pb::withdrawals_server::Withdrawals for WithdrawalsService {
    async fn request_withdrawal(
        &self,
        request: Request<pb::RequestWithdrawalRequest>,
    ) -> Result<Response<pb::RequestWithdrawalResponse>, Status> {
        let caller = self.state.auth.authorize(&request, Scope::Withdraw, "RequestWithdrawal").await?;
        let message = request.get_ref();
        let external_id = wire::required(&message.external_id, "external_id")?;
        let external_id = ExternalId::parse(external_id).map_err(|e| Status::invalid_argument(e.to_string()))?;
        let asset = wire::required(&message.asset, "asset")?;
        let known = {
            let known = self.state.known.lock().expect("BUG: known accounts poisoned");
            (known.accounts.contains(&message.account_id), known.assets.get(asset).copied())
        };
        let (asset, asset_decimals, chain) = match known {
            (true, Some(found)) => found,
            (_, cached) => {
                // One round trip for both.
                let client = self.state.client().await?;
                let (_, found) = futures::try_join!(account_by_id(&client, message.account_id), async {
                    match cached {
                        Some(found) => Ok(Some(found)),
                        None => request::find_asset(&client, asset)
                            .await
                            .map_err(|e| status::database("resolving the asset", &e)),
                    }
                })?;
                let found = found.ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "unknown asset {asset:?}: withdrawals pay out ETH, registered ERC-20 tokens and BTC, \
                         named by symbol or key"
                    ))
                })?;
                let mut known = self.state.known.lock().expect("BUG: known accounts poisoned");
                if known.accounts.len() >= crate::KNOWN_MAX || known.assets.len() >= crate::KNOWN_MAX {
                    *known = crate::Known::default();
                }
                known.accounts.insert(message.account_id);
                known.assets.insert(asset.to_owned(), found);
                found
            }
        };
        let (amount, decimals) = amount_input(message.amount.as_ref(), asset_decimals)?;
        let (destination, amount) =
            request::parse(chain, self.state.btc_network, &message.destination, amount, decimals)
                .map_err(status::request)?;
        let parsed = WithdrawalRequest {
            account_id: AccountId::new(message.account_id),
            external_id,
            asset,
            destination,
            amount,
            requested_by: caller.name,
        };
        // Written with the requests of other callers, on a connection of its batch's.
        let outcome = self.state.requests.request(parsed.clone()).await.map_err(status::request)?;
        if outcome.created {
            tracing::info!(id = %outcome.listed.withdrawal.id(), account = %parsed.account_id, "withdrawal requested");
        }
        let created = outcome.created;
        let withdrawal = withdrawal(outcome.listed);
        Ok(Response::new(pb::RequestWithdrawalResponse { withdrawal: Some(withdrawal), created }))
    }

    async fn get_withdrawal(
        &self,
        request: Request<pb::GetWithdrawalRequest>,
    ) -> Result<Response<pb::Withdrawal>, Status> {
        self.state.auth.authorize(&request, Scope::Read, "GetWithdrawal").await?;
        let client = self.state.client().await?;
        Ok(Response::new(load(&client, request.get_ref().id).await?))
    }

    async fn list_withdrawals(
        &self,
        request: Request<pb::ListWithdrawalsRequest>,
    ) -> Result<Response<pb::ListWithdrawalsResponse>, Status> {
        self.state.auth.authorize(&request, Scope::Read, "ListWithdrawals").await?;
        let message = request.get_ref();
        let filter = listing::Filter {
            account_id: message.account_id,
            state: wire::state_filter(message.state)?,
            after: wire::page_after(&message.page_token)?,
            limit: wire::page_size(message.page_size),
        };
        let client = self.state.client().await?;
        let (page, more) =
            listing::page(&client, &filter).await.map_err(|e| status::database("listing withdrawals", &e))?;
        let withdrawals: Vec<pb::Withdrawal> = page.into_iter().map(withdrawal).collect();
        let next_page_token = wire::next_page_token(more, withdrawals.last().map(|w| w.id));
        Ok(Response::new(pb::ListWithdrawalsResponse { withdrawals, next_page_token }))
    }

    async fn cancel_withdrawal(
        &self,
        request: Request<pb::CancelWithdrawalRequest>,
    ) -> Result<Response<pb::Withdrawal>, Status> {
        let caller = self.state.auth.authorize(&request, Scope::Withdraw, "CancelWithdrawal").await?;
        let id = request.get_ref().id;
        let mut client = self.state.client().await?;
        let by = caller.name;
        let (_, recorded) = actions::cancel(&mut client, id, &by).await.map_err(status::action)?;
        if recorded {
            tracing::info!(id, by, "withdrawal cancel recorded");
        }
        Ok(Response::new(load(&client, id).await?))
    }

    async fn approve_withdrawal(
        &self,
        request: Request<pb::ApproveWithdrawalRequest>,
    ) -> Result<Response<pb::Withdrawal>, Status> {
        // The approver is the authenticated principal, never a name the caller types.
        let caller = self.state.auth.authorize(&request, Scope::Approve, "ApproveWithdrawal").await?;
        let message = request.get_ref();
        let mut client = self.state.client().await?;
        let (_, recorded) = actions::approve(&mut client, message.id, &caller.name).await.map_err(status::action)?;
        if recorded {
            tracing::info!(id = message.id, by = caller.name, "withdrawal approval recorded");
        }
        Ok(Response::new(load(&client, message.id).await?))
    }
}
