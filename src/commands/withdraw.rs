//! `custodian hot-wallet`, `withdraw`, `withdrawals`, `cancel` and `work`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use custodian_api::tokens::Scope;
use custodian_domain::{AccountId, Amount, Asset, BtcAddress, Chain, EthAddress, ExternalId, LaneName};
use custodian_service::{keys, Service};
use custodian_store::btc_rpc::BtcRpc;
use custodian_store::ownership;
use custodian_withdrawals::actions::{self, ActionError};
use custodian_withdrawals::btc::node::BtcNode;
use custodian_withdrawals::btc::tx::FeeRate;
use custodian_withdrawals::btc::{BtcConfig, BtcWorker};
use custodian_withdrawals::hot_wallet::{self, HotWalletError};
use custodian_withdrawals::limits::{self, LimitChange, LimitError};
use custodian_withdrawals::listing;
use custodian_withdrawals::request::{self, Request, RequestError};
use custodian_withdrawals::{EthNode, LocalSigner, Signer, Worker, WorkerConfig};
use serde_json::json;

use crate::exit::{invalid, Exit};
use crate::settings::Settings;

fn node(settings: &Settings) -> Result<EthNode> {
    let url = settings
        .eth_rpc
        .as_deref()
        .ok_or_else(|| invalid("no Ethereum node: set --eth-rpc or CUSTODIAN_ETH_RPC_URL"))?;
    EthNode::with_timeout(url, settings.eth_rpc_timeout).map_err(|e| invalid(e.to_string()))
}

fn hot_wallet_error(e: HotWalletError) -> anyhow::Error {
    match e {
        HotWalletError::Database(e) => anyhow::Error::new(e).context("database error"),
        HotWalletError::Node(e) => anyhow::Error::new(e).context("asking the node for the pending nonce"),
        refusal => invalid(refusal.to_string()),
    }
}

fn action_error(e: ActionError) -> anyhow::Error {
    match e {
        refusal if refusal.is_refusal() => invalid(refusal.to_string()),
        failure => anyhow::Error::new(failure),
    }
}

fn limit_error(e: LimitError) -> anyhow::Error {
    match e {
        LimitError::Database(e) => anyhow::Error::new(e).context("setting the limits"),
        refusal => invalid(refusal.to_string()),
    }
}

/// `lane`, or `lane<N>` for the next free N.
fn lane_name(lane: Option<&str>, existing: usize) -> Result<String> {
    match lane {
        Some(lane) => Ok(LaneName::parse(lane).map_err(|e| invalid(e.to_string()))?.to_string()),
        None => Ok(format!("lane{}", existing + 1)),
    }
}

/// `hot-wallet add --chain btc`: an account-level BIP-84 extended private key from an owner-only
/// file; its funding address is watched from the node's next block.
async fn btc_hot_wallet_add(settings: &Settings, key_file: &Path, lane: Option<&str>) -> Result<Exit> {
    let key = custodian_withdrawals::btc_key::BtcHotKey::from_file(key_file, settings.btc_network)
        .map_err(|e| invalid(e.to_string()))?;
    let url = settings
        .btc_rpc
        .as_deref()
        .ok_or_else(|| invalid("no Bitcoin node: set --btc-rpc or CUSTODIAN_BTC_RPC_URL"))?;
    let tip = {
        use custodian_ingest::ChainReader;
        custodian_ingest::btc::BtcReader::new(url, settings.btc_auth.clone(), settings.btc_network)
            .map_err(|e| invalid(e.to_string()))?
            .tip_height()
            .await
            .context("reading the Bitcoin node's tip")?
    };
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let by = super::principal(settings, &client, Scope::Admin, "hot-wallet add").await?;
    let lane = lane_name(lane, hot_wallet::btc_lanes(&client).await?.len())?;
    let (registered, created) =
        hot_wallet::add_btc(&mut client, &key, &lane, tip, &by).await.map_err(hot_wallet_error)?;
    if settings.json {
        super::print_json(&json!({ "lane": registered, "created": created }))?;
    } else {
        println!(
            "BTC lane {} funds from {} (watched from block {}){}",
            registered.lane,
            registered.funding_address,
            tip + 1,
            if created { "" } else { " (already registered)" }
        );
    }
    Ok(Exit::Success)
}

