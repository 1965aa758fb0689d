//! Several nodes per chain, one policy for both chains (DESIGN §9, node failover).
//!
//! - **Reads stay on one node** (the current one), so answers that build on each other (a height,
//!   then the block at it) come from one view of the chain; when it does not answer (refused,
//!   timed out, an HTTP error), the call goes to the next node, which becomes current. A node that
//!   answers with an error object answered: that is the caller's to classify, not a failover.
//! - **Broadcasts go to every node** at once: a transaction one node drops is still relayed by the
//!   others. The first acceptance wins; failing that, the current node's refusal.
//! - **Every node's chain identity is checked** before any of its answers is used: the first node
//!   to answer sets the reference (the scanner and the worker check it against what the database
//!   recorded), and a node on another chain is refused for good, with an alert.
//!
//! Alloy's own fallback layer was not used for reads: it races the best-ranked nodes (answers of
//! different nodes interleave), ranks a node that failed once above one never tried, and drops the
//! losers of a race, so a broadcast would not reach every node. Its retry layer is kept, for rate
//! limits (`429`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

use alloy::rpc::client::RpcClient;
use alloy::rpc::json_rpc::{RequestPacket, ResponsePacket};
use alloy::transports::http::Http;
use alloy::transports::{TransportError, TransportFut};

/// The URLs in a configured list: comma-separated, blanks ignored.
pub fn split_urls(list: &str) -> Vec<String> {
    list.split(',').map(str::trim).filter(|u| !u.is_empty()).map(str::to_owned).collect()
}

/// A node's standing once its identity was read.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Standing {
    /// On the reference chain.
    Same,
    /// On another chain: never used.
    Refused(String),
}

/// The failover policy over a chain's nodes: which to ask, in what order, and whether each one's
/// identity matches.
#[derive(Debug)]
pub struct NodeSet {
    chain: &'static str,
    urls: Vec<String>,
    current: AtomicUsize,
    standing: Mutex<Vec<Option<Standing>>>,
    reference: OnceLock<String>,
}

impl NodeSet {
    /// The nodes of `chain` at `urls` (at least one).
    pub fn new(chain: &'static str, urls: Vec<String>) -> NodeSet {
        let standing = Mutex::new(vec![None; urls.len()]);
        NodeSet { chain, urls, current: AtomicUsize::new(0), standing, reference: OnceLock::new() }
    }

    /// How many nodes.
    pub fn len(&self) -> usize {
        self.urls.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.urls.is_empty()
    }

    /// Node `index`'s URL.
    pub fn url(&self, index: usize) -> &str {
        &self.urls[index]
    }

    /// The current node first, then the others in their configured order.
    pub fn order(&self) -> Vec<usize> {
        let n = self.urls.len();
        let start = self.current.load(Ordering::Relaxed) % n.max(1);
        (0..n).map(|k| (start + k) % n).collect()
    }

    /// `Some(true)` when node `index` is known to be on the reference chain, `Some(false)` when
    /// it was refused, `None` when its identity was not read yet.
    pub fn usable(&self, index: usize) -> Option<bool> {
        if self.urls.len() == 1 {
            // One node: its identity is the scanner's and the worker's to check.
            return Some(true);
        }
        let standing = self.standing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        standing[index].as_ref().map(|s| *s == Standing::Same)
    }

    /// Records what node `index` says its chain is; returns whether it may be used.
    pub fn identified(&self, index: usize, identity: &str) -> bool {
        let reference = self.reference.get_or_init(|| identity.to_owned());
        let standing = if reference == identity {
            Standing::Same
        } else {
            let reason = format!("it is on chain {identity}, the other nodes on {reference}");
            tracing::error!(chain = self.chain, node = %self.url(index), %reason,
                "ALERT: a configured node is on another chain; it is never used");
            metrics::counter!("custodian_node_refused_total", "chain" => self.chain).increment(1);
            Standing::Refused(reason)
        };
        let usable = standing == Standing::Same;
        self.standing.lock().unwrap_or_else(std::sync::PoisonError::into_inner)[index] = Some(standing);
        usable
    }

