//! What a scanner of the service does after every step: post the deposits that became
//! confirmed, and seal what the step appended into the history's hash chain.

use custodian_domain::Chain;
use custodian_ingest::AfterStep;

/// Posts confirmed deposits after every scan step; a failure is logged and retried next step.
pub struct PostAfterStep(pub custodian_store::Pool);

impl AfterStep for PostAfterStep {
    fn after_step(&self, chain: Chain) -> futures::future::BoxFuture<'_, ()> {
        Box::pin(async move {
            let outcome = match self.0.get().await {
                Ok(client) => {
                    match custodian_projections::posting::post_chain(&client, chain).await {
                        // What the step and the pass appended is sealed into the history's hash chain.
                        Ok(_) => {
                            custodian_projections::seals::seal(&client).await.map(|_| ()).map_err(|e| e.to_string())
                        }
                        Err(e) => Err(e.to_string()),
                    }
                }
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = outcome {
                tracing::warn!(%chain, "posting confirmed deposits or sealing failed; retried after the next step: {e}");
            }
        })
    }
}
