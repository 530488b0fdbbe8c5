//! Element types and reduction arithmetic of the host provider (the rounding rules: the
//! crate docs).

use float8::{F8E4M3, F8E5M2};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use nccl_sys::bindings::*;

/// The data types as one table: NCCL's constant, its name in messages, the element type
/// and the kernel that reduces it ([`reduce_t`], or [`reduce_via`] for a type whose every
/// step is computed in `f32` a block at a time). Makes [`size_of`], [`name`], the kernel
/// dispatch and, for the tests, the reference dispatch and `ALL_DTYPES`.
macro_rules! data_types {
    ($($dt:ident: $name:literal, $t:ty, $kernel:ident;)*) => {
        /// Bytes per element of `dt`; `None` for an unknown data type.
        pub(crate) fn size_of(dt: ncclDataType_t) -> Option<usize> {
            match dt {
                $($dt => Some(core::mem::size_of::<<$t as Elem>::Raw>()),)*
                _ => None,
            }
        }

        /// NCCL's name for an element type (`ncclFloat32` -> "float32"), for messages.
        pub(crate) fn name(dt: ncclDataType_t) -> std::borrow::Cow<'static, str> {
            match dt {
                $($dt => $name.into(),)*
                other => format!("unknown type {other}").into(),
            }
        }

        /// Reduces with `dt`'s kernel; an unknown data type leaves `out` untouched.
        fn kernel(dt: ncclDataType_t, kind: RedKind, inputs: &[&[u8]], scalars: &[Vec<u8>], out: &mut [u8]) -> bool {
            match dt {
                $($dt => $kernel::<$t>(kind, inputs, scalars, out),)*
                _ => true,
            }
        }

        /// [`kernel`]'s element-at-a-time form, [`reference_t`].
        #[cfg(test)]
        fn reference_kernel(dt: ncclDataType_t, kind: RedKind, inputs: &[&[u8]], scalars: &[Vec<u8>], out: &mut [u8]) {
            match dt {
                $($dt => reference_t::<$t>(kind, inputs, scalars, out),)*
                _ => {}
            }
        }

        /// Every data type the host provider reduces.
        #[cfg(test)]
        pub(crate) const ALL_DTYPES: &[ncclDataType_t] = &[$($dt),*];
    };
}

data_types! {
    ncclInt8: "int8", i8, reduce_t;
    ncclUint8: "uint8", u8, reduce_t;
    ncclInt32: "int32", i32, reduce_t;
    ncclUint32: "uint32", u32, reduce_t;
    ncclInt64: "int64", i64, reduce_t;
    ncclUint64: "uint64", u64, reduce_t;
    ncclFloat16: "float16", f16, reduce_via;
    ncclFloat32: "float32", f32, reduce_t;
    ncclFloat64: "float64", f64, reduce_t;
    ncclBfloat16: "bfloat16", bf16, reduce_t;
    ncclFloat8e4m3: "float8e4m3", E4M3, reduce_via;
    ncclFloat8e5m2: "float8e5m2", E5M2, reduce_via;
}

/// Decodes an fp8 value (`e5m2 == false`: E4M3 "fn", no infinities; `true`: E5M2, IEEE-like).
/// A NaN keeps its sign (`float8` decodes every NaN to one positive NaN).
pub(crate) fn fp8_to_f32(bits: u8, e5m2: bool) -> f32 {
    let x = if e5m2 {
        F8E5M2::from_bits(bits).to_f32()
    } else {
        F8E4M3::from_bits(bits).to_f32()
    };
    if x.is_nan() {
        f32::NAN.copysign(if bits & 0x80 != 0 { -1.0 } else { 1.0 })
    } else {
        x
    }
}

/// Encodes `x` as fp8, rounding to nearest (ties to even) and saturating to the largest
/// finite value (CUDA's `__NV_SATFINITE`, as `float8` does); NaN stays NaN: E4M3 keeps its
/// sign, E5M2 is always 0x7f (`float8` would keep the sign and payload bits).
pub(crate) fn f32_to_fp8(x: f32, e5m2: bool) -> u8 {
    match e5m2 {
        true if x.is_nan() => 0x7f,
        true => F8E5M2::from_f32(x).to_bits(),
        false => F8E4M3::from_f32(x).to_bits(),
    }
}

