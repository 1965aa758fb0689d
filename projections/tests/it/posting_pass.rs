//! The posting pass's reads of `deposit_status` after every scan step: the same rows as the view
//! filtered whole, derived for the few observations that can be among them, not for every deposit
//! ever observed.

use custodian_projections::posting;
use custodian_testkit::fixtures::credit_eth;
use custodian_testkit::TestDb;
use serde_json::Value;

/// The posting pass's statements as they were: filters on `deposit_status` over every
/// observation. The definition the candidates must agree with.
const DUE_WHOLE: &str = "
select distinct on (s.deposit_key) s.deposit_key, s.block_hash, s.amount - s.custody_posted as owed
  from deposit_status s
 where s.chain = $1 and s.confirmed and s.account_id is not null and s.custody_posted < s.amount
 order by s.deposit_key, s.height";
const MISMATCHES_WHOLE: &str = "
select s.deposit_key, s.block_hash
  from deposit_status s
 where s.chain = $1 and s.confirmed and s.custody_posted > 0
   and (s.custody_posted <> s.amount or s.account_id is null
        or s.credited_account not in ('user:' || s.account_id, 'treasury'))";

/// How many times a plan's nodes read `relation`, over every loop.
fn reads(plan: &Value, relation: &str) -> u64 {
    let own = if plan["Relation Name"] == relation { plan["Actual Loops"].as_u64().unwrap() } else { 0 };
    own + plan["Plans"].as_array().map_or(0, |children| children.iter().map(|c| reads(c, relation)).sum())
}

/// How many times `sql`, run for ETH, read `relation`.
async fn lookups(client: &tokio_postgres::Client, sql: &str, relation: &str) -> u64 {
    let explained: Value =
        client.query_one(&format!("explain (analyze, format json) {sql}"), &[&"eth"]).await.unwrap().get(0);
    reads(&explained[0]["Plan"], relation)
}

/// The rows of `sql` for ETH, each as `columns` (text), sorted.
async fn rows(client: &tokio_postgres::Client, sql: &str, columns: &str) -> Vec<Vec<String>> {
    let mut rows: Vec<Vec<String>> = client
        .query(&format!("select {columns} from ({sql}) q"), &[&"eth"])
        .await
        .unwrap()
        .iter()
        .map(|row| (0..row.len()).map(|i| row.get(i)).collect())
        .collect();
    rows.sort();
    rows
}

