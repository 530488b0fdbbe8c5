//! NCCL's parameters that override what the crate asks for (read as NCCL reads them:
//! [`nccl_sys::param`]), refused where they would break the crate's guarantees.

use super::*;

/// Refuses to create a communicator (`config`: the crate's request, `None` for
/// `ncclCommInitAll`, which passes NCCL's defaults) when an NCCL parameter overrides it
/// into a mode the crate cannot keep its promises in:
///
/// - `NCCL_COMM_BLOCKING=1` overrides the non-blocking mode (`envConfigOverride`,
///   init.cc:1646-1649): NCCL's init would wait inside the call, for ever for a rank that
///   never joins, where no bound of the crate's can end it (not for `ncclCommInitAll`,
///   blocking anyway, whose ranks are all in the call);
/// - `splitShare` / `shrinkShare` = 1 (the config's, or `NCCL_COMM_SPLIT_SHARE_RESOURCES` /
///   `NCCL_COMM_SHRINK_SHARE_RESOURCES`, which override it, init.cc:1719-1730): a child then
///   shares its parent's abort flag (init.cc:2582-2588), which an abort never clears. Once
///   either is aborted, the other's calls still return ncclSuccess
///   (`ncclCommEnsureReady`, init.cc:376-378) and its kernels exit without moving data: a
///   collective that "succeeds" with its buffers untouched.
pub(super) fn refuse_overrides(call: &'static str, config: Option<&Config>) -> Result<()> {
    let refuse = |reason: String| Err(Error::InvalidArgument { call, reason });
    if config.is_some() && param("NCCL_COMM_BLOCKING") == Some(1) {
        return refuse(
            "NCCL_COMM_BLOCKING=1 (in the environment or an nccl.conf) makes NCCL wait inside this call, for ever if a rank never joins, where Config::timeout cannot end it: unset it (the crate's communicators already behave as blocking ones, bounded by Config::timeout)".into(),
        );
    }
    let shared = [
        ("NCCL_COMM_SPLIT_SHARE_RESOURCES", "splitShare"),
        ("NCCL_COMM_SHRINK_SHARE_RESOURCES", "shrinkShare"),
    ]
    .into_iter()
    .find_map(|(var, field)| (param(var) == Some(1)).then(|| format!("{var}=1 ({field})")))
    .or_else(|| {
        config?
            .shared_resources()
            .map(|f| format!("Config's {f} = 1"))
    });
    match shared {
        Some(what) => refuse(format!(
            "{what} makes a split's or shrink's child share its parent's abort flag, so aborting one (a failure, a timeout, a drop after an error) makes the other's collectives return success without moving data: leave resource sharing off"
        )),
        None => Ok(()),
    }
}

/// NCCL's value of `name` as the `int` of a config override.
fn param(name: &str) -> Option<i32> {
    nccl_sys::param(name).map(|v| v as i32)
}
