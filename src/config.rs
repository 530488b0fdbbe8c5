//! [`Config`]: a builder over `ncclConfig_t`.

use std::ffi::{CStr, CString};
use std::mem::{offset_of, size_of};
use std::sync::Arc;

use nccl_sys::{ncclConfig_t, NCCL_CONFIG_UNDEF_INT};

use crate::error::{Error, Result};
use crate::library::Library;
use crate::version::Version;

/// Communicator options (`ncclConfig_t`). Unset fields keep NCCL's defaults.
///
/// The raw struct is filled for the loaded library: its `size` and `version` are those of
/// that release's layout, so NCCL 2.18 through 2.32 all accept it. Setting a field the
/// loaded release does not have is [`Error::Unsupported`] at init.
///
/// ```
/// use nccl_safe::Config;
/// let cfg = Config::new().blocking(false).comm_name("grads").max_ctas(16);
/// assert_eq!(cfg.is_blocking(), false);
/// ```
#[derive(Debug, Clone, Default)]
pub struct Config {
    /// Integer fields by [`Field`]; `None` keeps NCCL's default.
    ints: [Option<i32>; INT_FIELDS.len()],
    /// Shared, not copied: NCCL keeps `commName` by pointer and reads it after the call
    /// (its async init, and a split child that inherits the parent's config), so a
    /// communicator keeps these alive through [`ConfigNames`].
    net_name: Option<Arc<CStr>>,
    comm_name: Option<Arc<CStr>>,
    /// Watchdog, flight recorder and fingerprint options (builder methods in `diag`).
    pub(crate) diag: crate::diag::DiagConfig,
}

/// What a communicator keeps of the [`Config`] it was made with, and its split and shrink
/// children inherit (NCCL copies the parent's config into a child made without one,
/// init.cc:1798-1801 of 2.28.9): the name strings (`netName`, `commName`), kept alive, and
/// the resource-sharing fields, which decide whether its children share its abort flag.
#[derive(Debug, Clone, Default)]
pub(crate) struct ConfigNames {
    _net: Option<Arc<CStr>>,
    _comm: Option<Arc<CStr>>,
    /// `splitShare` and `shrinkShare` as set (`None`: NCCL's default, 0).
    pub(crate) share: (Option<i32>, Option<i32>),
}

impl ConfigNames {
    /// Leaves the name strings alive for the rest of the process: for a handle given away
    /// (`Communicator::into_raw`). NCCL keeps `commName` by pointer and reads it again
    /// after the call (2.28.9 init.cc:1251; a split's profiler init, profiler.cc:192), and
    /// a child made without a config inherits the pointer (init.cc:1798-1801), so it must
    /// live as long as the handle and every child of it, which the crate no longer sees.
    /// A few bytes per name set, once per handle given away.
    pub(crate) fn leak(self) {
        std::mem::forget(self);
    }
}

/// Whether NCCL 2.28.9 shares a parent's resources (and abort flag) with its split
/// (`shrink` false) or shrink child for this value of `splitShare` or `shrinkShare`: a
/// `splitShare` other than 1 counts as 0 (init.cc:1775-1778), any `shrinkShare` but 0 as
/// sharing (init.cc:2582).
pub(crate) fn shares(value: i32, shrink: bool) -> bool {
    if shrink {
        value != 0
    } else {
        value == 1
    }
}

/// The release that added `commName`, the one pointer field after the integers.
const COMM_NAME_SINCE: (u32, u32) = (2, 27);

/// Declares the integer fields of `ncclConfig_t`, one row each: its setter, the C field and
/// the release that added it. A row yields its entry in [`INT_FIELDS`] (in row order, which
/// is [`Field`]'s) and its setter, so no index is written by hand.
macro_rules! int_fields {
    ($(
        $(#[$doc:meta])*
        fn $setter:ident($ty:ty) => $c:ident, since ($maj:literal, $min:literal);
    )*) => {
        /// An integer field, by its setter's name; its value is its row in [`INT_FIELDS`].
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy)]
        enum Field { $($setter,)* }

        /// Integer fields: (C name, offset in the 2.32 struct, release that added it).
        const INT_FIELDS: &[(&str, usize, (u32, u32))] = &[
            $((stringify!($c), offset_of!(ncclConfig_t, $c), ($maj, $min)),)*
        ];

        impl Config {
            $(
                $(#[$doc])*
                pub fn $setter(mut self, value: $ty) -> Config {
                    self.ints[Field::$setter as usize] = Some(i32::from(value));
                    self
                }
            )*
        }
    };
}

