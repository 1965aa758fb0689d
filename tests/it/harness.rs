//! Runs the built binary and captures what it printed.

use std::process::Command;

/// What one run of the binary produced.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Parses stdout as JSON, panicking with both streams when it is not.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{}\nstderr:\n{}", self.stdout, self.stderr))
    }
}

/// Runs `custodian args…` against `database_url`, with no other CUSTODIAN_* settings inherited.
pub fn custodian(database_url: &str, args: &[&str]) -> Run {
    custodian_env(&[("CUSTODIAN_DATABASE_URL", database_url)], args)
}

/// Runs `custodian args…` with exactly the CUSTODIAN_* variables in `env`.
pub fn custodian_env(env: &[(&str, &str)], args: &[&str]) -> Run {
    let mut command = Command::new(env!("CARGO_BIN_EXE_custodian"));
    for (key, _) in std::env::vars() {
        if key.starts_with("CUSTODIAN_") {
            command.env_remove(key);
        }
    }
    let output = command.envs(env.iter().copied()).args(args).output().expect("running the custodian binary");
    Run {
        code: output.status.code().expect("the binary exited normally"),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// [`custodian_env`] off the async runtime, for tests whose node (the simulator, a proxy) answers
/// on that runtime while the binary runs.
pub async fn custodian_env_async(env: Vec<(String, String)>, args: &[&str]) -> Run {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        custodian_env(&env, &args)
    })
    .await
    .expect("the binary ran")
}

/// Runs `custodian args…` against `database_url` on the authority of the operator's `token`.
pub fn custodian_as(database_url: &str, token: &str, args: &[&str]) -> Run {
    custodian_env(&[("CUSTODIAN_DATABASE_URL", database_url), ("CUSTODIAN_TOKEN", token)], args)
}

/// Creates an API token `name` with `scopes` in `db` (as the first, bootstrap principal) and
/// returns it, for commands that record their author.
pub async fn token(db: &custodian_testkit::TestDb, name: &str, scopes: &[custodian_api::tokens::Scope]) -> String {
    let client = db.pool.get().await.expect("a connection");
    custodian_api::tokens::create(&client, name, scopes, custodian_api::tokens::BOOTSTRAP_PRINCIPAL)
        .await
        .expect("creating a test token")
}

/// A token holding every scope, named `operator`.
pub async fn operator(db: &custodian_testkit::TestDb) -> String {
    token(db, "operator", &custodian_api::tokens::Scope::ALL).await
}
