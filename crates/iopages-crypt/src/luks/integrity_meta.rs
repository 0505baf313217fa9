//! The LUKS2 metadata of an authenticated volume (`luks format
//! --integrity`): where its tags and tree live, said in the header, and
//! the area initialised at format time.
//!
//! An authenticated volume is a LUKS2 volume whose data segment has a
//! fixed size (`layout.data_bytes()`), followed on the same device by the
//! integrity area of [`crate::integrity::Layout`] (`area_offset =
//! data_offset + segment size`). The header says so twice:
//!
//! - `config.requirements.mandatory` holds [`INTEGRITY_REQUIREMENT`]. No
//!   other tool knows it, so cryptsetup (and anything else that honours
//!   LUKS2 requirements) refuses the volume instead of opening its data
//!   without the tags — a write through dm-crypt would leave every tag
//!   stale. cryptsetup's own `integrity` segment field (dm-integrity) is
//!   never written: that is another format.
//! - one token of type [`INTEGRITY_TOKEN`] (bound to no keyslot) carries
//!   the geometry: `mac`, `data_blocks`, `area_offset`, `area_size` (decimal
//!   strings, as LUKS2 writes offsets) and `block_size` (4096).
//!
//! Owns: those two entries — writing them at format time, and checking
//! them at every open ([`check`]: the requirement only with exactly one
//! valid token and a token only with the requirement; every number within
//! u64 and consistent with the segment and [`Layout::new`]) — and writing
//! the area's first blocks through the header's device. Must never: accept
//! a token whose numbers disagree with the segment or with each other, an
//! integrity token without the requirement (the requirement is what keeps
//! other tools out), or overflow adding an offset and a size.

use super::{Dev, LuksError};
use crate::backend::Backend;
use crate::integrity::{self, layout::BLOCK, Anchor, Keys, Layout, Mac};
use serde_json::{json, Map, Value};
use std::io;

/// The `config.requirements.mandatory` entry of an authenticated volume.
pub const INTEGRITY_REQUIREMENT: &str = "iopages-integrity-v1";
/// The `type` of the token that carries an authenticated volume's
/// geometry.
pub const INTEGRITY_TOKEN: &str = "iopages-integrity";

/// Where an authenticated volume's tags and tree live: the layout of its
/// integrity area, and the area's byte offset on the device (right after
/// the data segment).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IntegrityInfo {
    /// The geometry: MAC, data blocks, tree levels.
    pub layout: Layout,
    /// Byte offset of the integrity area on the device.
    pub area_offset: u64,
}

impl IntegrityInfo {
    /// The MAC of the tags.
    pub fn mac(&self) -> Mac {
        self.layout.mac()
    }

    /// Bytes of the integrity area.
    pub fn area_bytes(&self) -> u64 {
        self.layout.area_bytes()
    }

    /// The byte just past the integrity area (checked not to overflow
    /// when the header was read or made).
    pub fn area_end(&self) -> u64 {
        self.area_offset + self.area_bytes()
    }
}

/// The data segment as the token is checked against it.
pub(super) struct SegmentView<'a> {
    /// `segments.<id>`, for messages.
    pub path: &'a str,
    pub offset: u64,
    /// `None`: `"dynamic"`.
    pub size: Option<u64>,
    pub sector_size: u64,
}

fn corrupt(path: &str, m: &str) -> LuksError {
    LuksError::Corrupt(format!("LUKS2 metadata: {path} {m}"))
}

/// The layout an authenticated volume gets on a device of `device_bytes`
/// whose data starts at `data_offset`: the largest whose data and area
/// fit ([`Layout::fit`]).
///
/// **Returns:** [`LuksError::InvalidOptions`] when not one data block and
/// its area fit.
pub(super) fn fit(
    mac: Mac,
    device_bytes: u64,
    data_offset: u64,
) -> Result<IntegrityInfo, LuksError> {
    let room = device_bytes.saturating_sub(data_offset);
    let layout = Layout::fit(mac, room).ok_or_else(|| {
        let least = Layout::new(mac, 1).map_or(0, |l| l.data_bytes() + l.area_bytes());
        LuksError::InvalidOptions(format!(
            "the device is {device_bytes} bytes: an authenticated volume needs at least \
             {} bytes ({data_offset} bytes of header and keyslots, then {least} bytes for one \
             4096-byte data block and its integrity area)",
            data_offset + least
        ))
    })?;
    let area_offset = data_offset + layout.data_bytes();
    assert!(area_offset + layout.area_bytes() <= device_bytes);
    assert!(layout.data_blocks() >= 1);
    Ok(IntegrityInfo {
        layout,
        area_offset,
    })
}

