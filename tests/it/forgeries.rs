//! Forgeries `replay --verify` must name (exit 3), each made by the schema owner with the
//! triggers off and everything derived from the forged fact changed to match: only the retained
//! raw blocks and the fact seals can tell.

use bitcoin::Amount as Sats;
use custodian_domain::withdrawal::WithdrawalState;
use custodian_testkit::btcsim::{AddrKind, BitcoinSim};
use custodian_testkit::TestDb;
use serde_json::Value;

use crate::harness::{custodian, custodian_env_async};
use crate::ledger_support::new_account;

/// `replay --verify --json` must fail (exit 3) and name `check` with a detail containing `needle`.
fn names(db: &TestDb, check: &str, needle: &str) -> Vec<Value> {
    let replay = custodian(db.url.expose(), &["replay", "--verify", "--json"]);
    assert_eq!(replay.code, 3, "the forgery passed: {}", replay.stdout);
    let differences = replay.json()["differences"].as_array().unwrap().clone();
    assert!(
        differences.iter().any(|d| d["check"] == check && d["detail"].as_str().unwrap().contains(needle)),
        "expected a {check:?} difference mentioning {needle:?}: {differences:#?}"
    );
    differences
}

/// Facts of the history without a seal.
async fn unsealed(client: &deadpool_postgres::Object) -> i64 {
    client
        .query_one("select count(*) from audit_event a where not exists (select 1 from fact_seal s where s.position = a.position)", &[])
        .await
        .unwrap()
        .get(0)
}

/// Seals until every fact of the history is sealed (the horizon is cluster-wide: a transaction
/// running in another test's database holds it back for a moment).
async fn sealed_all(db: &TestDb) {
    custodian_testkit::eventually("every fact sealed", std::time::Duration::from_secs(30), || async {
        let client = db.pool.get().await.unwrap();
        custodian_projections::seals::seal(&client).await.unwrap();
        (unsealed(&client).await == 0).then_some(())
    })
    .await;
}

