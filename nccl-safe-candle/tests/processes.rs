//! DDP with its 4 ranks in 4 processes (the host provider meeting in shared memory, as
//! under torchrun, srun or mpirun) gives the same parameters, to the bit, as 4 ranks in
//! threads. The test re-runs this test binary as its ranks: a child runs only this test,
//! with `NCCL_SAFE_CANDLE_TEST_MP=rank:world:id` set, and prints its parameters' bits.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::train_ddp;
use nccl_safe::host::shared_unique_id;
use nccl_safe::launch::Launcher;
use nccl_safe::{CommDevice, Communicator, Config, UniqueId};

const ENV: &str = "NCCL_SAFE_CANDLE_TEST_MP";
const RANKS: usize = 4;
const STEPS: usize = 25;
const CAP: usize = 64;
/// A child still running after this is hung.
const HUNG: Duration = Duration::from_secs(60);

fn hex(bytes: impl IntoIterator<Item = u8>) -> String {
    bytes.into_iter().map(|b| format!("{b:02x}")).collect()
}

/// A child's part: join the communicator, train, print the parameters' bits.
fn child(spec: &str) {
    let mut it = spec.split(':');
    let rank: usize = it.next().and_then(|v| v.parse().ok()).expect("rank");
    let world: usize = it.next().and_then(|v| v.parse().ok()).expect("world size");
    let id = it.next().expect("id");
    let bytes: Vec<u8> = (0..id.len() / 2)
        .map(|i| u8::from_str_radix(&id[2 * i..2 * i + 2], 16).expect("hex"))
        .collect();
    let id = UniqueId::from_bytes(&bytes).expect("a unique id");
    let comm = Communicator::init_rank(&CommDevice::Host, world, rank, &id, &Config::new())
        .expect("init the rank");
    let params = train_ddp(&comm, CAP, STEPS).expect("training");
    println!(
        "PARAMS {}",
        hex(params.iter().flat_map(|v| v.to_le_bytes()))
    );
}

#[test]
fn ddp_in_four_processes_matches_four_ranks_in_threads() {
    if let Ok(spec) = std::env::var(ENV) {
        child(&spec);
        return;
    }
    let threads = Launcher::host(RANKS)
        .try_run(|rank| train_ddp(rank.comm(), CAP, STEPS))
        .unwrap();
    let id = hex(UniqueId::from_raw(shared_unique_id())
        .as_bytes()
        .iter()
        .copied());
    let exe = std::env::current_exe().expect("the test binary");
    let mut kids: Vec<_> = (0..RANKS)
        .map(|r| {
            Command::new(&exe)
                .args([
                    "ddp_in_four_processes_matches_four_ranks_in_threads",
                    "--exact",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(ENV, format!("{r}:{RANKS}:{id}"))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn a rank")
        })
        .collect();
    let start = Instant::now();
    let mut codes = vec![None; RANKS];
    while codes.iter().any(Option::is_none) {
        for (k, code) in kids.iter_mut().zip(codes.iter_mut()) {
            if code.is_none() {
                if let Ok(Some(st)) = k.try_wait() {
                    *code = Some(st.code());
                }
            }
        }
        if start.elapsed() > HUNG {
            for k in &mut kids {
                let _ = k.kill();
                let _ = k.wait();
            }
            panic!("a rank hung for {HUNG:?}: exit codes so far {codes:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let want = hex(threads[0].iter().flat_map(|v| v.to_le_bytes()));
    for (r, (k, code)) in kids.iter_mut().zip(codes).enumerate() {
        let (mut out, mut err) = (String::new(), String::new());
        k.stdout.as_mut().map(|o| o.read_to_string(&mut out));
        k.stderr.as_mut().map(|e| e.read_to_string(&mut err));
        assert_eq!(code, Some(Some(0)), "rank {r} failed:\n{out}\n{err}");
        let got = out
            .lines()
            .find_map(|l| l.split_once("PARAMS ").map(|(_, p)| p.trim()))
            .unwrap_or_else(|| panic!("rank {r} printed no parameters:\n{out}\n{err}"));
        assert_eq!(
            got, want,
            "rank {r} in a process differs from the ranks in threads"
        );
    }
}