/// Make the metadata `json` of a new volume (one data segment `"0"`, no
/// tokens) describe the authenticated volume `info`: the segment's fixed
/// size, the requirement, and token `"0"`.
pub(super) fn add_to_metadata(json: &mut Value, info: &IntegrityInfo) {
    let l = &info.layout;
    json["segments"]["0"]["size"] = json!(l.data_bytes().to_string());
    json["config"]["requirements"] = json!({ "mandatory": [INTEGRITY_REQUIREMENT] });
    json["tokens"]["0"] = json!({
        "type": INTEGRITY_TOKEN,
        "keyslots": [],
        "mac": l.mac().name(),
        "data_blocks": l.data_blocks().to_string(),
        "area_offset": info.area_offset.to_string(),
        "area_size": l.area_bytes().to_string(),
        "block_size": BLOCK,
    });
}

/// Check the integrity token against the requirement (`required`: the
/// requirement is listed) and the data segment `seg`.
///
/// **Returns:** the volume's [`IntegrityInfo`] when it is authenticated,
/// `None` when there is neither requirement nor token;
/// [`LuksError::Corrupt`] naming the field for anything else.
pub(super) fn check(
    required: bool,
    tokens: &Map<String, Value>,
    seg: &SegmentView<'_>,
) -> Result<Option<IntegrityInfo>, LuksError> {
    let ours: Vec<(&String, &Value)> = tokens
        .iter()
        .filter(|(_, t)| t.get("type").and_then(Value::as_str) == Some(INTEGRITY_TOKEN))
        .collect();
    match (required, ours.as_slice()) {
        (false, []) => Ok(None),
        (true, [(id, t)]) => check_token(&format!("tokens.{id}"), t, seg).map(Some),
        (false, [(id, _), ..]) => Err(corrupt(
            &format!("tokens.{id}"),
            &format!(
                "is an {INTEGRITY_TOKEN} token but config.requirements.mandatory does not list \
                 {INTEGRITY_REQUIREMENT:?} (the requirement is what keeps other tools from \
                 opening the data without its tags)"
            ),
        )),
        (true, _) => Err(corrupt(
            "tokens",
            &format!(
                "hold {} tokens of type {INTEGRITY_TOKEN:?}: config.requirements.mandatory lists \
                 {INTEGRITY_REQUIREMENT:?}, which needs exactly one",
                ours.len()
            ),
        )),
    }
}

/// A decimal-string number of the token at `path`, within u64.
fn decimal(t: &Map<String, Value>, key: &str, path: &str) -> Result<u64, LuksError> {
    let p = format!("{path}.{key}");
    let s = t
        .get(key)
        .ok_or_else(|| corrupt(&p, "is missing"))?
        .as_str()
        .ok_or_else(|| corrupt(&p, "is not a string (a decimal number in a string)"))?;
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(corrupt(&p, &format!("{s:?} is not a decimal number")));
    }
    s.parse()
        .map_err(|_| corrupt(&p, &format!("{s:?} is larger than 2^64 - 1")))
}

/// The token's own fields: no keyslots, a known MAC, a block size of
/// 4096, and a data block count [`Layout::new`] takes.
///
/// **Returns:** the layout and the token's `area_offset` and `area_size`.
fn token_fields(t: &Map<String, Value>, path: &str) -> Result<(Layout, u64, u64), LuksError> {
    let empty = t
        .get("keyslots")
        .and_then(Value::as_array)
        .is_some_and(Vec::is_empty);
    if !empty {
        return Err(corrupt(
            &format!("{path}.keyslots"),
            "is not an empty array (the integrity token belongs to no keyslot)",
        ));
    }
    let mac_path = format!("{path}.mac");
    let name = t.get("mac").and_then(Value::as_str).ok_or_else(|| {
        corrupt(
            &mac_path,
            "is missing or not a string (\"hmac-sha256\" or \"aead\")",
        )
    })?;
    let mac = Mac::from_name(name).ok_or_else(|| {
        corrupt(
            &mac_path,
            &format!("{name:?} is not a MAC (\"hmac-sha256\" or \"aead\")"),
        )
    })?;
    if t.get("block_size").and_then(Value::as_u64) != Some(BLOCK) {
        return Err(corrupt(
            &format!("{path}.block_size"),
            &format!(
                "is {}, not the integer {BLOCK}",
                t.get("block_size").unwrap_or(&Value::Null)
            ),
        ));
    }
    let blocks = decimal(t, "data_blocks", path)?;
    let layout = Layout::new(mac, blocks).ok_or_else(|| {
        corrupt(
            &format!("{path}.data_blocks"),
            &format!(
                "{blocks} is not a block count an authenticated volume has (1 to {})",
                integrity::layout::MAX_DATA_BLOCKS
            ),
        )
    })?;
    let area_offset = decimal(t, "area_offset", path)?;
    let area_size = decimal(t, "area_size", path)?;
    Ok((layout, area_offset, area_size))
}

