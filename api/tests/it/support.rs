//! Shared set-up: a server on a free port over a test database, tokens, clients, funded accounts
//! and anvil's development keys.

use std::collections::HashMap;
use std::time::Duration;

use bitcoin::bip32::{DerivationPath, Xpriv, Xpub};
use bitcoin::secp256k1::Secp256k1;
use bitcoin::NetworkKind;
use custodian_api::pb::accounts_client::AccountsClient;
use custodian_api::pb::admin_client::AdminClient;
use custodian_api::pb::audit_client::AuditClient;
use custodian_api::pb::health_client::HealthClient;
use custodian_api::pb::withdrawals_client::WithdrawalsClient;
use custodian_api::tokens::{self, Scope};
use custodian_api::{pb, serve, ApiConfig, ApiError};
use custodian_domain::hd::{DepositKey, EthDepositKey};
use custodian_domain::{BtcNetwork, Chain};
use custodian_testkit::TestDb;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

/// Anvil's and Hardhat's development mnemonic: its m/44'/60'/0'/0/i keys are anvil's funded
/// accounts, so the deposit addresses derived from its account key are those accounts.
pub const DEV_MNEMONIC: &str = "test test test test test test test test test test test junk";
/// The account key at m/44'/60'/0' of [`DEV_MNEMONIC`], as `custodian_domain::hd`'s tests know it.
pub const DEV_ETH_XPUB: &str =
    "xpub6Ce9NcJvTk36xtLSrJLZqE7wtgA5deCeYs7rSQtreh4cj6ByPtrg9sD7V2FNFLPnf8heNP3FGkeV9qwfzvZNSd54JoNXVsXFYSYwHsnJxqP";
/// Anvil's dev account 0: funds everything.
pub const FUNDER: &str = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266";
/// Anvil's dev account 1 and its key: the hot wallet of lane `a`.
pub const HOT_WALLET: &str = "0x70997970c51812dc3a010c7d01b50e0d17dc79c8";
/// Wei per ether.
pub const ETHER: u128 = 1_000_000_000_000_000_000;

/// The dev mnemonic's account-level ETH key, m/44'/60'/0', derived here from the seed.
pub fn dev_eth_xpub() -> Xpub {
    let secp = Secp256k1::new();
    let master = Xpriv::new_master(NetworkKind::Main, &custodian_testkit::fixtures::bip39_seed(DEV_MNEMONIC))
        .expect("valid seed");
    let path: DerivationPath = "m/44'/60'/0'".parse().expect("valid path");
    let xpub = Xpub::from_priv(&secp, &master.derive_priv(&secp, &path).expect("derivable"));
    assert_eq!(xpub.to_string(), DEV_ETH_XPUB, "BIP-39 and BIP-32 derivation of the dev mnemonic");
    xpub
}

/// The ETH address at m/44'/60'/0'/0/{index}, derived from `xpub` without Custodian's code.
pub fn eth_address_at(xpub: &Xpub, index: u32) -> String {
    use bitcoin::bip32::ChildNumber;
    let child = xpub
        .derive_pub(&Secp256k1::verification_only(), &[ChildNumber::Normal { index: 0 }, ChildNumber::Normal { index }])
        .expect("derivable");
    let public_key = child.public_key.serialize_uncompressed();
    alloy_primitives::Address::from_raw_public_key(&public_key[1..]).to_checksum(None)
}

/// A configuration with the dev ETH key, no BTC key and a rate limit no test reaches.
pub fn config() -> ApiConfig {
    let key = EthDepositKey::parse(&dev_eth_xpub().to_string()).expect("a valid account xpub");
    ApiConfig {
        requests_per_second: 100_000,
        burst: 100_000,
        peer_requests_per_second: 100_000,
        peer_burst: 100_000,
        ..ApiConfig::with_defaults(HashMap::from([(Chain::Eth, DepositKey::from(key))]), BtcNetwork::Regtest)
    }
}

/// A running API over its own database.
pub struct Api {
    pub db: TestDb,
    pub channel: Channel,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<Result<(), ApiError>>>,
}

impl Api {
    /// Starts the API with [`config`].
    pub async fn start() -> Api {
        Api::start_with(config()).await
    }

    /// Starts the API on 127.0.0.1, port 0, over a fresh database.
    pub async fn start_with(config: ApiConfig) -> Api {
        Api::start_on(TestDb::new().await, config).await
    }

