//! NCCL 2.30's parameter API (`ncclParamBind`, `ncclParamGet*`, `ncclParamGetParameter`,
//! `ncclParamGetAllParameterKeys`, `ncclParamDumpAll`) as param/c_api.cc of v2.30.7-1 has
//! it, over a registry of the parameters NCCL 2.30.7 declares with `DEFINE_NCCL_PARAM`
//! (param.cc:16-20, debug.cc:80-105, 441) whose parsers are a boolean, a string or the
//! timestamp-levels bit set. `NCCL_DEBUG` and `NCCL_DEBUG_SUBSYS` (an enum and a 64-bit set
//! of debug subsystems) are not registered: the provider has no debug log.
//!
//! A value is read as NCCL's `ncclParam<T>::loadValue` reads it (param.h:163-215): the
//! variable (environment, else an `nccl.conf`, [`nccl_sys::param_str`]) parsed by the
//! parameter's parser, else its default when unset or unparsable; a parameter flagged
//! `NCCL_PARAM_FLAG_CACHED` keeps its first value unless `NCCL_NO_CACHE` names it (or
//! `ALL`), every other one is read again at each access (param.h:139-158).

#![allow(non_snake_case)]

use core::ffi::{c_char, c_int, c_void, CStr};
use std::cell::RefCell;
use std::ffi::CString;
use std::sync::OnceLock;

use nccl_sys::bindings::{ncclInvalidArgument, ncclParamHandle_t, ncclResult_t, ncclSuccess};

use super::defs::Fail;

/// `NCCL_PARAM_FLAG_PUBLISHED` (param/common.h:24).
const PUBLISHED: u64 = 1;
/// `NCCL_PARAM_FLAG_CACHED` (param/common.h:26).
const CACHED: u64 = 1 << 2;

/// How a parameter's text is parsed, and its `ncclParamTypeId_t` (param/common.h:34-46).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `bool` (`NCCL_PARAM_TYPE_BOOL`): 1/T/TRUE or 0/F/FALSE (parser_default.h).
    Bool,
    /// `const char*` (`NCCL_PARAM_TYPE_CSTR`): the text as it is.
    Str,
    /// `uint32_t` (`NCCL_PARAM_TYPE_U32`) parsed as a bit set of these names
    /// (parser_bitset.h).
    Bits(&'static [(&'static str, u32)]),
}

/// A value of a parameter.
#[derive(Clone, PartialEq, Eq)]
enum Value {
    Bool(bool),
    Str(Option<String>),
    U32(u32),
}

/// One registered parameter (`ncclParamRegistry::mapEntry`): its handle is its address.
pub(crate) struct Entry {
    key: &'static CStr,
    kind: Kind,
    flags: u64,
    default: fn() -> Value,
    /// The value of a cached parameter, once loaded.
    cache: OnceLock<Value>,
}

/// `NCCL_DEBUG_TIMESTAMP_LEVELS`' options: `1 << NCCL_LOG_*` (debug.cc:85-97).
const LEVELS: &[(&str, u32)] = &[
    ("VERSION", 1 << 1),
    ("WARN", 1 << 2),
    ("INFO", 1 << 3),
    ("ABORT", 1 << 4),
    ("TRACE", 1 << 5),
    ("ALL", (1 << 1) | (1 << 2) | (1 << 3) | (1 << 4) | (1 << 5)),
];

macro_rules! entry {
    ($key:literal, $kind:expr, $flags:expr, $default:expr) => {
        Entry {
            key: $key,
            kind: $kind,
            flags: $flags,
            default: || $default,
            cache: OnceLock::new(),
        }
    };
}

/// The registry, in registration order.
static REGISTRY: [Entry; 7] = [
    entry!(c"NCCL_PARAM_DUMP_ALL", Kind::Bool, 0, Value::Bool(false)),
    entry!(c"NCCL_NO_CACHE", Kind::Str, CACHED, Value::Str(None)),
    entry!(
        c"NCCL_WARN_ENABLE_DEBUG_INFO",
        Kind::Bool,
        0,
        Value::Bool(false)
    ),
    entry!(
        c"NCCL_DEBUG_TIMESTAMP_LEVELS",
        Kind::Bits(LEVELS),
        PUBLISHED,
        Value::U32(1 << 2)
    ),
    entry!(
        c"NCCL_DEBUG_TIMESTAMP_FORMAT",
        Kind::Str,
        PUBLISHED,
        Value::Str(Some("[%F %T] ".into()))
    ),
    entry!(c"NCCL_DEBUG_FILE", Kind::Str, PUBLISHED, Value::Str(None)),
    entry!(
        c"NCCL_SET_THREAD_NAME",
        Kind::Bool,
        PUBLISHED | CACHED,
        Value::Bool(false)
    ),
];