/// A reduction's name for messages, from the code a shared-memory slot stores for it
/// (`RedKind as u64`).
pub(crate) fn red_name(code: u64) -> &'static str {
    RedKind::ALL
        .iter()
        .find(|r| **r as u64 == code)
        .map_or("unknown", |r| r.name())
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

impl RedKind {
    pub(crate) const ALL: [RedKind; 6] = [
        RedKind::Sum,
        RedKind::Prod,
        RedKind::Max,
        RedKind::Min,
        RedKind::Avg,
        RedKind::PreMulSum,
    ];

    /// NCCL's built-in reduction `op`, if it is one.
    pub(crate) fn of(op: ncclRedOp_t) -> Option<RedKind> {
        Some(match op {
            ncclSum => RedKind::Sum,
            ncclProd => RedKind::Prod,
            ncclMax => RedKind::Max,
            ncclMin => RedKind::Min,
            ncclAvg => RedKind::Avg,
            _ => return None,
        })
    }

    /// Its name in messages.
    pub(crate) fn name(self) -> &'static str {
        match self {
            RedKind::Sum => "sum",
            RedKind::Prod => "prod",
            RedKind::Max => "max",
            RedKind::Min => "min",
            RedKind::Avg => "avg",
            RedKind::PreMulSum => "premulsum",
        }
    }
}

/// An element type: its native-endian bytes (read and written without any alignment
/// requirement, so posted buffers need not be aligned) and its arithmetic.
trait Elem: Copy {
    /// The element's bytes, `[u8; size]`.
    type Raw: Copy + Default;
    /// `b` as whole elements (a trailing partial element is left out).
    fn raws(b: &[u8]) -> &[Self::Raw];
    fn raws_mut(b: &mut [u8]) -> &mut [Self::Raw];
    fn from_raw(r: Self::Raw) -> Self;
    fn to_raw(self) -> Self::Raw;
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    /// `o` when `o > self`, else `self` (the accumulator wins ties and NaN comparisons).
    fn max(self, o: Self) -> Self;
    /// `o` when `o < self`, else `self`.
    fn min(self, o: Self) -> Self;
    fn div_n(self, n: usize) -> Self;
}

/// The byte view shared by every element type.
macro_rules! raw_view {
    ($n:expr) => {
        type Raw = [u8; $n];
        #[inline(always)]
        fn raws(b: &[u8]) -> &[Self::Raw] {
            b.as_chunks().0
        }
        #[inline(always)]
        fn raws_mut(b: &mut [u8]) -> &mut [Self::Raw] {
            b.as_chunks_mut().0
        }
    };
}

/// What every native number type's [`Elem`] shares: its bytes in native order, and
/// `max`/`min` by its own comparison.
macro_rules! native_elem {
    ($t:ty) => {
        raw_view!(core::mem::size_of::<$t>());
        #[inline(always)]
        fn from_raw(r: Self::Raw) -> Self {
            <$t>::from_ne_bytes(r)
        }
        #[inline(always)]
        fn to_raw(self) -> Self::Raw {
            self.to_ne_bytes()
        }
        #[inline(always)]
        fn max(self, o: Self) -> Self {
            if o > self {
                o
            } else {
                self
            }
        }
        #[inline(always)]
        fn min(self, o: Self) -> Self {
            if o < self {
                o
            } else {
                self
            }
        }
    };
}

macro_rules! int_elem {
    ($($t:ty => $w:ty),*) => {$(
        impl Elem for $t {
            native_elem!($t);
            #[inline(always)]
            fn add(self, o: Self) -> Self { self.wrapping_add(o) }
            #[inline(always)]
            fn mul(self, o: Self) -> Self { self.wrapping_mul(o) }
            #[inline(always)]
            fn div_n(self, n: usize) -> Self { ((self as $w) / (n as $w)) as $t }
        }
    )*};
}
int_elem!(i8 => i64, u8 => u64, i32 => i64, u32 => u64, i64 => i64, u64 => u64);

