//! The signals `iopages serve` handles, received synchronously.
//!
//! Owns: which signals the server handles (SIGINT, SIGTERM and SIGHUP
//! stop it, SIGUSR1 asks for statistics), blocking them before any thread
//! starts so that only the thread that waits receives them, the wait
//! itself (with its retry on `EINTR`), and their names in messages. What a
//! signal makes the server do is decided by its callers (`serve` while
//! serving, `served` while a volume opens).
//! Must never: install an asynchronous signal handler (every signal is
//! taken by a wait, in ordinary code), or name the server's modules.

use crate::sys;
use std::time::Duration;

/// The blocked set the server waits on.
pub type SignalSet = libc::sigset_t;

/// The signals the server handles.
const HANDLED: [libc::c_int; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGUSR1, libc::SIGHUP];

/// Block the signals the server handles, in this thread and every thread
/// started after (the crypt workers, the connections), so that only
/// [`wait_signal`] in the main thread receives them.
pub fn block_signals() -> SignalSet {
    sys::block_signals(&HANDLED)
}

/// Wait up to `timeout` (`None`: without limit) for one of `set`.
///
/// **Returns:** the signal; `None` on timeout. An interrupted wait is
/// resumed (with the whole `timeout` again).
pub fn wait_signal(set: &SignalSet, timeout: Option<Duration>) -> Option<i32> {
    loop {
        match sys::sigwait(set, timeout) {
            Ok(sig) => return Some(sig),
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => return None,
            Err(_) => continue, // EINTR
        }
    }
}

/// A signal the server stops on, as messages name it: `INT`, `TERM`, or
/// `HUP` for the other one.
pub fn stop_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGINT => "INT",
        libc::SIGTERM => "TERM",
        _ => "HUP",
    }
}

/// Whether `sig` stops the process while a volume opens (SIGINT,
/// SIGTERM).
pub fn stops_opening(sig: i32) -> bool {
    sig == libc::SIGINT || sig == libc::SIGTERM
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_signals_are_named_as_the_messages_print_them() {
        assert_eq!(stop_name(libc::SIGINT), "INT");
        assert_eq!(stop_name(libc::SIGTERM), "TERM");
        assert_eq!(stop_name(libc::SIGHUP), "HUP");
        assert!(stops_opening(libc::SIGINT) && stops_opening(libc::SIGTERM));
        assert!(!stops_opening(libc::SIGHUP) && !stops_opening(libc::SIGUSR1));
    }
}
