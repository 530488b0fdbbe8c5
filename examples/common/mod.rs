//! Shared by the examples: flag parsing, element types, and running a per-rank body on
//! GPU buffers or host buffers.
#![allow(dead_code)]

use nccl_launch::{Launcher, Rank};
use nccl_safe::Provider;
use nccl_safe::{Error, NcclType, ReduceOp, Result};

/// Flags common to the examples.
#[derive(Debug, Clone)]
pub struct Args {
    pub ranks: Option<usize>,
    pub count: usize,
    pub dtype: String,
    pub op: ReduceOp,
    pub backend: String,
    pub launcher: String,
    pub root: usize,
}

/// Why an example failed: a mistake on its command line, or nccl-safe's error.
#[derive(Debug)]
pub enum Failure {
    /// A flag is unknown, malformed or contradicts another.
    Usage(String),
    /// The library's error.
    Nccl(Error),
    /// The launcher's error (starting the ranks, or a rank that failed).
    Launch(nccl_launch::Error),
    /// The run finished but a result was wrong.
    Wrong(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Usage(m) => write!(f, "command line: {m}"),
            Failure::Nccl(e) => write!(f, "{e}"),
            Failure::Launch(e) => write!(f, "{e}"),
            Failure::Wrong(m) => write!(f, "{m}"),
        }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure::Nccl(e)
    }
}

impl From<nccl_launch::Error> for Failure {
    fn from(e: nccl_launch::Error) -> Self {
        match e {
            nccl_launch::Error::Core(e) => Failure::Nccl(e),
            e => Failure::Launch(e),
        }
    }
}

fn bad(reason: String) -> Failure {
    Failure::Usage(reason)
}

/// The element types of `--dtype`.
const DTYPES: [&str; 10] = [
    "i8", "u8", "i32", "u32", "i64", "u64", "f16", "bf16", "f32", "f64",
];

impl Args {
    /// Parses `--ranks N --count N --dtype T --op OP --backend auto|nccl|host
    /// --launcher threads|env --root R`.
    pub fn parse() -> std::result::Result<Args, Failure> {
        let mut a = Args {
            ranks: None,
            count: 1 << 20,
            dtype: "f32".into(),
            op: ReduceOp::Sum,
            backend: "auto".into(),
            launcher: "threads".into(),
            root: 0,
        };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            let mut value = || {
                it.next()
                    .ok_or_else(|| bad(format!("{flag} needs a value")))
            };
            match flag.as_str() {
                "--ranks" => a.ranks = Some(parse_num(&value()?)?),
                "--count" => a.count = parse_num(&value()?)?,
                "--root" => a.root = parse_num(&value()?)?,
                "--dtype" => a.dtype = value()?,
                "--op" => {
                    a.op = match value()?.as_str() {
                        "sum" => ReduceOp::Sum,
                        "prod" => ReduceOp::Prod,
                        "max" => ReduceOp::Max,
                        "min" => ReduceOp::Min,
                        "avg" => ReduceOp::Avg,
                        other => {
                            return Err(bad(format!(
                                "unknown --op {other} (sum, prod, max, min, avg)"
                            )))
                        }
                    }
                }
                "--backend" => a.backend = value()?,
                "--launcher" => a.launcher = value()?,
                "-h" | "--help" => {
                    println!(
                        "flags: --ranks N --count N --dtype i8|u8|i32|u32|i64|u64|f16|bf16|f32|f64 \
                         --op sum|prod|max|min|avg --backend auto|nccl|host --launcher threads|env --root R"
                    );
                    std::process::exit(0);
                }
                other => return Err(bad(format!("unknown flag {other} (see --help)"))),
            }
        }
        if !DTYPES.contains(&a.dtype.as_str()) {
            return Err(bad(format!(
                "unknown --dtype {} ({})",
                a.dtype,
                DTYPES.join(", ")
            )));
        }
        if !["auto", "nccl", "host"].contains(&a.backend.as_str()) {
            return Err(bad(format!(
                "--backend {} must be auto, nccl or host",
                a.backend
            )));
        }
        if !["threads", "env"].contains(&a.launcher.as_str()) {
            return Err(bad(format!(
                "--launcher {} must be threads or env",
                a.launcher
            )));
        }
        Ok(a)
    }

    /// This process's rank of a job started by torchrun, srun or mpirun (`--launcher env`),
    /// on the host provider with `--backend host` (the job's processes meet in shared
    /// memory), else on the GPU of its local rank.
    pub fn process_rank(&self) -> nccl_launch::Result<Rank> {
        let launcher = Launcher::from_env()?;
        let launcher = if self.backend == "host" {
            launcher.host()
        } else {
            launcher
        };
        launcher.init()
    }

    /// The launcher for `--backend` and `--ranks`, and a first line saying what runs where.
    pub fn launcher(&self) -> nccl_launch::Result<(Launcher, Provider, String)> {
        let (launcher, backend) = match self.backend.as_str() {
            "host" => (Launcher::host(self.ranks.unwrap_or(4)), Provider::Host),
            "nccl" => (gpu_launcher(self.ranks)?, Provider::Nccl),
            _ => match gpu_launcher(self.ranks) {
                Ok(l) => (l, Provider::Nccl),
                Err(_) => (Launcher::host(self.ranks.unwrap_or(4)), Provider::Host),
            },
        };
        let line = if backend == Provider::Nccl {
            format!(
                "running {} ranks on NVIDIA NCCL {}, one per GPU",
                launcher.world_size(),
                nccl_safe::Library::load()?.version()
            )
        } else {
            format!(
                "no GPU used: running {} ranks on the nccl-safe host provider (CPU memory, ranks as threads)",
                launcher.world_size()
            )
        };
        Ok((launcher, backend, line))
    }
}