fn find(key: &CStr) -> Option<&'static Entry> {
    REGISTRY.iter().find(|e| e.key == key)
}

/// The entry a handle names; `None` for anything `ncclParamBind` never handed out (NCCL
/// would dereference it).
fn unwrap(h: ncclParamHandle_t) -> Option<&'static Entry> {
    REGISTRY
        .iter()
        .find(|e| core::ptr::eq(*e as *const Entry, h as *const Entry))
}

fn iequals(a: &str, b: &str) -> bool {
    a.eq_ignore_ascii_case(b)
}

impl Entry {
    /// `parser.resolve` (parser_default.h, parser_bitset.h).
    fn parse(&self, text: &str) -> Option<Value> {
        match self.kind {
            Kind::Str => Some(Value::Str(Some(text.to_string()))),
            Kind::Bool => match text {
                "1" => Some(Value::Bool(true)),
                "0" => Some(Value::Bool(false)),
                t if iequals(t, "T") || iequals(t, "TRUE") => Some(Value::Bool(true)),
                t if iequals(t, "F") || iequals(t, "FALSE") => Some(Value::Bool(false)),
                _ => None,
            },
            Kind::Bits(options) => {
                let (invert, rest) = match text.strip_prefix('^') {
                    Some(rest) => (true, rest),
                    None => (false, text),
                };
                let mut v: u32 = if invert { !0 } else { 0 };
                for token in rest.split(',').map(str::trim).filter(|t| !t.is_empty()) {
                    let &(_, mask) = options.iter().find(|(n, _)| iequals(n, token))?;
                    if invert {
                        v &= !mask;
                    } else {
                        v |= mask;
                    }
                }
                Some(Value::U32(v))
            }
        }
    }

    /// `loadValue`: the variable's parsed value, else the default.
    fn load(&self) -> Value {
        let key = self.key.to_str().unwrap_or_default();
        nccl_sys::param_str(key)
            .and_then(|t| self.parse(&t))
            .unwrap_or_else(self.default)
    }

    /// `ensureLoaded`: a cached parameter keeps its first value unless `NCCL_NO_CACHE`
    /// names it (`ncclParamIsCacheDisabled`, param.cc:22-40; `NCCL_NO_CACHE` itself is
    /// always cached).
    fn value(&self) -> Value {
        if self.flags & CACHED != 0 && !cache_disabled(self.key) {
            return self.cache.get_or_init(|| self.load()).clone();
        }
        self.load()
    }

    /// `parser.toString`.
    fn text(&self) -> String {
        match (self.value(), self.kind) {
            (Value::Bool(b), _) => if b { "TRUE" } else { "FALSE" }.into(),
            (Value::Str(s), _) => s.unwrap_or_default(),
            (Value::U32(v), Kind::Bits(options)) => bits_text(options, v),
            (Value::U32(v), _) => v.to_string(),
        }
    }

    /// `getRawData`'s bytes: the value's, a string's with its NUL (param.h:93-103, 206-218).
    fn raw(&self) -> Vec<u8> {
        match self.value() {
            Value::Bool(b) => vec![u8::from(b)],
            Value::U32(v) => v.to_ne_bytes().to_vec(),
            Value::Str(s) => {
                let mut b = s.unwrap_or_default().into_bytes();
                b.push(0);
                b
            }
        }
    }

    fn type_name(&self) -> &'static str {
        match self.kind {
            Kind::Bool => "bool",
            Kind::Str => "const char*",
            Kind::Bits(_) => "uint32_t",
        }
    }
}

/// `bitsetToString` (parser_bitset.h): an option of exactly that value, else the
/// single-bit options it holds joined by commas, else `NONE`.
fn bits_text(options: &[(&str, u32)], value: u32) -> String {
    if let Some((n, _)) = options.iter().find(|(_, v)| *v == value) {
        return (*n).to_string();
    }
    let mut names = Vec::new();
    let mut remaining = value;
    for &(n, v) in options {
        if v.is_power_of_two() && remaining & v == v {
            names.push(n);
            remaining &= !v;
        }
    }
    if names.is_empty() {
        "NONE".into()
    } else {
        names.join(",")
    }
}

fn cache_disabled(key: &CStr) -> bool {
    if key == c"NCCL_NO_CACHE" {
        return false;
    }
    let Some(Value::Str(Some(list))) = find(c"NCCL_NO_CACHE").map(Entry::value) else {
        return false;
    };
    list.split(',')
        .any(|k| k == "ALL" || k.as_bytes() == key.to_bytes())
}

/// Runs an entry point body: its failure's code (NCCL logs these at INFO level, so
/// `ncclGetLastError` is left as it is), a panic `ncclInternalError`.
fn ffi(f: impl FnOnce() -> Result<ncclResult_t, Fail>) -> ncclResult_t {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(Ok(code)) => code,
        Ok(Err(fail)) => fail.code,
        Err(_) => nccl_sys::bindings::ncclInternalError,
    }
}

