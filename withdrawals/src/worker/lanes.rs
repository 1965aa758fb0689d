//! A pass's lanes, run at once by either chain's worker: each lane's part locks only its own rows,
//! so one lane's slow node calls or database work never holds up another's. A lane whose part
//! fails transiently is counted, logged, listed in the pass's report and backed off (with jitter,
//! doubling up to [`LANE_MAX_BACKOFF`]) while the other lanes go on; an error retrying cannot help
//! ends the pass once every part is done.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::StreamExt;

use super::{PassReport, WorkError};

/// First wait before a failing lane is tried again; doubles up to [`LANE_MAX_BACKOFF`].
const LANE_FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// Longest wait between tries of a failing lane.
const LANE_MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Lanes of one pass running at most at once. A lane's part holds up to two pooled connections at
/// a time (its reads, and a recording or replacement transaction beside them), and the pool
/// (`custodian_store::pool::DEFAULT_POOL_SIZE`, 16) also serves the other chain's worker, the
/// scanners, posting and webhooks: with every lane at once, eight lanes could each hold one
/// connection and wait for a second until the checkout times out.
const LANES_AT_ONCE: usize = 4;

/// Lanes failing transiently: when each may be tried again, and its current backoff.
#[derive(Debug, Default)]
pub(crate) struct LaneBackoff(Mutex<HashMap<String, (Instant, Duration)>>);

impl LaneBackoff {
    /// Whether `lane` failed recently and its backoff has not run out.
    pub(crate) fn waiting(&self, lane: &str) -> bool {
        let backoff = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        backoff.get(lane).is_some_and(|(until, _)| Instant::now() < *until)
    }

    /// Records a failure of `lane`: its next try waits twice as long as the last (with jitter).
    fn failed(&self, lane: &str) -> Duration {
        let mut backoff = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let current = backoff.get(lane).map_or(LANE_FIRST_BACKOFF, |(_, last)| (*last * 2).min(LANE_MAX_BACKOFF));
        let wait = custodian_store::jittered(current);
        backoff.insert(lane.to_owned(), (Instant::now() + wait, current));
        wait
    }

    /// `lane`'s part went through: its next failure starts from the first backoff again.
    fn recovered(&self, lane: &str) {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(lane);
    }
}

/// Runs `parts` (each lane's name and its part of the pass on `chain`, which fills its own
/// report) at once, up to [`LANES_AT_ONCE`] of them, and sums their reports.
pub(crate) async fn run_at_once<F>(
    backoff: &LaneBackoff,
    chain: &str,
    parts: Vec<(String, F)>,
) -> Result<PassReport, WorkError>
where
    F: Future<Output = (PassReport, Result<(), WorkError>)>,
{
    let (lanes, parts): (Vec<String>, Vec<F>) = parts.into_iter().unzip();
    let mut report = PassReport::default();
    let mut fatal = None;
    let done: Vec<_> = futures::stream::iter(parts).buffered(LANES_AT_ONCE).collect().await;
    for (lane, (part, result)) in lanes.into_iter().zip(done) {
        report.merge(part);
        match result {
            Ok(()) => backoff.recovered(&lane),
            Err(e) if e.is_fatal() => {
                fatal.get_or_insert(e);
            }
            Err(e) => {
                let wait = backoff.failed(&lane);
                metrics::counter!("custodian_lane_errors_total", "chain" => chain.to_owned(), "lane" => lane.clone())
                    .increment(1);
                tracing::warn!(%chain, %lane, retry_in_ms = wait.as_millis() as u64,
                    "the lane's pass failed; the other lanes go on: {e}");
                report.lane_errors.push(format!("{lane}: {e}"));
            }
        }
    }
    match fatal {
        Some(e) => Err(e),
        None => Ok(report),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A part that counts how many parts run at once, then ends as `result` says.
    async fn part(
        running: &AtomicUsize,
        most: &AtomicUsize,
        result: Result<(), WorkError>,
    ) -> (PassReport, Result<(), WorkError>) {
        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
        most.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(20)).await;
        running.fetch_sub(1, Ordering::SeqCst);
        (PassReport { signed: 1, ..PassReport::default() }, result)
    }

    fn unavailable() -> WorkError {
        WorkError::Unavailable(deadpool_postgres::PoolError::Timeout(deadpool_postgres::TimeoutType::Wait))
    }

    #[tokio::test]
    async fn lanes_run_at_once_up_to_the_cap_and_a_failing_one_is_listed_and_backed_off() {
        let (running, most, backoff) = (AtomicUsize::new(0), AtomicUsize::new(0), LaneBackoff::default());
        let parts: Vec<_> = (0..9)
            .map(|i| {
                let result = if i == 3 { Err(unavailable()) } else { Ok(()) };
                (format!("l{i}"), part(&running, &most, result))
            })
            .collect();
        let report = run_at_once(&backoff, "btc", parts).await.expect("no fatal error");
        assert_eq!(report.signed, 9, "every part ran and its report was kept");
        assert_eq!(most.load(Ordering::SeqCst), LANES_AT_ONCE, "at most {LANES_AT_ONCE} at once, and that many");
        assert_eq!(report.lane_errors.len(), 1);
        assert!(report.lane_errors[0].starts_with("l3: no database connection"), "{:?}", report.lane_errors);
        assert!(backoff.waiting("l3") && !backoff.waiting("l4"));

        // A fatal error ends the pass once every part is done; a lane that goes through recovers.
        let parts = vec![
            ("l3".to_owned(), part(&running, &most, Ok(()))),
            ("l5".to_owned(), part(&running, &most, Err(WorkError::WrongChain { configured: 1, node: 2 }))),
        ];
        assert!(matches!(run_at_once(&backoff, "eth", parts).await, Err(WorkError::WrongChain { .. })));
        assert!(!backoff.waiting("l3"), "recovered");
    }
}
