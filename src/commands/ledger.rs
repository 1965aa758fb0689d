//! `custodian policy`, `post`, `reversals`, `balances`.

use anyhow::{Context, Result};
use custodian_domain::Decision;
use custodian_domain::{Amount, Chain};
use custodian_projections::reversals::DecisionError;
use custodian_projections::{balances, policy, posting, reversals};
use custodian_store::ownership;
use serde_json::json;

use crate::exit::{invalid, Exit};
use crate::settings::Settings;

pub async fn policy_set(
    settings: &Settings,
    chain: Chain,
    asset: &str,
    min_amount: &str,
    confirmations: u32,
) -> Result<Exit> {
    if i32::try_from(confirmations).is_err() {
        return Err(invalid("--confirmations is too large"));
    }
    let pool = super::pool(settings).await?;
    let client = pool.get().await?;
    let by = super::principal(settings, &client, custodian_api::tokens::Scope::Admin, "policy set").await?;
    let (asset, decimals) = ownership::find_asset(&client, chain, asset)
        .await?
        .ok_or_else(|| invalid(format!("unknown asset {asset:?} on {chain}")))?;
    let min = Amount::parse_decimal(min_amount, decimals).map_err(|e| invalid(format!("--min-amount: {e}")))?;
    policy::set_tier(&client, chain, &asset, min, confirmations, &by).await.context("setting the tier")?;
    if settings.json {
        super::print_json(
            &json!({ "chain": chain, "asset": asset, "min_amount": min, "confirmations": confirmations }),
        )?;
    } else {
        println!("{chain} {asset}: from {} on, {confirmations} confirmations", min.to_decimal_string(decimals));
    }
    Ok(Exit::Success)
}

pub async fn policy_show(settings: &Settings) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let tiers = policy::tiers(&pool.get().await?).await?;
    if settings.json {
        return super::print_json(&tiers).map(|()| Exit::Success);
    }
    for t in &tiers {
        println!("{:<4} {:<8} >= {:<24} {} confirmations", t.chain, t.symbol, t.min_amount_display, t.confirmations);
    }
    Ok(Exit::Success)
}

pub async fn post(settings: &Settings) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let client = pool.get().await?;
    let report = posting::post_all(&client).await.context("posting confirmed deposits")?;
    custodian_projections::seals::seal(&client).await.context("sealing the history")?;
    if settings.json {
        super::print_json(&report)?;
    } else {
        println!(
            "posted {} credits; {} discrepancies opened, {} closed (re-mined); {} mismatches",
            report.posted,
            report.reversals_proposed,
            report.discrepancies_closed,
            report.mismatches.len()
        );
        for m in &report.mismatches {
            println!("ALERT {}: block {} says {}, posted {}", m.key, m.block_hash, m.observed, m.posted);
        }
    }
    Ok(Exit::Success)
}

pub async fn reversals_list(settings: &Settings) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let proposals = reversals::list(&pool.get().await?).await?;
    if settings.json {
        return super::print_json(&proposals).map(|()| Exit::Success);
    }
    if proposals.is_empty() {
        println!("no discrepancies");
    }
    for p in &proposals {
        let decision = match (&p.decision, &p.decided_by) {
            (Some(d), Some(by)) => format!("{d} by {by}"),
            _ if p.reappeared => "re-mined: closes on the next posting pass".to_owned(),
            _ => "awaiting review (approve: debit the account; reject: book the loss to treasury)".to_owned(),
        };
        println!(
            "#{} {} round {} {} {} from {}: {}",
            p.id, p.deposit_key, p.round, p.amount, p.asset, p.ledger_account, decision
        );
    }
    Ok(Exit::Success)
}

pub async fn decide(settings: &Settings, id: i64, approve: bool, reason: Option<&str>) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let call = if approve { "reversals approve" } else { "reversals reject" };
    let by = super::principal(settings, &client, custodian_api::tokens::Scope::Approve, call).await?;
    let by = by.as_str();
    let (proposal, recorded) = match reversals::decide(&mut client, id, approve, by, reason).await {
        Ok(outcome) => outcome,
        Err(DecisionError::Database(e)) => return Err(anyhow::Error::new(e).context("recording the decision")),
        Err(refusal) => return Err(invalid(refusal.to_string())),
    };
    if settings.json {
        super::print_json(&json!({ "proposal": proposal, "recorded_now": recorded }))?;
    } else if recorded {
        println!("proposal #{id} {} by {by}", proposal.decision.map_or("decided", Decision::as_str));
    } else {
        println!(
            "proposal #{id} was already {} by {}; nothing changed",
            proposal.decision.map_or("decided", Decision::as_str),
            proposal.decided_by.unwrap_or_default()
        );
    }
    Ok(Exit::Success)
}

pub async fn balances(settings: &Settings, account: Option<&str>) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let client = pool.get().await?;
    let accounts = match account {
        Some(key) => {
            let a = ownership::find_account(&client, key).await.map_err(|e| invalid(e.to_string()))?;
            vec![(a.id, a.external_ref)]
        }
        None => balances::accounts(&client).await?,
    };
    let mut all = Vec::new();
    for (id, external_ref) in &accounts {
        all.extend(balances::for_account(&client, *id, external_ref).await?);
    }
    if settings.json {
        return super::print_json(&all).map(|()| Exit::Success);
    }
    println!(
        "{:<16} {:<8} {:>22} {:>22} {:>22} {:>22}",
        "account", "asset", "confirmed", "pending", "held", "available"
    );
    for b in &all {
        println!(
            "{:<16} {:<8} {:>22} {:>22} {:>22} {:>22}",
            b.account_ref, b.symbol, b.display.confirmed, b.display.pending, b.display.held, b.display.available
        );
        for p in &b.pending_deposits {
            println!(
                "{:<25} pending {}:{} {}/{} confirmations",
                "",
                p.tx_hash,
                p.output_index,
                p.confirmations,
                p.required_confirmations.unwrap_or(0)
            );
        }
    }
    Ok(Exit::Success)
}
