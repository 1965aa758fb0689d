//! A lock-then-write transaction in two round trips instead of four: `BEGIN` travels with the
//! first statement, and `COMMIT` with the writes.
//!
//! tokio-postgres sends each request when its future is first polled and answers them in order,
//! so requests joined in one poll share a round trip. Opening with `Client::transaction` instead
//! waits for `BEGIN` on its own, and `Transaction::commit` waits again after the writes.
//!
//! The server runs pipelined statements one after another as usual: if one fails, the rest fail
//! with "current transaction is aborted" and the `COMMIT` behind them ends the transaction as a
//! rollback. [`Pipelined::commit_with`] therefore returns `Ok` only when every statement and the
//! commit succeeded.

use deadpool_postgres::Object;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Error, Row, Statement};

/// Parameters of one statement.
pub type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

/// Parameters of one statement, owned: for a write made while the transaction runs.
pub type OwnedParams = Vec<Box<dyn ToSql + Sync + Send>>;

/// What the producer of [`Pipelined::commit_produced`] gives next.
pub enum Produced {
    /// A statement's parameters: the write is sent at once.
    Write(OwnedParams),
    /// No more writes: the tail and `COMMIT` follow.
    Done,
    /// Nothing of this transaction may stay: `ROLLBACK` follows the writes already sent.
    Abandon,
}

/// One pooled connection inside a pipelined transaction.
///
/// # Cancel safety
/// Dropped before [`Pipelined::commit_with`] or [`Pipelined::rollback`] finished (a cancelled
/// future, an error returned early), the connection is taken out of the pool and closed rather
/// than handed back mid-transaction: the server rolls back and releases the locks. Nothing is
/// committed unless the commit succeeded.
pub struct Pipelined {
    client: Option<Object>,
}

impl Pipelined {
    /// Sends `BEGIN` and `statement` in one round trip; returns the statement's rows.
    ///
    /// Prepare `statement` (with `prepare_cached`) before calling: a statement prepared once per
    /// connection costs no round trip here. Every statement of the transaction runs its generic
    /// plan: they are meant to be short keyed statements, for which planning each execution
    /// afresh costs more than the execution itself.
    pub async fn begin_with(
        client: Object,
        statement: &Statement,
        params: Params<'_>,
    ) -> Result<(Pipelined, Vec<Row>), Error> {
        let (open, mut rows) = Pipelined::begin_with_all(client, &[(statement, params)]).await?;
        Ok((open, rows.pop().expect("BUG: one statement answers once")))
    }

