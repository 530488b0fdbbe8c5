//! all_reduce on the host provider with ranks in separate processes (meeting in shared
//! memory), against the same ranks as threads of one process, and against Open MPI's
//! `MPI_Allreduce` on the same machine: one run, so the ratios compare like with like.
//!
//! `cargo bench --bench processes -- [--ranks 4] [--mib 64] [--iters 10] [--warmup 2] [--repeat 3]`
//!
//! The variants take turns, `--repeat` rounds, and each keeps its best time (the machine's
//! other load only ever slows a variant down).
//!
//! Every variant all-reduces `--mib` MiB of `f32` in place with `Sum`: `--warmup` calls, a
//! barrier, then `--iters` timed calls; the time is the slowest rank's, per call. The MPI
//! variant needs `mpicc` and `mpirun` (Debian: `libopenmpi-dev`, `openmpi-bin`); it compiles
//! `benches/mpi/allreduce.c` into Cargo's target directory and says so when it cannot.

use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use nccl_launch::Launcher;
use nccl_safe::host::shared_unique_id;
use nccl_safe::{CommDevice, Communicator, Config, ReduceOp, Result, Stream, UniqueId};

const CHILD: &str = "NCCL_SAFE_BENCH_PROCESS";

#[derive(Clone, Copy)]
struct Opts {
    ranks: usize,
    count: usize,
    iters: usize,
    warmup: usize,
    repeat: usize,
}

fn parse() -> std::result::Result<Opts, String> {
    let mut o = Opts {
        ranks: 4,
        count: 64 << 18, // 64 MiB of f32
        iters: 10,
        warmup: 2,
        repeat: 3,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> std::result::Result<usize, String> {
            args.next()
                .and_then(|v| v.parse().ok())
                .filter(|&v| v > 0)
                .ok_or(format!("{name} needs a positive number"))
        };
        match a.as_str() {
            "--ranks" => o.ranks = num("--ranks")?,
            "--mib" => o.count = num("--mib")? << 18,
            "--iters" => o.iters = num("--iters")?,
            "--warmup" => o.warmup = num("--warmup")?,
            "--repeat" => o.repeat = num("--repeat")?,
            "--bench" => {} // passed by `cargo bench`
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(o)
}

/// One rank's seconds per call.
fn timed(comm: &Communicator, o: Opts) -> Result<f64> {
    let mut buf = vec![1.0f32; o.count];
    for _ in 0..o.warmup {
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &Stream::Host)?;
    }
    let mut one = vec![0.0f32];
    comm.all_reduce_in_place(&mut one, ReduceOp::Sum, &Stream::Host)?;
    let t = Instant::now();
    for _ in 0..o.iters {
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum, &Stream::Host)?;
    }
    Ok(t.elapsed().as_secs_f64() / o.iters as f64)
}

fn threads(o: Opts) -> nccl_launch::Result<f64> {
    let times = Launcher::host(o.ranks).run(move |rank| timed(rank.comm(), o))?;
    Ok(times.into_iter().fold(0.0, f64::max))
}

fn processes(o: Opts) -> std::result::Result<f64, String> {
    let id = UniqueId::from_raw(shared_unique_id());
    let hex: String = id.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let kids: Vec<_> = (0..o.ranks)
        .map(|r| {
            Command::new(&exe)
                .args(std::env::args().skip(1))
                .env(CHILD, format!("{r}:{hex}"))
                .stdout(Stdio::piped())
                .spawn()
                .map_err(|e| e.to_string())
        })
        .collect::<std::result::Result<_, _>>()?;
    let mut worst: f64 = 0.0;
    for k in kids {
        let out = k.wait_with_output().map_err(|e| e.to_string())?;
        let text = String::from_utf8_lossy(&out.stdout);
        let t = seconds(&text).ok_or(format!("a rank failed: {text}"))?;
        worst = worst.max(t);
    }
    Ok(worst)
}

fn seconds(text: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix("SECONDS_PER_CALL "))
        .and_then(|v| v.trim().parse().ok())
}

