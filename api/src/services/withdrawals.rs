//! `Withdrawals`: request (idempotent per account and external id), read, cancel and approve.
//! Requests go through `custodian_withdrawals::request` exactly as the CLI's do; reads come from
//! the `withdrawal` projection, which is written in the same transaction as every event.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::SystemTime;

use alloy_primitives::U256;
use custodian_domain::withdrawal::WithdrawalState;
use custodian_domain::{Amount, Chain, Nonce};
use custodian_withdrawals::actions;
use custodian_withdrawals::request::{self, Request as WithdrawalRequest};
use deadpool_postgres::GenericClient;
use tokio_postgres::Row;
use tonic::{Request, Response, Status};

use crate::pb::{self, request_withdrawal_request::Amount as WireAmount};
use crate::services::accounts::account_by_id;
use crate::tokens::Scope;
use crate::{status, time, wire, State};

const WITHDRAWAL_BY_ID: &str = "
select w.id, w.account_id, w.external_id, w.asset, a.symbol, a.decimals, w.destination, w.amount, w.state,
       w.lane, w.from_address, w.nonce, w.tx_hash, w.mined_block_hash, w.requested_at, w.updated_at,
       w.stuck_at_cap
  from withdrawal w
  join asset a on a.asset = w.asset
 where w.id = $1";

const WITHDRAWAL_PAGE: &str = "
select w.id, w.account_id, w.external_id, w.asset, a.symbol, a.decimals, w.destination, w.amount, w.state,
       w.lane, w.from_address, w.nonce, w.tx_hash, w.mined_block_hash, w.requested_at, w.updated_at,
       w.stuck_at_cap
  from withdrawal w
  join asset a on a.asset = w.asset
 where ($1::bigint is null or w.account_id = $1)
   and ($2::text is null or w.state = $2)
   and w.id > $3
 order by w.id
 limit $4";

/// Every signed payload of some withdrawals, oldest first per withdrawal. Each id is looked up on
/// its own (`lateral … offset 0`), so the plan is index probes whatever the statistics said when it
/// was made: a generic plan made while the tables were small scans them whole for `= any($1)`.
const ATTEMPTS: &str = "
select a.withdrawal_id, a.tx_hash, a.kind, a.max_fee::text, a.intent, null::text as fee_sat, a.created_at
  from unnest($1::bigint[]) as k (id)
 cross join lateral (select * from withdrawal_attempt a where a.withdrawal_id = k.id offset 0) a
union all
select b.withdrawal_id, b.tx_hash, b.kind, null, case b.kind when 'cancel' then 'cancel' else 'payout' end,
       b.fee::text, b.created_at
  from unnest($1::bigint[]) as k (id)
 cross join lateral (select p.withdrawal_id, a.tx_hash, a.kind, a.fee, a.created_at
                       from btc_spend_payout p join btc_attempt a on a.spend_id = p.spend_id
                      where p.withdrawal_id = k.id offset 0) b
 order by 1, 7, 2";

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

/// A projection row as a message, without its attempts.
fn withdrawal(row: &Row) -> pb::Withdrawal {
    let decimals = u8::try_from(row.get::<_, i16>(5)).expect("BUG: decimals outside 0..=77");
    let amount = Amount::from_units(row.get::<_, U256>(7));
    let state: WithdrawalState = row.get::<_, &str>(8).parse().expect("BUG: withdrawal.state is checked by the table");
    pb::Withdrawal {
        id: row.get(0),
        account_id: row.get(1),
        external_id: row.get(2),
        asset: row.get(3),
        symbol: row.get(4),
        destination: wire::display_address(Chain::Eth, row.get(6)),
        amount: amount.to_string(),
        amount_display: amount.to_decimal_string(decimals),
        state: wire::state_to_pb(state),
        lane: row.get::<_, Option<String>>(9).unwrap_or_default(),
        from_address: row.get::<_, Option<&str>>(10).map(|a| wire::display_address(Chain::Eth, a)),
        nonce: row.get::<_, Option<i64>>(11).map(|n| Nonce::from_stored(n).get()),
        tx_hash: row.get(12),
        mined_block_hash: row.get(13),
        attempts: Vec::new(),
        requested_at: time::format(row.get::<_, SystemTime>(14)),
        updated_at: time::format(row.get::<_, SystemTime>(15)),
        stuck_at_cap: row.get(16),
    }
}

