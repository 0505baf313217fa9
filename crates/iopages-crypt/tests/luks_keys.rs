//! The key verbs (`add_key`, `remove_key`, `change_key`, `kill_slot`) as
//! specifications: each verb on LUKS1 and LUKS2, on a file and on a
//! backend; a crash after every write and every sync leaves a volume that
//! opens with the passphrases valid before or those valid after; every
//! refusal leaves the header bytes as they were.

mod common;

use iopages_crypt::backend::Backend;
use iopages_crypt::luks::{
    self, add_key, change_key, kill_slot, remove_key, FormatOptions, Hash, HeaderDevice, KdfLimits,
    KeyOptions, LuksError, LuksVersion, Pbkdf,
};
use std::io;
use std::sync::Mutex;

const VERSIONS: [LuksVersion; 2] = [LuksVersion::Luks1, LuksVersion::Luks2];
const SIZE: u64 = 17 << 20;

fn fast() -> KeyOptions {
    KeyOptions::new(Pbkdf::Pbkdf2 {
        hash: Hash::Sha256,
        iterations: 1000,
    })
}

/// A fresh image's bytes, formatted (cheap KDF) under `pass`.
fn image(version: LuksVersion, pass: &[u8]) -> Vec<u8> {
    let dir = common::Dir::new("luks-keys", "img");
    let p = dir.path("img");
    luks::format_path(
        &p,
        Some(SIZE),
        pass,
        &FormatOptions::fast_for_tests(version),
    )
    .unwrap();
    std::fs::read(&p).unwrap()
}

/// A RAM disk that fails once its budget of writes and flushes is spent:
/// the failing write lands torn (its first half, whole 512-byte sectors),
/// and `durable` keeps only what was flushed (a power cut's view).
struct Faulty {
    live: Mutex<Vec<u8>>,
    durable: Mutex<Vec<u8>>,
    budget: Mutex<usize>,
}

impl Faulty {
    fn new(bytes: &[u8], budget: usize) -> Faulty {
        Faulty {
            live: Mutex::new(bytes.to_vec()),
            durable: Mutex::new(bytes.to_vec()),
            budget: Mutex::new(budget),
        }
    }

    /// One operation's worth of budget: `false` once it is spent.
    fn spend(&self) -> bool {
        let mut b = self.budget.lock().unwrap();
        if *b == 0 {
            return false;
        }
        *b -= 1;
        true
    }

    fn live(&self) -> Vec<u8> {
        self.live.lock().unwrap().clone()
    }
}

impl Backend for Faulty {
    fn size_bytes(&self) -> u64 {
        self.live.lock().unwrap().len() as u64
    }

    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        let data: Vec<u8> = segments.concat();
        let at = offset as usize;
        let mut live = self.live.lock().unwrap();
        if !self.spend() {
            let torn = data.len() / 2 / 512 * 512;
            live[at..at + torn].copy_from_slice(&data[..torn]);
            return Err(io::Error::other("injected crash during a write"));
        }
        live[at..at + data.len()].copy_from_slice(&data);
        Ok(())
    }

    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()> {
        let live = self.live.lock().unwrap();
        let mut at = offset as usize;
        for s in segments.iter_mut() {
            let n = s.len();
            s.copy_from_slice(&live[at..at + n]);
            at += n;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        if !self.spend() {
            return Err(io::Error::other("injected crash before a flush"));
        }
        *self.durable.lock().unwrap() = self.live();
        Ok(())
    }
}

/// Whether `pass` opens the image `bytes`; any error but a wrong
/// passphrase (a damaged header, say) fails the test.
fn opens(bytes: &[u8], pass: &[u8]) -> bool {
    let d = Faulty::new(bytes, usize::MAX);
    match HeaderDevice::backend(&d).open(pass, &KdfLimits::default()) {
        Ok(_) => true,
        Err(LuksError::WrongPassphrase | LuksError::NoKeyslot) => false,
        Err(e) => panic!("the volume no longer opens cleanly: {e}"),
    }
}