fn gpu_launcher(ranks: Option<usize>) -> nccl_launch::Result<Launcher> {
    match ranks {
        None => Launcher::all_devices(),
        Some(n) => Launcher::devices(&(0..n).collect::<Vec<_>>()),
    }
}

fn parse_num(s: &str) -> std::result::Result<usize, Failure> {
    s.parse().map_err(|_| bad(format!("{s:?} is not a number")))
}

/// Element types the examples run with: exact small integers in every type.
pub trait Elem:
    NcclType + cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Default + std::fmt::Debug
{
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            fn from_f64(x: f64) -> Self { x as $t }
            fn to_f64(self) -> f64 { self as f64 }
        }
    )*};
}
elem!(i8, u8, i32, u32, i64, u64, f32, f64);

impl Elem for half::f16 {
    fn from_f64(x: f64) -> Self {
        half::f16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        half::f16::to_f64(self)
    }
}

impl Elem for half::bf16 {
    fn from_f64(x: f64) -> Self {
        half::bf16::from_f64(x)
    }
    fn to_f64(self) -> f64 {
        half::bf16::to_f64(self)
    }
}

/// Runs `$body::<T>` for the `--dtype` name.
#[macro_export]
macro_rules! with_dtype {
    ($name:expr, $f:ident ( $($arg:expr),* )) => {
        match $name {
            "i8" => $f::<i8>($($arg),*),
            "u8" => $f::<u8>($($arg),*),
            "i32" => $f::<i32>($($arg),*),
            "u32" => $f::<u32>($($arg),*),
            "i64" => $f::<i64>($($arg),*),
            "u64" => $f::<u64>($($arg),*),
            "f16" => $f::<half::f16>($($arg),*),
            "bf16" => $f::<half::bf16>($($arg),*),
            "f32" => $f::<f32>($($arg),*),
            "f64" => $f::<f64>($($arg),*),
            other => Err(nccl_safe::Error::InvalidArgument {
                call: "command line",
                reason: format!("unknown --dtype {other}"),
            }.into()),
        }
    };
}

/// A buffer of `T` on the rank's device (GPU) or in host memory, for examples that run on
/// either backend.
pub enum Buf<T: Elem> {
    Host(Vec<T>),
    Cuda(cudarc::driver::CudaSlice<T>),
}

impl<T: Elem> Buf<T> {
    /// Copies `data` to where `rank` runs.
    pub fn from_host(rank: &Rank, data: &[T]) -> Result<Buf<T>> {
        Ok(match rank.cuda_stream() {
            Some(s) => Buf::Cuda(s.clone_htod(data)?),
            None => Buf::Host(data.to_vec()),
        })
    }

    /// Copies the buffer back to the host (waiting for the rank's stream).
    pub fn to_host(&self, rank: &Rank) -> Result<Vec<T>> {
        match (self, rank.cuda_stream()) {
            (Buf::Cuda(b), Some(s)) => Ok(s.clone_dtoh(b)?),
            (Buf::Host(v), _) => Ok(v.clone()),
            (Buf::Cuda(_), None) => unreachable!("a device buffer exists only on a GPU rank"),
        }
    }
}

/// Prints the per-rank table and fails when a rank's result was wrong.
pub fn print_table(rows: &[(usize, String, f64, bool)]) -> std::result::Result<(), Failure> {
    println!("{:>5}  {:<10}  {:>14}  ok", "rank", "device", "value");
    for (rank, device, value, ok) in rows {
        println!(
            "{rank:>5}  {device:<10}  {value:>14}  {}",
            if *ok { "ok" } else { "WRONG" }
        );
    }
    let wrong = rows.iter().filter(|r| !r.3).count();
    if wrong > 0 {
        return Err(Failure::Wrong(format!(
            "{wrong} rank(s) got a wrong result"
        )));
    }
    println!("all {} ranks verified", rows.len());
    Ok(())
}

/// "cuda:N" or "host".
pub fn device_name(rank: &Rank) -> String {
    match rank.comm().cuda_ordinal() {
        Some(d) => format!("cuda:{d}"),
        None => "host".into(),
    }
}

/// Prints `error: {e}` on stderr in one write, so that the lines of ranks in other
/// processes sharing the stream (torchrun, mpirun, srun) never interleave.
pub fn print_error(e: &dyn std::fmt::Display) {
    use std::io::Write;
    let line = format!("error: {e}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}
