//! [`UniqueId`]: the token every rank of a communicator must share.

use std::fmt;
use std::str::FromStr;

use nccl_sys::ncclUniqueId;

use crate::error::{invalid, Error, Result};
use crate::library::{CallContext, Library};
use crate::nccl_call;

/// Number of bytes in a unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = nccl_sys::bindings::NCCL_UNIQUE_ID_BYTES as usize;

/// An `ncclUniqueId`: created by one rank, sent to all others, used once by each in
/// `Communicator::init_rank`.
///
/// Send it as bytes ([`to_bytes`](Self::to_bytes)/[`from_bytes`](Self::from_bytes)) or as
/// text: `Display` and `FromStr` use 256 lowercase hex digits, safe for an environment
/// variable or a command line. `Debug` shows only the first bytes.
///
/// ```
/// # use nccl_safe::UniqueId;
/// let id = UniqueId::from_bytes(&[7u8; 128])?;
/// let text = id.to_string();
/// assert_eq!(text.parse::<UniqueId>()?, id);
/// assert!(UniqueId::from_bytes(&[0u8; 12]).is_err());
/// # Ok::<(), nccl_safe::Error>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId([u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    /// A fresh id from the default library (`ncclGetUniqueId`).
    pub fn new() -> Result<UniqueId> {
        UniqueId::new_with(&*Library::load()?)
    }

    /// A fresh id from `lib` (`ncclGetUniqueId`).
    pub fn new_with(lib: &Library) -> Result<UniqueId> {
        let mut raw = ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: `raw` is a valid, writable ncclUniqueId for the duration of the call.
        unsafe { nccl_call!(lib, ncclGetUniqueId(&mut raw), CallContext::NONE) }?;
        Ok(UniqueId::from_raw(raw))
    }

    /// The id from exactly [`UNIQUE_ID_BYTES`] bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<UniqueId> {
        let arr: [u8; UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| {
            let reason = format!(
                "a unique id is {UNIQUE_ID_BYTES} bytes, got {}",
                bytes.len()
            );
            invalid("UniqueId::from_bytes", reason)
        })?;
        Ok(UniqueId(arr))
    }

    /// The id's bytes.
    pub fn to_bytes(&self) -> [u8; UNIQUE_ID_BYTES] {
        self.0
    }

    /// The id's bytes, borrowed.
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.0
    }

    /// From NCCL's struct.
    pub fn from_raw(raw: ncclUniqueId) -> UniqueId {
        UniqueId(raw.internal.map(|c| c as u8))
    }

    /// As NCCL's struct.
    pub fn to_raw(&self) -> ncclUniqueId {
        ncclUniqueId {
            internal: self.0.map(|b| b as std::ffi::c_char),
        }
    }
}

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…, {UNIQUE_ID_BYTES} bytes)")
    }
}

impl fmt::Display for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl FromStr for UniqueId {
    type Err = Error;

    fn from_str(s: &str) -> Result<UniqueId> {
        let bad = |reason: String| invalid("UniqueId::from_str", reason);
        let s = s.trim();
        if s.len() != 2 * UNIQUE_ID_BYTES {
            return Err(bad(format!(
                "expected {} hex digits, got {}",
                2 * UNIQUE_ID_BYTES,
                s.len()
            )));
        }
        let mut out = [0u8; UNIQUE_ID_BYTES];
        for (i, pair) in s.as_bytes().chunks(2).enumerate() {
            let text = String::from_utf8_lossy(pair);
            // Digits only: `from_str_radix` alone would take a sign ("+f").
            match u8::from_str_radix(&text, 16) {
                Ok(b) if pair.iter().all(u8::is_ascii_hexdigit) => out[i] = b,
                _ => return Err(bad(format!("{text:?} at byte {i} is not two hex digits"))),
            }
        }
        Ok(UniqueId(out))
    }
}

/// The most ranks one root of a scalable init serves in the launchers
/// ([`scalable_roots`]): NCCL's `NCCL_UID_STAGGER_THRESHOLD` default (bootstrap.cc:670 of
/// 2.30.7), above which NCCL delays each rank's connection to its root by its place in
/// the root's block (7000 connections a second, bootstrap.cc:754-760).
pub const RANKS_PER_ROOT: usize = 256;