/// Which of `passes` open `bytes`.
fn opening(bytes: &[u8], passes: &[&[u8]]) -> Vec<Vec<u8>> {
    passes
        .iter()
        .filter(|p| opens(bytes, p))
        .map(|p| p.to_vec())
        .collect()
}

/// Where a verb runs: a file, or a backend.
#[derive(Clone, Copy, Debug)]
enum Kind {
    File,
    Backend,
}

/// Run `verb` on `bytes` held in a device of `kind`; the bytes after.
fn on_device<T>(
    kind: Kind,
    bytes: &[u8],
    verb: impl FnOnce(&HeaderDevice<'_>) -> T,
) -> (T, Vec<u8>) {
    match kind {
        Kind::Backend => {
            let d = Faulty::new(bytes, usize::MAX);
            let out = verb(&HeaderDevice::backend(&d));
            (out, d.live())
        }
        Kind::File => {
            let dir = common::Dir::new("luks-keys", "dev");
            let p = dir.path("img");
            std::fs::write(&p, bytes).unwrap();
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&p)
                .unwrap();
            let out = verb(&HeaderDevice::file(&f).unwrap());
            (out, std::fs::read(&p).unwrap())
        }
    }
}

#[test]
fn each_verb_works_on_luks1_and_luks2_files_and_backends() {
    for version in VERSIONS {
        for kind in [Kind::File, Kind::Backend] {
            let what = format!("{version} on {kind:?}");
            let img = image(version, b"old");
            let (r, img) = on_device(kind, &img, |d| add_key(d, b"old", b"new", &fast()));
            let c = r.unwrap();
            assert_eq!((c.added, c.removed), (Some(1), None), "{what}");
            assert_eq!(opening(&img, &[b"old", b"new"]).len(), 2, "{what}");
            let (r, img) = on_device(kind, &img, |d| change_key(d, b"new", b"newer", &fast()));
            let c = r.unwrap();
            assert_eq!(c.removed, Some(1), "{what}");
            let want: Vec<Vec<u8>> = vec![b"old".to_vec(), b"newer".to_vec()];
            assert_eq!(opening(&img, &[b"old", b"new", b"newer"]), want, "{what}");
            let (r, img) = on_device(kind, &img, |d| remove_key(d, b"old", &fast()));
            assert_eq!(r.unwrap().removed, Some(0), "{what}");
            assert_eq!(opening(&img, &[b"old", b"newer"]), vec![b"newer".to_vec()]);
            let slot = c.added.unwrap();
            let (r, same) = on_device(kind, &img, |d| kill_slot(d, slot, None, &fast()));
            assert!(matches!(r, Err(LuksError::KeySlot(_))), "{what}: {r:?}");
            assert!(same == img, "{what}: a refused kill changed the image");
            let forced = KeyOptions {
                force: true,
                ..fast()
            };
            let (r, img) = on_device(kind, &img, |d| kill_slot(d, slot, None, &forced));
            assert_eq!(r.unwrap().removed, Some(slot), "{what}");
            assert!(
                opening(&img, &[b"old", b"new", b"newer"]).is_empty(),
                "{what}"
            );
        }
    }
}

