//! The exports of a server: each a volume served under a name, opened at
//! start or on the first connection that asks for it.
//!
//! Owns: [`Export`] (what the caller hands the server: a description and
//! a volume, or a way to open one), the server's catalog of exports (name
//! lookup for the handshake, the default export, opening a lazy export
//! once — never two volumes' key derivations at once — and, after a
//! failure, trying again only on a request after a backoff of 1 s doubling
//! to 60 s, so a client cannot make the server derive keys again and
//! again while a store that was briefly down still comes back), who may
//! use each export (its `allow` rules), its rate limits, and each
//! export's own counters, payload buffers and connections-in-transmission
//! count. Must never: open a lazy export twice, or serve one whose
//! opening failed.

use crate::error::{Error, Result};
use crate::server::buffers::Buffers;
use crate::server::device::Device;
use crate::server::peer::{allowed, Peer};
use crate::server::rate::Rate;
use crate::stats::Counters;
use crate::{ExportConfig, ExportInfo};
use iopages_crypt::queue::CryptQueue;
use iopages_crypt::target::SectorCipher;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The wait after a lazy export's first failed open; it doubles with each
/// failure in a row, up to [`OPEN_BACKOFF_MAX`].
pub const OPEN_BACKOFF_FIRST: Duration = Duration::from_secs(1);
/// The longest wait between two attempts to open a lazy export.
pub const OPEN_BACKOFF_MAX: Duration = Duration::from_secs(60);

/// Builds the device a volume is served through, given the export's
/// inline size and its count of connections in transmission.
type MakeDevice = Box<dyn FnOnce(u32, Arc<AtomicUsize>) -> Arc<dyn Device> + Send>;

/// A volume ready to serve: a crypt queue, without its cipher type.
pub struct ExportVolume(MakeDevice);

impl ExportVolume {
    /// Serve `queue`'s target (one queue for every connection to the
    /// export, so a flush on one covers writes completed on every other).
    pub fn new<C: SectorCipher + 'static>(queue: Arc<CryptQueue<C>>) -> ExportVolume {
        ExportVolume(Box::new(move |inline_max_bytes, active| {
            if inline_max_bytes > 0 {
                Arc::new(crate::server::device::Inline {
                    queue,
                    max_bytes: inline_max_bytes as usize,
                    active,
                })
            } else {
                queue
            }
        }))
    }
}

impl std::fmt::Debug for ExportVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExportVolume")
    }
}

/// Opens a lazy export's volume (derives its key): `Err` with a message
/// for the server's log. Called again after a failure (see
/// [`OPEN_BACKOFF_FIRST`]), never again after a success.
pub type Opener = Box<dyn FnMut() -> std::result::Result<ExportVolume, String> + Send>;

enum Source {
    Ready(ExportVolume),
    Lazy(Opener),
}

/// One export of a server: its description, and its volume or how to
/// open it.
pub struct Export {
    config: ExportConfig,
    source: Source,
}

impl Export {
    /// An export of an opened volume.
    pub fn ready(config: ExportConfig, volume: ExportVolume) -> Export {
        Export {
            config,
            source: Source::Ready(volume),
        }
    }

    /// An export opened by `open` on the first connection allowed to use
    /// it that asks for it by name (NBD_OPT_INFO, GO or EXPORT_NAME; a
    /// LIST only shows the name). After a failure, requests for it get an
    /// error without running `open` until a backoff has passed (1 s, then
    /// doubling up to 60 s while it keeps failing); the next request after
    /// that tries again.
    pub fn lazy(config: ExportConfig, open: Opener) -> Export {
        Export {
            config,
            source: Source::Lazy(open),
        }
    }

    /// The export's name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// What the export is advertised as.
    pub fn config(&self) -> &ExportConfig {
        &self.config
    }
}

/// An export being served: its description and device once open.
pub(crate) struct Live {
    pub(crate) info: ExportInfo,
    pub(crate) device: Arc<dyn Device>,
    pub(crate) buffers: Buffers,
}

