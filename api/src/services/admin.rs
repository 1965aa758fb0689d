//! `Admin`: the operators' controls over hot-wallet lanes.

use std::sync::Arc;

use custodian_domain::Chain;
use custodian_withdrawals::hot_wallet::{self, Lane};
use deadpool_postgres::GenericClient;
use tonic::{Request, Response, Status};

use crate::pb;
use crate::tokens::Scope;
use crate::{status, wire, State};

/// The `Admin` service.
#[derive(Debug)]
pub(crate) struct AdminService {
    state: Arc<State>,
}

impl AdminService {
    pub(crate) fn new(state: Arc<State>) -> Self {
        AdminService { state }
    }
}

fn hot_wallet(lane: Lane) -> pb::HotWallet {
    pb::HotWallet {
        chain: wire::chain_to_pb(Chain::Eth),
        address: wire::display_address(Chain::Eth, &lane.address),
        lane: lane.lane,
        next_nonce: lane.next_nonce,
        paused: lane.pause_reason.is_some(),
        pause_reason: lane.pause_reason,
    }
}

async fn lanes<C: GenericClient>(client: &C) -> Result<Vec<Lane>, Status> {
    hot_wallet::lanes(client).await.map_err(|e| status::database("listing hot wallets", &e))
}

/// Pauses (`Some(reason)`) or resumes a lane and returns it as it is now.
async fn set_paused(state: &State, lane: &str, reason: Option<&str>, by: &str) -> Result<pb::HotWallet, Status> {
    let mut client = state.client().await?;
    hot_wallet::set_paused(&mut client, lane, reason, by).await.map_err(status::hot_wallet)?;
    lanes(&client)
        .await?
        .into_iter()
        .find(|l| l.lane == lane)
        .map(hot_wallet)
        .ok_or_else(|| Status::not_found(format!("no hot-wallet lane named {lane:?}")))
}

#[tonic::async_trait]
impl pb::admin_server::Admin for AdminService {
    async fn list_hot_wallets(
        &self,
        request: Request<pb::ListHotWalletsRequest>,
    ) -> Result<Response<pb::ListHotWalletsResponse>, Status> {
        self.state.auth.authorize(&request, Scope::Admin, "ListHotWallets").await?;
        let client = self.state.client().await?;
        let hot_wallets = lanes(&client).await?.into_iter().map(hot_wallet).collect();
        Ok(Response::new(pb::ListHotWalletsResponse { hot_wallets }))
    }

    async fn pause_lane(&self, request: Request<pb::PauseLaneRequest>) -> Result<Response<pb::HotWallet>, Status> {
        let caller = self.state.auth.authorize(&request, Scope::Admin, "PauseLane").await?;
        let message = request.get_ref();
        let lane = wire::required(&message.lane, "lane")?;
        let reason = wire::required(&message.reason, "reason")?;
        let paused = set_paused(&self.state, lane, Some(reason), &caller.name).await?;
        tracing::warn!(lane, reason, token = caller.name, "lane paused through the API");
        Ok(Response::new(paused))
    }

    async fn resume_lane(&self, request: Request<pb::ResumeLaneRequest>) -> Result<Response<pb::HotWallet>, Status> {
        let caller = self.state.auth.authorize(&request, Scope::Admin, "ResumeLane").await?;
        let lane = wire::required(&request.get_ref().lane, "lane")?;
        let resumed = set_paused(&self.state, lane, None, &caller.name).await?;
        tracing::warn!(lane, token = caller.name, "lane resumed through the API");
        Ok(Response::new(resumed))
    }
}
