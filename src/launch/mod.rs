//! Multi-process launch: reading the launcher's environment and exchanging the unique id.
//!
//! A thread `Launcher` (one rank per device) will live next to these modules.

pub mod env;
pub mod rendezvous;
mod wire;
