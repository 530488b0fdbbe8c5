//! NCCL's parameter API (`ncclParam*`, NCCL 2.30+) as typed values:
//! [`Library::param`], [`Library::param_names`], [`Library::bind_param`] and [`Param`].
//!
//! NCCL 2.30.7 has no call that sets a parameter: they are read from the environment (or
//! `nccl.conf`, or an environment plugin), so set the variable before NCCL first reads it.

use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::Location;
use std::sync::Arc;

use nccl_sys::bindings::{ncclInvalidArgument, ncclParamHandle_t, ncclSuccess};
use nccl_sys::EntryPoint;

use crate::error::{invalid, Error, Result};
use crate::library::{CallContext, Library};

/// A parameter of NCCL's, bound by name ([`Library::bind_param`], `ncclParamBind`): read
/// it as its type with [`get`](Self::get), or as bytes with [`raw`](Self::raw). The
/// handle belongs to NCCL's parameter system for the library's lifetime, which `Param`
/// keeps alive.
pub struct Param {
    lib: Arc<Library>,
    handle: ncclParamHandle_t,
    name: String,
}

// SAFETY: the handle names an entry of NCCL's process-wide registry, never freed; NCCL
// loads a value under the entry's mutex and hands text out in buffers of the calling
// thread (param.h:139-158, c_api.cc:108-111), so any thread may read through it.
unsafe impl Send for Param {}
// SAFETY: as for `Send`: every read through the handle is NCCL's own thread-safe getter.
unsafe impl Sync for Param {}

impl std::fmt::Debug for Param {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Param").field("name", &self.name).finish()
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A type a parameter can be read as ([`Param::get`]): the fixed-width integers
/// (`ncclParamGetI8` ... `ncclParamGetU64`) and `String` (`ncclParamGetStr`). NCCL
/// refuses a type other than the parameter's own (c_api.cc:76-79 of 2.30.7): that is
/// [`Error::InvalidArgument`] naming the parameter and the type asked for.
pub trait ParamType: sealed::Sealed + Sized {
    /// The C type's name, for errors.
    const NAME: &'static str;
    /// The getter's entry point.
    const ENTRY: EntryPoint;
    #[doc(hidden)]
    fn read(p: &Param, caller: &'static Location<'static>) -> Result<Self>;
}

macro_rules! int_param {
    ($($t:ty => $f:ident, $c:literal;)*) => {$(
        impl sealed::Sealed for $t {}
        impl ParamType for $t {
            const NAME: &'static str = $c;
            const ENTRY: EntryPoint = EntryPoint::$f;
            fn read(p: &Param, caller: &'static Location<'static>) -> Result<Self> {
                let get = p.lib.optional(p.lib.table().$f, Self::ENTRY.name())?;
                let mut v: $t = 0;
                // SAFETY: the handle came from ncclParamBind of this library (kept alive);
                // `v` is a writable `$t`, the type this getter writes.
                let r = unsafe { get(p.handle, &mut v) };
                p.check::<Self>(r, caller)?;
                Ok(v)
            }
        }
    )*};
}

int_param! {
    i8 => ncclParamGetI8, "int8_t";
    i16 => ncclParamGetI16, "int16_t";
    i32 => ncclParamGetI32, "int32_t";
    i64 => ncclParamGetI64, "int64_t";
    u8 => ncclParamGetU8, "uint8_t";
    u16 => ncclParamGetU16, "uint16_t";
    u32 => ncclParamGetU32, "uint32_t";
    u64 => ncclParamGetU64, "uint64_t";
}

impl sealed::Sealed for String {}
impl ParamType for String {
    const NAME: &'static str = "const char*";
    const ENTRY: EntryPoint = EntryPoint::ncclParamGetStr;
    fn read(p: &Param, caller: &'static Location<'static>) -> Result<Self> {
        let get = p
            .lib
            .optional(p.lib.table().ncclParamGetStr, Self::ENTRY.name())?;
        let mut out: *const c_char = std::ptr::null();
        // SAFETY: the handle came from ncclParamBind of this library; `out` is a writable
        // out-pointer.
        let r = unsafe { get(p.handle, &mut out) };
        p.check::<Self>(r, caller)?;
        // SAFETY: on success NCCL wrote a C string in a buffer of this thread's, valid
        // until this thread's next ncclParamGetStr (c_api.cc:108-111): copied at once.
        Ok(unsafe { text(out) })
    }
}

/// A C string NCCL handed out (NULL as empty), copied.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for the call.
unsafe fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

impl Param {
    /// The parameter's name, e.g. `"NCCL_DEBUG_FILE"`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The value as `T`, the parameter's own type (`ncclParamGet{I8..U64,Str}`): read
    /// again at each call, unless NCCL caches the parameter.
    ///
    /// Errors: [`Error::InvalidArgument`] when `T` is not the parameter's type; NCCL's
    /// error otherwise.
    #[track_caller]
    pub fn get<T: ParamType>(&self) -> Result<T> {
        T::read(self, Location::caller())
    }

