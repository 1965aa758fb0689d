//! Requests that concurrent callers make at the same moment, recorded together: one transaction
//! and one commit for as many as arrived while the previous batch was being written
//! ([`request::request_batch`]). A commit waits for the disk; callers that would each have waited
//! for their own share one wait instead, and requests of one account no longer queue one commit
//! apart behind its lock.
//!
//! Each answer is sent only after its batch committed (or its request was refused): a request is
//! durable before it is acknowledged, as on its own.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, Mutex};

use crate::request::{self, Request, RequestError, Requested};

type Reply = oneshot::Sender<Result<Requested, RequestError>>;

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
                    let answers = request::request_batch(&pool, &requests).await;
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
    pub async fn request(&self, request: Request) -> Result<Requested, RequestError> {
        let (reply, answer) = oneshot::channel();
        self.queue.send((request, reply)).await.map_err(|_| RequestError::ShuttingDown)?;
        answer.await.map_err(|_| RequestError::ShuttingDown)?
    }
}
