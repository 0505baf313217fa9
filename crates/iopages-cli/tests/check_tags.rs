//! `luks check` and `luks decrypt` on an authenticated volume: written
//! through `iopages serve`, then checked offline — every block and the
//! tree verified against the freshness state file; one flipped bit in the
//! image makes both commands fail naming the block, and `decrypt` leaves
//! nothing behind.

mod common;

use common::{run, serve_cmd, succeeded, Dir, Served, BIN};
use iopages_testkit::nbd_client::{Client, CMD_FLUSH};
use std::process::Command;

const MIB: usize = 1 << 20;

/// An authenticated image (48 MiB), its passphrase file and state file.
fn format(dir: &Dir, mac: &str) -> (std::path::PathBuf, std::path::PathBuf, std::path::PathBuf) {
    let pass = dir.join("pass");
    std::fs::write(&pass, b"check-tags").unwrap();
    let (img, state, _) = common::luks2_auth_image(dir, "a", "48M", &pass, mac);
    (img, pass, state)
}

fn luks(
    verb: &str,
    img: &std::path::Path,
    pass: &std::path::Path,
    state: &std::path::Path,
) -> Command {
    let mut c = Command::new(BIN);
    c.args(["luks", verb])
        .arg(img)
        .arg("--passphrase-file")
        .arg(pass)
        .arg("--freshness")
        .arg(state);
    c
}

#[test]
fn check_and_decrypt_verify_every_block_and_refuse_a_flipped_one() {
    let dir = Dir::new("check-tags");
    let (img, pass, state) = format(&dir, "hmac-sha256");
    let sock = dir.join("s.sock");
    let mut cmd = serve_cmd();
    cmd.args(["--arena", "64M", "--image"])
        .arg(&img)
        .arg("--passphrase-file")
        .arg(&pass);
    cmd.arg("--freshness").arg(&state).arg("--unix").arg(&sock);
    let srv = Served::spawn(cmd, dir.join("serve.err"), |_| {});
    let data: Vec<u8> = (0..2 * MIB).map(|i| (i * 7 + i / 4096) as u8).collect();
    let mut c = Client::unix(&sock);
    c.go("iopages", &[]).expect("NBD_OPT_GO");
    assert_eq!(c.write(MIB as u64, &data, 0), 0, "write");
    assert_eq!(c.command(CMD_FLUSH, 0, 0, 0), 0, "flush");
    c.disconnect();
    srv.stop();

    let out = luks("check", &img, &pass, &state).output().unwrap();
    let text = succeeded(&luks("check", &img, &pass, &state), &out);
    assert!(text.contains("blocks and the tag tree verified"), "{text}");

    let plain = dir.join("plain");
    let mut d = luks("decrypt", &img, &pass, &state);
    d.arg(&plain);
    run(&mut d);
    let got = std::fs::read(&plain).unwrap();
    assert_eq!(&got[MIB..3 * MIB], &data[..]);
    assert!(
        got[..MIB].iter().all(|&b| b == 0),
        "never-written blocks read as zeros"
    );
    std::fs::remove_file(&plain).unwrap();

    // Flip one bit of block 300's ciphertext (data offset 16 MiB).
    let at = (16 * MIB + 300 * 4096 + 9) as u64;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&img)
        .unwrap();
    let mut b = [0u8; 1];
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, at).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[b[0] ^ 0x20], at).unwrap();
    drop(f);
    let out = luks("check", &img, &pass, &state).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a flipped block passed the check");
    assert!(err.contains("1 of") && err.contains(": 300 "), "{err}");
    let mut d = luks("decrypt", &img, &pass, &state);
    let out = d.arg(&plain).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("refusing to decrypt"),
        "{err}"
    );
    assert!(
        !plain.exists(),
        "decrypt left a tampered volume's plaintext behind"
    );
}

/// The LUKS header is not authenticated (its checksums are not keyed): a
/// store could strip an authenticated volume's requirement and token and
/// present it as a plain volume. The state file says it is authenticated:
/// serving a plain volume with one is refused, so that downgrade fails.
#[test]
fn a_plain_volume_served_with_a_freshness_state_file_is_refused() {
    let dir = Dir::new("downgrade");
    let (img, pass) = common::luks2_image(&dir, "plain", "24M", b"downgrade");
    let state = dir.join("state.fresh");
    std::fs::write(&state, b"anything").unwrap();
    let out = serve_cmd()
        .args(["--arena", "64M", "--image"])
        .arg(&img)
        .arg("--passphrase-file")
        .arg(&pass)
        .arg("--freshness")
        .arg(&state)
        .arg("--unix")
        .arg(dir.join("s.sock"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "served: {err}");
    assert!(err.contains("not authenticated"), "{err}");
}
