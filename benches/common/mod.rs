//! The bandwidth bench's parts, shared with `tests/bench_format.rs` (which includes this
//! file with `#[path]`): options, the table, the sweep and the plot.
// Each includer uses a different subset.
#![allow(dead_code)]

pub mod data;
pub mod options;
pub mod plot;
pub mod ranks;
pub mod report;
pub mod sweep;