int_fields! {
    /// `blocking`. The crate's own communicators are always created in NCCL's non-blocking
    /// mode, so that no init, split or call can wait for ever, and every `ncclInProgress`
    /// is waited out (bounded by [`Config::timeout`]): they behave as blocking ones
    /// whatever this says. It tells [`crate::Communicator::from_raw`] how an adopted handle
    /// was created. To do other work during init, use
    /// [`crate::Communicator::init_rank_nonblocking`]. `NCCL_COMM_BLOCKING=1`, which
    /// overrides this mode inside NCCL, is refused when a communicator is created.
    fn blocking(bool) => blocking, since (2, 14);
    /// `cgaClusterSize`: CUDA thread-block cluster size (Hopper and later).
    fn cga_cluster_size(i32) => cgaClusterSize, since (2, 14);
    /// `minCTAs`: lower bound on CTAs (channels) per collective.
    fn min_ctas(i32) => minCTAs, since (2, 14);
    /// `maxCTAs`: upper bound on CTAs per collective.
    fn max_ctas(i32) => maxCTAs, since (2, 14);
    /// `splitShare`: children of `split` share the parent's resources (1) or not (0). With
    /// 1, `split` is refused: NCCL would give the child its parent's abort flag, so that
    /// aborting one silently ends the other's work.
    fn split_share(i32) => splitShare, since (2, 18);
    /// `trafficClass`: network traffic class (NCCL 2.26+).
    fn traffic_class(i32) => trafficClass, since (2, 26);
    /// `collnetEnable`: allow CollNet/SHARP (NCCL 2.27+).
    fn collnet_enable(i32) => collnetEnable, since (2, 27);
    /// `CTAPolicy`: `NCCL_CTA_POLICY_*` bits (NCCL 2.27+).
    fn cta_policy(i32) => CTAPolicy, since (2, 27);
    /// `shrinkShare`: children of `shrink` share resources (NCCL 2.27+). With 1, `shrink`
    /// is refused, as `split` is for [`split_share`](Self::split_share).
    fn shrink_share(i32) => shrinkShare, since (2, 27);
    /// `nvlsCTAs`: CTAs for NVLS collectives (NCCL 2.27+).
    fn nvls_ctas(i32) => nvlsCTAs, since (2, 27);
    /// `nChannelsPerNetPeer` (NCCL 2.28+).
    fn n_channels_per_net_peer(i32) => nChannelsPerNetPeer, since (2, 28);
    /// `nvlinkCentricSched` (NCCL 2.28+).
    fn nvlink_centric_sched(i32) => nvlinkCentricSched, since (2, 28);
    /// `graphUsageMode` (NCCL 2.29+).
    fn graph_usage_mode(i32) => graphUsageMode, since (2, 29);
    /// `numRmaCtx` (NCCL 2.29+).
    fn num_rma_ctx(i32) => numRmaCtx, since (2, 29);
    /// `maxP2pPeers` (NCCL 2.30+).
    fn max_p2p_peers(i32) => maxP2pPeers, since (2, 30);
    /// `graphStreamOrdering` (NCCL 2.31+).
    fn graph_stream_ordering(i32) => graphStreamOrdering, since (2, 31);
    /// `launchOrderImplicit` (NCCL 2.31+).
    fn launch_order_implicit(i32) => launchOrderImplicit, since (2, 31);
    /// `numRmaSig` (NCCL 2.31+).
    fn num_rma_sig(i32) => numRmaSig, since (2, 31);
    /// `rmaEagerInit` (NCCL 2.31+).
    fn rma_eager_init(i32) => rmaEagerInit, since (2, 31);
    /// `hostCftMode`: an `ncclHostCftMode_t` (NCCL 2.31+).
    fn host_cft_mode(i32) => hostCftMode, since (2, 31);
    /// `nvlsHostMode`: `ncclNvlsHostMode_t` bits (NCCL 2.32+).
    fn nvls_host_mode(i32) => nvlsHostMode, since (2, 32);
}

