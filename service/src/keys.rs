//! Where a worker finds each lane's signing key, in one order, and the checks a set of keys must
//! pass before a worker signs with them.
//!
//! ETH lanes: a file named for the lane on the command line (`--key-file LANE=PATH`), then
//! `CUSTODIAN_HOT_KEY_FILE_<LANE>`, then `CUSTODIAN_HOT_KEY_<LANE>` (taken out of the environment
//! at start), then `[hot_keys.<lane>]` of the configuration file (`key_file`, else `key`). A lane
//! with none of these is left to a worker that has its key. BTC lanes: the account-level extended
//! key in `CUSTODIAN_BTC_HOT_KEY_FILE_<LANE>`, then `[btc.hot_key_files]`. Every failure here is a
//! refusal of the configuration: nothing has been signed.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use custodian_domain::{BtcAddress, BtcNetwork};
use custodian_withdrawals::btc_key::BtcHotKey;
use custodian_withdrawals::hot_wallet::Lane;
use custodian_withdrawals::{LocalSigner, Signer};
use secrecy::{ExposeSecret, SecretString};
use zeroize::Zeroizing;

/// A key named in the configuration file for a lane (`[hot_keys.<lane>]`).
#[derive(Debug, Clone, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfiguredKey {
    /// A file holding the key.
    pub key_file: Option<PathBuf>,
    /// The key itself (a file or the environment is better).
    pub key: Option<SecretString>,
}

/// Where keys may be, besides the environment's key files.
pub struct Sources<'a> {
    /// `--key-file LANE=PATH`, per lane ([`key_file_args`]).
    pub files: HashMap<String, PathBuf>,
    /// `[hot_keys.<lane>]`.
    pub configured: &'a BTreeMap<String, ConfiguredKey>,
    /// `[btc.hot_key_files]`.
    pub btc_files: &'a BTreeMap<String, PathBuf>,
    /// The key given as `CUSTODIAN_HOT_KEY_<LANE>` for a lane's [`env_name`], if any.
    pub env_key: &'a (dyn Fn(&str) -> Option<Zeroizing<String>> + Sync),
}

/// A configuration no worker may sign with.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// A `--key-file` argument that is not `LANE=PATH`.
    #[error("--key-file {0:?}: expected LANE=PATH")]
    Argument(String),
    /// A key that cannot be read or is not a key; the message names where it came from.
    #[error("{0}")]
    Unreadable(String),
    /// `[hot_keys.<lane>]` with neither `key_file` nor `key`.
    #[error("[hot_keys.{0}] needs key_file or key")]
    Empty(String),
    /// Lanes exist and none has a key.
    #[error("no hot-wallet key for any lane: pass --key-file LANE=PATH or set CUSTODIAN_HOT_KEY_<LANE>")]
    NoKey,
    /// Keys without the chain id they sign for.
    #[error(
        "hot-wallet keys are configured, so the chain they sign for must be too: set [eth] chain_id \
         (or --eth-chain-id / CUSTODIAN_ETH_CHAIN_ID); a node answering another id is then refused"
    )]
    NoChainId,
}

/// A lane's name as it appears in environment variables: ASCII letters and digits upper-cased,
/// anything else `_`.
pub fn env_name(lane: &str) -> String {
    lane.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' }).collect()
}

/// `--key-file LANE=PATH` arguments, per lane.
pub fn key_file_args(specs: &[String]) -> Result<HashMap<String, PathBuf>, KeyError> {
    specs
        .iter()
        .map(|spec| {
            let (lane, path) = spec.split_once('=').ok_or_else(|| KeyError::Argument(spec.clone()))?;
            Ok((lane.to_owned(), PathBuf::from(path)))
        })
        .collect()
}