    /// Node `index` answered: it is current from now on (a failover when it was not).
    pub fn answered(&self, index: usize) {
        let previous = self.current.swap(index, Ordering::Relaxed);
        if previous != index {
            tracing::warn!(chain = self.chain, from = %self.url(previous), to = %self.url(index),
                "node failover: the current node did not answer; reads go to the next one");
            metrics::counter!("custodian_node_failovers_total", "chain" => self.chain).increment(1);
        }
    }

    /// A read: asks the nodes, the current one first, until one answers; that one is current
    /// from then on. `ask(index)` is `Ok(None)` for a node refused for its chain identity. `Err`
    /// holds the last node's failure (none when every node was refused).
    pub async fn read<T, E, F, Fut>(&self, ask: F) -> Result<T, Option<E>>
    where
        E: std::fmt::Display,
        F: Fn(usize) -> Fut,
        Fut: std::future::Future<Output = Result<Option<T>, E>>,
    {
        let mut last = None;
        for index in self.order() {
            match ask(index).await {
                Ok(Some(answer)) => {
                    self.answered(index);
                    return Ok(answer);
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::debug!(chain = self.chain, node = %self.url(index), error = %e, "a node did not answer");
                    last = Some(e);
                }
            }
        }
        Err(last)
    }

    /// A broadcast: asks every node at once; the first answer `accepted` says yes to, else the
    /// first other answer in [`NodeSet::order`] (a refusal to classify), else the last failure.
    pub async fn broadcast<T, E, F, Fut>(&self, ask: F, accepted: impl Fn(&T) -> bool) -> Result<T, Option<E>>
    where
        F: Fn(usize) -> Fut,
        Fut: std::future::Future<Output = Result<Option<T>, E>>,
    {
        let sends = self.order().into_iter().map(|index| {
            let answer = ask(index);
            async move { (index, answer.await) }
        });
        let (mut refusal, mut last) = (None, None);
        for (index, answer) in futures::future::join_all(sends).await {
            match answer {
                Ok(Some(answer)) if accepted(&answer) => {
                    self.answered(index);
                    return Ok(answer);
                }
                Ok(Some(answer)) => {
                    refusal.get_or_insert((index, answer));
                }
                Ok(None) => {}
                Err(e) => last = Some(e),
            }
        }
        match refusal {
            Some((index, answer)) => {
                self.answered(index);
                Ok(answer)
            }
            None => Err(last),
        }
    }

    /// The error of a call no node answered: the last node's failure, with the refused nodes named.
    fn failure(&self, last: Option<TransportError>) -> TransportError {
        match last {
            Some(e) if !self.any_refused() => e,
            Some(e) => alloy::transports::TransportErrorKind::custom_str(&format!("{e}; {}", self.none_usable())),
            None => alloy::transports::TransportErrorKind::custom_str(&self.none_usable()),
        }
    }

    /// Whether some node was refused for its chain identity.
    pub fn any_refused(&self) -> bool {
        let standing = self.standing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        standing.iter().any(|s| matches!(s, Some(Standing::Refused(_))))
    }

    /// Why no node could be used for a call, when none was.
    pub fn none_usable(&self) -> String {
        let standing = self.standing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let refused: Vec<String> = standing
            .iter()
            .zip(&self.urls)
            .filter_map(|(s, url)| match s {
                Some(Standing::Refused(reason)) => Some(format!("{url}: {reason}")),
                _ => None,
            })
            .collect();
        if refused.is_empty() {
            format!("none of the {} {} nodes answered", self.urls.len(), self.chain)
        } else {
            format!("no {} node answered on the reference chain (refused: {})", self.chain, refused.join("; "))
        }
    }
}

/// The JSON-RPC transport over every configured Ethereum node, with [`NodeSet`]'s policy.
#[derive(Clone)]
pub struct EthNodes {
    set: Arc<NodeSet>,
    transports: Arc<Vec<Http<reqwest::Client>>>,
    clients: Arc<Vec<RpcClient>>,
}

impl std::fmt::Debug for EthNodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EthNodes").field("set", &self.set).finish_non_exhaustive()
    }
}

/// The methods sent to every node.
const ETH_BROADCASTS: [&str; 1] = ["eth_sendRawTransaction"];

