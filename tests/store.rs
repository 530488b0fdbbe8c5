//! The c10d TCPStore client and the id exchange through torchrun's agent store, against a
//! store server written in the test from PyTorch's protocol (loopback only).

mod support;

use nccl_launch::env::ProcessEnv;
use nccl_launch::rendezvous::{Refusal, Rendezvous, RendezvousError, ID_LEN};
use nccl_launch::store::{StoreClient, StoreError, StoreRendezvous};
use std::time::{Duration, Instant};
use support::c10d::{FakeStore, Mode};

const T: Duration = Duration::from_secs(2);

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The bytes PyTorch 2.15's own `TCPStore` client sent to a store, captured on loopback:
/// its validation, then `set("k", b"vv")`, `get("k")`, ...: its C++ client puts `/` before
/// every key, and so does `StoreClient`, so the same names reach the same keys.
#[test]
fn requests_are_byte_for_byte_what_pytorch_sends() {
    let store = FakeStore::start(Mode::Honest);
    let mut c = StoreClient::connect(&store.addr(), T).unwrap();
    c.set("k", b"vv").unwrap();
    assert_eq!(c.get("k", T).unwrap(), b"vv");
    assert!(!c.check(&["k", "zz"]).unwrap());
    assert_eq!(c.add("n", 5).unwrap(), 5);
    assert_eq!(c.compare_set("k", b"vv", b"ww").unwrap(), b"ww");
    let sent = hex(&store.received()[0]);
    let expect = [
        "00cef7853c", // VALIDATE, magic
        "0d",         // PING (nonce follows)
    ];
    assert!(
        sent.starts_with(&(expect[0].to_string() + expect[1])),
        "{sent}"
    );
    let rest = &sent[(5 + 1 + 4) * 2..];
    let pytorch = [
        "0102000000000000002f6b02000000000000007676", // SET
        "06010000000000000002000000000000002f6b",     // WAIT (before GET)
        "0302000000000000002f6b",                     // GET
        "05020000000000000002000000000000002f6b03000000000000002f7a7a", // CHECK
        "0402000000000000002f6e0500000000000000",     // ADD
        "0202000000000000002f6b0200000000000000767602000000000000007777", // COMPARE_SET
    ]
    .concat();
    assert_eq!(rest, pytorch);
}

/// A key set by another client of the store under PyTorch's name (`/k`, what Python's
/// `store.set("k", ..)` sends) is `StoreClient`'s `k`, and the reverse.
#[test]
fn keys_are_named_as_pytorch_names_them() {
    let store = FakeStore::start(Mode::Honest);
    store.put("/from_python", b"py");
    let mut c = StoreClient::connect(&store.addr(), T).unwrap();
    assert_eq!(c.get("from_python", T).unwrap(), b"py");
    assert!(c.check(&["from_python"]).unwrap());
    c.set("from_rust", b"rs").unwrap();
    // (SET has no answer: a request with one orders it before the look at the server.)
    assert!(c.check(&["from_rust"]).unwrap());
    assert_eq!(store.value("/from_rust").unwrap(), b"rs");
    assert_eq!(c.add("count", 2).unwrap(), 2);
    assert_eq!(store.value("/count").unwrap(), b"2");
    assert_eq!(c.compare_set("from_rust", b"rs", b"x").unwrap(), b"x");
    assert_eq!(store.value("/from_rust").unwrap(), b"x");
    assert_eq!(store.keys(), ["/count", "/from_python", "/from_rust"]);
}