type Verb = fn(&HeaderDevice<'_>) -> Result<luks::KeyChange, LuksError>;
type Passes = Vec<&'static [u8]>;

/// The crash table: a verb on a volume holding "a" (slot 0) and "b"
/// (slot 1), and the passphrases that open before and after it. LUKS1's
/// `change_key` adds the new passphrase before it removes the old, so
/// between the two both open (never neither).
fn crash_cases() -> Vec<(&'static str, Verb, Passes, Passes)> {
    vec![
        (
            "add c",
            |d| add_key(d, b"a", b"c", &fast()),
            vec![b"a", b"b"],
            vec![b"a", b"b", b"c"],
        ),
        (
            "remove a",
            |d| remove_key(d, b"a", &fast()),
            vec![b"a", b"b"],
            vec![b"b"],
        ),
        (
            "change a to c",
            |d| change_key(d, b"a", b"c", &fast()),
            vec![b"a", b"b"],
            vec![b"b", b"c"],
        ),
        (
            "kill slot 1",
            |d| kill_slot(d, 1, Some(b"a"), &fast()),
            vec![b"a", b"b"],
            vec![b"a"],
        ),
    ]
}

#[test]
fn a_crash_at_any_write_or_sync_leaves_the_old_or_the_new_passphrases() {
    let all: [&[u8]; 3] = [b"a", b"b", b"c"];
    for version in VERSIONS {
        let base = image(version, b"a");
        let (r, base) = on_device(Kind::Backend, &base, |d| add_key(d, b"a", b"b", &fast()));
        r.unwrap();
        for (name, verb, before, after) in crash_cases() {
            let before: Vec<Vec<u8>> = before.iter().map(|p| p.to_vec()).collect();
            let after: Vec<Vec<u8>> = after.iter().map(|p| p.to_vec()).collect();
            let mut done = false;
            for budget in 0..64 {
                let d = Faulty::new(&base, budget);
                let r = verb(&HeaderDevice::backend(&d));
                let durable = d.durable.lock().unwrap().clone();
                for (view, bytes) in [("written", d.live()), ("synced", durable)] {
                    let now = opening(&bytes, &all);
                    let both = version == LuksVersion::Luks1 && name.starts_with("change");
                    let union: Vec<Vec<u8>> = all
                        .iter()
                        .filter(|p| before.contains(&p.to_vec()) || after.contains(&p.to_vec()))
                        .map(|p| p.to_vec())
                        .collect();
                    let ok = now == before || now == after || (both && now == union);
                    assert!(
                        ok,
                        "{version} {name}, crash after {budget} operations ({view} view): \
                         {now:?} open, expected {before:?} or {after:?}"
                    );
                    if r.is_ok() {
                        assert_eq!(now, after, "{version} {name}: done, {view} view");
                    }
                }
                if r.is_ok() {
                    done = true;
                    break;
                }
            }
            assert!(done, "{version} {name} never completed");
        }
    }
}

#[test]
fn luks2_uses_the_valid_copy_with_the_higher_seqid() {
    let old = image(LuksVersion::Luks2, b"a");
    let (r, new) = on_device(Kind::Backend, &old, |d| add_key(d, b"a", b"b", &fast()));
    r.unwrap();
    let hdr = 16 << 10;
    // New secondary, old primary (a crash between the two writes).
    let mut mixed = new.clone();
    mixed[..hdr].copy_from_slice(&old[..hdr]);
    assert!(opens(&mixed, b"b"));
    // New primary, old secondary.
    let mut mixed = new.clone();
    mixed[hdr..2 * hdr].copy_from_slice(&old[hdr..2 * hdr]);
    assert!(opens(&mixed, b"b"));
    // New secondary with a damaged checksum: the old primary.
    let mut mixed = new.clone();
    mixed[..hdr].copy_from_slice(&old[..hdr]);
    mixed[hdr + 5000] ^= 1;
    assert!(!opens(&mixed, b"b") && opens(&mixed, b"a"));
}

/// `verb` on `img` must fail as `want` says and change no byte.
fn refused(
    img: &[u8],
    what: &str,
    verb: impl FnOnce(&HeaderDevice<'_>) -> Result<luks::KeyChange, LuksError>,
    want: fn(&LuksError) -> bool,
) {
    let (r, after) = on_device(Kind::Backend, img, verb);
    match r {
        Err(e) if want(&e) => {}
        other => panic!("{what}: unexpected {other:?}"),
    }
    assert!(after == img, "{what}: a refused verb changed the image");
}

#[test]
fn refused_verbs_change_nothing() {
    let is_slot = |e: &LuksError| matches!(e, LuksError::KeySlot(_));
    let is_wrong = |e: &LuksError| matches!(e, LuksError::WrongPassphrase);
    for version in VERSIONS {
        let img = image(version, b"a");
        let (r, img) = on_device(Kind::Backend, &img, |d| add_key(d, b"a", b"b", &fast()));
        r.unwrap();
        let v = format!("{version}");
        refused(&img, &v, |d| add_key(d, b"x", b"c", &fast()), is_wrong);
        refused(&img, &v, |d| remove_key(d, b"x", &fast()), is_wrong);
        refused(&img, &v, |d| change_key(d, b"x", b"c", &fast()), is_wrong);
        let in_use = KeyOptions {
            key_slot: Some(1),
            ..fast()
        };
        refused(&img, &v, |d| add_key(d, b"a", b"c", &in_use), is_slot);
        refused(&img, &v, |d| kill_slot(d, 5, None, &fast()), is_slot);
        refused(&img, &v, |d| kill_slot(d, 1, Some(b"b"), &fast()), is_slot);
        let few = KeyOptions::new(Pbkdf::Pbkdf2 {
            hash: Hash::Sha256,
            iterations: 999,
        });
        let is_opts = |e: &LuksError| matches!(e, LuksError::InvalidOptions(_));
        refused(&img, &v, |d| add_key(d, b"a", b"c", &few), is_opts);
        let big = KeyOptions {
            limits: KdfLimits {
                max_pbkdf2_iterations: 5000,
                ..KdfLimits::default()
            },
            ..KeyOptions::new(Pbkdf::Pbkdf2 {
                hash: Hash::Sha256,
                iterations: 6000,
            })
        };
        let is_over = |e: &LuksError| matches!(e, LuksError::OverLimit(_));
        refused(&img, &v, |d| add_key(d, b"a", b"c", &big), is_over);
        let argon = KeyOptions::new(FormatOptions::fast_for_tests(LuksVersion::Luks2).pbkdf);
        if version == LuksVersion::Luks1 {
            refused(&img, &v, |d| add_key(d, b"a", b"c", &argon), is_opts);
        }
        let (r, one) = on_device(Kind::Backend, &img, |d| remove_key(d, b"b", &fast()));
        r.unwrap();
        refused(&one, &v, |d| remove_key(d, b"a", &fast()), is_slot);
        let mut damaged = img.clone();
        damaged[0] ^= 0xff;
        if version == LuksVersion::Luks2 {
            damaged[(16 << 10) + 100] ^= 0xff; // both copies
        }
        let is_corrupt = |e: &LuksError| matches!(e, LuksError::Corrupt(_));
        refused(
            &damaged,
            &v,
            |d| add_key(d, b"a", b"c", &fast()),
            is_corrupt,
        );
    }
}

#[test]
fn a_full_slot_table_is_refused() {
    for (version, slots) in [(LuksVersion::Luks1, 8), (LuksVersion::Luks2, 32)] {
        let mut img = image(version, b"a");
        let d = Faulty::new(&img, usize::MAX);
        for i in 1..slots {
            let c = add_key(&HeaderDevice::backend(&d), b"a", b"b", &fast()).unwrap();
            assert_eq!(c.added, Some(i));
        }
        img = d.live();
        let is_slot = |e: &LuksError| matches!(e, LuksError::KeySlot(_));
        let v = format!("{version} full");
        refused(&img, &v, |d| add_key(d, b"a", b"c", &fast()), is_slot);
        if version == LuksVersion::Luks1 {
            refused(&img, &v, |d| change_key(d, b"a", b"c", &fast()), is_slot);
        }
    }
}

#[test]
fn still_holds_sees_a_lost_update() {
    for version in VERSIONS {
        let d = Faulty::new(&image(version, b"a"), usize::MAX);
        let dev = HeaderDevice::backend(&d);
        let c = add_key(&dev, b"a", b"b", &fast()).unwrap();
        assert!(dev.still_holds(&c).unwrap());
        add_key(&dev, b"a", b"c", &fast()).unwrap();
        assert!(!dev.still_holds(&c).unwrap(), "{version}");
    }
}
