//! The desync board across processes: rank 0 hosts it, ranks post what they were last
//! doing, every process fetches every rank's latest post; a wrong token gets nothing, and
//! garbage does not stop it. Loopback only; every wait is bounded.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nccl_launch::desync::{BoardClient, DesyncBoard};
use nccl_launch::rendezvous::{Refusal, RendezvousError};
use nccl_safe::diag::DesyncPost;

const CHILD: &str = "NCCL_SAFE_TEST_BOARD_CHILD";
const TOKEN: &str = "board-test-token";
const WORLD: usize = 3;

fn summary(rank: usize) -> DesyncPost {
    DesyncPost::new(
        42,
        rank as u64 + 5,
        &format!(
            "ncclAllReduce(f32 x 4) seq {} at train.rs:{rank}0 (in progress)",
            rank + 4
        ),
    )
}

/// Runs only inside the child processes spawned below.
#[test]
#[ignore = "run as a child process by the test below"]
fn child_board_rank() {
    let Some(rank) = std::env::var(CHILD)
        .ok()
        .and_then(|r| r.parse::<usize>().ok())
    else {
        panic!("run only as a child process ({CHILD} unset)");
    };
    let addr = std::env::var("BOARD_ADDR").unwrap();
    let board = (rank == 0).then(|| DesyncBoard::serve(&addr, WORLD, TOKEN).unwrap());
    let client = BoardClient::new(&addr, WORLD, TOKEN);
    let deadline = Instant::now() + Duration::from_secs(8);
    // Rank 1 is "behind": it posts nothing. The others retry until rank 0's board is up.
    if rank != 1 {
        while let Err(e) = client.post(rank, &summary(rank)) {
            assert!(Instant::now() < deadline, "rank {rank} could not post: {e}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let posts = loop {
        match client.fetch() {
            Ok(p) if p[0].is_some() && p[2].is_some() => break p,
            r => assert!(Instant::now() < deadline, "rank {rank}: {r:?}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    for (r, p) in posts.iter().enumerate() {
        match p {
            Some(p) => println!("\n@@POST {r} {} {} {}", p.clique, p.issued, p.text),
            None => println!("\n@@NONE {r}"),
        }
    }
    if let Some(board) = board {
        // Serve until the parent says the others are done (closes our stdin).
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        board.stop();
    }
}

#[test]
fn three_processes_see_each_others_posts_and_none_for_the_silent_rank() {
    let start = Instant::now();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let exe = std::env::current_exe().unwrap();
    let mut children: Vec<_> = (0..WORLD)
        .map(|rank| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "child_board_rank",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD, rank.to_string())
                .env("BOARD_ADDR", format!("127.0.0.1:{port}"))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Ranks 1 and 2 finish on their own (bounded by their 8 s deadline); then rank 0 may stop.
    let mut outs = vec![None, None, None];
    for r in [1, 2, 0] {
        if r == 0 {
            drop(children[0].stdin.take());
        }
        let c = std::mem::replace(&mut children[r], Command::new("true").spawn().unwrap());
        outs[r] = Some(c.wait_with_output().unwrap());
    }
    for (rank, out) in outs.into_iter().enumerate() {
        let out = out.unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "rank {rank}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        for r in 0..WORLD {
            if r == 1 {
                assert!(stdout.contains("@@NONE 1\n"), "rank {rank}: {stdout}");
            } else {
                let p = summary(r);
                let line = format!("@@POST {r} {} {} {}\n", p.clique, p.issued, p.text);
                assert!(stdout.contains(&line), "rank {rank} lacks {line}: {stdout}");
            }
        }
    }
    assert!(
        start.elapsed() < Duration::from_secs(12),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn wrong_token_gets_nothing_and_garbage_is_dropped() {
    let board = DesyncBoard::serve("127.0.0.1:0", 2, TOKEN).unwrap();
    let addr = board.local_addr().to_string();
    let good = BoardClient::new(&addr, 2, TOKEN);
    good.post(1, &summary(1)).unwrap();

    // The wrong-token refusal proves nothing (a server without the token can send it), so
    // the client tries until its deadline, and says what the board answered.
    let bad = BoardClient::new(&addr, 2, "not-the-job-token-at-all")
        .io_timeout(Duration::from_millis(200));
    for r in [bad.fetch().map(|_| ()), bad.post(0, &summary(0))] {
        match &r {
            Err(RendezvousError::BoardTimeout { last_error, .. }) => {
                assert!(last_error.contains(&Refusal::BadToken.to_string()), "{r:?}")
            }
            _ => panic!("not a BoardTimeout: {r:?}"),
        }
    }
    let wrong_world = BoardClient::new(&addr, 3, TOKEN).fetch();
    assert!(matches!(
        wrong_world,
        Err(RendezvousError::Refused {
            reason: Refusal::WorldSizeMismatch { .. },
            ..
        })
    ));
    assert!(good.post(2, &summary(0)).is_err(), "rank out of range");

    let send = |bytes: &[u8]| {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let _ = s.write_all(bytes);
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink); // the board closes on us
        sink.len()
    };
    let t = Instant::now();
    // A 4 GiB length prefix, an HTTP request, a well-sized frame of nonsense.
    assert!(send(&[0xff, 0xff, 0xff, 0xff, 1, 2, 3]) < 100);
    assert!(send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n") < 100);
    assert!(send(&[0, 0, 0, 3, 9, 9, 9]) < 100);
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // A silent peer does not hold up the others.
    let _silent = TcpStream::connect(&addr).unwrap();
    let posts = good.fetch().unwrap();
    assert_eq!(
        posts,
        vec![None, Some(summary(1))],
        "the bad token posted nothing"
    );
    board.stop();
    assert!(
        TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_millis(500)).is_err(),
        "listener still open after stop"
    );
}

/// End to end on the host provider: a communicator given the board by
/// `Config::desync_board` posts its ranks' last operations when the watchdog fires (and
/// not before), and its report still names the rank that is behind.
#[test]
fn a_timeout_posts_each_ranks_last_operation_to_the_board() {
    use nccl_safe::{CommDevice, Communicator, Config, ReduceOp, Stream};
    let board = DesyncBoard::serve("127.0.0.1:0", 2, TOKEN).unwrap();
    let client = BoardClient::new(board.local_addr().to_string(), 2, TOKEN);
    let timeout = Duration::from_millis(500);
    let config = Config::new().timeout(timeout).desync_board(client.clone());
    let id = CommDevice::Host.unique_id().unwrap();
    let start = Instant::now();
    let errors: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|rank| {
                let (id, config, client) = (&id, &config, &client);
                s.spawn(move || {
                    let comm =
                        Communicator::init_rank(&CommDevice::Host, 2, rank, id, config).unwrap();
                    let mut x = vec![1.0f32; 4];
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host)
                        .unwrap();
                    // Healthy operations post nothing.
                    assert_eq!(client.fetch().unwrap(), vec![None, None]);
                    if rank == 1 {
                        std::thread::sleep(timeout + Duration::from_millis(300));
                        return String::new();
                    }
                    let e = comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &Stream::Host);
                    e.unwrap_err().to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert!(errors[0].contains("rank 1: BEHIND"), "{}", errors[0]);
    let posts = client.fetch().unwrap();
    let (p0, p1) = (posts[0].as_ref().unwrap(), posts[1].as_ref().unwrap());
    assert_eq!((p0.issued, p1.issued), (2, 1), "{posts:?}");
    assert!(
        p0.text
            .starts_with("ncclAllReduce(float x 4) seq 1 at tests/desync_board.rs:"),
        "{p0:?}"
    );
    assert!(
        p1.text.contains("seq 0") && p1.text.contains("(completed)"),
        "{p1:?}"
    );
    assert_eq!(p0.clique, p1.clique);
}

/// A post is text from another process: terminal escapes, carriage returns and
/// bidirectional overrides in it are replaced before anyone prints it.
#[test]
fn control_characters_in_posts_are_replaced_where_they_are_received() {
    let board = DesyncBoard::serve("127.0.0.1:0", 2, TOKEN).unwrap();
    let client = BoardClient::new(board.local_addr().to_string(), 2, TOKEN);
    let evil = DesyncPost {
        clique: 42,
        issued: 3,
        text: "seq 3\u{1b}[2J\u{1b}]0;owned\u{7} at \u{202e}sr.niart\u{9b}1m\u{0}".into(),
        left: false,
    };
    client.post(1, &evil).unwrap();
    let got = client.fetch().unwrap()[1].clone().unwrap();
    assert_eq!(got.text, "seq 3?[2J?]0;owned? at ?sr.niart?1m?");
    assert!(!got.text.chars().any(char::is_control), "{:?}", got.text);
    assert_eq!((got.clique, got.issued), (42, 3));
}

/// A busy board (its busy refusal comes in place of the hello) is retried until the
/// client's deadline, not read as a protocol error.
#[test]
fn a_busy_board_is_retried() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let client = BoardClient::new(addr.to_string(), 2, TOKEN);
    let c2 = client.clone();
    let poster = std::thread::spawn(move || c2.post(1, &summary(1)));
    for _ in 0..2 {
        let (mut s, _) = listener.accept().unwrap();
        s.write_all(&[0, 0, 0, 10, 4, 5, 0, 0, 0, 0, 0, 0, 0, 0])
            .unwrap();
    }
    drop(listener);
    let board = DesyncBoard::serve(addr, 2, TOKEN).unwrap();
    poster.join().unwrap().unwrap();
    assert_eq!(client.fetch().unwrap(), vec![None, Some(summary(1))]);
    board.stop();
}

#[test]
fn a_board_clients_debug_output_never_shows_the_token() {
    let shown = format!("{:?}", BoardClient::new("127.0.0.1:1", 2, TOKEN));
    assert!(!shown.contains(TOKEN), "{shown}");
    assert!(shown.contains("<redacted>"), "{shown}");
}

// ---- strangers on the node ------------------------------------------------------------

fn free_addr() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body)?;
    Ok(body)
}

fn write_frame(s: &mut TcpStream, body: &[u8]) -> std::io::Result<()> {
    s.write_all(&(body.len() as u32).to_be_bytes())?;
    s.write_all(body)
}

/// A post made before rank 0's board listens (its connection refused) is retried until
/// the post's deadline, not given up at the first refused connect.
#[test]
fn a_post_before_the_board_listens_is_retried() {
    let addr = free_addr();
    let client = BoardClient::new(addr.to_string(), 2, TOKEN).io_timeout(Duration::from_secs(1));
    let c2 = client.clone();
    let poster = std::thread::spawn(move || c2.post(1, &summary(1)));
    std::thread::sleep(Duration::from_millis(300));
    let board = DesyncBoard::serve(addr, 2, TOKEN).unwrap();
    poster.join().unwrap().unwrap();
    assert_eq!(client.fetch().unwrap(), vec![None, Some(summary(1))]);
    board.stop();
}

/// A server on the board's address that does not hold the token (a squatter before rank 0
/// binds, a relay) answers with the wrong-token refusal: that proves nothing, so the post
/// is retried and reaches the real board once it listens there.
#[test]
fn an_unauthenticated_refusal_from_the_board_is_retried() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let client = BoardClient::new(addr.to_string(), 2, TOKEN).io_timeout(Duration::from_secs(1));
    let c2 = client.clone();
    let t0 = Instant::now();
    let poster = std::thread::spawn(move || c2.post(1, &summary(1)));
    listener.set_nonblocking(true).unwrap();
    for _ in 0..2 {
        let mut s = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(_) if t0.elapsed() < Duration::from_secs(5) && !poster.is_finished() => {
                    std::thread::sleep(Duration::from_millis(2))
                }
                Err(_) => panic!("the poster gave up: {:?}", poster.join().unwrap()),
            }
        };
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let hello = [&[1u8][..], b"nccl-safe-board1", &[7u8; 32]].concat();
        write_frame(&mut s, &hello).unwrap();
        let _auth = read_frame(&mut s).unwrap();
        write_frame(&mut s, &[4, 1, 0, 0, 0, 0, 0, 0, 0, 0]).unwrap();
    }
    drop(listener);
    let board = DesyncBoard::serve(addr, 2, TOKEN).unwrap();
    let posted = poster.join().unwrap();
    posted.unwrap_or_else(|e| panic!("after {:?}: {e}", t0.elapsed()));
    assert_eq!(client.fetch().unwrap(), vec![None, Some(summary(1))]);
    board.stop();
}

