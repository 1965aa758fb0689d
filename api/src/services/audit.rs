//! `Audit`: the history of every appended fact as a server stream that resumes from a position.
//!
//! The stream reads `custodian_projections::history::page` in a loop. A page holds only settled
//! facts (written by transactions older than every running one) in (transaction, position)
//! order, an order that never changes; so resuming after the last position received neither
//! skips nor repeats a fact. Caught up, the loop sleeps briefly and asks again.

use std::sync::Arc;
use std::time::Duration;

use custodian_projections::history::{self, Fact};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::auth::Caller;
use crate::pb::{self, Event, StreamEventsRequest};
use crate::tokens::Scope;
use crate::{status, time, State};

/// Facts read per query.
const PAGE_FACTS: i64 = 500;
/// Facts buffered towards a slow client before the reader waits for it.
const STREAM_BUFFER: usize = 64;
/// How long a caught-up stream waits before asking for new facts.
const POLL_INTERVAL: Duration = Duration::from_millis(200);
/// How long the closing status waits for room in a slow client's buffer.
const CLOSING_STATUS_TIMEOUT: Duration = Duration::from_secs(5);

/// The `Audit` service.
#[derive(Debug)]
pub(crate) struct AuditService {
    state: Arc<State>,
}

impl AuditService {
    pub(crate) fn new(state: Arc<State>) -> Self {
        AuditService { state }
    }
}

fn event(fact: Fact) -> Event {
    Event {
        position: fact.position,
        kind: fact.kind,
        // PostgreSQL's text form in the session's time zone; shown in UTC like every other time.
        recorded_at: time::parse(&fact.recorded_at).map_or(fact.recorded_at, time::format),
        payload_json: fact.payload.to_string(),
    }
}

/// Resolves once the server is shutting down (or the signal is gone).
async fn stopped(stopping: &mut watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

/// Where a stream stands, and where it sends.
struct Follower {
    state: Arc<State>,
    sender: mpsc::Sender<Result<Event, Status>>,
    stopping: watch::Receiver<bool>,
    /// Whose token opened the stream: it ends once that token is revoked.
    caller: Caller,
    /// The last position sent.
    after: Option<i64>,
    until_caught_up: bool,
}

/// Why a follower stopped sending.
enum End {
    /// The client went away or the stream is complete.
    Done,
    /// The server is shutting down or the database failed: say so, with where to resume.
    Failed(Status),
}

impl Follower {
    fn resume_hint(&self) -> String {
        match self.after {
            Some(position) => format!("resume with after_position {position}"),
            None => "resume from the beginning".to_owned(),
        }
    }

    /// Sends `facts` in order; `Done` if the client went away.
    async fn send(&mut self, facts: Vec<Fact>) -> Result<(), End> {
        for fact in facts {
            // Checked per fact (against the cached snapshot), so a revoked token's stream stops
            // within the snapshot's age even in the middle of a page.
            if let Err(status) = self.state.auth.still_active(&self.caller).await {
                return Err(End::Failed(Status::new(
                    status.code(),
                    format!("{}; {}", status.message(), self.resume_hint()),
                )));
            }
            let position = fact.position;
            tokio::select! {
                sent = self.sender.send(Ok(event(fact))) => sent.map_err(|_| End::Done)?,
                () = stopped(&mut self.stopping) => return Err(self.shutting_down()),
            }
            self.after = Some(position);
        }
        Ok(())
    }

    fn shutting_down(&self) -> End {
        End::Failed(Status::unavailable(format!("the server is shutting down; {}", self.resume_hint())))
    }

    async fn next_page(&self) -> Result<Vec<Fact>, End> {
        let client = self.state.pool.get().await.map_err(|e| End::Failed(status::pool(&e)))?;
        history::page(&client, self.after, PAGE_FACTS).await.map_err(|e| {
            let status = status::history(e, "after_position");
            End::Failed(Status::new(status.code(), format!("{}; {}", status.message(), self.resume_hint())))
        })
    }

    /// Sends pages until the client leaves, the history is read (`until_caught_up`), the server
    /// stops or the database fails.
    async fn run(&mut self, mut page: Vec<Fact>) -> End {
        loop {
            if let Err(status) = self.state.auth.still_active(&self.caller).await {
                return End::Failed(Status::new(
                    status.code(),
                    format!("{}; {}", status.message(), self.resume_hint()),
                ));
            }
            let caught_up = page.len() < usize::try_from(PAGE_FACTS).expect("BUG: page size is positive");
            if let Err(end) = self.send(page).await {
                return end;
            }
            if caught_up {
                if self.until_caught_up {
                    return End::Done;
                }
                tokio::select! {
                    () = tokio::time::sleep(POLL_INTERVAL) => {}
                    () = self.sender.closed() => return End::Done,
                    () = stopped(&mut self.stopping) => return self.shutting_down(),
                }
            }
            page = match self.next_page().await {
                Ok(page) => page,
                Err(end) => return end,
            };
        }
    }
}

#[tonic::async_trait]
impl pb::audit_server::Audit for AuditService {
    type StreamEventsStream = ReceiverStream<Result<Event, Status>>;

    async fn stream_events(
        &self,
        request: Request<StreamEventsRequest>,
    ) -> Result<Response<Self::StreamEventsStream>, Status> {
        let caller = self.state.auth.authorize(&request, Scope::Read, "StreamEvents").await?;
        let message = request.into_inner();
        // The first page is read before the stream starts, so an unknown position or a database
        // failure is the call's status rather than a stream that ends at once.
        let first = {
            let client = self.state.client().await?;
            history::page(&client, message.after_position, PAGE_FACTS)
                .await
                .map_err(|e| status::history(e, "after_position"))?
        };
        let (sender, receiver) = mpsc::channel(STREAM_BUFFER);
        let mut follower = Follower {
            state: self.state.clone(),
            sender,
            stopping: self.state.stopping.clone(),
            caller,
            after: message.after_position,
            until_caught_up: message.until_caught_up,
        };
        tokio::spawn(async move {
            if let End::Failed(status) = follower.run(first).await {
                // The client may be gone already, or not reading; then nobody hears it.
                let _ = tokio::time::timeout(CLOSING_STATUS_TIMEOUT, follower.sender.send(Err(status))).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(receiver)))
    }
}
