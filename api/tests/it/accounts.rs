//! Accounts, HD deposit addresses, balances and ledger entries through the API.

use std::collections::HashSet;

use custodian_api::pb::{self, get_account_request::Key};
use custodian_domain::hd::{BtcDepositKey, DepositKey};
use custodian_domain::{BtcNetwork, Chain};
use futures::future::join_all;
use tonic::Code;

use crate::support::{assert_status, authed, config, dev_eth_xpub, eth_address_at, withdrawal_request, Api, ETHER};

#[tokio::test]
async fn accounts_are_created_once_and_found_by_id_or_reference() {
    let api = Api::start().await;
    let token = api.root_token().await;
    let mut accounts = api.accounts();
    let create = |external_ref: &str| authed(&token, pb::CreateAccountRequest { external_ref: external_ref.into() });

    let first = accounts.create_account(create("  customer-7 ")).await.unwrap().into_inner();
    assert!(first.created);
    let account = first.account.unwrap();
    assert_eq!(account.external_ref, "customer-7", "the reference is trimmed");
    let again = accounts.create_account(create("customer-7")).await.unwrap().into_inner();
    assert_eq!((again.account.unwrap(), again.created), (account.clone(), false));

    let by_id = accounts.get_account(authed(&token, pb::GetAccountRequest { key: Some(Key::Id(account.id)) }));
    assert_eq!(by_id.await.unwrap().into_inner(), account);
    let by_ref = pb::GetAccountRequest { key: Some(Key::ExternalRef("customer-7".into())) };
    assert_eq!(accounts.get_account(authed(&token, by_ref)).await.unwrap().into_inner(), account);

    assert_status(accounts.create_account(create("   ")).await, Code::InvalidArgument, &["external_ref"]);
    assert_status(accounts.create_account(create(&"x".repeat(300))).await, Code::InvalidArgument, &["256"]);
    let missing = pb::GetAccountRequest { key: Some(Key::Id(account.id + 1)) };
    assert_status(accounts.get_account(authed(&token, missing)).await, Code::NotFound, &["no account has id"]);
    let missing = pb::GetAccountRequest { key: Some(Key::ExternalRef("customer-8".into())) };
    assert_status(accounts.get_account(authed(&token, missing)).await, Code::NotFound, &["customer-8"]);
    let neither = pb::GetAccountRequest { key: None };
    assert_status(accounts.get_account(authed(&token, neither)).await, Code::InvalidArgument, &["id", "external_ref"]);
}

#[tokio::test]
async fn deposit_addresses_need_a_configured_key_and_an_account() {
    let api = Api::start().await;
    let token = api.root_token().await;
    let account = api.account(&token, "alice").await;
    let mut accounts = api.accounts();
    let new = |account_id: i64, chain: pb::Chain| {
        authed(&token, pb::NewDepositAddressRequest { account_id, chain: chain.into() })
    };

    assert_status(
        accounts.new_deposit_address(new(account, pb::Chain::Btc)).await,
        Code::FailedPrecondition,
        &["no deposit key is configured for btc"],
    );
    assert_status(
        accounts.new_deposit_address(new(account, pb::Chain::Unspecified)).await,
        Code::InvalidArgument,
        &["chain"],
    );
    assert_status(
        accounts.new_deposit_address(new(account + 1, pb::Chain::Eth)).await,
        Code::NotFound,
        &["unknown account"],
    );

    let xpub = dev_eth_xpub();
    let first = accounts.new_deposit_address(new(account, pb::Chain::Eth)).await.unwrap().into_inner();
    let second = accounts.new_deposit_address(new(account, pb::Chain::Eth)).await.unwrap().into_inner();
    assert_eq!((first.derivation_index, second.derivation_index), (0, 1), "the failed calls consumed no index");
    assert_eq!(first.address, eth_address_at(&xpub, 0));
    assert_eq!(first.address, "0xf39Fd6e51aad88F6F4ce6aB8827279cffFb92266", "anvil's dev account 0");
    assert_eq!((first.account_id, first.valid_from_height, first.valid_to_height), (account, 0, None));

    let listed = accounts
        .list_deposit_addresses(authed(&token, pb::ListDepositAddressesRequest { account_id: account, chain: 0 }))
        .await
        .unwrap()
        .into_inner()
        .addresses;
    assert_eq!(listed, vec![first, second]);
    let btc_only = pb::ListDepositAddressesRequest { account_id: account, chain: pb::Chain::Btc.into() };
    assert!(accounts.list_deposit_addresses(authed(&token, btc_only)).await.unwrap().into_inner().addresses.is_empty());
    let unknown = pb::ListDepositAddressesRequest { account_id: account + 1, chain: 0 };
    assert_status(accounts.list_deposit_addresses(authed(&token, unknown)).await, Code::NotFound, &["no account"]);
}

