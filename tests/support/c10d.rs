//! A c10d `TCPStore` server written from PyTorch's protocol (query types of
//! `TCPStoreBackend.hpp`, little-endian numbers, `u64`-length-prefixed strings), for tests
//! on loopback. It can also misbehave: answer garbage, close mid-answer, or never answer.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

pub const MAGIC: u32 = 0x3C85_F7CE;

/// How the server answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// As PyTorch's server does.
    Honest,
    /// Every answer is replaced by bytes of 0x5a of the same length (a ping's nonce comes
    /// back wrong, a check answers 0x5a, ...).
    Garbage,
    /// Sends half of each answer, then closes the connection.
    Truncate,
    /// Reads queries but never answers.
    Silent,
    /// Answers a GET or COMPARE_SET with a length prefix of `u64::MAX` and nothing more.
    HugeLength,
    /// As a server of a PyTorch release without `PING` and `CANCEL_WAIT`: drops a client
    /// that sends either (an unknown query), and a wait goes on until its keys are set.
    NoPing,
}

#[derive(Default)]
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    /// Every byte each connection sent, in order of connection.
    received: Mutex<Vec<Vec<u8>>>,
}

/// A running store server; stops (within ~50 ms) when dropped.
pub struct FakeStore {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    mode: Arc<Mutex<Mode>>,
}

impl FakeStore {
    /// Listens on a free port of 127.0.0.1.
    pub fn start(mode: Mode) -> FakeStore {
        Self::on(TcpListener::bind("127.0.0.1:0").unwrap(), mode)
    }