/// The size of `ncclConfig_t` in the given release: the 2.32 layout cut after the last
/// field that release has (fields are only ever appended).
pub(crate) fn layout_size(v: Version) -> usize {
    let at = (v.major, v.minor);
    let mut end = offset_of!(ncclConfig_t, splitShare) + size_of::<i32>();
    for (_, off, since) in INT_FIELDS {
        if *since <= at {
            end = end.max(off + size_of::<i32>());
        }
    }
    if COMM_NAME_SINCE <= at {
        end = end.max(offset_of!(ncclConfig_t, commName) + size_of::<*const i8>());
    }
    // Round up to the struct's alignment, as C's sizeof does.
    let align = std::mem::align_of::<ncclConfig_t>();
    end.div_ceil(align) * align
}

impl Config {
    /// All fields unset (NCCL's defaults, blocking).
    pub fn new() -> Config {
        Config::default()
    }

    /// Whether this config asks for blocking calls (NCCL's default).
    pub fn is_blocking(&self) -> bool {
        self.ints[Field::blocking as usize] != Some(0)
    }

    /// The resource-sharing field this config turns on, if any (see [`shares`]).
    pub(crate) fn shared_resources(&self) -> Option<&'static str> {
        let (split, shrink) = self.names().share;
        let split = shares(split.unwrap_or(0), false).then_some("splitShare");
        split.or(shares(shrink.unwrap_or(0), true).then_some("shrinkShare"))
    }

    /// `netName`: the network plugin or transport to use (e.g. `"IB"`, `"Socket"`).
    /// A name with an interior NUL is rejected at init.
    pub fn net_name(mut self, name: &str) -> Config {
        self.net_name = Some(Arc::from(CString::new(name).unwrap_or_default()));
        self
    }

    /// `commName`: a name shown in NCCL's logs and profilers (NCCL 2.27+).
    pub fn comm_name(mut self, name: &str) -> Config {
        self.comm_name = Some(Arc::from(CString::new(name).unwrap_or_default()));
        self
    }

    /// The name strings the raw struct of [`to_raw`](Self::to_raw) points into, for the
    /// communicator to keep.
    pub(crate) fn names(&self) -> ConfigNames {
        ConfigNames {
            _net: self.net_name.clone(),
            _comm: self.comm_name.clone(),
            share: (
                self.ints[Field::split_share as usize],
                self.ints[Field::shrink_share as usize],
            ),
        }
    }

    /// Fills NCCL's struct for `lib`. The returned struct points into the name strings
    /// `self` shares with its clones and its [`names`](Self::names): keep one of those
    /// alive as long as NCCL may read them (for `commName`, the communicator's life and its
    /// children's: NCCL 2.28 keeps it by pointer, init.cc:1251, and a split without a
    /// config inherits the pointer).
    pub(crate) fn to_raw(&self, lib: &Library) -> Result<ncclConfig_t> {
        let v = lib.version();
        let at = (v.major, v.minor);
        // The full 2.32 initializer: every field unset.
        // SAFETY: ncclConfig_t is plain data (ints and pointers); all-zero is a valid value,
        // and every field is then set explicitly below.
        let mut raw: ncclConfig_t = unsafe { std::mem::zeroed() };
        raw.size = layout_size(v);
        raw.magic = nccl_sys::bindings::NCCL_API_MAGIC;
        raw.version = v.code() as u32;
        let base = &mut raw as *mut ncclConfig_t as *mut u8;
        for (i, (name, off, since)) in INT_FIELDS.iter().enumerate() {
            let value = match self.ints[i] {
                Some(_) if *since > at => {
                    return Err(Error::Unsupported {
                        symbol: name,
                        needs: Version::new(since.0, since.1, 0),
                        found: v,
                    })
                }
                Some(value) => value,
                None => NCCL_CONFIG_UNDEF_INT,
            };
            // SAFETY: `off` is the offset of an i32 field of ncclConfig_t (from offset_of!).
            unsafe { base.add(*off).cast::<i32>().write(value) };
        }
        raw.netName = self
            .net_name
            .as_ref()
            .map_or(std::ptr::null(), |s| s.as_ptr());
        raw.commName = match &self.comm_name {
            Some(_) if at < COMM_NAME_SINCE => {
                return Err(Error::Unsupported {
                    symbol: "commName",
                    needs: Version::new(COMM_NAME_SINCE.0, COMM_NAME_SINCE.1, 0),
                    found: v,
                })
            }
            Some(s) => s.as_ptr(),
            None => std::ptr::null(),
        };
        Ok(raw)
    }
}