/// The MACs name their protocol: a rank's AUTH frame for the board, relayed to the
/// rendezvous under the rendezvous's own challenge, is a wrong token there (so a relay
/// cannot spend a rank's board connection on the rendezvous).
#[test]
fn the_rendezvous_does_not_take_a_boards_auth_frame() {
    use nccl_launch::rendezvous::TcpRendezvous;
    let server = TcpRendezvous::new("127.0.0.1", 0, TOKEN)
        .timeout(Duration::from_secs(5))
        .serve(2, [5u8; 128])
        .unwrap();
    let relay = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let client = BoardClient::new(relay.local_addr().unwrap().to_string(), 2, TOKEN)
        .io_timeout(Duration::from_millis(500));
    let poster = std::thread::spawn(move || client.post(1, &summary(1)));
    let (mut c, _) = relay.accept().unwrap();
    let mut s = TcpStream::connect(server.local_addr()).unwrap();
    for x in [&mut c, &mut s] {
        x.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    }
    let mut hello = read_frame(&mut s).unwrap();
    hello[1..17].copy_from_slice(b"nccl-safe-board1");
    write_frame(&mut c, &hello).unwrap();
    let auth = read_frame(&mut c).unwrap();
    write_frame(&mut s, &auth).unwrap();
    let reply = read_frame(&mut s).unwrap();
    assert!(
        reply.len() == 10 && reply[..2] == [4, 1],
        "the rendezvous took the board's AUTH frame and answered kind {} ({} bytes)",
        reply[0],
        reply.len()
    );
    drop((c, relay));
    let _ = poster.join().unwrap();
    server.stop();
}

