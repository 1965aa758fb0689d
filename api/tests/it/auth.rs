//! Bearer tokens: presence, validity, revocation, scopes and the per-token rate limit.

use std::time::Duration;

use bitcoin::hashes::{sha256, Hash};
use custodian_api::pb;
use custodian_api::tokens::{self, Scope, TokenError};
use tonic::{Code, Request, Status};

use crate::support::{assert_status, authed, config, Api};

#[tokio::test]
async fn calls_without_a_valid_token_are_unauthenticated() {
    let api = Api::start().await;
    let token = api.token("client", &[Scope::Read]).await;
    let get = |request: Request<pb::GetAccountRequest>| {
        let mut accounts = api.accounts();
        async move { accounts.get_account(request).await }
    };
    let message = || pb::GetAccountRequest { key: Some(pb::get_account_request::Key::Id(1)) };

    assert_status(get(Request::new(message())).await, Code::Unauthenticated, &["no API token", "Bearer"]);
    let mut basic = Request::new(message());
    basic.metadata_mut().insert("authorization", format!("Basic {token}").parse().unwrap());
    assert_status(get(basic).await, Code::Unauthenticated, &["Bearer <token>"]);
    assert_status(get(authed("nope", message())).await, Code::Unauthenticated, &["malformed"]);
    let unknown = format!("cust_{}", "ab".repeat(32));
    assert_status(get(authed(&unknown, message())).await, Code::Unauthenticated, &["not a known API token"]);

    // The token works until it is revoked, and within a second of that no more.
    assert_status(get(authed(&token, message())).await, Code::NotFound, &["no account has id 1"]);
    assert!(tokens::revoke(&api.db.pool.get().await.unwrap(), "client", "ops").await.unwrap());
    let revoked_at = std::time::Instant::now();
    let refused = custodian_testkit::eventually("the revocation to take effect", Duration::from_secs(1), || async {
        get(authed(&token, message())).await.err().filter(|status| status.code() == Code::Unauthenticated)
    })
    .await;
    assert!(revoked_at.elapsed() < Duration::from_secs(1));
    assert_status(Err::<(), _>(refused), Code::Unauthenticated, &["\"client\"", "revoked"]);

    // Health needs no token.
    let health = api.health().check(pb::CheckRequest {}).await.expect("health check");
    assert!(health.into_inner().serving);
}

/// Every RPC with the scope it needs.
#[derive(Debug, Clone, Copy)]
enum Call {
    CreateAccount,
    GetAccount,
    NewDepositAddress,
    ListDepositAddresses,
    GetBalances,
    ListLedgerEntries,
    RequestWithdrawal,
    GetWithdrawal,
    ListWithdrawals,
    CancelWithdrawal,
    ApproveWithdrawal,
    StreamEvents,
    ListHotWallets,
    PauseLane,
    ResumeLane,
}

const CALLS: [(Call, Scope); 15] = [
    (Call::CreateAccount, Scope::Withdraw),
    (Call::GetAccount, Scope::Read),
    (Call::NewDepositAddress, Scope::Withdraw),
    (Call::ListDepositAddresses, Scope::Read),
    (Call::GetBalances, Scope::Read),
    (Call::ListLedgerEntries, Scope::Read),
    (Call::RequestWithdrawal, Scope::Withdraw),
    (Call::GetWithdrawal, Scope::Read),
    (Call::ListWithdrawals, Scope::Read),
    (Call::CancelWithdrawal, Scope::Withdraw),
    (Call::ApproveWithdrawal, Scope::Approve),
    (Call::StreamEvents, Scope::Read),
    (Call::ListHotWallets, Scope::Admin),
    (Call::PauseLane, Scope::Admin),
    (Call::ResumeLane, Scope::Admin),
];

