//! `iopages serve --config FILE`: one service, several encrypted volumes
//! behind one port, described in a TOML file (see `contrib/iopages.toml`).
//!
//! Owns: reading the file (at most [`MAX_CONFIG_BYTES`]), turning it into
//! typed settings and refusing everything wrong in it with the file, line
//! and column, and the export it concerns. Must never: open an image, read
//! a passphrase or touch the network — that is `serve`'s work once the
//! whole file is known to be good. The file is all or nothing: `strict`
//! governs what happens when an export fails to open or unlock, not errors
//! in the file itself.

use crate::defaults::DEFAULT_ARENA_BYTES;
use iopages_nbd::{AllowRule, RateLimit};
use serde::de::{self, Visitor};
use serde::Deserialize;
use std::ffi::OsStr;
use std::fmt;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use toml::de::{DeTable, DeValue, ValueDeserializer};

/// Largest configuration file read (1 MiB): far more than 256 exports
/// need, small enough that a wrong path (a disk image) fails at once.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Most exports one file may describe.
pub const MAX_EXPORTS: usize = 256;

/// Longest export name (the NBD protocol's limit), in bytes.
pub const MAX_NAME_BYTES: usize = 4096;

/// Largest `max-kdf-memory` (4 GiB), as `--max-kdf-memory`.
pub const MAX_KDF_MEMORY_BYTES: u64 = 4 << 30;

/// Where the server listens when the file names neither `listen` nor
/// `unix` (as `serve` without `--listen`).
pub const DEFAULT_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 10809);

/// The whole file: the server's settings and the volumes it exports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeConfig {
    /// `[server]`, defaults where the file leaves it out.
    pub server: ServerSection,
    /// Every `[[export]]`, in file order; at least one, at most
    /// [`MAX_EXPORTS`], names unique.
    pub exports: Vec<ExportSpec>,
}

/// `[server]`: where to listen and how exports come up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerSection {
    /// TCP addresses (`listen`). [`DEFAULT_LISTEN`] when neither `listen`
    /// nor `unix` is given.
    pub listen: Vec<SocketAddr>,
    /// Unix socket paths (`unix`).
    pub unix: Vec<PathBuf>,
    /// When volumes are unlocked (`unlock`, default `"start"`).
    pub unlock: Unlock,
    /// `strict`: true, any export that fails to open stops the server from
    /// starting; false (default), it is reported by name and the others
    /// serve.
    pub strict: bool,
    /// Prometheus endpoint address (`metrics`), if any.
    pub metrics: Option<SocketAddr>,
    /// `max-handshakes`: connections in the handshake at once.
    pub max_handshakes: Option<usize>,
    /// `peer-min-connections`: the floor of each peer's share of
    /// connections.
    pub peer_min_connections: Option<usize>,
    /// `peer-min-inflight`: the floor of each peer's share of bytes in
    /// flight.
    pub peer_min_inflight: Option<u64>,
}

impl Default for ServerSection {
    fn default() -> Self {
        ServerSection {
            listen: vec![DEFAULT_LISTEN],
            unix: Vec::new(),
            unlock: Unlock::Start,
            strict: false,
            metrics: None,
            max_handshakes: None,
            peer_min_connections: None,
            peer_min_inflight: None,
        }
    }
}

/// When the volumes' key slots are opened (`unlock`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Unlock {
    /// `"start"`: every volume at start, one after another.
    #[default]
    Start,
    /// `"lazy"`: on the first connection that asks for the export.
    Lazy,
}

/// How an image is read and written (`io`), as `serve --io`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IoMode {
    /// O_DIRECT where the file system takes it, buffered otherwise.
    #[default]
    Auto,
    /// O_DIRECT or fail.
    Direct,
    /// Through the page cache.
    Buffered,
}

/// Where an export's LUKS image lives (`image`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ImageSpec {
    /// A file or block device (a relative path is kept as written:
    /// relative to the working directory).
    Path(PathBuf),
    /// A remote store, `nbd://host[:port]/export` or
    /// `nbd+unix:///export?socket=PATH` (`nbds://`, `nbds+unix://`: over
    /// TLS, with `tls-*` query parameters), kept as written (only the
    /// scheme has been checked).
    Nbd(String),
}

/// Where an export's passphrase comes from: exactly one per export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PassphraseSource {
    /// `passphrase-file`: the file's exact bytes (as `--passphrase-file`).
    File(PathBuf),
    /// `passphrase-credential`: a systemd credential name (checked by
    /// [`check_credential_name`]); [`read_credential`] gives its path.
    Credential(String),
    /// `passphrase-prompt = true`: one line of standard input at start
    /// (only with `unlock = "start"`).
    Prompt,
}

/// One `[[export]]`: an encrypted volume and how it is served.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSpec {
    /// The name clients ask for: unique, 1..=4096 bytes, no NUL.
    pub name: String,
    /// The LUKS1 or LUKS2 image.
    pub image: ImageSpec,
    /// The passphrase's source.
    pub passphrase: PassphraseSource,
    /// Shown to clients that ask (`description`).
    pub description: Option<String>,
    /// `read-only` (default false).
    pub read_only: bool,
    /// `io` (default auto).
    pub io: IoMode,
    /// `allow-discards` (default false), as `--allow-discards`.
    pub allow_discards: bool,
    /// `freshness`: an authenticated image's state file, as
    /// `--freshness`.
    pub freshness: Option<PathBuf>,
    /// `arena` in bytes: a non-zero multiple of 4096 (default
    /// [`DEFAULT_ARENA_BYTES`]).
    pub arena_bytes: u64,
    /// `workers`: crypt worker threads, at least 1 (default: per core; 64
    /// for a remote image).
    pub workers: Option<usize>,
    /// `max-kdf-memory` in bytes, at most 4 GiB (default: the KDF limits'
    /// own, 1 GiB).
    pub max_kdf_memory: Option<u64>,
    /// `inline-max` in bytes; 0: never inline (default: as `serve`).
    pub inline_max: Option<u32>,
    /// `allow`: who may use it (empty: anyone the server admits).
    pub allow: Vec<AllowRule>,
    /// `rate-bytes`, `rate-requests`: its rate limits.
    pub rate: RateLimit,
    /// `reconnect-delay` in whole seconds, for a remote image: how long
    /// requests wait for its store to come back (default: the URI's
    /// `reconnect-delay=`, else 10 s).
    pub reconnect_delay: Option<std::time::Duration>,
    /// 1-based line of the export's `[[export]]` header, for messages.
    pub line: usize,
}

