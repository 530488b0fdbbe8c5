//! The key of a clique: a hash of its unique id (plus the split path for children), the
//! same in every process. Also the teardown lane of a host-provider family, so it is kept
//! without the `diag` feature too.

use std::hash::{Hash, Hasher};

/// The process-wide key of a clique.
pub(crate) type CliqueKey = u64;

/// The key of a clique, from its unique id's bytes (and, for children, the parent's key and
/// the split). Ranks in different processes (different binaries, even) must compute the
/// same key, since it names the clique on the job's desync board: FNV-1a, whose output is
/// fixed, unlike `DefaultHasher`'s, which may change between Rust releases.
pub(crate) fn key_of(parts: impl Hash) -> CliqueKey {
    let mut h = Fnv1a(0xcbf2_9ce4_8422_2325);
    parts.hash(&mut h);
    h.finish()
}

/// 64-bit FNV-1a.
struct Fnv1a(u64);

impl Hasher for Fnv1a {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// The key of the clique that rank `rank` of `world_size` joins through unique id `id`. A
/// unique id made under `NCCL_COMM_ID` (it starts with [`nccl_sys::NCCL_MAGIC`]) is the
/// same for every communicator of the job, so those this rank creates through it (one
/// after another, as NCCL's bootstrap allows) are told apart by their size and their order:
/// the `n`-th of a size, on every rank, forms one clique. Counted per rank index, so that
/// ranks in threads of one process count apart, and only for such ids, so the count stays
/// as small as the ranks. It assumes what NCCL's bootstrap does, that every rank creates
/// the communicators of that id in the same order; a process that starts again (not the
/// whole job) counts from 0, and its diagnostics then name a clique apart from its peers'.
pub(crate) fn of_id(id: &[u8], rank: usize, world_size: usize) -> CliqueKey {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    let key = key_of(id);
    let fixed = id.first_chunk().map(|m| u64::from_ne_bytes(*m)) == Some(nccl_sys::NCCL_MAGIC);
    if !fixed {
        return key;
    }
    static MADE: Mutex<BTreeMap<(CliqueKey, usize, usize), u64>> = Mutex::new(BTreeMap::new());
    let mut made = crate::teardown::lock(&MADE);
    let n = made.entry((key, rank, world_size)).or_insert(0);
    *n += 1;
    key_of((key, world_size, *n - 1))
}

/// A fresh key, for cliques created in one call (`ncclCommInitAll`).
pub(crate) fn fresh_key() -> CliqueKey {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(1);
    key_of((
        "nccl-safe init_all",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clique_keys_are_fnv1a_of_the_hashed_bytes() {
        let fnv = |bytes: &[u8]| {
            bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
                (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
            })
        };
        // FNV-1a's published test vector.
        assert_eq!(fnv(b"a"), 0xaf63_dc4c_8601_ec8c);
        // A slice hashes as its length (a native-endian usize) and then its bytes.
        let id = [7u8, 1, 200, 3];
        let mut stream = id.len().to_ne_bytes().to_vec();
        stream.extend_from_slice(&id);
        assert_eq!(key_of(&id[..]), fnv(&stream));
        assert_ne!(key_of(&id[..]), key_of(&[7u8, 1, 200, 4][..]));
    }
}
