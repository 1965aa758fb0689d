//! What a scanner of the service does after every step: post the deposits that became
//! confirmed, and seal what the step appended into the history's hash chain.

use custodian_domain::Chain;
use custodian_ingest::AfterStep;
use custodian_projections::posting::{ChainPasses, WHOLE_PASS_EVERY};
use tokio::sync::Mutex;

/// Posts confirmed deposits after every scan step; a failure is logged and retried next step.
/// A chain's passes run one at a time and, between whole passes, derive only what changed since
/// the previous one ([`ChainPasses`]).
pub struct PostAfterStep {
    pool: custodian_store::Pool,
    passes: [Mutex<ChainPasses>; 2],
}

impl PostAfterStep {
    pub fn new(pool: custodian_store::Pool) -> Self {
        let passes = Chain::ALL.map(|chain| Mutex::new(ChainPasses::new(chain, WHOLE_PASS_EVERY)));
        Self { pool, passes }
    }
}

impl AfterStep for PostAfterStep {
    fn after_step(&self, chain: Chain) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(async move {
            let index = Chain::ALL.iter().position(|c| *c == chain).expect("BUG: a chain outside Chain::ALL");
            let mut passes = self.passes[index].lock().await;
            let outcome = match self.pool.get().await {
                Ok(client) => match passes.run(&client).await {
                    // What the step and the pass appended is sealed into the history's hash chain.
                    Ok(_) => custodian_projections::seals::seal(&client).await.map(|_| ()).map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                },
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = outcome {
                tracing::warn!(%chain, "posting confirmed deposits or sealing failed; retried after the next step: {e}");
            }
        })
    }
}