/// Something wrong with a configuration file, where it is.
///
/// Displays as `path:line:col: message`, `path:line: message` or
/// `path: message`, as much as is known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The file.
    pub path: PathBuf,
    /// 1-based line; `None` for the file as a whole (unreadable, too
    /// large, no export).
    pub line: Option<usize>,
    /// 1-based column (in characters), where known.
    pub column: Option<usize>,
    /// What is wrong, naming the export (`export "vm2": ...`) where one is
    /// concerned.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.path.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(col) = self.column {
                write!(f, ":{col}")?;
            }
        }
        write!(f, ": {}", self.message)
    }
}

impl std::error::Error for ConfigError {}

/// Reads and checks the configuration file at `path`.
///
/// **Context:** refuses a file over [`MAX_CONFIG_BYTES`] without reading
/// more than one byte past it, and a file that is not UTF-8.
///
/// **Returns:** the settings, or the first error (I/O errors name the
/// path).
pub fn load(path: &Path) -> Result<ServeConfig, ConfigError> {
    let whole = |message: String| ConfigError {
        path: path.to_path_buf(),
        line: None,
        column: None,
        message,
    };
    let file = std::fs::File::open(path).map_err(|e| whole(format!("cannot open: {e}")))?;
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| whole(format!("cannot read: {e}")))?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(too_large(path));
    }
    let text = match String::from_utf8(bytes) {
        Ok(t) => t,
        Err(e) => {
            let good = e.utf8_error().valid_up_to();
            // The text before the bad byte is valid: count lines in it.
            let before = std::str::from_utf8(&e.as_bytes()[..good]).unwrap_or("");
            let (line, column) = line_col(before, good);
            return Err(ConfigError {
                path: path.to_path_buf(),
                line: Some(line),
                column: Some(column),
                message: "not UTF-8 text".into(),
            });
        }
    };
    parse(&text, path)
}

fn too_large(path: &Path) -> ConfigError {
    ConfigError {
        path: path.to_path_buf(),
        line: None,
        column: None,
        message: format!("larger than {MAX_CONFIG_BYTES} bytes (1 MiB): not a configuration file?"),
    }
}

/// Checks the TOML `text` of a configuration file; `path` only names the
/// file in errors.
///
/// **Context:** pure: reads no file, passphrase or environment.
///
/// **Returns:** the settings with defaults filled in, or the first error
/// with its line: the key's or value's for what TOML and the types catch
/// (syntax, unknown keys, wrong types), the `[[export]]` header's for the
/// checks across keys (names, passphrase sources, sizes, images).
pub fn parse(text: &str, path: &Path) -> Result<ServeConfig, ConfigError> {
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(too_large(path));
    }
    let loc = Locator { text, path };
    let root = DeTable::parse(text).map_err(|e| loc.at(e.span(), e.message().to_string()))?;
    let (server_value, export_value) = top_level(root.get_ref(), &loc)?;
    let server = match server_value {
        None => ServerSection::default(),
        Some(v) => server_section(v, &loc)?,
    };
    let exports = export_list(export_value, &loc, server.unlock)?;
    Ok(ServeConfig { server, exports })
}

/// A value of the file with its span.
type Item<'i> = toml::Spanned<DeValue<'i>>;

/// The file being parsed, to place errors in it.
struct Locator<'a> {
    text: &'a str,
    path: &'a Path,
}

impl Locator<'_> {
    /// `message` at the line and column where `span` starts (none without
    /// a span).
    fn at(&self, span: Option<std::ops::Range<usize>>, message: String) -> ConfigError {
        let (line, column) = match span {
            Some(s) => {
                let (l, c) = line_col(self.text, s.start);
                (Some(l), Some(c))
            }
            None => (None, None),
        };
        ConfigError {
            path: self.path.to_path_buf(),
            line,
            column,
            message,
        }
    }
}

/// The top level's `[server]` and `export` values, each if present; any
/// other key is an error.
fn top_level<'t, 'i>(
    root: &'t DeTable<'i>,
    loc: &Locator<'_>,
) -> Result<(Option<&'t Item<'i>>, Option<&'t Item<'i>>), ConfigError> {
    let mut server_value = None;
    let mut export_value = None;
    for (k, v) in root.iter() {
        match k.get_ref().as_ref() {
            "server" => server_value = Some(v),
            "export" => export_value = Some(v),
            other => {
                return Err(loc.at(
                    Some(k.span()),
                    format!("unknown key {other:?} (expected [server] or [[export]])"),
                ))
            }
        }
    }
    Ok((server_value, export_value))
}

/// `[server]`: its keys, then the checks across them.
fn server_section(v: &Item<'_>, loc: &Locator<'_>) -> Result<ServerSection, ConfigError> {
    let Some(table) = v.get_ref().as_table() else {
        return Err(loc.at(Some(v.span()), "[server] must be a table".into()));
    };
    let raw = RawServer::deserialize(ValueDeserializer::from(v.clone()))
        .map_err(|e| loc.at(e.span(), format!("[server]: {}", serde_message(&e, table))))?;
    raw.into_section()
        .map_err(|m| loc.at(Some(v.span()), format!("[server]: {m}")))
}

