//! `custodian webhook add|list|pause|resume|remove|deliver`: subscribers to the fact history.

use anyhow::{Context, Result};
use custodian_api::tokens::Scope;
use custodian_api::webhooks::{self, Deliverer, Subscriber, WebhookError};

use crate::cli::WebhookCommand;
use crate::exit::{invalid, Exit};
use crate::settings::Settings;

fn webhook_error(e: WebhookError) -> anyhow::Error {
    if e.is_refusal() {
        invalid(e.to_string())
    } else {
        anyhow::Error::new(e)
    }
}

/// The secret in `path`, which only its owner may read.
fn read_secret(path: &std::path::Path) -> Result<zeroize::Zeroizing<String>> {
    match crate::config::readable_by_others(path) {
        Ok(Some(mode)) => {
            return Err(invalid(format!(
                "{} holds a webhook secret but is readable by others (mode {mode:o}): chmod 600 it",
                path.display()
            )))
        }
        Ok(None) => {}
        Err(e) => return Err(invalid(format!("cannot read {}: {e}", path.display()))),
    }
    let secret = std::fs::read_to_string(path).map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?;
    Ok(zeroize::Zeroizing::new(secret))
}

fn print_one(s: &Subscriber) {
    let state = match &s.paused_reason {
        Some(reason) => format!("paused: {reason}"),
        None => s.state.clone(),
    };
    let cursor = s.cursor.map_or_else(|| "start".to_owned(), |c| c.to_string());
    let backlog = s.backlog.map_or_else(String::new, |b| format!(", {b} waiting"));
    let failing =
        s.last_error.as_ref().map_or_else(String::new, |e| format!(", failing ({} attempts): {e}", s.attempts));
    println!(
        "#{} {} [{}] {state}; after {cursor}, {} delivered{backlog}{failing}",
        s.id,
        s.url,
        s.kinds.join(","),
        s.delivered
    );
}

/// The deliverer for this process, with the configured settings.
pub fn deliverer(settings: &Settings, pool: custodian_store::Pool) -> Result<Deliverer> {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let owner = format!("{}:{}", host.trim(), std::process::id());
    Deliverer::new(pool, settings.file.webhooks.delivery(), owner).context("starting webhook delivery")
}

pub async fn run(settings: &Settings, command: WebhookCommand) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    match command {
        WebhookCommand::Add { url, kinds, secret_file, from_start } => {
            let kinds = webhooks::parse_kinds(&kinds).map_err(webhook_error)?;
            let secret = secret_file.as_deref().map(read_secret).transpose()?;
            let by = super::principal(settings, &client, Scope::Admin, "webhook add").await?;
            let added = webhooks::add(&mut client, &url, &kinds, secret.as_ref().map(|s| s.as_str()), from_start, &by)
                .await
                .map_err(webhook_error)?;
            if settings.json {
                super::print_json(&added)?;
            } else {
                print_one(&added.subscriber);
                if let Some(secret) = &added.secret {
                    println!("secret (shown once; receivers verify {} with it): {secret}", webhooks::SIGNATURE_HEADER);
                }
            }
        }
        WebhookCommand::List => {
            super::principal(settings, &client, Scope::Admin, "webhook list").await?;
            let all = webhooks::list(&client).await.map_err(webhook_error)?;
            if settings.json {
                super::print_json(&all)?;
            } else if all.is_empty() {
                println!("no webhook subscribers");
            } else {
                all.iter().for_each(print_one);
            }
        }
        WebhookCommand::Pause { id, reason } => {
            let by = super::principal(settings, &client, Scope::Admin, "webhook pause").await?;
            let paused = webhooks::set_paused(&mut client, id, Some(&reason), &by).await.map_err(webhook_error)?;
            if settings.json {
                super::print_json(&paused)?;
            } else {
                print_one(&paused);
            }
        }
        WebhookCommand::Resume { id } => {
            let by = super::principal(settings, &client, Scope::Admin, "webhook resume").await?;
            let resumed = webhooks::set_paused(&mut client, id, None, &by).await.map_err(webhook_error)?;
            if settings.json {
                super::print_json(&resumed)?;
            } else {
                print_one(&resumed);
            }
        }
        WebhookCommand::Remove { id } => {
            let by = super::principal(settings, &client, Scope::Admin, "webhook remove").await?;
            webhooks::remove(&mut client, id, &by).await.map_err(webhook_error)?;
            if settings.json {
                super::print_json(&serde_json::json!({ "removed": id }))?;
            } else {
                println!("webhook subscriber #{id} removed");
            }
        }
        WebhookCommand::Deliver { once } => {
            drop(client);
            let deliverer = deliverer(settings, pool.clone())?;
            if once {
                let report = deliverer.pass().await.map_err(webhook_error)?;
                let failed = report.subscribers.values().any(|t| t.failed.is_some());
                if settings.json {
                    super::print_json(&report)?;
                } else if report.subscribers.is_empty() {
                    println!("no webhook subscriber is due");
                } else {
                    for (id, turn) in &report.subscribers {
                        let outcome = match (&turn.failed, turn.paused) {
                            (Some(e), true) => format!("; failed and PAUSED: {e}"),
                            (Some(e), false) => format!("; failed, retried later: {e}"),
                            (None, _) => "; caught up".to_owned(),
                        };
                        println!(
                            "#{id}: {} delivered, {} of other kinds passed over{outcome}",
                            turn.delivered, turn.skipped
                        );
                    }
                }
                return Ok(if failed { Exit::Operational } else { Exit::Success });
            }
            let (stop, stopped) = tokio::sync::watch::channel(false);
            tokio::spawn(async move {
                super::shutdown_signal().await;
                let _ = stop.send(true);
            });
            deliverer.run(stopped).await.map_err(webhook_error)?;
        }
    }
    Ok(Exit::Success)
}
