//! Migrations are idempotent and the finance role sees only the views.

use custodian_store::migrate;
use custodian_testkit::db::plan;
use custodian_testkit::TestDb;

use crate::refused;

/// A textual fingerprint of the schema: columns, constraints, indexes, triggers, views.
async fn schema_signature(client: &tokio_postgres::Client) -> String {
    let rows = client
        .query(
            "select 'column ' || table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable
               from information_schema.columns where table_schema = 'public'
             union all
             select 'constraint ' || conrelid::regclass || ' ' || pg_get_constraintdef(oid)
               from pg_constraint where connamespace = 'public'::regnamespace
             union all
             select 'index ' || indexdef from pg_indexes where schemaname = 'public'
             union all
             select 'trigger ' || tgrelid::regclass || ' ' || tgname from pg_trigger where not tgisinternal
             union all
             select 'view ' || viewname || ' ' || definition from pg_views where schemaname = 'public'
             order by 1",
            &[],
        )
        .await
        .unwrap();
    rows.iter().map(|r| r.get::<_, String>(0)).collect::<Vec<_>>().join("\n")
}

#[tokio::test]
async fn migrating_twice_leaves_the_same_schema() {
    let db = TestDb::new().await;
    let mut client = db.owner_client().await;
    let before = schema_signature(&client).await;
    assert!(before.contains("trigger ledger_posting ledger_posting_balanced"), "the template is migrated");
    let report = migrate::run(&mut client).await.expect("re-running migrations");
    assert!(report.applied.is_empty(), "nothing to apply the second time: {:?}", report.applied);
    assert_eq!(report.version, migrate::latest_version());
    assert_eq!(schema_signature(&client).await, before);
}

#[tokio::test]
async fn migrating_an_empty_database_applies_every_file_once() {
    let db = TestDb::new().await;
    // The owner may create databases (and only that beyond its own schema).
    let admin = db.owner_client().await;
    let scratch = format!("{}_empty", db.name);
    admin.batch_execute(&format!("create database \"{scratch}\"")).await.unwrap();
    let url = db.owner_url.with_dbname(&scratch);
    let (mut client, connection) = url.config().connect(tokio_postgres::NoTls).await.unwrap();
    let handle = tokio::spawn(connection);
    assert_eq!(migrate::current_version(&client).await.unwrap(), None);
    let first = migrate::run(&mut client).await.unwrap();
    assert_eq!(first.applied.len(), usize::try_from(migrate::latest_version()).unwrap());
    let signature = schema_signature(&client).await;
    let second = migrate::run(&mut client).await.unwrap();
    assert!(second.applied.is_empty());
    assert_eq!(schema_signature(&client).await, signature);
    drop(client);
    handle.await.unwrap().ok();
    admin.batch_execute(&format!("drop database \"{scratch}\" with (force)")).await.unwrap();
}

#[tokio::test]
async fn the_reader_role_reads_views_and_nothing_else() {
    let db = TestDb::new().await;
    // Only a superuser (test infrastructure) may become the reader role.
    let url = custodian_testkit::db::superuser_url().with_dbname(&db.name);
    let (client, connection) = url.config().connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    client.batch_execute("set role custodian_reader").await.unwrap();
    for view in ["account_balance", "deposit_status", "withdrawal_status", "ledger_entries"] {
        client.query(&format!("select * from {view} limit 1"), &[]).await.unwrap_or_else(|e| panic!("{view}: {e}"));
    }
    for table in ["ledger_posting", "deposit_event", "account", "withdrawal_event"] {
        let message = refused(&client, &format!("select * from {table}")).await;
        assert!(message.contains("permission denied"), "{table}: {message}");
    }
    let message = refused(&client, "insert into account (external_ref) values ('x')").await;
    assert!(message.contains("permission denied"), "{message}");
}