macro_rules! float_elem {
    ($($t:ty),*) => {$(
        impl Elem for $t {
            native_elem!($t);
            #[inline(always)]
            fn add(self, o: Self) -> Self { self + o }
            #[inline(always)]
            fn mul(self, o: Self) -> Self { self * o }
            #[inline(always)]
            fn div_n(self, n: usize) -> Self { self / (n as $t) }
        }
    )*};
}
float_elem!(f32, f64);

/// Elements per block of the `f32` kernels: the block's values widened to `f32` stay in L1.
const BLOCK: usize = 256;

/// A type whose arithmetic goes through `f32`, rounding back after every step.
trait ViaF32: Elem {
    fn to32(self) -> f32;
    fn from32(x: f32) -> Self;
    /// `dst[i] = to32(src[i])` over the common length (at most [`BLOCK`]).
    #[inline(always)]
    fn widen(src: &[Self::Raw], dst: &mut [f32]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::from_raw(s).to32();
        }
    }
    /// `dst[i] = from32(src[i])` over the common length (at most [`BLOCK`]).
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [Self::Raw]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::from32(s).to_raw();
        }
    }
}

/// [`Elem`] of a [`ViaF32`] type of `$n` bytes, read by `$from` and written by `$to`: each
/// step computed in `f32` and rounded back.
macro_rules! via_f32_elem {
    ($t:ty, $n:expr, |$r:ident| $from:expr, |$x:ident| $to:expr) => {
        impl Elem for $t {
            raw_view!($n);
            #[inline(always)]
            fn from_raw($r: Self::Raw) -> Self {
                $from
            }
            #[inline(always)]
            fn to_raw(self) -> Self::Raw {
                let $x = self;
                $to
            }
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                Self::from32(self.to32() + o.to32())
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                Self::from32(self.to32() * o.to32())
            }
            #[inline(always)]
            fn max(self, o: Self) -> Self {
                if o.to32() > self.to32() {
                    o
                } else {
                    self
                }
            }
            #[inline(always)]
            fn min(self, o: Self) -> Self {
                if o.to32() < self.to32() {
                    o
                } else {
                    self
                }
            }
            #[inline(always)]
            fn div_n(self, n: usize) -> Self {
                Self::from32(self.to32() / n as f32)
            }
        }
    };
}

/// A `half` type: its bits as the raw bytes, `half`'s own conversions to and from f32, and
/// after them any block conversions of its own.
macro_rules! half_via_f32 {
    ($t:ident $($block:tt)*) => {
        via_f32_elem!($t, 2, |r| $t::from_bits(u16::from_ne_bytes(r)), |x| x.to_bits().to_ne_bytes());
        impl ViaF32 for $t {
            #[inline(always)]
            fn to32(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn from32(x: f32) -> Self {
                $t::from_f32(x)
            }
            $($block)*
        }
    };
}

half_via_f32!(bf16);
half_via_f32! {
    f16
    // `half`'s slice conversions pick the same implementation as its per-element ones
    // (F16C where the CPU has it, else the same software rounding), a block at a time.
    #[inline(always)]
    fn widen(src: &[Self::Raw], dst: &mut [f32]) {
        let k = src.len().min(dst.len()).min(BLOCK);
        let mut h = [f16::ZERO; BLOCK];
        for (h, &s) in h.iter_mut().zip(&src[..k]) {
            *h = <Self as Elem>::from_raw(s);
        }
        h[..k].convert_to_f32_slice(&mut dst[..k]);
    }
    #[inline(always)]
    fn narrow(src: &[f32], dst: &mut [Self::Raw]) {
        let k = src.len().min(dst.len()).min(BLOCK);
        let mut h = [f16::ZERO; BLOCK];
        h[..k].convert_from_f32_slice(&src[..k]);
        for (d, h) in dst[..k].iter_mut().zip(&h[..k]) {
            *d = <Self as Elem>::to_raw(*h);
        }
    }
}

#[derive(Clone, Copy)]
struct E4M3(u8);
#[derive(Clone, Copy)]
struct E5M2(u8);

/// Every fp8 value decoded by [`fp8_to_f32`], indexed by its bits.
fn fp8_table(e5m2: bool) -> &'static [f32; 256] {
    static TABLES: [std::sync::OnceLock<[f32; 256]>; 2] =
        [std::sync::OnceLock::new(), std::sync::OnceLock::new()];
    TABLES[e5m2 as usize].get_or_init(|| core::array::from_fn(|b| fp8_to_f32(b as u8, e5m2)))
}

