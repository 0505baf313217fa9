//! `iopages luks`: make LUKS volumes, check a passphrase, and read a
//! volume's plaintext offline.
//!
//! Owns: the command line of the LUKS tools. Must never: overwrite a
//! non-empty file without `--yes`, or leave a half-written output behind
//! (a failed `decrypt` removes what it wrote).

use crate::passphrase::read_passphrase;
use iopages_crypt::luks::{self, FormatOptions, Hash, LuksVersion, Pbkdf};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Subcommand)]
pub enum LuksCommand {
    /// Make a LUKS volume (header and one key slot) that cryptsetup opens.
    Format(FormatArgs),
    /// Open a volume's header with a passphrase and describe it.
    Check {
        /// The LUKS image (file or block device).
        image: PathBuf,
        /// The passphrase: the file's exact bytes, or `-` for one line of
        /// standard input.
        #[arg(long, value_name = "FILE")]
        passphrase_file: PathBuf,
    },
    /// Decrypt a volume's whole payload into a raw file (offline, no
    /// server).
    Decrypt {
        /// The LUKS image (file or block device).
        image: PathBuf,
        /// Where the plaintext goes (must not exist, unless --yes).
        output: PathBuf,
        /// The passphrase: the file's exact bytes, or `-` for one line of
        /// standard input.
        #[arg(long, value_name = "FILE")]
        passphrase_file: PathBuf,
        /// Overwrite OUTPUT if it exists.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(clap::Args)]
pub struct FormatArgs {
    /// The image: a file (created if missing) or a block device.
    image: PathBuf,
    /// The passphrase: the file's exact bytes, or `-` for one line of
    /// standard input.
    #[arg(long, value_name = "FILE")]
    passphrase_file: PathBuf,
    /// Payload size: the file is made the header plus this many bytes; K,
    /// M, G suffixes. Without it the file's present size is used.
    #[arg(long, value_name = "BYTES", value_parser = crate::parse_size)]
    size: Option<u64>,
    /// LUKS version.
    #[arg(long = "type", value_enum, default_value_t = VersionArg::Luks2)]
    version: VersionArg,
    /// Key size in bits (aes-xts-plain64: 256 or 512).
    #[arg(long, value_name = "BITS", default_value_t = 512)]
    key_size: usize,
    /// Encryption sector size (4096 only with LUKS2).
    #[arg(long, value_name = "BYTES", default_value_t = 512)]
    sector_size: usize,
    /// Key derivation of the key slot (LUKS1: pbkdf2 only).
    #[arg(long, value_enum)]
    pbkdf: Option<PbkdfArg>,
    /// PBKDF2's hash (and LUKS1's hash spec).
    #[arg(long, value_enum, default_value_t = HashArg::Sha256)]
    hash: HashArg,
    /// PBKDF2 iterations, or Argon2 passes (time cost).
    #[arg(long, value_name = "N")]
    iterations: Option<u32>,
    /// Argon2 memory cost in KiB.
    #[arg(long, value_name = "KIB")]
    memory: Option<u32>,
    /// Argon2 lanes.
    #[arg(long, value_name = "N")]
    parallel: Option<u32>,
    /// A label (LUKS2).
    #[arg(long)]
    label: Option<String>,
    /// Overwrite an image that is not empty (its data is lost).
    #[arg(long)]
    yes: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum VersionArg {
    Luks1,
    Luks2,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum PbkdfArg {
    Pbkdf2,
    Argon2i,
    Argon2id,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum HashArg {
    Sha1,
    Sha256,
}

fn version_name(v: LuksVersion) -> &'static str {
    match v {
        LuksVersion::Luks1 => "LUKS1",
        LuksVersion::Luks2 => "LUKS2",
    }
}

pub fn run(cmd: LuksCommand) -> Result<(), String> {
    match cmd {
        LuksCommand::Format(a) => format(a),
        LuksCommand::Check {
            image,
            passphrase_file,
        } => {
            let pass = read_passphrase(&passphrase_file)?;
            let v =
                luks::open_path(&image, &pass).map_err(|e| format!("{}: {e}", image.display()))?;
            let dev = device_bytes(&image)?;
            println!(
                "{}: {} {}, {}-bit key, {}-byte sectors, payload {} bytes at offset {}, key slot {} opened{}, uuid {}",
                image.display(),
                version_name(v.version()),
                v.cipher_spec(),
                v.master_key().len() * 8,
                v.sector_size(),
                v.data_size_bytes(dev),
                v.data_offset_bytes(),
                v.keyslot(),
                if v.used_secondary_header() {
                    " (primary header damaged: the secondary copy was used)"
                } else {
                    ""
                },
                v.uuid()
            );
            Ok(())
        }
        LuksCommand::Decrypt {
            image,
            output,
            passphrase_file,
            yes,
        } => decrypt(&image, &output, &passphrase_file, yes),
    }
}

fn device_bytes(path: &Path) -> Result<u64, String> {
    let f =
        std::fs::File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    use std::io::Seek;
    let mut f = f;
    f.seek(std::io::SeekFrom::End(0))
        .map_err(|e| format!("cannot size {}: {e}", path.display()))
}

fn format(a: FormatArgs) -> Result<(), String> {
    let version = match a.version {
        VersionArg::Luks1 => LuksVersion::Luks1,
        VersionArg::Luks2 => LuksVersion::Luks2,
    };
    if a.key_size != 256 && a.key_size != 512 {
        return Err(format!(
            "--key-size {} is not one aes-xts-plain64 takes: 256 or 512",
            a.key_size
        ));
    }
    let pbkdf_kind = a.pbkdf.unwrap_or(match version {
        LuksVersion::Luks1 => PbkdfArg::Pbkdf2,
        LuksVersion::Luks2 => PbkdfArg::Argon2id,
    });
    let pbkdf = match pbkdf_kind {
        PbkdfArg::Pbkdf2 => Pbkdf::Pbkdf2 {
            hash: match a.hash {
                HashArg::Sha1 => Hash::Sha1,
                HashArg::Sha256 => Hash::Sha256,
            },
            iterations: a.iterations.unwrap_or(match Pbkdf::pbkdf2_default() {
                Pbkdf::Pbkdf2 { iterations, .. } => iterations,
                // Not reached: the PBKDF2 default is PBKDF2.
                _ => 600_000,
            }),
        },
        PbkdfArg::Argon2i | PbkdfArg::Argon2id => {
            let (t, m, p) = Pbkdf::argon2id_default()
                .argon2_params()
                .unwrap_or((4, 64 << 10, 4));
            let name = if pbkdf_kind == PbkdfArg::Argon2i {
                "argon2i"
            } else {
                "argon2id"
            };
            Pbkdf::argon2(
                name,
                a.iterations.unwrap_or(t),
                a.memory.unwrap_or(m),
                a.parallel.unwrap_or(p),
            )
            .ok_or_else(|| format!("{name} is not an Argon2 variant"))?
        }
    };
    let opts = FormatOptions {
        version,
        key_bytes: a.key_size / 8,
        sector_size: a.sector_size,
        pbkdf,
        label: a.label.clone(),
    };
    let pass = read_passphrase(&a.passphrase_file)?;
    let existing = std::fs::metadata(&a.image).ok();
    let is_file = existing.as_ref().is_none_or(|m| m.is_file());
    if let Some(m) = &existing {
        let non_empty = if m.is_file() { m.len() > 0 } else { true };
        if non_empty && !a.yes {
            return Err(format!(
                "{} is not empty: formatting destroys its data; add --yes to go ahead",
                a.image.display()
            ));
        }
    }
    let t0 = Instant::now();
    let vol = match a.size {
        Some(size) => {
            if !is_file {
                return Err("--size makes a file; leave it out for a block device".into());
            }
            // Room for any header, then the file is cut to header + size.
            let v = luks::format_path(&a.image, Some((32 << 20) + size), &pass, &opts)
                .map_err(|e| format!("{}: {e}", a.image.display()))?;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(&a.image)
                .map_err(|e| format!("cannot open {}: {e}", a.image.display()))?;
            f.set_len(v.data_offset_bytes() + size)
                .map_err(|e| format!("cannot size {}: {e}", a.image.display()))?;
            v
        }
        None => {
            if existing.is_none() {
                return Err(format!(
                    "{} does not exist: give --size to make it",
                    a.image.display()
                ));
            }
            luks::format_path(&a.image, None, &pass, &opts)
                .map_err(|e| format!("{}: {e}", a.image.display()))?
        }
    };
    let dev = device_bytes(&a.image)?;
    println!(
        "{}: {} {}, {}-bit key, {}-byte sectors, payload {} bytes at offset {}, uuid {} ({:.1} s)",
        a.image.display(),
        version_name(vol.version()),
        vol.cipher_spec(),
        vol.master_key().len() * 8,
        vol.sector_size(),
        vol.data_size_bytes(dev),
        vol.data_offset_bytes(),
        vol.uuid(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn decrypt(image: &Path, output: &Path, passphrase_file: &Path, yes: bool) -> Result<(), String> {
    let pass = read_passphrase(passphrase_file)?;
    let src =
        std::fs::File::open(image).map_err(|e| format!("cannot open {}: {e}", image.display()))?;
    let vol = luks::open(&src, &pass).map_err(|e| format!("{}: {e}", image.display()))?;
    let dev = device_bytes(image)?;
    let ss = vol.sector_size() as u64;
    let size = vol.data_size_bytes(dev) / ss * ss;
    let mut cipher = vol
        .xts_cipher()
        .map_err(|e| format!("cannot set up {}: {e}", vol.cipher_spec()))?;
    if output.exists() && !yes {
        return Err(format!(
            "{} exists: add --yes to overwrite it",
            output.display()
        ));
    }
    let out = std::fs::File::create(output)
        .map_err(|e| format!("cannot create {}: {e}", output.display()))?;
    let result = (|| -> Result<(), String> {
        let mut buf = vec![0u8; 1 << 20];
        let mut at = 0u64;
        let t0 = Instant::now();
        let mut last = t0;
        while at < size {
            let n = ((size - at) as usize).min(buf.len());
            let b = &mut buf[..n];
            src.read_exact_at(b, vol.data_offset_bytes() + at)
                .map_err(|e| {
                    format!(
                        "reading {} at {}: {e}",
                        image.display(),
                        vol.data_offset_bytes() + at
                    )
                })?;
            cipher
                .decrypt_sectors_in_place(at / ss, b)
                .map_err(|e| format!("decrypting at {at}: {e}"))?;
            out.write_all_at(b, at)
                .map_err(|e| format!("writing {}: {e}", output.display()))?;
            at += n as u64;
            if last.elapsed().as_secs() >= 1 {
                last = Instant::now();
                eprint!("\rdecrypted {} of {} MiB", at >> 20, size >> 20);
                let _ = std::io::stderr().flush();
            }
        }
        out.sync_all()
            .map_err(|e| format!("syncing {}: {e}", output.display()))?;
        if t0.elapsed().as_secs() >= 1 {
            eprintln!();
        }
        Ok(())
    })();
    if let Err(e) = result {
        drop(out);
        let _ = std::fs::remove_file(output);
        return Err(format!("{e} ({} removed)", output.display()));
    }
    println!(
        "{}: {} bytes of plaintext from {} ({})",
        output.display(),
        size,
        image.display(),
        version_name(vol.version())
    );
    Ok(())
}
