//! The per-token request rate limit: a token bucket of `burst` requests refilled at
//! `requests_per_second`, kept as one "theoretical arrival time" per token (GCRA), in integer
//! nanoseconds.
//!
//! A request is admitted when the bucket holds a whole request; each admitted request moves the
//! token's arrival time one emission interval (1 s / rate) ahead of `max(now, arrival time)`.
//! Refused requests change nothing, so a client hammering the API does not push its own recovery
//! further away. Keys are token ids (bounded by the `api_token` table) or peer addresses; past
//! [`PRUNE_ABOVE`] keys, those whose bucket is full again are forgotten, which changes nothing
//! they would be told.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const NANOS_PER_SECOND: u64 = 1_000_000_000;

/// How many keys the limiter tracks before it forgets the idle ones.
const PRUNE_ABOVE: usize = 10_000;

/// Requests per second and burst, both at least 1.
#[derive(Debug)]
pub(crate) struct RateLimiter<K> {
    /// Nanoseconds between requests at the sustained rate.
    interval_ns: u64,
    /// How far ahead of now a token's arrival time may run: `burst` intervals.
    tolerance_ns: u64,
    /// Reference point for the integer clock.
    epoch: Instant,
    /// Theoretical arrival time per key, in nanoseconds after `epoch`.
    arrivals: Mutex<HashMap<K, u64>>,
}

impl<K: Hash + Eq> RateLimiter<K> {
    /// A limiter admitting `burst` requests at once and `requests_per_second` sustained.
    ///
    /// # Panics
    /// If either is zero: the caller validates the configuration first.
    pub(crate) fn new(requests_per_second: u32, burst: u32) -> RateLimiter<K> {
        assert!(requests_per_second > 0 && burst > 0, "BUG: rate limit not validated");
        let interval_ns = NANOS_PER_SECOND / u64::from(requests_per_second);
        RateLimiter {
            interval_ns,
            tolerance_ns: interval_ns.saturating_mul(u64::from(burst)),
            epoch: Instant::now(),
            arrivals: Mutex::new(HashMap::new()),
        }
    }

    /// Admits a request of `key` now, or says how long until one would be admitted.
    pub(crate) fn check(&self, key: K) -> Result<(), Duration> {
        self.check_at(key, Instant::now())
    }

    fn check_at(&self, id: K, now: Instant) -> Result<(), Duration> {
        let now_ns = u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX);
        // A poisoned lock only means another request panicked between two integer operations;
        // the map is still a map.
        let mut arrivals = self.arrivals.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let arrival = arrivals.get(&id).copied().unwrap_or(now_ns).max(now_ns);
        let next = arrival.saturating_add(self.interval_ns);
        let ahead = next - now_ns;
        if ahead > self.tolerance_ns {
            return Err(Duration::from_nanos(ahead - self.tolerance_ns));
        }
        if arrivals.len() >= PRUNE_ABOVE {
            arrivals.retain(|_, arrival| *arrival > now_ns);
        }
        arrivals.insert(id, next);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_is_admitted_then_the_sustained_rate() {
        let limiter = RateLimiter::<i64>::new(10, 3);
        let start = limiter.epoch;
        for _ in 0..3 {
            assert_eq!(limiter.check_at(1, start), Ok(()));
        }
        assert_eq!(limiter.check_at(1, start), Err(Duration::from_millis(100)));
        // Refusals do not push recovery further away.
        assert_eq!(limiter.check_at(1, start), Err(Duration::from_millis(100)));
        assert_eq!(limiter.check_at(1, start + Duration::from_millis(99)), Err(Duration::from_millis(1)));
        assert_eq!(limiter.check_at(1, start + Duration::from_millis(100)), Ok(()));
        assert!(limiter.check_at(1, start + Duration::from_millis(100)).is_err());
        // Another token has a bucket of its own.
        assert_eq!(limiter.check_at(2, start), Ok(()));
        // After a long pause the bucket is full again, never fuller.
        let later = start + Duration::from_secs(60);
        for _ in 0..3 {
            assert_eq!(limiter.check_at(1, later), Ok(()));
        }
        assert!(limiter.check_at(1, later).is_err());
    }

    #[test]
    fn a_steady_client_at_the_rate_is_never_refused() {
        let limiter = RateLimiter::<i64>::new(4, 1);
        let start = limiter.epoch;
        for i in 0..100u64 {
            assert_eq!(limiter.check_at(7, start + Duration::from_millis(250 * i)), Ok(()), "request {i}");
        }
        assert!(limiter.check_at(7, start + Duration::from_millis(250 * 99 + 1)).is_err());
    }
}