/// The signer of each ETH lane of `lanes` whose key is found, in the order the module names.
pub fn eth_signers(sources: &Sources<'_>, lanes: &[Lane]) -> Result<HashMap<String, Arc<dyn Signer>>, KeyError> {
    let from_file = |lane: &str, path: &Path| {
        LocalSigner::from_file(path).map_err(|e| KeyError::Unreadable(format!("lane {lane}: {e}")))
    };
    let mut signers: HashMap<String, Arc<dyn Signer>> = HashMap::new();
    for lane in lanes {
        let name = env_name(lane.lane.as_str());
        let file = sources
            .files
            .get(lane.lane.as_str())
            .cloned()
            .or_else(|| std::env::var_os(format!("CUSTODIAN_HOT_KEY_FILE_{name}")).map(PathBuf::from));
        let signer = match file {
            Some(path) => from_file(lane.lane.as_str(), &path)?,
            None => match (sources.env_key)(&name) {
                Some(key) => LocalSigner::from_hex(&key)
                    .map_err(|e| KeyError::Unreadable(format!("CUSTODIAN_HOT_KEY_{name}: {e}")))?,
                None => match sources.configured.get(lane.lane.as_str()) {
                    Some(ConfiguredKey { key_file: Some(path), .. }) => from_file(lane.lane.as_str(), path)?,
                    Some(ConfiguredKey { key: Some(key), .. }) => LocalSigner::from_hex(key.expose_secret())
                        .map_err(|e| KeyError::Unreadable(format!("[hot_keys.{}]: {e}", lane.lane)))?,
                    Some(_) => return Err(KeyError::Empty(lane.lane.to_string())),
                    None => {
                        tracing::warn!(lane = %lane.lane, "no key for this lane; its withdrawals wait for a worker that has one");
                        continue;
                    }
                },
            },
        };
        signers.insert(lane.lane.to_string(), Arc::new(signer));
    }
    Ok(signers)
}

/// The checks ETH keys pass before a worker signs with them: a chain id to sign for whenever
/// there is a key, and, where `required`, a key for at least one of the lanes.
pub fn check_eth_signers(
    signers: &HashMap<String, Arc<dyn Signer>>,
    lanes: &[Lane],
    chain_id: Option<u64>,
    required: bool,
) -> Result<(), KeyError> {
    if required && signers.is_empty() && !lanes.is_empty() {
        return Err(KeyError::NoKey);
    }
    if !signers.is_empty() && chain_id.is_none() {
        return Err(KeyError::NoChainId);
    }
    Ok(())
}

/// The key of each BTC lane of `lanes` whose key file is found, for `network`.
pub fn btc_keys(
    sources: &Sources<'_>,
    lanes: &[Lane<BtcAddress>],
    network: BtcNetwork,
) -> Result<HashMap<String, Arc<BtcHotKey>>, KeyError> {
    let mut keys = HashMap::new();
    for lane in lanes {
        let path = std::env::var_os(format!("CUSTODIAN_BTC_HOT_KEY_FILE_{}", env_name(lane.lane.as_str())))
            .map(PathBuf::from)
            .or_else(|| sources.btc_files.get(lane.lane.as_str()).cloned());
        let Some(path) = path else { continue };
        let key = BtcHotKey::from_file(&path, network)
            .map_err(|e| KeyError::Unreadable(format!("BTC lane {}: {e}", lane.lane)))?;
        keys.insert(lane.lane.to_string(), Arc::new(key));
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_names_become_environment_names() {
        assert_eq!(env_name("lane-1"), "LANE_1");
        assert_eq!(env_name("b0"), "B0");
        assert_eq!(env_name("ö.x"), "__X");
    }

    #[test]
    fn key_file_arguments_are_lane_equals_path() {
        let parsed = key_file_args(&["a=/k/a".to_owned(), "b=/k/b=c".to_owned()]).unwrap();
        assert_eq!(parsed["a"], PathBuf::from("/k/a"));
        assert_eq!(parsed["b"], PathBuf::from("/k/b=c"));
        assert!(matches!(key_file_args(&["nolane".to_owned()]), Err(KeyError::Argument(_))));
    }
}
