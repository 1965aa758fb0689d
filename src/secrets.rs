//! Process hygiene for secrets: hot keys given in the environment are taken out of it before
//! anything else runs, and the process cannot leave a core dump (or be read by ptrace as a
//! non-dumpable process) holding keys.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use zeroize::Zeroizing;

/// The prefix of the variables holding a hot key's hex (`CUSTODIAN_HOT_KEY_<LANE>`); the
/// `CUSTODIAN_HOT_KEY_FILE_<LANE>` variables name files and stay.
const HOT_KEY_PREFIX: &str = "CUSTODIAN_HOT_KEY_";
const HOT_KEY_FILE_PREFIX: &str = "CUSTODIAN_HOT_KEY_FILE_";

static HOT_KEYS: OnceLock<Mutex<HashMap<String, Zeroizing<String>>>> = OnceLock::new();

/// Moves every `CUSTODIAN_HOT_KEY_<LANE>` variable out of the environment into memory that is
/// erased when taken. Call first thing in `main`, while the process has one thread (changing the
/// environment is only sound then).
pub fn take_hot_keys_from_environment() {
    let mut keys = HashMap::new();
    for (name, value) in std::env::vars_os() {
        let Some(name) = name.to_str() else { continue };
        if let Some(lane) = name.strip_prefix(HOT_KEY_PREFIX).filter(|_| !name.starts_with(HOT_KEY_FILE_PREFIX)) {
            keys.insert(lane.to_owned(), Zeroizing::new(value.to_string_lossy().into_owned()));
            std::env::remove_var(name);
        }
    }
    HOT_KEYS.get_or_init(|| Mutex::new(keys));
}

/// The key given as `CUSTODIAN_HOT_KEY_<lane>`, if any (a copy, erased when dropped).
pub fn hot_key(lane: &str) -> Option<Zeroizing<String>> {
    let keys = HOT_KEYS.get()?;
    keys.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(lane).cloned()
}

/// No core dumps: the soft and hard limits go to zero, and on Linux the process is marked not
/// dumpable (which also keeps other processes of the same user from attaching to it).
pub fn disable_core_dumps() -> std::io::Result<()> {
    let none = rustix::process::Rlimit { current: Some(0), maximum: Some(0) };
    rustix::process::setrlimit(rustix::process::Resource::Core, none)?;
    #[cfg(target_os = "linux")]
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hot_keys_leave_the_environment_and_core_dumps_are_off() {
        let key = "ac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80";
        std::env::set_var("CUSTODIAN_HOT_KEY_UNITLANE", key);
        std::env::set_var("CUSTODIAN_HOT_KEY_FILE_UNITLANE", "/etc/custodian/unit.key");
        take_hot_keys_from_environment();
        assert!(std::env::var_os("CUSTODIAN_HOT_KEY_UNITLANE").is_none(), "the key left the environment");
        assert!(std::env::var_os("CUSTODIAN_HOT_KEY_FILE_UNITLANE").is_some(), "file paths are not secrets");
        assert_eq!(hot_key("UNITLANE").as_deref().map(String::as_str), Some(key));
        assert_eq!(hot_key("FILE_UNITLANE"), None);

        disable_core_dumps().unwrap();
        let limit = rustix::process::getrlimit(rustix::process::Resource::Core);
        assert_eq!((limit.current, limit.maximum), (Some(0), Some(0)));
        assert_eq!(rustix::process::dumpable_behavior().unwrap(), rustix::process::DumpableBehavior::NotDumpable);
    }
}
