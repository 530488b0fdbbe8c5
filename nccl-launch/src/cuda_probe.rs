//! Whether the CUDA driver library can be used, under every cudarc linking mode.
//!
//! cudarc's own probe (`cudarc::driver::sys::is_culib_present`) exists only when cudarc
//! loads the driver at run time (`dynamic-loading`); the application may pick
//! `dynamic-linking` or `static-linking` instead (Cargo unifies cudarc's features across
//! the build). Opening the driver library ourselves works in every mode: under dynamic
//! loading it is the library cudarc would open (its first candidates are these names), and
//! under linking it is already mapped, so opening it again only takes a reference.

/// The driver library's names, most specific first (NCCL runs on Linux only).
const DRIVER_NAMES: &[&str] = &["libcuda.so.1", "libcuda.so"];

/// Whether the CUDA driver library (`libcuda.so.1`) can be opened. Never
/// panics; the library is closed again (a linked or already loaded one stays mapped).
pub(crate) fn driver_present() -> bool {
    any_opens(DRIVER_NAMES)
}

/// Whether one of `names` can be opened by the dynamic loader.
fn any_opens(names: &[&str]) -> bool {
    names.iter().any(|name| {
        // SAFETY: opening a system library runs only its ELF/DLL initialisers, which have
        // no preconditions for the CUDA driver; no symbol is read and the handle is dropped
        // at once.
        unsafe { libloading::Library::new(*name) }.is_ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A missing library is `false` (not a panic), a present one `true`, whichever comes
    /// first in the list.
    #[test]
    fn the_probe_opens_what_exists_and_only_that() {
        const MISSING: &str = "libnccl-safe-no-such-driver.so.1";
        assert!(!any_opens(&[MISSING]));
        assert!(!any_opens(&[]));
        assert!(any_opens(&[MISSING, "libc.so.6"]));
        assert!(any_opens(&["libc.so.6", MISSING]));
        // Whatever this machine has, the device count follows the probe without panicking.
        let n = crate::cuda_device_count();
        if !driver_present() {
            assert_eq!(n, 0);
        }
    }
}