/// One integrity token at `path`, checked field by field and against the
/// data segment `seg`.
fn check_token(path: &str, t: &Value, seg: &SegmentView<'_>) -> Result<IntegrityInfo, LuksError> {
    let t = t
        .as_object()
        .ok_or_else(|| corrupt(path, "is not an object"))?;
    let (layout, area_offset, area_size) = token_fields(t, path)?;
    let seg_path = seg.path;
    if seg.sector_size != BLOCK {
        return Err(corrupt(
            &format!("{seg_path}.sector_size"),
            &format!(
                "{}: an authenticated volume has 4096-byte sectors",
                seg.sector_size
            ),
        ));
    }
    // Layout::new bounds data_blocks to 2^40, so the product fits.
    let data_bytes = layout.data_bytes();
    if seg.size != Some(data_bytes) {
        let size = seg
            .size
            .map_or("\"dynamic\"".to_string(), |s| s.to_string());
        return Err(corrupt(
            &format!("{seg_path}.size"),
            &format!(
                "is {size}: an authenticated volume's segment is fixed at {path}.data_blocks × \
                 4096 = {data_bytes} bytes"
            ),
        ));
    }
    if area_size != layout.area_bytes() {
        return Err(corrupt(
            &format!("{path}.area_size"),
            &format!(
                "{area_size} is not the {}-byte area of {} data blocks",
                layout.area_bytes(),
                layout.data_blocks()
            ),
        ));
    }
    let after_data = seg.offset.checked_add(data_bytes);
    if after_data != Some(area_offset) {
        return Err(corrupt(
            &format!("{path}.area_offset"),
            &format!(
                "{area_offset} is not right after the data segment ({seg_path}.offset {} + size \
                 {data_bytes})",
                seg.offset
            ),
        ));
    }
    if area_offset.checked_add(area_size).is_none() {
        return Err(corrupt(
            &format!("{path}.area_size"),
            &format!("{area_size} at offset {area_offset}: the area's end overflows"),
        ));
    }
    Ok(IntegrityInfo {
        layout,
        area_offset,
    })
}

/// The integrity area of a device: a window of the header's [`Dev`], so
/// that [`integrity::format_area`] writes through the same file or
/// backend the header went to.
struct AreaWindow<'d, 'a> {
    dev: &'d Dev<'a>,
    start: u64,
    len: u64,
}

impl AreaWindow<'_, '_> {
    fn check(&self, offset: u64, len: usize) -> io::Result<u64> {
        let end = offset.checked_add(len as u64);
        if end.is_none_or(|e| e > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{len} bytes at {offset} leave the {}-byte integrity area",
                    self.len
                ),
            ));
        }
        Ok(self.start + offset)
    }
}

impl Backend for AreaWindow<'_, '_> {
    fn size_bytes(&self) -> u64 {
        self.len
    }

    fn write_at(&self, offset: u64, segments: &[&[u8]]) -> io::Result<()> {
        let whole = segments.concat();
        let at = self.check(offset, whole.len())?;
        self.dev.write_at(at, &whole).map_err(io::Error::from)
    }

    fn read_at(&self, offset: u64, segments: &mut [&mut [u8]]) -> io::Result<()> {
        let mut at = offset;
        for s in segments.iter_mut() {
            let abs = self.check(at, s.len())?;
            self.dev.read_at(abs, s).map_err(io::Error::from)?;
            at += s.len() as u64;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.dev.sync().map_err(io::Error::from)
    }
}

/// Initialise the integrity area `info` of a freshly formatted volume
/// (UUID `uuid`, volume key `volume_key`) on `dev`: the superblock of
/// epoch 0 and the empty tree ([`integrity::format_area`]), made durable.
///
/// **Context:** writes two 4 KiB blocks at `info.area_offset` and syncs.
///
/// **Returns:** the anchor a new state file holds.
pub(super) fn format_area(
    dev: &Dev<'_>,
    info: &IntegrityInfo,
    volume_key: &[u8],
    uuid: &str,
) -> Result<Anchor, LuksError> {
    assert!(
        info.area_end() <= dev.size(),
        "format fitted the area to the device"
    );
    let area = AreaWindow {
        dev,
        start: info.area_offset,
        len: info.area_bytes(),
    };
    let keys = Keys::derive(info.mac(), volume_key)?;
    let anchor = integrity::format_area(&area, &info.layout, &keys, uuid)?;
    assert_eq!(anchor.epoch, 0);
    Ok(anchor)
}
