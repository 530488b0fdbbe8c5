//! NCCL's parameters that override what the crate asks for (read as NCCL reads them:
//! [`nccl_sys::param`]), refused where they would break the crate's guarantees.

use super::*;

/// Refuses to make a communicator (an init, a split, a shrink, a grow) under
/// `NCCL_COMM_BLOCKING=1`, which overrides the non-blocking mode the crate asks for
/// (`envConfigOverride`, init.cc:1646-1649 of 2.28.9; a child's config too, :1800): NCCL
/// would then wait inside the call, for ever for a rank that never joins, where no bound of
/// the crate's can end it. (Not for `ncclCommInitAll`: blocking anyway, with every rank in
/// the call.)
pub(super) fn refuse_blocking(call: &'static str) -> Result<()> {
    if param("NCCL_COMM_BLOCKING") != Some(1) {
        return Ok(());
    }
    Err(invalid(call, "NCCL_COMM_BLOCKING=1 (in the environment or an nccl.conf) makes NCCL wait inside this call, for ever if a rank never joins, where Config::timeout cannot end it: unset it (the crate's communicators already behave as blocking ones, bounded by Config::timeout)"))
}

/// Refuses a split (`shrink` false) or a shrink whose child would share its parent's
/// resources. `share` is the parent's config (`splitShare`, `shrinkShare`), which
/// `NCCL_COMM_SPLIT_SHARE_RESOURCES` / `NCCL_COMM_SHRINK_SHARE_RESOURCES` override
/// (init.cc:1719-1730), read as `config::shares` says. A sharing child gets its parent's
/// abort flag (:2582-2588), which an abort never clears: once either is aborted (a failure,
/// a timeout, a drop after an error), the other's calls still return ncclSuccess
/// (`ncclCommEnsureReady`, :376-378) and its kernels exit without moving data, collectives
/// that "succeed" with their buffers untouched.
pub(super) fn refuse_sharing(
    call: &'static str,
    share: (Option<i32>, Option<i32>),
    shrink: bool,
) -> Result<()> {
    let (var, field, set) = if shrink {
        ("NCCL_COMM_SHRINK_SHARE_RESOURCES", "shrinkShare", share.1)
    } else {
        ("NCCL_COMM_SPLIT_SHARE_RESOURCES", "splitShare", share.0)
    };
    let from_var = param(var).filter(|&v| v != nccl_sys::NCCL_CONFIG_UNDEF_INT);
    let value = from_var.or(set).unwrap_or(0);
    if !crate::config::shares(value, shrink) {
        return Ok(());
    }
    let what = match from_var {
        Some(v) => format!("{var}={v}"),
        None => format!("the communicator's config ({field} = {value})"),
    };
    Err(invalid(call, format!("{what} makes the child share its parent's abort flag, so aborting one (a failure, a timeout, a drop after an error) makes the other's collectives return success without moving data: leave resource sharing off")))
}

/// NCCL's value of `name` as the `int` of a config override.
fn param(name: &str) -> Option<i32> {
    nccl_sys::param(name).map(|v| v as i32)
}
