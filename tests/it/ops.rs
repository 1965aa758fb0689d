//! What operators are shipped (`ops/`): the Prometheus alert rules load in `promtool`, and every
//! metric the rules and the Grafana dashboard name is one the service exports, with HELP text;
//! every metric the code records is in the catalog that gives it that text.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use custodian_api::metric_catalog::{Kind, CATALOG};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under the crates' `src` folders.
fn sources() -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack: Vec<PathBuf> = [
        "src",
        "domain/src",
        "store/src",
        "ingest/src",
        "projections/src",
        "withdrawals/src",
        "api/src",
        "service/src",
    ]
    .iter()
    .map(|d| root().join(d))
    .collect();
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                found.push(path);
            }
        }
    }
    found
}

/// Metric names recorded in `text` with `counter!`, `gauge!` or `histogram!`.
fn recorded(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    for macro_name in ["counter!(", "gauge!(", "histogram!("] {
        for (at, _) in text.match_indices(macro_name) {
            let rest = text[at + macro_name.len()..].trim_start();
            if let Some(quoted) = rest.strip_prefix('"') {
                names.push(quoted.split('"').next().unwrap().to_owned());
            }
        }
    }
    names
}

/// Every `custodian_…` token in `text`.
fn named(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (at, _) in text.match_indices("custodian_") {
        let token: String =
            text[at..].chars().take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_').collect();
        names.insert(token);
    }
    names
}

fn catalogued(name: &str) -> bool {
    CATALOG.iter().any(|(n, kind, _)| {
        *n == name
            || (*kind == Kind::Histogram
                && ["_bucket", "_sum", "_count"].iter().any(|suffix| name.strip_suffix(suffix) == Some(*n)))
    })
}

#[test]
fn every_recorded_metric_is_catalogued_with_help_and_every_catalogued_one_is_recorded() {
    let mut used = BTreeSet::new();
    for path in sources() {
        used.extend(recorded(&std::fs::read_to_string(&path).unwrap()));
    }
    assert!(used.len() > 20, "the scan found the metrics: {used:?}");
    let missing: Vec<_> = used.iter().filter(|n| !catalogued(n)).collect();
    assert!(missing.is_empty(), "recorded but not in api/src/metric_catalog.rs: {missing:?}");
    let unused: Vec<_> = CATALOG.iter().map(|(n, ..)| *n).filter(|n| !used.contains(*n)).collect();
    assert!(unused.is_empty(), "catalogued but never recorded: {unused:?}");
    for (name, _, help) in CATALOG {
        assert!(help.len() > 10, "{name} has no real HELP text");
    }
}

#[test]
fn the_dashboard_and_the_alert_rules_name_only_exported_metrics() {
    for file in ["ops/grafana/custodian.json", "ops/prometheus/alerts.yml"] {
        let text = std::fs::read_to_string(root().join(file)).unwrap();
        let names = named(&text);
        assert!(names.len() >= 8, "{file} names metrics: {names:?}");
        let unknown: Vec<_> = names.iter().filter(|n| !catalogued(n)).collect();
        assert!(unknown.is_empty(), "{file} names metrics the service does not export: {unknown:?}");
    }
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("ops/grafana/custodian.json")).unwrap()).unwrap();
    assert!(dashboard["panels"].as_array().unwrap().len() >= 12);
}

/// `promtool` from Debian's `prometheus` package (`scripts/setup.sh` installs it).
fn promtool() -> PathBuf {
    let candidates = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join("promtool")).collect::<Vec<_>>())
        .unwrap_or_default();
    candidates
        .into_iter()
        .chain([PathBuf::from("/usr/bin/promtool")])
        .find(|p| Path::new(p).exists())
        .expect("promtool not found: run scripts/setup.sh (it installs Debian's prometheus package)")
}

#[test]
fn the_alert_rules_load_in_promtool() {
    let out = std::process::Command::new(promtool())
        .args(["check", "rules"])
        .arg(root().join("ops/prometheus/alerts.yml"))
        .output()
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{said}");
    assert!(said.contains("SUCCESS"), "{said}");
    // And a broken rule is refused, so the check can fail.
    let broken = std::env::temp_dir().join(format!("custodian-broken-rules-{}.yml", std::process::id()));
    std::fs::write(
        &broken,
        "groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: custodian_paused_lanes >\n",
    )
    .unwrap();
    let out = std::process::Command::new(promtool()).args(["check", "rules"]).arg(&broken).output().unwrap();
    std::fs::remove_file(&broken).ok();
    assert!(!out.status.success(), "promtool accepted a broken expression");
}
