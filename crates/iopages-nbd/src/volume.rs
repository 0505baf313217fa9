//! A served volume: a LUKS image (file or block device), or an in-memory
//! LUKS2 volume made at start, set up as the crypt stack the server
//! exports.
//!
//! Owns: opening the LUKS header with a passphrase, and building the
//! stack under it: the page arena, the `aes-xts-plain64` cipher per
//! worker from the volume's key (sector size and IV numbering as
//! cryptsetup would set dm-crypt up), an io_uring file over the image
//! with the arena as its fixed buffers, the payload window after the
//! header ([`Window`]), the crypt target and its queue. Must never: serve
//! a volume whose key failed the header's digest check, write anywhere
//! outside the payload (the header and key slots cannot be reached through
//! the export), or map an image file another process could cut shorter
//! (a read through the mapping would then raise `SIGBUS`).
//!
//! The in-memory volume is a LUKS2 image in a memfd: a real header with
//! one Argon2id key slot under a generated passphrase (shown once), so
//! what is served by default is the same thing a file would hold.

use iopages::PageAllocator;
use iopages_crypt::backend::{Backend, Window};
use iopages_crypt::integrity::{AuthBackend, AuthOptions, Freshness, Keys};
use iopages_crypt::luks::{self, FormatOptions, KdfLimits, LuksVersion, LuksVolume, Pbkdf};
use iopages_crypt::queue::{CryptQueue, QueueConfig};
use iopages_crypt::strategy::Strategy;
use iopages_crypt::target::{CipherPool, CryptTarget, TargetConfig};
use iopages_crypt::uring::{DirectIo, UringFile, UringOptions};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use zeroize::Zeroizing;

/// The default page arena of a served volume (out pages, payload
/// buffers, bounce buffers).
pub const DEFAULT_ARENA_BYTES: u64 = 512 << 20;

/// Crypt worker threads of a volume whose image is a remote NBD export,
/// by default. A worker waits for the remote's reply to each request it
/// serves, so the workers are the requests in flight to the remote: one
/// per core (2 here) left a 4 KiB random load with 64 requests queued
/// waiting on round trips, not on the cipher. 64 keeps as many in
/// flight as fio's 2 × qd32 (the remote client carries up to 4 × 64).
pub const DEFAULT_REMOTE_WORKERS: usize = 64;

/// How to build the stack under a volume.
#[derive(Clone, Debug)]
pub struct VolumeOptions {
    /// Page arena size in bytes. Default [`DEFAULT_ARENA_BYTES`].
    pub arena_bytes: u64,
    /// Crypt worker threads; `None` (the default): one per core for an
    /// image file, [`DEFAULT_REMOTE_WORKERS`] for a remote export
    /// ([`open_remote`]: each worker waits a round trip per request).
    pub workers: Option<usize>,
    /// Requests admitted to the crypt queue at once. Default 128.
    pub queue_depth: usize,
    /// Out-page strategy. Default compound.
    pub strategy: Strategy,
    /// Open the image read-only.
    pub read_only: bool,
    /// `O_DIRECT` (with a fallback), required, or buffered through the
    /// page cache. Default [`DirectIo::Auto`].
    pub direct: DirectIo,
    /// What opening the image's header may spend on key derivation (and
    /// its cancel flag). Default [`KdfLimits::default`].
    pub kdf_limits: KdfLimits,
    /// Use a LUKS2 image's secondary header even when the primary header
    /// area carries another format's signature (see
    /// [`luks::LuksOpenOptions::allow_secondary_header`]). Default off.
    pub allow_secondary_header: bool,
    /// Serve discards and fast zeroing by punching holes in the image,
    /// and read all-zero ciphertext sectors as zeros (see
    /// [`TargetConfig::allow_discards`]). Default off.
    pub allow_discards: bool,
    /// An authenticated volume's freshness anchor: its local state file
    /// (`--freshness FILE`) and whether to accept the store's tree as
    /// fresh (`--freshness-reset`). Required to serve one writable.
    pub freshness: Freshness,
    /// Bytes of an authenticated volume's tag tree kept in memory,
    /// whatever the volume's size. Default 64 MiB.
    pub freshness_cache: usize,
}

