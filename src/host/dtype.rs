//! Element types and reduction arithmetic of the host provider.
//!
//! Every reduction folds the ranks' inputs element by element in rank order 0, 1, 2, ...
//! rounding each step to the element type: integers wrap, `f32`/`f64` use their own
//! arithmetic, `f16`/`bf16`/fp8 compute each step in `f32` and round back.

use half::{bf16, f16};
use nccl_sys::bindings::*;

/// Bytes per element of `dt`; `None` for an unknown data type.
pub(crate) fn size_of(dt: ncclDataType_t) -> Option<usize> {
    Some(match dt {
        ncclInt8 | ncclUint8 | ncclFloat8e4m3 | ncclFloat8e5m2 => 1,
        ncclFloat16 | ncclBfloat16 => 2,
        ncclInt32 | ncclUint32 | ncclFloat32 => 4,
        ncclInt64 | ncclUint64 | ncclFloat64 => 8,
        _ => return None,
    })
}

/// Decodes an fp8 value (`e5m2 == false`: E4M3 "fn", no infinities; `true`: E5M2, IEEE-like).
pub(crate) fn fp8_to_f32(bits: u8, e5m2: bool) -> f32 {
    let neg = bits & 0x80 != 0;
    let (exp_bits, man_bits, bias) = if e5m2 { (5u32, 2u32, 15i32) } else { (4, 3, 7) };
    let e = ((bits as u32 & 0x7f) >> man_bits) as i32;
    let m = (bits as u32) & ((1 << man_bits) - 1);
    let emax = (1i32 << exp_bits) - 1;
    let mag = if e5m2 && e == emax {
        if m == 0 {
            f32::INFINITY
        } else {
            f32::NAN
        }
    } else if !e5m2 && e == emax && m == (1 << man_bits) - 1 {
        f32::NAN
    } else if e == 0 {
        m as f32 * 2f32.powi(1 - bias - man_bits as i32)
    } else {
        (1.0 + m as f32 / (1u32 << man_bits) as f32) * 2f32.powi(e - bias)
    };
    if neg {
        -mag
    } else {
        mag
    }
}

/// Encodes `x` as fp8, rounding to nearest (ties to even) and saturating to the largest
/// finite value (CUDA's `__NV_SATFINITE`); NaN stays NaN.
pub(crate) fn f32_to_fp8(x: f32, e5m2: bool) -> u8 {
    let (man_bits, bias, max) = if e5m2 {
        (2i32, 15i32, 57344.0f64)
    } else {
        (3, 7, 448.0)
    };
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    if x.is_nan() {
        return if e5m2 { 0x7f } else { 0x7f | sign };
    }
    let a = (x as f64).abs();
    if a == 0.0 {
        return sign;
    }
    // Exponent of the leading bit (a is a normal f64 because it came from an f32).
    let e = ((a.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    let e = Ord::max(e, 1 - bias);
    let quantum = 2f64.powi(e - man_bits);
    let q = ((a / quantum).round_ties_even() * quantum).min(max);
    if q == 0.0 {
        return sign;
    }
    let qe = ((q.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    let bits = if qe < 1 - bias {
        (q / 2f64.powi(1 - bias - man_bits)) as u32
    } else {
        let mant = (q / 2f64.powi(qe - man_bits)) as u32 - (1 << man_bits);
        (((qe + bias) as u32) << man_bits) | mant
    };
    sign | bits as u8
}

/// A reduction, resolved (a PreMulSum carries its per-rank scalar separately).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RedKind {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
    PreMulSum,
}

trait Elem: Copy {
    const SIZE: usize;
    fn load(b: &[u8]) -> Self;
    fn store(self, b: &mut [u8]);
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    /// `o` when `o > self`, else `self` (the accumulator wins ties and NaN comparisons).
    fn max(self, o: Self) -> Self;
    /// `o` when `o < self`, else `self`.
    fn min(self, o: Self) -> Self;
    fn div_n(self, n: usize) -> Self;
}

macro_rules! int_elem {
    ($($t:ty => $w:ty),*) => {$(
        impl Elem for $t {
            const SIZE: usize = core::mem::size_of::<$t>();
            fn load(b: &[u8]) -> Self {
                let mut a = [0u8; core::mem::size_of::<$t>()];
                a.copy_from_slice(b);
                <$t>::from_ne_bytes(a)
            }
            fn store(self, b: &mut [u8]) { b.copy_from_slice(&self.to_ne_bytes()) }
            fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
            fn max(self, o: Self) -> Self { if o > self { o } else { self } }
            fn min(self, o: Self) -> Self { if o < self { o } else { self } }
            fn div_n(self, n: usize) -> Self { ((self as $w) / (n as $w)) as $t }
        }
    )*};
}
int_elem!(i8 => i64, u8 => u64, i32 => i64, u32 => u64, i64 => i64, u64 => u64);

macro_rules! float_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            const SIZE: usize = core::mem::size_of::<$t>();
            fn load(b: &[u8]) -> Self {
                let mut a = [0u8; core::mem::size_of::<$t>()];
                a.copy_from_slice(b);
                <$t>::from_ne_bytes(a)
            }
            fn store(self, b: &mut [u8]) { b.copy_from_slice(&self.to_ne_bytes()) }
            fn add(self, o: Self) -> Self { self + o }
            fn mul(self, o: Self) -> Self { self * o }
            fn max(self, o: Self) -> Self { if o > self { o } else { self } }
            fn min(self, o: Self) -> Self { if o < self { o } else { self } }
            fn div_n(self, n: usize) -> Self { self / (n as $t) }
        }
    )*};
}
float_elem!(f32, f64);

