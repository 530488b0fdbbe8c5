//! Prints which NCCL nccl-safe finds and what it can do:
//! `cargo run --example info` (set `NCCL_LIBRARY` to pin a file).

use std::process::ExitCode;

use nccl_safe::{Library, Result, UniqueId};

fn run() -> Result<()> {
    let lib = Library::load()?;
    match (lib.path(), lib.source()) {
        (Some(p), Some(source)) => println!("library:  {} ({source})", p.display()),
        (Some(p), None) => println!("library:  {}", p.display()),
        (None, _) => println!("library:  in-process ({:?})", lib.provider()),
    }
    println!("version:  NCCL {}", lib.version());
    println!("optional entry points:");
    for (name, present) in lib.optional_features() {
        let since = nccl_sys::optional_since(name).unwrap_or((0, 0));
        let mark = if present { "yes" } else { "no " };
        println!("  {mark}  {name:<26} (NCCL {}.{}+)", since.0, since.1);
    }
    let id = UniqueId::new_with(&lib)?;
    let head: String = id.to_bytes()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    println!("unique id: {head}... (128 bytes)");
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