/// How many unique ids (roots) the launchers give a `world_size`-rank job's
/// [`Communicator::init_rank_scalable`](crate::Communicator::init_rank_scalable): one per
/// [`RANKS_PER_ROOT`] ranks (so no root serves more than NCCL's stagger threshold), at
/// least one, at most one per rank. A job of up to 256 ranks has one, which is exactly
/// `ncclCommInitRankConfig`'s init.
///
/// ```
/// assert_eq!(nccl_safe::scalable_roots(8), 1);
/// assert_eq!(nccl_safe::scalable_roots(257), 2);
/// assert_eq!(nccl_safe::scalable_roots(32_768), 128);
/// ```
pub fn scalable_roots(world_size: usize) -> usize {
    world_size
        .div_ceil(RANKS_PER_ROOT)
        .clamp(1, world_size.max(1))
}

/// The rank that makes id `root` of a scalable init of `world_size` ranks with `roots`
/// ids: the first rank of the block that root serves (`firstRankFromRoot`,
/// bootstrap.cc:51-56 of 2.30.7), so each root runs in a process of its own block.
/// `None` when `root >= roots` or `roots` is not in `1..=world_size`.
///
/// ```
/// // 10 ranks, 3 roots: blocks 0-3, 4-6, 7-9.
/// let makers: Vec<_> = (0..3).map(|i| nccl_safe::scalable_root_rank(10, 3, i)).collect();
/// assert_eq!(makers, [Some(0), Some(4), Some(7)]);
/// ```
pub fn scalable_root_rank(world_size: usize, roots: usize, root: usize) -> Option<usize> {
    if roots == 0 || roots > world_size || root >= roots {
        return None;
    }
    Some(root * (world_size / roots) + root.min(world_size % roots))
}

/// The root whose id rank `rank` makes in a scalable init of `world_size` ranks with
/// `roots` ids: `Some(i)` when `rank` is [`scalable_root_rank`]`(world_size, roots, i)`
/// (NCCL's `rankHasRoot`, docs/userguide usage/communicators.rst of 2.30.7), else `None`.
pub(crate) fn root_made_by(world_size: usize, roots: usize, rank: usize) -> Option<usize> {
    if roots == 0 || roots > world_size || rank >= world_size {
        return None;
    }
    // rootIdFromRank (bootstrap.cc:59-69 of 2.30.7), offset 0.
    let (rmr, rpr) = (world_size % roots, world_size / roots);
    let d = rmr * (rpr + 1);
    let root = if rank < d {
        rank / (rpr + 1)
    } else {
        (rank - d) / rpr + rmr
    };
    (scalable_root_rank(world_size, roots, root) == Some(rank)).then_some(root)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_round_trips_and_debug_is_short() {
        let mut b = [0u8; 128];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 37 % 256) as u8;
        }
        let id = UniqueId::from_bytes(&b).unwrap();
        assert_eq!(id.to_string().len(), 256);
        assert_eq!(id.to_string().parse::<UniqueId>().unwrap(), id);
        assert_eq!(UniqueId::from_raw(id.to_raw()), id);
        let dbg = format!("{id:?}");
        assert!(
            dbg.chars().count() <= 40 && dbg.contains("128 bytes"),
            "{dbg}"
        );
        assert!("zz".repeat(128).parse::<UniqueId>().is_err());
        assert!("ab".parse::<UniqueId>().is_err());
        assert!(matches!(
            UniqueId::from_bytes(&b[..127]),
            Err(Error::InvalidArgument { .. })
        ));
    }

    /// The makers are NCCL's `rankHasRoot` (usage/communicators.rst of 2.30.7): 3 ids
    /// over 7 ranks are made on ranks 0, 3 and 5.
    #[test]
    fn root_makers_follow_rank_has_root() {
        let has_root = |rank: usize, n: usize, ids: usize| {
            let (rmr, rpr) = (n % ids, n / ids);
            let rlim = rmr * (rpr + 1);
            if rank < rlim {
                rank.is_multiple_of(rpr + 1)
            } else {
                (rank - rlim).is_multiple_of(rpr)
            }
        };
        let makers: Vec<_> = (0..7).filter_map(|r| root_made_by(7, 3, r)).collect();
        assert_eq!(makers, [0, 1, 2]);
        assert_eq!(root_made_by(7, 3, 3), Some(1));
        for n in 1..40 {
            for ids in 1..=n {
                for r in 0..n {
                    assert_eq!(root_made_by(n, ids, r).is_some(), has_root(r, n, ids));
                }
            }
        }
        assert_eq!(root_made_by(4, 0, 0), None);
        assert_eq!(root_made_by(4, 5, 0), None);
    }
}