macro_rules! fp8_via_f32 {
    ($($t:ident => $e5m2:expr),*) => {$(
        via_f32_elem!($t, 1, |r| $t(r[0]), |x| [x.0]);
        impl ViaF32 for $t {
            #[inline(always)]
            fn to32(self) -> f32 { fp8_to_f32(self.0, $e5m2) }
            #[inline(always)]
            fn from32(x: f32) -> Self { $t(f32_to_fp8(x, $e5m2)) }
            #[inline(always)]
            fn widen(src: &[Self::Raw], dst: &mut [f32]) {
                let t = fp8_table($e5m2);
                for (d, s) in dst.iter_mut().zip(src) {
                    *d = t[s[0] as usize];
                }
            }
        }
    )*};
}
fp8_via_f32!(E4M3 => false, E5M2 => true);

/// Reduces a type computed through `f32` a block at a time: each input block is widened
/// once, every step computed in `f32` over the block and rounded back to `T` (then
/// widened again for the next step), exactly the per-element steps of the [`Elem`] impl.
/// `false` when a PreMulSum scalar is missing.
fn reduce_via<T: ViaF32>(
    kind: RedKind,
    inputs: &[&[u8]],
    scalars: &[Vec<u8>],
    out: &mut [u8],
) -> bool {
    let n = inputs.len();
    if n == 0 {
        return true;
    }
    let mut s32 = smallvec::SmallVec::<[f32; 16]>::new();
    if kind == RedKind::PreMulSum {
        for r in 0..n {
            match scalars.get(r).and_then(|s| T::raws(s).first()) {
                Some(&b) => s32.push(T::from_raw(b).to32()),
                None => return false,
            }
        }
    }
    let (mut a32, mut x32, mut t32) = ([0f32; BLOCK], [0f32; BLOCK], [0f32; BLOCK]);
    let mut tr = [T::Raw::default(); BLOCK];
    for (bi, a) in T::raws_mut(out).chunks_mut(BLOCK).enumerate() {
        let (lo, k) = (bi * BLOCK, a.len());
        let (a32, x32, t32, tr) = (&mut a32[..k], &mut x32[..k], &mut t32[..k], &mut tr[..k]);
        let x = |r: usize| T::raws(inputs[r]).get(lo..lo + k).unwrap_or(&[]);
        // Every kind but PreMulSum starts from rank 0's input.
        if kind != RedKind::PreMulSum {
            for (a, &x) in a.iter_mut().zip(x(0)) {
                *a = x;
            }
            T::widen(a, a32);
        }
        match kind {
            RedKind::Max | RedKind::Min => {
                let max = kind == RedKind::Max;
                for r in 1..n {
                    let xr = x(r);
                    T::widen(xr, x32);
                    for (((a, a32), &x), &x32) in
                        a.iter_mut().zip(a32.iter_mut()).zip(xr).zip(&*x32)
                    {
                        if (max && x32 > *a32) || (!max && x32 < *a32) {
                            *a = x;
                            *a32 = x32;
                        }
                    }
                }
            }
            // (A float average arrives as a PreMulSum: see `float_avg_scalars`.)
            RedKind::Sum | RedKind::Avg | RedKind::Prod => {
                let prod = kind == RedKind::Prod;
                for r in 1..n {
                    T::widen(x(r), x32);
                    if prod {
                        for ((t, &a), &x) in t32.iter_mut().zip(&*a32).zip(&*x32) {
                            *t = a * x;
                        }
                    } else {
                        for ((t, &a), &x) in t32.iter_mut().zip(&*a32).zip(&*x32) {
                            *t = a + x;
                        }
                    }
                    T::narrow(t32, a);
                    T::widen(a, a32);
                }
            }
            RedKind::PreMulSum => {
                // Each term scalar_r * x_r is rounded to T before it is added.
                T::widen(x(0), x32);
                for (t, &x) in t32.iter_mut().zip(&*x32) {
                    *t = s32[0] * x;
                }
                T::narrow(t32, a);
                T::widen(a, a32);
                for (r, &s) in s32.iter().enumerate().skip(1) {
                    T::widen(x(r), x32);
                    for (t, &x) in t32.iter_mut().zip(&*x32) {
                        *t = s * x;
                    }
                    T::narrow(t32, tr);
                    T::widen(tr, x32);
                    for ((t, &a), &x) in t32.iter_mut().zip(&*a32).zip(&*x32) {
                        *t = a + x;
                    }
                    T::narrow(t32, a);
                    T::widen(a, a32);
                }
            }
        }
    }
    true
}

