//! `Accounts`: customer accounts, their HD deposit addresses, balances and ledger entries.

use std::sync::Arc;
use std::time::SystemTime;

use alloy_primitives::U256;
use custodian_domain::{Amount, Chain};
use custodian_projections::balances;
use custodian_store::deposit_addresses::{self, DerivedAddress};
use custodian_store::ownership;
use deadpool_postgres::GenericClient;
use tonic::{Request, Response, Status};

use crate::pb::{self, get_account_request::Key};
use crate::tokens::Scope;
use crate::{status, time, wire, State};

const ACCOUNT_BY_ID: &str = "select id, external_ref from account where id = $1";

const ACCOUNT_BY_REF: &str = "select id, external_ref from account where external_ref = $1";

/// One page of an account's postings after a posting id, with the asset's symbol and decimals.
/// The view is `ledger_entries`, the one finance reads.
const LEDGER_PAGE: &str = "
select e.posting_id, e.transfer_id, e.idempotency_key, e.kind, e.reference::text, e.created_at,
       e.ledger_account, e.asset, a.symbol, a.decimals, e.direction, e.amount
  from ledger_entries e
  join asset a on a.asset = e.asset
 where e.ledger_account = 'user:' || $1::bigint
   and ($2::timestamptz is null or e.created_at >= $2)
   and ($3::timestamptz is null or e.created_at < $3)
   and e.posting_id > $4
 order by e.posting_id
 limit $5";

/// The longest account reference accepted.
const MAX_EXTERNAL_REF_LEN: usize = 256;

/// The `Accounts` service.
#[derive(Debug)]
pub(crate) struct AccountsService {
    state: Arc<State>,
}

impl AccountsService {
    pub(crate) fn new(state: Arc<State>) -> Self {
        AccountsService { state }
    }
}

/// The account with `id`, or `NOT_FOUND`.
pub(crate) async fn account_by_id<C: GenericClient>(client: &C, id: i64) -> Result<pb::Account, Status> {
    let read = async { client.query_opt(&client.prepare_cached(ACCOUNT_BY_ID).await?, &[&id]).await };
    let row = read
        .await
        .map_err(|e| status::database("reading the account", &e))?
        .ok_or_else(|| Status::not_found(format!("no account has id {id}")))?;
    Ok(pb::Account { id: row.get(0), external_ref: row.get(1) })
}

fn deposit_address(derived: DerivedAddress) -> pb::DepositAddress {
    pb::DepositAddress {
        chain: wire::chain_to_pb(derived.chain),
        address: derived.address.to_string(),
        derivation_index: derived.derivation_index,
        account_id: derived.account_id,
        valid_from_height: derived.valid_from_height,
        valid_to_height: derived.valid_to_height,
    }
}

/// Decimals of an asset key from the `asset` table.
async fn decimals<C: GenericClient>(client: &C, asset: &str) -> Result<u8, Status> {
    ownership::asset_info(client, asset)
        .await
        .map_err(|e| status::database("reading the asset", &e))?
        .map(|(_, decimals)| decimals)
        .ok_or_else(|| Status::internal(format!("asset {asset} has a balance but is not registered")))
}

#[tonic::async_trait]
impl pb::accounts_server::Accounts for AccountsService {
    async fn create_account(
        &self,
        request: Request<pb::CreateAccountRequest>,
    ) -> Result<Response<pb::CreateAccountResponse>, Status> {
        self.state.auth.authorize(&request, Scope::Withdraw, "CreateAccount").await?;
        let external_ref = wire::required(&request.get_ref().external_ref, "external_ref")?;
        if external_ref.len() > MAX_EXTERNAL_REF_LEN {
            return Err(Status::invalid_argument(format!(
                "external_ref is {} bytes long; at most {MAX_EXTERNAL_REF_LEN} are accepted",
                external_ref.len()
            )));
        }
        let client = self.state.client().await?;
        let (account, created) = ownership::create_account(&client, external_ref).await.map_err(status::ownership)?;
        Ok(Response::new(pb::CreateAccountResponse {
            account: Some(pb::Account { id: account.id, external_ref: account.external_ref }),
            created,
        }))
    }

    async fn get_account(&self, request: Request<pb::GetAccountRequest>) -> Result<Response<pb::Account>, Status> {
        self.state.auth.authorize(&request, Scope::Read, "GetAccount").await?;
        let client = self.state.client().await?;
        let account = match &request.get_ref().key {
            Some(Key::Id(id)) => account_by_id(&client, *id).await?,
            Some(Key::ExternalRef(external_ref)) => {
                let row = client
                    .query_opt(ACCOUNT_BY_REF, &[external_ref])
                    .await
                    .map_err(|e| status::database("reading the account", &e))?
                    .ok_or_else(|| Status::not_found(format!("no account has external_ref {external_ref:?}")))?;
                pb::Account { id: row.get(0), external_ref: row.get(1) }
            }
            None => return Err(Status::invalid_argument("give the account's id or its external_ref")),
        };
        Ok(Response::new(account))
    }

