//! `custodian demo`: the whole story on a laptop, against a fresh `custodian_demo` database, a
//! local anvil and the Bitcoin Core simulator (no bitcoind can be installed here; the BTC part
//! says so). Built with `--features demo` (`make demo` does it).

#[cfg(not(feature = "demo"))]
pub async fn run(_settings: &crate::settings::Settings) -> anyhow::Result<crate::exit::Exit> {
    Err(crate::exit::invalid("this build has no demo: run `make demo` (cargo run --features demo -- demo)"))
}

#[cfg(feature = "demo")]
pub use story::run;

#[cfg(feature = "demo")]
mod story {
    use std::collections::HashMap;
    use std::str::FromStr;
    use std::sync::Arc;
    use std::time::Instant;

    use alloy_primitives::U256;
    use anyhow::{bail, Context, Result};
    use bitcoin::bip32::{DerivationPath, Xpriv, Xpub};
    use bitcoin::secp256k1::Secp256k1;
    use custodian_api::tokens::{self, Scope};
    use custodian_api::webhooks;
    use custodian_domain::hd::{BtcDepositKey, DepositKey, EthDepositKey};
    use custodian_domain::withdrawal::{WithdrawalEvent, WithdrawalState};
    use custodian_domain::{
        AccountId, Amount, Asset, BtcAddress, BtcNetwork, Chain, ChainAddress, EthAddress, ExternalId,
    };
    use custodian_ingest::btc::{BtcAuth, BtcReader};
    use custodian_ingest::eth::EthReader;
    use custodian_ingest::{ChainReader, NoProgress, ScanConfig, Scanner};
    use custodian_projections::{balances, policy, posting, replay};
    use custodian_store::{deposit_addresses, migrate, ownership, Pool};
    use custodian_testkit::btcsim::AddrKind;
    use custodian_testkit::btcsim::BitcoinSim;
    use custodian_testkit::Anvil;
    use custodian_withdrawals::btc::node::BtcNode;
    use custodian_withdrawals::btc::{BtcConfig, BtcWorker};
    use custodian_withdrawals::btc_key::BtcHotKey;
    use custodian_withdrawals::limits::{self, LimitChange};
    use custodian_withdrawals::request::{self, Request, RequestError};
    use custodian_withdrawals::{actions, hot_wallet, sql, EthNode, LocalSigner, Signer, Worker, WorkerConfig};
    use serde_json::{json, Value};

    use crate::exit::Exit;
    use crate::settings::Settings;

    const ETHER: u128 = 1_000_000_000_000_000_000;
    /// anvil's first dev account, unlocked: it pays the customers' deposits.
    const FUNDER: &str = "0xf39fd6e51aad88f6f4ce6ab8827279cfffb92266";
    /// anvil's dev keys 8 and 9 (well-known test keys) are the two hot wallets.
    const HOT_KEYS: [(&str, &str); 2] = [
        ("lane-a", "0xdbda1821b80551c9d65939329250298aa3472ba22feea921c0cf5d620ea67b97"),
        ("lane-b", "0x2a871d0798f97d79848a013d4936a73bf4cc922c825d33c1cf7073dff6d409c6"),
    ];
    /// anvil's chain id: the demo's worker signs for it and would refuse any other node.
    const DEMO_CHAIN_ID: u64 = 31337;
    /// A seed used only by the demo to make its deposit xpubs; its private half is dropped.
    const DEMO_SEED: [u8; 32] = *b"custodian demo seed, not a key!!";

    /// The demo's webhook receiver: it checks each request's signature as a receiver must, and
    /// keeps what it was sent.
    #[derive(Clone, Default)]
    struct Receiver {
        got: Arc<std::sync::Mutex<Vec<(i64, String, bool)>>>,
    }

    const WEBHOOK_SECRET: &str = "whsec_demo_receiver_shared_secret";

