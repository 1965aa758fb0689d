//! What the service's login (`custodian_app`, in `custodian_service`) can never do, proven by
//! trying it (DESIGN §1 principle 8): change or remove a fact, switch triggers off, change an API
//! token's scopes or hash, change what a withdrawal pays. And the check every command runs: a
//! superuser or the schema owner is refused as the service's connection.

use custodian_store::{check_service_role, RoleError};
use custodian_testkit::TestDb;
use tokio_postgres::Client;

use crate::{eth_address, seed_one_of_everything};

/// SQLSTATE insufficient_privilege.
const INSUFFICIENT_PRIVILEGE: &str = "42501";

/// Runs `sql` and returns the refusal's SQLSTATE and message, panicking if it was accepted.
async fn refusal(client: &Client, sql: &str) -> (String, String) {
    match client.batch_execute(sql).await {
        Ok(()) => panic!("custodian_app was allowed to run: {sql}"),
        Err(e) => {
            let db = e.as_db_error().unwrap_or_else(|| panic!("{sql}: not a database refusal: {e}"));
            (db.code().code().to_owned(), db.message().to_owned())
        }
    }
}

async fn assert_denied(client: &Client, sql: &str) -> String {
    let (code, message) = refusal(client, sql).await;
    assert_eq!(code, INSUFFICIENT_PRIVILEGE, "{sql}: {message}");
    message
}

async fn seeded() -> (TestDb, Client) {
    let db = TestDb::new().await;
    seed_one_of_everything(&db.owner_client().await).await;
    let app = db.client().await;
    let role: String = app.query_one("select current_user::text", &[]).await.unwrap().get(0);
    assert_eq!(role, "custodian_app", "the test must run as the service's login");
    (db, app)
}

const FACT_TABLES: &[&str] = &[
    "chain_block",
    "raw_block",
    "deposit_event",
    "wallet_address",
    "ledger_transfer",
    "ledger_posting",
    "reversal_proposal",
    "reversal_decision",
    "withdrawal_event",
    "nonce_allocation",
    "withdrawal_attempt",
    "orphan_mark",
    "block_verdict",
    "chain_identity",
    "operator_action",
    "api_token",
];

#[tokio::test]
async fn the_service_role_cannot_update_or_delete_any_fact() {
    let (db, app) = seeded().await;
    for table in FACT_TABLES {
        // A column the service may not update (valid_to_height and revoked_at are
        // the set-once exceptions, guarded by their triggers).
        let column = match *table {
            "chain_block" => "orphaned_at = null",
            "raw_block" => "seen_at = now()",
            "wallet_address" => "account_id = account_id",
            "api_token" => "name = name",
            "orphan_mark" => "orphaned_at = now()",
            "block_verdict" => "reason = 'changed'",
            "chain_identity" => "genesis_hash = genesis_hash",
            "operator_action" | "reversal_proposal" => "id = id",
            "reversal_decision" => "decided_by = 'mallory'",
            "ledger_posting" | "deposit_event" => "amount = amount + 1",
            "ledger_transfer" => "kind = 'adjustment'",
            "withdrawal_event" => "payload = '{}'",
            "nonce_allocation" => "withdrawal_id = 2",
            "withdrawal_attempt" => "max_fee = 200",
            other => panic!("no column chosen for {other}"),
        };
        assert_denied(&app, &format!("update {table} set {column}")).await;
        if *table != "raw_block" {
            // pruning raw payloads past the window is the one permitted deletion
            assert_denied(&app, &format!("delete from {table}")).await;
        }
        assert_denied(&app, &format!("truncate {table}")).await;
    }
    let owner = db.owner_client().await;
    let deposits: i64 = owner.query_one("select count(*) from deposit_event", &[]).await.unwrap().get(0);
    assert_eq!(deposits, 1, "nothing was changed");
}

