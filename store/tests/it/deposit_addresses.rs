//! Deposit addresses derived from an extended public key: concurrent requests get distinct,
//! gapless indexes, each address is the key's child at its index, and a changed key is refused.

use std::collections::HashSet;
use std::sync::Arc;

use custodian_domain::hd::{BtcDepositKey, DepositKey, EthDepositKey};
use custodian_domain::{BtcNetwork, Chain, ChainAddress};
use custodian_store::deposit_addresses::{self, DepositAddressError, DerivedAddress};
use custodian_store::ownership;
use custodian_testkit::TestDb;

/// Account key m/44'/60'/0' of anvil's mnemonic "test test … junk" (checked in `domain::hd`).
const DEV_ETH_XPUB: &str =
    "xpub6Ce9NcJvTk36xtLSrJLZqE7wtgA5deCeYs7rSQtreh4cj6ByPtrg9sD7V2FNFLPnf8heNP3FGkeV9qwfzvZNSd54JoNXVsXFYSYwHsnJxqP";
/// Anvil's first two dev accounts: the children 0/0 and 0/1 of [`DEV_ETH_XPUB`].
const DEV_ETH_ADDRESSES: [&str; 2] =
    ["0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266", "0x70997970c51812dc3a010c7d01b50e0d17dc79c8"];
/// BIP-32 test vector 1, chain m/0'/1/2': another account-level key, unrelated to the others.
const OTHER_XPUB: &str =
    "xpub6D4BDPcP2GT577Vvch3R8wDkScZWzQzMMUm3PWbmWvVJrZwQY4VUNgqFJPMM3No2dFDFGTsxxpG5uJh7n7epu4trkrX7x7DogT5Uv6fcLW5";
/// BIP-84 test vector: account 0 of "abandon … about" and its first two receive addresses.
const BIP84_ZPUB: &str =
    "zpub6rFR7y4Q2AijBEqTUquhVz398htDFrtymD9xYYfG1m4wAcvPhXNfE3EfH1r1ADqtfSdVCToUG868RvUUkgDKf31mGDtKsAYz2oz2AGutZYs";
const BIP84_ADDRESSES: [&str; 2] =
    ["bc1qcr8te4kr609gcawutmrza0j4xv80jy8z306fyu", "bc1qnjg0jd8228aq7egyzacy8cys3knf9xvrerkf9g"];

fn eth_key(xpub: &str) -> DepositKey {
    EthDepositKey::parse(xpub).expect("valid xpub").into()
}

async fn create_accounts(db: &TestDb, count: usize) -> Vec<i64> {
    let client = db.pool.get().await.unwrap();
    let mut ids = Vec::with_capacity(count);
    for n in 0..count {
        ids.push(ownership::create_account(&client, &format!("customer-{n}")).await.unwrap().0.id);
    }
    ids
}

/// `count` concurrent `new_address` calls over the pool, spread round-robin over `accounts`.
async fn allocate_concurrently(db: &TestDb, key: DepositKey, accounts: &[i64], count: usize) -> Vec<DerivedAddress> {
    let key = Arc::new(key);
    let tasks: Vec<_> = (0..count)
        .map(|n| {
            let (pool, key, account) = (db.pool.clone(), key.clone(), accounts[n % accounts.len()]);
            tokio::spawn(async move {
                let mut client = pool.get().await.expect("a pooled connection");
                deposit_addresses::new_address(&mut client, &key, account).await
            })
        })
        .collect();
    let mut derived = Vec::with_capacity(count);
    for task in tasks {
        derived.push(task.await.unwrap().expect("every request gets an address"));
    }
    derived
}

