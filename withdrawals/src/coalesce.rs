//! Requests that concurrent callers make at the same moment, recorded together: one transaction
//! and one commit for as many as arrived while the previous batch was being written
//! ([`request::request_batch`]). A commit waits for the disk; callers that would each have waited
//! for their own share one wait instead, and requests of one account no longer queue one commit
//! apart behind its lock.
//!
//! Each answer is sent only after its batch committed (or its request was refused): a request is
//! durable before it is acknowledged, as on its own. An answer is the withdrawal as listed: a new
//! one's from what its request wrote, an idempotent hit's from what its request read (so neither
//! costs a round trip more); whatever a request did not know is read for the whole batch in one.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::listing::{self, Listed};
use crate::request::{self, Request, RequestError, Requested};

type Reply = oneshot::Sender<Result<Answer, RequestError>>;

/// A recorded request, as its caller is answered.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The withdrawal as listed: its symbol, decimals, timestamps and attempts beside the fold.
    pub listed: Listed,
    /// False when an earlier request with the same external id and payload was returned.
    pub created: bool,
}

/// The front of the batches: [`Coalescer::request`] is [`request::request`] for a caller among
/// many.
#[derive(Debug, Clone)]
pub struct Coalescer {
    /// One queue per writer; an account's requests always go to the same one.
    queues: Arc<[mpsc::Sender<(Request, Reply)>]>,
}

impl Coalescer {
    /// Starts `writers` tasks, each taking up to `batch_max` waiting requests of its queue at a
    /// time. They end when every clone of the coalescer is dropped.
    ///
    /// Requests of one account all queue for one writer. Writers that shared them would each take
    /// a few and then wait for one another at the account's lock, one commit apart; one writer
    /// takes all that waited in one batch and one commit.
    pub fn start(pool: deadpool_postgres::Pool, writers: usize, batch_max: usize) -> Coalescer {
        let batch_max = batch_max.max(1);
        let queues: Vec<_> = (0..writers.max(1))
            .map(|_| {
                let (queue, mut waiting) = mpsc::channel::<(Request, Reply)>(batch_max * 4);
                let pool = pool.clone();
                tokio::spawn(async move {
                    while let Some(first) = waiting.recv().await {
                        let mut batch = vec![first];
                        while batch.len() < batch_max {
                            match waiting.try_recv() {
                                Ok(next) => batch.push(next),
                                Err(_) => break,
                            }
                        }
                        let requests: Vec<Request> = batch.iter().map(|(r, _)| r.clone()).collect();
                        metrics::histogram!("custodian_request_batch_size").record(requests.len() as f64);
                        let answers = listed(&pool, request::request_batch(&pool, &requests).await).await;
                        for ((_, reply), answer) in batch.into_iter().zip(answers) {
                            // A caller that went away finds its request by its external id.
                            let _ = reply.send(answer);
                        }
                    }
                });
                queue
            })
            .collect();
        Coalescer { queues: queues.into() }
    }

    /// Records `request` with whatever others are waiting, or returns the earlier one with the
    /// same external id and payload; answered once its batch committed.
    ///
    /// # Cancel safety
    /// Cancelled after the request was queued, the request may still be recorded: a retry with
    /// the same external id returns it.
    pub async fn request(&self, request: Request) -> Result<Answer, RequestError> {
        let (reply, answer) = oneshot::channel();
        let queue = &self.queues[writer_of(request.account_id.get(), self.queues.len())];
        queue.send((request, reply)).await.map_err(|_| RequestError::ShuttingDown)?;
        answer.await.map_err(|_| RequestError::ShuttingDown)?
    }
}

/// The writer (of `writers`) whose queue takes `account`'s requests.
fn writer_of(account: i64, writers: usize) -> usize {
    usize::try_from(account.unsigned_abs() % u64::try_from(writers).expect("BUG: writers beyond u64"))
        .expect("BUG: a remainder below usize")
}

/// The batch's answers as listed: those whose requests knew their listing as they are, one read
/// for all the others, or, if that read fails, one for each (so each caller gets its own error;
/// its request stays recorded either way).
async fn listed(
    pool: &deadpool_postgres::Pool,
    answers: Vec<Result<Requested, RequestError>>,
) -> Vec<Result<Answer, RequestError>> {
    let recorded: Vec<_> =
        answers.iter().flatten().filter(|r| r.extras.is_none()).map(|r| r.withdrawal.clone()).collect();
    let together = if recorded.is_empty() {
        Some(Vec::new()) // every request was refused: nothing to read
    } else {
        match pool.get().await {
            Ok(client) => listing::folded(&client, recorded).await.ok(),
            Err(_) => None,
        }
    };
    let mut together = together.map(Vec::into_iter);
    let mut out = Vec::with_capacity(answers.len());
    for answer in answers {
        out.push(match answer {
            Err(e) => Err(e),
            Ok(Requested { withdrawal, created, extras: Some(extras) }) => {
                Ok(Answer { listed: extras.listed(withdrawal), created })
            }
            Ok(requested) => match together.as_mut() {
                Some(read) => Ok(answer_of(read.next().expect("BUG: one listing per withdrawal"), requested.created)),
                None => one(pool, requested).await,
            },
        });
    }
    out
}

/// One answer read on its own.
async fn one(pool: &deadpool_postgres::Pool, requested: Requested) -> Result<Answer, RequestError> {
    let created = requested.created;
    let read = listing::folded(&pool.get().await?, vec![requested.withdrawal]).await?;
    Ok(answer_of(read.into_iter().next().expect("BUG: one listing per withdrawal"), created))
}

fn answer_of(listed: Option<Listed>, created: bool) -> Answer {
    Answer { listed: listed.expect("BUG: a recorded withdrawal has no projection row"), created }
}

#[cfg(test)]
mod tests {
    use super::writer_of;

    #[test]
    fn an_account_always_queues_for_the_same_writer_and_accounts_spread_over_all() {
        for writers in 1..=4 {
            let mut used = vec![false; writers];
            for account in [-3i64, 0, 1, 2, 3, 17, 64, i64::MAX, i64::MIN] {
                let writer = writer_of(account, writers);
                assert!(writer < writers);
                assert_eq!(writer, writer_of(account, writers), "account {account}");
                used[writer] = true;
            }
            assert!(used.iter().all(|u| *u), "{writers} writers: every one takes some account");
        }
    }
}