pub async fn hot_wallet_add(settings: &Settings, chain: Chain, key_file: &Path, lane: Option<&str>) -> Result<Exit> {
    if chain == Chain::Btc {
        return btc_hot_wallet_add(settings, key_file, lane).await;
    }
    let signer = LocalSigner::from_file(key_file).map_err(|e| invalid(e.to_string()))?;
    let address = EthAddress::from_alloy(signer.address());
    drop(signer);
    let node = node(settings)?;
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let by = super::principal(settings, &client, Scope::Admin, "hot-wallet add").await?;
    let lane = lane_name(lane, hot_wallet::lanes(&client).await?.len())?;
    let (registered, created) =
        hot_wallet::add(&mut client, &node, &lane, address, &by).await.map_err(hot_wallet_error)?;
    if settings.json {
        super::print_json(&json!({ "lane": registered, "created": created }))?;
    } else {
        println!(
            "lane {} is {} with next nonce {}{}",
            registered.lane,
            registered.address.to_lowercase_hex(),
            registered.next_nonce,
            if created { "" } else { " (already registered)" }
        );
    }
    Ok(Exit::Success)
}

pub async fn pause(settings: &Settings, lane: &str, reason: Option<&str>) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let call = if reason.is_some() { "hot-wallet pause" } else { "hot-wallet resume" };
    let by = super::principal(settings, &client, Scope::Admin, call).await?;
    hot_wallet::set_paused(&mut client, lane, reason, &by).await.map_err(hot_wallet_error)?;
    if settings.json {
        super::print_json(&json!({ "lane": lane, "paused": reason.is_some(), "reason": reason }))?;
    } else {
        println!("lane {lane} {}", if reason.is_some() { "paused" } else { "resumed" });
    }
    Ok(Exit::Success)
}

pub async fn resync(settings: &Settings, lane: &str) -> Result<Exit> {
    let node = node(settings)?;
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let by = super::principal(settings, &client, Scope::Admin, "hot-wallet resync").await?;
    let done = hot_wallet::resync(&mut client, &node, lane, &by).await.map_err(hot_wallet_error)?;
    if settings.json {
        super::print_json(&done)?;
    } else {
        println!(
            "lane {lane}: chain nonce {}, ours {}; the cursor moved from {} to {} (recorded); resume it when ready",
            done.chain_nonce, done.local_next, done.previous_next_nonce, done.next_nonce
        );
    }
    Ok(Exit::Success)
}

pub async fn rebalance(
    settings: &Settings,
    chain: Chain,
    from: &str,
    to: &str,
    amount: &str,
    asset: &str,
    external_id: Option<&str>,
) -> Result<Exit> {
    if chain != Chain::Eth {
        return Err(invalid("hot wallets are ETH lanes; BTC withdrawals are not supported"));
    }
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let by = super::principal(settings, &client, Scope::Admin, "hot-wallet rebalance").await?;
    let (asset, decimals, _) = resolve_asset(&client, asset).await?;
    let amount = Amount::parse_decimal(amount, decimals).map_err(|e| invalid(format!("--amount: {e}")))?;
    let external_id = external_id.map_or_else(
        || {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
            format!("rebalance-{}", nanos.as_nanos())
        },
        str::to_owned,
    );
    let external_id = ExternalId::parse(&external_id).map_err(|e| invalid(format!("--external-id: {e}")))?;
    let r = request::Rebalance {
        from_lane: from.to_owned(),
        to_lane: to.to_owned(),
        asset,
        amount,
        external_id,
        requested_by: by,
    };
    let outcome = match request::rebalance(&mut client, &r).await {
        Ok(outcome) => outcome,
        Err(RequestError::Database(e)) => return Err(anyhow::Error::new(e).context("recording the rebalance")),
        Err(refusal) => return Err(invalid(refusal.to_string())),
    };
    if settings.json {
        super::print_json(&json!({ "withdrawal": outcome.withdrawal, "created": outcome.created }))?;
    } else {
        println!(
            "rebalance {} ({}): {} of {asset} from lane {from} to lane {to} ({}), {}",
            outcome.withdrawal.id(),
            outcome.withdrawal.external_id(),
            amount.to_decimal_string(decimals),
            outcome.withdrawal.destination(),
            if outcome.created { "requested" } else { "already requested" }
        );
    }
    Ok(Exit::Success)
}