/// Whether an export can be served now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportState {
    /// Lazy, and not opened yet.
    Closed,
    /// Open and served.
    Open,
    /// Lazy, its last open failed: tried again on a request once its
    /// backoff has passed.
    Failed,
}

/// The last failed open of a lazy export.
struct Failure {
    message: String,
    backoff: Duration,
    retry_at: Instant,
}

/// One export in the catalog.
pub(crate) struct Slot {
    pub(crate) config: ExportConfig,
    /// The opener of a lazy export, until it has succeeded.
    opener: Mutex<Option<Opener>>,
    live: OnceLock<Live>,
    failure: Mutex<Option<Failure>>,
    /// Opens that failed.
    pub(crate) open_failures: AtomicU64,
    pub(crate) counters: Arc<Counters>,
    /// Connections in transmission on this export now.
    pub(crate) active: Arc<AtomicUsize>,
    pub(crate) rate: Rate,
}

/// Serialises the opening of lazy exports: one key derivation at a time
/// in the whole process (each may take a large share of the memory and a
/// second of a core).
static OPENING: Mutex<()> = Mutex::new(());

impl Slot {
    /// The export's live state, opening it first if it is lazy and not
    /// opened yet (waiting for any other opening in the process), unless
    /// its last failure's backoff has not passed.
    ///
    /// **Context:** may derive a key (seconds, much memory), one opening
    /// at a time in the process. **Returns:** the failure's message.
    pub(crate) fn open(&self) -> std::result::Result<&Live, String> {
        if let Some(l) = self.live.get() {
            return Ok(l);
        }
        let _one_at_a_time = OPENING.lock();
        if let Some(l) = self.live.get() {
            return Ok(l);
        }
        let backoff = match &*self.failure.lock() {
            Some(f) if Instant::now() < f.retry_at => return Err(f.message.clone()),
            Some(f) => (f.backoff * 2).min(OPEN_BACKOFF_MAX),
            None => OPEN_BACKOFF_FIRST,
        };
        let mut opener = self.opener.lock();
        let open = opener
            .as_mut()
            .expect("a lazy slot keeps its opener until opened");
        let r = open().and_then(|v| {
            live(&self.config, v, Arc::clone(&self.active)).map_err(|e| e.to_string())
        });
        match r {
            Ok(l) => {
                *opener = None;
                *self.failure.lock() = None;
                assert!(self.live.set(l).is_ok(), "opened once, under OPENING");
                Ok(self.live.get().expect("just set"))
            }
            Err(message) => {
                self.open_failures.fetch_add(1, Ordering::Relaxed);
                eprintln!(
                    "iopages-nbd: export {:?} could not be opened: {message}; tried again on a request after {} s",
                    self.config.name,
                    backoff.as_secs()
                );
                *self.failure.lock() = Some(Failure {
                    message: message.clone(),
                    backoff,
                    retry_at: Instant::now() + backoff,
                });
                Err(message)
            }
        }
    }

    /// Whether [`Slot::open`] would open it now (lazy, not open, and its
    /// last failure's backoff passed): long work, kept off the watchers.
    pub(crate) fn needs_opening(&self) -> bool {
        self.live.get().is_none()
            && self
                .failure
                .lock()
                .as_ref()
                .is_none_or(|f| Instant::now() >= f.retry_at)
    }

    /// The live state if the export is open (never opens it).
    pub(crate) fn get(&self) -> Option<&Live> {
        self.live.get()
    }

    /// Whether it is open, not yet, or failed.
    pub(crate) fn state(&self) -> ExportState {
        if self.live.get().is_some() {
            ExportState::Open
        } else if self.failure.lock().is_some() {
            ExportState::Failed
        } else {
            ExportState::Closed
        }
    }
}

