//! `Admin`: the operators' controls over hot-wallet lanes and webhook subscribers.

use std::sync::Arc;

use custodian_domain::Chain;
use custodian_withdrawals::hot_wallet::{self, Lane};
use deadpool_postgres::GenericClient;
use tonic::{Request, Response, Status};

use crate::pb;
use crate::tokens::Scope;
use crate::webhooks;
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
        address: lane.address.to_checksummed(),
        lane: lane.lane.to_string(),
        next_nonce: lane.next_nonce.stored(),
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

fn webhook(s: webhooks::Subscriber) -> pb::Webhook {
    pb::Webhook {
        id: s.id,
        url: s.url,
        kinds: s.kinds,
        paused: s.state == "paused",
        paused_reason: s.paused_reason,
        cursor: s.cursor,
        delivered: s.delivered,
        attempts: s.attempts,
        last_error: s.last_error,
        backlog: s.backlog.unwrap_or(0),
        created_by: s.created_by,
        created_at: s.created_at,
    }
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

    async fn add_webhook(
        &self,
        request: Request<pb::AddWebhookRequest>,
    ) -> Result<Response<pb::AddWebhookResponse>, Status> {
        let caller = self.state.auth.authorize(&request, Scope::Admin, "AddWebhook").await?;
        let message = request.get_ref();
        let kinds = webhooks::parse_kinds(&message.kinds.join(",")).map_err(status::webhook)?;
        let mut client = self.state.client().await?;
        let added = webhooks::add(
            &mut client,
            &message.url,
            &kinds,
            message.secret.as_deref(),
            message.from_start,
            &caller.name,
        )
        .await
        .map_err(status::webhook)?;
        Ok(Response::new(pb::AddWebhookResponse { webhook: Some(webhook(added.subscriber)), secret: added.secret }))
    }

    async fn list_webhooks(
        &self,
        request: Request<pb::ListWebhooksRequest>,
    ) -> Result<Response<pb::ListWebhooksResponse>, Status> {
        self.state.auth.authorize(&request, Scope::Admin, "ListWebhooks").await?;
        let client = self.state.client().await?;
        let all = webhooks::list(&client).await.map_err(status::webhook)?;
        Ok(Response::new(pb::ListWebhooksResponse { webhooks: all.into_iter().map(webhook).collect() }))
    }

    async fn pause_webhook(&self, request: Request<pb::PauseWebhookRequest>) -> Result<Response<pb::Webhook>, Status> {
        let caller = self.state.auth.authorize(&request, Scope::Admin, "PauseWebhook").await?;
        let message = request.get_ref();
        let reason = wire::required(&message.reason, "reason")?;
        let mut client = self.state.client().await?;
        let paused =
            webhooks::set_paused(&mut client, message.id, Some(reason), &caller.name).await.map_err(status::webhook)?;
        Ok(Response::new(webhook(paused)))
    }

    async fn resume_webhook(
        &self,
        request: Request<pb::ResumeWebhookRequest>,
    ) -> Result<Response<pb::Webhook>, Status> {
        let caller = self.state.auth.authorize(&request, Scope::Admin, "ResumeWebhook").await?;
        let mut client = self.state.client().await?;
        let resumed = webhooks::set_paused(&mut client, request.get_ref().id, None, &caller.name)
            .await
            .map_err(status::webhook)?;
        Ok(Response::new(webhook(resumed)))
    }

    async fn remove_webhook(
        &self,
        request: Request<pb::RemoveWebhookRequest>,
    ) -> Result<Response<pb::RemoveWebhookResponse>, Status> {
        let caller = self.state.auth.authorize(&request, Scope::Admin, "RemoveWebhook").await?;
        let mut client = self.state.client().await?;
        webhooks::remove(&mut client, request.get_ref().id, &caller.name).await.map_err(status::webhook)?;
        Ok(Response::new(pb::RemoveWebhookResponse {}))
    }
}