/// A server of a PyTorch release without `PING` and `CANCEL_WAIT` drops a client that
/// sends them: the client connects again without them, and a wait that times out moves to
/// a fresh connection instead of canceling.
#[test]
fn a_server_without_ping_is_spoken_to_without_it() {
    let store = FakeStore::start(Mode::NoPing);
    let mut c = StoreClient::connect(&store.addr(), T).unwrap();
    assert!(!c.answers_ping());
    c.ping().unwrap();
    c.set("a", b"1").unwrap();
    assert_eq!(c.get("a", T).unwrap(), b"1");
    let t0 = Instant::now();
    let err = c.wait(&["never"], Duration::from_millis(200)).unwrap_err();
    assert!(matches!(err, StoreError::WaitTimeout { .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    // The connection goes on, and the late answer of the abandoned wait never shows.
    store.put("/never", b"late");
    c.set("b", b"2").unwrap();
    assert!(c.check(&["b"]).unwrap());
    assert_eq!(c.get("b", T).unwrap(), b"2");
    assert_eq!(c.get("never", T).unwrap(), b"late");
    // The modern server is pinged, and keeps its connection after a canceled wait.
    let modern = FakeStore::start(Mode::Honest);
    assert!(StoreClient::connect(&modern.addr(), T)
        .unwrap()
        .answers_ping());
}

#[test]
fn set_get_add_check_wait_round_trip() {
    let store = FakeStore::start(Mode::Honest);
    let mut c = StoreClient::connect(&store.addr(), T).unwrap();
    assert!(!c.check(&["a"]).unwrap());
    c.set("a", &[1, 2, 3]).unwrap();
    assert!(c.check(&["a"]).unwrap());
    assert_eq!(c.get("a", T).unwrap(), [1, 2, 3]);
    assert_eq!(c.add("counter", 3).unwrap(), 3);
    assert_eq!(c.add("counter", -1).unwrap(), 2);
    // On the server, under PyTorch's name for it.
    assert_eq!(store.value("/counter").unwrap(), b"2");
    assert_eq!(store.value("counter"), None);
    // A wait on a key another connection sets later ends when it is set.
    let addr = store.addr();
    let setter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        StoreClient::connect(&addr, T)
            .unwrap()
            .set("later", b"x")
            .unwrap();
    });
    c.wait(&["a", "later"], Duration::from_secs(5)).unwrap();
    setter.join().unwrap();
    c.ping().unwrap();
}

#[test]
fn a_wait_that_times_out_is_canceled_and_the_connection_goes_on() {
    let store = FakeStore::start(Mode::Honest);
    let mut c = StoreClient::connect(&store.addr(), T).unwrap();
    let t0 = Instant::now();
    let err = c.wait(&["never"], Duration::from_millis(300)).unwrap_err();
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "{took:?}"
    );
    assert!(matches!(err, StoreError::WaitTimeout { .. }), "{err}");
    assert!(err.to_string().contains(&store.addr()), "{err}");
    // The cancel was answered, so the stream is in step: later requests work.
    c.set("k", b"v").unwrap();
    assert_eq!(c.get("k", T).unwrap(), b"v");
}

