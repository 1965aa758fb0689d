//! `Health`: whether the server can reach its database. Needs no token, so load balancers and
//! orchestrators can ask.

use std::sync::Arc;
use std::time::Duration;

use tonic::{Request, Response, Status};

use crate::pb::{self, CheckRequest, CheckResponse};
use crate::State;

/// How long a health check waits for the database before answering "not serving".
const DATABASE_TIMEOUT: Duration = Duration::from_secs(2);

/// The `Health` service.
#[derive(Debug)]
pub(crate) struct HealthService {
    state: Arc<State>,
}

impl HealthService {
    pub(crate) fn new(state: Arc<State>) -> Self {
        HealthService { state }
    }
}

#[tonic::async_trait]
impl pb::health_server::Health for HealthService {
    async fn check(&self, _request: Request<CheckRequest>) -> Result<Response<CheckResponse>, Status> {
        let database = async {
            let client = self.state.pool.get().await.ok()?;
            client.query_one("select 1", &[]).await.ok()
        };
        let serving = matches!(tokio::time::timeout(DATABASE_TIMEOUT, database).await, Ok(Some(_)));
        Ok(Response::new(CheckResponse { serving }))
    }
}
