//! NCCL's parameters (`NCCL_*`) as NCCL 2.28.9 reads them, for the code that must know
//! what NCCL will do: the process environment, else the first of `$NCCL_CONF_FILE` (or
//! `~/.nccl.conf`) and `/etc/nccl.conf` that sets the parameter (`initEnvFunc` copies their
//! lines into the environment without overwriting, misc/param.cc:27-69), parsed with
//! `strtoll(value, NULL, 0)` (misc/param.cc:76-95). An environment plugin
//! (`NCCL_ENV_PLUGIN`) is not followed.

/// NCCL's value of parameter `name` (say `"NCCL_COMM_BLOCKING"`), as `ncclLoadParam`
/// reads it: `None` when it is unset or empty (NCCL's default), or out of `i64`'s range
/// (NCCL then keeps its default too). A config override that takes an `int` takes the low
/// 32 bits (`as i32`).
pub fn param(name: &str) -> Option<i64> {
    param_str(name)
        .filter(|v| !v.is_empty())
        .and_then(|v| strtoll(&v))
}

/// NCCL's text of parameter `name` (say `"NCCL_COMM_ID"`), as `ncclGetEnv` gives it:
/// `None` when it is unset (an empty value is `Some("")`, which NCCL's integer parameters
/// take as unset, misc/param.cc:82).
pub fn param_str(name: &str) -> Option<String> {
    match std::env::var_os(name) {
        Some(v) => Some(v.to_string_lossy().into_owned()),
        None => conf_files().iter().find_map(|f| conf_value(f, name)),
    }
}

/// NCCL's configuration files, in the order it reads them.
fn conf_files() -> Vec<std::path::PathBuf> {
    let mut files = Vec::with_capacity(2);
    match std::env::var_os("NCCL_CONF_FILE").filter(|f| !f.is_empty()) {
        Some(f) => files.push(f.into()),
        None => files.extend(home_dir().map(|h| h.join(".nccl.conf"))),
    }
    files.push("/etc/nccl.conf".into());
    files
}

/// The first value a configuration file gives `name`: lines `NAME=VALUE`, `#` comments
/// (misc/param.cc:36-48).
fn conf_value(file: &std::path::Path, name: &str) -> Option<String> {
    let text = std::fs::read(file).ok()?;
    String::from_utf8_lossy(&text).lines().find_map(|line| {
        let (var, value) = line.split_once('=').filter(|_| !line.starts_with('#'))?;
        (var == name).then(|| value.to_string())
    })
}

/// The user's home directory as NCCL finds it: the password database, not `$HOME`
/// (`userHomeDir`, misc/param.cc:22-25).
fn home_dir() -> Option<std::path::PathBuf> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: `getpwuid_r` writes `pw` and its strings into `buf`, whose length it is
    // given; `out` is null or `&pw` afterwards, and `pw_dir` a C string in `buf`.
    unsafe {
        let mut pw: libc::passwd = std::mem::zeroed();
        let mut buf = vec![0 as libc::c_char; 4096];
        let mut out = std::ptr::null_mut();
        let r = libc::getpwuid_r(
            libc::getuid(),
            &mut pw,
            buf.as_mut_ptr(),
            buf.len(),
            &mut out,
        );
        if r != 0 || out.is_null() || pw.pw_dir.is_null() {
            return None;
        }
        let dir = std::ffi::CStr::from_ptr(pw.pw_dir).to_bytes();
        Some(std::ffi::OsStr::from_bytes(dir).into())
    }
}

/// C's `strtoll(s, NULL, 0)` as NCCL checks it: leading white space, a sign, then `0x` for
/// hex or `0` for octal, and the digits up to the first that is not one; no digits read 0.
/// `None` where `strtoll` sets `errno` (an overflow), so that NCCL keeps its default.
fn strtoll(s: &str) -> Option<i64> {
    let s = s.trim_start_matches([' ', '\t', '\n', '\r', '\x0b', '\x0c']);
    let (negative, s) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let hex = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X"));
    let (radix, digits) = match hex {
        Some(h) if h.starts_with(|c: char| c.is_ascii_hexdigit()) => (16, h),
        _ if s.starts_with('0') => (8, s),
        _ => (10, s),
    };
    let end = digits
        .find(|c: char| !c.is_digit(radix))
        .unwrap_or(digits.len());
    if end == 0 {
        return Some(0);
    }
    // Accumulated negatively, as i64::MIN has no positive counterpart.
    let mut v: i64 = 0;
    for c in digits[..end].chars() {
        let d = i64::from(c.to_digit(radix).expect("a digit of the radix"));
        v = v.checked_mul(i64::from(radix))?.checked_sub(d)?;
    }
    if negative {
        Some(v)
    } else {
        v.checked_neg()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_parse_as_strtoll_parses_them() {
        for (s, want) in [
            ("1", Some(1)),
            (" \t1", Some(1)),
            ("1 # note", Some(1)),
            ("1abc", Some(1)),
            ("0x1", Some(1)),
            ("0X1f", Some(31)),
            ("010", Some(8)),
            ("09", Some(0)),
            ("-1", Some(-1)),
            ("+7", Some(7)),
            ("abc", Some(0)),
            ("", Some(0)),
            ("0x", Some(0)),
            ("9223372036854775807", Some(i64::MAX)),
            ("-9223372036854775808", Some(i64::MIN)),
            ("9223372036854775808", None),
            ("4294967297", Some(4_294_967_297)),
        ] {
            assert_eq!(strtoll(s), want, "{s:?}");
        }
        // And NCCL's int takes the low 32 bits.
        assert_eq!(strtoll("4294967297").map(|v| v as i32), Some(1));
    }

    #[test]
    fn a_configuration_file_gives_the_first_value_of_a_line_not_commented_out() {
        let dir = std::env::temp_dir().join(format!("nccl-safe-params-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("nccl.conf");
        let text = "#NCCL_COMM_BLOCKING=0\nNCCL_DEBUG=WARN\nNCCL_COMM_BLOCKING=0x1\nNCCL_COMM_BLOCKING=0\nNOEQUALS\n";
        std::fs::write(&file, text).unwrap();
        assert_eq!(
            conf_value(&file, "NCCL_COMM_BLOCKING").as_deref(),
            Some("0x1")
        );
        assert_eq!(conf_value(&file, "NCCL_DEBUG").as_deref(), Some("WARN"));
        assert_eq!(conf_value(&file, "NOEQUALS"), None);
        assert_eq!(conf_value(&dir.join("absent"), "NCCL_DEBUG"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