    /// [`Pipelined::begin_with`] for several statements, run in order, all in the one round trip
    /// with `BEGIN`; returns each statement's rows. Each statement takes its own snapshot, so one
    /// that follows a `for update` sees whatever committed before that lock was granted.
    pub async fn begin_with_all(
        client: Object,
        statements: &[(&Statement, Params<'_>)],
    ) -> Result<(Pipelined, Vec<Vec<Row>>), Error> {
        let open = Pipelined { client: Some(client) };
        let rows = {
            let client = open.client();
            let reads = futures::future::try_join_all(statements.iter().map(|(s, p)| client.query(*s, p)));
            let (_, rows) = futures::try_join!(
                client.batch_execute("begin; set local plan_cache_mode = force_generic_plan"),
                reads
            )?;
            rows
        };
        Ok((open, rows))
    }

    /// A whole transaction in one round trip: `BEGIN`, `statements` in order, `COMMIT`; returns
    /// the rows each statement affected. `Ok` means committed. For a transaction whose checks are
    /// made by the server (a statement that raises to refuse): every answer is awaited, so after
    /// an error the connection is known to be outside a transaction and goes back to the pool.
    pub async fn once(client: Object, statements: &[(&Statement, Params<'_>)]) -> Result<Vec<u64>, Error> {
        Ok(Pipelined::once_inner(client, statements, None).await?.0)
    }

    /// [`Pipelined::once`], with `read` run after the writes and before `COMMIT`, in the same
    /// round trip: what the transaction wrote as it will be committed (its timestamp, say).
    /// Returns the rows each write affected and `read`'s rows.
    pub async fn once_reading(
        client: Object,
        statements: &[(&Statement, Params<'_>)],
        read: (&Statement, Params<'_>),
    ) -> Result<(Vec<u64>, Vec<Row>), Error> {
        let (affected, rows) = Pipelined::once_inner(client, statements, Some(read)).await?;
        Ok((affected, rows.expect("BUG: a read was asked for")))
    }

    async fn once_inner(
        client: Object,
        statements: &[(&Statement, Params<'_>)],
        read: Option<(&Statement, Params<'_>)>,
    ) -> Result<(Vec<u64>, Option<Vec<Row>>), Error> {
        let mut open = Pipelined { client: Some(client) };
        let (begun, affected, rows, committed) = {
            let client = open.client();
            let writes = futures::future::join_all(statements.iter().map(|(s, p)| client.execute(*s, p)));
            let read = async {
                match read {
                    Some((s, p)) => client.query(s, p).await.map(Some),
                    None => Ok(None),
                }
            };
            futures::join!(
                client.batch_execute("begin; set local plan_cache_mode = force_generic_plan"),
                writes,
                read,
                client.batch_execute("commit")
            )
        };
        // Every request was answered: COMMIT ended the transaction, as a rollback if anything
        // before it failed.
        open.finish();
        begun?;
        let affected = affected.into_iter().collect::<Result<Vec<u64>, Error>>()?;
        let rows = rows?;
        committed?;
        Ok((affected, rows))
    }

    /// Reads in one round trip, each with a generic plan: `BEGIN`, `plan_cache_mode =
    /// force_generic_plan` for the transaction, `statements`, `COMMIT`. For statements whose best
    /// plan does not depend on their parameters (each key probed on its own, `lateral … offset
    /// 0`), which in auto mode would be planned anew on every call once their custom plans look
    /// cheaper than the generic one. Every answer is awaited, so after an error the connection is
    /// outside a transaction.
    pub async fn read_generic(
        client: &Object,
        statements: &[(&Statement, Params<'_>)],
    ) -> Result<Vec<Vec<Row>>, Error> {
        let (begun, rows, committed) = futures::join!(
            client.batch_execute("begin; set local plan_cache_mode = force_generic_plan"),
            futures::future::join_all(statements.iter().map(|(s, p)| client.query(*s, p))),
            client.batch_execute("commit")
        );
        begun?;
        let rows = rows.into_iter().collect::<Result<Vec<Vec<Row>>, Error>>()?;
        committed?;
        Ok(rows)
    }

    /// Runs `statement` inside the transaction (its own round trip), planned for its parameters
    /// rather than generically: for the larger read a lock-then-write transaction sometimes needs
    /// in between.
    pub async fn query(&self, statement: &Statement, params: Params<'_>) -> Result<Vec<Row>, Error> {
        let client = self.client();
        let (_, rows, _) = futures::try_join!(
            client.batch_execute("set local plan_cache_mode = auto"),
            client.query(statement, params),
            client.batch_execute("set local plan_cache_mode = force_generic_plan"),
        )?;
        Ok(rows)
    }

    /// The connection, while the transaction is open.
    fn client(&self) -> &Object {
        self.client.as_ref().expect("BUG: a finished pipelined transaction was used")
    }

    /// Runs `statements` in order and `COMMIT`, all in one round trip; returns the rows each
    /// statement affected. `Ok` means committed.
    pub async fn commit_with(mut self, statements: &[(&Statement, Params<'_>)]) -> Result<Vec<u64>, Error> {
        let affected = {
            let client = self.client();
            let writes = futures::future::try_join_all(statements.iter().map(|(s, p)| client.execute(*s, p)));
            let (affected, ()) = futures::try_join!(writes, client.batch_execute("commit"))?;
            affected
        };
        self.finish();
        Ok(affected)
    }

    /// Runs `statement` once for each parameter set `next` makes, sending each as soon as it is
    /// made, so the server executes one write while `next` prepares the one after (signs it, say);
    /// then, once `next` says [`Produced::Done`], `tail` and `COMMIT` behind the last, in the same
    /// round trip. Returns the rows each write and each of `tail` affected: `Some` means committed.
    /// When `next` says [`Produced::Abandon`] instead, `ROLLBACK` follows the writes already sent
    /// and the answer is `None`: nothing was committed.
    pub async fn commit_produced(
        mut self,
        statement: &Statement,
        mut next: impl FnMut() -> Produced,
        tail: &[(&Statement, Params<'_>)],
    ) -> Result<Option<Vec<u64>>, Error> {
        use futures::StreamExt;
        let ended = {
            let client = self.client();
            let mut in_flight = futures::stream::FuturesOrdered::new();
            let mut answered = Vec::new();
            let commit = loop {
                match next() {
                    Produced::Write(params) => in_flight.push_back(client.execute_raw(statement, params)),
                    Produced::Done => break true,
                    Produced::Abandon => break false,
                }
                // Polled once, the write is on its way; answers that already came are kept.
                futures::future::poll_fn(|cx| {
                    while let std::task::Poll::Ready(Some(answer)) = in_flight.poll_next_unpin(cx) {
                        answered.push(answer);
                    }
                    std::task::Poll::Ready(())
                })
                .await;
                // The request is queued for the connection's task, which writes it to the socket;
                // woken from a task on a runtime thread, that task waits in the thread's next-task
                // slot, which no other thread takes, until this one yields. Without the yield, a
                // producer that blocks its thread (signing) sent every write only once it was done.
                tokio::task::yield_now().await;
            };
            if commit {
                let tail = futures::future::join_all(tail.iter().map(|(s, p)| client.execute(*s, p)));
                let (rest, tail, committed) =
                    futures::join!(in_flight.collect::<Vec<_>>(), tail, client.batch_execute("commit"));
                // The first error is what failed: every statement after it, and the commit, failed
                // (or rolled back) because of it.
                answered
                    .into_iter()
                    .chain(rest)
                    .chain(tail)
                    .collect::<Result<Vec<u64>, Error>>()
                    .and_then(|affected| committed.map(|()| Some(affected)))
            } else {
                // What the writes answered no longer matters: none of it stays.
                let (_, rolled_back) = futures::join!(in_flight.collect::<Vec<_>>(), client.batch_execute("rollback"));
                rolled_back.map(|()| None)
            }
        };
        // Every request was answered: the transaction is over either way.
        self.finish();
        ended
    }

    /// Ends the transaction without writing anything.
    pub async fn rollback(mut self) -> Result<(), Error> {
        self.client().batch_execute("rollback").await?;
        self.finish();
        Ok(())
    }

    /// Hands the connection back to the pool, outside any transaction.
    fn finish(&mut self) {
        drop(self.client.take());
    }
}

impl Drop for Pipelined {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            // Still inside the transaction: close the connection instead of pooling it.
            drop(Object::take(client));
        }
    }
}