/// A type whose arithmetic goes through `f32`, rounding back after every step.
trait ViaF32: Copy {
    fn to32(self) -> f32;
    fn from32(x: f32) -> Self;
    fn bits(self) -> u16;
    fn from_bits(b: u16) -> Self;
    const SIZE: usize;
}

impl ViaF32 for f16 {
    fn to32(self) -> f32 {
        self.to_f32()
    }
    fn from32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn from_bits(b: u16) -> Self {
        f16::from_bits(b)
    }
    const SIZE: usize = 2;
}

impl ViaF32 for bf16 {
    fn to32(self) -> f32 {
        self.to_f32()
    }
    fn from32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn from_bits(b: u16) -> Self {
        bf16::from_bits(b)
    }
    const SIZE: usize = 2;
}

#[derive(Clone, Copy)]
struct E4M3(u8);
#[derive(Clone, Copy)]
struct E5M2(u8);

impl ViaF32 for E4M3 {
    fn to32(self) -> f32 {
        fp8_to_f32(self.0, false)
    }
    fn from32(x: f32) -> Self {
        E4M3(f32_to_fp8(x, false))
    }
    fn bits(self) -> u16 {
        self.0 as u16
    }
    fn from_bits(b: u16) -> Self {
        E4M3(b as u8)
    }
    const SIZE: usize = 1;
}

impl ViaF32 for E5M2 {
    fn to32(self) -> f32 {
        fp8_to_f32(self.0, true)
    }
    fn from32(x: f32) -> Self {
        E5M2(f32_to_fp8(x, true))
    }
    fn bits(self) -> u16 {
        self.0 as u16
    }
    fn from_bits(b: u16) -> Self {
        E5M2(b as u8)
    }
    const SIZE: usize = 1;
}

