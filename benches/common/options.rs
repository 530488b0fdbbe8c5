//! Command-line options of the bandwidth bench, with nccl-tests' letters and defaults.

use std::fmt;
use std::path::PathBuf;

use nccl_safe::{DataType, ReduceOp};

use super::report::{self, Collective, Measured, MEASURED};

/// Which implementation runs the collectives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// NVIDIA's NCCL when a GPU and libnccl are found, else the host provider.
    Auto,
    /// NVIDIA's NCCL on CUDA devices (fails without them).
    Nccl,
    /// The in-process host provider (ranks as threads, CPU memory).
    Host,
}

/// How the per-rank times of one measurement are combined (nccl-tests' `-a`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Average {
    /// Rank 0's time.
    Rank0,
    /// The mean over ranks.
    Mean,
    /// The fastest rank.
    Min,
    /// The slowest rank (the default here: a collective is done when its last rank is).
    Max,
}

/// How the buffers are allocated and registered (nccl-tests' `-R`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Register {
    /// `-R 0`: plain buffers (cudarc's allocator; `Vec` on the host provider), unregistered.
    None,
    /// `-R 1`: buffers from `ncclMemAlloc`, registered with `ncclCommRegister`.
    Local,
    /// `-R 2`: buffers from `ncclMemAlloc`, registered as symmetric windows
    /// (`ncclCommWindowRegister` with `NCCL_WIN_COLL_SYMMETRIC`).
    Symmetric,
}

/// Everything the sweep needs.
#[derive(Debug, Clone)]
pub struct Options {
    /// `-b`: smallest size in bytes.
    pub min_bytes: usize,
    /// `-e`: largest size in bytes.
    pub max_bytes: usize,
    /// `-i`: increment when the factor is 1.
    pub step_bytes: usize,
    /// `-f`: multiplication factor between sizes (1 = add `step_bytes`).
    pub step_factor: usize,
    /// `-n`: timed iterations.
    pub iters: usize,
    /// `-w`: warm-up iterations.
    pub warmup_iters: usize,
    /// `-c`: correctness checks per measurement (0 = none).
    pub check: usize,
    /// `-d`: element type.
    pub dtype: DataType,
    /// `-o`: reduction operator.
    pub redop: ReduceOp,
    /// `-r`: root of broadcast and reduce.
    pub root: usize,
    /// `-z`: synchronize the stream after every operation.
    pub blocking: bool,
    /// `-g`: number of ranks (`None` = one per GPU, 4 on the host provider).
    pub ranks: Option<usize>,
    /// `-a`: how per-rank times are combined.
    pub average: Average,
    /// `--backend`.
    pub backend: Backend,
    /// `-R`: buffer allocation and registration.
    pub register: Register,
    /// `-E`: cudarc's event tracking on the bench's CUDA buffers (off by default: nccl-tests
    /// passes raw pointers, so tracking would time cudarc's events, not NCCL).
    pub event_tracking: bool,
    /// `--op` / `-t` / positional: the collectives to run, in this order.
    pub collectives: Vec<Collective>,
    /// `--json FILE`.
    pub json: Option<PathBuf>,
    /// `--plot FILE.svg`.
    pub plot: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            min_bytes: 32 << 20,
            max_bytes: 32 << 20,
            step_bytes: 1 << 20,
            step_factor: 1,
            iters: 20,
            warmup_iters: 5,
            check: 1,
            dtype: DataType::Float32,
            redop: ReduceOp::Sum,
            root: 0,
            blocking: false,
            ranks: None,
            average: Average::Max,
            backend: Backend::Auto,
            register: Register::None,
            event_tracking: false,
            collectives: MEASURED.to_vec(),
            json: None,
            plot: None,
        }
    }
}

/// What parsing asks the program to do.
#[derive(Debug, Clone)]
pub enum Command {
    /// Run the sweep.
    Run(Options),
    /// Print [`USAGE`] and exit successfully.
    Help,
}

/// A bad command line: printed with [`USAGE`], exit status 2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// The help text.
pub const USAGE: &str = "\
usage: cargo bench --bench bandwidth -- [options] [COLLECTIVE...]