    async fn hook(
        axum::extract::State(receiver): axum::extract::State<Receiver>,
        headers: axum::http::HeaderMap,
        body: axum::body::Bytes,
    ) -> axum::http::StatusCode {
        let header = headers.get(custodian_api::webhooks::SIGNATURE_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("");
        let verified = header.strip_prefix("t=").and_then(|rest| rest.split_once(",v1=")).is_some_and(|(t, v1)| {
            t.parse().is_ok_and(|t| custodian_api::webhooks::signature(WEBHOOK_SECRET, t, &body) == v1)
        });
        let fact: Value = serde_json::from_slice(&body).unwrap_or_default();
        let kind = fact["kind"].as_str().unwrap_or("?").to_owned();
        receiver.got.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((
            fact["id"].as_i64().unwrap_or(-1),
            kind,
            verified,
        ));
        axum::http::StatusCode::NO_CONTENT
    }

    async fn start_receiver() -> Result<(String, Receiver)> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}/hook", listener.local_addr()?);
        let receiver = Receiver::default();
        let app = axum::Router::new().route("/hook", axum::routing::post(hook)).with_state(receiver.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        Ok((url, receiver))
    }

    fn say(line: impl AsRef<str>) {
        println!("{}", line.as_ref());
    }

    fn chapter(title: &str) {
        println!("\n== {title}");
    }

    fn account_xpub(path: &str, kind: bitcoin::NetworkKind) -> Result<Xpub> {
        let secp = Secp256k1::new();
        let master = Xpriv::new_master(kind, &DEMO_SEED)?;
        let path: DerivationPath = path.parse()?;
        Ok(Xpub::from_priv(&secp, &master.derive_priv(&secp, &path)?))
    }

    async fn fresh_database(settings: &Settings) -> Result<Pool> {
        // The schema owner creates and migrates the database (it may create databases, nothing
        // more); the story then runs as the service's login, custodian_app.
        let owner = settings.migrate_database_url.with_dbname("postgres");
        let client = owner.connect_one().await.context("connecting to PostgreSQL as the owner")?;
        client.batch_execute("drop database if exists custodian_demo with (force)").await?;
        client.batch_execute("create database custodian_demo").await?;
        let mut client = settings
            .migrate_database_url
            .with_dbname("custodian_demo")
            .connect_one()
            .await
            .context("connecting to custodian_demo as the owner")?;
        migrate::run(&mut client).await?;
        drop(client);
        let url = settings.database_url.with_dbname("custodian_demo");
        let pool = custodian_store::connect(&url, 8).await?;
        custodian_store::check_service_role(&pool.get().await?).await?;
        say(format!(
            "fresh database custodian_demo at {url}, migrated by its owner; the story runs as {}",
            custodian_store::roles::APP_ROLE
        ));
        Ok(pool)
    }

    async fn scan_and_post<R: ChainReader>(pool: &Pool, reader: R) -> Result<()> {
        let config = ScanConfig { batch_blocks: 50, ..ScanConfig::default() };
        let report = Scanner::new(reader, pool.clone(), config).run_to_tip(&NoProgress).await?;
        let posted = posting::post_all(&pool.get().await?).await?;
        custodian_projections::seals::seal(&pool.get().await?).await?;
        let reorg = if report.reorgs > 0 {
            format!(", reorg handled: {} blocks orphan-marked", report.orphaned)
        } else {
            String::new()
        };
        say(format!(
            "  scanned to our tip {} ({} new blocks, {} new deposit observations{reorg}); posted {} credits",
            report.our_tip.unwrap_or_default(),
            report.blocks,
            report.deposits,
            posted.posted
        ));
        Ok(())
    }

    async fn table(pool: &Pool, accounts: &[(i64, String)]) -> Result<()> {
        let client = pool.get().await?;
        say(format!(
            "  {:<8} {:<5} {:>14} {:>14} {:>14} {:>14}",
            "account", "asset", "confirmed", "pending", "held", "available"
        ));
        for (id, name) in accounts {
            for b in balances::for_account(&client, *id, name).await? {
                say(format!(
                    "  {:<8} {:<5} {:>14} {:>14} {:>14} {:>14}",
                    name, b.symbol, b.display.confirmed, b.display.pending, b.display.held, b.display.available
                ));
                for p in &b.pending_deposits {
                    say(format!(
                        "  {:<14} pending {}… {}/{} confirmations",
                        "",
                        &p.tx_hash[..12],
                        p.confirmations,
                        p.required_confirmations.unwrap_or(0)
                    ));
                }
            }
        }
        Ok(())
    }