    async fn new_deposit_address(
        &self,
        request: Request<pb::NewDepositAddressRequest>,
    ) -> Result<Response<pb::DepositAddress>, Status> {
        self.state.auth.authorize(&request, Scope::Withdraw, "NewDepositAddress").await?;
        let message = request.get_ref();
        let chain = wire::chain(message.chain, "chain")?;
        let key = self.state.deposit_keys.get(&chain).ok_or_else(|| {
            Status::failed_precondition(format!(
                "no deposit key is configured for {chain}: an operator must configure the chain's \
                 account-level extended public key before {chain} deposit addresses can be derived"
            ))
        })?;
        let mut client = self.state.client().await?;
        let derived = deposit_addresses::new_address(&mut client, key, message.account_id)
            .await
            .map_err(status::deposit_address)?;
        tracing::info!(account = derived.account_id, %chain, index = derived.derivation_index, "deposit address derived");
        Ok(Response::new(deposit_address(derived)))
    }

    async fn list_deposit_addresses(
        &self,
        request: Request<pb::ListDepositAddressesRequest>,
    ) -> Result<Response<pb::ListDepositAddressesResponse>, Status> {
        self.state.auth.authorize(&request, Scope::Read, "ListDepositAddresses").await?;
        let message = request.get_ref();
        let chain: Option<Chain> = wire::optional_chain(message.chain, "chain")?;
        let client = self.state.client().await?;
        account_by_id(&client, message.account_id).await?;
        let addresses = deposit_addresses::list(&client, message.account_id)
            .await
            .map_err(|e| status::database("listing deposit addresses", &e))?
            .into_iter()
            .filter(|a| chain.is_none_or(|c| a.chain == c))
            .map(deposit_address)
            .collect();
        Ok(Response::new(pb::ListDepositAddressesResponse { addresses }))
    }

    async fn get_balances(
        &self,
        request: Request<pb::GetBalancesRequest>,
    ) -> Result<Response<pb::GetBalancesResponse>, Status> {
        self.state.auth.authorize(&request, Scope::Read, "GetBalances").await?;
        let client = self.state.client().await?;
        let account = account_by_id(&client, request.get_ref().account_id).await?;
        let rows = balances::for_account(&client, account.id, &account.external_ref)
            .await
            .map_err(|e| status::database("reading balances", &e))?;
        let mut out = Vec::with_capacity(rows.len());
        for b in rows {
            out.push(pb::Balance {
                decimals: u32::from(decimals(&client, &b.asset).await?),
                asset: b.asset,
                symbol: b.symbol,
                confirmed: b.confirmed,
                pending: b.pending,
                held: b.held,
                available: b.available,
                confirmed_display: b.display.confirmed,
                pending_display: b.display.pending,
                held_display: b.display.held,
                available_display: b.display.available,
                pending_deposits: b
                    .pending_deposits
                    .into_iter()
                    .map(|p| pb::PendingDeposit {
                        tx_hash: p.tx_hash,
                        output_index: p.output_index,
                        amount: p.amount,
                        confirmations: p.confirmations,
                        required_confirmations: p.required_confirmations,
                    })
                    .collect(),
            });
        }
        Ok(Response::new(pb::GetBalancesResponse { account: Some(account), balances: out }))
    }

    async fn list_ledger_entries(
        &self,
        request: Request<pb::ListLedgerEntriesRequest>,
    ) -> Result<Response<pb::ListLedgerEntriesResponse>, Status> {
        self.state.auth.authorize(&request, Scope::Read, "ListLedgerEntries").await?;
        let message = request.get_ref();
        let from: Option<SystemTime> = wire::time_filter(&message.from_time, "from_time")?;
        let to: Option<SystemTime> = wire::time_filter(&message.to_time, "to_time")?;
        if let (Some(from), Some(to)) = (from, to) {
            if to < from {
                return Err(Status::invalid_argument(format!(
                    "to_time {:?} is before from_time {:?}",
                    message.to_time, message.from_time
                )));
            }
        }
        let after = wire::page_after(&message.page_token)?;
        let size = wire::page_size(message.page_size);
        let client = self.state.client().await?;
        account_by_id(&client, message.account_id).await?;
        let rows = client
            .query(LEDGER_PAGE, &[&message.account_id, &from, &to, &after, &(size + 1)])
            .await
            .map_err(|e| status::database("reading ledger entries", &e))?;
        let more = rows.len() > usize::try_from(size).expect("BUG: page size is positive");
        let entries: Vec<pb::LedgerEntry> = rows
            .iter()
            .take(usize::try_from(size).expect("BUG: page size is positive"))
            .map(|r| {
                let decimals = u8::try_from(r.get::<_, i16>(9)).expect("BUG: decimals outside 0..=77");
                let amount = Amount::from_units(r.get::<_, U256>(11));
                pb::LedgerEntry {
                    posting_id: r.get(0),
                    transfer_id: r.get(1),
                    idempotency_key: r.get(2),
                    kind: r.get(3),
                    reference_json: r.get(4),
                    created_at: time::format(r.get(5)),
                    ledger_account: r.get(6),
                    asset: r.get(7),
                    symbol: r.get(8),
                    direction: wire::direction_to_pb(r.get(10)),
                    amount: amount.to_string(),
                    amount_display: amount.to_decimal_string(decimals),
                }
            })
            .collect();
        let next_page_token = wire::next_page_token(more, entries.last().map(|e| e.posting_id));
        Ok(Response::new(pb::ListLedgerEntriesResponse { entries, next_page_token }))
    }
}