    /// The value's bytes as NCCL stores them (`ncclParamGet`): an integer's or a
    /// boolean's in native byte order, a string's with its terminating NUL, an
    /// enumeration's as its C type. The buffer grows until the value fits (up to 1 MiB).
    #[track_caller]
    pub fn raw(&self) -> Result<Vec<u8>> {
        const OP: &str = EntryPoint::ncclParamGet.name();
        let caller = Location::caller();
        let get = self.lib.optional(self.lib.table().ncclParamGet, OP)?;
        let mut buf = vec![0u8; 64];
        loop {
            let mut len: c_int = 0;
            // SAFETY: the handle came from ncclParamBind of this library; `buf` holds
            // `buf.len()` (<= 1 MiB, fits c_int) writable bytes; `len` is writable.
            let r = unsafe {
                get(
                    self.handle,
                    buf.as_mut_ptr().cast(),
                    buf.len() as c_int,
                    &mut len,
                )
            };
            if r == ncclSuccess {
                buf.truncate((len.max(0) as usize).min(buf.len()));
                return Ok(buf);
            }
            // Too small: NCCL writes 0 to `len` and returns ncclInvalidArgument
            // (param.h:97-100, 210-213).
            if r == ncclInvalidArgument && len == 0 && buf.len() < 1 << 20 {
                let grown = buf.len() * 4;
                buf.resize(grown, 0);
                continue;
            }
            return Err(self
                .lib
                .error_for(OP, r, CallContext::at(None, caller))
                .into());
        }
    }

    fn check<T: ParamType>(
        &self,
        r: nccl_sys::ncclResult_t,
        caller: &'static Location<'static>,
    ) -> Result<()> {
        if r == ncclSuccess {
            return Ok(());
        }
        if r == ncclInvalidArgument {
            // The handle and the out-pointer are valid: the type is not the parameter's.
            return Err(invalid(
                T::ENTRY.name(),
                format!("parameter {} is not of type {} (NCCL refused to read it as one; Param::raw reads any type)", self.name, T::NAME),
            ));
        }
        Err(self
            .lib
            .error_for(T::ENTRY.name(), r, CallContext::at(None, caller))
            .into())
    }
}

/// `name` as a C string: interior NULs are refused.
fn c_name(call: &'static str, name: &str) -> Result<CString> {
    CString::new(name)
        .map_err(|_| invalid(call, format!("parameter name {name:?} holds a NUL byte")))
}

impl Library {
    /// The text of NCCL's parameter `name` (`ncclParamGetParameter`, NCCL 2.30+), as NCCL
    /// prints it: `"TRUE"`/`"FALSE"` for a boolean, the names of a set's members, a
    /// string as it is (empty when unset).
    ///
    /// Errors: [`Error::Unsupported`] before NCCL 2.30; [`Error::UnknownParam`] for a name
    /// NCCL's registry does not hold (many `NCCL_*` variables NCCL reads are not in it:
    /// [`param_names`](Self::param_names) lists those that are).
    ///
    /// ```
    /// let lib = nccl_safe::Library::host();
    /// assert_eq!(lib.param("NCCL_SET_THREAD_NAME")?, "FALSE");
    /// assert!(matches!(lib.param("NCCL_NO_SUCH"), Err(nccl_safe::Error::UnknownParam { .. })));
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[track_caller]
    pub fn param(&self, name: &str) -> Result<String> {
        const OP: &str = EntryPoint::ncclParamGetParameter.name();
        let caller = Location::caller();
        let get = self.optional(self.table().ncclParamGetParameter, OP)?;
        let key = c_name(OP, name)?;
        let mut value: *const c_char = std::ptr::null();
        let mut len: c_int = 0;
        // SAFETY: `key` is a C string; `value` and `len` are writable out-pointers.
        let r = unsafe { get(key.as_ptr(), &mut value, &mut len) };
        if r == ncclInvalidArgument {
            // Every pointer is valid: the key is not in the registry (c_api.cc:171-176).
            return Err(Error::UnknownParam {
                name: name.to_string(),
            });
        }
        self.check(OP, r, CallContext::at(None, caller))?;
        // SAFETY: on success `value` is a C string in a buffer of this thread's, valid
        // until its next ncclParamGetParameter (c_api.cc:164-168): copied at once.
        Ok(unsafe { text(value) })
    }