    async fn rpc(anvil: &Anvil, method: &str, params: Value) -> Result<Value> {
        anvil.rpc(method, params).await.with_context(|| format!("anvil {method}"))
    }

    async fn send(anvil: &Anvil, to: &str, wei: u128) -> Result<String> {
        let hash =
            rpc(anvil, "eth_sendTransaction", json!([{"from": FUNDER, "to": to, "value": format!("0x{wei:x}")}]))
                .await?;
        Ok(hash.as_str().context("a hash")?.to_owned())
    }

    async fn mine(anvil: &Anvil, blocks: u64) -> Result<()> {
        rpc(anvil, "anvil_mine", json!([format!("0x{blocks:x}")])).await.map(|_| ())
    }

    async fn withdraw(
        pool: &Pool,
        account: i64,
        external_id: &str,
        to: &str,
        ether: &str,
        requested_by: &str,
    ) -> Result<request::Requested, RequestError> {
        let (destination, amount) = request::parse(Chain::Eth, BtcNetwork::Regtest, to, ether, 18)?;
        let r = Request {
            account_id: AccountId::new(account),
            external_id: ExternalId::parse(external_id).map_err(|e| RequestError::Invalid(e.to_string()))?,
            asset: Asset::Native(Chain::Eth),
            destination,
            amount,
            requested_by: requested_by.to_owned(),
        };
        request::request(pool, &r).await
    }