impl<T: ViaF32> Elem for T {
    const SIZE: usize = <T as ViaF32>::SIZE;
    fn load(b: &[u8]) -> Self {
        if b.len() == 1 {
            T::from_bits(b[0] as u16)
        } else {
            T::from_bits(u16::from_ne_bytes([b[0], b[1]]))
        }
    }
    fn store(self, b: &mut [u8]) {
        if b.len() == 1 {
            b[0] = self.bits() as u8;
        } else {
            b.copy_from_slice(&self.bits().to_ne_bytes());
        }
    }
    fn add(self, o: Self) -> Self {
        T::from32(self.to32() + o.to32())
    }
    fn mul(self, o: Self) -> Self {
        T::from32(self.to32() * o.to32())
    }
    fn max(self, o: Self) -> Self {
        if o.to32() > self.to32() {
            o
        } else {
            self
        }
    }
    fn min(self, o: Self) -> Self {
        if o.to32() < self.to32() {
            o
        } else {
            self
        }
    }
    fn div_n(self, n: usize) -> Self {
        T::from32(self.to32() / n as f32)
    }
}

fn reduce_t<T: Elem>(kind: RedKind, inputs: &[Vec<u8>], scalars: &[Vec<u8>], out: &mut [u8]) {
    let s = T::SIZE;
    let nranks = inputs.len();
    let term = |r: usize, i: usize| -> T {
        let x = T::load(&inputs[r][i * s..(i + 1) * s]);
        if kind == RedKind::PreMulSum {
            T::load(&scalars[r][..s]).mul(x)
        } else {
            x
        }
    };
    for i in 0..out.len() / s {
        let mut acc = term(0, i);
        for r in 1..nranks {
            let x = term(r, i);
            acc = match kind {
                RedKind::Sum | RedKind::Avg | RedKind::PreMulSum => acc.add(x),
                RedKind::Prod => acc.mul(x),
                RedKind::Max => acc.max(x),
                RedKind::Min => acc.min(x),
            };
        }
        if kind == RedKind::Avg {
            acc = acc.div_n(nranks);
        }
        acc.store(&mut out[i * s..(i + 1) * s]);
    }
}

/// Reduces `inputs` (one byte vector per rank, each at least `out.len()` long) into `out`.
/// `scalars[r]` is rank r's PreMulSum scalar (ignored for other kinds).
pub(crate) fn reduce(
    dt: ncclDataType_t,
    kind: RedKind,
    inputs: &[Vec<u8>],
    scalars: &[Vec<u8>],
    out: &mut [u8],
) {
    if inputs.is_empty() {
        return;
    }
    match dt {
        ncclInt8 => reduce_t::<i8>(kind, inputs, scalars, out),
        ncclUint8 => reduce_t::<u8>(kind, inputs, scalars, out),
        ncclInt32 => reduce_t::<i32>(kind, inputs, scalars, out),
        ncclUint32 => reduce_t::<u32>(kind, inputs, scalars, out),
        ncclInt64 => reduce_t::<i64>(kind, inputs, scalars, out),
        ncclUint64 => reduce_t::<u64>(kind, inputs, scalars, out),
        ncclFloat16 => reduce_t::<f16>(kind, inputs, scalars, out),
        ncclFloat32 => reduce_t::<f32>(kind, inputs, scalars, out),
        ncclFloat64 => reduce_t::<f64>(kind, inputs, scalars, out),
        ncclBfloat16 => reduce_t::<bf16>(kind, inputs, scalars, out),
        ncclFloat8e4m3 => reduce_t::<E4M3>(kind, inputs, scalars, out),
        ncclFloat8e5m2 => reduce_t::<E5M2>(kind, inputs, scalars, out),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_round_trips_every_finite_value() {
        for e5m2 in [false, true] {
            for b in 0..=255u8 {
                let x = fp8_to_f32(b, e5m2);
                if x.is_finite() {
                    let back = f32_to_fp8(x, e5m2);
                    // -0 and +0 are distinct encodings and both round-trip.
                    assert_eq!(back, b, "e5m2={e5m2} bits={b:#x} value={x}");
                }
            }
        }
        assert_eq!(fp8_to_f32(f32_to_fp8(1000.0, false), false), 448.0);
        assert_eq!(fp8_to_f32(f32_to_fp8(1.0625, false), false), 1.0); // tie to even
        assert_eq!(fp8_to_f32(f32_to_fp8(1.1875, false), false), 1.25); // tie to even
    }
}
