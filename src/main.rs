//! The `custodian` binary: parse arguments, load settings, build the pieces, run one command.
//! Logic lives in the library crates; this file only wires them and chooses the exit code.

mod cli;
mod commands;
mod config;
mod exit;
mod secrets;
mod settings;

use clap::Parser;

fn main() -> std::process::ExitCode {
    // Before any thread exists: hot keys leave the environment, and no core dump can hold them.
    secrets::take_hot_keys_from_environment();
    if let Err(e) = secrets::disable_core_dumps() {
        eprintln!("error: could not disable core dumps: {e}");
        return exit::Exit::Operational.into();
    }
    // One TLS implementation for the whole process (PostgreSQL, gRPC, https node URLs): rustls
    // with ring.
    custodian_store::tls::install_crypto_provider();
    let cli = cli::Cli::parse();
    let json = cli.global.json;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CUSTODIAN_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: could not start the async runtime: {e}");
            return exit::Exit::Operational.into();
        }
    };
    match runtime.block_on(commands::run(cli)) {
        Ok(exit) => exit.into(),
        Err(error) => {
            let exit = exit::classify(&error);
            let message = exit::message(&error);
            eprintln!("error: {message}");
            if json {
                // Machine-readable too: the message and the exit code on stdout.
                let kind = match exit {
                    exit::Exit::Usage => "usage",
                    exit::Exit::Verification => "verification",
                    _ => "operational",
                };
                println!("{}", serde_json::json!({ "error": message, "kind": kind, "exit_code": exit as u8 }));
            }
            exit.into()
        }
    }
}