    /// Starts the API over `db`.
    pub async fn start_on(db: TestDb, config: ApiConfig) -> Api {
        let pool = db.pool.clone();
        Api::start_on_pool(db, pool, config).await
    }

    /// Starts the API over `db`, with `pool` as the API's own connections.
    pub async fn start_on_pool(db: TestDb, pool: custodian_store::Pool, config: ApiConfig) -> Api {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind a free port");
        let address = listener.local_addr().expect("bound address");
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, pool, config, async move {
            let _ = stopped.await;
        }));
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
            .expect("a valid URI")
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await
            .expect("connect to the API");
        Api { db, channel, stop: Some(stop), server: Some(server) }
    }

    /// Creates a token with `scopes` directly in the database, as `custodian token create` does.
    pub async fn token(&self, name: &str, scopes: &[Scope]) -> String {
        tokens::create(&self.db.pool.get().await.unwrap(), name, scopes, tokens::BOOTSTRAP_PRINCIPAL)
            .await
            .expect("create a token")
    }

    /// A token with every scope.
    pub async fn root_token(&self) -> String {
        self.token("root", &Scope::ALL).await
    }

    pub fn health(&self) -> HealthClient<Channel> {
        HealthClient::new(self.channel.clone())
    }
    pub fn accounts(&self) -> AccountsClient<Channel> {
        AccountsClient::new(self.channel.clone())
    }
    pub fn withdrawals(&self) -> WithdrawalsClient<Channel> {
        WithdrawalsClient::new(self.channel.clone())
    }
    pub fn audit(&self) -> AuditClient<Channel> {
        AuditClient::new(self.channel.clone())
    }
    pub fn admin(&self) -> AdminClient<Channel> {
        AdminClient::new(self.channel.clone())
    }

    /// Signals shutdown and waits for `serve` to return.
    pub async fn stop(&mut self) -> Result<(), ApiError> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.server.take() {
            Some(server) => tokio::time::timeout(Duration::from_secs(10), server)
                .await
                .expect("serve returns within 10 s of shutdown")
                .expect("the server task does not panic"),
            None => Ok(()),
        }
    }

    /// Creates an account through the API and returns its id.
    pub async fn account(&self, token: &str, external_ref: &str) -> i64 {
        let response = self
            .accounts()
            .create_account(authed(token, pb::CreateAccountRequest { external_ref: external_ref.into() }))
            .await
            .expect("create an account");
        response.into_inner().account.expect("an account").id
    }

    /// Credits `account` with `wei` by a deposit fact and its posted transfer, as the posting
    /// pass would (for tests that are not about deposits). `n` keeps facts of one account apart.
    pub async fn credit(&self, account: i64, n: u32, wei: u128) {
        custodian_testkit::fixtures::credit_eth(&self.db.client().await, account, n, wei).await;
    }

    /// Registers anvil's dev account 1 as lane `a` without asking a node (its nonce starts at 0).
    pub async fn hot_wallet(&self) {
        self.db
            .pool
            .get()
            .await
            .unwrap()
            .execute(
                "insert into hot_wallet (chain, address, lane, next_nonce) values ('eth', $1, 'a', 0)",
                &[&HOT_WALLET],
            )
            .await
            .expect("register the hot wallet");
    }
}

impl Drop for Api {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// `message` with `authorization: Bearer <token>`.
pub fn authed<T>(token: &str, message: T) -> Request<T> {
    let mut request = Request::new(message);
    request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().expect("ASCII metadata"));
    request
}

/// Asserts `result` failed with `code` and a message containing every one of `words`.
#[track_caller]
pub fn assert_status<T: std::fmt::Debug>(result: Result<T, Status>, code: Code, words: &[&str]) -> Status {
    let status = result.expect_err("the call should fail");
    assert_eq!(status.code(), code, "unexpected status: {status:?}");
    for word in words {
        assert!(status.message().contains(word), "{:?} should mention {word:?}", status.message());
    }
    status
}

/// A withdrawal request of `amount_units` wei of ETH.
pub fn withdrawal_request(
    account_id: i64,
    external_id: &str,
    destination: &str,
    wei: u128,
) -> pb::RequestWithdrawalRequest {
    pb::RequestWithdrawalRequest {
        account_id,
        external_id: external_id.into(),
        asset: "ETH".into(),
        destination: destination.into(),
        amount: Some(pb::request_withdrawal_request::Amount::AmountUnits(wei.to_string())),
    }
}