    /// Serves on `listener`.
    pub fn on(listener: TcpListener, mode: Mode) -> FakeStore {
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let shared = Arc::new(Shared::default());
        let stop = Arc::new(AtomicBool::new(false));
        let mode = Arc::new(Mutex::new(mode));
        let (sh, st, md) = (Arc::clone(&shared), Arc::clone(&stop), Arc::clone(&mode));
        thread::spawn(move || {
            while !st.load(Ordering::Acquire) {
                match listener.accept() {
                    Ok((s, _)) => {
                        let (sh, st, md) = (Arc::clone(&sh), Arc::clone(&st), Arc::clone(&md));
                        let index = {
                            let mut r = sh.received.lock().unwrap();
                            r.push(Vec::new());
                            r.len() - 1
                        };
                        thread::spawn(move || {
                            let _ = serve(s, &sh, &st, &md, index);
                        });
                    }
                    Err(_) => thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        FakeStore {
            addr,
            shared,
            stop,
            mode,
        }
    }

    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn set_mode(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }

    /// The value under `key`, if set.
    pub fn value(&self, key: &str) -> Option<Vec<u8>> {
        self.shared.map.lock().unwrap().get(key).cloned()
    }

    /// Sets `key` directly.
    pub fn put(&self, key: &str, value: &[u8]) {
        self.shared
            .map
            .lock()
            .unwrap()
            .insert(key.into(), value.to_vec());
        self.shared.changed.notify_all();
    }

    /// The keys set so far.
    pub fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = self.shared.map.lock().unwrap().keys().cloned().collect();
        k.sort();
        k
    }

    /// What each connection sent so far.
    pub fn received(&self) -> Vec<Vec<u8>> {
        self.shared.received.lock().unwrap().clone()
    }
}

impl Drop for FakeStore {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.shared.changed.notify_all();
    }
}

struct Conn<'a> {
    s: TcpStream,
    shared: &'a Shared,
    index: usize,
}

impl Conn<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<()> {
        self.s.read_exact(buf)?;
        self.shared.received.lock().unwrap()[self.index].extend_from_slice(buf);
        Ok(())
    }
    fn u8(&mut self) -> io::Result<u8> {
        let mut b = [0u8; 1];
        self.read(&mut b)?;
        Ok(b[0])
    }
    fn u32(&mut self) -> io::Result<u32> {
        let mut b = [0u8; 4];
        self.read(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    fn u64(&mut self) -> io::Result<u64> {
        let mut b = [0u8; 8];
        self.read(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    fn bytes(&mut self) -> io::Result<Vec<u8>> {
        let n = self.u64()?;
        if n > 1 << 24 {
            return Err(io::Error::other("too long"));
        }
        let mut v = vec![0u8; n as usize];
        self.read(&mut v)?;
        Ok(v)
    }
    fn string(&mut self) -> io::Result<String> {
        String::from_utf8(self.bytes()?).map_err(io::Error::other)
    }
    fn keys(&mut self) -> io::Result<Vec<String>> {
        let n = self.u64()?;
        if n > 1 << 16 {
            return Err(io::Error::other("too many keys"));
        }
        (0..n).map(|_| self.string()).collect()
    }
}

fn vec_answer(v: &[u8]) -> Vec<u8> {
    let mut a = (v.len() as u64).to_le_bytes().to_vec();
    a.extend_from_slice(v);
    a
}

fn serve(
    s: TcpStream,
    shared: &Shared,
    stop: &AtomicBool,
    mode: &Mutex<Mode>,
    index: usize,
) -> io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(Duration::from_millis(50)))?;
    let mut c = Conn { s, shared, index };
    loop {
        if stop.load(Ordering::Acquire) {
            return Ok(());
        }
        let q = match c.u8() {
            Ok(q) => q,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(e) => return Err(e),
        };
        c.s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let answer: Option<Vec<u8>> = match q {
            0 => {
                if c.u32()? != MAGIC {
                    return Ok(()); // PyTorch closes a client with a wrong magic
                }
                None
            }
            1 => {
                let k = c.string()?;
                let v = c.bytes()?;
                shared.map.lock().unwrap().insert(k, v);
                shared.changed.notify_all();
                None
            }
            2 => {
                let k = c.string()?;
                let expected = c.bytes()?;
                let desired = c.bytes()?;
                let mut m = shared.map.lock().unwrap();
                let now = match m.get(&k) {
                    None if expected.is_empty() => {
                        m.insert(k, desired.clone());
                        desired
                    }
                    None => expected,
                    Some(v) if *v == expected => {
                        m.insert(k, desired.clone());
                        desired
                    }
                    Some(v) => v.clone(),
                };
                shared.changed.notify_all();
                Some(vec_answer(&now))
            }
            3 => {
                let k = c.string()?;
                let v = shared
                    .map
                    .lock()
                    .unwrap()
                    .get(&k)
                    .cloned()
                    .unwrap_or_default();
                Some(vec_answer(&v))
            }
            4 => {
                let k = c.string()?;
                let mut d = [0u8; 8];
                c.read(&mut d)?;
                let mut m = shared.map.lock().unwrap();
                let old: i64 = m
                    .get(&k)
                    .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
                    .unwrap_or(0);
                let new = old + i64::from_le_bytes(d);
                m.insert(k, new.to_string().into_bytes());
                shared.changed.notify_all();
                Some(new.to_le_bytes().to_vec())
            }
            5 => {
                let keys = c.keys()?;
                let m = shared.map.lock().unwrap();
                Some(vec![u8::from(!keys.iter().all(|k| m.contains_key(k)))])
            }
            6 => {
                let keys = c.keys()?;
                // Waits for the keys, or for CANCEL_WAIT from the client.
                c.s.set_read_timeout(Some(Duration::from_millis(20)))?;
                loop {
                    if stop.load(Ordering::Acquire) {
                        return Ok(());
                    }
                    let ready = {
                        let m = shared.map.lock().unwrap();
                        keys.iter().all(|k| m.contains_key(k))
                    };
                    if ready {
                        break Some(vec![0]);
                    }
                    match c.u8() {
                        Ok(12) if *mode.lock().unwrap() == Mode::NoPing => return Ok(()),
                        Ok(12) => break Some(vec![1]),
                        Ok(other) => {
                            return Err(io::Error::other(format!("query {other} during a wait")))
                        }
                        Err(e)
                            if matches!(
                                e.kind(),
                                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                            ) => {}
                        Err(e) => return Err(e),
                    }
                }
            }
            8 => {
                let k = c.string()?;
                let gone = shared.map.lock().unwrap().remove(&k).is_some();
                shared.changed.notify_all();
                Some(i64::from(gone).to_le_bytes().to_vec())
            }
            12 | 13 if *mode.lock().unwrap() == Mode::NoPing => return Ok(()),
            12 => Some(vec![1]), // a cancel with no wait running
            13 => Some(c.u32()?.to_le_bytes().to_vec()),
            _ => return Ok(()), // unknown query: PyTorch drops the client
        };
        c.s.set_read_timeout(Some(Duration::from_millis(50)))?;
        let Some(answer) = answer else { continue };
        let m = *mode.lock().unwrap();
        match m {
            Mode::Honest | Mode::NoPing => c.s.write_all(&answer)?,
            Mode::Garbage => c.s.write_all(&vec![0x5a; answer.len()])?,
            Mode::Truncate => {
                c.s.write_all(&answer[..answer.len() / 2])?;
                return Ok(());
            }
            Mode::Silent => {
                let until = Instant::now() + Duration::from_secs(30);
                while Instant::now() < until && !stop.load(Ordering::Acquire) {
                    thread::sleep(Duration::from_millis(20));
                }
                return Ok(());
            }
            Mode::HugeLength if q == 3 || q == 2 => c.s.write_all(&u64::MAX.to_le_bytes())?,
            Mode::HugeLength => c.s.write_all(&answer)?,
        }
    }
}