const EXIT_CHILD: &str = "NCCL_SAFE_TEST_BOARD_EXIT_CHILD";

/// Rank 0 hosting the board: serves it on the address the parent gives, and when the
/// parent writes a line, ends the process (its exit guard installed by a communicator's
/// teardown).
#[test]
#[ignore = "run as a child process by the test below"]
fn child_board_host_that_exits() {
    use nccl_safe::{CommDevice, Communicator, Config};
    let Ok(addr) = std::env::var(EXIT_CHILD) else {
        panic!("run only as a child process ({EXIT_CHILD} unset)");
    };
    let id = CommDevice::Host.unique_id().unwrap();
    drop(Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &Config::new()).unwrap());
    let board = DesyncBoard::serve(addr.as_str(), 2, TOKEN).unwrap();
    println!("\n@@SERVING");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    board.stop();
    println!("\n@@EXITING");
}

/// A stranger's connection to the board, which never authenticates, does not hold up the
/// exit of rank 0's process: only a token holder's request is waited for.
#[test]
fn a_strangers_connection_does_not_hold_up_rank_0s_exit() {
    use std::io::BufRead;
    let addr = free_addr();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_board_host_that_exits",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(EXIT_CHILD, addr.to_string())
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut wait_for = |mark: &str| {
        let mut line = String::new();
        while !line.starts_with(mark) {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "no {mark}");
        }
    };
    wait_for("@@SERVING");
    // The stranger connects and reads the hello: the board is serving it.
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    read_frame(&mut s).unwrap();
    child.stdin.as_mut().unwrap().write_all(b"exit\n").unwrap();
    wait_for("@@EXITING");
    let t0 = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the child did not exit"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    let took = t0.elapsed();
    assert!(status.success(), "{status}");
    assert!(
        took < Duration::from_millis(500),
        "the exit waited {took:?}"
    );
    drop(s);
}