fn live(config: &ExportConfig, v: ExportVolume, active: Arc<AtomicUsize>) -> Result<Live> {
    let device = (v.0)(config.inline_max_bytes, active);
    let mut info = ExportInfo::new(config, device.size_bytes(), device.sector_bytes())?;
    info.discards = device.holes().discards_allowed();
    info.fast_zero = info.discards && device.holes().can_punch_zeroes();
    let buffers = Buffers::new(&device.allocator());
    Ok(Live {
        info,
        device,
        buffers,
    })
}

/// The exports of a server, in the order given; the first is the default
/// (what the empty name selects).
pub(crate) struct Catalog {
    pub(crate) slots: Vec<Slot>,
}

impl Catalog {
    /// Check the exports (names unique, descriptions valid) and open the
    /// ready ones' descriptions.
    ///
    /// **Returns:** [`Error::Config`] for no export, a repeated name, or
    /// an export whose block sizes do not fit its volume.
    pub(crate) fn new(exports: Vec<Export>) -> Result<Catalog> {
        if exports.is_empty() {
            return Err(Error::Config("no export to serve".into()));
        }
        let mut slots = Vec::with_capacity(exports.len());
        for e in exports {
            if slots.iter().any(|s: &Slot| s.config.name == e.config.name) {
                return Err(Error::Config(format!(
                    "two exports are named {:?}",
                    e.config.name
                )));
            }
            // The name and description are checked now for every export,
            // not only once a lazy one is opened.
            ExportInfo::new(&e.config, 0, 512)?;
            let r = e.config.rate;
            if r.bytes_per_second == Some(0) || r.requests_per_second == Some(0) {
                return Err(Error::Config(format!(
                    "export {:?}: a rate limit must be at least 1 per second",
                    e.config.name
                )));
            }
            let active = Arc::new(AtomicUsize::new(0));
            let (opener, live) = match e.source {
                Source::Ready(v) => {
                    let l = live(&e.config, v, Arc::clone(&active))?;
                    (None, OnceLock::from(l))
                }
                Source::Lazy(o) => (Some(o), OnceLock::new()),
            };
            slots.push(Slot {
                rate: Rate::new(e.config.rate),
                config: e.config,
                opener: Mutex::new(opener),
                live,
                failure: Mutex::new(None),
                open_failures: AtomicU64::new(0),
                counters: Arc::new(Counters::default()),
                active,
            });
        }
        Ok(Catalog { slots })
    }

    /// The export `name` selects: the empty name is the first (the
    /// protocol's default export).
    pub(crate) fn find(&self, name: &[u8]) -> Option<usize> {
        if name.is_empty() {
            return Some(0);
        }
        self.slots
            .iter()
            .position(|s| s.config.name.as_bytes() == name)
    }

    /// Whether export `name` is open; `None` for no such export.
    pub(crate) fn is_open(&self, name: &str) -> Option<bool> {
        let i = self.find(name.as_bytes())?;
        Some(self.slots[i].get().is_some())
    }

    /// Export `name`'s state (open, not opened yet, failed); `None` for
    /// no such export.
    pub(crate) fn state_of(&self, name: &str) -> Option<ExportState> {
        let i = self.find(name.as_bytes())?;
        Some(self.slots[i].state())
    }

    /// The export `name` selects if `peer` may use it; `None` both for no
    /// such export and for one `peer` is not allowed (a client cannot
    /// tell the two apart, so it cannot learn the names of others'
    /// exports by asking).
    pub(crate) fn find_allowed(&self, name: &[u8], peer: &Peer) -> Option<usize> {
        self.find(name)
            .filter(|&i| allowed(&self.slots[i].config.allow, peer))
    }

    /// The longest handshake deadline of any export.
    pub(crate) fn handshake_timeout(&self) -> std::time::Duration {
        self.slots
            .iter()
            .map(|s| s.config.handshake_timeout)
            .max()
            .expect("a catalog has an export")
    }
}
