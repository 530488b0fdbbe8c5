//! NCCL release numbers.

use std::fmt;

/// An NCCL release, decoded from `ncclGetVersion`'s integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    /// Major release (2).
    pub major: u32,
    /// Minor release (18 ... 32).
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl Version {
    /// The oldest NCCL this crate loads.
    pub const MIN_SUPPORTED: Version = Version::new(
        nccl_sys::MIN_SUPPORTED_VERSION.0,
        nccl_sys::MIN_SUPPORTED_VERSION.1,
        0,
    );

    /// A version from its parts.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Version {
        Version {
            major,
            minor,
            patch,
        }
    }

    /// Decodes `ncclGetVersion`'s integer: `X*10000 + Y*100 + Z` since 2.9, `X*1000 + Y*100 + Z` before.
    /// `None` for a negative code.
    pub const fn from_code(code: i32) -> Option<Version> {
        if code < 0 {
            return None;
        }
        let code = code as u32;
        Some(if code >= 10000 {
            Version::new(code / 10000, (code % 10000) / 100, code % 100)
        } else {
            Version::new(code / 1000, (code % 1000) / 100, code % 100)
        })
    }

    /// The integer `ncclGetVersion` reports for this version (`NCCL_VERSION(X, Y, Z)`).
    pub const fn code(self) -> i32 {
        nccl_sys::nccl_version_code(self.major as i32, self.minor as i32, self.patch as i32)
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_both_encodings_and_round_trips() {
        assert_eq!(Version::from_code(23203), Some(Version::new(2, 32, 3)));
        assert_eq!(Version::from_code(21803), Some(Version::new(2, 18, 3)));
        assert_eq!(Version::from_code(2804), Some(Version::new(2, 8, 4)));
        assert_eq!(Version::from_code(-1), None);
        for v in [
            Version::new(2, 8, 4),
            Version::new(2, 18, 3),
            Version::new(2, 32, 3),
        ] {
            assert_eq!(Version::from_code(v.code()), Some(v));
        }
        assert!(Version::new(2, 17, 9) < Version::MIN_SUPPORTED);
        assert_eq!(Version::new(2, 32, 3).to_string(), "2.32.3");
    }
}
