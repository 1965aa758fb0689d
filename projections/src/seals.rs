//! Fact seals: a hash chain over the audit history, appended after the service's writes and
//! checked by `replay --verify` (the schema's `seal_facts` and `verify_seals` do the hashing).

use deadpool_postgres::GenericClient;

/// Facts sealed per statement.
const SEAL_BATCH: i32 = 10_000;

/// Seals every final fact not sealed yet; returns how many were sealed.
///
/// # Cancel safety
/// Each batch is one statement; a cancelled call leaves the batches it committed, all valid.
pub async fn seal<C: GenericClient>(client: &C) -> Result<u64, tokio_postgres::Error> {
    let mut total = 0u64;
    loop {
        let sealed: i32 = client.query_one("select seal_facts($1)", &[&SEAL_BATCH]).await?.get(0);
        total += u64::try_from(sealed).expect("BUG: a negative count");
        if sealed < SEAL_BATCH {
            return Ok(total);
        }
    }
}

/// Sealed facts that were changed or deleted, and breaks in the seal chain: (position, problem).
pub async fn broken<C: GenericClient>(client: &C) -> Result<Vec<(i64, String)>, tokio_postgres::Error> {
    let rows = client.query("select seal_position, problem from verify_seals()", &[]).await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}