async fn owner_runs(db: &TestDb, sql: &str) {
    let owner = db.owner_client().await;
    owner.batch_execute(sql).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// [`owner_runs`] `sql` with the user triggers of `tables` (the append-only guards) switched off
/// around it, as a forger with the schema owner's rights would.
async fn owner_runs_unguarded(db: &TestDb, tables: &[&str], sql: &str) {
    let switch = |to: &str| tables.iter().map(|t| format!("alter table {t} {to} trigger user;")).collect::<String>();
    owner_runs(db, &format!("{}\n{sql}\n{}", switch("disable"), switch("enable"))).await;
}

/// Two BTC deposits scanned and credited (and sealed) through the binary.
async fn deposits() -> (TestDb, BitcoinSim, String) {
    let db = TestDb::new().await;
    let sim = BitcoinSim::start().await;
    let address = sim.address(AddrKind::P2wpkh, 31);
    new_account(&db, "alice", &address, 0).await;
    sim.mine_empty(1);
    let paid = sim.pay(&[(address.clone(), Sats::from_sat(1_000_000))]);
    sim.mine(std::slice::from_ref(&paid));
    sim.mine(&[sim.pay(&[(address.clone(), Sats::from_sat(2_000_000))])]);
    sim.mine_empty(2);
    let env = vec![
        ("CUSTODIAN_DATABASE_URL".to_owned(), db.url.expose().to_owned()),
        ("CUSTODIAN_BTC_RPC_URL".to_owned(), sim.url()),
        ("CUSTODIAN_BTC_RPC_USER".to_owned(), sim.user().to_owned()),
        ("CUSTODIAN_BTC_RPC_PASSWORD".to_owned(), sim.password().to_owned()),
        ("CUSTODIAN_BTC_NETWORK".to_owned(), "regtest".to_owned()),
    ];
    let scanned = custodian_env_async(env, &["scan", "--chain", "btc", "--once"]).await;
    assert_eq!(scanned.code, 0, "{}", scanned.stderr);
    sealed_all(&db).await;
    let replay = custodian(db.url.expose(), &["replay", "--verify", "--json"]);
    assert_eq!(replay.code, 0, "the honest ledger verifies: {}", replay.stdout);
    (db, sim, paid.compute_txid().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_deposit_amount_with_its_posting_edited_to_match_is_named() {
    let (db, _sim, txid) = deposits().await;
    owner_runs_unguarded(
        &db,
        &["deposit_event", "ledger_posting"],
        &format!(
            "update deposit_event set amount = 9000000 where tx_hash = '{txid}';
             update ledger_posting set amount = 9000000 where transfer_id =
                 (select id from ledger_transfer where deposit_key like 'deposit:btc:{txid}:%');"
        ),
    )
    .await;
    names(&db, "raw blocks", "the block's payload says 1000000");
    names(&db, "fact seals", "deposit_observed fact was changed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fabricated_deposit_with_its_transfer_is_named() {
    let (db, _sim, _) = deposits().await;
    let forged_tx = "ab".repeat(32);
    // The service role itself may append facts: the forgery needs no trigger switched off.
    let app = db.pool.get().await.unwrap();
    app.batch_execute(&format!(
        "insert into deposit_event (chain, block_hash, tx_hash, kind, output_index, address, asset, amount)
         select chain, block_hash, '{forged_tx}', 'output', 0, address, asset, 5000000
           from deposit_event order by id limit 1;
         begin;
         insert into ledger_transfer (idempotency_key, kind, deposit_key, reference)
         select 'deposit:btc:{forged_tx}:output:0:credit:1', 'deposit', 'deposit:btc:{forged_tx}:output:0',
                jsonb_build_object('chain', 'btc', 'tx_hash', '{forged_tx}', 'kind', 'output', 'output_index', 0,
                                   'block_hash', block_hash)
           from deposit_event where tx_hash = '{forged_tx}';
         insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount)
         select currval('ledger_transfer_id_seq'), a, 'BTC', d, 5000000
           from (values ('custody', 'debit'), ('user:1', 'credit')) v(a, d);
         commit;"
    ))
    .await
    .unwrap();
    names(&db, "raw blocks", &format!("observation {forged_tx}:output:0"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_row_feeding_account_balance_is_named() {
    let (db, _sim, txid) = deposits().await;
    owner_runs_unguarded(
        &db,
        &["ledger_posting"],
        &format!(
            "update ledger_posting set amount = amount + 1
              where direction = 'credit' and ledger_account like 'user:%' and transfer_id =
                    (select id from ledger_transfer where deposit_key like 'deposit:btc:{txid}:%');"
        ),
    )
    .await;
    names(&db, "transfers balance", "debits differ from credits");
    names(&db, "fact seals", "ledger_transfer fact was changed");
}

/// One ETH withdrawal requested, signed, mined and confirmed with its real fee, then sealed.
async fn settled_withdrawal() -> (crate::eth_harness::Harness, i64) {
    let h = crate::eth_harness::Harness::start(&[]).await;
    let alice = h.funded_account("alice", 1_000_000_000_000_000_000).await;
    let w =
        h.request(alice, "pay-1", "0x90f79bf6eb2c4f870365e785982e1f101e93b906", 1_000_000_000_000_000).await.unwrap();
    let worker = h.worker(custodian_withdrawals::WorkerConfig { confirmations: 1, ..Default::default() });
    let id = w.withdrawal.id();
    h.work_until(&worker, true, "confirmation", |h| {
        Box::pin(async move { h.state(id.get()).await == WithdrawalState::Confirmed })
    })
    .await;
    sealed_all(&h.db).await;
    let replay = custodian(h.db.url.expose(), &["replay", "--verify", "--json"]);
    assert_eq!(replay.code, 0, "the honest ledger verifies: {}", replay.stdout);
    (h, id.get())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_withdrawal_event_with_its_transfers_and_projection_made_to_match_is_named() {
    let (h, id) = settled_withdrawal().await;
    owner_runs_unguarded(
        &h.db,
        &["withdrawal_event", "ledger_transfer", "ledger_posting"],
        &format!(
            "delete from ledger_posting where transfer_id in (select id from ledger_transfer
                 where idempotency_key in ('withdrawal:{id}:settle', 'withdrawal:{id}:fee'));
             delete from ledger_transfer where idempotency_key in ('withdrawal:{id}:settle', 'withdrawal:{id}:fee');
             delete from withdrawal_event where withdrawal_id = {id} and event_type = 'confirmed';
             update withdrawal set state = 'mined', last_seq = last_seq - 1 where id = {id};"
        ),
    )
    .await;
    names(&h.db, "fact seals", "withdrawal_confirmed fact is gone");
    names(&h.db, "fact seals", "ledger_transfer fact is gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fee_edited_consistently_in_its_event_and_postings_is_named() {
    let (h, id) = settled_withdrawal().await;
    owner_runs_unguarded(
        &h.db,
        &["withdrawal_event", "ledger_posting"],
        &format!(
            "update withdrawal_event set payload = jsonb_set(payload, '{{fee}}',
                    to_jsonb(((payload ->> 'fee')::numeric - 1000)::text))
              where withdrawal_id = {id} and event_type = 'confirmed';
             update ledger_posting set amount = amount - 1000
              where transfer_id = (select id from ledger_transfer where idempotency_key = 'withdrawal:{id}:fee');"
        ),
    )
    .await;
    names(&h.db, "fact seals", "withdrawal_confirmed fact was changed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_balance_row_the_request_path_reads_that_disagrees_with_the_postings_is_named() {
    let (db, _sim, _txid) = deposits().await;
    // The service may read the projection, never write it: only the ledger's trigger does.
    let service = db.pool.get().await.unwrap();
    let refused = service.execute("update user_balance set balance = balance + 1", &[]).await;
    assert!(refused.is_err(), "the service cannot write user_balance");
    let balance: String =
        service.query_one("select balance::text from user_balance where asset = 'BTC'", &[]).await.unwrap().get(0);
    assert_eq!(balance, "3000000", "kept by the postings' own transaction");
    owner_runs(&db, "update user_balance set balance = balance + 500000000 where asset = 'BTC'").await;
    names(&db, "user balances", "user_balance says 503000000, the postings sum to 3000000");
}

/// The seals written in one statement (V17) are the ones V7's loop wrote fact by fact: the same
/// digests and the same chain, continued from the last seal across batches of any size. Checked
/// against that loop itself, run over the same history (withdrawal events and ledger transfers
/// with their postings) into a table of its own.
#[tokio::test]
async fn seals_written_in_batches_are_the_chain_the_fact_by_fact_loop_computes() {
    let db = TestDb::new().await;
    let owner = db.owner_client().await;
    for n in 0..3 {
        let account: i64 = owner
            .query_one("insert into account (external_ref) values ($1) returning id", &[&format!("seal-{n}")])
            .await
            .unwrap()
            .get(0);
        custodian_testkit::fixtures::credit_eth(&owner, account, n, 1_000 + u128::from(n)).await;
    }
    owner_runs(
        &db,
        "insert into withdrawal_event (withdrawal_id, seq, event_type, payload)
         select n / 5, n % 5 + 1, 'signed', jsonb_build_object('tx_hash', lpad(to_hex(n), 64, '0'), 'nonce', n)
           from generate_series(5, 204) n;",
    )
    .await;
    // Batches of 7: the chain is carried from one statement to the next.
    custodian_testkit::eventually("every fact sealed", std::time::Duration::from_secs(30), || async {
        let client = db.pool.get().await.unwrap();
        while client.query_one("select seal_facts(7)", &[]).await.unwrap().get::<_, i32>(0) == 7 {}
        (unsealed(&client).await == 0).then_some(())
    })
    .await;
    owner_runs(
        &db,
        "create table expected_seal (position bigint, digest bytea, chain_hash bytea);
         do $$
         declare
             previous bytea := sha256(''::bytea);
             fact record;
             digest bytea;
         begin
             for fact in select a.position, a.kind, a.payload from audit_event a order by a.xid, a.position loop
                 digest := fact_digest(fact.kind, fact.position, fact.payload);
                 previous := sha256(previous || digest);
                 insert into expected_seal values (fact.position, digest, previous);
             end loop;
         end $$;",
    )
    .await;
    let compared = owner
        .query_one(
            "select count(*), count(*) filter (where s.digest is distinct from e.digest
                                                  or s.chain_hash is distinct from e.chain_hash)
               from expected_seal e full join fact_seal s using (position)",
            &[],
        )
        .await
        .unwrap();
    let (facts, differing): (i64, i64) = (compared.get(0), compared.get(1));
    assert!(facts > 200, "the history holds the events and the transfers: {facts}");
    assert_eq!(differing, 0, "seals differing from the loop's");
    assert!(custodian_projections::seals::broken(&db.pool.get().await.unwrap()).await.unwrap().is_empty());
}