/// Default bound on an authenticated volume's cached tag tree.
pub const DEFAULT_FRESHNESS_CACHE: usize = 64 << 20;

impl VolumeOptions {
    /// The crypt workers to start: [`VolumeOptions::workers`], else one
    /// per core; at least one.
    fn worker_count(&self) -> usize {
        self.workers
            .unwrap_or_else(|| QueueConfig::default().workers)
            .max(1)
    }
}

impl Default for VolumeOptions {
    fn default() -> Self {
        let q = QueueConfig::default();
        VolumeOptions {
            arena_bytes: DEFAULT_ARENA_BYTES,
            workers: None,
            queue_depth: q.queue_depth,
            strategy: TargetConfig::default().strategy,
            read_only: false,
            direct: DirectIo::Auto,
            kdf_limits: KdfLimits::default(),
            allow_secondary_header: false,
            allow_discards: false,
            freshness: Freshness::default(),
            freshness_cache: DEFAULT_FRESHNESS_CACHE,
        }
    }
}

/// What a served volume is.
#[derive(Clone, Debug)]
pub struct VolumeInfo {
    /// LUKS1 or LUKS2.
    pub version: LuksVersion,
    /// The header's UUID.
    pub uuid: String,
    /// The cipher (always `aes-xts-plain64` here).
    pub cipher: String,
    /// Key size in bits.
    pub key_bits: usize,
    /// Encryption sector size in bytes.
    pub sector_size: usize,
    /// Where the payload starts in the image.
    pub data_offset: u64,
    /// Payload bytes (what the export's size is).
    pub size_bytes: u64,
    /// The key slot the passphrase opened.
    pub keyslot: usize,
    /// The image (`None`: in memory, or on a remote export).
    pub image: Option<PathBuf>,
    /// The remote export holding the image, if it is one (its URI).
    pub remote: Option<String>,
    /// How the image is read and written (O_DIRECT or buffered, fixed
    /// buffers, and any fallback taken).
    pub io: String,
    /// Whether the ciphers' expanded keys are locked in memory (out of
    /// swap). The volume key itself is wiped once they are built.
    pub keys_locked: bool,
    /// The tags' MAC of an authenticated volume (`hmac-sha256`, `aead`).
    pub integrity: Option<String>,
}

/// An opened volume: its crypt queue, ready to be served.
pub struct Volume {
    /// The queue the server submits to.
    pub queue: Arc<CryptQueue<CipherPool>>,
    /// The arena everything comes from.
    pub alloc: PageAllocator,
    /// What was opened.
    pub info: VolumeInfo,
    /// The image file (for its I/O statistics); `None` for a remote image.
    pub file: Option<Arc<UringFile>>,
    /// The remote store a remote image is on, when it is an
    /// [`NbdRemote`](crate::remote::NbdRemote) (its health and counters);
    /// set by whoever connected it.
    pub remote: Option<Arc<crate::client::NbdRemote>>,
    /// An authenticated volume's tag layer (its failures and commits).
    pub auth: Option<Arc<AuthBackend>>,
}

fn invalid(m: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, m)
}

/// Open the LUKS volume at `path` (a file or block device) with
/// `passphrase`, within `opts.kdf_limits`, and build its stack.
///
/// **Returns:** the LUKS error (wrong passphrase, unsupported cipher,
/// corrupted or truncated header, a key slot over the KDF limits, a
/// cancelled open) as an `io::Error` naming the image, or the error of
/// whatever could not be set up.
pub fn open_image(path: &Path, passphrase: &[u8], opts: &VolumeOptions) -> io::Result<Volume> {
    let f = File::open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot open {}: {e}", path.display())))?;
    let open = luks::LuksOpenOptions::new().allow_secondary_header(opts.allow_secondary_header);
    let luks = luks::open_with_options(&f, passphrase, &opts.kdf_limits, &open).map_err(|e| {
        let e: io::Error = e.into();
        io::Error::new(e.kind(), format!("{}: {e}", path.display()))
    })?;
    drop(f);
    build(path, Some(path.to_path_buf()), &luks, opts)
}

