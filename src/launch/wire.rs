//! The rendezvous wire format: length-prefixed frames, HMAC-SHA-256, nonces.
//!
//! Every frame is a big-endian `u32` length followed by that many bytes, at most
//! [`MAX_FRAME`]; a longer prefix is refused before anything is allocated.

use sha2::{Digest, Sha256};
use std::io::{self, Read, Write};

/// Largest frame body either side accepts.
pub(crate) const MAX_FRAME: usize = 4096;
/// Magic and protocol version at the start of the server's hello.
pub(crate) const MAGIC: &[u8; 16] = b"nccl-safe-rdzv/1";
/// Length of nonces and MACs.
pub(crate) const N: usize = 32;

/// Frame kinds (the first body byte).
pub(crate) const HELLO: u8 = 1;
pub(crate) const AUTH: u8 = 2;
pub(crate) const ID: u8 = 3;
pub(crate) const REFUSE: u8 = 4;
pub(crate) const ACK: u8 = 5;

/// Refusal codes carried in a REFUSE frame.
pub(crate) const R_TOKEN: u8 = 1;
pub(crate) const R_WORLD: u8 = 2;
pub(crate) const R_RANGE: u8 = 3;
pub(crate) const R_DUPLICATE: u8 = 4;
pub(crate) const R_BUSY: u8 = 5;

pub(crate) fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len())
        .ok()
        .filter(|&l| l as usize <= MAX_FRAME)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&len.to_be_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)?;
    w.flush()
}

pub(crate) fn read_frame(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame length {len} exceeds the {MAX_FRAME}-byte limit"),
        ));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(body)
}

/// HMAC-SHA-256 (RFC 2104) of the concatenation of `parts` under `key`.
pub(crate) fn hmac(key: &[u8], parts: &[&[u8]]) -> [u8; N] {
    const BLOCK: usize = 64;
    let mut k = [0u8; BLOCK];
    if key.len() > BLOCK {
        k[..N].copy_from_slice(&Sha256::digest(key));
    } else {
        k[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(k.map(|b| b ^ 0x36));
    for p in parts {
        inner.update(p);
    }
    let mut outer = Sha256::new();
    outer.update(k.map(|b| b ^ 0x5c));
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// Compares two byte strings in time that depends only on their lengths.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// 32 unpredictable bytes from the operating system.
pub(crate) fn nonce() -> io::Result<[u8; N]> {
    let mut n = [0u8; N];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut n)?;
    Ok(n)
}

/// The MAC a client proves it holds the token with.
pub(crate) fn client_mac(
    token: &[u8],
    sn: &[u8; N],
    cn: &[u8; N],
    rank: u32,
    world: u32,
) -> [u8; N] {
    hmac(
        token,
        &[b"client", sn, cn, &rank.to_be_bytes(), &world.to_be_bytes()],
    )
}

/// The MAC the server proves it holds the token with, over the encrypted id.
pub(crate) fn server_mac(
    token: &[u8],
    sn: &[u8; N],
    cn: &[u8; N],
    rank: u32,
    world: u32,
    ct: &[u8],
) -> [u8; N] {
    hmac(
        token,
        &[
            b"server",
            sn,
            cn,
            &rank.to_be_bytes(),
            &world.to_be_bytes(),
            ct,
        ],
    )
}

/// XORs `id` with a keystream derived from the token and both nonces (HMAC in counter
/// mode), so the id does not cross the network in clear. Its own inverse.
pub(crate) fn mask(token: &[u8], sn: &[u8; N], cn: &[u8; N], id: &[u8; 128]) -> [u8; 128] {
    let mut out = *id;
    for (i, chunk) in out.chunks_mut(N).enumerate() {
        let ks = hmac(token, &[b"stream", sn, cn, &(i as u32).to_be_bytes()]);
        for (o, k) in chunk.iter_mut().zip(ks) {
            *o ^= k;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn hmac_matches_rfc4231() {
        // Test case 1 and 2 of RFC 4231.
        assert_eq!(
            hex(&hmac(&[0x0b; 20], &[b"Hi There"])),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
        );
        assert_eq!(
            hex(&hmac(b"Jefe", &[b"what do ya want ", b"for nothing?"])),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // Test case 6: a key longer than the block is hashed first.
        assert_eq!(
            hex(&hmac(
                &[0xaa; 131],
                &[b"Test Using Larger Than Block-Size Key - Hash Key First"]
            )),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }

    #[test]
    fn frames_round_trip_and_bound_length() {
        let mut buf = Vec::new();
        write_frame(&mut buf, b"abc").unwrap();
        assert_eq!(read_frame(&mut &buf[..]).unwrap(), b"abc");
        let huge = u32::MAX.to_be_bytes();
        assert_eq!(
            read_frame(&mut &huge[..]).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
        assert!(write_frame(&mut Vec::new(), &[0; MAX_FRAME + 1]).is_err());
    }

    #[test]
    fn mask_is_an_involution() {
        let id = [7u8; 128];
        let (sn, cn) = (nonce().unwrap(), nonce().unwrap());
        let m = mask(b"t", &sn, &cn, &id);
        assert_ne!(m, id);
        assert_eq!(mask(b"t", &sn, &cn, &m), id);
    }
}
