//! `custodian account create`, `address assign`, `asset add`.

use anyhow::{Context, Result};
use custodian_api::tokens::{self, Scope};
use custodian_domain::{BtcAddress, Chain, ChainAddress, EthAddress};
use custodian_store::operator::{self, Action};
use custodian_store::ownership::{self, OwnershipError};
use serde_json::json;

use crate::exit::{invalid, Exit};
use crate::settings::Settings;

/// Turns refusals into validation errors (exit 2) and keeps database failures operational.
fn classify(error: OwnershipError) -> anyhow::Error {
    match error {
        OwnershipError::Database(e) => anyhow::Error::new(e).context("database error"),
        refusal => invalid(refusal.to_string()),
    }
}

pub async fn create(settings: &Settings, external_ref: &str) -> Result<Exit> {
    let external_ref = external_ref.trim();
    if external_ref.is_empty() {
        return Err(invalid("--ref must not be empty"));
    }
    let pool = super::pool(settings).await?;
    let client = pool.get().await.context("taking a database connection")?;
    let (account, created) = ownership::create_account(&client, external_ref).await.map_err(classify)?;
    if settings.json {
        super::print_json(&json!({ "id": account.id, "external_ref": account.external_ref, "created": created }))?;
    } else if created {
        println!("created account {} ({})", account.id, account.external_ref);
    } else {
        println!("account {} ({}) already exists", account.id, account.external_ref);
    }
    Ok(Exit::Success)
}

/// Parses an address for `chain` (for BTC, on the configured network).
pub fn parse_address(settings: &Settings, chain: Chain, address: &str) -> Result<ChainAddress> {
    match chain {
        Chain::Eth => EthAddress::parse(address.trim()).map(ChainAddress::Eth).map_err(|e| invalid(e.to_string())),
        Chain::Btc => {
            BtcAddress::parse(address, settings.btc_network).map(ChainAddress::Btc).map_err(|e| invalid(e.to_string()))
        }
    }
}

pub async fn assign(
    settings: &Settings,
    account: &str,
    chain: Chain,
    address: &str,
    from_height: Option<u64>,
) -> Result<Exit> {
    let address = parse_address(settings, chain, address)?;
    if from_height.is_some_and(|h| i64::try_from(h).is_err()) {
        return Err(invalid("--from-height is too large"));
    }
    let pool = super::pool(settings).await?;
    // A reassignment takes effect above the node's tip, read before the transaction opens.
    let node_tip = match from_height {
        Some(_) => None,
        None => node_tip(settings, chain).await?,
    };
    let mut client = pool.get().await.context("taking a database connection")?;
    let account = ownership::find_account(&client, account).await.map_err(classify)?;
    let (owned, changed) = ownership::assign_address_at(&mut client, &address, account.id, from_height, node_tip)
        .await
        .map_err(classify)?;
    if settings.json {
        super::print_json(&json!({
            "chain": chain, "address": owned.address, "account_id": owned.account_id,
            "account_ref": account.external_ref, "valid_from_height": owned.valid_from_height, "changed": changed,
        }))?;
    } else if changed {
        println!(
            "{chain} {} belongs to account {} from height {}",
            owned.address.stored(),
            account.external_ref,
            owned.valid_from_height
        );
    } else {
        println!(
            "{chain} {} already belongs to account {} (from height {})",
            owned.address.stored(),
            account.external_ref,
            owned.valid_from_height
        );
    }
    Ok(Exit::Success)
}

/// The configured node's tip, if a node is configured for `chain`.
async fn node_tip(settings: &Settings, chain: Chain) -> Result<Option<u64>> {
    use custodian_ingest::ChainReader;
    let tip = match chain {
        Chain::Eth => match &settings.eth_rpc {
            Some(url) => {
                Some(custodian_ingest::eth::EthReader::new(url).map_err(|e| invalid(e.to_string()))?.tip_height().await)
            }
            None => None,
        },
        Chain::Btc => match &settings.btc_rpc {
            Some(url) => Some(
                custodian_ingest::btc::BtcReader::new(url, settings.btc_auth.clone(), settings.btc_network)
                    .map_err(|e| invalid(e.to_string()))?
                    .tip_height()
                    .await,
            ),
            None => None,
        },
    };
    tip.transpose().with_context(|| format!("reading the {chain} node's tip"))
}

