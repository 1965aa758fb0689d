//! Appending to a withdrawal's event stream with optimistic concurrency.
//!
//! A writer states the sequence number it last saw; the new event takes the next one. The primary
//! key `(withdrawal_id, seq)` is what enforces it: two writers that saw the same state cannot both
//! append, and the loser gets [`AppendError::Conflict`] to reload and decide again.

use deadpool_postgres::GenericClient;

/// Why an event was not appended.
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    /// Another writer appended first (or the stream is not at `expected_seq`). The surrounding
    /// transaction is aborted; roll it back, reload the stream and retry.
    #[error("withdrawal {withdrawal_id}: stream is no longer at sequence {expected_seq}")]
    Conflict {
        /// The stream.
        withdrawal_id: i64,
        /// The sequence the writer expected to follow.
        expected_seq: i32,
    },
    /// The database refused for another reason.
    #[error("could not append to withdrawal {withdrawal_id}: {}", crate::describe(source))]
    Database {
        /// The stream.
        withdrawal_id: i64,
        /// The underlying error.
        source: tokio_postgres::Error,
    },
}

/// Inserts the event only if the stream currently ends at `$2` (0 for a new stream). When two
/// writers race past the check, the primary key stops the second.
const APPEND_EVENT: &str = "
insert into withdrawal_event (withdrawal_id, seq, event_type, payload)
select $1::bigint, $2::integer + 1, $3::text, $4::jsonb
where case when $2::integer = 0
           then not exists (select 1 from withdrawal_event where withdrawal_id = $1)
           else exists (select 1 from withdrawal_event where withdrawal_id = $1 and seq = $2)
      end
returning global_position";

/// Appends `event_type` with `payload` as event `expected_seq + 1` of `withdrawal_id`, returning
/// its global position.
///
/// # Cancel safety
/// Runs one statement on the caller's transaction; nothing is visible until the caller commits.
pub async fn append_withdrawal_event<C: GenericClient>(
    client: &C,
    withdrawal_id: i64,
    expected_seq: i32,
    event_type: &str,
    payload: &serde_json::Value,
) -> Result<i64, AppendError> {
    let conflict = AppendError::Conflict { withdrawal_id, expected_seq };
    match client.query_opt(APPEND_EVENT, &[&withdrawal_id, &expected_seq, &event_type, payload]).await {
        Ok(Some(row)) => Ok(row.get(0)),
        Ok(None) => Err(conflict),
        Err(e) if crate::is_unique_violation(&e, None) => Err(conflict),
        Err(source) => Err(AppendError::Database { withdrawal_id, source }),
    }
}