collectives (default: all): all_reduce all_gather broadcast reduce reduce_scatter
                            all_to_all sendrecv   (pick with --op NAME, -t NAME or positionally;
                            a comma-separated list or `all` also works)
  -b, --minbytes SIZE     smallest size (bytes; K/M/G suffixes are binary)   [32M]
  -e, --maxbytes SIZE     largest size                                       [32M]
  -i, --stepbytes SIZE    increment when the factor is 1                     [1M]
  -f, --stepfactor N      multiply the size by N at each step                [1]
  -n, --iters N           timed iterations                                   [20]
  -w, --warmup_iters N    warm-up iterations                                 [5]
  -c, --check N           correctness checks per measurement (0 = off)      [1]
  -d, --datatype TYPE     int8 uint8 int32 uint32 int64 uint64 half float double bfloat16 [float]
  -o, --redop OP          sum prod max min avg                               [sum]
  -r, --root N            root of broadcast and reduce                       [0]
  -z, --blocking 0|1      synchronize the stream after every operation      [0]
  -g, --ngpus N           ranks (one per GPU; 4 on the host provider)
  -a, --average 0|1|2|3   time reported: rank 0, mean, min, max over ranks  [3]
  -R, --local_register 0|1|2  buffers from ncclMemAlloc, registered (1) or as
                          symmetric windows (2); 0: plain buffers           [0]
  -E, --event_tracking 0|1  cudarc's event tracking on the CUDA buffers (1: on, as
                          cudarc's default; 0: off, like nccl-tests' raw pointers) [0]
      --backend B         auto | nccl | host                                 [auto]
      --json FILE         also write the results as JSON
      --plot FILE.svg     draw bus bandwidth against size per collective
  -h, --help              this text";

/// Parses a size: a number with an optional binary `K`, `M` or `G` suffix (nccl-tests' rule).
pub fn parse_size(text: &str) -> Option<usize> {
    let t = text.trim();
    let (digits, unit) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&t[..i], c.to_ascii_uppercase()),
        _ => (t, ' '),
    };
    let scale: u64 = match unit {
        ' ' => 1,
        'K' => 1 << 10,
        'M' => 1 << 20,
        'G' => 1 << 30,
        _ => return None,
    };
    let value: f64 = digits.trim().parse().ok()?;
    if !value.is_finite() || value < 0.0 {
        return None;
    }
    let bytes = value * scale as f64;
    (bytes <= usize::MAX as f64).then_some(bytes as usize)
}

fn parse_dtype(text: &str) -> Option<DataType> {
    Some(match text {
        "int8" | "char" => DataType::Int8,
        "uint8" => DataType::Uint8,
        "int32" | "int" => DataType::Int32,
        "uint32" => DataType::Uint32,
        "int64" => DataType::Int64,
        "uint64" => DataType::Uint64,
        "half" | "float16" | "f16" => DataType::Float16,
        "float" | "float32" | "f32" => DataType::Float32,
        "double" | "float64" | "f64" => DataType::Float64,
        "bfloat16" | "bf16" => DataType::Bfloat16,
        _ => return None,
    })
}

fn parse_redop(text: &str) -> Option<ReduceOp> {
    Some(match text {
        "sum" => ReduceOp::Sum,
        "prod" => ReduceOp::Prod,
        "max" => ReduceOp::Max,
        "min" => ReduceOp::Min,
        "avg" => ReduceOp::Avg,
        _ => return None,
    })
}

fn parse_number(flag: &str, text: &str) -> Result<usize, UsageError> {
    text.trim()
        .parse()
        .map_err(|_| UsageError(format!("{flag}: `{text}` is not a non-negative integer")))
}

/// Adds the collectives named in `text` (comma-separated, or `all`).
fn push_collectives(text: &str, to: &mut Vec<Collective>) -> Result<(), UsageError> {
    for name in text.split(',').filter(|s| !s.is_empty()) {
        if name == "all" {
            to.extend_from_slice(&MEASURED);
            continue;
        }
        let c = report::from_name(name).ok_or_else(|| {
            let known: Vec<_> = MEASURED.iter().map(|c| c.bench_name()).collect();
            UsageError(format!(
                "unknown collective `{name}` (known: {})",
                known.join(", ")
            ))
        })?;
        to.push(c);
    }
    Ok(())
}

