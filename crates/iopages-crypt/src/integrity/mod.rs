//! Authenticated volumes: every 4 KiB block of ciphertext carries a tag,
//! and a hash tree over the tags, anchored outside the store, makes a
//! store that flips, moves or rolls back a block caught at the read.
//!
//! dm-crypt authenticates with dm-integrity's per-sector tags (LUKS2
//! `--integrity`), which catch flips and moves but not a rolled-back
//! sector. Here [`AuthBackend`] sits between the crypt target and the
//! store, on ciphertext (encrypt-then-MAC), so every backend — files,
//! block devices, RAM, remote stores — gets it:
//!
//! - **Tags** ([`layout::Record`], `mac.rs`): 64 bytes per block, the MAC
//!   (HMAC-SHA256, or GMAC with a nonce stored beside it) of the block's number, the
//!   epoch it was written in, a zero flag and its ciphertext, under a key
//!   derived from the volume key. They live in an area of their own after
//!   the data, 32 to a 4 KiB tag block (each with the record its write
//!   replaced).
//! - **Tree** (`tree.rs`): each tag block and each interior node (128
//!   entries) has two slots on the store; a parent's [`layout::Entry`]
//!   names the child's hash, slot and epoch. A node is written only to the
//!   slot its last commit did not use, so the committed tree is never
//!   overwritten before the next commit is durable.
//! - **Anchor** (`state.rs`): the root's entry and the epoch of the last
//!   commit, in a local state file written atomically at every flush, and
//!   in an authenticated superblock on the store (to explain mismatches).
//!
//! Must never: return bytes whose tag does not verify, accept a tag block
//! or node that does not match its parent, or overwrite a committed node.

mod auth;
pub mod layout;
pub mod mac;
pub mod state;
mod tree;

pub use auth::{block_ranges, AuthBackend, AuthOptions, AuthStats, Freshness};
pub use layout::{Layout, Mac};
pub use mac::Keys;
pub use state::{Anchor, StateFile};

use crate::backend::Backend;
use std::io;

/// Initialise the integrity area of a freshly formatted volume: a
/// superblock of epoch 0 naming the empty tree in slot 0, slot 1 zeroed.
/// Tag blocks and nodes are not written: an empty entry means "never
/// written", so nothing on the store is read for them.
///
/// **Returns:** the anchor written (what a new state file holds).
pub fn format_area(
    area: &dyn Backend,
    layout: &Layout,
    keys: &Keys,
    uuid: &str,
) -> io::Result<Anchor> {
    if area.size_bytes() < layout.area_bytes() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "the integrity area needs {} bytes, {} given",
                layout.area_bytes(),
                area.size_bytes()
            ),
        ));
    }
    let anchor = Anchor {
        mac: layout.mac(),
        data_blocks: layout.data_blocks(),
        volume: state::volume_id(uuid),
        epoch: 0,
        root: layout::Entry::default(),
    };
    let sb = state::encode_superblock(&anchor, keys)?;
    area.write_at(0, &[&sb, &[0u8; layout::BLOCK as usize]])?;
    area.flush()?;
    Ok(anchor)
}