/// The diagnostics options: the watchdog, the flight recorder, timing and aborts (see
/// [`crate::diag`]).
impl Config {
    /// [`timing`](Self::timing), unless it was set.
    pub(crate) fn timing_unless_set(mut self, precise: bool) -> Config {
        self.diag.precise.get_or_insert(precise);
        self
    }

    /// Sets the remote desync board (see nccl-launch's `desync`).
    #[cfg(feature = "diag")]
    pub(crate) fn remote_board(mut self, board: Arc<dyn crate::diag::RemoteBoard>) -> Config {
        // Not asked again for a while once it failed to answer (`remote::Guarded`).
        self.diag.board = Some(Arc::new(crate::diag::remote::Guarded::new(board)));
        self
    }

    /// Gives the communicator the job's desync board: when its clique times out, it posts
    /// what its ranks were last doing, and its report shows what the ranks in other
    /// processes posted (instead of "no record"). Nothing is sent in normal operation.
    /// nccl-launch's `ProcessLauncher::init` sets it for you.
    /// Children from split/shrink do not inherit it (their ranks are numbered differently).
    #[cfg(feature = "diag")]
    pub fn desync_board(self, board: impl crate::diag::RemoteBoard + 'static) -> Config {
        self.remote_board(Arc::new(board))
    }

    /// The watchdog's timeout for every operation of the communicator (default
    /// `NCCL_SAFE_TIMEOUT_MS`, else 10 minutes, PyTorch's default). Children from
    /// split/shrink inherit it.
    ///
    /// It bounds an operation from its call to its completion, the wait for the slowest rank
    /// to call it included: a rank that saves a checkpoint while the others wait in the next
    /// all-reduce makes them wait that long (the transfer itself takes well under a second).
    /// After a quarter of the timeout (at most a minute) the watchdog prints one notice per
    /// waiting operation: what the rank waits in, from which line, and which ranks of its
    /// process have not called it. nccl-launch's `Launcher::timeout` is
    /// a bound of its own.
    pub fn timeout(mut self, timeout: std::time::Duration) -> Config {
        self.diag.timeout = Some(timeout);
        self
    }

    /// Turns the collective fingerprint check on or off (default: on with
    /// `NCCL_SAFE_DEBUG=detail`). Every rank must use the same setting.
    #[cfg(feature = "diag")]
    pub fn check_collectives(mut self, on: bool) -> Config {
        self.diag.check = Some(on);
        self
    }

    /// How many operations the flight recorder keeps (default 64, or
    /// `NCCL_SAFE_FLIGHT_RECORD_LEN`; 0 turns recording off).
    #[cfg(feature = "diag")]
    pub fn flight_record_len(mut self, len: usize) -> Config {
        self.diag.ring = Some(len);
        self
    }

    /// Writes the flight record as JSON into `dir` on a timeout or error (default
    /// `NCCL_SAFE_FLIGHT_RECORD_DIR`, else nowhere).
    #[cfg(feature = "diag")]
    pub fn flight_record_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Config {
        self.diag.dump_dir = Some(dir.into());
        self
    }

    /// Prints the flight record to stderr on a timeout or error (default: with
    /// `NCCL_SAFE_DEBUG=info` or `detail`).
    #[cfg(feature = "diag")]
    pub fn dump_on_failure(mut self, on: bool) -> Config {
        self.diag.dump_stderr = Some(on);
        self
    }