/// Fills in the attempts of `withdrawals`.
async fn with_attempts<C: GenericClient>(client: &C, withdrawals: &mut [pb::Withdrawal]) -> Result<(), Status> {
    let ids: Vec<i64> = withdrawals.iter().map(|w| w.id).collect();
    let rows = client.query(ATTEMPTS, &[&ids]).await.map_err(|e| status::database("reading attempts", &e))?;
    attach(rows, withdrawals);
    Ok(())
}

/// Hands [`ATTEMPTS`]'s rows to their withdrawals.
fn attach(rows: Vec<Row>, withdrawals: &mut [pb::Withdrawal]) {
    let mut by_id: HashMap<i64, Vec<pb::Attempt>> = HashMap::new();
    for row in rows {
        by_id.entry(row.get(0)).or_default().push(pb::Attempt {
            tx_hash: row.get(1),
            kind: row.get(2),
            max_fee_per_gas_wei: row.get::<_, Option<String>>(3).unwrap_or_default(),
            intent: row.get(4),
            fee_sat: row.get::<_, Option<String>>(5).unwrap_or_default(),
        });
    }
    for w in withdrawals {
        w.attempts = by_id.remove(&w.id).unwrap_or_default();
    }
}

/// The withdrawal `id` with its attempts, or `NOT_FOUND`: both reads in one round trip.
async fn load<C: GenericClient>(client: &C, id: i64) -> Result<pb::Withdrawal, Status> {
    let read = async {
        let (by_id, attempts) =
            futures::try_join!(client.prepare_cached(WITHDRAWAL_BY_ID), client.prepare_cached(ATTEMPTS))?;
        let ids = vec![id];
        let (one, many): (
            [&(dyn tokio_postgres::types::ToSql + Sync); 1],
            [&(dyn tokio_postgres::types::ToSql + Sync); 1],
        ) = ([&id], [&ids]);
        futures::try_join!(client.query_opt(&by_id, &one), client.query(&attempts, &many))
    };
    let (row, attempts) = read.await.map_err(|e| status::database("reading the withdrawal", &e))?;
    let row = row.ok_or_else(|| Status::not_found(format!("no withdrawal has id {id}")))?;
    let mut found = [withdrawal(&row)];
    attach(attempts, &mut found);
    let [w] = found;
    Ok(w)
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
        let asset = wire::required(&message.asset, "asset")?;
        let known = {
            let known = self.state.known.lock().expect("BUG: known accounts poisoned");
            (known.accounts.contains(&message.account_id), known.assets.get(asset).cloned())
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
                known.assets.insert(asset.to_owned(), found.clone());
                found
            }
        };
        let (amount, decimals) = amount_input(message.amount.as_ref(), asset_decimals)?;
        let (destination, amount) =
            request::parse(chain, self.state.btc_network, &message.destination, amount, decimals)
                .map_err(status::request)?;
        let parsed = WithdrawalRequest {
            account_id: message.account_id,
            external_id: external_id.to_owned(),
            asset,
            destination,
            amount,
            requested_by: caller.name,
        };
        // Written with the requests of other callers, on a connection of its batch's.
        let outcome = self.state.requests.request(parsed.clone()).await.map_err(status::request)?;
        if outcome.created {
            tracing::info!(id = outcome.withdrawal.id, account = parsed.account_id, "withdrawal requested");
        }
        let withdrawal = load(&self.state.client().await?, outcome.withdrawal.id).await?;
        Ok(Response::new(pb::RequestWithdrawalResponse { withdrawal: Some(withdrawal), created: outcome.created }))
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
        let state = wire::state_filter(message.state)?.map(WithdrawalState::as_str);
        let after = wire::page_after(&message.page_token)?;
        let size = wire::page_size(message.page_size);
        let client = self.state.client().await?;
        let rows = client
            .query(WITHDRAWAL_PAGE, &[&message.account_id, &state, &after, &(size + 1)])
            .await
            .map_err(|e| status::database("listing withdrawals", &e))?;
        let size = usize::try_from(size).expect("BUG: page size is positive");
        let more = rows.len() > size;
        let mut withdrawals: Vec<pb::Withdrawal> = rows.iter().take(size).map(withdrawal).collect();
        with_attempts(&client, &mut withdrawals).await?;
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