/// PostgreSQL prepares a table's CHECK expressions again for every statement that writes it, and
/// an SQL-language function called there is inlined, that is read and planned, each time: on the
/// tables written once or more per withdrawal or deposit, that planning was most of what a
/// single-row write cost (#14). No CHECK on them calls an SQL-language function.
#[tokio::test]
async fn the_checks_of_tables_written_per_request_call_no_function_planned_per_statement() {
    let db = TestDb::new().await;
    let client = db.owner_client().await;
    let planned: Vec<String> = client
        .query(
            "select distinct c.conrelid::regclass::text || ' ' || c.conname || ' calls ' || p.proname
               from pg_constraint c
               join pg_depend d on d.classid = 'pg_constraint'::regclass and d.objid = c.oid
                               and d.refclassid = 'pg_proc'::regclass
               join pg_proc p on p.oid = d.refobjid
               join pg_language l on l.oid = p.prolang
              where c.contype = 'c' and l.lanname = 'sql'
                and c.conrelid::regclass::text = any($1)
              order by 1",
            &[&vec![
                "withdrawal",
                "withdrawal_event",
                "withdrawal_attempt",
                "nonce_allocation",
                "ledger_transfer",
                "ledger_posting",
                "user_balance",
                "deposit_event",
                "chain_block",
                "output_spend",
                "fact_seal",
                "btc_attempt",
                "utxo_reservation",
            ]],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(planned.is_empty(), "CHECKs inlining SQL functions on hot tables: {planned:?}");
    // And the shared format checks still refuse what they refused.
    let row = client
        .query_one(
            "select is_valid_address('eth', '0xABC'), is_valid_hash('btc', repeat('a', 64)), is_u256(-1),
                    is_valid_address('eth', null) is null",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, bool>(0), row.get::<_, bool>(1), row.get::<_, bool>(2), row.get::<_, bool>(3)),
        (false, true, false, true)
    );
}

/// `deposit_status` reads each deposit key's postings through ledger_posting's transfer index,
/// whatever the statistics: on a ledger grown since it was last analysed (here: never), a join
/// planned for a small table scanned every posting once per deposit, and the posting pass after
/// every block grew with every withdrawal ever paid (#14).
#[tokio::test]
async fn deposit_status_reads_a_keys_postings_by_index_on_an_unanalysed_ledger() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let account: i64 =
        client.query_one("insert into account (external_ref) values ('plans') returning id", &[]).await.unwrap().get(0);
    for n in 0..40 {
        custodian_testkit::fixtures::credit_eth(&client, account, n, 1_000).await;
    }
    // A ledger much larger than its (absent) statistics say: 4,000 transfers under no deposit key.
    db.owner_client()
        .await
        .batch_execute(
            "begin;
             insert into ledger_transfer (idempotency_key, kind, reference)
                  select 'plans:' || n, 'adjustment', '{}'::jsonb from generate_series(1, 4000) n;
             insert into ledger_posting (transfer_id, ledger_account, asset, direction, amount)
                  select t.id, a.account, 'ETH', a.direction, 1
                    from ledger_transfer t
                   cross join (values ('custody', 'debit'), ('treasury', 'credit')) a (account, direction)
                   where t.idempotency_key like 'plans:%';
             commit;",
        )
        .await
        .unwrap();
    let plan = plan(&client, "select * from deposit_status where chain = 'eth' and confirmed", &[]).await;
    assert!(!plan.contains("Seq Scan on ledger_posting"), "every posting read per deposit:\n{plan}");
    assert!(plan.contains("ledger_posting_transfer"), "postings not read by their transfer:\n{plan}");
    let credited: i64 = client
        .query_one("select count(*) from deposit_status where chain = 'eth' and custody_posted = 1000", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(credited, 40, "each deposit's postings still summed");
}

/// Every pooled connection runs without JIT: the posting pass's discrepancy check over
/// `deposit_lost`, estimated above `jit_above_cost`, was compiled with LLVM on every call (0.4–1.8 s
/// of CPU a pass for a statement reading 64 rows, under the request path bench).
#[tokio::test]
async fn pooled_connections_run_without_jit() {
    let db = TestDb::new().await;
    let client = db.pool.get().await.unwrap();
    let jit: String = client.query_one("show jit", &[]).await.unwrap().get(0);
    assert_eq!(jit, "off");
    // Estimated above every JIT threshold: with JIT on, its plan says how many functions it compiles.
    let plan = plan(&client, "select count(*) from generate_series(1, 10000000) a where a % 7 = 3", &[]).await;
    assert!(!plan.lines().any(|line| line.starts_with("JIT")), "{plan}");
}

/// Every pooled connection plans without parallel workers: the BTC worker's coin read under the
/// lane lock (10,000 coins in the BTC allocation bench) was planned with two, and their start and
/// Gather Merge took 56 of its 72 ms on two cores.
#[tokio::test]
async fn pooled_connections_plan_without_parallel_workers() {
    let db = TestDb::new().await;
    let client = db.pool.get().await.unwrap();
    let workers: String = client.query_one("show max_parallel_workers_per_gather", &[]).await.unwrap().get(0);
    assert_eq!(workers, "0");
    // Large enough (above min_parallel_table_scan_size) that, with workers allowed, its plan
    // gathers from them.
    db.owner_client()
        .await
        .batch_execute(
            "create table wide as select g as n from generate_series(1, 500000) g; analyze wide;
             grant select on wide to custodian_app",
        )
        .await
        .unwrap();
    let plan = plan(&client, "select count(*) from wide where n % 7 = 3", &[]).await;
    assert!(!plan.contains("Gather"), "{plan}");
}

/// A pooled connection's first statements pay for their plans (pipelined writes are planned
/// generically on first use, PL/pgSQL functions and triggers on first call): the pool hands out
/// the connection used last, so a few warm connections serve a steady load instead of every
/// connection of the pool in turn. Taken in turns (deadpool's default), each client of the
/// request path bench waited 17–27 ms for its first three requests.
async fn pid(client: &deadpool_postgres::Object) -> i32 {
    client.query_one("select pg_backend_pid()", &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn the_pool_hands_out_the_connection_used_last() {
    let db = TestDb::new().await;
    let (first, second) = (db.pool.get().await.unwrap(), db.pool.get().await.unwrap());
    let (a, b) = (pid(&first).await, pid(&second).await);
    assert_ne!(a, b);
    drop(first);
    drop(second);
    for _ in 0..3 {
        let again = db.pool.get().await.unwrap();
        assert_eq!(pid(&again).await, b, "the connection returned last comes first");
    }
}

/// Payouts and reservations name the spend their statement inserted. Since V11 the spend's
/// existence is checked once per statement instead of by a foreign key probed row by row: a
/// statement naming a missing spend, even beside rows naming a real one, is refused whole with
/// the foreign key's SQLSTATE, and nothing of it is written. The withdrawal a payout names is
/// still a foreign key.
#[tokio::test]
async fn a_payout_or_reservation_naming_a_missing_spend_is_refused_whole() {
    const FUNDING: &str = "bcrt1qw508d6qejxtdg4y5r3zarvary0c5xw7kygt080";
    const DESTINATION: &str = "bcrt1q6rz28mcfaxtmd6v789l9rrlrusdprr9pz3cppk";
    let xpub = format!("tpub{}", "D".repeat(107));
    let db = TestDb::new().await;
    let client = db.owner_client().await;
    client
        .batch_execute(&format!(
            "insert into hot_wallet (chain, address, lane, next_nonce) values ('btc', '{FUNDING}', 'b0', 0);
             insert into btc_hot_wallet (lane, address, account_xpub) values ('b0', '{FUNDING}', '{xpub}');
             insert into account (external_ref) values ('alice');
             insert into withdrawal (id, account_id, external_id, chain, asset, destination, amount, state, lane, last_seq)
                  select i, (select id from account where external_ref = 'alice'), 'w' || i, 'btc', 'BTC',
                         '{DESTINATION}', 1000, 'requested', 'b0', 1
                    from generate_series(1, 3) i;
             insert into btc_spend (lane) values ('b0');"
        ))
        .await
        .unwrap();
    let spend: i64 = client.query_one("select max(id) from btc_spend", &[]).await.unwrap().get(0);
    let missing = spend + 1;
    let coin = "a".repeat(64);
    async fn refused_as_foreign_key(client: &tokio_postgres::Client, sql: &str) -> String {
        let error = client.batch_execute(sql).await.expect_err(sql);
        let db = error.as_db_error().expect("a database error");
        assert_eq!(db.code(), &tokio_postgres::error::SqlState::FOREIGN_KEY_VIOLATION, "{sql}: {db:?}");
        db.message().to_owned()
    }
    let message = refused_as_foreign_key(
        &client,
        &format!(
            "insert into btc_spend_payout (spend_id, withdrawal_id, output_index, weight)
                  values ({spend}, 1, 0, 100), ({missing}, 2, 0, 100)"
        ),
    )
    .await;
    assert!(message.contains(&format!("spend {missing}")) && message.contains("btc_spend_payout"), "{message}");
    let message = refused_as_foreign_key(
        &client,
        &format!(
            "insert into utxo_reservation (tx_hash, output_index, spend_id, amount)
                  values ('{coin}', 0, {spend}, 5000), ('{coin}', 1, {missing}, 5000)"
        ),
    )
    .await;
    assert!(message.contains(&format!("spend {missing}")) && message.contains("utxo_reservation"), "{message}");
    // The withdrawal's reference too (V15), by the foreign key's name.
    let message = refused_as_foreign_key(
        &client,
        &format!(
            "insert into btc_spend_payout (spend_id, withdrawal_id, output_index, weight) values ({spend}, 99, 0, 100)"
        ),
    )
    .await;
    assert!(message.contains("btc_spend_payout_withdrawal_id_fkey"), "{message}");
    let written: i64 = client
        .query_one("select (select count(*) from btc_spend_payout) + (select count(*) from utxo_reservation)", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(written, 0, "a refused statement wrote nothing");

    // The same rows naming the real spend go in; a withdrawal is still paid by one spend only.
    client
        .batch_execute(&format!(
            "insert into btc_spend_payout (spend_id, withdrawal_id, output_index, weight)
                  values ({spend}, 1, 0, 100), ({spend}, 2, 1, 100);
             insert into utxo_reservation (tx_hash, output_index, spend_id, amount)
                  values ('{coin}', 0, {spend}, 5000), ('{coin}', 1, {spend}, 5000);"
        ))
        .await
        .unwrap();
    client.batch_execute("insert into btc_spend (lane) values ('b0')").await.unwrap();
    let message = refused(
        &client,
        &format!(
            "insert into btc_spend_payout (spend_id, withdrawal_id, output_index, weight) values ({missing}, 1, 0, 100)"
        ),
    )
    .await;
    assert!(message.contains("btc_spend_payout_pkey"), "{message}");
}

/// A payout's withdrawal is checked once, when the payout is inserted (V15): that is all the
/// foreign key said because a withdrawal row is never deleted, truncated or given another id, by
/// the schema owner either.
#[tokio::test]
async fn a_withdrawal_row_is_never_deleted_truncated_or_renumbered() {
    let db = TestDb::new().await;
    let client = db.owner_client().await;
    client
        .batch_execute(&format!(
            "insert into account (external_ref) values ('alice');
             insert into withdrawal (id, account_id, external_id, chain, asset, destination, amount, state, last_seq)
                  values (1, (select id from account where external_ref = 'alice'), 'w1', 'eth', 'ETH', '{}', 1000, 'requested', 1);",
            crate::eth_address('a')
        ))
        .await
        .unwrap();
    for sql in
        ["delete from withdrawal where id = 1", "truncate withdrawal", "update withdrawal set id = 2 where id = 1"]
    {
        let e = client.batch_execute(sql).await.expect_err(sql);
        let db = e.as_db_error().unwrap_or_else(|| panic!("{sql}: {e}"));
        assert_eq!(db.code().code(), "42501", "{sql}: {}", db.message());
    }
    let ids: Vec<i64> =
        client.query("select id from withdrawal", &[]).await.unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(ids, [1]);
    // What the projection moves still moves.
    client.execute("update withdrawal set state = 'signed', last_seq = 2 where id = 1", &[]).await.unwrap();
}

/// A rule's name, and the argument (by position) and value that break it alone.
type BrokenBy = (&'static str, usize, String);

/// The rules of the rows an allocation writes are one CHECK per table (V14), each calling a
/// function that names the rule a row breaks: every rule still refuses what it refused, with
/// SQLSTATE 23514 and its own constraint name; a row breaking none, or with its columns null (a
/// CHECK lets null pass), is accepted.
#[tokio::test]
async fn each_folded_rule_refuses_by_its_own_name() {
    let db = TestDb::new().await;
    let client = db.owner_client().await;
    let (hash, address) = (crate::eth_hash('c'), crate::eth_address('a'));
    let btc_hash = "c".repeat(64);
    let u256_plus_one = "115792089237316195423570985008687907853269984665640564039457584007913129639936";
    // Per table: its function, a call's arguments that break no rule, and for each rule the
    // argument (by position) that breaks it alone.
    let tables: [(&str, Vec<String>, Vec<BrokenBy>); 4] = [
        (
            "withdrawal_broken_rule",
            vec![
                "'eth'".into(),
                "'e1'".into(),
                format!("'{address}'"),
                "5".into(),
                "'signed'".into(),
                format!("'{address}'"),
                "3".into(),
                format!("'{hash}'"),
                format!("'{hash}'"),
                "2".into(),
                "'client'".into(),
            ],
            vec![
                ("withdrawal_external_id_nonempty", 1, "''".into()),
                ("withdrawal_chain_known", 0, "'doge'".into()),
                ("withdrawal_destination_format", 2, "'0xABC'".into()),
                ("withdrawal_amount_positive", 3, "0".into()),
                ("withdrawal_amount_u256", 3, u256_plus_one.into()),
                ("withdrawal_state_known", 4, "'paid'".into()),
                ("withdrawal_from_address_format", 5, "'0xABC'".into()),
                ("withdrawal_nonce_nonnegative", 6, "-1".into()),
                ("withdrawal_tx_hash_format", 7, "'0x12'".into()),
                ("withdrawal_mined_block_hash_format", 8, format!("'{btc_hash}'")),
                ("withdrawal_last_seq_positive", 9, "0".into()),
                ("withdrawal_requested_by_length", 10, format!("'{}'", "x".repeat(65))),
            ],
        ),
        (
            "withdrawal_attempt_broken_rule",
            vec![
                "'eth'".into(),
                format!("'{hash}'"),
                "'original'".into(),
                "2".into(),
                "1".into(),
                "'payout'".into(),
                format!("'{address}'"),
                "7".into(),
                "''::bytea".into(),
            ],
            vec![
                ("withdrawal_attempt_chain_known", 0, "'doge'".into()),
                ("withdrawal_attempt_kind_known", 2, "'speedup'".into()),
                ("withdrawal_attempt_max_fee_u256", 3, u256_plus_one.into()),
                ("withdrawal_attempt_priority_fee_u256", 4, "-1".into()),
                ("withdrawal_attempt_tx_hash_format", 1, format!("'{btc_hash}'")),
                ("withdrawal_attempt_priority_fee_within_max_fee", 4, "3".into()),
                ("withdrawal_attempt_intent_known", 5, "'gift'".into()),
                ("withdrawal_attempt_intent_to_format", 6, "'0xABC'".into()),
                ("withdrawal_attempt_intent_value_u256", 7, "-1".into()),
                ("withdrawal_attempt_intent_whole", 8, "null".into()),
            ],
        ),
        (
            "hot_wallet_broken_rule",
            vec![
                "'eth'".into(),
                format!("'{address}'"),
                "'lane_1'".into(),
                "0".into(),
                "now()".into(),
                "'paused'".into(),
                "'short'".into(),
                "now()".into(),
            ],
            vec![
                ("hot_wallet_chain_known", 0, "'doge'".into()),
                ("hot_wallet_address_format", 1, "'0xABC'".into()),
                ("hot_wallet_lane_name", 2, "'lane 1'".into()),
                ("hot_wallet_next_nonce_nonnegative", 3, "-1".into()),
                ("hot_wallet_pause_reason", 4, "null".into()),
                ("hot_wallet_shortage_since", 7, "null".into()),
            ],
        ),
        (
            "btc_attempt_broken_rule",
            vec![format!("'{btc_hash}'"), "'bump'".into(), "100".into(), "200".into(), "1".into(), "4".into()],
            vec![
                ("btc_attempt_tx_hash_format", 0, format!("'{hash}'")),
                ("btc_attempt_kind_known", 1, "'speedup'".into()),
                ("btc_attempt_fee_positive", 2, "0".into()),
                ("btc_attempt_vsize_positive", 3, "0".into()),
                ("btc_attempt_change_output_nonnegative", 4, "-1".into()),
                ("btc_attempt_change_whole", 5, "null".into()),
            ],
        ),
    ];
    for (function, valid, rules) in tables {
        let call = |args: &[String]| format!("select {function}({})", args.join(", "));
        let accepted: bool = client.query_one(&call(&valid), &[]).await.unwrap().get(0);
        assert!(accepted, "{function}: the valid row");
        // The first argument (the chain, or btc_attempt's hash) kept: the format rules read the
        // chain, and a null chain matches none.
        let mut nulls = vec!["null".to_owned(); valid.len()];
        nulls[0] = valid[0].clone();
        let accepted: bool = client.query_one(&call(&nulls), &[]).await.unwrap().get(0);
        assert!(accepted, "{function}: null passes every rule, as in a CHECK");
        for (rule, position, breaking) in rules {
            let mut args = valid.clone();
            args[position] = breaking;
            let e = client.query_one(&call(&args), &[]).await.expect_err(rule);
            let db = e.as_db_error().unwrap_or_else(|| panic!("{rule}: {e}"));
            assert_eq!((db.code().code(), db.constraint()), ("23514", Some(rule)), "{rule}: {}", db.message());
        }
    }
    // Each folded table has exactly that one CHECK, and a row written to it goes through it.
    let checks: Vec<String> = client
        .query(
            "select conrelid::regclass::text || ' ' || conname from pg_constraint
              where contype = 'c' and conrelid::regclass::text = any($1) order by 1",
            &[&vec!["withdrawal", "withdrawal_attempt", "hot_wallet", "btc_attempt"]],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        checks,
        [
            "btc_attempt btc_attempt_rules",
            "hot_wallet hot_wallet_rules",
            "withdrawal withdrawal_rules",
            "withdrawal_attempt withdrawal_attempt_rules"
        ]
    );
    let e = client
        .execute("insert into hot_wallet (chain, address, lane, next_nonce) values ('eth', $1, 'a', -1)", &[&address])
        .await
        .expect_err("a negative cursor");
    assert_eq!(e.as_db_error().and_then(|db| db.constraint()), Some("hot_wallet_next_nonce_nonnegative"));
}