/// Parameters of the in-memory volume's key slot: Argon2id with a small
/// memory cost. The passphrase is generated with 143 bits of entropy, so
/// the key derivation's cost adds nothing to its strength; it only delays
/// the start.
pub fn in_memory_format_options() -> FormatOptions {
    FormatOptions {
        version: LuksVersion::Luks2,
        key_bytes: 64,
        sector_size: 4096,
        pbkdf: Pbkdf::Argon2id {
            time: 4,
            memory_kib: 32 << 10,
            parallel: 2,
        },
        label: Some("iopages".into()),
    }
}

/// A passphrase of 24 characters from 62, drawn from the kernel's random
/// source (143 bits).
pub fn generate_passphrase() -> io::Result<Zeroizing<String>> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut out = Zeroizing::new(String::with_capacity(24));
    let mut raw = Zeroizing::new([0u8; 64]);
    let mut filled = 0;
    while out.len() < 24 {
        if filled == 0 {
            fill_random(&mut raw[..])?;
            filled = raw.len();
        }
        filled -= 1;
        let b = raw[filled];
        // Rejection sampling: 248 = 4 × 62 keeps the draw uniform.
        if b < 248 {
            out.push(ALPHABET[(b % 62) as usize] as char);
        }
    }
    Ok(out)
}

/// Random bytes from OpenSSL's CSPRNG, the one source of randomness the
/// LUKS code and the TLS setup use too.
fn fill_random(buf: &mut [u8]) -> io::Result<()> {
    openssl::rand::rand_bytes(buf).map_err(|e| io::Error::other(format!("OpenSSL random: {e}")))
}

/// Make an in-memory LUKS2 volume of `size_bytes` payload under a
/// generated passphrase, and build its stack. Returns the volume and the
/// passphrase (shown once by the caller; nothing else keeps it).
pub fn in_memory(size_bytes: u64, opts: &VolumeOptions) -> io::Result<(Volume, Zeroizing<String>)> {
    let fmt = in_memory_format_options();
    if size_bytes == 0 || !size_bytes.is_multiple_of(fmt.sector_size as u64) {
        return Err(invalid(format!(
            "volume size {size_bytes} must be a non-zero multiple of {} bytes",
            fmt.sector_size
        )));
    }
    let name = c"iopages-volume";
    let file = match crate::sys::memfd_sealable(name) {
        Ok(fd) => File::from(fd),
        Err(e) => return Err(io::Error::new(e.kind(), format!("memfd_create: {e}"))),
    };
    let fd = file.as_raw_fd();
    let pass = generate_passphrase()?;
    // Room for any header (LUKS2 puts the payload at 16 MiB), then the
    // file is cut to the header plus exactly `size_bytes` of payload.
    file.set_len((32 << 20) + size_bytes)?;
    let made = luks::format(&file, pass.as_bytes(), &fmt).map_err(io::Error::from)?;
    file.set_len(made.data_offset_bytes() + size_bytes)?;
    drop(made);
    // Nothing can cut the memfd shorter from now on.
    if let Err(e) = crate::sys::seal_shrink(file.as_fd()) {
        return Err(io::Error::new(e.kind(), format!("sealing the memfd: {e}")));
    }
    let luks =
        luks::open_with(&file, pass.as_bytes(), &opts.kdf_limits).map_err(io::Error::from)?;
    let path = PathBuf::from(format!("/proc/self/fd/{fd}"));
    // A memfd is memory: O_DIRECT (which shmem takes since Linux 6.6)
    // only adds a trip through io_uring's workers to every request, where
    // a buffered `preadv` is a copy. Only an explicit requirement gets it.
    // Buffered, the volume is served inline by default (`--inline-max`).
    let mut opts = opts.clone();
    if opts.direct == DirectIo::Auto {
        opts.direct = DirectIo::Off;
    }
    let vol = build(&path, None, &luks, &opts)?;
    // The UringFile opened its own descriptor of the memfd; the memory
    // lives as long as it does.
    drop(file);
    Ok((vol, pass))
}

