//! Runs the examples (built by `cargo test` next to this binary) on the host provider and
//! checks what they print, not only their exit code.

use std::path::PathBuf;
use std::process::{Command, Output};

fn example(name: &str, args: &[&str]) -> Output {
    // target/<profile>/deps/examples-<hash> -> target/<profile>/examples/<name>
    let exe = std::env::current_exe().unwrap();
    let dir: PathBuf = exe
        .parent()
        .and_then(|d| d.parent())
        .unwrap()
        .join("examples");
    let bin = dir.join(name);
    assert!(
        bin.is_file(),
        "{} not built (cargo test builds examples)",
        bin.display()
    );
    Command::new(&bin)
        .args(args)
        .env_remove("NCCL_LIBRARY")
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn allreduce_runs_on_the_host_provider_and_verifies_every_rank() {
    let o = example("allreduce", &["--backend", "host", "--count", "1000"]);
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.lines().next().unwrap().contains("host provider"),
        "{out}"
    );
    for rank in 0..4 {
        assert!(
            out.contains(&format!("    {rank}  host                    10  ok")),
            "{out}"
        );
    }
    assert!(out.contains("all 4 ranks verified"), "{out}");
}

#[test]
fn one_sided_runs_on_the_host_provider_and_verifies_every_rank() {
    let o = example("one_sided", &["--backend", "host", "--count", "64"]);
    let out = stdout(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{out}{err}");
    assert!(
        out.lines().next().unwrap().contains("host provider"),
        "{out}"
    );
    // Rank r received block r-1, whose first value is 1000 (r - 1).
    for (rank, from) in [(0, 3), (1, 0), (2, 1), (3, 2)] {
        let row = format!("    {rank}  host        {:>14}  ok", 1000 * from);
        assert!(out.contains(&row), "{out}");
    }
    assert!(out.contains("all 4 ranks verified"), "{out}");
}

#[test]
fn allreduce_flags_change_the_result() {
    let o = example(
        "allreduce",
        &[
            "--backend",
            "host",
            "--ranks",
            "3",
            "--count",
            "7",
            "--dtype",
            "u8",
            "--op",
            "max",
        ],
    );
    let out = stdout(&o);
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("all 3 ranks verified") && out.contains("3  ok"),
        "{out}"
    );
    let o = example("allreduce", &["--op", "bogus"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown --op bogus"));
}

#[test]
fn allgather_and_broadcast_verify_every_rank() {
    let o = example(
        "allgather",
        &["--backend", "host", "--count", "5", "--dtype", "i64"],
    );
    let out = stdout(&o);
    assert!(
        o.status.success() && out.contains("all 4 ranks verified") && out.contains("50  ok"),
        "{out}"
    );
    let o = example(
        "broadcast",
        &[
            "--backend",
            "host",
            "--ranks",
            "5",
            "--root",
            "3",
            "--count",
            "9",
        ],
    );
    let out = stdout(&o);
    assert!(
        o.status.success() && out.contains("all 5 ranks verified") && out.contains("42  ok"),
        "{out}"
    );
    let o = example("broadcast", &["--backend", "host", "--root", "7"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("root 7 is out of range"));
}

#[test]
fn train_keeps_ranks_identical_and_the_loss_falls() {
    let o = example("train", &["--backend", "host", "--ranks", "3"]);
    let out = stdout(&o);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.contains("parameters identical on every rank: yes"),
        "{out}"
    );
    assert!(out.contains("loss fell from"), "{out}");
}

#[test]
fn info_without_nccl_exits_1_with_the_paths_tried() {
    let o = Command::new(
        std::env::current_exe()
            .unwrap()
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .join("examples/info"),
    )
    .env("NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
    .output()
    .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("/nonexistent/libnccl.so.2: no such file")
            && err.contains("pip install nvidia-nccl-cu12"),
        "{err}"
    );
}

#[test]
fn mismatch_reports_every_ranks_call_and_line_and_fails_fast() {
    let start = std::time::Instant::now();
    let o = example("mismatch", &["3"]);
    assert!(start.elapsed() < std::time::Duration::from_secs(20));
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("ncclAllReduce(float x 1)") && err.contains("examples/mismatch.rs:19"),
        "{err}"
    );
    assert!(
        err.contains("ncclBroadcast(float x 1024, root 0)")
            && err.contains("<-- differs from rank 0"),
        "{err}"
    );
}

/// Starts `name` as `n` processes with the variables torchrun sets (as torchrun, srun or
/// mpirun would), on the host provider: they meet in shared memory.
fn as_processes(name: &str, n: usize, args: &[&str]) -> Vec<Output> {
    // A free port, and the next one free too: rank 0 serves the desync board there (and
    // fails its init when it cannot).
    let port = loop {
        let p = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            break p;
        }
    };
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .and_then(|d| d.parent())
        .unwrap()
        .join("examples")
        .join(name);
    let kids: Vec<_> = (0..n)
        .map(|r| {
            Command::new(&bin)
                .args(args)
                .env_remove("NCCL_LIBRARY")
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env(
                    "NCCL_SAFE_RENDEZVOUS_TOKEN",
                    "examples-test-token-0123456789",
                )
                .env("NCCL_SAFE_HOST_TIMEOUT_MS", "30000")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    kids.into_iter()
        .map(|k| k.wait_with_output().unwrap())
        .collect()
}

/// `--launcher env --backend host`: each process is one rank, on the CPU.
#[test]
fn allreduce_and_train_run_as_processes_on_the_host_provider() {
    let outs = as_processes(
        "allreduce",
        4,
        &[
            "--launcher",
            "env",
            "--backend",
            "host",
            "--count",
            "100000",
        ],
    );
    for (r, o) in outs.iter().enumerate() {
        let out = stdout(o);
        assert!(
            o.status.success(),
            "rank {r}: {out}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(out.contains(&format!("rank {r} of 4")), "{out}");
        assert!(
            out.contains(&format!("    {r}  host                    10  ok")),
            "{out}"
        );
    }
    let outs = as_processes("train", 4, &["--launcher", "env", "--backend", "host"]);
    for (r, o) in outs.iter().enumerate() {
        let out = stdout(o);
        assert!(
            o.status.success(),
            "rank {r}: {out}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(
            out.contains(&format!("rank {r}: loss"))
                && out.contains("parameters identical on every rank: yes"),
            "{out}"
        );
    }
}

/// The README opens with the crate documentation's first example (src/lib.rs, which rustdoc
/// compiles and runs), line for line less rustdoc's hidden `# ` lines: a change to one that
/// is not made to the other fails here.
#[test]
fn the_readme_opens_with_lib_rs_example() {
    let root = env!("CARGO_MANIFEST_DIR");
    let lib = std::fs::read_to_string(format!("{root}/src/lib.rs")).unwrap();
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let doc: Vec<&str> = lib
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .map(|l| l.strip_prefix(' ').unwrap_or(l))
        .collect();
    let start = doc
        .iter()
        .position(|l| *l == "```")
        .expect("lib.rs has an example")
        + 1;
    let len = doc[start..].iter().position(|l| *l == "```").unwrap();
    let example: Vec<&str> = doc[start..start + len]
        .iter()
        .copied()
        .filter(|l| !l.starts_with("# ") && *l != "#")
        .collect();
    let marker = "<!-- src/lib.rs's example -->\n```rust\n";
    let at = readme
        .find(marker)
        .expect("the README marks its copy of lib.rs's example")
        + marker.len();
    let copy: Vec<&str> = readme[at..]
        .split("\n```")
        .next()
        .unwrap()
        .lines()
        .collect();
    assert_eq!(
        copy, example,
        "the README's opening example differs from src/lib.rs's: copy lib.rs's into it"
    );
    let first_heading = readme.find("\n## ").unwrap();
    assert!(
        at < first_heading,
        "the README must open with the example, before its first section"
    );
}