pub async fn retire(settings: &Settings, lane: &str) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let by = super::principal(settings, &client, Scope::Admin, "hot-wallet retire").await?;
    let now = hot_wallet::retire(&mut client, lane, &by).await.map_err(hot_wallet_error)?;
    if settings.json {
        super::print_json(&json!({ "lane": lane, "retired": true, "retired_now": now }))?;
    } else if now {
        println!("lane {lane} retired: new withdrawals go to the other lanes; its in-flight ones finish");
    } else {
        println!("lane {lane} was already retired; nothing changed");
    }
    Ok(Exit::Success)
}

pub async fn rebroadcast(settings: &Settings, id: i64) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let client = pool.get().await?;
    super::principal(settings, &client, Scope::Admin, "withdrawals rebroadcast").await?;
    let btc = client.query_opt("select 1 from withdrawal where id = $1 and chain = 'btc'", &[&id]).await?.is_some();
    let hash = if btc {
        let node = btc_node(settings, &format!("withdrawal {id} is a BTC one"))?;
        actions::rebroadcast_btc(&client, &node, id).await.map_err(action_error)?
    } else {
        actions::rebroadcast(&client, &node(settings)?, id).await.map_err(action_error)?
    };
    if settings.json {
        super::print_json(&json!({ "withdrawal_id": id, "tx_hash": hash }))?;
    } else {
        println!("withdrawal {id}: sent {hash} again; once it is mined and buried, resolve it --paid-by {hash}");
    }
    Ok(Exit::Success)
}

pub async fn resolve(settings: &Settings, id: i64, paid_by: Option<&str>, depth: Option<u64>) -> Result<Exit> {
    let confirmations =
        depth.or(settings.file.withdrawals.confirmations).unwrap_or(WorkerConfig::default().confirmations);
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let by = super::principal(settings, &client, Scope::Admin, "withdrawals resolve").await?;
    let resolution = match paid_by {
        Some(hash) => actions::Resolution::PaidBy(hash.to_owned()),
        None => actions::Resolution::NotPaid,
    };
    let btc = client.query_opt("select 1 from withdrawal where id = $1 and chain = 'btc'", &[&id]).await?.is_some();
    let done = if btc {
        let confirmations = depth.or(settings.file.btc.confirmations).unwrap_or(BtcConfig::default().confirmations);
        actions::resolve_btc(&mut client, id, &resolution, confirmations, &by).await.map_err(action_error)?
    } else {
        let node = node(settings)?;
        actions::resolve(&mut client, &node, id, &resolution, confirmations, &by).await.map_err(action_error)?
    };
    if settings.json {
        super::print_json(&done)?;
    } else if done.paid {
        println!(
            "withdrawal {id} resolved by {by} as paid by {}: settled, fee {} wei",
            paid_by.unwrap_or(""),
            done.fee
        );
    } else {
        println!("withdrawal {id} resolved by {by} as not paid: the hold is released");
    }
    Ok(Exit::Success)
}