/// Parses the arguments after the program name. `--bench` (added by `cargo bench`) is ignored.
pub fn parse<I, S>(args: I) -> Result<Command, UsageError>
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    let mut o = Options::default();
    let mut picked: Vec<Collective> = Vec::new();
    let mut args = args.into_iter().map(Into::into);
    while let Some(arg) = args.next() {
        if arg == "--bench" {
            continue;
        }
        if arg == "-h" || arg == "--help" {
            return Ok(Command::Help);
        }
        if !arg.starts_with('-') || arg == "-" {
            push_collectives(&arg, &mut picked)?;
            continue;
        }
        // `--name=value`, `--name value`, `-xVALUE` or `-x value`.
        let (flag, inline) = if let Some(long) = arg.strip_prefix("--") {
            match long.split_once('=') {
                Some((f, v)) => (format!("--{f}"), Some(v.to_string())),
                None => (arg.clone(), None),
            }
        } else if arg.len() > 2 {
            (arg[..2].to_string(), Some(arg[2..].to_string()))
        } else {
            (arg.clone(), None)
        };
        let mut value = || -> Result<String, UsageError> {
            match &inline {
                Some(v) => Ok(v.clone()),
                None => args
                    .next()
                    .ok_or_else(|| UsageError(format!("{flag} needs a value"))),
            }
        };
        let size = |v: String| {
            parse_size(&v).ok_or_else(|| {
                UsageError(format!(
                    "{flag}: `{v}` is not a size (a number with an optional K, M or G suffix)"
                ))
            })
        };
        match flag.as_str() {
            "-b" | "--minbytes" => o.min_bytes = size(value()?)?,
            "-e" | "--maxbytes" => o.max_bytes = size(value()?)?,
            "-i" | "--stepbytes" => o.step_bytes = size(value()?)?,
            "-f" | "--stepfactor" => o.step_factor = parse_number(&flag, &value()?)?,
            "-n" | "--iters" => o.iters = parse_number(&flag, &value()?)?,
            "-w" | "--warmup_iters" => o.warmup_iters = parse_number(&flag, &value()?)?,
            "-c" | "--check" => o.check = parse_number(&flag, &value()?)?,
            "-r" | "--root" => o.root = parse_number(&flag, &value()?)?,
            "-z" | "--blocking" => o.blocking = parse_number(&flag, &value()?)? != 0,
            "-g" | "--ngpus" => o.ranks = Some(parse_number(&flag, &value()?)?),
            "-d" | "--datatype" => {
                let v = value()?;
                o.dtype = parse_dtype(&v)
                    .ok_or_else(|| UsageError(format!("{flag}: unknown data type `{v}`")))?;
            }
            "-o" | "--redop" => {
                let v = value()?;
                o.redop = parse_redop(&v).ok_or_else(|| {
                    UsageError(format!(
                        "{flag}: unknown reduction `{v}` (sum, prod, max, min, avg)"
                    ))
                })?;
            }
            "-a" | "--average" => {
                o.average = match parse_number(&flag, &value()?)? {
                    0 => Average::Rank0,
                    1 => Average::Mean,
                    2 => Average::Min,
                    3 => Average::Max,
                    n => return Err(UsageError(format!("{flag}: {n} is not 0, 1, 2 or 3"))),
                }
            }
            "-R" | "--local_register" => {
                o.register = match parse_number(&flag, &value()?)? {
                    0 => Register::None,
                    1 => Register::Local,
                    2 => Register::Symmetric,
                    n => return Err(UsageError(format!("{flag}: {n} is not 0, 1 or 2"))),
                }
            }
            "-E" | "--event_tracking" => {
                o.event_tracking = match parse_number(&flag, &value()?)? {
                    0 => false,
                    1 => true,
                    n => return Err(UsageError(format!("{flag}: {n} is not 0 or 1"))),
                }
            }
            "-t" | "--op" | "--collective" => push_collectives(&value()?, &mut picked)?,
            "--backend" => {
                let v = value()?;
                o.backend = match v.as_str() {
                    "auto" => Backend::Auto,
                    "nccl" => Backend::Nccl,
                    "host" => Backend::Host,
                    _ => {
                        return Err(UsageError(format!(
                            "--backend: `{v}` is not auto, nccl or host"
                        )))
                    }
                }
            }
            "--json" => o.json = Some(PathBuf::from(value()?)),
            "--plot" => o.plot = Some(PathBuf::from(value()?)),
            _ => return Err(UsageError(format!("unknown option `{arg}`"))),
        }
    }
    if !picked.is_empty() {
        let mut seen = Vec::new();
        for c in picked {
            if !seen.contains(&c) {
                seen.push(c);
            }
        }
        o.collectives = seen;
    }
    if o.min_bytes > o.max_bytes {
        return Err(UsageError(format!(
            "-b ({}) is larger than -e ({})",
            o.min_bytes, o.max_bytes
        )));
    }
    if o.step_factor == 0 {
        return Err(UsageError("-f must be at least 1".into()));
    }
    if o.step_factor == 1 && o.step_bytes == 0 && o.min_bytes < o.max_bytes {
        return Err(UsageError(
            "-i 0 with -f 1 would never reach -e: give a step".into(),
        ));
    }
    if o.iters == 0 {
        return Err(UsageError("-n must be at least 1".into()));
    }
    if o.ranks == Some(0) {
        return Err(UsageError("-g must be at least 1".into()));
    }
    if let Some(n) = o.ranks {
        if o.root >= n {
            return Err(UsageError(format!(
                "-r {} is not a rank of {n} ranks",
                o.root
            )));
        }
    }
    Ok(Command::Run(o))
}

impl Options {
    /// The sizes of the sweep, in bytes (nccl-tests' loop: multiply by `-f` when it is
    /// above 1, else add `-i`).
    pub fn sizes(&self) -> Vec<usize> {
        let mut out = Vec::new();
        let mut size = self.min_bytes;
        while size <= self.max_bytes {
            out.push(size);
            let next = if self.step_factor > 1 {
                size.checked_mul(self.step_factor)
            } else {
                size.checked_add(self.step_bytes)
            };
            match next {
                Some(n) if n > size => size = n,
                // `-b 0 -f 4` or an overflow: nothing more to visit.
                _ if size == 0 && self.step_factor > 1 => size = 1,
                _ => break,
            }
        }
        out
    }
}
