//! The exports of a server: each a volume served under a name, opened at
//! start or on the first connection that asks for it.
//!
//! Owns: [`Export`] (what the caller hands the server: a description and
//! a volume, or a way to open one), the server's catalog of exports (name
//! lookup for the handshake, the default export, opening a lazy export
//! once — never two volumes' key derivations at once — and remembering a
//! failure so a client cannot make the server derive keys again and
//! again), and each export's own counters, payload buffers and
//! connections-in-transmission count. Must never: open a lazy export
//! twice, or serve one whose opening failed.

use crate::buffers::Buffers;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::stats::Counters;
use crate::{ExportConfig, ExportInfo};
use iopages_crypt::queue::CryptQueue;
use iopages_crypt::target::SectorCipher;
use parking_lot::Mutex;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, OnceLock};

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
                Arc::new(crate::device::Inline {
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
/// for the server's log.
pub type Opener = Box<dyn FnOnce() -> std::result::Result<ExportVolume, String> + Send>;

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

    /// An export opened by `open` on the first connection that asks for
    /// it by name (NBD_OPT_INFO, GO or EXPORT_NAME; a LIST only shows the
    /// name). A failure is kept: the export then answers every request
    /// for it with an error, without running `open` again.
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

/// One export in the catalog.
pub(crate) struct Slot {
    pub(crate) config: ExportConfig,
    /// The opener of a lazy export, until it has run.
    opener: Mutex<Option<Opener>>,
    live: OnceLock<std::result::Result<Live, String>>,
    pub(crate) counters: Arc<Counters>,
    /// Connections in transmission on this export now.
    pub(crate) active: Arc<AtomicUsize>,
}

/// Serialises the opening of lazy exports: one key derivation at a time
/// in the whole process (each may take a large share of the memory and a
/// second of a core).
static OPENING: Mutex<()> = Mutex::new(());

impl Slot {
    /// The export's live state, opening it first if it is lazy and not
    /// opened yet (waiting for any other opening in the process).
    pub(crate) fn open(&self) -> std::result::Result<&Live, &str> {
        if let Some(r) = self.live.get() {
            return r.as_ref().map_err(|e| e.as_str());
        }
        let _one_at_a_time = OPENING.lock();
        let r = self.live.get_or_init(|| {
            let open = self
                .opener
                .lock()
                .take()
                .expect("a lazy slot keeps its opener until opened");
            let r = open().and_then(|v| {
                live(&self.config, v, Arc::clone(&self.active)).map_err(|e| e.to_string())
            });
            if let Err(e) = &r {
                eprintln!(
                    "iopages-nbd: export {:?} could not be opened: {e}",
                    self.config.name
                );
            }
            r
        });
        r.as_ref().map_err(|e| e.as_str())
    }

    /// The live state if the export is open (never opens it).
    pub(crate) fn get(&self) -> Option<&Live> {
        self.live.get().and_then(|r| r.as_ref().ok())
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
            let active = Arc::new(AtomicUsize::new(0));
            let (opener, live) = match e.source {
                Source::Ready(v) => {
                    let l = live(&e.config, v, Arc::clone(&active))?;
                    (None, OnceLock::from(Ok(l)))
                }
                Source::Lazy(o) => (Some(o), OnceLock::new()),
            };
            slots.push(Slot {
                config: e.config,
                opener: Mutex::new(opener),
                live,
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

    /// The longest handshake deadline of any export.
    pub(crate) fn handshake_timeout(&self) -> std::time::Duration {
        self.slots
            .iter()
            .map(|s| s.config.handshake_timeout)
            .max()
            .expect("a catalog has an export")
    }
}
