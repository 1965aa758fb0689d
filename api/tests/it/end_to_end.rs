//! A deposit credited and a withdrawal confirmed with the API as the only client interface: the
//! real scanner, posting pass and withdrawal worker run against anvil in between.

use std::collections::HashMap;
use std::sync::Arc;

use alloy_primitives::U256;
use custodian_api::pb;
use custodian_domain::{Amount, Chain};
use custodian_ingest::eth::EthReader;
use custodian_ingest::{NoProgress, ScanConfig, Scanner};
use custodian_projections::{policy, posting};
use custodian_testkit::Anvil;
use custodian_withdrawals::{hot_wallet, EthNode, LocalSigner, Signer, Worker, WorkerConfig};
use serde_json::json;

use crate::support::{authed, dev_eth_xpub, eth_address_at, Api, ETHER, FUNDER, HOT_WALLET};

/// Where the withdrawal pays out: an address nobody holds a key for.
const DESTINATION: &str = "0x00000000000000000000000000000000deadbeef";
/// The hot wallet: anvil's dev account 3, outside the deposit addresses this test derives (the
/// dev mnemonic's first three, which are customers' or the house's).
const LANE_ADDRESS: &str = "0x90f79bf6eb2c4f870365e785982e1f101e93b906";
const LANE_KEY: &str = "0x7c852118294e51e653712a81e05800f419141751be58f605c371e15141b007a6";
/// Confirmations every ETH deposit needs in this test.
const DEPOSIT_CONFIRMATIONS: u32 = 2;
/// Scan-and-post or worker rounds before giving up.
const MAX_ROUNDS: usize = 30;

async fn mine(anvil: &Anvil, blocks: u64) {
    anvil.rpc("anvil_mine", json!([format!("0x{blocks:x}")])).await.expect("anvil_mine");
}

async fn on_chain_balance(anvil: &Anvil, address: &str) -> U256 {
    let hex = anvil.rpc("eth_getBalance", json!([address, "latest"])).await.expect("eth_getBalance");
    U256::from_str_radix(hex.as_str().expect("a hex quantity").trim_start_matches("0x"), 16).expect("a quantity")
}