#[tokio::test]
async fn a_btc_key_for_another_network_is_refused_at_start() {
    // The BIP-84 test vector's zpub is a mainnet key; the server is configured for regtest.
    let zpub = "zpub6rFR7y4Q2AijBEqTUquhVz398htDFrtymD9xYYfG1m4wAcvPhXNfE3EfH1r1ADqtfSdVCToUG868RvUUkgDKf31mGDtKsAYz2oz2AGutZYs";
    let key = BtcDepositKey::parse(zpub, BtcNetwork::Mainnet).unwrap();
    let mut config = config();
    config.deposit_keys.insert(Chain::Btc, DepositKey::from(key));
    let db = custodian_testkit::TestDb::new().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let refused = custodian_api::serve(listener, db.pool.clone(), config.clone(), async {}).await.unwrap_err();
    assert!(refused.to_string().contains("mainnet addresses, but Bitcoin is configured for regtest"), "{refused}");

    config.requests_per_second = 0;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let refused = custodian_api::serve(listener, db.pool.clone(), config, async {}).await.unwrap_err();
    assert!(refused.to_string().contains("rate limit"), "{refused}");
}

#[tokio::test]
async fn five_hundred_concurrent_requests_get_five_hundred_derivable_addresses() {
    let api = Api::start().await;
    let token = api.root_token().await;
    let accounts: Vec<i64> = join_all((0..5).map(|i| {
        let token = token.clone();
        let api = &api;
        async move { api.account(&token, &format!("holder-{i}")).await }
    }))
    .await;
    let calls = (0..500).map(|i| {
        let mut client = api.accounts();
        let request = authed(
            &token,
            pb::NewDepositAddressRequest { account_id: accounts[i % accounts.len()], chain: pb::Chain::Eth.into() },
        );
        async move { client.new_deposit_address(request).await.map(tonic::Response::into_inner) }
    });
    let derived: Vec<pb::DepositAddress> = join_all(calls).await.into_iter().collect::<Result<_, _>>().unwrap();

    let addresses: HashSet<&str> = derived.iter().map(|a| a.address.as_str()).collect();
    assert_eq!(addresses.len(), 500, "every call got its own address");
    let indexes: HashSet<u32> = derived.iter().map(|a| a.derivation_index).collect();
    assert_eq!(indexes, (0..500).collect(), "indexes are gapless");
    let xpub = dev_eth_xpub();
    for address in &derived {
        assert_eq!(
            address.address,
            eth_address_at(&xpub, address.derivation_index),
            "index {}",
            address.derivation_index
        );
    }
    // What the API answered is what was recorded.
    let mut listed = Vec::new();
    for account in &accounts {
        let request = pb::ListDepositAddressesRequest { account_id: *account, chain: 0 };
        listed.extend(
            api.accounts().list_deposit_addresses(authed(&token, request)).await.unwrap().into_inner().addresses,
        );
    }
    let mut derived = derived;
    derived.sort_by_key(|a| a.derivation_index);
    listed.sort_by_key(|a| a.derivation_index);
    assert_eq!(listed, derived);
}