fn invalid(m: impl std::fmt::Display) -> Fail {
    Fail::new(ncclInvalidArgument, m)
}

std::thread_local! {
    /// The text `ncclParamGetStr` and `ncclParamGetParameter` hand out (each its own
    /// buffer, valid until the same call on the same thread), and the key table of
    /// `ncclParamGetAllParameterKeys`.
    static STR: RefCell<CString> = RefCell::new(CString::default());
    static PARAMETER: RefCell<CString> = RefCell::new(CString::default());
    static KEYS: RefCell<(Vec<CString>, Vec<*const c_char>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `ncclParamBind` (c_api.cc:55-66): NULL out or key, or a key not in the registry, is
/// ncclInvalidArgument with nothing written.
pub(crate) unsafe extern "C" fn ncclParamBind(
    out: *mut ncclParamHandle_t,
    key: *const c_char,
) -> ncclResult_t {
    ffi(|| {
        if out.is_null() || key.is_null() {
            return Err(invalid("ncclParamBind: out or key is NULL"));
        }
        // SAFETY: NCCL's contract: a non-NULL key is a C string.
        let key = unsafe { CStr::from_ptr(key) };
        let e = find(key)
            .ok_or_else(|| invalid(format!("PARAM: key {key:?} not found in registry")))?;
        // SAFETY: checked non-NULL; the caller's out-pointer.
        unsafe { out.write((e as *const Entry).cast_mut().cast()) };
        Ok(ncclSuccess)
    })
}

/// The typed getters (c_api.cc:72-94): NULL handle or out, or a parameter of another
/// type, is ncclInvalidArgument with nothing written.
fn typed<T: Copy>(h: ncclParamHandle_t, out: *mut T, want: &'static str) -> ncclResult_t {
    ffi(|| {
        let e = unwrap(h).ok_or_else(|| invalid("ncclParamGet: not a parameter handle"))?;
        if out.is_null() {
            return Err(invalid("ncclParamGet: out is NULL"));
        }
        if e.type_name() != want {
            return Err(invalid(format!("PARAM: type mismatch for key {:?}", e.key)));
        }
        let raw = e.raw();
        if raw.len() != size_of::<T>() {
            return Err(invalid("PARAM: size mismatch"));
        }
        // SAFETY: `out` is non-NULL and, by NCCL's contract, a `T`; `raw` has its size.
        unsafe { core::ptr::copy_nonoverlapping(raw.as_ptr(), out.cast::<u8>(), raw.len()) };
        Ok(ncclSuccess)
    })
}

macro_rules! typed_getters {
    ($($name:ident($t:ty, $c:literal);)*) => {
        $(
            #[doc = concat!("`", stringify!($name), "` (c_api.cc:72-94).")]
            pub(crate) unsafe extern "C" fn $name(h: ncclParamHandle_t, out: *mut $t) -> ncclResult_t {
                typed(h, out, $c)
            }
        )*
    };
}

typed_getters! {
    ncclParamGetI8(i8, "int8_t");
    ncclParamGetI16(i16, "int16_t");
    ncclParamGetI32(i32, "int32_t");
    ncclParamGetI64(i64, "int64_t");
    ncclParamGetU8(u8, "uint8_t");
    ncclParamGetU16(u16, "uint16_t");
    ncclParamGetU32(u32, "uint32_t");
    ncclParamGetU64(u64, "uint64_t");
}

/// `ncclParamGetStr` (c_api.cc:100-113): a string parameter's text in a buffer of this
/// thread's, valid until its next `ncclParamGetStr`.
pub(crate) unsafe extern "C" fn ncclParamGetStr(
    h: ncclParamHandle_t,
    out: *mut *const c_char,
) -> ncclResult_t {
    ffi(|| {
        let e = unwrap(h).ok_or_else(|| invalid("ncclParamGetStr: not a parameter handle"))?;
        if out.is_null() {
            return Err(invalid("ncclParamGetStr: out is NULL"));
        }
        if e.kind != Kind::Str {
            return Err(invalid(format!("PARAM: type mismatch for key {:?}", e.key)));
        }
        let text = CString::new(e.text()).unwrap_or_default();
        STR.with(|s| {
            let mut s = s.borrow_mut();
            *s = text;
            // SAFETY: checked non-NULL; the caller's out-pointer.
            unsafe { out.write(s.as_ptr()) };
        });
        Ok(ncclSuccess)
    })
}

/// `ncclParamGet` (c_api.cc:115-119, param.h:93-103, 206-218): the value's bytes (a
/// string's with its NUL) into `out`, their count into `len`; a buffer too small is
/// ncclInvalidArgument with `*len = 0`.
pub(crate) unsafe extern "C" fn ncclParamGet(
    h: ncclParamHandle_t,
    out: *mut c_void,
    max_len: c_int,
    len: *mut c_int,
) -> ncclResult_t {
    ffi(|| {
        let e = unwrap(h).ok_or_else(|| invalid("ncclParamGet: not a parameter handle"))?;
        if out.is_null() || len.is_null() || max_len <= 0 {
            return Err(invalid("ncclParamGet: out or len is NULL, or maxLen <= 0"));
        }
        let raw = e.raw();
        if raw.len() > max_len as usize {
            // SAFETY: checked non-NULL; the caller's out-pointer.
            unsafe { len.write(0) };
            return Err(invalid(format!(
                "ncclParamGet: {:?} needs {} bytes, maxLen is {max_len}",
                e.key,
                raw.len()
            )));
        }
        // SAFETY: `out` holds `max_len >= raw.len()` bytes (NCCL's contract); `len` non-NULL.
        unsafe {
            core::ptr::copy_nonoverlapping(raw.as_ptr(), out.cast::<u8>(), raw.len());
            len.write(raw.len() as c_int);
        }
        Ok(ncclSuccess)
    })
}

/// `ncclParamGetParameter` (c_api.cc:156-177): the text of the parameter `key`, in a
/// buffer of this thread's; an unknown key writes NULL and 0 and is ncclInvalidArgument.
pub(crate) unsafe extern "C" fn ncclParamGetParameter(
    key: *const c_char,
    value: *mut *const c_char,
    value_len: *mut c_int,
) -> ncclResult_t {
    ffi(|| {
        if key.is_null() || value.is_null() || value_len.is_null() {
            return Err(invalid(
                "ncclParamGetParameter: key, value or valueLen is NULL",
            ));
        }
        // SAFETY: NCCL's contract: a non-NULL key is a C string.
        let key = unsafe { CStr::from_ptr(key) };
        let Some(e) = find(key) else {
            // SAFETY: checked non-NULL; the caller's out-pointers.
            unsafe {
                value.write(core::ptr::null());
                value_len.write(0);
            }
            return Err(invalid(format!("PARAM: key {key:?} not found in registry")));
        };
        let text = CString::new(e.text()).unwrap_or_default();
        PARAMETER.with(|p| {
            let mut p = p.borrow_mut();
            *p = text;
            // SAFETY: checked non-NULL; the caller's out-pointers.
            unsafe {
                value.write(p.as_ptr());
                value_len.write(p.as_bytes().len() as c_int);
            }
        });
        Ok(ncclSuccess)
    })
}

/// Whether `NCCL_PARAM_DUMP_ALL` asks for the unpublished parameters too.
fn show_all() -> bool {
    find(c"NCCL_PARAM_DUMP_ALL").map(Entry::value) == Some(Value::Bool(true))
}

/// `ncclParamGetAllParameterKeys` (c_api.cc:124-154): the published keys (every key under
/// `NCCL_PARAM_DUMP_ALL=1`), in a table of this thread's valid until its next call.
pub(crate) unsafe extern "C" fn ncclParamGetAllParameterKeys(
    table: *mut *mut *const c_char,
    table_len: *mut c_int,
) -> ncclResult_t {
    ffi(|| {
        if table.is_null() || table_len.is_null() {
            return Err(invalid(
                "ncclParamGetAllParameterKeys: table or tableLen is NULL",
            ));
        }
        let all = show_all();
        KEYS.with(|k| {
            let mut k = k.borrow_mut();
            let (keys, ptrs) = &mut *k;
            *keys = REGISTRY
                .iter()
                .filter(|e| all || e.flags & PUBLISHED != 0)
                .map(|e| e.key.to_owned())
                .collect();
            *ptrs = keys.iter().map(|s| s.as_ptr()).collect();
            // SAFETY: checked non-NULL; the caller's out-pointers.
            unsafe {
                table.write(ptrs.as_mut_ptr());
                table_len.write(ptrs.len() as c_int);
            }
        });
        Ok(ncclSuccess)
    })
}

/// `ncclParamDumpAll` (c_api.cc:179-188): every published parameter (all of them under
/// `NCCL_PARAM_DUMP_ALL=1`) to standard output.
pub(crate) unsafe extern "C" fn ncclParamDumpAll() {
    let _ = std::panic::catch_unwind(|| {
        let all = show_all();
        let mut text = String::from("=== ncclParam Registry Dump ===\n");
        for e in REGISTRY.iter().filter(|e| all || e.flags & PUBLISHED != 0) {
            let current = e.text();
            let current = if current.is_empty() {
                "<unset>".into()
            } else {
                current
            };
            text += &format!(
                "{} ({})\n    Current value={current}\n",
                e.key.to_string_lossy(),
                e.type_name()
            );
        }
        use std::io::Write;
        let _ = std::io::stdout().lock().write_all(text.as_bytes());
    });
}