impl EthNodes {
    /// The nodes at `urls` (comma-separated), every call bounded by `timeout`.
    pub fn new(urls: &str, timeout: std::time::Duration) -> Result<EthNodes, String> {
        crate::tls::install_crypto_provider();
        let urls = split_urls(urls);
        if urls.is_empty() {
            return Err("no Ethereum RPC URL given".to_owned());
        }
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .map_err(|e| format!("building the HTTP client: {e}"))?;
        let mut transports = Vec::new();
        let mut clients = Vec::new();
        for url in &urls {
            let parsed: reqwest::Url = url.parse().map_err(|e| format!("invalid Ethereum RPC URL {url:?}: {e}"))?;
            transports.push(Http::with_client(http.clone(), parsed.clone()));
            clients.push(RpcClient::new_http_with_client(http.clone(), parsed));
        }
        Ok(EthNodes {
            set: Arc::new(NodeSet::new("eth", urls)),
            transports: Arc::new(transports),
            clients: Arc::new(clients),
        })
    }

    /// An alloy client over these nodes, retrying rate-limited calls (`429`) with backoff.
    pub fn client(&self) -> RpcClient {
        let retry = alloy::transports::layers::RetryBackoffLayer::new(3, 250, 100_000);
        alloy::rpc::client::ClientBuilder::default().layer(retry).transport(self.clone(), false)
    }

    /// Reads node `index`'s identity (chain id and genesis hash) if not yet known; whether it
    /// may be used, or `Err` when it did not answer.
    async fn check(&self, index: usize) -> Result<bool, TransportError> {
        if let Some(usable) = self.set.usable(index) {
            return Ok(usable);
        }
        let client = &self.clients[index];
        let chain_id: alloy_primitives::U64 = client.request("eth_chainId", ()).await?;
        let genesis: Option<serde_json::Value> = client.request("eth_getBlockByNumber", ("0x0", false)).await?;
        let hash = genesis.as_ref().and_then(|b| b.get("hash")).and_then(|h| h.as_str()).unwrap_or("none").to_owned();
        Ok(self.set.identified(index, &format!("chain id {chain_id}, genesis {hash}")))
    }

    /// Node `index`'s answer to `request`, `None` when the node is refused.
    async fn ask(self, index: usize, request: RequestPacket) -> Result<Option<ResponsePacket>, TransportError> {
        if !self.check(index).await? {
            return Ok(None);
        }
        let mut transport = self.transports[index].clone();
        tower::Service::call(&mut transport, request).await.map(Some)
    }

    async fn route(self, request: RequestPacket) -> Result<ResponsePacket, TransportError> {
        let ask = |index| self.clone().ask(index, request.clone());
        let answer = if self.set.len() > 1 && request.method_names().any(|m| ETH_BROADCASTS.contains(&m)) {
            self.set.broadcast(ask, ResponsePacket::is_success).await
        } else {
            self.set.read(ask).await
        };
        answer.map_err(|last| self.set.failure(last))
    }
}

impl tower::Service<RequestPacket> for EthNodes {
    type Response = ResponsePacket;
    type Error = TransportError;
    type Future = TransportFut<'static>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: RequestPacket) -> Self::Future {
        Box::pin(self.clone().route(request))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_split_on_commas_and_blanks_dropped() {
        assert_eq!(split_urls(" http://a:1 ,http://b:2,, "), ["http://a:1", "http://b:2"]);
        assert!(split_urls(" , ").is_empty());
    }

    #[test]
    fn the_current_node_is_asked_first_and_a_failover_moves_it() {
        let set = NodeSet::new("eth", vec!["a".into(), "b".into(), "c".into()]);
        assert_eq!(set.order(), [0, 1, 2]);
        set.answered(1);
        assert_eq!(set.order(), [1, 2, 0], "sticky on the node that answered");
    }

    #[test]
    fn a_node_on_another_chain_is_refused_for_good() {
        let set = NodeSet::new("eth", vec!["a".into(), "b".into()]);
        assert_eq!(set.usable(0), None, "unknown until read");
        assert!(set.identified(0, "chain id 1, genesis 0xd4e5"));
        assert!(!set.identified(1, "chain id 5, genesis 0xbf7e"));
        assert_eq!((set.usable(0), set.usable(1)), (Some(true), Some(false)));
        assert!(set.none_usable().contains("b: it is on chain chain id 5"), "{}", set.none_usable());
    }
}