fn build(
    path: &Path,
    image: Option<PathBuf>,
    luks: &LuksVolume,
    opts: &VolumeOptions,
) -> io::Result<Volume> {
    let alloc = arena(luks, opts)?;
    let mut uring = UringOptions::default()
        .arena(alloc.clone())
        .rings(opts.worker_count())
        .direct(opts.direct)
        .read_only(opts.read_only);
    // Nothing is mapped. An image file (or block device): another process
    // can cut it shorter at any time, and a read copying out of a mapping
    // past the new end raises SIGBUS, which would kill the server; reads
    // go through `preadv`, which reports the end of file as an error
    // instead. The in-memory volume (a memfd sealed against shrinking):
    // a read fault on one of its holes would allocate the page, so reading
    // a fresh volume through would fill it; `preadv` reads holes as zeros.
    uring.map_reads = false;
    let file = Arc::new(UringFile::open(path, uring)?);
    let mut io = format!(
        "{}{}",
        if file.direct_io() {
            "O_DIRECT"
        } else {
            "buffered"
        },
        if file.fixed_buffers() {
            ", arena as fixed buffers"
        } else {
            ""
        }
    );
    for f in file.fallbacks() {
        io.push_str("; ");
        io.push_str(f);
    }
    let device: Arc<dyn Backend> = Arc::clone(&file) as Arc<dyn Backend>;
    let (queue, info, auth) = stack(&alloc, device, luks, opts, image, None, io)?;
    Ok(Volume {
        queue,
        alloc,
        info,
        file: Some(file),
        remote: None,
        auth,
    })
}

/// Open the LUKS volume whose image is `device` (a remote export: see
/// [`crate::remote`]), named `uri` in messages, with `passphrase`, and
/// build its stack over it.
///
/// **Returns:** as [`open_image`].
pub fn open_remote(
    uri: &str,
    device: Arc<dyn Backend>,
    passphrase: &[u8],
    opts: &VolumeOptions,
) -> io::Result<Volume> {
    let open = luks::LuksOpenOptions::new().allow_secondary_header(opts.allow_secondary_header);
    let luks = luks::open_backend(&*device, passphrase, &opts.kdf_limits, &open).map_err(|e| {
        let e: io::Error = e.into();
        io::Error::new(e.kind(), format!("{uri}: {e}"))
    })?;
    let alloc = arena(&luks, opts)?;
    let io = "remote NBD export".to_string();
    let opts = VolumeOptions {
        workers: Some(opts.workers.unwrap_or(DEFAULT_REMOTE_WORKERS)),
        ..opts.clone()
    };
    let (queue, info, auth) = stack(
        &alloc,
        device,
        &luks,
        &opts,
        None,
        Some(uri.to_string()),
        io,
    )?;
    Ok(Volume {
        queue,
        alloc,
        info,
        file: None,
        remote: None,
        auth,
    })
}

/// The volume's page arena (after checking its cipher is one served).
fn arena(luks: &LuksVolume, opts: &VolumeOptions) -> io::Result<PageAllocator> {
    if luks.cipher_spec() != "aes-xts-plain64" {
        return Err(invalid(format!(
            "cipher {} is not supported (only aes-xts-plain64)",
            luks.cipher_spec()
        )));
    }
    PageAllocator::builder()
        .size_bytes(opts.arena_bytes)
        .build()
        .map_err(|e| {
            io::Error::new(
                io::ErrorKind::OutOfMemory,
                format!(
                    "cannot create the page arena ({} bytes): {e}",
                    opts.arena_bytes
                ),
            )
        })
}