#[tokio::test]
async fn the_pass_derives_the_status_of_its_candidates_only_and_finds_what_the_whole_view_finds() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let owner = db.owner_client().await;
    let accounts: Vec<i64> = client
        .query("insert into account (external_ref) select 'pass-' || n from generate_series(1, 4) n returning id", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    // 40 deposits observed and credited exactly: nothing to do for any of them. Each amount its
    // own, so that no plan can answer one tier lookup for several of them.
    for n in 0..40 {
        credit_eth(&client, accounts[0], n, 1_000 + u128::from(n)).await;
    }
    // And one of each case the pass acts on or reports, in the blocks of the credits above.
    for (account, n) in [(accounts[1], 0), (accounts[2], 0), (accounts[3], 0)] {
        credit_eth(&client, account, n, 1_000).await;
    }
    let key = |account: i64| format!("deposit:eth:0x{:064x}:native:0", 0x7e57_0000_0000u64 + account as u64 * 1000);
    let block = |account: i64| format!("0x{:064x}", 0xb10c_0000_0000u64 + account as u64 * 1000);
    let address = |account: i64| format!("0x{:040x}", 0xdead_0000_0000u64 + account as u64 * 1000);
    // An observation of transaction `tx` paying `amount` to `to`, in the second customer's block,
    // and its first credit, to `credited`.
    let observed_and_credited = |tx: u64, to: &str, amount: u32, credited: &str| {
        let (block, tx) = (block(accounts[1]), format!("0x{tx:064x}"));
        format!(
            "insert into deposit_event (chain, block_hash, tx_hash, kind, output_index, address, asset, amount)
                  values ('eth', '{block}', '{tx}', 'native', 0, '{to}', 'ETH', {amount});
             insert into ledger_transfer (idempotency_key, kind, deposit_key, reference)
                  values ('deposit:eth:{tx}:native:0:credit:1', 'deposit', 'deposit:eth:{tx}:native:0',
                          jsonb_build_object('chain', 'eth', 'tx_hash', '{tx}', 'kind', 'native',
                                             'output_index', 0, 'block_hash', '{block}'));
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
                  (currval('ledger_transfer_id_seq'), 'custody', 'ETH', 'debit', {amount}),
                  (currval('ledger_transfer_id_seq'), '{credited}', 'ETH', 'credit', {amount});"
        )
    };
    owner
        .batch_execute(&format!(
            "-- every block deep below the tip
             insert into chain_block (chain, height, block_hash, parent_hash)
                  values ('eth', 5000000, '0x{tip:064x}', '0x{tip:064x}');
             -- observed, not credited: due
             insert into deposit_event (chain, block_hash, tx_hash, kind, output_index, address, asset, amount)
                  values ('eth', '{b1}', '0x{due:064x}', 'native', 0, '{a1}', 'ETH', 700);
             -- credited twice: more in custody than the chain paid
             insert into ledger_transfer (idempotency_key, kind, deposit_key, reference)
                  select '{k2}:credit:2', 'deposit', deposit_key, reference from ledger_transfer
                   where idempotency_key = '{k2}:credit:1';
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
                  (currval('ledger_transfer_id_seq'), 'custody', 'ETH', 'debit', 5),
                  (currval('ledger_transfer_id_seq'), 'user:{u2}', 'ETH', 'credit', 5);
             -- paid to the fourth customer's address, credited to the third customer
             {wrong}
             -- credited, to an address nobody owns
             {nobody}",
            tip = 0x71f_u64,
            due = 0xd0e_u64,
            b1 = block(accounts[1]),
            a1 = address(accounts[1]),
            k2 = key(accounts[2]),
            u2 = accounts[2],
            wrong = observed_and_credited(0x3707, &address(accounts[3]), 300, &format!("user:{}", accounts[2])),
            nobody = observed_and_credited(0x0b0d, &format!("0x{:040x}", 0x0b0d), 400, "treasury"),
        ))
        .await
        .unwrap();
    db.owner_client().await.batch_execute("analyze").await.unwrap();

    const DUE_COLUMNS: &str = "deposit_key, block_hash, owed::text";
    let due = rows(&client, DUE_WHOLE, DUE_COLUMNS).await;
    assert_eq!(due, [[format!("deposit:eth:0x{:064x}:native:0", 0xd0e), block(accounts[1]), "700".to_owned()]]);
    assert_eq!(rows(&client, &posting::due(), DUE_COLUMNS).await, due);
    let mismatched = rows(&client, MISMATCHES_WHOLE, "deposit_key").await;
    assert_eq!(
        mismatched,
        [
            [format!("deposit:eth:0x{:064x}:native:0", 0x0b0d)],
            [format!("deposit:eth:0x{:064x}:native:0", 0x3707)],
            [key(accounts[2])],
        ],
        "to nobody's address, to another customer, credited twice"
    );
    assert_eq!(rows(&client, &posting::mismatches(), "deposit_key").await, mismatched);

    // 46 observations. Filtered whole, each statement derives the status of every one of them (a
    // tier lookup in `confirmation_policy` for each); the pass derives the status of its
    // candidates: the one observation owed money, and the three keys holding something other than
    // their observations say.
    const TIERS: &str = "confirmation_policy";
    assert!(lookups(&client, DUE_WHOLE, TIERS).await >= 46, "the whole view is the measure");
    let due_lookups = lookups(&client, &posting::due(), TIERS).await;
    assert!(due_lookups <= 2, "due: {due_lookups} tier lookups for 1 candidate");
    let mismatch_lookups = lookups(&client, &posting::mismatches(), TIERS).await;
    assert!(mismatch_lookups <= 2 * 3, "mismatches: {mismatch_lookups} tier lookups for 3 candidates");
    // deposit_lost derives the owner of the observations on orphaned blocks only: here, none.
    let owners = lookups(&client, "select * from deposit_lost where chain = $1", "wallet_address").await;
    assert_eq!(owners, 0, "no block is orphaned, yet deposit_lost looked up {owners} owners");
}

/// The rows of `sql` for ETH since `horizon`, each as `columns` (text), sorted.
async fn rows_since(
    client: &tokio_postgres::Client,
    sql: &str,
    columns: &str,
    horizon: &posting::Horizon,
) -> Vec<Vec<String>> {
    let mut rows: Vec<Vec<String>> = client
        .query(&format!("select {columns} from ({sql}) q"), &[&"eth", &horizon.xmin, &horizon.tip, &horizon.deepest])
        .await
        .unwrap()
        .iter()
        .map(|row| (0..row.len()).map(|i| row.get(i)).collect())
        .collect();
    rows.sort();
    rows
}