/// The allocations are distinct, use exactly the indexes `0..count`, are each the key's child at
/// their index, and are what `list` reports per account on that chain; the chain's counter stands
/// at `count`.
async fn assert_gapless_and_derived(db: &TestDb, key: &DepositKey, accounts: &[i64], derived: &[DerivedAddress]) {
    let count = derived.len();
    let addresses: HashSet<String> = derived.iter().map(|d| d.address.stored()).collect();
    assert_eq!(addresses.len(), count, "every request got its own address");
    let mut indexes: Vec<u32> = derived.iter().map(|d| d.derivation_index).collect();
    indexes.sort_unstable();
    assert_eq!(indexes, (0..u32::try_from(count).unwrap()).collect::<Vec<_>>(), "indexes are 0..{count}, no gap");
    for d in derived {
        assert_eq!(d.chain, key.chain());
        assert_eq!(d.address, key.address(d.derivation_index).unwrap(), "index {}", d.derivation_index);
        assert_eq!((d.valid_from_height, d.valid_to_height), (0, None));
    }

    let client = db.pool.get().await.unwrap();
    let mut listed = Vec::new();
    for &account in accounts {
        let mut of_account = deposit_addresses::list(&client, account).await.unwrap();
        of_account.retain(|d| d.chain == key.chain());
        assert!(of_account.iter().all(|d| d.account_id == account));
        assert!(of_account.windows(2).all(|w| w[0].derivation_index < w[1].derivation_index), "ordered by index");
        listed.extend(of_account);
    }
    let mut expected = derived.to_vec();
    expected.sort_by_key(|d| d.derivation_index);
    listed.sort_by_key(|d| d.derivation_index);
    assert_eq!(listed, expected, "the database holds exactly what the callers were told");

    let next: i32 = client
        .query_one("select next_index from deposit_address_counter where chain = $1", &[&key.chain().as_str()])
        .await
        .unwrap()
        .get(0);
    assert_eq!(usize::try_from(next).unwrap(), count);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_eth_requests_get_distinct_gapless_indexes() {
    let db = TestDb::new().await;
    let accounts = create_accounts(&db, 5).await;
    let key = eth_key(DEV_ETH_XPUB);
    let derived = allocate_concurrently(&db, key.clone(), &accounts, 500).await;
    assert_gapless_and_derived(&db, &key, &accounts, &derived).await;
    for (index, expected) in (0..).zip(DEV_ETH_ADDRESSES) {
        let found = derived.iter().find(|d| d.derivation_index == index).expect("index allocated");
        assert_eq!(found.address.stored(), expected, "anvil's dev account {index}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_btc_requests_get_distinct_gapless_indexes_independent_of_eth() {
    let db = TestDb::new().await;
    let accounts = create_accounts(&db, 3).await;
    let mut client = db.pool.get().await.unwrap();
    deposit_addresses::new_address(&mut client, &eth_key(DEV_ETH_XPUB), accounts[0]).await.unwrap();
    let key: DepositKey = BtcDepositKey::parse(BIP84_ZPUB, BtcNetwork::Mainnet).unwrap().into();
    let derived = allocate_concurrently(&db, key.clone(), &accounts, 100).await;
    assert_gapless_and_derived(&db, &key, &accounts, &derived).await;
    for (index, expected) in (0..).zip(BIP84_ADDRESSES) {
        let found = derived.iter().find(|d| d.derivation_index == index).expect("index allocated");
        assert_eq!(found.address.stored(), expected, "BIP-84 vector address {index}");
    }
    // The ETH address allocated first kept its own counter and is still listed.
    let eth: Vec<_> = deposit_addresses::list(&client, accounts[0]).await.unwrap();
    let eth: Vec<_> =
        eth.iter().filter(|d| d.chain == Chain::Eth).map(|d| (d.derivation_index, d.address.stored())).collect();
    assert_eq!(eth, [(0, DEV_ETH_ADDRESSES[0].to_owned())]);
}

#[tokio::test]
async fn a_different_key_is_refused_and_consumes_nothing() {
    let db = TestDb::new().await;
    let accounts = create_accounts(&db, 1).await;
    let mut client = db.pool.get().await.unwrap();
    let original = eth_key(DEV_ETH_XPUB);
    let other = eth_key(OTHER_XPUB);
    assert_ne!(original.fingerprint(), other.fingerprint());
    deposit_addresses::new_address(&mut client, &original, accounts[0]).await.unwrap();

    match deposit_addresses::new_address(&mut client, &other, accounts[0]).await {
        Err(DepositAddressError::KeyChanged { chain: Chain::Eth, stored, configured }) => {
            assert_eq!((stored.as_str(), configured.as_str()), (original.fingerprint(), other.fingerprint()));
        }
        other => panic!("a changed key must be refused, got {other:?}"),
    }
    let second = deposit_addresses::new_address(&mut client, &original, accounts[0]).await.unwrap();
    assert_eq!(
        (second.derivation_index, second.address.stored().as_str()),
        (1, DEV_ETH_ADDRESSES[1]),
        "nothing was consumed"
    );
    // The other chain's counter is its own: the same key may start one there.
    let btc: DepositKey = BtcDepositKey::parse(BIP84_ZPUB, BtcNetwork::Mainnet).unwrap().into();
    assert_eq!(deposit_addresses::new_address(&mut client, &btc, accounts[0]).await.unwrap().derivation_index, 0);
}

#[tokio::test]
async fn refused_requests_consume_no_index() {
    let db = TestDb::new().await;
    let accounts = create_accounts(&db, 1).await;
    let mut client = db.pool.get().await.unwrap();
    let key = eth_key(DEV_ETH_XPUB);

    match deposit_addresses::new_address(&mut client, &key, 999_999).await {
        Err(DepositAddressError::UnknownAccount(999_999)) => {}
        other => panic!("expected an unknown account, got {other:?}"),
    }
    // The address of index 0 was assigned by hand before anything was derived: the derivation
    // stops there with an error naming it, rather than giving one address two owners.
    ownership::assign_address(
        &mut client,
        &ChainAddress::parse_stored(DEV_ETH_ADDRESSES[0]).unwrap(),
        accounts[0],
        None,
    )
    .await
    .unwrap();
    match deposit_addresses::new_address(&mut client, &key, accounts[0]).await {
        Err(DepositAddressError::AddressTaken { chain: Chain::Eth, address, index: 0 }) => {
            assert_eq!(address, DEV_ETH_ADDRESSES[0]);
        }
        other => panic!("expected the address to be taken, got {other:?}"),
    }
    let counter = client.query_opt("select next_index from deposit_address_counter", &[]).await.unwrap();
    assert!(counter.is_none(), "no request succeeded, so no counter exists");
    assert!(deposit_addresses::list(&client, accounts[0]).await.unwrap().is_empty());
}

#[tokio::test]
async fn the_database_refuses_a_derivation_index_twice() {
    let db = TestDb::new().await;
    let accounts = create_accounts(&db, 1).await;
    let mut client = db.pool.get().await.unwrap();
    let key = eth_key(DEV_ETH_XPUB);
    deposit_addresses::new_address(&mut client, &key, accounts[0]).await.unwrap();
    // Rewinding the counter by hand makes the next request derive index 0 again, whose address
    // is taken; swapping the key's fingerprint by hand as well gives a fresh address at the taken
    // index. Both are refused, and nothing is written.
    client.execute("update deposit_address_counter set next_index = 0", &[]).await.unwrap();
    match deposit_addresses::new_address(&mut client, &key, accounts[0]).await {
        Err(DepositAddressError::AddressTaken { index: 0, address, .. }) => assert_eq!(address, DEV_ETH_ADDRESSES[0]),
        other => panic!("expected the address at index 0 to be refused, got {other:?}"),
    }
    let other = eth_key(OTHER_XPUB);
    client.execute("update deposit_address_counter set xpub_fingerprint = $1", &[&other.fingerprint()]).await.unwrap();
    match deposit_addresses::new_address(&mut client, &other, accounts[0]).await {
        Err(DepositAddressError::IndexTaken { chain: Chain::Eth, index: 0 }) => {}
        other => panic!("expected index 0 to be refused, got {other:?}"),
    }
    assert_eq!(deposit_addresses::list(&client, accounts[0]).await.unwrap().len(), 1);
    let message = crate::refused(
        &db.client().await,
        &format!(
            "insert into wallet_address (chain, address, account_id, derivation_index)
                  values ('eth', '{}', {}, 0)",
            crate::eth_address('7'),
            accounts[0]
        ),
    )
    .await;
    assert!(message.contains("wallet_address_derivation_index"), "{message}");
}