/// The bytes of payload to serve on an image of `device` bytes: whole
/// sectors (dm-crypt maps only whole sectors), within a fixed segment.
/// A header-only image (a header backup, a detached header) has nothing
/// to serve: refused before anything else is said about it.
fn payload_to_serve(luks: &LuksVolume, device: u64) -> io::Result<u64> {
    let size = luks.payload_bytes(device).map_err(io::Error::from)?;
    if let Some(seg) = luks.segment_size_bytes() {
        let end = luks.data_offset_bytes().checked_add(seg);
        if end.is_none_or(|end| end > device) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the data segment's size {seg} at offset {} runs past the end of the \
                     {device}-byte image",
                    luks.data_offset_bytes()
                ),
            ));
        }
    }
    let ss = luks.sector_size() as u64;
    Ok(size - size % ss)
}

/// What [`stack`] builds: the queue, what it is, and an authenticated
/// volume's tag layer.
type Stack = (
    Arc<CryptQueue<CipherPool>>,
    VolumeInfo,
    Option<Arc<AuthBackend>>,
);

/// What the target writes to, and the tag layer when that is it.
type Payload = (Arc<dyn Backend>, Option<Arc<AuthBackend>>);

/// The crypt stack over `file` (the whole image): the payload window (an
/// authenticated volume's tag layer over it), the cipher pool, the target
/// and its queue, and what was built.
fn stack(
    alloc: &PageAllocator,
    file: Arc<dyn Backend>,
    luks: &LuksVolume,
    opts: &VolumeOptions,
    image: Option<PathBuf>,
    remote: Option<String>,
    io: String,
) -> io::Result<Stack> {
    let size = payload_to_serve(luks, file.size_bytes())?;
    let name = match (&image, &remote) {
        (Some(p), _) => p.display().to_string(),
        (None, Some(uri)) => uri.clone(),
        (None, None) => luks.uuid().to_string(),
    };
    let (backend, auth) = payload(&file, luks, opts, size, name)?;
    let cipher = luks
        .xts_cipher()
        .map_err(|e| invalid(format!("cannot set up aes-xts-plain64: {e}")))?;
    let cipher = CipherPool::new(cipher, opts.worker_count())
        .map_err(|e| invalid(format!("cannot set up the cipher pool: {e}")))?;
    let keys_locked = cipher.keys_locked();
    let target = CryptTarget::new(
        alloc,
        cipher,
        Arc::clone(&backend),
        TargetConfig {
            strategy: opts.strategy,
            allow_discards: opts.allow_discards,
            sparse_reads: auth.is_some(),
            ..TargetConfig::default()
        },
    )?;
    let queue = CryptQueue::new(
        Arc::new(target),
        QueueConfig {
            queue_depth: opts.queue_depth,
            workers: opts.worker_count(),
            preallocated_out: false,
        },
    )?;
    let info = VolumeInfo {
        version: luks.version(),
        uuid: luks.uuid().to_string(),
        cipher: luks.cipher_spec().to_string(),
        key_bits: luks.master_key().len() * 8,
        sector_size: luks.sector_size(),
        data_offset: luks.data_offset_bytes(),
        size_bytes: backend.size_bytes(),
        keyslot: luks.keyslot(),
        image,
        remote,
        io,
        keys_locked,
        integrity: auth.as_ref().map(|a| a.layout().mac().name().to_string()),
    };
    Ok((Arc::new(queue), info, auth))
}