#[tokio::test]
async fn a_pass_since_a_horizon_finds_what_changed_through_every_fact_and_the_tip_and_nothing_else() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let owner = db.owner_client().await;
    let accounts: Vec<i64> = client
        .query("insert into account (external_ref) select 'since-' || n from generate_series(1, 4) n returning id", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    // 40 deposits observed and credited exactly, each amount its own, and one credited deposit of
    // each other customer (their addresses and blocks, at heights about 1,000,000 + 1,000 × id).
    for n in 0..40 {
        credit_eth(&client, accounts[0], n, 1_000 + u128::from(n)).await;
    }
    for &account in &accounts[1..] {
        credit_eth(&client, account, 0, 1_000).await;
    }
    let seed = |account: i64, n: u64| account as u64 * 1000 + n;
    let key = |tx: u64| format!("deposit:eth:0x{tx:064x}:native:0");
    let address = |account: i64| format!("0x{:040x}", 0xdead_0000_0000u64 + seed(account, 0));
    let credited_tx = |account: i64, n: u64| 0x7e57_0000_0000u64 + seed(account, n);
    let (tip, orphaned, deep) =
        (0x71f_u64, 0x0f0_u64, format!("0x{:064x}", 0xb10c_0000_0000u64 + seed(accounts[1], 0)));
    let observe = |block: &str, tx: u64, to: &str, amount: u32| {
        format!(
            "insert into deposit_event (chain, block_hash, tx_hash, kind, output_index, address, asset, amount)
                  values ('eth', '{block}', '0x{tx:064x}', 'native', 0, '{to}', 'ETH', {amount});"
        )
    };
    // Before the horizon: the tip at 2,000,000; in it, a deposit one confirmation deep (12 due);
    // a deposit on an orphaned block at 1,500,000, never credited; a deposit to nobody's address,
    // credited (a mismatch already there).
    owner
        .batch_execute(&format!(
            "insert into chain_block (chain, height, block_hash, parent_hash)
                  values ('eth', 2000000, '0x{tip:064x}', '0x{tip:064x}'),
                         ('eth', 1500000, '0x{orphaned:064x}', '0x{orphaned:064x}');
             {in_tip}
             {on_orphaned}
             insert into block_verdict (chain, block_hash, seq, verdict, reason)
                  values ('eth', '0x{orphaned:064x}', 1, 'orphaned', 'test: a reorg');
             {nobody}
             insert into ledger_transfer (idempotency_key, kind, deposit_key, reference)
                  values ('{nobody_key}:credit:1', 'deposit', '{nobody_key}', '{{}}');
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
                  (currval('ledger_transfer_id_seq'), 'custody', 'ETH', 'debit', 400),
                  (currval('ledger_transfer_id_seq'), 'treasury', 'ETH', 'credit', 400);",
            in_tip = observe(&format!("0x{tip:064x}"), 0x71f0, &address(accounts[1]), 700),
            on_orphaned = observe(&format!("0x{orphaned:064x}"), 0x0f00, &address(accounts[2]), 600),
            nobody = observe(&deep, 0x0b0d, &format!("0x{:040x}", 0x0b0d), 400),
            nobody_key = key(0x0b0d),
        ))
        .await
        .unwrap();
    // The horizon is the oldest transaction running on the whole server, so another test's
    // transaction can hold it below the writes above for a moment (then a pass since derives
    // them too: more than needed, never less). Wait until it has passed them.
    let written: String = owner
        .query_one(
            "select greatest((select max(fact_xid) from ledger_transfer), (select max(fact_xid) from deposit_event),
                             (select max(fact_xid) from block_verdict))::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let waiting = std::time::Instant::now();
    let horizon = loop {
        let horizon = posting::horizon(&db.pool.get().await.unwrap(), custodian_domain::Chain::Eth).await.unwrap();
        let passed: bool = client
            .query_one("select $1::text::xid8 > $2::text::xid8", &[&horizon.xmin, &written])
            .await
            .unwrap()
            .get(0);
        if passed {
            break horizon;
        }
        assert!(waiting.elapsed() < std::time::Duration::from_secs(60), "a transaction held the horizon for 60 s");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    assert_eq!((horizon.tip, horizon.deepest), (2_000_000, 64));
    // Since the horizon, one of each way a row changes: a new observation, deep below the tip;
    // the tip 20 blocks on (nothing new about the deposit in the old tip); the orphaned block
    // back; a credit reversed (a transfer under its key, its block unchanged); and a key credited
    // twice (a new transfer, now a mismatch).
    let (u3, twice) = (accounts[3], credited_tx(accounts[0], 5));
    owner
        .batch_execute(&format!(
            "{new}
             insert into chain_block (chain, height, block_hash, parent_hash)
                  values ('eth', 2000020, '0x{next:064x}', '0x{next:064x}');
             insert into block_verdict (chain, block_hash, seq, verdict, reason)
                  values ('eth', '0x{orphaned:064x}', 2, 'reinstated', 'test: back');
             insert into ledger_transfer (idempotency_key, kind, deposit_key, reference)
                  values ('{reversed}:reversal:1', 'reversal', '{reversed}', '{{}}');
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
                  (currval('ledger_transfer_id_seq'), 'custody', 'ETH', 'credit', 1000),
                  (currval('ledger_transfer_id_seq'), 'user:{u3}', 'ETH', 'debit', 1000);
             insert into ledger_transfer (idempotency_key, kind, deposit_key, reference)
                  values ('{twice}:credit:2', 'deposit', '{twice}', '{{}}');
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount) values
                  (currval('ledger_transfer_id_seq'), 'custody', 'ETH', 'debit', 1005),
                  (currval('ledger_transfer_id_seq'), 'user:{u0}', 'ETH', 'credit', 1005);",
            new = observe(&deep, 0xe1e, &address(accounts[1]), 800),
            next = 0x720_u64,
            reversed = key(credited_tx(u3, 0)),
            twice = key(twice),
            u0 = accounts[0],
        ))
        .await
        .unwrap();
    owner.batch_execute("analyze").await.unwrap();

    const DUE_COLUMNS: &str = "deposit_key, owed::text";
    let due = rows(&client, DUE_WHOLE, DUE_COLUMNS).await;
    let mut expected: Vec<Vec<String>> = [(key(0xe1e), "800"), (key(0x71f0), "700"), (key(0x0f00), "600")]
        .into_iter()
        .chain([(key(credited_tx(u3, 0)), "1000")])
        .map(|(k, owed)| vec![k, owed.to_owned()])
        .collect();
    expected.sort();
    assert_eq!(due, expected, "new, confirmed by the tip, back on the chain, reversed");
    assert_eq!(rows_since(&client, &posting::due_since(), DUE_COLUMNS, &horizon).await, due);
    assert_eq!(
        rows(&client, MISMATCHES_WHOLE, "deposit_key").await,
        [[key(0x0b0d)], [key(twice)]],
        "to nobody's address (before the horizon), credited twice (after)"
    );
    assert_eq!(
        rows_since(&client, &posting::mismatches_since(), "deposit_key", &horizon).await,
        [[key(twice)]],
        "since the horizon: the key credited twice, not the mismatch that was there before"
    );

    // 47 observations; since the horizon the pass derives those something changed: the new one,
    // the two in the blocks the tip's reach covers, the reversed and the twice-credited keys.
    let explained: Value = client
        .query_one(
            &format!("explain (analyze, format json) {}", posting::due_since()),
            &[&"eth", &horizon.xmin, &horizon.tip, &horizon.deepest],
        )
        .await
        .unwrap()
        .get(0);
    let tiers = reads(&explained[0]["Plan"], "confirmation_policy");
    assert!(lookups(&client, DUE_WHOLE, "confirmation_policy").await >= 47, "the whole view is the measure");
    // Two lookups an observation (its own tier and the deepest), two for the tip's reach (the
    // deepest tier, read where the reach is used).
    assert!(tiers <= 2 * 5 + 2, "since: {tiers} tier lookups for 5 observations");

    // The pass the service runs: whole first, then since the previous pass began. The second
    // derives the first's four credits (transfers since) and the deposit in the tip's reach, and
    // finds nothing to post. (Which mismatches it reports depends on how far other tests'
    // transactions held its horizon back; the statement's rows are pinned above.)
    let mut passes = posting::ChainPasses::new(custodian_domain::Chain::Eth, std::time::Duration::MAX);
    let pooled = db.pool.get().await.unwrap();
    let (first, whole) = passes.run(&pooled).await.unwrap();
    assert!(whole);
    assert_eq!((first.posted, first.mismatches.len()), (4, 2));
    let (second, whole) = passes.run(&pooled).await.unwrap();
    assert!(!whole);
    assert_eq!(second.posted, 0);
    let unposted: i64 = client
        .query_one("select count(*) from deposit_status where confirmed and account_id is not null and not posted", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(unposted, 0);
}