pub async fn lanes(settings: &Settings) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let client = pool.get().await?;
    let lanes = hot_wallet::lanes(&client).await?;
    let btc = hot_wallet::btc_lanes(&client).await?;
    if settings.json {
        // ETH lanes as before (an array); BTC lanes, when any, after them with their balances.
        if btc.is_empty() {
            return super::print_json(&lanes).map(|()| Exit::Success);
        }
        let mut all: Vec<serde_json::Value> = lanes
            .iter()
            .map(|l| {
                let mut v = serde_json::to_value(l).expect("BUG: a lane serialises");
                v["chain"] = json!("eth");
                v
            })
            .collect();
        all.extend(btc.iter().map(|l| {
            let mut v = serde_json::to_value(l).expect("BUG: a lane serialises");
            v["chain"] = json!("btc");
            v
        }));
        return super::print_json(&all).map(|()| Exit::Success);
    }
    for l in &btc {
        let mut status = l.pause_reason.as_deref().map_or("running".to_owned(), |r| format!("PAUSED: {r}"));
        if let Some(short) = &l.shortage {
            status.push_str(&format!("; SHORT: {short}"));
        }
        println!(
            "{:<10} btc {} spendable {} sat, reserved {} sat, unconfirmed {} sat in {} coins {status}",
            l.lane, l.funding_address, l.spendable, l.reserved, l.unconfirmed, l.coins,
        );
    }
    for l in &lanes {
        let mut status = l.pause_reason.as_deref().map_or("running".to_owned(), |r| format!("PAUSED: {r}"));
        if let Some(short) = &l.shortage {
            status.push_str(&format!("; SHORT of {short}"));
        }
        if l.retired {
            status.push_str("; retired (takes no new withdrawals)");
        }
        println!("{:<10} {} next nonce {:<6} {status}", l.lane, l.address.to_lowercase_hex(), l.next_nonce);
    }
    Ok(Exit::Success)
}

async fn resolve_asset(client: &deadpool_postgres::Object, asset: &str) -> Result<(Asset, u8, Chain)> {
    request::find_asset(client, asset).await?.ok_or_else(|| {
        invalid(format!("unknown asset {asset:?} (withdrawals pay out ETH, registered ERC-20 tokens and BTC)"))
    })
}

pub async fn request(
    settings: &Settings,
    account: &str,
    asset: &str,
    to: &str,
    amount: &str,
    external_id: &str,
) -> Result<Exit> {
    let external_id = ExternalId::parse(external_id).map_err(|e| invalid(format!("--external-id: {e}")))?;
    let pool = super::pool(settings).await?;
    let client = pool.get().await?;
    let requested_by = super::principal(settings, &client, Scope::Withdraw, "withdraw").await?;
    let account = ownership::find_account(&client, account).await.map_err(|e| invalid(e.to_string()))?;
    let (asset, decimals, chain) = resolve_asset(&client, asset).await?;
    let (destination, amount) =
        request::parse(chain, settings.btc_network, to, amount, decimals).map_err(|e| invalid(e.to_string()))?;
    let r = Request { account_id: AccountId::new(account.id), external_id, asset, destination, amount, requested_by };
    drop(client);
    let outcome = match request::request(&pool, &r).await {
        Ok(outcome) => outcome,
        Err(refusal) if refusal.is_refusal() => return Err(invalid(refusal.to_string())),
        Err(e) => return Err(anyhow::Error::new(e).context("recording the withdrawal")),
    };
    let w = &outcome.withdrawal;
    if settings.json {
        super::print_json(&json!({ "withdrawal": w, "created": outcome.created }))?;
    } else {
        println!(
            "withdrawal {} {} ({} {} to {} on lane {}){}",
            w.id(),
            w.state().as_str(),
            w.amount().to_decimal_string(decimals),
            r.asset,
            w.destination(),
            w.lane(),
            if outcome.created { "" } else { " — returned the earlier request with this external id" }
        );
    }
    Ok(Exit::Success)
}

pub async fn approve(settings: &Settings, id: i64) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let by = super::principal(settings, &client, Scope::Approve, "withdrawals approve").await?;
    let (w, recorded) = actions::approve(&mut client, id, &by).await.map_err(action_error)?;
    if settings.json {
        super::print_json(&json!({ "withdrawal": w, "recorded_now": recorded }))?;
    } else {
        let waiting = usize::try_from(w.approvals_required()).unwrap_or(usize::MAX).saturating_sub(w.approvers().len());
        let outcome = match (recorded, w.state()) {
            (false, _) => format!("was already approved by {by}; nothing changed"),
            (true, custodian_domain::withdrawal::WithdrawalState::AwaitingApproval) => {
                format!("approved by {by}; waiting for {waiting} more approver(s)")
            }
            (true, _) => format!("approved by {by}; it proceeds ({})", w.approvers().join(", ")),
        };
        println!("withdrawal {id} {outcome}");
    }
    Ok(Exit::Success)
}