pub async fn add_token(settings: &Settings, chain: Chain, contract: &str, symbol: &str, decimals: u8) -> Result<Exit> {
    if chain != Chain::Eth {
        return Err(invalid(format!("tokens exist only on eth, not {chain}")));
    }
    let contract = EthAddress::parse(contract.trim()).map_err(|e| invalid(e.to_string()))?.to_lowercase_hex();
    let symbol = symbol.trim();
    if symbol.is_empty() || symbol.len() > 16 || !symbol.chars().all(|c| c.is_ascii_alphanumeric()) {
        return Err(invalid(format!("--symbol {symbol:?} must be 1 to 16 letters or digits")));
    }
    if decimals > custodian_domain::amount::MAX_DECIMALS {
        return Err(invalid(format!(
            "--decimals {decimals} is above the maximum of {}",
            custodian_domain::amount::MAX_DECIMALS
        )));
    }
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await.context("taking a database connection")?;
    let by = super::principal(settings, &client, Scope::Admin, "asset add").await?;
    let tx = client.transaction().await?;
    let (asset, created) = ownership::add_token(&tx, &contract, symbol, decimals).await.map_err(classify)?;
    if created {
        let details =
            json!({ "asset": asset, "chain": "eth", "contract": contract, "symbol": symbol, "decimals": decimals });
        operator::record(&tx, Action::AssetRegistered, &by, &details).await?;
    }
    tx.commit().await?;
    if settings.json {
        super::print_json(&json!({ "asset": asset, "symbol": symbol, "decimals": decimals, "created": created }))?;
    } else if created {
        println!("registered {symbol} ({asset}, {decimals} decimals)");
    } else {
        println!("{symbol} ({asset}) is already registered");
    }
    Ok(Exit::Success)
}

pub async fn token_create(settings: &Settings, name: &str, scopes: &str) -> Result<Exit> {
    let name = name.trim();
    if name.is_empty() {
        return Err(invalid("--name must not be empty"));
    }
    let scopes = scopes
        .split(',')
        .map(|s| s.trim().parse::<Scope>().map_err(|e| invalid(format!("--scope: {e}"))))
        .collect::<Result<Vec<_>>>()?;
    let pool = super::pool(settings).await?;
    let client = pool.get().await?;
    // The first admin token is made by the operator at the database; every later one by a
    // principal holding `admin`.
    let by = if settings.token.is_none() && tokens::needs_bootstrap(&client).await? {
        if scopes != [Scope::Admin] {
            return Err(invalid(
                "no admin token exists yet: the first token must have the admin scope and no other \
                 (decisions need tokens of their own, made by it)",
            ));
        }
        tokens::BOOTSTRAP_PRINCIPAL.to_owned()
    } else {
        super::principal(settings, &client, Scope::Admin, "token create").await?
    };
    let token = tokens::create(&client, name, &scopes, &by).await.map_err(|e| invalid(e.to_string()))?;
    if settings.json {
        super::print_json(&json!({ "name": name, "token": token }))?;
    } else {
        println!("{token}");
        eprintln!("token {name:?} created; it is shown only now (only its hash is stored)");
    }
    Ok(Exit::Success)
}

pub async fn token_revoke(settings: &Settings, name: &str) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let client = pool.get().await?;
    let by = super::principal(settings, &client, Scope::Admin, "token revoke").await?;
    let revoked = tokens::revoke(&client, name, &by).await.map_err(|e| invalid(e.to_string()))?;
    if !revoked {
        return Err(invalid(format!("no active token named {name:?}")));
    }
    if settings.json {
        super::print_json(&json!({ "name": name, "revoked": true }))?;
    } else {
        println!("token {name:?} revoked");
    }
    Ok(Exit::Success)
}
