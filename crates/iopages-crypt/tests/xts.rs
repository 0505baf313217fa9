//! The cipher's contract beyond the known answers: backends agree with each
//! other and with an outside implementation, round trips hold for any key,
//! sector size, offset and length, plain64 and `iv_offset` number sectors
//! as dm-crypt does, and bad input is an error, never a panic.

use iopages_crypt::{plain64_iv, Error, XtsBackend, XtsCipher};
use proptest::prelude::*;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};

/// The backends this CPU runs (the VAES kernel needs AES-NI, AVX2, VAES and
/// VPCLMULQDQ); the others are reported, not silently dropped.
fn backends() -> Vec<XtsBackend> {
    XtsBackend::ALL
        .into_iter()
        .filter(|b| {
            let ok = b.is_available();
            if !ok {
                eprintln!(
                    "note: backend {} cannot run on this CPU; not checked",
                    b.name()
                );
            }
            ok
        })
        .collect()
}

fn key(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn build(backend: XtsBackend, key: &[u8], sector: usize, iv_offset: u64) -> XtsCipher {
    XtsCipher::builder(key)
        .backend(backend)
        .sector_size_bytes(sector)
        .iv_offset(iv_offset)
        .build()
        .expect("valid settings")
}

fn data(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            // xorshift64: test data, nothing secret.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn every_backend_gives_the_same_ciphertext_for_both_key_and_sector_sizes() {
    let all = backends();
    for key_len in [32, 64] {
        for sector in [512, 4096] {
            let k = key(key_len, 7);
            // 70 sectors: crosses every internal batch boundary.
            let plain = data(sector * 70, 99);
            let mut reference: Option<Vec<u8>> = None;
            for &b in &all {
                let mut xts = build(b, &k, sector, 5);
                let mut out = vec![0u8; plain.len()];
                xts.encrypt_sectors(1_000_003, &plain, &mut out).unwrap();
                match &reference {
                    None => reference = Some(out),
                    Some(r) => assert!(
                        *r == out,
                        "{} differs from {} (key {key_len}, sector {sector})",
                        b.name(),
                        all[0].name()
                    ),
                }
            }
        }
    }
}

#[test]
fn sector_n_with_offset_k_is_sector_n_plus_k_without_offset() {
    for b in backends() {
        for sector in [512, 4096] {
            let k = key(64, 3);
            let plain = data(sector * 3, 5);
            let (n, off) = (12_345u64, 678u64);
            let mut with_offset = vec![0u8; plain.len()];
            build(b, &k, sector, off)
                .encrypt_sectors(n, &plain, &mut with_offset)
                .unwrap();
            let mut shifted = vec![0u8; plain.len()];
            build(b, &k, sector, 0)
                .encrypt_sectors(n + off, &plain, &mut shifted)
                .unwrap();
            assert_eq!(with_offset, shifted, "{} sector {sector}", b.name());
        }
    }
}

#[test]
fn each_sector_of_a_request_is_the_sector_encrypted_alone() {
    for b in backends() {
        let mut xts = build(b, &key(32, 1), 512, 0);
        let plain = data(512 * 20, 3);
        let mut whole = vec![0u8; plain.len()];
        xts.encrypt_sectors(40, &plain, &mut whole).unwrap();
        for (i, chunk) in plain.chunks(512).enumerate() {
            let mut one = vec![0u8; 512];
            xts.encrypt_sectors(40 + i as u64, chunk, &mut one).unwrap();
            assert_eq!(one, whole[i * 512..][..512], "{} sector {i}", b.name());
        }
    }
}

#[test]
fn plain64_is_the_little_endian_sector_number_then_zeros() {
    assert_eq!(
        plain64_iv(0x0102_0304_0506_0708),
        [8, 7, 6, 5, 4, 3, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    );
    let xts = build(XtsBackend::RustCrypto, &key(32, 0), 512, 10);
    assert_eq!(xts.iv_sector(5), 15);
    assert_eq!(xts.iv(5), plain64_iv(15));
    // Sector numbers wrap modulo 2^64, like the kernel's sector_t.
    assert_eq!(xts.iv_sector(u64::MAX), 9);
}

#[test]
fn iv_in_512_byte_units_counts_eight_per_4096_byte_sector() {
    for b in backends() {
        let k = key(64, 9);
        let plain = data(4096 * 2, 1);
        let mut small_units = XtsCipher::builder(&k)
            .backend(b)
            .sector_size_bytes(4096)
            .iv_large_sectors(false)
            .build()
            .unwrap();
        assert!(!small_units.iv_large_sectors());
        assert_eq!(small_units.iv_sector(3), 24);
        let mut a = vec![0u8; plain.len()];
        small_units.encrypt_sectors(3, &plain, &mut a).unwrap();
        // Large units: sector 24 and sector 32 carry the same IVs.
        let mut large = build(b, &k, 4096, 0);
        let mut c = vec![0u8; 4096];
        large.encrypt_sectors(24, &plain[..4096], &mut c).unwrap();
        assert_eq!(c, a[..4096], "{}", b.name());
        large.encrypt_sectors(32, &plain[4096..], &mut c).unwrap();
        assert_eq!(c, a[4096..], "{}", b.name());
    }
}

#[test]
fn sector_numbers_wrap_around_the_top_of_the_64_bit_range() {
    for b in backends() {
        let k = key(32, 4);
        let plain = data(512 * 4, 8);
        let mut top = vec![0u8; plain.len()];
        build(b, &k, 512, 0)
            .encrypt_sectors(u64::MAX - 1, &plain, &mut top)
            .unwrap();
        // Sectors MAX-1, MAX, 0, 1.
        let mut low = vec![0u8; 1024];
        build(b, &k, 512, 0)
            .encrypt_sectors(0, &plain[1024..], &mut low)
            .unwrap();
        assert_eq!(low, top[1024..], "{}", b.name());
    }
}

#[test]
fn bad_keys_sector_sizes_and_buffers_are_errors() {
    for len in [0, 16, 31, 33, 48, 63, 65, 128] {
        let err = XtsCipher::new(&key(len, 1), 512, 0).unwrap_err();
        assert!(
            matches!(err, Error::KeyLength { len_bytes } if len_bytes == len),
            "{err}"
        );
        assert!(err.to_string().contains("32 bytes") && err.to_string().contains("64 bytes"));
    }
    for size in [0, 16, 256, 1024, 2048, 8192] {
        let err = XtsCipher::new(&key(64, 1), size, 0).unwrap_err();
        assert!(
            matches!(err, Error::SectorSize { size_bytes } if size_bytes == size),
            "{err}"
        );
    }
    let mut halves = key(32, 1);
    halves.extend_from_within(..);
    for b in XtsBackend::ALL {
        let err = XtsCipher::builder(&halves).backend(b).build().unwrap_err();
        assert!(matches!(err, Error::EqualKeyHalves), "{}: {err}", b.name());
    }
    for b in backends() {
        let mut xts = build(b, &key(64, 2), 4096, 0);
        let mut buf = vec![0u8; 4096 + 512];
        let err = xts.encrypt_sectors_in_place(0, &mut buf).unwrap_err();
        assert!(matches!(
            err,
            Error::PartialSector {
                len_bytes: 4608,
                sector_size_bytes: 4096
            }
        ));
        let err = xts
            .decrypt_sectors_in_place(0, &mut buf[..100])
            .unwrap_err();
        assert!(matches!(err, Error::PartialSector { .. }), "{err}");
        let src = vec![0u8; 8192];
        let err = xts.encrypt_sectors(0, &src, &mut buf[..4096]).unwrap_err();
        assert!(matches!(
            err,
            Error::LengthMismatch {
                src_bytes: 8192,
                dst_bytes: 4096
            }
        ));
        let err = xts.decrypt_sectors(0, &src[..4096], &mut buf).unwrap_err();
        assert!(matches!(err, Error::LengthMismatch { .. }), "{err}");
        // Nothing to do is not an error.
        xts.encrypt_sectors(0, &[], &mut []).unwrap();
    }
}

#[test]
fn unavailable_backend_is_an_error_not_a_crash() {
    if XtsBackend::Vaes.is_available() {
        assert_eq!(
            XtsCipher::new(&key(64, 1), 512, 0).unwrap().backend(),
            XtsBackend::Vaes
        );
    } else {
        let err = XtsCipher::builder(&key(64, 1))
            .backend(XtsBackend::Vaes)
            .build()
            .unwrap_err();
        assert!(matches!(err, Error::BackendUnavailable { .. }), "{err}");
        assert_eq!(XtsBackend::default(), XtsBackend::RustCrypto);
    }
}

#[test]
fn a_clone_encrypts_like_the_original_and_debug_shows_no_key() {
    for b in backends() {
        let k = key(64, 0xa5);
        let xts = build(b, &k, 512, 3);
        let mut copy = xts.try_clone().unwrap();
        let mut orig = xts;
        let plain = data(2048, 2);
        let (mut x, mut y) = (vec![0u8; 2048], vec![0u8; 2048]);
        orig.encrypt_sectors(9, &plain, &mut x).unwrap();
        copy.encrypt_sectors(9, &plain, &mut y).unwrap();
        assert_eq!(x, y, "{}", b.name());
        let shown = format!("{orig:?} {:?}", XtsCipher::builder(&k));
        assert!(!shown.contains("165"), "Debug leaks key bytes: {shown}");
        assert!(shown.contains("key_size_bytes: 64") && shown.contains("key_bytes: 64"));
    }
}

/// Encrypt with an implementation outside this crate: the `openssl enc`
/// command if it takes XTS (OpenSSL 3 refuses: "enc XTS ciphers not
/// supported"), else Python's `cryptography` package if installed. `None`
/// when neither can.
fn outside_encrypt(key: &[u8], iv: &[u8; 16], plain: &[u8]) -> Option<(String, Vec<u8>)> {
    let hexs = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
    let cipher = if key.len() == 32 {
        "-aes-128-xts"
    } else {
        "-aes-256-xts"
    };
    // Ask `openssl enc` until it refuses once.
    static ENC_REFUSES: AtomicBool = AtomicBool::new(false);
    if ENC_REFUSES.load(Ordering::Relaxed) {
        // Go straight to Python.
    } else if let Ok(mut child) = Command::new("openssl")
        .args(["enc", cipher, "-nopad", "-K", &hexs(key), "-iv", &hexs(iv)])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        child.stdin.take()?.write_all(plain).ok()?;
        let out = child.wait_with_output().ok()?;
        if out.status.success() && out.stdout.len() == plain.len() {
            return Some(("openssl enc".into(), out.stdout));
        }
        ENC_REFUSES.store(true, Ordering::Relaxed);
        eprintln!(
            "note: `openssl enc {cipher}` refused: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .next()
                .unwrap_or("")
        );
    }
    let script = "import sys\n\
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes\n\
        k, iv, p = (bytes.fromhex(x) for x in sys.stdin.read().split())\n\
        e = Cipher(algorithms.AES(k), modes.XTS(iv)).encryptor()\n\
        sys.stdout.write((e.update(p) + e.finalize()).hex())\n";
    let mut child = Command::new("python3")
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    let input = format!("{} {} {}", hexs(key), hexs(iv), hexs(plain));
    child.stdin.take()?.write_all(input.as_bytes()).ok()?;
    let out = child.wait_with_output().ok()?;
    if !out.status.success() {
        eprintln!(
            "note: Python's cryptography package is not usable here: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let bytes = (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16))
        .collect::<Result<Vec<u8>, _>>()
        .ok()?;
    Some(("python cryptography".into(), bytes))
}

#[test]
fn an_outside_implementation_agrees_on_random_sectors() {
    let mut checked = 0;
    for (key_len, sector, first, off) in [
        (32, 512, 7u64, 0u64),
        (64, 512, 0xdead_beef, 11),
        (32, 4096, 3, 1 << 40),
        (64, 4096, u64::MAX - 1, 2),
    ] {
        let k = key(key_len, first as u8);
        let plain = data(sector * 2, first ^ off);
        let sealed: Vec<(XtsBackend, Vec<u8>)> = backends()
            .into_iter()
            .map(|b| {
                let mut out = vec![0u8; plain.len()];
                build(b, &k, sector, off)
                    .encrypt_sectors(first, &plain, &mut out)
                    .unwrap();
                (b, out)
            })
            .collect();
        let ivs = build(XtsBackend::RustCrypto, &k, sector, off);
        for (i, chunk) in plain.chunks(sector).enumerate() {
            let iv = ivs.iv(first.wrapping_add(i as u64));
            let Some((who, theirs)) = outside_encrypt(&k, &iv, chunk) else {
                eprintln!(
                    "note: no outside implementation here (openssl enc refuses XTS, Python's cryptography is missing); the OpenSSL library backend is the outside check"
                );
                return;
            };
            for (b, ours) in &sealed {
                assert_eq!(
                    theirs,
                    ours[i * sector..][..sector],
                    "{} against {who}",
                    b.name()
                );
                checked += 1;
            }
        }
    }
    eprintln!("checked {checked} sectors against an outside implementation");
}

fn arb_key() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 32),
        proptest::collection::vec(any::<u8>(), 64)
    ]
    .prop_filter("halves must differ", |k| {
        k[..k.len() / 2] != k[k.len() / 2..]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn round_trips_and_backends_agree_for_any_key_offset_and_length(
        key in arb_key(),
        large in any::<bool>(),
        nr_sectors in 1usize..24,
        first in any::<u64>(),
        off in any::<u64>(),
        seed in any::<u64>(),
    ) {
        let sector = if large { 4096 } else { 512 };
        let plain = data(sector * nr_sectors, seed);
        let mut reference: Option<Vec<u8>> = None;
        for b in backends() {
            let mut xts = build(b, &key, sector, off);
            let mut sealed = vec![0u8; plain.len()];
            xts.encrypt_sectors(first, &plain, &mut sealed).unwrap();
            prop_assert_ne!(&sealed, &plain);
            let mut in_place = plain.clone();
            xts.encrypt_sectors_in_place(first, &mut in_place).unwrap();
            prop_assert_eq!(&in_place, &sealed, "{} in place", b.name());
            let mut back = vec![0u8; plain.len()];
            xts.decrypt_sectors(first, &sealed, &mut back).unwrap();
            prop_assert_eq!(&back, &plain, "{} decrypt", b.name());
            xts.decrypt_sectors_in_place(first, &mut in_place).unwrap();
            prop_assert_eq!(&in_place, &plain, "{} decrypt in place", b.name());
            match &reference {
                None => reference = Some(sealed),
                Some(r) => prop_assert_eq!(r, &sealed, "{} differs", b.name()),
            }
        }
    }
}

#[test]
fn streaming_encryption_writes_the_same_ciphertext_aligned_or_not() {
    for b in backends() {
        for (key_len, sector) in [(32, 512), (64, 4096)] {
            let k = key(key_len, 9);
            let plain = data(sector * 5, 77);
            let mut want = vec![0u8; plain.len()];
            build(b, &k, sector, 3)
                .encrypt_sectors(40, &plain, &mut want)
                .unwrap();
            // A 4096-aligned destination (non-temporal stores where the
            // backend has them) and one 16 bytes off (ordinary stores).
            let mut big = vec![0u8; plain.len() + 8192];
            let base = big.as_ptr().align_offset(4096);
            for off in [base, base + 16] {
                let dst = &mut big[off..off + plain.len()];
                dst.fill(0);
                build(b, &k, sector, 3)
                    .encrypt_sectors_streaming(40, &plain, dst)
                    .unwrap();
                assert!(dst == &want[..], "{}: offset {off}", b.name());
            }
        }
    }
}

/// Scattered encryption is the one-buffer encryption cut at the segment
/// boundaries: the sectors are numbered on across segments (one-sector
/// segments, a segment crossing the 16-sector tweak batch, odd counts),
/// with and without non-temporal stores, on every backend.
#[test]
fn scattered_encryption_is_the_one_buffer_ciphertext_cut_into_segments() {
    for b in backends() {
        for (key_len, sector) in [(32, 512), (64, 4096)] {
            let k = key(key_len, 5);
            let cuts = [1usize, 1, 3, 17, 2, 1, 16, 4];
            let total: usize = cuts.iter().sum();
            let plain = data(sector * total, 31);
            let mut want = vec![0u8; plain.len()];
            build(b, &k, sector, 7)
                .encrypt_sectors(1000, &plain, &mut want)
                .unwrap();
            for streaming in [false, true] {
                // Each segment at its own 4096-aligned place, a page apart.
                let gaps: usize = cuts
                    .iter()
                    .map(|n| (n * sector).next_multiple_of(4096) + 4096)
                    .sum();
                let mut big = vec![0u8; gaps + 4096];
                let base = big.as_ptr().align_offset(4096);
                let mut rest = &mut big[base..];
                let mut segs: Vec<&mut [u8]> = Vec::new();
                for &n in &cuts {
                    let gap = (n * sector).next_multiple_of(4096) + 4096;
                    let (seg, tail) = std::mem::take(&mut rest).split_at_mut(gap);
                    segs.push(&mut seg[..n * sector]);
                    rest = tail;
                }
                build(b, &k, sector, 7)
                    .encrypt_sectors_scattered(1000, &plain, &mut segs, streaming)
                    .unwrap();
                let got: Vec<u8> = segs.iter().flat_map(|s| s.iter().copied()).collect();
                assert!(
                    got == want,
                    "{} sector {sector} streaming {streaming}",
                    b.name()
                );
            }
        }
    }
}

#[test]
fn scattered_encryption_refuses_a_partial_sector_or_a_length_mismatch() {
    for b in backends() {
        let mut x = build(b, &key(64, 1), 4096, 0);
        let plain = data(8192, 3);
        let (mut a, mut c) = (vec![0u8; 4096], vec![7u8; 4096]);
        let mut short = vec![0u8; 4095];
        let mut bad: Vec<&mut [u8]> = vec![&mut a, &mut short];
        assert!(matches!(
            x.encrypt_sectors_scattered(0, &plain[..8191], &mut bad, false),
            Err(Error::PartialSector { .. }) | Err(Error::LengthMismatch { .. })
        ));
        let mut one: Vec<&mut [u8]> = vec![&mut c];
        assert!(matches!(
            x.encrypt_sectors_scattered(0, &plain, &mut one, false),
            Err(Error::LengthMismatch { .. })
        ));
        assert!(
            c.iter().all(|&v| v == 7),
            "{}: nothing written on an error",
            b.name()
        );
    }
}