/// Makes `call` with `token` against account `account`; only the status matters.
async fn call(api: &Api, token: &str, call: Call, account: i64) -> Result<(), Status> {
    let by_id = pb::get_account_request::Key::Id(account);
    match call {
        Call::CreateAccount => {
            api.accounts().create_account(authed(token, pb::CreateAccountRequest { external_ref: "x".into() })).await?;
        }
        Call::GetAccount => {
            api.accounts().get_account(authed(token, pb::GetAccountRequest { key: Some(by_id) })).await?;
        }
        Call::NewDepositAddress => {
            let request = pb::NewDepositAddressRequest { account_id: account, chain: pb::Chain::Eth.into() };
            api.accounts().new_deposit_address(authed(token, request)).await?;
        }
        Call::ListDepositAddresses => {
            let request = pb::ListDepositAddressesRequest { account_id: account, chain: 0 };
            api.accounts().list_deposit_addresses(authed(token, request)).await?;
        }
        Call::GetBalances => {
            api.accounts().get_balances(authed(token, pb::GetBalancesRequest { account_id: account })).await?;
        }
        Call::ListLedgerEntries => {
            let request = pb::ListLedgerEntriesRequest { account_id: account, ..Default::default() };
            api.accounts().list_ledger_entries(authed(token, request)).await?;
        }
        Call::RequestWithdrawal => {
            let request = crate::support::withdrawal_request(account, "scope", crate::support::FUNDER, 1);
            api.withdrawals().request_withdrawal(authed(token, request)).await?;
        }
        Call::GetWithdrawal => {
            api.withdrawals().get_withdrawal(authed(token, pb::GetWithdrawalRequest { id: 1 })).await?;
        }
        Call::ListWithdrawals => {
            api.withdrawals().list_withdrawals(authed(token, pb::ListWithdrawalsRequest::default())).await?;
        }
        Call::CancelWithdrawal => {
            api.withdrawals().cancel_withdrawal(authed(token, pb::CancelWithdrawalRequest { id: 1 })).await?;
        }
        Call::ApproveWithdrawal => {
            let request = pb::ApproveWithdrawalRequest { id: 1 };
            api.withdrawals().approve_withdrawal(authed(token, request)).await?;
        }
        Call::StreamEvents => {
            let request = pb::StreamEventsRequest { after_position: None, until_caught_up: true };
            api.audit().stream_events(authed(token, request)).await?;
        }
        Call::ListHotWallets => {
            api.admin().list_hot_wallets(authed(token, pb::ListHotWalletsRequest {})).await?;
        }
        Call::PauseLane => {
            let request = pb::PauseLaneRequest { lane: "a".into(), reason: "scope test".into() };
            api.admin().pause_lane(authed(token, request)).await?;
        }
        Call::ResumeLane => {
            api.admin().resume_lane(authed(token, pb::ResumeLaneRequest { lane: "a".into() })).await?;
        }
    }
    Ok(())
}

#[tokio::test]
async fn each_scope_allows_its_calls_and_only_those() {
    let api = Api::start().await;
    api.hot_wallet().await;
    let root = api.root_token().await;
    let account = api.account(&root, "scoped").await;
    api.credit(account, 0, 10).await;
    for scope in Scope::ALL {
        let token = api.token(&format!("only-{scope}"), &[scope]).await;
        for (rpc, needed) in CALLS {
            let result = call(&api, &token, rpc, account).await;
            if needed == scope {
                // Allowed: whatever the outcome, it is not about the token.
                if let Err(status) = &result {
                    assert!(
                        !matches!(status.code(), Code::PermissionDenied | Code::Unauthenticated),
                        "{rpc:?} with a {scope} token: {status:?}"
                    );
                }
            } else {
                let status = assert_status(result, Code::PermissionDenied, &[needed.as_str(), scope.as_str()]);
                assert!(status.message().contains(&format!("{rpc:?}")), "{rpc:?}: {status:?}");
            }
        }
    }
    // A token may hold several scopes.
    let both = api.token("read-and-withdraw", &[Scope::Read, Scope::Withdraw]).await;
    call(&api, &both, Call::GetBalances, account).await.expect("read");
    call(&api, &both, Call::CreateAccount, account).await.expect("withdraw");
    assert_status(call(&api, &both, Call::ListHotWallets, account).await, Code::PermissionDenied, &["admin"]);
}

#[tokio::test]
async fn a_token_over_its_rate_is_resource_exhausted_and_others_are_not() {
    let api = Api::start_with(custodian_api::ApiConfig { requests_per_second: 1, burst: 3, ..config() }).await;
    let busy = api.token("busy", &[Scope::Read]).await;
    let calm = api.token("calm", &[Scope::Read]).await;
    let list = |token: String| {
        let mut withdrawals = api.withdrawals();
        async move { withdrawals.list_withdrawals(authed(&token, pb::ListWithdrawalsRequest::default())).await }
    };
    for _ in 0..3 {
        list(busy.clone()).await.expect("within the burst");
    }
    assert_status(list(busy.clone()).await, Code::ResourceExhausted, &["\"busy\"", "request rate", "retry in"]);
    list(calm.clone()).await.expect("another token has its own bucket");
    // The bucket refills at one request per second.
    custodian_testkit::eventually("the bucket refills", std::time::Duration::from_secs(3), || {
        let call = list(busy.clone());
        async move { call.await.ok() }
    })
    .await;
}