    /// Times every operation with the precise clock (default: with `NCCL_SAFE_TIMING=1` or
    /// `NCCL_SAFE_DEBUG=info|detail`; children inherit it).
    ///
    /// Off, the watchdog, the flight recorder and [`crate::diag::Diagnostics::wait`] use a
    /// coarse clock the watchdog advances every 10 ms (see ARCHITECTURE.md for its cost):
    /// timeouts fire within a tick of their deadline, per-operation times read as whole
    /// ticks, and sums over many operations are right on average.
    /// nccl-launch's `Launcher::run_report` turns it on for its communicators.
    #[cfg(feature = "diag")]
    pub fn timing(mut self, precise: bool) -> Config {
        self.diag.precise = Some(precise);
        self
    }

    /// Where the watchdog learns that an operation's GPU work finished (default on, unless
    /// `NCCL_SAFE_EXACT_COMPLETION=0`; children inherit it).
    ///
    /// On, the owner records a CUDA event on the operation's stream right after its NCCL
    /// call (once per stream for a [`crate::Group`]): nothing enqueued on that stream
    /// afterwards counts against the operation, so a stream blocked after a collective
    /// never times it out, and work on `CU_STREAM_PER_THREAD` (candle's stream) is watched.
    /// It costs a `cuEventRecord` per operation or group, as PyTorch's ProcessGroupNCCL
    /// pays (plus a `cuCtxGetCurrent` and `cuCtxSetCurrent` when the stream's context is not
    /// current, and a `cuStreamIsCapturing` on `CU_STREAM_PER_THREAD`, or while more than
    /// 64 markers are in flight on the stream). Under graph capture the record adds no
    /// node, and the watchdog does not query it while the capture is open.
    ///
    /// Off, the per-operation path makes no CUDA driver call of its own: the watchdog
    /// records one event per stream per tick, behind whatever was enqueued by then, so
    /// work enqueued on the same stream shortly after a collective counts against it, and
    /// a per-thread stream is not watched. The host provider is unaffected.
    #[cfg(feature = "diag")]
    pub fn exact_completion(mut self, on: bool) -> Config {
        self.diag.exact = Some(on);
        self
    }

    /// The bound on an abort (default `NCCL_SAFE_ABORT_TIMEOUT_MS`, else
    /// [`crate::diag::DEFAULT_ABORT_TIMEOUT`], 30 s). NVIDIA's `ncclCommAbort` can block for ever
    /// behind a stuck stream, so aborts run on a thread of their own: the watchdog never
    /// waits for one, and a communicator's drop waits at most this long. Past it,
    /// [`on_abort_timeout`](Self::on_abort_timeout) applies. Children inherit it.
    ///
    /// For NVIDIA's NCCL it must be at least [`crate::diag::MIN_NCCL_ABORT_TIMEOUT`] (2 s):
    /// its teardown of even an idle communicator takes 0.5 to 1 s, so init refuses a
    /// shorter bound with [`crate::Error::InvalidArgument`]. With several ranks of the
    /// communicator in this process, NCCL frees them all in the last one's teardown, so the
    /// bound grows by [`crate::diag::NCCL_RECLAIM_PER_LOCAL_RANK`] per other rank here.
    pub fn abort_timeout(mut self, bound: std::time::Duration) -> Config {
        self.diag.abort_timeout = Some(bound);
        self
    }

    /// What happens to an abort still running at its
    /// [`abort_timeout`](Self::abort_timeout) (default `NCCL_SAFE_ON_ABORT_TIMEOUT=report|exit`,
    /// else [`crate::diag::OnAbortTimeout::Report`]). Children inherit it.
    pub fn on_abort_timeout(mut self, action: crate::diag::OnAbortTimeout) -> Config {
        self.diag.on_abort_timeout = Some(action);
        self
    }