/// A rank of [`processes`]: joins, times, prints.
fn child(spec: &str, o: Opts) -> ExitCode {
    let (rank, hex) = spec.split_once(':').unwrap_or(("0", ""));
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .filter_map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok())
        .collect();
    let run = || -> Result<f64> {
        let id = UniqueId::from_bytes(&bytes)?;
        let rank = rank.parse().unwrap_or(0);
        let comm = Communicator::init_rank(&CommDevice::Host, o.ranks, rank, &id, &Config::new())?;
        timed(&comm, o)
    };
    match run() {
        Ok(t) => {
            println!("SECONDS_PER_CALL {t:.9}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("rank {rank}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn mpi(o: Opts) -> std::result::Result<f64, String> {
    let have = |c: &str| {
        Command::new(c)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !have("mpicc") || !have("mpirun") {
        return Err("no mpicc/mpirun (Debian: apt-get install libopenmpi-dev openmpi-bin)".into());
    }
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/mpi/allreduce.c");
    let bin = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("mpi-allreduce");
    let built = Command::new("mpicc")
        .args(["-O2", "-o"])
        .arg(&bin)
        .arg(&src)
        .status()
        .map_err(|e| e.to_string())?;
    if !built.success() {
        return Err(format!("mpicc {} failed", src.display()));
    }
    let out = Command::new("mpirun")
        .args(["-np", &o.ranks.to_string(), "--oversubscribe"])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .arg(&bin)
        .args([o.count, o.iters, o.warmup].map(|v| v.to_string()))
        .output()
        .map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&out.stdout);
    seconds(&text).ok_or(format!(
        "mpirun failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    ))
}

fn main() -> ExitCode {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{e}\nusage: cargo bench --bench processes -- [--ranks 4] [--mib 64] [--iters 10] [--warmup 2] [--repeat 3]");
            return ExitCode::from(2);
        }
    };
    if let Ok(spec) = std::env::var(CHILD) {
        return child(&spec, o);
    }
    let bytes = o.count * 4;
    println!(
        "# all_reduce (sum, in place) of {} MiB f32 over {} ranks: {} warm-up + {} timed calls, slowest rank",
        bytes >> 20,
        o.ranks,
        o.warmup,
        o.iters
    );
    println!(
        "# {} CPUs available",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let gbs = |t: f64| bytes as f64 / t / 1e9;
    let (mut t_threads, mut t_proc, mut t_mpi) = (f64::MAX, f64::MAX, Err(String::new()));
    for round in 0..o.repeat {
        let t = match threads(o) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: ranks as threads: {e}");
                return ExitCode::FAILURE;
            }
        };
        t_threads = t_threads.min(t);
        let p = match processes(o) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("error: ranks as processes: {e}");
                return ExitCode::FAILURE;
            }
        };
        t_proc = t_proc.min(p);
        let m = mpi(o);
        let shown = m
            .as_ref()
            .map_or("-".to_string(), |t| format!("{:.2}", t * 1e3));
        t_mpi = match (t_mpi, m) {
            (Ok(a), Ok(b)) => Ok(f64::min(a, b)),
            (_, m) => m,
        };
        println!(
            "# round {round}: threads {:.2} ms, processes {:.2} ms, MPI {shown} ms",
            t * 1e3,
            p * 1e3
        );
    }
    let line =
        |name: &str, t: f64| println!("{name:<36} {:>10.2} ms/call {:>8.2} GB/s", t * 1e3, gbs(t));
    line("host provider, ranks as threads", t_threads);
    line("host provider, ranks as processes", t_proc);
    match &t_mpi {
        Ok(t) => line("Open MPI MPI_Allreduce, processes", *t),
        Err(e) => println!("# Open MPI skipped: {e}"),
    }
    println!(
        "processes vs threads (speed ratio, goal >= 0.8): {:.2}",
        t_threads / t_proc
    );
    if let Ok(t) = t_mpi {
        println!(
            "processes vs Open MPI (speed ratio, goal >= 2): {:.2}",
            t / t_proc
        );
    }
    ExitCode::SUCCESS
}