/// Every `[[export]]`: at least one, at most [`MAX_EXPORTS`], names
/// unique; each checked for the server's `unlock`.
fn export_list(
    export_value: Option<&Item<'_>>,
    loc: &Locator<'_>,
    unlock: Unlock,
) -> Result<Vec<ExportSpec>, ConfigError> {
    let Some(export_value) = export_value else {
        return Err(loc.at(
            None,
            "no [[export]]: describe at least one volume to serve".into(),
        ));
    };
    let Some(elements) = export_value.get_ref().as_array() else {
        return Err(loc.at(
            Some(export_value.span()),
            "`export` must be an array of tables: write [[export]], not [export]".into(),
        ));
    };
    if elements.is_empty() {
        return Err(loc.at(
            Some(export_value.span()),
            "no [[export]]: describe at least one volume to serve".into(),
        ));
    }
    let mut exports: Vec<ExportSpec> = Vec::with_capacity(elements.len().min(MAX_EXPORTS));
    for (i, element) in elements.iter().enumerate() {
        let (who, spec) = export_spec(i, element, loc, unlock)?;
        if let Some(first) = exports.iter().find(|x| x.name == spec.name) {
            return Err(loc.at(
                Some(element.span()),
                format!(
                    "{who}: name already used by the export at line {}",
                    first.line
                ),
            ));
        }
        exports.push(spec);
    }
    Ok(exports)
}

/// The `i`th `[[export]]` (from 0), and how errors name it: `export
/// "NAME"`, or `export #N` before its name is known.
fn export_spec(
    i: usize,
    element: &Item<'_>,
    loc: &Locator<'_>,
    unlock: Unlock,
) -> Result<(String, ExportSpec), ConfigError> {
    let header = element.span();
    let Some(table) = element.get_ref().as_table() else {
        return Err(loc.at(Some(header), format!("export #{}: must be a table", i + 1)));
    };
    let who = match table.get("name").and_then(|n| n.get_ref().as_str()) {
        Some(name) => format!("export {}", shown_name(name)),
        None => format!("export #{}", i + 1),
    };
    if i == MAX_EXPORTS {
        return Err(loc.at(
            Some(header),
            format!("{who}: more than {MAX_EXPORTS} exports in one file"),
        ));
    }
    let raw = RawExport::deserialize(ValueDeserializer::from(element.clone()))
        .map_err(|e| loc.at(e.span(), format!("{who}: {}", serde_message(&e, table))))?;
    let (line, _) = line_col(loc.text, header.start);
    let spec = raw
        .check(line, unlock)
        .map_err(|m| loc.at(Some(header), format!("{who}: {m}")))?;
    Ok((who, spec))
}

/// The file for the systemd credential `name`:
/// `$CREDENTIALS_DIRECTORY/name`.
///
/// **Context:** reads the environment, not the file; systemd sets the
/// variable for a unit with `LoadCredential=` or `SetCredential=`.
///
/// **Returns:** the path to read the passphrase from (exact bytes, as a
/// passphrase file), or why not: a name that could leave the directory, or
/// the variable unset.
pub fn read_credential(name: &str) -> Result<PathBuf, String> {
    credential_path(std::env::var_os("CREDENTIALS_DIRECTORY").as_deref(), name)
}

fn credential_path(dir: Option<&OsStr>, name: &str) -> Result<PathBuf, String> {
    check_credential_name(name)?;
    match dir {
        Some(d) if !d.is_empty() => Ok(Path::new(d).join(name)),
        _ => Err(format!(
            "passphrase-credential {name:?}: $CREDENTIALS_DIRECTORY is not set (run under \
             systemd with LoadCredential={name}:PATH, or use passphrase-file)"
        )),
    }
}

/// Whether `name` can be a credential's file name: not empty, no `/`, no
/// `..`, no NUL.
///
/// **Returns:** `Ok(())`, or the reason.
pub fn check_credential_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name == "." || name.contains('/') || name.contains("..") {
        return Err(format!(
            "passphrase-credential {name:?} is not a credential name (one file name: no `/`, \
             no `..`)"
        ));
    }
    if name.contains('\0') {
        return Err("passphrase-credential contains a NUL byte".into());
    }
    Ok(())
}

/// 1-based line and column (in characters) of byte `offset` in `text`.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let before = &text[..offset];
    let line = before.bytes().filter(|&b| b == b'\n').count() + 1;
    let start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[start..].chars().count() + 1)
}

/// A name for messages: quoted and escaped, cut after 64 characters.
fn shown_name(name: &str) -> String {
    const SHOWN: usize = 64;
    if name.chars().count() <= SHOWN {
        format!("{name:?}")
    } else {
        let cut: String = name.chars().take(SHOWN).collect();
        format!("{cut:?}…")
    }
}

