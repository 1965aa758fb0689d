//! Rebuild when a migration file is added or changed: `embed_migrations!` reads them at compile time.
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