/// `Some("none")` removes a limit, another value sets it, `None` leaves it.
fn limit_value(value: Option<&str>, decimals: u8, flag: &str) -> Result<Option<Option<alloy_primitives::U256>>> {
    match value.map(str::trim) {
        None => Ok(None),
        Some("none") => Ok(Some(None)),
        Some(amount) => Ok(Some(Some(
            Amount::parse_decimal(amount, decimals).map_err(|e| invalid(format!("{flag}: {e}")))?.units(),
        ))),
    }
}

pub async fn limit(
    settings: &Settings,
    asset: &str,
    amount: Option<&str>,
    approvals: Option<u32>,
    daily: Option<&str>,
) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let by = super::principal(settings, &client, Scope::Admin, "withdrawals limit").await?;
    let (asset, decimals, _) = resolve_asset(&client, asset).await?;
    let change = LimitChange {
        approval_limit: limit_value(amount, decimals, "--amount")?,
        approvals_required: approvals,
        daily_limit: limit_value(daily, decimals, "--daily")?,
    };
    let limits = limits::set(&mut client, &asset.key(), &change, &by).await.map_err(limit_error)?;
    let show = |v: Option<alloy_primitives::U256>| v.map(|v| Amount::from_units(v).to_decimal_string(decimals));
    if settings.json {
        super::print_json(&json!({
            "asset": asset,
            "approval_limit": show(limits.approval_limit),
            "approvals_required": limits.approvals_required,
            "daily_limit": show(limits.daily_limit),
            "set_by": by,
        }))?;
    } else {
        println!(
            "{asset}: above {} a withdrawal needs {} approver(s); daily limit per account {} (set by {by})",
            show(limits.approval_limit).unwrap_or_else(|| "no limit".to_owned()),
            limits.approvals_required,
            show(limits.daily_limit).unwrap_or_else(|| "none".to_owned()),
        );
    }
    Ok(Exit::Success)
}

pub async fn cancel(settings: &Settings, id: i64) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let by = super::principal(settings, &client, Scope::Withdraw, "cancel").await?;
    let (w, recorded) = actions::cancel(&mut client, id, &by).await.map_err(action_error)?;
    if settings.json {
        super::print_json(&json!({ "withdrawal": w, "recorded_now": recorded }))?;
    } else {
        println!("withdrawal {id} is {}", w.state().as_str());
    }
    Ok(Exit::Success)
}

/// The withdrawals, oldest first, a page at a time: a full page says on stderr where the next one
/// starts (`--after`), so nothing is cut off silently. Each with its attempts (ETH's signed
/// payloads, or the BTC transactions of its spend).
pub async fn list(
    settings: &Settings,
    id: Option<i64>,
    state: Option<&str>,
    after: Option<i64>,
    limit: i64,
) -> Result<Exit> {
    let state = state.map(str::parse::<custodian_domain::withdrawal::WithdrawalState>).transpose().map_err(invalid)?;
    let pool = super::pool(settings).await?;
    let client = pool.get().await?;
    let (listed, more) = match id {
        Some(id) => (listing::one(&client, id).await?.into_iter().collect(), false),
        None => {
            let filter = listing::Filter { account_id: None, state, after: after.unwrap_or(0), limit };
            listing::page(&client, &filter).await?
        }
    };
    let last = listed.last().map(|l| l.withdrawal.id());
    let out: Vec<serde_json::Value> =
        listed.iter().map(|l| json!({ "withdrawal": l.withdrawal, "attempts": l.attempts })).collect();
    if id.is_some() && out.is_empty() {
        return Err(invalid(format!("no withdrawal {}", id.unwrap_or_default())));
    }
    if let (true, Some(last)) = (more, last) {
        eprintln!("{limit} withdrawals shown; the next page: --after {last}");
    }
    if settings.json {
        return super::print_json(&out).map(|()| Exit::Success);
    }
    for entry in &out {
        let w = &entry["withdrawal"];
        println!(
            "#{} {}{} {} {} -> {} lane {} nonce {}",
            w["id"],
            w["state"],
            if w["stuck_at_cap"] == true { " (STUCK AT THE FEE CAP)" } else { "" },
            w["amount"],
            w["asset"],
            w["destination"],
            w["lane"],
            w["nonce"]
        );
        for a in entry["attempts"].as_array().into_iter().flatten() {
            println!("    {} {} {}", a["kind"], a["intent"], a["tx_hash"]);
        }
    }
    Ok(Exit::Success)
}