    pub async fn run(settings: &Settings) -> Result<Exit> {
        let started = Instant::now();
        chapter("Setting up");
        let anvil = Anvil::spawn().await.context("starting anvil (run `make demo`, which installs it)")?;
        say(format!("anvil (a real Ethereum node) at {}", anvil.url));
        let pool = fresh_database(settings).await?;
        let client = pool.get().await?;
        say("operators and clients are API tokens; every decision is recorded with the token that made it:");
        let ops_token = tokens::create(&client, "ops", &[Scope::Admin], tokens::BOOTSTRAP_PRINCIPAL).await?;
        let mut principal = HashMap::new();
        principal.insert("ops", tokens::principal(&client, &ops_token, Scope::Admin, "demo").await?);
        for (name, scopes) in [
            ("wallet-app", &[Scope::Withdraw, Scope::Approve][..]),
            ("dana", &[Scope::Approve][..]),
            ("erin", &[Scope::Approve][..]),
        ] {
            let token = tokens::create(&client, name, scopes, &principal["ops"]).await?;
            let scope = scopes[scopes.len() - 1];
            principal.insert(name, tokens::principal(&client, &token, scope, "demo").await?);
            let names: Vec<&str> = scopes.iter().map(|s| s.as_str()).collect();
            say(format!("  token {name:<10} scopes {}", names.join(",")));
        }
        let ops = principal["ops"].as_str();
        policy::set_tier(&client, Chain::Eth, "ETH", Amount::ZERO, 2, ops).await?;
        policy::set_tier(&client, Chain::Eth, "ETH", Amount::parse_decimal("1", 18)?, 3, ops).await?;
        policy::set_tier(&client, Chain::Eth, "ETH", Amount::parse_decimal("100", 18)?, 3, ops).await?;
        say("confirmation policy for the demo: 2 confirmations below 1 ETH, 3 from 1 ETH (real defaults: 12/32/64)");
        let (hook_url, receiver) = start_receiver().await?;
        let mut admin = pool.get().await?;
        let kinds = [webhooks::Kind::Deposit, webhooks::Kind::Withdrawal];
        let subscriber = webhooks::add(&mut admin, &hook_url, &kinds, Some(WEBHOOK_SECRET), true, ops).await?;
        drop(admin);
        say(format!(
            "webhook subscriber #{} at {hook_url} for deposit,withdrawal facts (signed HMAC-SHA256, delivered in order)",
            subscriber.subscriber.id
        ));

        chapter("Three customers and their deposit addresses");
        let eth_key = DepositKey::from(EthDepositKey::parse(
            &account_xpub("m/44'/60'/0'", bitcoin::NetworkKind::Main)?.to_string(),
        )?);
        say("deposit addresses derive from an account-level xpub (m/44'/60'/0'); the service holds no private key for them");
        let mut accounts = Vec::new();
        let mut addresses = HashMap::new();
        for name in ["alice", "bob", "carol"] {
            let (account, _) = ownership::create_account(&client, name).await?;
            let derived = deposit_addresses::new_address(&mut pool.get().await?, &eth_key, account.id).await?;
            say(format!(
                "  {name:<6} account {} deposit address {} (index {})",
                account.id,
                derived.address.stored(),
                derived.derivation_index
            ));
            addresses.insert(name, derived.address.stored());
            accounts.push((account.id, name.to_owned()));
        }
        let id = |name: &str| accounts.iter().find(|(_, n)| n == name).map(|(id, _)| *id).expect("demo account");

        chapter("Deposits: pending, then confirmed");
        for (name, ether) in [("alice", 5u128), ("bob", 2), ("carol", 1)] {
            let hash = send(&anvil, &addresses[name], ether * ETHER).await?;
            say(format!("  anvil dev account pays {ether} ETH to {name}: {hash}"));
        }
        let reader = EthReader::new(&anvil.url)?;
        scan_and_post(&pool, reader.clone()).await?;
        table(&pool, &accounts).await?;
        mine(&anvil, 3).await?;
        say("  … 3 more blocks");
        scan_and_post(&pool, reader.clone()).await?;
        table(&pool, &accounts).await?;

        chapter("A reorg takes a deposit out, and it comes back");
        let tip_deposit = send(&anvil, &addresses["carol"], ETHER / 2).await?;
        let raw = rpc(&anvil, "eth_getRawTransactionByHash", json!([tip_deposit])).await?;
        say(format!("  0.5 ETH more to carol: {tip_deposit}"));
        scan_and_post(&pool, reader.clone()).await?;
        table(&pool, &accounts).await?;
        rpc(&anvil, "anvil_reorg", json!([1, []])).await?;
        mine(&anvil, 1).await?;
        say("  anvil reorgs its last block away (the deposit is gone from the chain); the scanner orphan-marks, never deletes");
        scan_and_post(&pool, reader.clone()).await?;
        table(&pool, &accounts).await?;
        rpc(&anvil, "eth_sendRawTransaction", json!([raw])).await?;
        mine(&anvil, 3).await?;
        say("  the same signed transaction is mined again in a new block, then 3 blocks on top");
        scan_and_post(&pool, reader.clone()).await?;
        table(&pool, &accounts).await?;
        let observations: i64 =
            client.query_one("select count(*) from deposit_event where tx_hash = $1", &[&tip_deposit]).await?.get(0);
        say(format!(
            "  that deposit has {observations} observations (one orphaned, one canonical) and was credited once"
        ));

        chapter("Withdrawals");
        let node = EthNode::new(&anvil.url)?;
        let mut signers: HashMap<String, Arc<dyn Signer>> = HashMap::new();
        for (lane, key) in HOT_KEYS {
            let signer = LocalSigner::from_hex(key)?;
            let (registered, _) =
                hot_wallet::add(&mut pool.get().await?, &node, lane, EthAddress::from_alloy(signer.address()), ops)
                    .await?;
            say(format!(
                "  hot wallet {} is {lane}, next nonce {}",
                registered.address.to_lowercase_hex(),
                registered.next_nonce
            ));
            // anvil's dev accounts start with 10,000 ETH the chain never showed arriving; the
            // demo empties them so that every wei a hot wallet holds came by a transfer the
            // scanner saw (and `reconcile` can account for).
            rpc(&anvil, "anvil_setBalance", json!([registered.address, "0x0"])).await?;
            let funding = send(&anvil, &registered.address.to_lowercase_hex(), 10 * ETHER).await?;
            say(format!("    funded with 10 ETH by a transfer the scanner credits to the treasury: {funding}"));
            signers.insert(lane.to_owned(), Arc::new(signer));
        }
        mine(&anvil, 3).await?;
        scan_and_post(&pool, reader.clone()).await?;
        let four_eyes = LimitChange {
            approval_limit: Some(Some(U256::from(3 * ETHER))),
            approvals_required: Some(2),
            daily_limit: None,
        };
        limits::set(&mut pool.get().await?, "ETH", &four_eyes, ops).await?;
        say("  approval limit (set by ops): withdrawals above 3 ETH wait for two approvers, neither the requester");
        let app = principal["wallet-app"].as_str();
        let outside = EthAddress::parse("0x5aAeb6053F3E94C9b9A09f33669435E7Ef1BeAed")?.to_checksummed();
        let first = withdraw(&pool, id("alice"), "alice-0001", &outside, "1.25", app).await?;
        say(format!(
            "  alice asks for 1.25 ETH (external id alice-0001): withdrawal {} {}",
            first.withdrawal.id(),
            first.withdrawal.state().as_str()
        ));
        let retried = withdraw(&pool, id("alice"), "alice-0001", &outside, "1.25", app).await?;
        say(format!(
            "  her client retries the same request: withdrawal {} again (created now: {})",
            retried.withdrawal.id(),
            retried.created
        ));
        match withdraw(&pool, id("bob"), "bob-0001", &outside, "10", app).await {
            Err(e) => say(format!("  bob asks for 10 ETH: refused, nothing written: {e}")),
            Ok(_) => bail!("bob's withdrawal should have been refused"),
        }
        let big = withdraw(&pool, id("alice"), "alice-0002", &outside, "3.5", app).await?;
        say(format!(
            "  alice asks for 3.5 ETH through {app}: withdrawal {} {}",
            big.withdrawal.id(),
            big.withdrawal.state().as_str()
        ));
        match actions::approve(&mut pool.get().await?, big.withdrawal.id().get(), app).await {
            Err(refusal @ actions::ActionError::SelfApproval { .. }) => {
                say(format!("  {app} (which holds the approve scope) tries to approve it: refused: {refusal}"))
            }
            other => bail!("a self-approval must be refused, got {other:?}"),
        }
        let (approved, _) =
            actions::approve(&mut pool.get().await?, big.withdrawal.id().get(), &principal["dana"]).await?;
        say(format!("  dana approves it: still {} (one of two)", approved.state().as_str()));
        let (again, recorded) =
            actions::approve(&mut pool.get().await?, big.withdrawal.id().get(), &principal["dana"]).await?;
        say(format!("  dana approves again: counts once (recorded: {recorded}), still {}", again.state().as_str()));
        let (approved, _) =
            actions::approve(&mut pool.get().await?, big.withdrawal.id().get(), &principal["erin"]).await?;
        say(format!(
            "  erin approves it: {} (approved by {})",
            approved.state().as_str(),
            approved.approvers().join(" and ")
        ));
        table(&pool, &accounts).await?;

        let worker = Worker::new(
            pool.clone(),
            node,
            signers,
            WorkerConfig { confirmations: 2, chain_id: Some(DEMO_CHAIN_ID), ..WorkerConfig::default() },
        );
        let ids = [first.withdrawal.id(), big.withdrawal.id()];
        let mut told: HashMap<i64, usize> = HashMap::new();
        for _ in 0..30 {
            worker.pass().await?;
            let mut all_confirmed = true;
            for id in ids {
                let events = sql::events(&client, id.get()).await?;
                let from = told.get(&id.get()).copied().unwrap_or(0);
                for event in &events[from..] {
                    let detail = match event {
                        WithdrawalEvent::Signed { from_address, nonce: Some(nonce), tx_hash, .. } => {
                            format!("nonce {nonce} of {from_address} allocated and signed: {tx_hash}")
                        }
                        WithdrawalEvent::Broadcast { tx_hash, .. } => format!("the node accepted {tx_hash}"),
                        WithdrawalEvent::Mined { block_number, .. } => format!("mined in block {block_number}"),
                        WithdrawalEvent::Confirmed { fee, .. } => format!(
                            "confirmed; real fee {} ETH (gasUsed x effectiveGasPrice)",
                            fee.to_decimal_string(18)
                        ),
                        WithdrawalEvent::Requested { amount, .. } => {
                            format!("{} ETH, hold posted", amount.to_decimal_string(18))
                        }
                        WithdrawalEvent::AwaitingApproval { limit, approvals, .. } => {
                            format!(
                                "above the {} ETH approval limit: {approvals} approvers",
                                limit.to_decimal_string(18)
                            )
                        }
                        WithdrawalEvent::Approved { by } => format!("approved by {by}"),
                        other => other.event_type().to_owned(),
                    };
                    say(format!("  withdrawal {id} {}: {detail}", event.event_type()));
                }
                told.insert(id.get(), events.len());
                all_confirmed &=
                    sql::load(&client, id.get()).await?.is_some_and(|w| w.state() == WithdrawalState::Confirmed);
            }
            if all_confirmed {
                break;
            }
            mine(&anvil, 1).await?;
        }
        table(&pool, &accounts).await?;

        chapter("Bitcoin (against testkit's Bitcoin Core simulator: no bitcoind is installed here)");
        let sim = BitcoinSim::start().await;
        let btc_key = DepositKey::from(BtcDepositKey::parse(
            &account_xpub("m/84'/1'/0'", bitcoin::NetworkKind::Test)?.to_string(),
            BtcNetwork::Regtest,
        )?);
        let derived = deposit_addresses::new_address(&mut pool.get().await?, &btc_key, id("alice")).await?;
        say(format!("  alice's BTC deposit address (BIP-84 P2WPKH): {}", derived.address));
        let address = derived.address.btc().expect("a BTC key derives BTC addresses").as_bitcoin().clone();
        let tx = sim.pay(&[(address.clone(), bitcoin::Amount::from_sat(5_000_000))]);
        sim.mine_empty(1);
        sim.mine(&[tx]);
        say("  the simulator mines a real block paying her 0.05 BTC (1 confirmation needed below 0.1 BTC)");
        let auth = BtcAuth::UserPassword { user: sim.user().to_owned(), password: sim.password().to_owned() };
        let btc_reader = || BtcReader::new(&sim.url(), auth.clone(), BtcNetwork::Regtest);
        scan_and_post(&pool, btc_reader()?).await?;

        chapter("A deposit reorged out, a discrepancy after its grace, the money re-mined and credited again");
        let half = sim.pay(&[(address.clone(), bitcoin::Amount::from_sat(50_000_000))]);
        sim.mine(std::slice::from_ref(&half));
        sim.mine_empty(2);
        say("  alice is paid 0.5 BTC (the 3-confirmation tier) and the block gets 3 confirmations");
        scan_and_post(&pool, btc_reader()?).await?;
        let old_tip = sim.height();
        sim.reorg(3, &[vec![], vec![], vec![], vec![]]);
        say(format!(
            "  a reorg replaces the last 3 blocks with 4 empty ones: the payment is gone (old tip {old_tip}, now {})",
            sim.height()
        ));
        scan_and_post(&pool, btc_reader()?).await?;
        let open = custodian_projections::reversals::list(&pool.get().await?).await?;
        say(format!(
            "  discrepancies open: {} (the grace is the deposit's own 3 blocks beyond the old tip; the money may come back)",
            open.iter().filter(|p| p.decision.is_none()).count()
        ));
        sim.mine_empty(2);
        scan_and_post(&pool, btc_reader()?).await?;
        let open: Vec<_> = custodian_projections::reversals::list(&pool.get().await?)
            .await?
            .into_iter()
            .filter(|p| p.decision.is_none())
            .collect();
        let Some(round) = open.first() else { bail!("no discrepancy opened after the grace period") };
        say(format!(
            "  3 blocks beyond the old tip without it: discrepancy #{} opened for {} ({} sat from {}); nothing debited yet",
            round.id,
            round.deposit_key,
            round.amount,
            round.ledger_account
        ));
        let (decided, _) = custodian_projections::reversals::decide(
            &mut pool.get().await?,
            round.id,
            true,
            "carol",
            Some("the payment is gone from the chain"),
        )
        .await?;
        say(format!(
            "  carol (an approve-scoped token) approves it: alice is debited by transfer #{}",
            decided.compensating_transfer_id.unwrap_or_default()
        ));
        table(&pool, &accounts).await?;
        sim.mine(std::slice::from_ref(&half));
        sim.mine_empty(2);
        say("  the same signed payment is mined again later and confirmed");
        scan_and_post(&pool, btc_reader()?).await?;
        let client = pool.get().await?;
        let row = client
            .query_one(
                "select deposit_key, credited::text, reversed::text, recredited::text from deposit_status
                  where tx_hash = $1 and not orphaned",
                &[&half.compute_txid().to_string()],
            )
            .await?;
        say(format!(
            "  deposit_status for {}: credited {}, reversed {}, re-credited {} (automatically, once)",
            row.get::<_, String>(0),
            row.get::<_, String>(1),
            row.get::<_, String>(2),
            row.get::<_, String>(3)
        ));

        chapter("Bitcoin withdrawals: one transaction pays a batch, a replacement bumps it");
        let account = {
            let master = Xpriv::new_master(bitcoin::Network::Regtest, &[42u8; 32])?;
            master.derive_priv(&Secp256k1::new(), &DerivationPath::from_str("m/84'/1'/0'")?)?
        };
        let hot_key = BtcHotKey::parse(&account.to_string(), BtcNetwork::Regtest)?;
        hot_wallet::add_btc(&mut pool.get().await?, &hot_key, "btc-1", sim.height(), "operator").await?;
        let funding = hot_key.funding_address();
        say(format!("  BTC hot wallet btc-1 from a BIP-84 account key; funding address …/0/0 = {funding}"));
        let top_up = sim.pay(&vec![(funding.clone(), bitcoin::Amount::from_sat(20_000_000)); 2]);
        sim.mine(&[top_up]);
        sim.mine_empty(3);
        scan_and_post(&pool, btc_reader()?).await?;
        say("  the treasury tops it up with two coins of 0.2 BTC, confirmed and credited to treasury");
        let mut batch = Vec::new();
        for (n, kind) in [AddrKind::P2wpkh, AddrKind::P2tr, AddrKind::P2pkh].into_iter().enumerate() {
            let to = sim.address(kind, 500 + n as u32);
            let r = Request {
                account_id: AccountId::new(id("alice")),
                external_id: ExternalId::parse(&format!("alice-btc-{n}"))?,
                asset: Asset::Native(Chain::Btc),
                destination: ChainAddress::Btc(BtcAddress::parse(&to.to_string(), BtcNetwork::Regtest)?),
                amount: Amount::parse_decimal("0.01", 8)?,
                requested_by: "alice-app".into(),
            };
            let w = request::request(&pool, &r).await?.withdrawal;
            say(format!("  alice asks for 0.01 BTC to {to} (withdrawal {})", w.id()));
            batch.push(w.id());
        }
        let rpc = custodian_store::btc_rpc::BtcRpc::new(&sim.url(), auth.clone())?;
        let config = BtcConfig {
            network: BtcNetwork::Regtest,
            batch_wait: std::time::Duration::ZERO,
            confirmations: 1,
            bump_after_blocks: 1,
            ..BtcConfig::default()
        };
        let keys = std::collections::HashMap::from([("btc-1".to_owned(), std::sync::Arc::new(hot_key))]);
        let btc_worker = BtcWorker::new(pool.clone(), BtcNode::new(rpc), keys, config);
        btc_worker.pass().await?;
        let client = pool.get().await?;
        let original = sql::load(&client, batch[0].get())
            .await?
            .and_then(|w| w.tx_hash().map(|h| h.to_string()))
            .unwrap_or_default();
        let row = client.query_one("select fee::text, vsize from btc_attempt where tx_hash = $1", &[&original]).await?;
        say(format!(
            "  one pass: coins reserved, one transaction signed (BIP-143) paying all three plus change, stored, sent: {original} ({} vB, fee {} sat)",
            row.get::<_, i32>(1),
            row.get::<_, String>(0)
        ));
        sim.set_fee_rate(Some(25));
        sim.mine_empty(1);
        scan_and_post(&pool, btc_reader()?).await?;
        btc_worker.pass().await?;
        let bumped = sql::load(&client, batch[0].get())
            .await?
            .and_then(|w| w.live_attempt().map(|h| h.to_string()))
            .unwrap_or_default();
        let row = client.query_one("select fee::text from btc_attempt where tx_hash = $1", &[&bumped]).await?;
        say(format!(
            "  the fee market rises to 25 sat/vB and a block passes without it: replaced (BIP-125) by {bumped}, fee {} sat from change; the customers' outputs unchanged",
            row.get::<_, String>(0)
        ));
        sim.mine_mempool();
        scan_and_post(&pool, btc_reader()?).await?;
        btc_worker.pass().await?;
        for id in &batch {
            let w = sql::load(&client, id.get()).await?.context("a demo withdrawal")?;
            say(format!(
                "  withdrawal {id}: {} by {}",
                w.state().as_str(),
                w.tx_hash().map(|h| h.to_string()).unwrap_or_default()
            ));
        }
        table(&pool, &accounts).await?;

        chapter("Webhooks and reconciliation");
        let deliverer = webhooks::Deliverer::new(pool.clone(), webhooks::DeliveryConfig::default(), "demo".to_owned())?;
        let mut delivered = 0;
        // The history is final once no older transaction is running; a few passes reach its end.
        for _ in 0..20 {
            let report = deliverer.pass().await?;
            delivered += report.subscribers.values().map(|t| t.delivered).sum::<u64>();
            if report.subscribers.values().all(|t| t.delivered == 0 && t.failed.is_none()) && delivered > 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let got = receiver.got.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let verified = got.iter().filter(|(_, _, ok)| *ok).count();
        let once = got.iter().map(|(id, _, _)| *id).collect::<std::collections::HashSet<_>>().len() == got.len();
        say(format!(
            "  {} facts delivered to the receiver, {verified} with a signature it verified, each once: {once}",
            got.len()
        ));
        for (id, kind, _) in got.iter().take(3).chain(got.iter().rev().take(2).collect::<Vec<_>>().into_iter().rev()) {
            say(format!("    #{id} {kind}"));
        }
        if verified != got.len() || got.is_empty() {
            bail!("the webhook receiver could not verify every delivery");
        }
        // The chain is read at our tip: scan to the node's tip first, so what the worker settled
        // is in the blocks read.
        scan_and_post(&pool, reader.clone()).await?;
        let node = EthNode::with_timeout(&anvil.url, std::time::Duration::from_secs(10))?;
        let reconciled = custodian_service::reconcile::once(Some(&node), &pool).await?;
        if reconciled.differences.is_empty() {
            let checked = reconciled.assets.len();
            say(format!(
                "  reconcile: {checked} assets; custody equals what the chain says our addresses hold, and covers what customers are owed"
            ));
            for skipped in &reconciled.skipped {
                say(format!("    skipped: {skipped}"));
            }
        } else {
            for d in &reconciled.differences {
                say(format!("  DIFFERENCE {d}"));
            }
            bail!("reconcile found {} differences", reconciled.differences.len());
        }

        chapter("Audit");
        let report = replay::verify(&mut pool.get().await?).await?;
        if report.verified() {
            say(format!(
                "  replay --verify: {} facts replayed; every projection and invariant matches",
                report.facts_read
            ));
        } else {
            for d in &report.differences {
                say(format!("  DIFFERENCE [{}] {}", d.check, d.detail));
            }
            bail!("replay --verify found {} differences", report.differences.len());
        }
        chapter("Final balances");
        table(&pool, &accounts).await?;
        say(format!("\ndemo finished in {:.0?}", started.elapsed()));
        Ok(Exit::Success)
    }
}
