//! Migrations are idempotent and the finance role sees only the views.

use custodian_store::migrate;
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