#[test]
fn a_silent_store_times_out_naming_its_address() {
    let store = FakeStore::start(Mode::Silent);
    let t0 = Instant::now();
    let err = StoreClient::connect(&store.addr(), Duration::from_millis(300)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(matches!(err, StoreError::Timeout { .. }), "{err}");
    assert!(err.to_string().contains(&store.addr()), "{err}");
    assert!(err.to_string().contains("PING"), "{err}");
}

#[test]
fn garbage_answers_are_typed_errors_naming_the_store() {
    let store = FakeStore::start(Mode::Honest);
    let mut c = StoreClient::connect(&store.addr(), T).unwrap();
    store.set_mode(Mode::Garbage);
    let err = c.ping().unwrap_err();
    assert!(matches!(err, StoreError::Protocol { .. }), "{err}");
    assert!(err.to_string().contains(&store.addr()), "{err}");
    let mut c = StoreClient::connect(&store.addr(), T).unwrap_err();
    assert!(matches!(c, StoreError::Protocol { .. }), "{c}");
    store.set_mode(Mode::Honest);
    let mut ok = StoreClient::connect(&store.addr(), T).unwrap();
    store.set_mode(Mode::Garbage);
    c = ok.check(&["x"]).unwrap_err();
    assert!(
        c.to_string()
            .contains("neither ready (0) nor not ready (1)"),
        "{c}"
    );
}

#[test]
fn truncated_answers_are_typed_errors_naming_the_store() {
    let store = FakeStore::start(Mode::Honest);
    let mut c = StoreClient::connect(&store.addr(), T).unwrap();
    c.set("k", &[7; 64]).unwrap();
    store.set_mode(Mode::Truncate);
    let err = c.get("k", T).unwrap_err();
    // The WAIT's one-byte answer is cut to nothing, and the connection closed.
    assert!(matches!(err, StoreError::Closed { .. }), "{err}");
    assert!(err.to_string().contains(&store.addr()), "{err}");
    store.set_mode(Mode::Honest);
    let mut c = StoreClient::connect(&store.addr(), T).unwrap();
    c.wait(&["k"], T).unwrap();
    store.set_mode(Mode::Truncate);
    let err = c.compare_set("k", &[7; 64], b"x").unwrap_err();
    assert!(matches!(err, StoreError::Closed { .. }), "{err}");
}

#[test]
fn a_huge_length_is_refused_before_allocating() {
    let store = FakeStore::start(Mode::Honest);
    let mut c = StoreClient::connect(&store.addr(), T).unwrap();
    c.set("k", b"v").unwrap();
    store.set_mode(Mode::HugeLength);
    let err = c.get("k", T).unwrap_err();
    assert!(matches!(err, StoreError::TooLarge { .. }), "{err}");
    assert!(err.to_string().contains(&store.addr()), "{err}");
    // And the client does not send one either.
    store.set_mode(Mode::Honest);
    let mut c = StoreClient::connect(&store.addr(), T).unwrap();
    let err = c.set("big", &vec![0; (1 << 20) + 1]).unwrap_err();
    assert!(matches!(err, StoreError::TooLarge { .. }), "{err}");
}

#[test]
fn nothing_listening_is_a_connect_error_naming_the_address() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let err = StoreClient::connect(&addr, Duration::from_millis(300)).unwrap_err();
    assert!(matches!(err, StoreError::Connect { .. }), "{err}");
    assert!(err.to_string().contains(&addr), "{err}");
}

fn torchrun_env(rank: usize, world: usize, port: u16, restart: u32) -> ProcessEnv {
    let vars = [
        ("RANK", rank.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
        ("TORCHELASTIC_USE_AGENT_STORE", "True".into()),
        ("TORCHELASTIC_RUN_ID", "job7".into()),
        ("TORCHELASTIC_RESTART_COUNT", restart.to_string()),
    ];
    ProcessEnv::from_lookup(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())).unwrap()
}

fn id(seed: u8) -> [u8; ID_LEN] {
    std::array::from_fn(|i| (i as u8) ^ seed)
}