/// The worker's configuration: flags, then `[withdrawals]` in the file, then defaults.
pub fn worker_config(settings: &Settings, args: &crate::cli::WorkerArgs) -> WorkerConfig {
    let file = &settings.file.withdrawals;
    let defaults = WorkerConfig::default();
    let gwei = args.max_fee_gwei.or(file.max_fee_gwei);
    WorkerConfig {
        confirmations: args.confirmations.or(file.confirmations).unwrap_or(defaults.confirmations),
        bump_after_blocks: args.bump_after_blocks.or(file.bump_after_blocks).unwrap_or(defaults.bump_after_blocks),
        max_fee_per_gas_wei: gwei.map_or(defaults.max_fee_per_gas_wei, |g| {
            alloy_primitives::U256::from(g) * alloy_primitives::U256::from(1_000_000_000u64)
        }),
        chain_id: settings.eth_chain_id,
        ..defaults
    }
}

/// Where this process finds hot keys ([`keys`] says in which order): the command line's
/// `--key-file`, the environment, the configuration file.
pub fn key_sources<'a>(settings: &'a Settings, key_files: &[String]) -> Result<keys::Sources<'a>> {
    Ok(keys::Sources {
        files: keys::key_file_args(key_files).map_err(refused)?,
        configured: &settings.file.hot_keys,
        btc_files: &settings.file.btc.hot_key_files,
        env_key: &crate::secrets::hot_key,
    })
}

fn refused(e: keys::KeyError) -> anyhow::Error {
    invalid(e.to_string())
}

/// The signers of the ETH lanes whose keys this process has, checked ([`keys::check_eth_signers`]).
pub fn signers(
    settings: &Settings,
    lanes: &[hot_wallet::Lane],
    key_files: &[String],
    required: bool,
) -> Result<HashMap<String, Arc<dyn Signer>>> {
    let signers = keys::eth_signers(&key_sources(settings, key_files)?, lanes).map_err(refused)?;
    keys::check_eth_signers(&signers, lanes, settings.eth_chain_id, required).map_err(refused)?;
    Ok(signers)
}

/// The configured Bitcoin node; without one, a usage error saying `why` it is needed.
fn btc_node(settings: &Settings, why: &str) -> Result<BtcNode> {
    let url =
        settings.btc_rpc.as_deref().ok_or_else(|| invalid(format!("{why}: set --btc-rpc or CUSTODIAN_BTC_RPC_URL")))?;
    Ok(BtcNode::new(BtcRpc::new(url, settings.btc_auth.clone()).map_err(|e| invalid(e.to_string()))?))
}

/// The BTC worker, if any BTC lane has a key: `CUSTODIAN_BTC_HOT_KEY_FILE_<LANE>`, then
/// `[btc.hot_key_files]`; priced and batched by `[btc]`. Needs the Bitcoin node.
pub async fn btc_worker(settings: &Settings, pool: &custodian_store::Pool) -> Result<Option<BtcWorker>> {
    let lanes = hot_wallet::lanes_on::<BtcAddress, _>(&pool.get().await?).await?;
    let file = &settings.file.btc;
    let keys = keys::btc_keys(&key_sources(settings, &[])?, &lanes, settings.btc_network).map_err(refused)?;
    if keys.is_empty() {
        return Ok(None);
    }
    let node = btc_node(settings, "BTC hot keys are configured but no Bitcoin node")?;
    let defaults = BtcConfig::default();
    let config = BtcConfig {
        network: settings.btc_network,
        batch_max: file.batch_max.unwrap_or(defaults.batch_max).max(1),
        batches_per_commit: file.batches_per_commit.unwrap_or(defaults.batches_per_commit).max(1),
        batch_wait: file.batch_wait_ms.map_or(defaults.batch_wait, Duration::from_millis),
        fee_target_blocks: file.fee_target_blocks.unwrap_or(defaults.fee_target_blocks),
        min_fee_rate: file.min_fee_rate_sat_vb.map_or(defaults.min_fee_rate, FeeRate::per_vb),
        max_fee_rate: file.max_fee_rate_sat_vb.map_or(defaults.max_fee_rate, FeeRate::per_vb),
        confirmations: file.confirmations.unwrap_or(defaults.confirmations),
        bump_after_blocks: file.bump_after_blocks.unwrap_or(defaults.bump_after_blocks),
        ..defaults
    };
    Ok(Some(BtcWorker::new(pool.clone(), node, keys, config)))
}

