//! Bitcoin withdrawals (#13) against the Bitcoin Core simulator and real PostgreSQL: BTC hot
//! wallets from BIP-84 account keys, funded from outside and credited to treasury.

use std::str::FromStr;

use bitcoin::bip32::{DerivationPath, Xpriv};
use bitcoin::secp256k1::Secp256k1;
use custodian_testkit::{BitcoinSim, TestDb};

use crate::lifecycle::{btc_env, run, scan};

/// The regtest account key m/84'/1'/`account`' of the BIP-84 test vector's mnemonic, as `tprv`.
fn account_key(account: u32) -> Xpriv {
    let words = ["abandon"; 11].join(" ") + " about";
    let seed = custodian_testkit::fixtures::bip39_seed(&words);
    let master = Xpriv::new_master(bitcoin::Network::Regtest, &seed).unwrap();
    master.derive_priv(&Secp256k1::new(), &DerivationPath::from_str(&format!("m/84'/1'/{account}'")).unwrap()).unwrap()
}

/// Writes `text` to a fresh file with `mode`; returns its path.
fn key_file(dir: &std::path::Path, name: &str, text: &str, mode: u32) -> String {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path.display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_btc_hot_wallet_from_a_bip84_account_key_is_funded_from_outside_and_credited_to_treasury() {
    let sim = BitcoinSim::start().await;
    let db = TestDb::new().await;
    let token = crate::harness::operator(&db).await;
    let env = btc_env(&db, &sim, Some(&token));
    let dir = tempdir();
    let key = account_key(0);
    let open = key_file(&dir, "open.key", &key.to_string(), 0o644);
    let refused = run(env.clone(), &["hot-wallet", "add", "--chain", "btc", "--key-file", &open, "--lane", "b1"]).await;
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    assert!(refused.stderr.contains("chmod 600"), "{}", refused.stderr);
    let public =
        key_file(&dir, "public.key", &bitcoin::bip32::Xpub::from_priv(&Secp256k1::new(), &key).to_string(), 0o600);
    let refused =
        run(env.clone(), &["hot-wallet", "add", "--chain", "btc", "--key-file", &public, "--lane", "b1"]).await;
    assert_eq!(refused.code, 2, "a public key is not a hot wallet: {}", refused.stderr);
    let mainnet = key_file(
        &dir,
        "main.key",
        &{
            let master = Xpriv::new_master(bitcoin::Network::Bitcoin, &[7u8; 64]).unwrap();
            master
                .derive_priv(&Secp256k1::new(), &DerivationPath::from_str("m/84'/0'/0'").unwrap())
                .unwrap()
                .to_string()
        },
        0o600,
    );
    let refused =
        run(env.clone(), &["hot-wallet", "add", "--chain", "btc", "--key-file", &mainnet, "--lane", "b1"]).await;
    assert_eq!(refused.code, 2, "{}", refused.stderr);
    assert!(refused.stderr.contains("configured for regtest"), "{}", refused.stderr);
    assert_eq!(
        db.client()
            .await
            .query_one("select count(*) from hot_wallet where chain = 'btc'", &[])
            .await
            .unwrap()
            .get::<_, i64>(0),
        0,
        "nothing written"
    );

    // Money paid to the funding address before registration is not custody.
    // …/0/0 of the account, derived here with the bitcoin crate alone.
    let secp = Secp256k1::new();
    let child = key.derive_priv(&secp, &DerivationPath::from_str("m/0/0").unwrap()).unwrap();
    let funding_address = bitcoin::Address::p2wpkh(
        &bitcoin::CompressedPublicKey(child.private_key.public_key(&secp)),
        bitcoin::Network::Regtest,
    );
    let funding = funding_address.to_string();
    let before = sim.pay(&[(funding_address.clone(), bitcoin::Amount::from_sat(7_000))]);
    sim.mine(&[before]);
    let good = key_file(&dir, "hot.key", &key.to_string(), 0o600);
    let added =
        run(env.clone(), &["hot-wallet", "add", "--chain", "btc", "--key-file", &good, "--lane", "b1", "--json"]).await;
    assert_eq!(added.code, 0, "{}", added.stderr);
    assert_eq!(added.json()["lane"]["funding_address"], funding.as_str(), "…/0/0 of the account");
    assert_eq!(added.json()["created"], true);
    let again =
        run(env.clone(), &["hot-wallet", "add", "--chain", "btc", "--key-file", &good, "--lane", "b1", "--json"]).await;
    assert_eq!(again.json()["created"], false, "{}", again.stderr);
    assert!(!added.stdout.contains(&key.to_string()) && !added.stderr.contains(&key.to_string()), "never printed");

    // A top-up from outside: a deposit of the treasury, spendable once confirmed.
    let top_up = sim.pay(&[(funding_address, bitcoin::Amount::from_sat(50_000_000))]);
    sim.mine(&[top_up]);
    sim.mine_empty(10);
    scan(&db, &sim).await;
    let posted = run(env.clone(), &["post"]).await;
    assert_eq!(posted.code, 0, "{}", posted.stderr);
    let treasury: String = db
        .client()
        .await
        .query_one(
            "select coalesce(sum(case direction when 'credit' then amount else -amount end), 0)::text
               from ledger_posting where ledger_account = 'treasury' and asset = 'BTC'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(treasury, "50000000", "the top-up, and only what arrived after registration");
    let listed = run(env.clone(), &["hot-wallet", "list", "--json"]).await;
    assert_eq!(listed.code, 0, "{}", listed.stderr);
    let lane = listed.json().as_array().unwrap().iter().find(|l| l["lane"] == "b1").cloned().unwrap();
    assert_eq!(
        (lane["chain"].clone(), lane["spendable"].clone(), lane["coins"].clone()),
        (serde_json::json!("btc"), serde_json::json!("50000000"), serde_json::json!(1))
    );
    let verified = run(env.clone(), &["replay", "--verify"]).await;
    assert_eq!(verified.code, 0, "{}{}", verified.stdout, verified.stderr);
    // The chain holds both coins; the ledger holds the top-up and knows the earlier payment as an
    // observation it never credited (the address was not ours yet): nothing unexplained.
    let reconciled = run(env, &["reconcile", "--json"]).await;
    assert_eq!(reconciled.code, 0, "{}{}", reconciled.stdout, reconciled.stderr);
    let btc = reconciled.json()["assets"].as_array().unwrap().iter().find(|a| a["asset"] == "BTC").cloned().unwrap();
    assert_eq!(
        (btc["chain"].as_str(), btc["custody"].as_str(), btc["uncredited"].as_str(), btc["difference"].as_str()),
        (Some("50007000"), Some("50000000"), Some("7000"), Some("0"))
    );
}

/// A fresh directory for key files, removed with the process's temporary files.
fn tempdir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("custodian-btc-keys-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn rand_suffix() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos()
}
