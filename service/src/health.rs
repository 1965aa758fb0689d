//! `/metrics` (Prometheus text) and `/healthz`: 200 when the database answers and no part of the
//! service stopped, 503 otherwise, with each scanner's state and the standing warnings.

use std::sync::Arc;

use custodian_domain::Chain;
use custodian_ingest::StateHandle;
use custodian_store::Pool;
use tokio::sync::watch;

/// What `/healthz` reports besides the database.
pub struct Parts {
    /// Standing warnings (plaintext listeners, unverified TLS).
    pub warnings: Vec<String>,
    /// Parts that stopped for good.
    pub broken: crate::Broken,
    /// Each scanner's state.
    pub scanners: Vec<(Chain, StateHandle)>,
}

impl Parts {
    /// Reasons to answer 503, and a line per scanner.
    fn report(&self) -> (Vec<String>, Vec<String>) {
        let mut down = self.broken.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let mut lines = Vec::new();
        for (chain, state) in &self.scanners {
            let state = state.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
            if state.is_stopped() {
                down.push(format!("the {chain} scanner {}", state.describe()));
            }
            lines.push(format!("{chain} scanner: {}", state.describe()));
        }
        (down, lines)
    }
}

/// A minimal HTTP/1.1 responder: `GET /metrics` (Prometheus text) and `GET /healthz` (200 when
/// the database answers and no part stopped, 503 otherwise, with each scanner's state). One
/// request per connection.
pub async fn serve(
    listener: tokio::net::TcpListener,
    pool: Pool,
    recorder: Arc<metrics_exporter_prometheus::PrometheusHandle>,
    parts: Arc<Parts>,
    mut stopped: watch::Receiver<bool>,
) -> std::io::Result<()> {
    use axum::http::{header, HeaderValue, StatusCode};
    use axum::response::IntoResponse;
    const TEXT: &str = "text/plain; version=0.0.4";
    let metrics = axum::routing::get(move || {
        let recorder = recorder.clone();
        async move { ([(header::CONTENT_TYPE, TEXT)], recorder.render()) }
    });
    let healthz = axum::routing::get(move || {
        let (pool, parts) = (pool.clone(), parts.clone());
        async move {
            let (down, scanner_lines) = parts.report();
            let scanner_lines: String = scanner_lines.iter().map(|l| format!("{l}\n")).collect();
            let (status, body) = if !down.is_empty() {
                (StatusCode::SERVICE_UNAVAILABLE, format!("stopped: {}\n{scanner_lines}", down.join("\n")))
            } else {
                match pool.get().await {
                    Ok(client) if client.query_one("select 1", &[]).await.is_ok() => {
                        let notes: String = parts.warnings.iter().map(|w| format!("warning: {w}\n")).collect();
                        (StatusCode::OK, format!("ok\n{scanner_lines}{notes}"))
                    }
                    _ => (StatusCode::SERVICE_UNAVAILABLE, format!("database unreachable\n{scanner_lines}")),
                }
            };
            (status, [(header::CONTENT_TYPE, TEXT)], body)
        }
    });
    let router = axum::Router::new()
        .route("/metrics", metrics)
        .route("/healthz", healthz)
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found\n").into_response() })
        // One request per connection, as probes and scrapers make them.
        .layer(axum::middleware::map_response(|mut response: axum::response::Response| async move {
            response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
            response
        }));
    axum::serve(listener, router)
        .with_graceful_shutdown(async move {
            let _ = stopped.wait_for(|stop| *stop).await;
        })
        .await
}
