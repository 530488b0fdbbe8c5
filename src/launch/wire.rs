//! The rendezvous wire format: length-prefixed frames, HMAC-SHA-256, nonces.
//!
//! Every frame is a big-endian `u32` length followed by that many bytes, at most
//! [`MAX_FRAME`]; a longer prefix is refused before anything is allocated.

use sha2::{Digest, Sha256};
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

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

/// Most connections a server handles at once; more are refused with `R_BUSY` at once.
pub(crate) const MAX_CONNECTIONS: usize = 256;

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

/// Puts an accepted or connected stream in blocking mode with every read and write bounded
/// by `t`.
pub(crate) fn bound_waits(s: &TcpStream, t: Duration) -> io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(t))?;
    s.set_write_timeout(Some(t))?;
    let _ = s.set_nodelay(true);
    Ok(())
}

/// Accepts at most one connection from the non-blocking `listener` and hands it to
/// `handle` on its own thread (errors of `handle` only drop that peer). Over
/// [`MAX_CONNECTIONS`] open ones, the peer gets a `R_BUSY` refusal instead. With nothing to
/// accept (or a transient error such as `EMFILE`) it sleeps 5 ms.
pub(crate) fn accept_one(
    listener: &TcpListener,
    active: &Arc<AtomicUsize>,
    thread_name: &str,
    handle: impl FnOnce(TcpStream) + Send + 'static,
) {
    match listener.accept() {
        Ok((mut stream, _peer)) => {
            if active.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
                let _ = stream.set_write_timeout(Some(Duration::from_millis(100)));
                let _ = write_frame(&mut stream, &refuse(R_BUSY, 0, 0));
                return;
            }
            active.fetch_add(1, Ordering::SeqCst);
            let active2 = Arc::clone(active);
            let spawned = thread::Builder::new()
                .name(thread_name.into())
                .spawn(move || {
                    handle(stream);
                    active2.fetch_sub(1, Ordering::SeqCst);
                });
            if spawned.is_err() {
                active.fetch_sub(1, Ordering::SeqCst);
            }
        }
        Err(_) => thread::sleep(Duration::from_millis(5)),
    }
}

/// Server side of the handshake, step 1: sends `HELLO` with `magic` and a fresh server
/// nonce, which it returns.
pub(crate) fn send_hello(s: &mut impl Write, magic: &[u8; 16]) -> io::Result<[u8; N]> {
    let sn = nonce()?;
    let mut hello = vec![HELLO];
    hello.extend_from_slice(magic);
    hello.extend_from_slice(&sn);
    write_frame(s, &hello)?;
    Ok(sn)
}

/// Client side, step 1: the server nonce of a `HELLO` frame carrying `magic`.
pub(crate) fn parse_hello(frame: &[u8], magic: &[u8; 16]) -> Option<[u8; N]> {
    if frame.len() != 1 + magic.len() + N || frame[0] != HELLO || &frame[1..17] != magic {
        return None;
    }
    let mut sn = [0u8; N];
    sn.copy_from_slice(&frame[17..]);
    Some(sn)
}

/// Client side, step 2: the `AUTH` frame proving the token for `rank` of `world`.
pub(crate) fn auth_frame(
    token: &[u8],
    sn: &[u8; N],
    cn: &[u8; N],
    rank: u32,
    world: u32,
) -> Vec<u8> {
    let mut auth = vec![AUTH];
    auth.extend_from_slice(&rank.to_be_bytes());
    auth.extend_from_slice(&world.to_be_bytes());
    auth.extend_from_slice(cn);
    auth.extend_from_slice(&client_mac(token, sn, cn, rank, world));
    auth
}

/// What an authenticated client claimed.
pub(crate) struct Auth {
    pub rank: u32,
    pub world: u32,
    pub cn: [u8; N],
}

/// Server side, step 2: reads the `AUTH` frame. `Ok(None)`: well-formed, but the peer does
/// not hold the token; `Err`: not an `AUTH` frame at all (drop the peer).
pub(crate) fn read_auth(s: &mut impl Read, token: &[u8], sn: &[u8; N]) -> io::Result<Option<Auth>> {
    let auth = read_frame(s)?;
    if auth.len() != 1 + 4 + 4 + N + N || auth[0] != AUTH {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not an authentication frame",
        ));
    }
    let rank = u32::from_be_bytes([auth[1], auth[2], auth[3], auth[4]]);
    let world = u32::from_be_bytes([auth[5], auth[6], auth[7], auth[8]]);
    let mut cn = [0u8; N];
    cn.copy_from_slice(&auth[9..9 + N]);
    if !ct_eq(&auth[9 + N..], &client_mac(token, sn, &cn, rank, world)) {
        return Ok(None);
    }
    Ok(Some(Auth { rank, world, cn }))
}

/// A `REFUSE` frame with its code and two numbers.
pub(crate) fn refuse(code: u8, a: u32, b: u32) -> Vec<u8> {
    let mut v = vec![REFUSE, code];
    v.extend_from_slice(&a.to_be_bytes());
    v.extend_from_slice(&b.to_be_bytes());
    v
}

/// The code and numbers of a `REFUSE` frame.
pub(crate) fn parse_refuse(frame: &[u8]) -> Option<(u8, usize, usize)> {
    if frame.len() != 10 || frame[0] != REFUSE {
        return None;
    }
    let a = u32::from_be_bytes([frame[2], frame[3], frame[4], frame[5]]) as usize;
    let b = u32::from_be_bytes([frame[6], frame[7], frame[8], frame[9]]) as usize;
    Some((frame[1], a, b))
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