/// A deserialization error in the file's words: keys rather than fields,
/// and the key a wrong value belongs to.
fn serde_message(e: &toml::de::Error, table: &DeTable<'_>) -> String {
    let msg = e.message();
    if let Some(rest) = msg.strip_prefix("unknown field `") {
        if let Some((key, expected)) = rest.split_once("`, expected ") {
            return format!(
                "unknown key {key:?} (expected {})",
                expected.replace('`', "")
            );
        }
    }
    if let Some(rest) = msg.strip_prefix("missing field `") {
        return format!("missing key {:?}", rest.trim_end_matches('`'));
    }
    let msg = match msg.strip_prefix("unknown variant `") {
        Some(rest) => match rest.split_once("`, expected ") {
            Some((v, expected)) => {
                format!(
                    "unknown value {v:?} (expected {})",
                    expected.replace('`', "\"")
                )
            }
            None => msg.to_string(),
        },
        None => msg.to_string(),
    };
    // Name the key whose value the error is in.
    if let Some(span) = e.span() {
        for (k, v) in table.iter() {
            let vs = v.span();
            if vs.start <= span.start && span.start < vs.end.max(vs.start + 1) {
                return format!("{}: {msg}", k.get_ref());
            }
        }
    }
    msg
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawServer {
    #[serde(default)]
    listen: Vec<SocketAddr>,
    #[serde(default)]
    unix: Vec<PathBuf>,
    #[serde(default)]
    unlock: Unlock,
    #[serde(default)]
    strict: bool,
    metrics: Option<SocketAddr>,
    max_handshakes: Option<usize>,
    peer_min_connections: Option<usize>,
    peer_min_inflight: Option<SizeText>,
}

impl RawServer {
    fn into_section(self) -> Result<ServerSection, String> {
        let listen = if self.listen.is_empty() && self.unix.is_empty() {
            vec![DEFAULT_LISTEN]
        } else {
            self.listen
        };
        if self.max_handshakes == Some(0) || self.peer_min_connections == Some(0) {
            return Err("max-handshakes and peer-min-connections must be at least 1".into());
        }
        let peer_min_inflight = match &self.peer_min_inflight {
            Some(s) => Some(size("peer-min-inflight", s)?),
            None => None,
        };
        Ok(ServerSection {
            listen,
            unix: self.unix,
            unlock: self.unlock,
            strict: self.strict,
            metrics: self.metrics,
            max_handshakes: self.max_handshakes,
            peer_min_connections: self.peer_min_connections,
            peer_min_inflight,
        })
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawExport {
    name: String,
    image: String,
    passphrase_file: Option<PathBuf>,
    passphrase_credential: Option<String>,
    passphrase_prompt: Option<bool>,
    description: Option<String>,
    #[serde(default)]
    read_only: bool,
    #[serde(default)]
    io: IoMode,
    #[serde(default)]
    allow_discards: bool,
    freshness: Option<PathBuf>,
    arena: Option<SizeText>,
    workers: Option<usize>,
    max_kdf_memory: Option<SizeText>,
    inline_max: Option<SizeText>,
    #[serde(default)]
    allow: Vec<String>,
    rate_bytes: Option<SizeText>,
    rate_requests: Option<u64>,
    reconnect_delay: Option<u64>,
}

impl RawExport {
    /// The checks across keys; the error names the key, the caller the
    /// export and the line.
    fn check(self, line: usize, unlock: Unlock) -> Result<ExportSpec, String> {
        check_name(&self.name)?;
        let image = image_spec(&self.image)?;
        let passphrase = self.passphrase(unlock)?;
        if self.workers == Some(0) {
            return Err("workers must be at least 1".into());
        }
        let arena_bytes = match &self.arena {
            Some(s) => size("arena", s)?,
            None => DEFAULT_ARENA_BYTES,
        };
        let max_kdf_memory = match &self.max_kdf_memory {
            Some(s) => {
                let b = size("max-kdf-memory", s)?;
                if b > MAX_KDF_MEMORY_BYTES {
                    return Err(format!(
                        "max-kdf-memory {}: at most 4G ({MAX_KDF_MEMORY_BYTES} bytes)",
                        s.0
                    ));
                }
                Some(b)
            }
            None => None,
        };
        let inline_max = match &self.inline_max {
            Some(s) if s.0.trim() == "0" => Some(0),
            Some(s) => {
                let b = size("inline-max", s)?;
                Some(
                    u32::try_from(b)
                        .map_err(|_| format!("inline-max {}: larger than a request can be", s.0))?,
                )
            }
            None => None,
        };
        let allow = self
            .allow
            .iter()
            .map(|r| r.parse::<AllowRule>())
            .collect::<Result<Vec<_>, _>>()?;
        let rate = self.rate()?;
        let reconnect_delay = self.reconnect_delay(&image)?;
        Ok(ExportSpec {
            allow,
            rate,
            reconnect_delay,
            name: self.name,
            image,
            passphrase,
            description: self.description,
            read_only: self.read_only,
            io: self.io,
            allow_discards: self.allow_discards,
            freshness: self.freshness,
            arena_bytes,
            workers: self.workers,
            max_kdf_memory,
            inline_max,
            line,
        })
    }

    /// `rate-bytes` and `rate-requests`, each at least 1 when given.
    fn rate(&self) -> Result<RateLimit, String> {
        let rate = RateLimit {
            bytes_per_second: match &self.rate_bytes {
                Some(s) => Some(size("rate-bytes", s)?),
                None => None,
            },
            requests_per_second: self.rate_requests,
        };
        if rate.bytes_per_second == Some(0) || rate.requests_per_second == Some(0) {
            return Err(
                "rate-bytes and rate-requests must be at least 1 (leave them out for no limit)"
                    .into(),
            );
        }
        Ok(rate)
    }

    /// `reconnect-delay`, only for a remote image.
    fn reconnect_delay(&self, image: &ImageSpec) -> Result<Option<std::time::Duration>, String> {
        Ok(match self.reconnect_delay {
            None => None,
            Some(_) if !matches!(image, ImageSpec::Nbd(_)) => {
                return Err("reconnect-delay is for an image on a remote store (nbd://…)".into())
            }
            Some(n) => Some(
                iopages_nbd::remote::parse_reconnect_delay(&n.to_string())
                    .map_err(|e| e.replace("=", " "))?,
            ),
        })
    }

    fn passphrase(&self, unlock: Unlock) -> Result<PassphraseSource, String> {
        let prompt = self.passphrase_prompt == Some(true);
        let given: Vec<&str> = [
            ("passphrase-file", self.passphrase_file.is_some()),
            (
                "passphrase-credential",
                self.passphrase_credential.is_some(),
            ),
            ("passphrase-prompt", prompt),
        ]
        .iter()
        .filter(|(_, set)| *set)
        .map(|(k, _)| *k)
        .collect();
        if given.len() > 1 {
            return Err(format!(
                "more than one passphrase source ({}): give exactly one",
                given.join(", ")
            ));
        }
        if let Some(p) = &self.passphrase_file {
            if p.as_os_str().is_empty() {
                return Err("passphrase-file is empty".into());
            }
            return Ok(PassphraseSource::File(p.clone()));
        }
        if let Some(c) = &self.passphrase_credential {
            check_credential_name(c)?;
            return Ok(PassphraseSource::Credential(c.clone()));
        }
        if prompt {
            if unlock == Unlock::Lazy {
                return Err(
                    "passphrase-prompt needs unlock = \"start\" (standard input is read once, \
                     at start): use passphrase-file or passphrase-credential with unlock = \
                     \"lazy\""
                        .into(),
                );
            }
            return Ok(PassphraseSource::Prompt);
        }
        Err(
            "no passphrase source: give one of passphrase-file, passphrase-credential or \
             passphrase-prompt = true"
                .into(),
        )
    }
}

fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("name is empty".into());
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(format!(
            "name is {} bytes long, at most {MAX_NAME_BYTES}",
            name.len()
        ));
    }
    if name.contains('\0') {
        return Err("name contains a NUL byte".into());
    }
    Ok(())
}

/// `image`: a path, or an `nbd://` / `nbd+unix://` URI (or its TLS form,
/// `nbds://` / `nbds+unix://`) kept as written.
fn image_spec(s: &str) -> Result<ImageSpec, String> {
    if s.is_empty() {
        return Err("image is empty".into());
    }
    if let Some((scheme, _)) = s.split_once("://") {
        let looks_like_scheme = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
            && scheme
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
        if looks_like_scheme {
            let lower = scheme.to_ascii_lowercase();
            return match lower.as_str() {
                "nbd" | "nbd+unix" | "nbds" | "nbds+unix" => Ok(ImageSpec::Nbd(s.to_string())),
                _ if lower.starts_with("nbd") => Err(format!(
                    "image {s:?}: unknown scheme {scheme:?} (expected nbd://, nbds://, \
                     nbd+unix:// or nbds+unix://)"
                )),
                _ => Err(format!(
                    "image {s:?}: unknown scheme {scheme:?} (an image is a file or block device \
                     path, nbd[s]://host[:port]/export or nbd[s]+unix:///export?socket=PATH)"
                )),
            };
        }
    }
    Ok(ImageSpec::Path(PathBuf::from(s)))
}

/// A size as written: a TOML string (`"512M"`) or integer (a byte count).
struct SizeText(String);

impl<'de> Deserialize<'de> for SizeText {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = SizeText;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size: a byte count or a string such as \"512M\"")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<SizeText, E> {
                Ok(SizeText(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<SizeText, E> {
                if v < 0 {
                    return Err(E::custom(format!("size {v} is negative")));
                }
                Ok(SizeText(v.to_string()))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<SizeText, E> {
                Ok(SizeText(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

/// Bytes from a size, with `--arena`'s rules ([`crate::parse_size`]).
fn size(key: &str, s: &SizeText) -> Result<u64, String> {
    crate::parse_size(&s.0).map_err(|e| format!("{key}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_files_default_listen_address_is_the_servers() {
        assert_eq!(
            DEFAULT_LISTEN,
            iopages_nbd::DEFAULT_LISTEN.parse().unwrap(),
            "the config file's default and serve's default differ"
        );
    }

    fn path() -> &'static Path {
        Path::new("/etc/iopages.toml")
    }

    fn ok(text: &str) -> ServeConfig {
        match parse(text, path()) {
            Ok(c) => c,
            Err(e) => panic!("{e}"),
        }
    }

    /// The error, checked for its line and a piece of its message.
    fn err(text: &str, line: Option<usize>, piece: &str) -> ConfigError {
        let e = parse(text, path()).expect_err("the file should be refused");
        assert_eq!(e.line, line, "line of: {e}");
        assert!(e.message.contains(piece), "{piece:?} not in: {e}");
        e
    }

    const MINIMAL: &str =
        "[[export]]\nname = \"vm1\"\nimage = \"/img\"\npassphrase-file = \"/p\"\n";

    /// A file that sets every key: `[server]` and three exports, one per
    /// image kind and passphrase source.
    const FULL_FILE: &str = r#"
[server]
listen = ["127.0.0.1:10809", "[::1]:10810"]
unix = ["/run/iopages/nbd.sock"]
unlock = "start"
strict = true
metrics = "127.0.0.1:9810"
max-handshakes = 8
peer-min-connections = 3
peer-min-inflight = "8M"

[[export]]
name = "vm1"
image = "/var/lib/iopages/vm1.luks"
passphrase-file = "/etc/iopages/vm1.pass"
description = "the first VM"
read-only = true
io = "direct"
allow-discards = true
arena = "1G"
workers = 2
max-kdf-memory = "4G"
inline-max = "64K"
allow = ["psk:alice", "ip:10.0.0.0/8"]
rate-bytes = "100M"
rate-requests = 5000

[[export]]
name = "vm2"
image = "nbd://store.example:10809/vm2"
passphrase-credential = "vm2.pass"
io = "buffered"
arena = 1048576
inline-max = 0
reconnect-delay = 30

[[export]]
name = "vm3"
image = "nbd+unix:///vm3?socket=/run/store.sock"
passphrase-prompt = true
"#;

    /// [`FULL_FILE`]'s `[server]`.
    fn full_file_server() -> ServerSection {
        ServerSection {
            listen: vec![
                "127.0.0.1:10809".parse().unwrap(),
                "[::1]:10810".parse().unwrap(),
            ],
            unix: vec![PathBuf::from("/run/iopages/nbd.sock")],
            unlock: Unlock::Start,
            strict: true,
            metrics: Some("127.0.0.1:9810".parse().unwrap()),
            max_handshakes: Some(8),
            peer_min_connections: Some(3),
            peer_min_inflight: Some(8 << 20),
        }
    }

    /// [`FULL_FILE`]'s first export: a file, every key set.
    fn full_file_vm1() -> ExportSpec {
        ExportSpec {
            name: "vm1".into(),
            image: ImageSpec::Path("/var/lib/iopages/vm1.luks".into()),
            passphrase: PassphraseSource::File("/etc/iopages/vm1.pass".into()),
            description: Some("the first VM".into()),
            read_only: true,
            io: IoMode::Direct,
            allow_discards: true,
            freshness: None,
            arena_bytes: 1 << 30,
            workers: Some(2),
            max_kdf_memory: Some(4 << 30),
            inline_max: Some(64 << 10),
            allow: vec![
                AllowRule::Psk("alice".into()),
                "ip:10.0.0.0/8".parse().unwrap(),
            ],
            rate: RateLimit {
                bytes_per_second: Some(100 << 20),
                requests_per_second: Some(5000),
            },
            reconnect_delay: None,
            line: 12,
        }
    }

    /// [`FULL_FILE`]'s second export: a remote image, a credential.
    fn full_file_vm2() -> ExportSpec {
        ExportSpec {
            name: "vm2".into(),
            image: ImageSpec::Nbd("nbd://store.example:10809/vm2".into()),
            passphrase: PassphraseSource::Credential("vm2.pass".into()),
            description: None,
            read_only: false,
            io: IoMode::Buffered,
            allow_discards: false,
            freshness: None,
            arena_bytes: 1 << 20,
            workers: None,
            max_kdf_memory: None,
            inline_max: Some(0),
            allow: Vec::new(),
            rate: RateLimit::default(),
            reconnect_delay: Some(std::time::Duration::from_secs(30)),
            line: 28,
        }
    }

    /// [`FULL_FILE`]'s third export: a remote image over a Unix socket, a
    /// prompt, every default.
    fn full_file_vm3() -> ExportSpec {
        ExportSpec {
            name: "vm3".into(),
            image: ImageSpec::Nbd("nbd+unix:///vm3?socket=/run/store.sock".into()),
            passphrase: PassphraseSource::Prompt,
            description: None,
            read_only: false,
            io: IoMode::Auto,
            allow_discards: false,
            freshness: None,
            arena_bytes: DEFAULT_ARENA_BYTES,
            workers: None,
            max_kdf_memory: None,
            inline_max: None,
            allow: Vec::new(),
            rate: RateLimit::default(),
            reconnect_delay: None,
            line: 37,
        }
    }

    #[test]
    fn config_full_file_round_trips() {
        let c = ok(FULL_FILE);
        assert_eq!(c.server, full_file_server());
        assert_eq!(
            c.exports,
            vec![full_file_vm1(), full_file_vm2(), full_file_vm3()]
        );
    }

    #[test]
    fn config_defaults() {
        let c = ok(MINIMAL);
        assert_eq!(c.server, ServerSection::default());
        assert_eq!(c.server.listen, vec![DEFAULT_LISTEN]);
        assert_eq!(c.server.unlock, Unlock::Start);
        assert!(!c.server.strict);
        let e = &c.exports[0];
        assert_eq!(e.line, 1);
        assert_eq!(e.image, ImageSpec::Path("/img".into()));
        assert_eq!(e.passphrase, PassphraseSource::File("/p".into()));
        assert_eq!(e.description, None);
        assert!(!e.read_only && !e.allow_discards);
        assert_eq!(e.io, IoMode::Auto);
        assert_eq!(e.arena_bytes, DEFAULT_ARENA_BYTES);
        assert_eq!(
            (e.workers, e.max_kdf_memory, e.inline_max),
            (None, None, None)
        );
    }

    #[test]
    fn config_unix_only_does_not_listen_on_tcp() {
        let c = ok(&format!("[server]\nunix = [\"/s\"]\n{MINIMAL}"));
        assert!(c.server.listen.is_empty());
        assert_eq!(c.server.unix, vec![PathBuf::from("/s")]);
        let c = ok(&format!("[server]\nunlock = \"lazy\"\n{MINIMAL}"));
        assert_eq!(c.server.unlock, Unlock::Lazy);
        assert_eq!(c.server.listen, vec![DEFAULT_LISTEN]);
    }

    #[test]
    fn config_example_file_parses() {
        let text = include_str!("../../../contrib/iopages.toml");
        let c = ok(text);
        assert_eq!(c.exports[0].name, "vm1");
        assert!(c.exports.len() >= 2);
    }

    #[test]
    fn config_error_display() {
        let text =
            "[[export]]\nname = \"vm2\"\nimage = \"/x\"\npassphrase-file = \"/p\"\nimag = \"/y\"\n";
        let e = err(text, Some(5), "unknown key \"imag\"");
        assert_eq!(e.column, Some(1));
        let shown = e.to_string();
        assert!(
            shown.starts_with("/etc/iopages.toml:5:1: export \"vm2\": unknown key \"imag\" (expected one of name, image, "),
            "{shown}"
        );
        let whole = ConfigError {
            path: "/f".into(),
            line: None,
            column: None,
            message: "m".into(),
        };
        assert_eq!(whole.to_string(), "/f: m");
    }

    #[test]
    fn config_unknown_key_in_server() {
        err(
            &format!("[server]\nlisten = []\nlistne = []\n{MINIMAL}"),
            Some(3),
            "[server]: unknown key \"listne\"",
        );
    }

    #[test]
    fn config_unknown_top_level_key() {
        err(
            &format!("{MINIMAL}\n[exports]\nx = 1\n"),
            Some(6),
            "unknown key \"exports\"",
        );
        err(
            "[[exprt]]\nname = \"a\"\n",
            Some(1),
            "unknown key \"exprt\"",
        );
    }

    #[test]
    fn config_type_error_points_at_the_value() {
        let e = err(
            &format!("{MINIMAL}workers = \"two\"\n"),
            Some(5),
            "export \"vm1\": workers: invalid type: string \"two\"",
        );
        assert_eq!(e.column, Some(11));
        err(
            &format!("{MINIMAL}read-only = 1\n"),
            Some(5),
            "read-only: invalid type: integer",
        );
        err(
            &format!("[server]\nlisten = [\"localhost\"]\n{MINIMAL}"),
            Some(2),
            "[server]: listen: invalid socket address",
        );
        err(
            &format!("[server]\nunlock = \"sometimes\"\n{MINIMAL}"),
            Some(2),
            "unknown value \"sometimes\" (expected \"start\" or \"lazy\")",
        );
        err(
            &format!("{MINIMAL}io = \"fast\"\n"),
            Some(5),
            "io: unknown value \"fast\"",
        );
        err(
            &format!("{MINIMAL}arena = -4096\n"),
            Some(5),
            "arena: size -4096 is negative",
        );
    }

    #[test]
    fn config_syntax_error_points_at_its_line() {
        let e = err(
            "[server]\nstrict = true\n\n[[export]]\nname = \"vm1\nimage = \"/x\"\n",
            Some(5),
            "",
        );
        assert!(e.column.is_some());
        err("[server\n", Some(1), "");
    }

    #[test]
    fn config_missing_name_and_image() {
        err(
            "[server]\n\n[[export]]\nimage = \"/x\"\npassphrase-file = \"/p\"\n",
            Some(3),
            "export #1: missing key \"name\"",
        );
        err(
            &format!("{MINIMAL}\n[[export]]\nname = \"vm2\"\npassphrase-file = \"/p\"\n"),
            Some(6),
            "export \"vm2\": missing key \"image\"",
        );
    }

    #[test]
    fn config_duplicate_names_point_at_the_second() {
        let text = format!(
            "{MINIMAL}\n[[export]]\nname = \"vm1\"\nimage = \"/y\"\npassphrase-file = \"/p\"\n"
        );
        err(
            &text,
            Some(6),
            "export \"vm1\": name already used by the export at line 1",
        );
    }

    #[test]
    fn config_passphrase_sources() {
        let head = "[[export]]\nname = \"vm1\"\nimage = \"/x\"\n";
        err(head, Some(1), "export \"vm1\": no passphrase source");
        err(
            &format!("{head}passphrase-prompt = false\n"),
            Some(1),
            "no passphrase source",
        );
        err(
            &format!("{head}passphrase-file = \"/p\"\npassphrase-credential = \"c\"\n"),
            Some(1),
            "more than one passphrase source (passphrase-file, passphrase-credential)",
        );
        err(
            &format!("\n\n{head}passphrase-credential = \"c\"\npassphrase-prompt = true\n"),
            Some(3),
            "more than one passphrase source (passphrase-credential, passphrase-prompt)",
        );
        err(
            &format!("[server]\nunlock = \"lazy\"\n\n{head}passphrase-prompt = true\n"),
            Some(4),
            "export \"vm1\": passphrase-prompt needs unlock = \"start\"",
        );
        err(
            &format!("{head}passphrase-credential = \"../etc/shadow\"\n"),
            Some(1),
            "is not a credential name",
        );
        err(
            &format!("{head}passphrase-file = \"\"\n"),
            Some(1),
            "passphrase-file is empty",
        );
    }

    #[test]
    fn config_bad_names() {
        let tail = "image = \"/x\"\npassphrase-file = \"/p\"\n";
        err(
            &format!("{MINIMAL}\n[[export]]\nname = \"\"\n{tail}"),
            Some(6),
            "export \"\": name is empty",
        );
        err(
            &format!("[[export]]\nname = \"a\\u0000b\"\n{tail}"),
            Some(1),
            "name contains a NUL byte",
        );
        let long = "n".repeat(4097);
        let e = err(
            &format!("[[export]]\nname = \"{long}\"\n{tail}"),
            Some(1),
            "name is 4097 bytes long, at most 4096",
        );
        assert!(e.message.len() < 300, "the name is cut in messages");
        let max = "n".repeat(4096);
        assert_eq!(
            ok(&format!("[[export]]\nname = \"{max}\"\n{tail}")).exports[0].name,
            max
        );
    }

    #[test]
    fn config_workers_zero() {
        err(
            &format!("{MINIMAL}workers = 0\n"),
            Some(1),
            "export \"vm1\": workers must be at least 1",
        );
        err(
            &format!("{MINIMAL}workers = -1\n"),
            Some(5),
            "workers: invalid value",
        );
    }

    #[test]
    fn config_tenant_keys_are_checked() {
        err(
            &format!("{MINIMAL}allow = [\"user:x\"]\n"),
            Some(1),
            "allow rule \"user:x\": unknown kind",
        );
        err(
            &format!("{MINIMAL}allow = \"psk:a\"\n"),
            Some(5),
            "allow: invalid type",
        );
        err(
            &format!("{MINIMAL}rate-requests = 0\n"),
            Some(1),
            "rate-bytes and rate-requests must be at least 1",
        );
        err(
            &format!("{MINIMAL}rate-bytes = \"1Q\"\n"),
            Some(1),
            "rate-bytes",
        );
        err(
            &format!("[server]\nmax-handshakes = 0\n{MINIMAL}"),
            Some(1),
            "[server]: max-handshakes and peer-min-connections must be at least 1",
        );
        err(
            &format!("[server]\npeer-min-inflight = \"x\"\n{MINIMAL}"),
            Some(1),
            "peer-min-inflight",
        );
    }

    #[test]
    fn config_sizes() {
        let with = |kv: &str| format!("\n{MINIMAL}{kv}\n");
        assert_eq!(ok(&with("arena = \"2M\"")).exports[0].arena_bytes, 2 << 20);
        assert_eq!(ok(&with("arena = \"8k\"")).exports[0].arena_bytes, 8192);
        assert_eq!(ok(&with("arena = 12288")).exports[0].arena_bytes, 12288);
        assert_eq!(ok(&with("arena = \"12288\"")).exports[0].arena_bytes, 12288);
        err(
            &with("arena = \"512X\""),
            Some(2),
            "export \"vm1\": arena: `512X` is not a size",
        );
        err(
            &with("arena = \"1T\""),
            Some(2),
            "arena: `1T` is not a size",
        );
        err(
            &with("arena = 4097"),
            Some(2),
            "arena: size 4097 must be a non-zero multiple of 4096",
        );
        err(
            &with("arena = \"0\""),
            Some(2),
            "must be a non-zero multiple of 4096",
        );
        err(&with("arena = \"\""), Some(2), "arena: `` is not a size");
        err(&with("arena = \"2000000G\""), Some(2), "is larger than");
        assert_eq!(
            ok(&with("max-kdf-memory = \"4G\"")).exports[0].max_kdf_memory,
            Some(4 << 30)
        );
        err(
            &with("max-kdf-memory = \"5G\""),
            Some(2),
            "export \"vm1\": max-kdf-memory 5G: at most 4G",
        );
        err(
            &with("max-kdf-memory = \"1Q\""),
            Some(2),
            "max-kdf-memory: `1Q` is not a size",
        );
        assert_eq!(
            ok(&with("inline-max = \"0\"")).exports[0].inline_max,
            Some(0)
        );
        assert_eq!(
            ok(&with("inline-max = 4096")).exports[0].inline_max,
            Some(4096)
        );
        err(
            &with("inline-max = \"4G\""),
            Some(2),
            "inline-max 4G: larger than a request can be",
        );
        err(
            &with("inline-max = \"100\""),
            Some(2),
            "inline-max: size 100 must be",
        );
        err(
            &with("arena = true"),
            Some(6),
            "arena: invalid type: boolean",
        );
    }

    #[test]
    fn config_images() {
        let head = "[[export]]\nname = \"vm1\"\npassphrase-file = \"/p\"\n";
        let image = |s: &str| parse(&format!("{head}image = \"{s}\"\n"), path());
        assert_eq!(
            image("relative/vm1.luks").unwrap().exports[0].image,
            ImageSpec::Path("relative/vm1.luks".into())
        );
        assert_eq!(
            image("/dev/nbd-disk0").unwrap().exports[0].image,
            ImageSpec::Path("/dev/nbd-disk0".into())
        );
        assert_eq!(
            image("nbd://h/e").unwrap().exports[0].image,
            ImageSpec::Nbd("nbd://h/e".into())
        );
        for tls in [
            "nbds://store/vm1?tls-certificates=/etc/pki/store",
            "nbds+unix:///e?socket=/s&tls-psk-file=/k.psk",
        ] {
            assert_eq!(
                image(tls).unwrap().exports[0].image,
                ImageSpec::Nbd(tls.into())
            );
        }
        err(
            &format!("{head}image = \"nbd+vsock://1/e\"\n"),
            Some(1),
            "unknown scheme \"nbd+vsock\" (expected nbd://, nbds://, nbd+unix:// or nbds+unix://)",
        );
        err(
            &format!("{head}image = \"http://x/y\"\n"),
            Some(1),
            "unknown scheme \"http\"",
        );
        err(&format!("{head}image = \"\"\n"), Some(1), "image is empty");
    }

    #[test]
    fn config_no_export() {
        err("", None, "no [[export]]");
        err(
            "# nothing\n[server]\nstrict = true\n",
            None,
            "no [[export]]",
        );
        err("export = []\n", Some(1), "no [[export]]");
        err(
            "[export]\nname = \"a\"\n",
            Some(1),
            "write [[export]], not [export]",
        );
    }

    #[test]
    fn config_inline_exports() {
        let c =
            ok("\nexport = [\n  { name = \"a\", image = \"/a\", passphrase-file = \"/p\" },\n]\n");
        assert_eq!(c.exports[0].line, 3);
        err(
            "export = [\n  { name = \"a\", image = \"/a\", imag = 1 },\n]\n",
            Some(2),
            "export \"a\": unknown key \"imag\"",
        );
    }

    #[test]
    fn config_at_most_256_exports() {
        let one = |i: usize| {
            format!("[[export]]\nname = \"e{i}\"\nimage = \"/x\"\npassphrase-file = \"/p\"\n")
        };
        let text: String = (0..MAX_EXPORTS).map(one).collect();
        assert_eq!(ok(&text).exports.len(), MAX_EXPORTS);
        let text: String = (0..=MAX_EXPORTS).map(one).collect();
        err(
            &text,
            Some(4 * MAX_EXPORTS + 1),
            "export \"e256\": more than 256 exports",
        );
    }

    #[test]
    fn config_load_bounds_and_names_the_path() {
        let dir = std::env::temp_dir().join(format!("iopages-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.toml");
        std::fs::write(&good, MINIMAL).unwrap();
        assert_eq!(load(&good).unwrap().exports[0].name, "vm1");

        let big = dir.join("big.toml");
        let mut text = MINIMAL.to_string();
        text.push_str(&"#".repeat(MAX_CONFIG_BYTES as usize));
        std::fs::write(&big, &text).unwrap();
        let e = load(&big).unwrap_err();
        assert_eq!((e.path.as_path(), e.line), (big.as_path(), None));
        assert!(e.message.contains("larger than 1048576 bytes"), "{e}");
        assert!(parse(&text, &big)
            .unwrap_err()
            .message
            .contains("larger than"));

        let missing = dir.join("missing.toml");
        let e = load(&missing).unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("{}: cannot open: ", missing.display())),
            "{e}"
        );

        let binary = dir.join("binary.toml");
        std::fs::write(&binary, b"# ok\n\xff\xfe").unwrap();
        let e = load(&binary).unwrap_err();
        assert_eq!((e.line, e.column), (Some(2), Some(1)));
        assert!(e.message.contains("not UTF-8"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn config_credentials() {
        let dir = OsStr::new("/run/credentials/iopages.service");
        assert_eq!(
            credential_path(Some(dir), "vm1.pass").unwrap(),
            PathBuf::from("/run/credentials/iopages.service/vm1.pass")
        );
        for bad in ["", ".", "..", "a/b", "../x", "x/..", "a..b", "a\0b"] {
            assert!(credential_path(Some(dir), bad).is_err(), "{bad:?}");
        }
        let e = credential_path(None, "vm1.pass").unwrap_err();
        assert!(e.contains("$CREDENTIALS_DIRECTORY is not set"), "{e}");
        assert!(credential_path(Some(OsStr::new("")), "vm1.pass").is_err());
    }

    #[test]
    fn config_line_col() {
        assert_eq!(line_col("", 0), (1, 1));
        assert_eq!(line_col("ab\ncd", 3), (2, 1));
        assert_eq!(line_col("ab\ncd", 4), (2, 2));
        assert_eq!(line_col("é\né", 5), (2, 2));
        assert_eq!(line_col("é\né", 4), (2, 1), "inside a character");
        assert_eq!(line_col("ab", 99), (1, 3));
    }
}