pub async fn work(
    settings: &Settings,
    once: bool,
    key_files: &[String],
    config: WorkerConfig,
    interval: Duration,
) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let btc = btc_worker(settings, &pool).await?;
    // Without an Ethereum node, a worker with BTC keys works BTC lanes only.
    let eth = if settings.eth_rpc.is_none() && btc.is_some() {
        None
    } else {
        let node = node(settings)?;
        let lanes = hot_wallet::lanes(&pool.get().await?).await?;
        let signers = signers(settings, &lanes, key_files, true)?;
        Some(Worker::new(pool.clone(), node, signers, config))
    };
    if once {
        let eth_report = match &eth {
            Some(worker) => Some(worker.pass().await.context("running a withdrawal pass")?),
            None => None,
        };
        let btc_report = match &btc {
            Some(btc) => Some(btc.pass().await.context("running a BTC withdrawal pass")?),
            None => None,
        };
        if settings.json {
            match (eth_report, btc_report) {
                (Some(eth), None) => super::print_json(&eth)?,
                (Some(eth), Some(btc)) => super::print_json(&json!({ "eth": eth, "btc": btc }))?,
                // Without an ETH worker there is a BTC one.
                (None, btc) => super::print_json(&json!({ "btc": btc }))?,
            }
        } else {
            for (chain, report) in [("eth", eth_report), ("btc", btc_report)] {
                if let Some(report) = report {
                    println!("{}", pass_summary(chain, &report));
                }
            }
        }
        return Ok(Exit::Success);
    }
    // A pass is never interrupted: the signal is only looked at between passes.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        super::shutdown_signal().await;
        let _ = stop.send(true);
    });
    let mut service = Service::new(pool, stopped);
    if let Some(eth) = eth {
        service.eth_worker(eth, interval);
    }
    if let Some(btc) = btc {
        service.btc_worker(btc, interval);
    }
    service.run().await?;
    Ok(Exit::Success)
}

/// One pass's report for people: what moved, then each lane that needs attention on its own line.
fn pass_summary(chain: &str, r: &custodian_withdrawals::PassReport) -> String {
    let counts = [
        ("signed", r.signed),
        ("broadcast", r.broadcast),
        ("sent again", r.rebroadcast),
        ("bumped", r.bumped),
        ("cancels signed", r.cancel_attempts),
        ("mined", r.mined),
        ("unmined", r.unmined),
        ("confirmed", r.confirmed),
        ("cancelled", r.cancelled),
        ("failed on chain", r.failed_onchain),
        ("rejected", r.rejected),
        ("paid short", r.short_paid),
        ("needs review", r.needs_review),
        ("at the fee cap", r.fee_cap_reached),
    ];
    let moved: Vec<String> = counts.iter().filter(|(_, n)| *n > 0).map(|(what, n)| format!("{n} {what}")).collect();
    let mut out = format!("{chain}: {}", if moved.is_empty() { "nothing to do".to_owned() } else { moved.join(", ") });
    for (what, lanes) in [
        ("short", &r.short_lanes),
        ("nonce gap", &r.nonce_gaps),
        ("paused now", &r.paused_lanes),
        ("failed (retried)", &r.lane_errors),
    ] {
        for lane in lanes {
            out.push_str(&format!("\n  {what}: {lane}"));
        }
    }
    out
}