/// One step of a fold, chosen at compile time so the per-element loop has no branch on
/// the reduction kind.
trait Step {
    fn step<T: Elem>(acc: T, x: T) -> T;
}

/// A [`Step`] type per reduction, each calling its [`Elem`] method.
macro_rules! steps {
    ($($step:ident => $method:ident),*) => {$(
        struct $step;
        impl Step for $step {
            #[inline(always)]
            fn step<T: Elem>(acc: T, x: T) -> T {
                acc.$method(x)
            }
        }
    )*};
}

steps!(AddStep => add, MulStep => mul, MaxStep => max, MinStep => min);

/// `acc[i] = S(acc[i], x[i])` for every element.
#[inline(always)]
fn fold<T: Elem, S: Step>(acc: &mut [T::Raw], x: &[T::Raw]) {
    for (a, &x) in acc.iter_mut().zip(x) {
        *a = S::step(T::from_raw(*a), T::from_raw(x)).to_raw();
    }
}

/// `acc = S(S(acc, x), y)` element by element: the same order as two [`fold`]s, with
/// one pass over the accumulator instead of two.
#[inline(always)]
fn fold2<T: Elem, S: Step>(acc: &mut [T::Raw], x: &[T::Raw], y: &[T::Raw]) {
    for ((a, &x), &y) in acc.iter_mut().zip(x).zip(y) {
        let t = S::step(T::from_raw(*a), T::from_raw(x));
        *a = S::step(t, T::from_raw(y)).to_raw();
    }
}

/// Folds `rest` into `acc` in order with step `S`.
fn fold_all<T: Elem, S: Step>(acc: &mut [T::Raw], rest: &[&[u8]]) {
    let mut pairs = rest.chunks_exact(2);
    for p in &mut pairs {
        fold2::<T, S>(acc, T::raws(p[0]), T::raws(p[1]));
    }
    if let [x] = pairs.remainder() {
        fold::<T, S>(acc, T::raws(x));
    }
}

/// Reduces with elements of type `T`; `false` when a PreMulSum scalar is missing.
fn reduce_t<T: Elem>(kind: RedKind, inputs: &[&[u8]], scalars: &[Vec<u8>], out: &mut [u8]) -> bool {
    let acc = T::raws_mut(out);
    let Some((first, rest)) = inputs.split_first() else {
        return true;
    };
    if kind == RedKind::PreMulSum {
        let mut sc = smallvec::SmallVec::<[T; 16]>::with_capacity(inputs.len());
        for r in 0..inputs.len() {
            match scalars.get(r).and_then(|s| T::raws(s).first()) {
                Some(&b) => sc.push(T::from_raw(b)),
                None => return false,
            }
        }
        let s0 = sc[0];
        for (a, &x) in acc.iter_mut().zip(T::raws(first)) {
            *a = s0.mul(T::from_raw(x)).to_raw();
        }
        for (x, &s) in rest.iter().zip(&sc[1..]) {
            for (a, &x) in acc.iter_mut().zip(T::raws(x)) {
                *a = T::from_raw(*a).add(s.mul(T::from_raw(x))).to_raw();
            }
        }
        return true;
    }
    for (a, &x) in acc.iter_mut().zip(T::raws(first)) {
        *a = x;
    }
    match kind {
        RedKind::Sum | RedKind::Avg | RedKind::PreMulSum => fold_all::<T, AddStep>(acc, rest),
        RedKind::Prod => fold_all::<T, MulStep>(acc, rest),
        RedKind::Max => fold_all::<T, MaxStep>(acc, rest),
        RedKind::Min => fold_all::<T, MinStep>(acc, rest),
    }
    if kind == RedKind::Avg {
        let n = inputs.len();
        for a in acc.iter_mut() {
            *a = T::from_raw(*a).div_n(n).to_raw();
        }
    }
    true
}

