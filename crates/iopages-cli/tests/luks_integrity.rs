//! `iopages luks format --integrity`: an authenticated volume made from
//! the command line — what it prints, the freshness state file
//! `--freshness` writes (the anchor of the empty tree the area's
//! superblock names), what `check` and `dump` say of it, and every
//! refusal made before anything is written (an existing state file,
//! LUKS1, a 512-byte sector, `--freshness` alone).

mod common;

use common::{run, Dir, BIN};
use iopages_crypt::integrity::{state, Keys, Mac, StateFile};
use iopages_crypt::luks;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Stdio};

/// `iopages luks format IMAGE` with a cheap fixed KDF and `args`.
fn format_cmd(img: &Path, pass: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.args(["luks", "format"])
        .arg(img)
        .arg("--passphrase-file")
        .arg(pass)
        .args(["--pbkdf", "pbkdf2", "--iterations", "1000"])
        .args(args)
        .stdin(Stdio::null());
    c
}

/// `cmd` must fail; its stderr.
fn fails(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(!out.status.success(), "{cmd:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The state file `fresh` holds the anchor the superblock of `vol`'s
/// integrity area (in `img`) names: epoch 0, the empty tree, clean.
fn state_file_is_the_superblocks_anchor(fresh: &Path, img: &Path, vol: &luks::LuksVolume) {
    let i = vol.integrity().unwrap();
    let mac = i.mac();
    let st = StateFile::load(fresh).unwrap().expect("a state file");
    assert!(st.clean);
    assert!(st.anchor.root.is_empty(), "the empty tree");
    assert_eq!(st.anchor.epoch, 0);
    assert_eq!(st.anchor.mac, mac);
    assert_eq!(st.anchor.data_blocks, i.layout.data_blocks());
    assert_eq!(st.anchor.volume, state::volume_id(vol.uuid()));
    let mut sb = vec![0u8; 4096];
    let f = std::fs::File::open(img).unwrap();
    f.read_exact_at(&mut sb, i.area_offset).unwrap();
    let keys = Keys::derive(mac, vol.master_key()).unwrap();
    assert_eq!(state::decode_superblock(&sb, &keys), Some(st.anchor));
}

#[test]
fn format_integrity_writes_the_volume_and_its_freshness_state() {
    let dir = Dir::new("integrity-format");
    let pass = dir.join("pass");
    std::fs::write(&pass, b"pw").unwrap();
    for (mac, name) in [(Mac::HmacSha256, "hmac-sha256"), (Mac::Gmac, "aead")] {
        let img = dir.join(&format!("{name}.img"));
        let fresh = dir.join(&format!("{name}.fresh"));
        let fresh_arg = fresh.to_str().unwrap();
        let out = run(&mut format_cmd(
            &img,
            &pass,
            &[
                "--size",
                "4M",
                "--integrity",
                name,
                "--freshness",
                fresh_arg,
            ],
        ));
        assert_eq!(
            std::fs::metadata(&img).unwrap().len(),
            (16 << 20) + (4 << 20)
        );
        let vol = luks::open_path(&img, b"pw").unwrap();
        let i = vol.integrity().expect("an authenticated volume").clone();
        assert_eq!(i.mac(), mac);
        assert_eq!(vol.sector_size(), 4096);
        let said = format!(
            "integrity: {name} tags, data {} bytes ({} blocks of 4096), integrity area {} bytes \
             at offset {}, freshness state in {fresh_arg}",
            i.layout.data_bytes(),
            i.layout.data_blocks(),
            i.area_bytes(),
            i.area_offset
        );
        assert!(out.contains(&said), "{said:?} not in:\n{out}");
        state_file_is_the_superblocks_anchor(&fresh, &img, &vol);
        // check and dump say what it is.
        let check = run(Command::new(BIN)
            .args(["luks", "check", "--passphrase-file"])
            .arg(&pass)
            .arg(&img));
        assert!(
            check.contains(&format!("authenticated ({name} tags")),
            "{check}"
        );
        let dump = run(Command::new(BIN).args(["luks", "dump"]).arg(&img));
        assert!(
            dump.contains("Requirements:   iopages-integrity-v1"),
            "{dump}"
        );
        assert!(dump.contains("0: iopages-integrity"), "{dump}");
    }
    // Without --freshness: the volume, and no state file anywhere.
    let img = dir.join("nofresh.img");
    let out = run(&mut format_cmd(
        &img,
        &pass,
        &["--size", "1M", "--integrity", "aead"],
    ));
    assert!(out.contains("integrity: aead tags"), "{out}");
    assert!(!out.contains("freshness"), "{out}");
    assert!(luks::open_path(&img, b"pw").unwrap().integrity().is_some());
}

#[test]
fn format_integrity_refusals_write_nothing() {
    let dir = Dir::new("integrity-refused");
    let pass = dir.join("pass");
    std::fs::write(&pass, b"pw").unwrap();
    let img = dir.join("v.img");
    let fresh = dir.join("taken.fresh");
    std::fs::write(&fresh, b"another volume's state").unwrap();
    let f = fresh.to_str().unwrap();
    let cases: [(&[&str], &str); 4] = [
        (
            &["--integrity", "hmac-sha256", "--freshness", f],
            "the file exists",
        ),
        (
            &["--integrity", "aead", "--type", "luks1"],
            "--integrity needs LUKS2",
        ),
        (
            &["--integrity", "aead", "--sector-size", "512"],
            "--sector-size 512 with --integrity",
        ),
        (&["--freshness", f], "--integrity"),
    ];
    for (args, words) in cases {
        let mut all = vec!["--size", "4M"];
        all.extend_from_slice(args);
        let err = fails(&mut format_cmd(&img, &pass, &all));
        assert!(err.contains(words), "{args:?}: {words:?} not in: {err}");
        assert!(!img.exists(), "{args:?}: the image was made");
    }
    // An existing image taken over with --yes: untouched when the state
    // file exists.
    std::fs::write(&img, vec![0x5a; 1 << 20]).unwrap();
    let err = fails(&mut format_cmd(
        &img,
        &pass,
        &["--yes", "--integrity", "aead", "--freshness", f],
    ));
    assert!(err.contains("the file exists"), "{err}");
    assert_eq!(std::fs::read(&img).unwrap(), vec![0x5a; 1 << 20]);
    assert_eq!(std::fs::read(&fresh).unwrap(), b"another volume's state");
    // --sector-size 4096 is what --integrity takes anyway.
    run(&mut format_cmd(
        &dir.join("s4k.img"),
        &pass,
        &[
            "--size",
            "1M",
            "--integrity",
            "aead",
            "--sector-size",
            "4096",
        ],
    ));
}