    /// The names of NCCL's documented parameters (`ncclParamGetAllParameterKeys`, NCCL
    /// 2.30+; every one under `NCCL_PARAM_DUMP_ALL=1`).
    ///
    /// Errors: [`Error::Unsupported`] before NCCL 2.30.
    #[track_caller]
    pub fn param_names(&self) -> Result<Vec<String>> {
        const OP: &str = EntryPoint::ncclParamGetAllParameterKeys.name();
        let caller = Location::caller();
        let get = self.optional(self.table().ncclParamGetAllParameterKeys, OP)?;
        let mut table: *mut *const c_char = std::ptr::null_mut();
        let mut len: c_int = 0;
        // SAFETY: both are writable out-pointers.
        let r = unsafe { get(&mut table, &mut len) };
        self.check(OP, r, CallContext::at(None, caller))?;
        if table.is_null() || len <= 0 {
            return Ok(Vec::new());
        }
        // SAFETY: on success `table` holds `len` C strings, in storage of this thread's
        // valid until its next call (c_api.cc:128-153): copied at once.
        let keys = unsafe { std::slice::from_raw_parts(table, len as usize) };
        Ok(keys.iter().map(|&k| unsafe { text(k) }).collect())
    }

    /// Binds NCCL's parameter `name` (`ncclParamBind`, NCCL 2.30+) for typed reads.
    ///
    /// Errors: [`Error::Unsupported`] before NCCL 2.30; [`Error::UnknownParam`] for a name
    /// not in NCCL's registry.
    ///
    /// ```
    /// let lib = nccl_safe::Library::host();
    /// let levels = lib.bind_param("NCCL_DEBUG_TIMESTAMP_LEVELS")?;
    /// assert_eq!(levels.get::<u32>()?, 1 << 2); // WARN
    /// assert!(levels.get::<i64>().is_err()); // not its type
    /// # Ok::<(), nccl_safe::Error>(())
    /// ```
    #[track_caller]
    pub fn bind_param(self: &Arc<Self>, name: &str) -> Result<Param> {
        const OP: &str = EntryPoint::ncclParamBind.name();
        let caller = Location::caller();
        let bind = self.optional(self.table().ncclParamBind, OP)?;
        let key = c_name(OP, name)?;
        let mut handle: ncclParamHandle_t = std::ptr::null_mut();
        // SAFETY: `handle` is a writable out-pointer, `key` a C string.
        let r = unsafe { bind(&mut handle, key.as_ptr()) };
        if r == ncclInvalidArgument {
            // Both pointers are valid: the key is not in the registry (c_api.cc:58-62).
            return Err(Error::UnknownParam {
                name: name.to_string(),
            });
        }
        self.check(OP, r, CallContext::at(None, caller))?;
        if handle.is_null() {
            return Err(invalid(OP, "NCCL returned success but no handle"));
        }
        Ok(Param {
            lib: Arc::clone(self),
            handle,
            name: name.to_string(),
        })
    }
}
