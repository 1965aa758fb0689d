//! A pass's lanes, run at once by either chain's worker: each lane's part locks only its own rows,
//! so one lane's slow node calls or database work never holds up another's. A lane whose part
//! fails transiently is counted, logged, listed in the pass's report and backed off (with jitter,
//! doubling up to [`LANE_MAX_BACKOFF`]) while the other lanes go on; an error retrying cannot help
//! ends the pass once every part is done.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{PassReport, WorkError};

/// First wait before a failing lane is tried again; doubles up to [`LANE_MAX_BACKOFF`].
const LANE_FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// Longest wait between tries of a failing lane.
const LANE_MAX_BACKOFF: Duration = Duration::from_secs(30);

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
/// report) at once and sums their reports.
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
    for (lane, (part, result)) in lanes.into_iter().zip(futures::future::join_all(parts).await) {
        report.merge(part);
        match result {
            Ok(()) => backoff.recovered(&lane),
            Err(e) if e.is_fatal() => {
                fatal.get_or_insert(e);
            }
            Err(e) => {
                let wait = backoff.failed(&lane);
                metrics::counter!("custodian_lane_errors_total", "lane" => lane.clone()).increment(1);
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