#[tokio::test]
async fn a_deposit_is_credited_and_a_withdrawal_confirmed_through_the_api_alone() {
    let anvil = Anvil::spawn().await.expect("start anvil");
    let api = Api::start().await;
    let token = api.root_token().await;
    let client = api.db.pool.get().await.unwrap();
    policy::set_tier(&client, Chain::Eth, "ETH", Amount::ZERO, DEPOSIT_CONFIRMATIONS, "ops").await.unwrap();
    let mut accounts = api.accounts();
    let mut withdrawals = api.withdrawals();
    let new_address =
        |account_id| authed(&token, pb::NewDepositAddressRequest { account_id, chain: pb::Chain::Eth.into() });

    // The dev mnemonic's first two addresses are anvil's funder and our hot wallet: give them to
    // a house account so the customer's address is nobody else's.
    let house = api.account(&token, "house").await;
    for expected in [FUNDER, HOT_WALLET] {
        let address = accounts.new_deposit_address(new_address(house)).await.unwrap().into_inner();
        assert_eq!(address.address.to_lowercase(), expected);
    }
    let alice = api.account(&token, "alice").await;
    let deposit_address = accounts.new_deposit_address(new_address(alice)).await.unwrap().into_inner();
    assert_eq!(deposit_address.derivation_index, 2);
    assert_eq!(deposit_address.address, eth_address_at(&dev_eth_xpub(), 2));

    let deposit = ETHER / 2;
    anvil
        .rpc(
            "eth_sendTransaction",
            json!([{ "from": FUNDER, "to": deposit_address.address, "value": format!("{deposit:#x}") }]),
        )
        .await
        .expect("fund the deposit address");

    let scanner = Scanner::new(EthReader::new(&anvil.url).unwrap(), api.db.pool.clone(), ScanConfig::default());
    let balance = |account_id| authed(&token, pb::GetBalancesRequest { account_id });
    let mut saw_pending = false;
    let mut credited = None;
    for _ in 0..MAX_ROUNDS {
        scanner.run_to_tip(&NoProgress).await.expect("scan");
        posting::post_chain(&client, Chain::Eth).await.expect("post confirmed deposits");
        let balances = accounts.get_balances(balance(alice)).await.unwrap().into_inner().balances;
        if let Some(eth) = balances.into_iter().find(|b| b.asset == "ETH") {
            if eth.pending == deposit.to_string() {
                let pending = &eth.pending_deposits[0];
                assert_eq!(pending.required_confirmations, Some(2));
                assert!(pending.confirmations < 2);
                saw_pending = true;
            }
            if eth.confirmed == deposit.to_string() {
                credited = Some(eth);
                break;
            }
        }
        mine(&anvil, 1).await;
    }
    let credited = credited.expect("the deposit is confirmed within the rounds");
    assert!(saw_pending, "the deposit was pending before it was confirmed");
    assert_eq!((credited.available_display.as_str(), credited.pending.as_str()), ("0.5", "0"));

    // The withdrawal: requested through the API, paid out by the real worker.
    let node = EthNode::new(&anvil.url).unwrap();
    let signer = LocalSigner::from_hex(LANE_KEY).unwrap();
    hot_wallet::add(&mut api.db.pool.get().await.unwrap(), &node, "a", LANE_ADDRESS.parse().unwrap(), "ops")
        .await
        .expect("register the lane");
    let signers: HashMap<String, Arc<dyn Signer>> =
        HashMap::from([("a".to_owned(), Arc::new(signer) as Arc<dyn Signer>)]);
    let worker =
        Worker::new(api.db.pool.clone(), node, signers, WorkerConfig { confirmations: 1, ..WorkerConfig::default() });

    let payout = ETHER / 5;
    let request = pb::RequestWithdrawalRequest {
        account_id: alice,
        external_id: "alice-payout-1".into(),
        asset: "ETH".into(),
        destination: DESTINATION.into(),
        amount: Some(pb::request_withdrawal_request::Amount::AmountDecimal("0.2".into())),
    };
    let requested = withdrawals.request_withdrawal(authed(&token, request)).await.unwrap().into_inner();
    let id = requested.withdrawal.unwrap().id;
    let mut confirmed = None;
    for _ in 0..MAX_ROUNDS {
        worker.pass().await.expect("a worker pass");
        let w = withdrawals.get_withdrawal(authed(&token, pb::GetWithdrawalRequest { id })).await.unwrap().into_inner();
        if w.state == i32::from(pb::WithdrawalState::Confirmed) {
            confirmed = Some(w);
            break;
        }
        mine(&anvil, 1).await;
    }
    let confirmed = confirmed.expect("the withdrawal is confirmed within the rounds");
    assert_eq!(confirmed.from_address.as_deref().map(str::to_lowercase).as_deref(), Some(LANE_ADDRESS));
    assert_eq!(confirmed.nonce, Some(0));
    assert_eq!(confirmed.attempts.len(), 1);
    assert_eq!((confirmed.attempts[0].kind.as_str(), confirmed.attempts[0].intent.as_str()), ("original", "payout"));
    assert!(!confirmed.stuck_at_cap);
    assert_eq!(confirmed.tx_hash.as_deref(), Some(confirmed.attempts[0].tx_hash.as_str()));
    assert!(confirmed.mined_block_hash.is_some());
    assert_eq!(on_chain_balance(&anvil, DESTINATION).await, U256::from(payout), "the money arrived");

    // What the customer sees: the payout left, the fee was the operator's.
    let [eth]: [pb::Balance; 1] =
        accounts.get_balances(balance(alice)).await.unwrap().into_inner().balances.try_into().unwrap();
    assert_eq!(
        [eth.confirmed_display.as_str(), eth.held.as_str(), eth.available_display.as_str()],
        ["0.3", "0", "0.3"]
    );
    let entries = accounts
        .list_ledger_entries(authed(&token, pb::ListLedgerEntriesRequest { account_id: alice, ..Default::default() }))
        .await
        .unwrap()
        .into_inner()
        .entries;
    let kinds: Vec<(&str, &str)> = entries.iter().map(|e| (e.kind.as_str(), e.amount_display.as_str())).collect();
    assert_eq!(kinds, [("deposit", "0.5"), ("withdrawal_hold", "0.2")]);
}