#[tokio::test]
async fn tokens_are_stored_hashed_and_revoked_not_deleted() {
    let api = Api::start().await;
    let client = api.db.pool.get().await.unwrap();
    let token = tokens::create(&client, "reporting", &[Scope::Read, Scope::Read, Scope::Admin], "ops").await.unwrap();
    assert!(token.starts_with(tokens::TOKEN_PREFIX));

    let row = client.query_one("select token_hash, scopes, row_to_json(t)::text from api_token t", &[]).await.unwrap();
    let stored: Vec<u8> = row.get(0);
    let raw: Vec<u8> =
        (0..32).map(|i| u8::from_str_radix(&token[tokens::TOKEN_PREFIX.len() + 2 * i..][..2], 16).unwrap()).collect();
    assert_eq!(stored, sha256::Hash::hash(&raw).to_byte_array().to_vec(), "SHA-256 of the token's 32 bytes");
    assert_eq!(row.get::<_, Vec<String>>(1), ["read", "admin"]);
    let whole_row: String = row.get(2);
    assert!(!whole_row.contains(&token[tokens::TOKEN_PREFIX.len()..]), "the token itself is not stored");

    assert!(matches!(
        tokens::create(&client, "reporting", &[Scope::Read], "ops").await,
        Err(TokenError::NameTaken(name)) if name == "reporting"
    ));
    assert!(matches!(tokens::create(&client, "empty", &[], "ops").await, Err(TokenError::NoScopes)));
    assert!(matches!(
        tokens::create(&client, "two words", &[Scope::Read], "ops").await,
        Err(TokenError::InvalidName(_))
    ));
    assert!(matches!(tokens::revoke(&client, "nobody", "ops").await, Err(TokenError::UnknownName(_))));

    assert!(tokens::revoke(&client, "reporting", "ops").await.unwrap(), "revoked now");
    assert!(!tokens::revoke(&client, "reporting", "ops").await.unwrap(), "revoking again changes nothing");
    // The table keeps the record: nothing but the revocation may change, nothing may go.
    // The service's login meets a missing privilege first; revoking twice meets the trigger.
    for (statement, expected) in [
        ("update api_token set scopes = array['read']", "permission denied"),
        ("update api_token set revoked_at = now()", "append-only"),
        ("delete from api_token", "permission denied"),
        ("truncate api_token", "permission denied"),
    ] {
        let refused = client.execute(statement, &[]).await.expect_err(statement);
        let message = refused.as_db_error().map(|db| db.message().to_owned()).unwrap_or_default();
        assert!(message.contains(expected), "{statement}: {refused:?}");
    }
    assert_eq!(client.query_one("select count(*) from api_token", &[]).await.unwrap().get::<_, i64>(0), 1);
}

#[tokio::test]
async fn a_busy_pool_answers_unavailable_with_a_retry_hint_and_no_database_text() {
    let db = custodian_testkit::TestDb::new().await;
    let own = custodian_store::pool::connect_with(&db.url, 1, Duration::from_millis(200)).await.unwrap();
    let api = Api::start_on_pool(db, own.clone(), config()).await;
    let token = api.token("client", &[Scope::Read]).await;
    let get = |token: &str| {
        let mut accounts = api.accounts();
        let request = authed(token, pb::GetAccountRequest { key: Some(pb::get_account_request::Key::Id(1)) });
        async move { accounts.get_account(request).await }
    };
    assert_status(get(&token).await, Code::NotFound, &["no account has id 1"]);
    // Every API connection is taken (a flood, a slow query): the call waits its checkout timeout.
    let held = own.get().await.unwrap();
    let started = std::time::Instant::now();
    let busy = get(&token).await.expect_err("no connection is free");
    assert_eq!(busy.code(), Code::Unavailable, "{busy:?}");
    assert!(busy.message().contains("retry in 1000 ms") && busy.message().contains("error id"), "{}", busy.message());
    assert_eq!(busy.metadata().get("retry-after-ms").and_then(|v| v.to_str().ok()), Some("1000"));
    assert!(started.elapsed() < Duration::from_secs(2), "the checkout timed out, it did not hang");
    drop(held);
    assert_status(get(&token).await, Code::NotFound, &["no account has id 1"]);
}