#[tokio::test]
async fn the_service_role_cannot_switch_triggers_off() {
    let (_db, app) = seeded().await;
    let message = assert_denied(&app, "set session_replication_role = replica").await;
    assert!(message.contains("session_replication_role"), "{message}");
    for sql in [
        "alter table api_token disable trigger api_token_append_only",
        "alter table ledger_posting disable trigger all",
        "drop trigger withdrawal_event_append_only on withdrawal_event",
        "alter table withdrawal drop constraint withdrawal_pkey",
        "create or replace function reject_mutation() returns trigger language plpgsql as $$ begin return new; end $$",
    ] {
        let message = assert_denied(&app, sql).await;
        // replacing a function meets the schema's CREATE privilege before the ownership check
        assert!(
            message.contains("must be owner") || message.contains("permission denied for schema"),
            "{sql}: {message}"
        );
    }
}

#[tokio::test]
async fn the_service_role_cannot_change_a_tokens_scopes_or_hash() {
    let (_db, app) = seeded().await;
    app.batch_execute(
        "insert into api_token (name, token_hash, scopes) values ('reporting', decode(repeat('ab', 32), 'hex'), '{read}')",
    )
    .await
    .expect("the service creates tokens");
    for change in ["scopes = '{read,withdraw,approve,admin}'", "token_hash = decode(repeat('cd', 32), 'hex')"] {
        assert_denied(&app, &format!("update api_token set {change} where name = 'reporting'")).await;
    }
    let scopes: Vec<String> =
        app.query_one("select scopes from api_token where name = 'reporting'", &[]).await.unwrap().get(0);
    assert_eq!(scopes, ["read"]);
    // revoking is the one change it may make
    assert_eq!(app.execute("update api_token set revoked_at = now() where name = 'reporting'", &[]).await.unwrap(), 1);
}

#[tokio::test]
async fn what_a_withdrawal_pays_never_changes_after_insert() {
    let (db, app) = seeded().await;
    let owner = db.owner_client().await;
    let account: i64 =
        owner.query_one("select id from account where external_ref = 'alice'", &[]).await.unwrap().get(0);
    let destination = eth_address('3');
    app.execute(
        "insert into withdrawal (id, account_id, external_id, chain, asset, destination, amount, state, lane, last_seq, requested_by)
         values (7, $1, 'pay-7', 'eth', 'ETH', $2, 100, 'requested', 'a', 1, 'client')",
        &[&account, &destination],
    )
    .await
    .expect("the service inserts the projection");
    let mallory = eth_address('9');
    let changes = [
        format!("destination = '{mallory}'"),
        "amount = 100000".to_owned(),
        "asset = 'BTC', chain = 'btc'".to_owned(),
        "account_id = null".to_owned(),
        "external_id = 'other'".to_owned(),
        "requested_by = 'someone-else'".to_owned(),
    ];
    for change in &changes {
        // the service: no privilege on the column
        assert_denied(&app, &format!("update withdrawal set {change} where id = 7")).await;
        // the owner too: the trigger
        let (code, message) = refusal(&owner, &format!("update withdrawal set {change} where id = 7")).await;
        assert_eq!(code, INSUFFICIENT_PRIVILEGE, "{change}: {message}");
        assert!(message.contains("never change"), "{change}: {message}");
    }
    // the projection's moving columns remain the service's to write
    app.execute("update withdrawal set state = 'signed', last_seq = 2 where id = 7", &[]).await.unwrap();
    let row =
        owner.query_one("select destination, amount::text, state from withdrawal where id = 7", &[]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), destination);
    assert_eq!(row.get::<_, String>(1), "100");
    assert_eq!(row.get::<_, String>(2), "signed");
}

#[tokio::test]
async fn a_superuser_or_the_schema_owner_is_refused_as_the_service_connection() {
    let db = TestDb::new().await;
    check_service_role(&db.pool.get().await.unwrap()).await.expect("custodian_app is the service's login");
    let superuser = custodian_testkit::db::superuser_url().with_dbname(&db.name);
    for (url, expected) in [(superuser, "superuser"), (db.owner_url.clone(), "owns the schema")] {
        let pool = custodian_store::connect(&url, 1).await.unwrap();
        match check_service_role(&pool.get().await.unwrap()).await {
            Err(RoleError::TooPowerful { role, power }) => {
                assert!(power.contains(expected), "{role}: {power}");
                let message = RoleError::TooPowerful { role, power }.to_string();
                assert!(message.contains("custodian_app"), "the refusal names the role to use: {message}");
            }
            other => panic!("{url} must be refused, got {other:?}"),
        }
    }
}