#[test]
fn ranks_exchange_the_id_through_the_agent_store() {
    let store = FakeStore::start(Mode::Honest);
    let world = 4;
    let handles: Vec<_> = (0..world)
        .rev()
        .map(|rank| {
            let env = torchrun_env(rank, world, store.port(), 0);
            std::thread::spawn(move || {
                let r = StoreRendezvous::new(format!("127.0.0.1:{}", env.master_port), "p/")
                    .timeout(Duration::from_secs(5));
                Rendezvous::Store(r)
                    .exchange(rank, world, || Ok::<_, nccl_launch::Error>(id(3)))
                    .unwrap()
                    .id
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.join().unwrap(), id(3));
    }
    let v = store.value("/p/unique_id").unwrap();
    assert_eq!(&v[..4], &4u32.to_le_bytes());
}

#[test]
fn from_env_uses_the_agent_store_only_under_torchrun_with_it() {
    let env = torchrun_env(1, 2, 29500, 3);
    let e = env.elastic.as_ref().unwrap();
    assert!(e.use_agent_store);
    assert_eq!((e.run_id.as_str(), e.restart_count), ("job7", 3));
    let r = StoreRendezvous::from_env(&env).unwrap();
    assert_eq!(r.addr(), "127.0.0.1:29500");
    assert!(
        r.id_key().starts_with("nccl-safe/job7/attempt_3/"),
        "{}",
        r.id_key()
    );
    assert!(matches!(
        Rendezvous::from_env(&env).unwrap(),
        Rendezvous::Store(_)
    ));
    // Without the agent store: the authenticated TCP rendezvous, which needs its token.
    let plain = ProcessEnv {
        elastic: None,
        ..env
    };
    assert!(StoreRendezvous::from_env(&plain).is_none());
}

#[test]
fn a_restarted_job_never_reads_the_previous_attempts_id() {
    let store = FakeStore::start(Mode::Honest);
    let port = store.port();
    let at = |restart| {
        let env = torchrun_env(0, 2, port, restart);
        let e = env.elastic.unwrap();
        StoreRendezvous::new(
            format!("127.0.0.1:{port}"),
            format!("nccl-safe/{}/attempt_{}/0/", e.run_id, e.restart_count),
        )
        .timeout(Duration::from_millis(300))
    };
    // Attempt 0 published its id, then the job was restarted.
    at(0).publish(2, &id(1)).unwrap();
    assert_eq!(at(0).read(1, 2).unwrap(), id(1));
    // Rank 1 of attempt 1 does not take attempt 0's id: it waits for its own rank 0.
    let t0 = Instant::now();
    let err = at(1).read(1, 2).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert!(
        matches!(err.as_store(), Some(StoreError::WaitTimeout { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("attempt_1"), "{err}");
    assert!(
        err.to_string().contains("rank 1 waited for rank 0"),
        "{err}"
    );
    at(1).publish(2, &id(2)).unwrap();
    assert_eq!(at(1).read(1, 2).unwrap(), id(2));
    // The keys of the two attempts differ by the restart count only.
    assert_eq!(
        store.keys(),
        [
            "/nccl-safe/job7/attempt_0/0/unique_id",
            "/nccl-safe/job7/attempt_1/0/unique_id"
        ]
    );
}

/// The key of an exchange counts the communicators joined, which is the same on every rank
/// (an init completes on all ranks or on none), never the exchanges a process completed:
/// - a rank whose exchange failed (rank 0 was late) and that tries again keeps the key its
///   peers use;
/// - when rank 0 published but the communicator never formed (rank 1's read failed, so
///   rank 0's join failed too), both retry under the same key, and rank 1 never reads the
///   stale id: rank 0 retracted it, so rank 1 waits for the id of the retry;
/// - once the communicator is joined, the process's next exchange moves on.
///
/// The ranks here are threads of one process sharing the count, as the ranks of a real
/// job have equal counts; the test shows the count moves on joins only, and the
/// retraction.
#[test]
fn a_retried_exchange_keeps_its_key_and_never_reads_a_stale_id() {
    let store = FakeStore::start(Mode::Honest);
    let env0 = torchrun_env(0, 2, store.port(), 0);
    let env1 = torchrun_env(1, 2, store.port(), 0);
    let short = |env: &ProcessEnv| {
        StoreRendezvous::from_env(env)
            .unwrap()
            .timeout(Duration::from_millis(200))
    };
    let first = short(&env1);
    assert!(first.read(1, 2).is_err(), "rank 0 has not published yet");
    let retry = StoreRendezvous::from_env(&env1).unwrap().timeout(T);
    assert_eq!(retry.id_key(), first.id_key());
    // Rank 0 publishes under that key; the retried read gets it.
    let rank0 = StoreRendezvous::from_env(&env0).unwrap();
    assert_eq!(rank0.id_key(), first.id_key());
    rank0.publish(2, &id(4)).unwrap();
    assert_eq!(retry.read(1, 2).unwrap(), id(4));
    // Say that communicator never formed: rank 0's join failed, and it retracts its id.
    // Both ranks retry under the same key, and rank 1 does not take id(4) again.
    rank0.retract().unwrap();
    let (again0, again1) = (short(&env0), short(&env1));
    assert_eq!(again0.id_key(), first.id_key());
    assert_eq!(again1.id_key(), first.id_key());
    assert!(
        again1.read(1, 2).is_err(),
        "rank 1 read the retracted id of the failed join"
    );
    again0.publish(2, &id(5)).unwrap();
    assert_eq!(again1.read(1, 2).unwrap(), id(5));
    // This time the communicator formed: the next exchange (a second communicator) uses
    // the next key, on every rank.
    again1.joined();
    let next = StoreRendezvous::from_env(&env1).unwrap();
    assert_ne!(next.id_key(), first.id_key());
    assert_eq!(
        next.id_key(),
        StoreRendezvous::from_env(&env0).unwrap().id_key()
    );
}

#[test]
fn delete_key_removes_a_key_and_says_whether_it_was_set() {
    let store = FakeStore::start(Mode::Honest);
    let mut c = StoreClient::connect(&store.addr(), T).unwrap();
    c.set("gone", b"x").unwrap();
    assert!(c.delete_key("gone").unwrap());
    assert!(!c.delete_key("gone").unwrap());
    assert!(!store.keys().contains(&"/gone".to_string()));
}

#[test]
fn a_world_size_disagreement_or_a_foreign_value_is_refused() {
    let store = FakeStore::start(Mode::Honest);
    let r = StoreRendezvous::new(store.addr(), "w/").timeout(T);
    r.publish(3, &id(5)).unwrap();
    let err = r.read(1, 4).unwrap_err();
    assert!(
        matches!(
            err.as_rendezvous(),
            Some(RendezvousError::Refused {
                rank: 1,
                reason: Refusal::WorldSizeMismatch {
                    server: 3,
                    client: 4
                },
                ..
            })
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("rank 0 serves 3 ranks but this peer says 4"),
        "{err}"
    );
    store.put("/w/unique_id", b"something else");
    let err = r.read(1, 3).unwrap_err();
    assert!(
        matches!(err.as_store(), Some(StoreError::Protocol { .. })),
        "{err}"
    );
}

#[test]
fn the_desync_board_goes_through_the_store_and_posts_come_back_clean() {
    use nccl_safe::diag::DesyncPost;
    let store = FakeStore::start(Mode::Honest);
    let r = StoreRendezvous::new(store.addr(), "b/");
    let board = r.board(3);
    let by = || Instant::now() + T;
    let post = DesyncPost::new(9, 4, "ncclAllReduce seq 4 at train.rs:10 (in progress)");
    board.post_by(2, &post, by()).unwrap();
    assert_eq!(board.fetch_by(by()).unwrap(), vec![None, None, Some(post)]);
    assert!(store.keys().contains(&"/b/desync/2".to_string()));
    // A post carrying terminal escapes and a bidirectional override is cleaned on reading.
    let evil = DesyncPost::new(9, 4, "ok\u{1b}[2J\u{1b}]0;pwned\u{7}\u{202e}txt\u{9b}31m");
    board.post_by(0, &evil, by()).unwrap();
    let got = board.fetch_by(by()).unwrap()[0].clone().unwrap();
    assert_eq!(got.text, "ok?[2J?]0;pwned??txt?31m");
    assert!(!got.text.chars().any(char::is_control));
    // A silent store ends the fetch by its deadline, with an error naming the store.
    store.set_mode(Mode::Silent);
    let t0 = Instant::now();
    let err = board
        .fetch_by(Instant::now() + Duration::from_millis(300))
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(err.to_string().contains(&store.addr()), "{err}");
}

/// Against PyTorch's own store server, named (`host:port`) by `NCCL_SAFE_TEST_C10D_STORE`;
/// `scripts/test-torchrun.sh` runs it with `--ignored` for both of PyTorch's servers. Without
/// the variable it fails rather than passing on nothing.
#[test]
#[ignore = "needs a PyTorch TCPStore server; scripts/test-torchrun.sh runs it with --ignored"]
fn against_a_real_pytorch_store() {
    let addr = std::env::var("NCCL_SAFE_TEST_C10D_STORE")
        .expect("NCCL_SAFE_TEST_C10D_STORE must name a PyTorch TCPStore server (host:port)");
    let mut c = StoreClient::connect(&addr, T).unwrap();
    // PyTorch's servers since 2.4 answer PING; NCCL_SAFE_TEST_C10D_OLD=1 names an older one
    // (2.2 and 2.3: the oldest that speak this protocol), spoken to without it.
    let old = std::env::var("NCCL_SAFE_TEST_C10D_OLD").is_ok_and(|v| v == "1");
    assert_eq!(
        c.answers_ping(),
        !old,
        "a server {} PING",
        if old {
            "before 2.4 without"
        } else {
            "since 2.4 with"
        }
    );
    // Keys under the same names on both sides: Python set `interop/from_python` before
    // starting this test, and reads `interop/from_rust` after it.
    assert_eq!(
        c.get("interop/from_python", T).unwrap(),
        b"hello from python"
    );
    c.set("interop/from_rust", b"hello from rust").unwrap();
    let k = format!("nccl-safe-test/{}/", std::process::id());
    let key = |s: &str| format!("{k}{s}");
    assert!(!c.check(&[&key("a")]).unwrap());
    c.set(&key("a"), &[0, 1, 2, 255]).unwrap();
    assert!(c.check(&[&key("a")]).unwrap());
    assert_eq!(c.get(&key("a"), T).unwrap(), [0, 1, 2, 255]);
    assert_eq!(c.add(&key("n"), 7).unwrap(), 7);
    assert_eq!(c.add(&key("n"), -2).unwrap(), 5);
    assert_eq!(
        c.compare_set(&key("a"), &[0, 1, 2, 255], b"new").unwrap(),
        b"new"
    );
    assert_eq!(c.compare_set(&key("a"), b"old", b"x").unwrap(), b"new");
    // An unset key with a non-empty `expected`: the server echoes `expected`, stores nothing.
    assert_eq!(c.compare_set(&key("u"), b"e", b"d").unwrap(), b"e");
    assert!(!c.check(&[&key("u")]).unwrap());
    let t0 = Instant::now();
    let err = c
        .wait(&[&key("never")], Duration::from_millis(300))
        .unwrap_err();
    assert!(matches!(err, StoreError::WaitTimeout { .. }), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(2));
    // The server answered the cancel: the connection is still in step.
    c.ping().unwrap();
    assert_eq!(c.get(&key("a"), T).unwrap(), b"new");
    assert!(c.delete_key(&key("a")).unwrap());
    assert!(!c.delete_key(&key("a")).unwrap());
    assert!(!c.check(&[&key("a")]).unwrap());
    let r = StoreRendezvous::new(addr.clone(), key("x/")).timeout(T);
    r.publish(2, &id(9)).unwrap();
    assert_eq!(r.read(1, 2).unwrap(), id(9));
    // A retracted id is gone: a reader waits for the next one.
    r.retract().unwrap();
    assert!(!c.check(&[&r.id_key()]).unwrap());
    let board = r.board(2);
    let post = nccl_safe::diag::DesyncPost::new(1, 2, "seq 2\u{1b}[31m");
    board.post_by(1, &post, Instant::now() + T).unwrap();
    let got = board.fetch_by(Instant::now() + T).unwrap();
    assert_eq!(got[0], None);
    assert_eq!(got[1].as_ref().unwrap().text, "seq 2?[31m");
    println!("@@REAL-STORE-OK {addr}");
}
