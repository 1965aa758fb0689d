//! Requests that concurrent callers make at the same moment, recorded together: one transaction
//! and one commit for as many as arrived while the previous batch was being written
//! ([`request::request_batch`]). A commit waits for the disk; callers that would each have waited
//! for their own share one wait instead, and requests of one account no longer queue one commit
//! apart behind its lock.
//!
//! Each answer is sent only after its batch committed (or its request was refused): a request is
//! durable before it is acknowledged, as on its own. An answer is the withdrawal as listed, read
//! for the whole batch in one round trip.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Mutex};

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
    queue: mpsc::Sender<(Request, Reply)>,
}

impl Coalescer {
    /// Starts `writers` tasks, each taking up to `batch_max` waiting requests at a time. They end
    /// when every clone of the coalescer is dropped.
    pub fn start(pool: deadpool_postgres::Pool, writers: usize, batch_max: usize) -> Coalescer {
        let (queue, waiting) = mpsc::channel::<(Request, Reply)>(batch_max.max(1) * writers.max(1) * 4);
        let waiting = Arc::new(Mutex::new(waiting));
        for _ in 0..writers.max(1) {
            let (pool, waiting) = (pool.clone(), waiting.clone());
            tokio::spawn(async move {
                loop {
                    let mut batch = Vec::new();
                    {
                        // One writer takes what is waiting; the others wait for the next.
                        let mut waiting = waiting.lock().await;
                        match waiting.recv().await {
                            Some(first) => batch.push(first),
                            None => return,
                        }
                        while batch.len() < batch_max {
                            match waiting.try_recv() {
                                Ok(next) => batch.push(next),
                                Err(_) => break,
                            }
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
        }
        Coalescer { queue }
    }

    /// Records `request` with whatever others are waiting, or returns the earlier one with the
    /// same external id and payload; answered once its batch committed.
    ///
    /// # Cancel safety
    /// Cancelled after the request was queued, the request may still be recorded: a retry with
    /// the same external id returns it.
    pub async fn request(&self, request: Request) -> Result<Answer, RequestError> {
        let (reply, answer) = oneshot::channel();
        self.queue.send((request, reply)).await.map_err(|_| RequestError::ShuttingDown)?;
        answer.await.map_err(|_| RequestError::ShuttingDown)?
    }
}

/// The batch's answers as listed: one read for all that were recorded, or, if that read fails,
/// one for each (so each caller gets its own error; its request stays recorded either way).
async fn listed(
    pool: &deadpool_postgres::Pool,
    answers: Vec<Result<Requested, RequestError>>,
) -> Vec<Result<Answer, RequestError>> {
    let recorded: Vec<_> = answers.iter().flatten().map(|r| r.withdrawal.clone()).collect();
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
