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
