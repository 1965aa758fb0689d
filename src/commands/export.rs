//! Finance exports: the ledger's postings between two moments, and balances as of a past moment.
//! Both read only `ledger_entries` (a view the read-only role `custodian_reader` may read), in one
//! read-only repeatable-read transaction, so finance's own login runs them and the figures are of
//! one instant. Amounts are integers in the asset's smallest unit.

use std::io::Write;

use anyhow::{Context, Result};
use futures::{pin_mut, TryStreamExt};
use serde_json::json;

use crate::cli::ExportFormat;
use crate::exit::{invalid, Exit};
use crate::settings::Settings;

/// `value` as PostgreSQL reads a `timestamptz` (a date, or a timestamp with its zone), normalised
/// to RFC 3339 in UTC; refused with exit 2 when it is not one.
async fn moment(client: &deadpool_postgres::Object, flag: &str, value: &str) -> Result<String> {
    let row = client
        .query_one(
            "select to_char($1::text::timestamptz at time zone 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
            &[&value],
        )
        .await
        .map_err(|e| match e.code().map(|c| c.code().starts_with("22")) {
            Some(true) => {
                invalid(format!("{flag} {value:?} is not a date or a timestamp (2026-11-30, 2026-11-30T18:00:00Z)"))
            }
            _ => anyhow::Error::new(e).context("reading the moment"),
        })?;
    Ok(row.get(0))
}

async fn read_only(client: &mut deadpool_postgres::Object) -> Result<deadpool_postgres::Transaction<'_>> {
    client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .context("starting a read-only transaction")
}

/// One CSV field, quoted when it holds a comma, a quote or a line break.
fn csv_field(value: &str) -> String {
    if value.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", value.replace('"', "\"\""))
    } else {
        value.to_owned()
    }
}

const COLUMNS: [&str; 9] = [
    "posting_id",
    "transfer_id",
    "created_at",
    "idempotency_key",
    "kind",
    "ledger_account",
    "asset",
    "direction",
    "amount",
];

/// `custodian export ledger`: every posting with `from <= created_at < to`, oldest first, streamed.
pub async fn ledger(
    settings: &Settings,
    from: &str,
    to: &str,
    format: ExportFormat,
    ledger_account: Option<&str>,
) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let (from, to) = (moment(&client, "--from", from).await?, moment(&client, "--to", to).await?);
    if from >= to {
        return Err(invalid(format!("--from {from} is not before --to {to}")));
    }
    let tx = read_only(&mut client).await?;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&from, &to, &ledger_account];
    let rows = tx
        .query_raw(
            "select posting_id::text, transfer_id::text,
                    to_char(created_at at time zone 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'),
                    idempotency_key, kind, ledger_account, asset, direction, amount::text
               from ledger_entries
              where created_at >= $1::text::timestamptz and created_at < $2::text::timestamptz
                and ($3::text is null or ledger_account = $3)
              order by created_at, transfer_id, posting_id",
            params,
        )
        .await
        .context("reading ledger_entries")?;
    pin_mut!(rows);
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    let mut count = 0u64;
    match format {
        ExportFormat::Csv => writeln!(out, "{}", COLUMNS.join(","))?,
        ExportFormat::Json => write!(out, "[")?,
    }
    while let Some(row) = rows.try_next().await.context("reading ledger_entries")? {
        let cells: Vec<String> = (0..COLUMNS.len()).map(|i| row.get::<_, String>(i)).collect();
        match format {
            ExportFormat::Csv => {
                writeln!(out, "{}", cells.iter().map(|c| csv_field(c)).collect::<Vec<_>>().join(","))?;
            }
            ExportFormat::Json => {
                let object: serde_json::Map<String, serde_json::Value> =
                    COLUMNS.iter().zip(&cells).map(|(k, v)| ((*k).to_owned(), json!(v))).collect();
                write!(out, "{}\n  {}", if count == 0 { "" } else { "," }, serde_json::Value::Object(object))?;
            }
        }
        count += 1;
        if count.is_multiple_of(100_000) {
            eprintln!("exported {count} postings so far");
        }
    }
    if format == ExportFormat::Json {
        writeln!(out, "{}]", if count == 0 { "" } else { "\n" })?;
    }
    out.flush()?;
    drop(out);
    tx.rollback().await?;
    eprintln!("exported {count} postings from {from} to {to}");
    Ok(Exit::Success)
}

/// `custodian balances --as-of T`: per account and asset, what the postings up to `T` made
/// available (the account's own ledger balance) and held (its withdrawals' holds not yet settled
/// or released).
pub async fn balances_as_of(settings: &Settings, account: Option<&str>, as_of: &str) -> Result<Exit> {
    let pool = super::pool(settings).await?;
    let mut client = pool.get().await?;
    let at = moment(&client, "--as-of", as_of).await?;
    let account_id: Option<i64> = match account {
        None => None,
        Some(key) => Some(key.parse().map_err(|_| {
            invalid(format!(
                "--account {key:?}: with --as-of, give the account id (finance's role reads no account table)"
            ))
        })?),
    };
    let tx = read_only(&mut client).await?;
    let rows = tx
        .query(
            "with moved as (
                 select substr(ledger_account, 6)::bigint as account_id, asset,
                        sum(case direction when 'credit' then amount else -amount end) as available,
                        0::numeric as held
                   from ledger_entries
                  where ledger_account like 'user:%' and created_at <= $1::text::timestamptz
                  group by 1, 2
                 union all
                 select substr(h.payer, 6)::bigint, p.asset, 0,
                        sum(case p.direction when 'credit' then p.amount else -p.amount end)
                   from ledger_entries p
                   join (select (reference ->> 'withdrawal_id')::bigint as withdrawal_id, ledger_account as payer
                           from ledger_entries where kind = 'withdrawal_hold' and direction = 'debit') h
                     on h.withdrawal_id = (p.reference ->> 'withdrawal_id')::bigint
                  where p.ledger_account = 'withdrawal_holds' and p.created_at <= $1::text::timestamptz
                    and h.payer like 'user:%'
                  group by 1, 2
             )
             select account_id, asset, sum(available)::text, sum(held)::text from moved
              where $2::bigint is null or account_id = $2
              group by 1, 2 order by 1, 2",
            &[&at, &account_id],
        )
        .await
        .context("reading ledger_entries")?;
    tx.rollback().await?;
    let balances: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            json!({"account_id": r.get::<_, i64>(0), "asset": r.get::<_, String>(1),
                   "available": r.get::<_, String>(2), "held": r.get::<_, String>(3)})
        })
        .collect();
    if settings.json {
        super::print_json(&json!({ "as_of": at, "balances": balances }))?;
    } else {
        println!("balances as of {at} (smallest units)");
        println!("{:<10} {:<48} {:>26} {:>26}", "account", "asset", "available", "held");
        for b in &balances {
            println!(
                "{:<10} {:<48} {:>26} {:>26}",
                b["account_id"],
                b["asset"].as_str().unwrap_or(""),
                b["available"].as_str().unwrap_or(""),
                b["held"].as_str().unwrap_or("")
            );
        }
    }
    Ok(Exit::Success)
}