/// NCCL's average of a floating-point type: a PreMulSum by `T(1/nranks)`, the same scalar on
/// every rank (`hostToDevRedOp`, enqueue.cc:2285-2320 of 2.28.9): `float(1.0/nRanks)`
/// rounded to the type (fp8 saturating), `1.0/nRanks` for f64. So each input is scaled and
/// rounded before the sum, and a sum that would overflow the type does not. `None` for
/// the integer types, whose average is the sum divided by `nranks`.
fn float_avg_scalars(dt: ncclDataType_t, nranks: usize) -> Option<Vec<Vec<u8>>> {
    let inv = 1.0 / nranks as f64;
    let one: Vec<u8> = match dt {
        ncclFloat16 => f16::from_f32(inv as f32).to_ne_bytes().into(),
        ncclBfloat16 => bf16::from_f32(inv as f32).to_ne_bytes().into(),
        ncclFloat32 => (inv as f32).to_ne_bytes().into(),
        ncclFloat64 => inv.to_ne_bytes().into(),
        ncclFloat8e4m3 => vec![f32_to_fp8(inv as f32, false)],
        ncclFloat8e5m2 => vec![f32_to_fp8(inv as f32, true)],
        _ => return None,
    };
    Some(vec![one; nranks])
}

/// Reduces `inputs` (one byte slice per rank, each at least `out.len()` long) into `out`,
/// element by element in rank order. `scalars[r]` is rank r's PreMulSum scalar (ignored
/// for other kinds). Returns `false`, leaving `out` unspecified, when an input is shorter
/// than `out` or a PreMulSum scalar is shorter than one element; an unknown data type
/// leaves `out` untouched.
pub(crate) fn reduce(
    dt: ncclDataType_t,
    kind: RedKind,
    inputs: &[&[u8]],
    scalars: &[Vec<u8>],
    out: &mut [u8],
) -> bool {
    if inputs.iter().any(|x| x.len() < out.len()) {
        return false;
    }
    let avg = (kind == RedKind::Avg)
        .then(|| float_avg_scalars(dt, inputs.len()))
        .flatten();
    let (kind, scalars) = match &avg {
        Some(avg) => (RedKind::PreMulSum, &avg[..]),
        None => (kind, scalars),
    };
    kernel(dt, kind, inputs, scalars, out)
}

/// The element-at-a-time form of [`reduce`] (the kind matched per element, each element
/// loaded and stored on its own): the definition the fast kernels must match bit for bit.
#[cfg(test)]
fn reference_t<T: Elem>(kind: RedKind, inputs: &[&[u8]], scalars: &[Vec<u8>], out: &mut [u8]) {
    let s = core::mem::size_of::<T::Raw>();
    let load = |b: &[u8], i: usize| T::from_raw(T::raws(&b[i * s..(i + 1) * s])[0]);
    let nranks = inputs.len();
    let term = |r: usize, i: usize| -> T {
        let x = load(inputs[r], i);
        if kind == RedKind::PreMulSum {
            load(&scalars[r], 0).mul(x)
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
        T::raws_mut(&mut out[i * s..(i + 1) * s])[0] = acc.to_raw();
    }
}

/// [`reduce`] computed element by element by [`reference_t`].
#[cfg(test)]
pub(crate) fn reference_reduce(
    dt: ncclDataType_t,
    kind: RedKind,
    inputs: &[&[u8]],
    scalars: &[Vec<u8>],
    out: &mut [u8],
) {
    if inputs.is_empty() {
        return;
    }
    let avg = (kind == RedKind::Avg)
        .then(|| float_avg_scalars(dt, inputs.len()))
        .flatten();
    let (kind, scalars) = match &avg {
        Some(avg) => (RedKind::PreMulSum, &avg[..]),
        None => (kind, scalars),
    };
    reference_kernel(dt, kind, inputs, scalars, out)
}

/// Deterministic pseudo-random bytes (xorshift64*), every bit pattern possible.
#[cfg(test)]
pub(crate) fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut v = Vec::with_capacity(n + 8);
    while v.len() < n {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        v.extend_from_slice(&x.wrapping_mul(0x2545_F491_4F6C_DD1D).to_ne_bytes());
    }
    v.truncate(n);
    v
}