    /// Keep the handle for a shrink when a rank is lost (default off). When the watchdog
    /// fails this communicator's clique because a rank left or an operation ran out of
    /// time, it **revokes** the communicator (`ncclCommRevoke`: its work in flight ends,
    /// its operations are refused) instead of aborting it, and leaves the handle with
    /// its owner, so that
    /// [`shrink_after_failure`](crate::Communicator::shrink_after_failure) can make a
    /// communicator of the ranks left; [`Communicator::lost_rank`](crate::Communicator::lost_rank)
    /// names the rank that left. Every handle is still torn down once: by its owner (a
    /// dropped revoked communicator aborts). Without `ncclCommRevoke` (NCCL before 2.29),
    /// or when the revoke fails, and for a GPU fault, the watchdog aborts as usual.
    /// Children inherit it.
    pub fn elastic(mut self, on: bool) -> Config {
        self.diag.elastic = Some(on);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_sizes_match_each_releases_struct() {
        // Sizes read off the headers of each release (x86_64).
        assert_eq!(layout_size(Version::new(2, 18, 3)), 48);
        assert_eq!(layout_size(Version::new(2, 26, 2)), 48);
        assert_eq!(layout_size(Version::new(2, 27, 3)), 72);
        assert_eq!(layout_size(Version::new(2, 28, 3)), 80);
        assert_eq!(
            layout_size(Version::new(2, 32, 3)),
            size_of::<ncclConfig_t>()
        );
    }

    /// NCCL keeps `commName` by pointer (2.28.9 init.cc:1251) and reads it again after the
    /// handle left this crate (a split's profiler init, profiler.cc:192; a child made
    /// without a config inherits the pointer, init.cc:1798-1801): `into_raw` must leave
    /// the string alive, though the caller's `Config` and the communicator are gone.
    #[cfg(all(feature = "host", feature = "diag"))]
    #[test]
    fn into_raw_leaves_the_name_nccl_points_to_alive() {
        use crate::{CommDevice, Communicator};
        let id = CommDevice::Host.unique_id().unwrap();
        let (comm, name) = {
            let cfg = Config::new().comm_name("given-away");
            let name = Arc::downgrade(cfg.comm_name.as_ref().unwrap());
            let comm = Communicator::init_rank(&CommDevice::Host, 1, 0, &id, &cfg).unwrap();
            (comm, name)
        };
        assert!(name.upgrade().is_some(), "the communicator keeps its name");
        let raw = comm.into_raw();
        assert!(
            name.upgrade().is_some(),
            "into_raw freed the name NCCL still points to"
        );
        // SAFETY: `raw` is a live host communicator whose name is alive (checked above).
        let read = unsafe { crate::host::comm_name(raw) };
        assert_eq!(read.as_deref(), Some("given-away"));
        // SAFETY: `raw` is live and ours: its one teardown.
        let r = unsafe { (Library::host().table().ncclCommDestroy)(raw) };
        assert_eq!(r, nccl_sys::bindings::ncclSuccess);
    }

    /// Every row's setter writes its own C field, and nothing else.
    #[cfg(feature = "host")]
    #[test]
    fn each_setter_writes_its_own_field() {
        let lib = Library::host();
        let raw = Config::new()
            .blocking(false)
            .cga_cluster_size(2)
            .min_ctas(3)
            .max_ctas(4)
            .split_share(1)
            .cta_policy(5)
            .nvls_host_mode(6)
            .to_raw(&lib)
            .unwrap();
        assert_eq!(
            (raw.blocking, raw.cgaClusterSize, raw.minCTAs, raw.maxCTAs),
            (0, 2, 3, 4)
        );
        assert_eq!((raw.splitShare, raw.CTAPolicy, raw.nvlsHostMode), (1, 5, 6));
        assert_eq!(raw.trafficClass, NCCL_CONFIG_UNDEF_INT);
        assert_eq!(raw.maxP2pPeers, NCCL_CONFIG_UNDEF_INT);
        assert!(!Config::new().blocking(false).is_blocking());
        assert!(Config::new().blocking(true).is_blocking());
        // Row i of the table is the field at its offset, for every row.
        for (i, (name, off, _)) in INT_FIELDS.iter().enumerate() {
            let mut c = Config::new();
            c.ints[i] = Some(1000 + i as i32);
            let raw = c.to_raw(&lib).unwrap();
            let base = &raw as *const ncclConfig_t as *const u8;
            // SAFETY: `off` is the offset of an i32 field inside `raw`.
            let got = unsafe { base.add(*off).cast::<i32>().read() };
            assert_eq!(got, 1000 + i as i32, "{name}");
        }
    }
}