#[tokio::test]
async fn balances_show_confirmed_held_and_available_in_units_and_for_people() {
    let api = Api::start().await;
    api.hot_wallet().await;
    let token = api.root_token().await;
    let account = api.account(&token, "bob").await;
    let balances = |account_id| {
        let mut accounts = api.accounts();
        let request = authed(&token, pb::GetBalancesRequest { account_id });
        async move { accounts.get_balances(request).await }
    };
    let empty = balances(account).await.unwrap().into_inner();
    assert_eq!(empty.account.unwrap().external_ref, "bob");
    assert!(empty.balances.is_empty());

    api.credit(account, 0, 3 * ETHER / 2).await;
    let request = withdrawal_request(account, "w-1", crate::support::FUNDER, ETHER / 4);
    api.withdrawals().request_withdrawal(authed(&token, request)).await.unwrap();
    let [eth]: [pb::Balance; 1] = balances(account).await.unwrap().into_inner().balances.try_into().unwrap();
    assert_eq!((eth.asset.as_str(), eth.symbol.as_str(), eth.decimals), ("ETH", "ETH", 18));
    assert_eq!(
        [eth.confirmed.as_str(), eth.pending.as_str(), eth.held.as_str(), eth.available.as_str()],
        ["1500000000000000000", "0", "250000000000000000", "1250000000000000000"]
    );
    assert_eq!(
        [&eth.confirmed_display, &eth.pending_display, &eth.held_display, &eth.available_display],
        ["1.5", "0", "0.25", "1.25"]
    );
    assert_status(balances(account + 1).await, Code::NotFound, &["no account has id"]);
}

#[tokio::test]
async fn ledger_entries_page_through_an_account_and_a_time_range() {
    let api = Api::start().await;
    api.hot_wallet().await;
    let token = api.root_token().await;
    let account = api.account(&token, "carol").await;
    let other = api.account(&token, "dave").await;
    for n in 0..3 {
        api.credit(account, n, ETHER).await;
    }
    api.credit(other, 0, ETHER).await;
    for n in 0..2 {
        let request = withdrawal_request(account, &format!("w-{n}"), crate::support::FUNDER, ETHER / 10);
        api.withdrawals().request_withdrawal(authed(&token, request)).await.unwrap();
    }
    let page = |page_size: u32, page_token: String, from_time: &str, to_time: &str| {
        let mut accounts = api.accounts();
        let request = authed(
            &token,
            pb::ListLedgerEntriesRequest {
                account_id: account,
                from_time: from_time.into(),
                to_time: to_time.into(),
                page_size,
                page_token,
            },
        );
        async move { accounts.list_ledger_entries(request).await.map(tonic::Response::into_inner) }
    };

    let all = page(0, String::new(), "", "").await.unwrap();
    assert_eq!(all.next_page_token, "");
    let kinds: Vec<(&str, i32, &str)> =
        all.entries.iter().map(|e| (e.kind.as_str(), e.direction, e.amount_display.as_str())).collect();
    let (credit, debit) = (pb::Direction::Credit.into(), pb::Direction::Debit.into());
    assert_eq!(
        kinds,
        [
            ("deposit", credit, "1"),
            ("deposit", credit, "1"),
            ("deposit", credit, "1"),
            ("withdrawal_hold", debit, "0.1"),
            ("withdrawal_hold", debit, "0.1"),
        ]
    );
    assert!(all.entries.iter().all(|e| e.ledger_account == format!("user:{account}")), "only this account's");
    assert!(all.entries[3].idempotency_key.ends_with(":hold"));
    assert!(all.entries[0].reference_json.contains("tx_hash"));

    // Pages of two give the same entries, each once, in order.
    let mut paged = Vec::new();
    let mut token_ = String::new();
    loop {
        let response = page(2, token_, "", "").await.unwrap();
        assert!(response.entries.len() <= 2);
        paged.extend(response.entries);
        if response.next_page_token.is_empty() {
            break;
        }
        token_ = response.next_page_token;
    }
    assert_eq!(paged, all.entries);

    // A time range around everything, and one before anything.
    let everything = page(0, String::new(), "2000-01-01T00:00:00Z", "2999-01-01T00:00:00+01:00").await.unwrap();
    assert_eq!(everything.entries, all.entries);
    let before = page(0, String::new(), "", &all.entries[0].created_at).await.unwrap();
    assert_eq!(before.entries, [], "to_time is exclusive");
    let from_first = page(0, String::new(), &all.entries[0].created_at, "").await.unwrap();
    assert_eq!(from_first.entries, all.entries, "from_time is inclusive");

    assert_status(page(0, String::new(), "yesterday", "").await, Code::InvalidArgument, &["from_time", "RFC 3339"]);
    assert_status(
        page(0, String::new(), "2025-02-01T00:00:00Z", "2025-01-01T00:00:00Z").await,
        Code::InvalidArgument,
        &["before from_time"],
    );
    assert_status(page(0, "x".into(), "", "").await, Code::InvalidArgument, &["page_token"]);
}