/// What the target writes to: the payload window, or for an
/// authenticated volume its tag layer over the data and integrity area
/// (opened against its freshness anchor).
fn payload(
    file: &Arc<dyn Backend>,
    luks: &LuksVolume,
    opts: &VolumeOptions,
    size: u64,
    name: String,
) -> io::Result<Payload> {
    let Some(i) = luks.integrity() else {
        if let Some(p) = &opts.freshness.state {
            return Err(invalid(format!(
                "{name}: a freshness state file ({}) was given, but the volume is not \
                 authenticated (luks format --integrity makes one that is)",
                p.display()
            )));
        }
        let w = Window::new(Arc::clone(file), luks.data_offset_bytes(), size)?;
        return Ok((Arc::new(w), None));
    };
    let data = Window::new(
        Arc::clone(file),
        luks.data_offset_bytes(),
        i.layout.data_bytes(),
    )?;
    let area = Window::new(Arc::clone(file), i.area_offset, i.area_bytes())?;
    let keys = Keys::derive(i.mac(), luks.master_key())?;
    let auth = AuthBackend::open(
        Arc::new(data),
        Arc::new(area),
        i.layout.clone(),
        keys,
        AuthOptions {
            uuid: luks.uuid().to_string(),
            freshness: opts.freshness.clone(),
            cache_bytes: opts.freshness_cache,
            read_only: opts.read_only,
            name: name.clone(),
        },
    )
    .map_err(|e| io::Error::new(e.kind(), format!("{name}: {e}")))?;
    let auth = Arc::new(auth);
    Ok((Arc::clone(&auth) as Arc<dyn Backend>, Some(auth)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> VolumeOptions {
        VolumeOptions {
            arena_bytes: 16 << 20,
            workers: Some(1),
            direct: DirectIo::Off,
            ..VolumeOptions::default()
        }
    }

    /// An image file is never mapped (a file cut shorter underneath would
    /// turn a mapped read into SIGBUS); reads past a truncation are
    /// errors. Nor is the in-memory volume (a read fault on a hole would
    /// fill it), which is buffered unless O_DIRECT is required.
    #[test]
    fn image_files_and_the_memfd_are_read_with_preadv() {
        let dir = std::env::temp_dir().join(format!("iopages-volume-map-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = dir.join("v.img");
        luks::format_path(
            &img,
            Some((2 << 20) + (1 << 20)),
            b"pw",
            &FormatOptions::fast_for_tests(LuksVersion::Luks1),
        )
        .unwrap();
        let vol = open_image(&img, b"pw", &small()).unwrap();
        let file = vol.file.as_ref().unwrap();
        assert!(!file.direct_io());
        assert!(file.mapped(0, 256 << 10).is_none());
        // Cut the image under the open volume: a read is an error.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&img)
            .unwrap()
            .set_len(2 << 20)
            .unwrap();
        let mut buf = vec![0u8; 256 << 10];
        assert!(vol.queue.target().read(0, &mut buf).is_err());
        drop(vol);

        let auto = VolumeOptions {
            direct: DirectIo::Auto,
            ..small()
        };
        let (mem, _pass) = in_memory(1 << 20, &auto).unwrap();
        let file = mem.file.as_ref().unwrap();
        assert!(file.mapped(0, 256 << 10).is_none());
        assert!(
            !file.direct_io(),
            "a memfd buffered unless O_DIRECT is required"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_kdf_limits_reach_the_open() {
        let dir = std::env::temp_dir().join(format!("iopages-volume-kdf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let img = dir.join("v.img");
        luks::format_path(
            &img,
            Some((2 << 20) + (1 << 20)),
            b"pw",
            &FormatOptions::fast_for_tests(LuksVersion::Luks1),
        )
        .unwrap();
        let opts = VolumeOptions {
            kdf_limits: KdfLimits {
                max_pbkdf2_iterations: 999,
                ..KdfLimits::default()
            },
            ..small()
        };
        let e = open_image(&img, b"pw", &opts).err().unwrap();
        assert_eq!(e.kind(), io::ErrorKind::InvalidData);
        assert!(e.to_string().contains("max_pbkdf2_iterations"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