/// Replaces every NaN in `b` (elements of `dt`) by the NaN this machine computes for
/// `inf - inf`. Rust leaves the payload of a NaN computed from two NaN operands unspecified
/// (the compiler may swap the operands of `+` and `*`), so results are comparable bit for
/// bit only when every NaN, given or computed, is the same one.
#[cfg(test)]
pub(crate) fn one_nan(dt: ncclDataType_t, b: &mut [u8]) {
    fn each<const N: usize>(b: &mut [u8], is_nan: impl Fn([u8; N]) -> bool, nan: [u8; N]) {
        for c in b.as_chunks_mut::<N>().0 {
            if is_nan(*c) {
                *c = nan;
            }
        }
    }
    use std::hint::black_box;
    let nan = black_box(f32::INFINITY) - black_box(f32::INFINITY);
    let nan64 = black_box(f64::INFINITY) - black_box(f64::INFINITY);
    match dt {
        ncclFloat16 => each(
            b,
            |c| f16::from_ne_bytes(c).is_nan(),
            f16::from_f32(nan).to_ne_bytes(),
        ),
        ncclBfloat16 => each(
            b,
            |c| bf16::from_ne_bytes(c).is_nan(),
            bf16::from_f32(nan).to_ne_bytes(),
        ),
        ncclFloat32 => each(b, |c| f32::from_ne_bytes(c).is_nan(), nan.to_ne_bytes()),
        ncclFloat64 => each(b, |c| f64::from_ne_bytes(c).is_nan(), nan64.to_ne_bytes()),
        ncclFloat8e4m3 | ncclFloat8e5m2 => {
            let e5m2 = dt == ncclFloat8e5m2;
            each(
                b,
                |c: [u8; 1]| fp8_to_f32(c[0], e5m2).is_nan(),
                [f32_to_fp8(nan, e5m2)],
            )
        }
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

    fn values(dt: ncclDataType_t, seed: u64, n: usize) -> Vec<u8> {
        let mut v = noise(seed, n);
        one_nan(dt, &mut v);
        v
    }

    #[test]
    fn kernels_match_the_element_at_a_time_reduction() {
        for &dt in ALL_DTYPES {
            let es = size_of(dt).unwrap();
            for kind in RedKind::ALL {
                for nranks in [1usize, 2, 3, 4, 5, 8, 9] {
                    for elems in [0usize, 1, 7, 64, 1000] {
                        let seed = (dt as u64) << 32 | (nranks as u64) << 16 | elems as u64;
                        let inputs: Vec<Vec<u8>> = (0..nranks)
                            .map(|r| values(dt, seed ^ (r as u64 + 1) << 40, elems * es))
                            .collect();
                        let scalars: Vec<Vec<u8>> = (0..nranks)
                            .map(|r| values(dt, !seed ^ r as u64, es))
                            .collect();
                        let ins: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
                        let mut want = vec![0u8; elems * es];
                        reference_reduce(dt, kind, &ins, &scalars, &mut want);
                        let mut got = vec![0x5Au8; elems * es];
                        assert!(reduce(dt, kind, &ins, &scalars, &mut got));
                        assert!(
                            want == got,
                            "dt={dt} kind={kind:?} nranks={nranks} elems={elems}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn malformed_reductions_are_refused_without_panicking() {
        let (a, short, four) = ([0u8; 8], [0u8; 4], vec![vec![0u8; 4]]);
        let ok = |dt, kind, inputs: &[&[u8]], scalars: &[Vec<u8>]| {
            reduce(dt, kind, inputs, scalars, &mut [0u8; 8])
        };
        assert!(!ok(ncclFloat32, RedKind::Sum, &[&a, &short], &[]));
        assert!(!ok(ncclFloat32, RedKind::PreMulSum, &[&a, &a], &four));
        assert!(!ok(ncclFloat64, RedKind::PreMulSum, &[&a], &four));
        assert!(ok(ncclFloat32, RedKind::Sum, &[], &[]));
        assert!(ok(u32::MAX, RedKind::Sum, &[&a], &[]));
    }
}
