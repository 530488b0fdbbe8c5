//! Conformance of the host provider: every collective x dtype x op x world size x
//! in-place/out-of-place, compared bit-exactly against a serial reference written here
//! independently of the provider. Every call goes through `nccl_sys::FunctionTable`.

#![allow(non_upper_case_globals)]

use core::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

use half::{bf16, f16};
use nccl_sys::bindings::*;
use nccl_sys::FunctionTable;

fn table() -> FunctionTable {
    // SAFETY: the host provider's lookup returns functions with NCCL's signatures.
    unsafe { FunctionTable::load(nccl_safe::host::lookup) }.expect("host provider table")
}

const DTYPES: [ncclDataType_t; 12] = [
    ncclInt8,
    ncclUint8,
    ncclInt32,
    ncclUint32,
    ncclInt64,
    ncclUint64,
    ncclFloat16,
    ncclFloat32,
    ncclFloat64,
    ncclBfloat16,
    ncclFloat8e4m3,
    ncclFloat8e5m2,
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Op {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
    PreMulSum,
}
const OPS: [Op; 6] = [Op::Sum, Op::Prod, Op::Max, Op::Min, Op::Avg, Op::PreMulSum];

fn size(dt: ncclDataType_t) -> usize {
    match dt {
        ncclInt8 | ncclUint8 | ncclFloat8e4m3 | ncclFloat8e5m2 => 1,
        ncclFloat16 | ncclBfloat16 => 2,
        ncclInt32 | ncclUint32 | ncclFloat32 => 4,
        _ => 8,
    }
}

fn int_info(dt: ncclDataType_t) -> Option<(u32, bool)> {
    match dt {
        ncclInt8 => Some((8, true)),
        ncclUint8 => Some((8, false)),
        ncclInt32 => Some((32, true)),
        ncclUint32 => Some((32, false)),
        ncclInt64 => Some((64, true)),
        ncclUint64 => Some((64, false)),
        _ => None,
    }
}

// ---- fp8, written independently: decode by formula, encode by nearest search ----

fn fp8_dec(b: u8, e5m2: bool) -> f64 {
    let (mb, bias) = if e5m2 { (2, 15) } else { (3, 7) };
    let e = ((b & 0x7f) >> mb) as i32;
    let m = (b & ((1 << mb) - 1)) as f64;
    let v = if e == 0 {
        m * 2f64.powi(1 - bias - mb)
    } else {
        (1.0 + m / (1 << mb) as f64) * 2f64.powi(e - bias)
    };
    if b & 0x80 != 0 {
        -v
    } else {
        v
    }
}

fn fp8_finite(b: u8, e5m2: bool) -> bool {
    if e5m2 {
        (b & 0x7c) != 0x7c
    } else {
        (b & 0x7f) != 0x7f
    }
}

fn fp8_enc(x: f32, e5m2: bool) -> u8 {
    let x = x as f64;
    let mut best: Option<(u8, f64)> = None;
    for b in 0..=255u8 {
        if !fp8_finite(b, e5m2) || (b == 0x80) {
            continue;
        }
        let d = (fp8_dec(b, e5m2) - x).abs();
        best = match best {
            None => Some((b, d)),
            Some((bb, bd)) if d < bd || (d == bd && b & 1 == 0 && bb & 1 == 1) => Some((b, d)),
            keep => keep,
        };
    }
    best.map_or(0, |(b, _)| b)
}

// ---- element arithmetic of the reference ----

fn int_dec(b: &[u8], bits: u32, signed: bool) -> i128 {
    let mut a = [0u8; 16];
    a[..b.len()].copy_from_slice(b);
    let u = u128::from_le_bytes(a);
    if signed && bits < 128 && (u >> (bits - 1)) & 1 == 1 {
        (u as i128) - (1i128 << bits)
    } else {
        u as i128
    }
}

fn int_enc(v: i128, bytes: usize) -> Vec<u8> {
    v.to_le_bytes()[..bytes].to_vec()
}

/// f32-domain value of a via-f32 type, or None.
fn to_f32(dt: ncclDataType_t, b: &[u8]) -> f32 {
    match dt {
        ncclFloat16 => f16::from_le_bytes([b[0], b[1]]).to_f32(),
        ncclBfloat16 => bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        ncclFloat8e4m3 => fp8_dec(b[0], false) as f32,
        ncclFloat8e5m2 => fp8_dec(b[0], true) as f32,
        ncclFloat32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        _ => unreachable!(),
    }
}

fn from_f32(dt: ncclDataType_t, x: f32) -> Vec<u8> {
    match dt {
        ncclFloat16 => f16::from_f32(x).to_le_bytes().to_vec(),
        ncclBfloat16 => bf16::from_f32(x).to_le_bytes().to_vec(),
        ncclFloat8e4m3 => vec![fp8_enc(x, false)],
        ncclFloat8e5m2 => vec![fp8_enc(x, true)],
        ncclFloat32 => x.to_le_bytes().to_vec(),
        _ => unreachable!(),
    }
}

/// The value `x` in type `dt` (rounded / wrapped).
fn make(dt: ncclDataType_t, x: f64) -> Vec<u8> {
    if int_info(dt).is_some() {
        int_enc(x as i128, size(dt))
    } else if dt == ncclFloat64 {
        x.to_le_bytes().to_vec()
    } else {
        from_f32(dt, x as f32)
    }
}

/// One step of the fold, rounded to the type.
fn step(dt: ncclDataType_t, op: Op, a: &[u8], b: &[u8]) -> Vec<u8> {
    if let Some((bits, signed)) = int_info(dt) {
        let (x, y) = (int_dec(a, bits, signed), int_dec(b, bits, signed));
        let r = match op {
            Op::Sum | Op::Avg | Op::PreMulSum => x.wrapping_add(y),
            Op::Prod => x.wrapping_mul(y),
            Op::Max => {
                if y > x {
                    y
                } else {
                    x
                }
            }
            Op::Min => {
                if y < x {
                    y
                } else {
                    x
                }
            }
        };
        return int_enc(r, size(dt));
    }
    if dt == ncclFloat64 {
        let x = f64::from_le_bytes(a.try_into().unwrap());
        let y = f64::from_le_bytes(b.try_into().unwrap());
        let r = match op {
            Op::Sum | Op::Avg | Op::PreMulSum => x + y,
            Op::Prod => x * y,
            Op::Max => {
                if y > x {
                    y
                } else {
                    x
                }
            }
            Op::Min => {
                if y < x {
                    y
                } else {
                    x
                }
            }
        };
        return r.to_le_bytes().to_vec();
    }
    let (x, y) = (to_f32(dt, a), to_f32(dt, b));
    match op {
        Op::Sum | Op::Avg | Op::PreMulSum => from_f32(dt, x + y),
        Op::Prod => from_f32(dt, x * y),
        Op::Max => (if y > x { b } else { a }).to_vec(),
        Op::Min => (if y < x { b } else { a }).to_vec(),
    }
}

/// An integer average's last step: the wrapped sum divided by `n`, truncating.
fn div_n(dt: ncclDataType_t, a: &[u8], n: usize) -> Vec<u8> {
    let (bits, signed) = int_info(dt).expect("an integer type");
    int_enc(int_dec(a, bits, signed) / n as i128, size(dt))
}

/// The serial reference: element-wise fold over ranks in rank order, each step rounded to
/// the type; PreMulSum = sum of (scalar_r * x_r); avg as NCCL computes it
/// (`hostToDevRedOp`, enqueue.cc:2285-2320 of 2.28.9): integers (sum in rank order) /
/// nranks, floating-point types a PreMulSum by `float(1.0/nranks)` rounded to the type
/// (`1.0/nranks` for f64) on every rank.
fn reference_reduce(
    dt: ncclDataType_t,
    op: Op,
    inputs: &[Vec<u8>],
    scalars: &[Vec<u8>],
) -> Vec<u8> {
    let s = size(dt);
    let n = inputs[0].len() / s;
    let mut out = Vec::with_capacity(n * s);
    let float_avg =
        (op == Op::Avg && int_info(dt).is_none()).then(|| make(dt, 1.0 / inputs.len() as f64));
    for i in 0..n {
        let term = |r: usize| {
            let x = &inputs[r][i * s..(i + 1) * s];
            match (op, &float_avg) {
                (Op::PreMulSum, _) => step(dt, Op::Prod, &scalars[r], x),
                (_, Some(scalar)) => step(dt, Op::Prod, scalar, x),
                _ => x.to_vec(),
            }
        };
        let mut acc = term(0);
        for r in 1..inputs.len() {
            acc = step(dt, op, &acc, &term(r));
        }
        if op == Op::Avg && float_avg.is_none() {
            acc = div_n(dt, &acc, inputs.len());
        }
        out.extend_from_slice(&acc);
    }
    out
}

#[test]
fn reference_self_check() {
    // 3 ranks of int8 sums wrap; avg truncates toward zero; fp8 rounds each step.
    let i = |v: &[i8]| v.iter().map(|&x| x as u8).collect::<Vec<u8>>();
    let r = reference_reduce(ncclInt8, Op::Sum, &[i(&[100]), i(&[100]), i(&[-7])], &[]);
    assert_eq!(r, i(&[-63])); // 200 wraps to -56, then -63
    let r = reference_reduce(ncclInt8, Op::Avg, &[i(&[-7]), i(&[0]), i(&[0])], &[]);
    assert_eq!(r, i(&[-2]));
    // A float average scales each input first, so a sum that would overflow does not.
    let f = |v: f32| v.to_le_bytes().to_vec();
    let r = reference_reduce(ncclFloat32, Op::Avg, &[f(3.0e38), f(3.0e38)], &[]);
    assert_eq!(r, f(3.0e38));
    assert_eq!(fp8_dec(fp8_enc(1.0625, false), false), 1.0);
    assert_eq!(fp8_dec(fp8_enc(3.0, true), true), 3.0);
}

/// Rank `r`'s element `i` for a case (`salt`), small so products stay meaningful.
fn input(dt: ncclDataType_t, op: Op, r: usize, i: usize, salt: usize) -> Vec<u8> {
    let k = r * 3 + i * 5 + salt;
    let x = match (int_info(dt), op) {
        (Some((_, true)), Op::Prod) => {
            ((k % 3) as f64 + 1.0) * if k.is_multiple_of(4) { -1.0 } else { 1.0 }
        }
        (Some((_, false)), Op::Prod) => (k % 3) as f64 + 1.0,
        (Some((_, true)), _) => (k % 11) as f64 - 5.0,
        (Some((_, false)), _) => (k % 11) as f64 + 1.0,
        (None, Op::Prod) => 0.75 + 0.125 * (k % 5) as f64,
        (None, _) => 0.25 * (k % 13) as f64 - 1.4,
    };
    make(dt, x)
}

fn inputs(dt: ncclDataType_t, op: Op, r: usize, n: usize, salt: usize) -> Vec<u8> {
    (0..n).flat_map(|i| input(dt, op, r, i, salt)).collect()
}

fn scalar(dt: ncclDataType_t, r: usize) -> Vec<u8> {
    if int_info(dt).is_some() {
        make(dt, r as f64 + 2.0)
    } else {
        make(dt, 0.5 + 0.25 * r as f64)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Coll {
    AllReduce,
    Reduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Bcast,
    AlltoAll,
    Gather,
    Scatter,
    SendRecvRing,
}

#[derive(Clone, Copy, Debug)]
struct Case {
    coll: Coll,
    dt: ncclDataType_t,
    op: Op,
    in_place: bool,
    count: usize,
    root: usize,
    salt: usize,
}

fn cases(world: usize) -> Vec<Case> {
    let mut v = Vec::new();
    let mut idx = 0usize;
    let mut push = |coll, dt, op, in_place| {
        v.push(Case {
            coll,
            dt,
            op,
            in_place,
            count: 7 + (idx * 5) % 31,
            root: idx % world,
            salt: idx,
        });
        idx += 1;
    };
    for dt in DTYPES {
        for in_place in [false, true] {
            for op in OPS {
                push(Coll::AllReduce, dt, op, in_place);
                push(Coll::Reduce, dt, op, in_place);
                push(Coll::ReduceScatter, dt, op, in_place);
            }
            push(Coll::AllGather, dt, Op::Sum, in_place);
            push(Coll::Broadcast, dt, Op::Sum, in_place);
            push(Coll::Gather, dt, Op::Sum, in_place);
            push(Coll::Scatter, dt, Op::Sum, in_place);
        }
        push(Coll::Bcast, dt, Op::Sum, true);
        push(Coll::AlltoAll, dt, Op::Sum, false);
        push(Coll::SendRecvRing, dt, Op::Sum, false);
    }
    v
}

const SENTINEL: u8 = 0xA5;

/// Runs one case on rank `r`; returns a mismatch description on failure.
fn run_case(
    t: &FunctionTable,
    comm: ncclComm_t,
    r: usize,
    w: usize,
    c: &Case,
) -> Result<(), String> {
    let s = size(c.dt);
    let n = c.count;
    let nb = n * s;
    let null = core::ptr::null_mut::<CUstream_st>();
    let all: Vec<Vec<u8>> = (0..w).map(|q| inputs(c.dt, c.op, q, n, c.salt)).collect();
    let all_big: Vec<Vec<u8>> = (0..w)
        .map(|q| inputs(c.dt, c.op, q, n * w, c.salt))
        .collect();
    let scalars: Vec<Vec<u8>> = (0..w).map(|q| scalar(c.dt, q)).collect();
    let mut op = ncclSum;
    let mut dev_scalar = scalars[r].clone();
    let call = |res: ncclResult_t, what: &str| {
        if res == ncclSuccess {
            Ok(())
        } else {
            Err(format!("{what} returned {res}"))
        }
    };
    match c.op {
        Op::Sum => op = ncclSum,
        Op::Prod => op = ncclProd,
        Op::Max => op = ncclMax,
        Op::Min => op = ncclMin,
        Op::Avg => op = ncclAvg,
        Op::PreMulSum => {
            let residence = if c.salt.is_multiple_of(2) {
                ncclScalarHostImmediate
            } else {
                ncclScalarDevice
            };
            // SAFETY: valid out pointer, scalar of one element of dt, live comm.
            call(
                unsafe {
                    (t.ncclRedOpCreatePreMulSum)(
                        &mut op,
                        dev_scalar.as_mut_ptr() as *mut c_void,
                        c.dt,
                        residence,
                        comm,
                    )
                },
                "ncclRedOpCreatePreMulSum",
            )?;
        }
    }
    let expect_red = |big: bool| {
        let ins = if big { &all_big } else { &all };
        reference_reduce(c.dt, c.op, ins, &scalars)
    };
    let (got, want): (Vec<u8>, Vec<u8>);
    // SAFETY (for every call below): buffers are live Vecs of the sizes NCCL requires for
    // the collective; the comm is live; the stream is ignored by the host provider.
    unsafe {
        match c.coll {
            Coll::AllReduce => {
                let mut recv = if c.in_place {
                    all[r].clone()
                } else {
                    vec![SENTINEL; nb]
                };
                let send = if c.in_place {
                    recv.as_ptr()
                } else {
                    all[r].as_ptr()
                };
                call(
                    (t.ncclAllReduce)(send as _, recv.as_mut_ptr() as _, n, c.dt, op, comm, null),
                    "ncclAllReduce",
                )?;
                got = recv;
                want = expect_red(false);
            }
            Coll::Reduce => {
                let mut recv = if c.in_place {
                    all[r].clone()
                } else {
                    vec![SENTINEL; nb]
                };
                let send = if c.in_place {
                    recv.as_ptr()
                } else {
                    all[r].as_ptr()
                };
                call(
                    (t.ncclReduce)(
                        send as _,
                        recv.as_mut_ptr() as _,
                        n,
                        c.dt,
                        op,
                        c.root as i32,
                        comm,
                        null,
                    ),
                    "ncclReduce",
                )?;
                got = recv;
                want = if r == c.root {
                    expect_red(false)
                } else if c.in_place {
                    all[r].clone()
                } else {
                    vec![SENTINEL; nb]
                };
            }
            Coll::ReduceScatter => {
                let full = expect_red(true);
                want = full[r * nb..(r + 1) * nb].to_vec();
                if c.in_place {
                    let mut buf = all_big[r].clone();
                    let p = buf.as_mut_ptr();
                    call(
                        (t.ncclReduceScatter)(p as _, p.add(r * nb) as _, n, c.dt, op, comm, null),
                        "ncclReduceScatter",
                    )?;
                    got = buf[r * nb..(r + 1) * nb].to_vec();
                } else {
                    let mut recv = vec![SENTINEL; nb];
                    call(
                        (t.ncclReduceScatter)(
                            all_big[r].as_ptr() as _,
                            recv.as_mut_ptr() as _,
                            n,
                            c.dt,
                            op,
                            comm,
                            null,
                        ),
                        "ncclReduceScatter",
                    )?;
                    got = recv;
                }
            }
            Coll::AllGather => {
                want = all.concat();
                let mut recv = vec![SENTINEL; nb * w];
                if c.in_place {
                    recv[r * nb..(r + 1) * nb].copy_from_slice(&all[r]);
                    let p = recv.as_mut_ptr();
                    call(
                        (t.ncclAllGather)(p.add(r * nb) as _, p as _, n, c.dt, comm, null),
                        "ncclAllGather",
                    )?;
                } else {
                    call(
                        (t.ncclAllGather)(
                            all[r].as_ptr() as _,
                            recv.as_mut_ptr() as _,
                            n,
                            c.dt,
                            comm,
                            null,
                        ),
                        "ncclAllGather",
                    )?;
                }
                got = recv;
            }
            Coll::Broadcast | Coll::Bcast => {
                want = all[c.root].clone();
                let mut recv = if c.in_place {
                    all[r].clone()
                } else {
                    vec![SENTINEL; nb]
                };
                if c.coll == Coll::Bcast {
                    call(
                        (t.ncclBcast)(recv.as_mut_ptr() as _, n, c.dt, c.root as i32, comm, null),
                        "ncclBcast",
                    )?;
                } else {
                    let send = if c.in_place {
                        recv.as_ptr()
                    } else {
                        all[r].as_ptr()
                    };
                    call(
                        (t.ncclBroadcast)(
                            send as _,
                            recv.as_mut_ptr() as _,
                            n,
                            c.dt,
                            c.root as i32,
                            comm,
                            null,
                        ),
                        "ncclBroadcast",
                    )?;
                }
                got = recv;
            }
            Coll::AlltoAll => {
                want = (0..w)
                    .flat_map(|q| all_big[q][r * nb..(r + 1) * nb].to_vec())
                    .collect();
                let mut recv = vec![SENTINEL; nb * w];
                let f = t.ncclAlltoAll.ok_or("no ncclAlltoAll")?;
                call(
                    f(
                        all_big[r].as_ptr() as _,
                        recv.as_mut_ptr() as _,
                        n,
                        c.dt,
                        comm,
                        null,
                    ),
                    "ncclAlltoAll",
                )?;
                got = recv;
            }
            Coll::Gather => {
                let f = t.ncclGather.ok_or("no ncclGather")?;
                let is_root = r == c.root;
                let mut recv = vec![SENTINEL; nb * w];
                if c.in_place && is_root {
                    recv[r * nb..(r + 1) * nb].copy_from_slice(&all[r]);
                    let p = recv.as_mut_ptr();
                    call(
                        f(
                            p.add(r * nb) as _,
                            p as _,
                            n,
                            c.dt,
                            c.root as i32,
                            comm,
                            null,
                        ),
                        "ncclGather",
                    )?;
                } else {
                    let rp = if is_root {
                        recv.as_mut_ptr()
                    } else {
                        core::ptr::null_mut()
                    };
                    call(
                        f(
                            all[r].as_ptr() as _,
                            rp as _,
                            n,
                            c.dt,
                            c.root as i32,
                            comm,
                            null,
                        ),
                        "ncclGather",
                    )?;
                }
                got = recv;
                want = if is_root {
                    all.concat()
                } else {
                    vec![SENTINEL; nb * w]
                };
            }
            Coll::Scatter => {
                let f = t.ncclScatter.ok_or("no ncclScatter")?;
                let is_root = r == c.root;
                want = all_big[c.root][r * nb..(r + 1) * nb].to_vec();
                if c.in_place && is_root {
                    let mut buf = all_big[r].clone();
                    let p = buf.as_mut_ptr();
                    call(
                        f(
                            p as _,
                            p.add(r * nb) as _,
                            n,
                            c.dt,
                            c.root as i32,
                            comm,
                            null,
                        ),
                        "ncclScatter",
                    )?;
                    got = buf[r * nb..(r + 1) * nb].to_vec();
                } else {
                    let mut recv = vec![SENTINEL; nb];
                    let sp = if is_root {
                        all_big[r].as_ptr()
                    } else {
                        core::ptr::null()
                    };
                    call(
                        f(
                            sp as _,
                            recv.as_mut_ptr() as _,
                            n,
                            c.dt,
                            c.root as i32,
                            comm,
                            null,
                        ),
                        "ncclScatter",
                    )?;
                    got = recv;
                }
            }
            Coll::SendRecvRing => {
                let next = (r + 1) % w;
                let prev = (r + w - 1) % w;
                let mut recv = vec![SENTINEL; nb];
                call((t.ncclGroupStart)(), "ncclGroupStart")?;
                call(
                    (t.ncclSend)(all[r].as_ptr() as _, n, c.dt, next as i32, comm, null),
                    "ncclSend",
                )?;
                call(
                    (t.ncclRecv)(recv.as_mut_ptr() as _, n, c.dt, prev as i32, comm, null),
                    "ncclRecv",
                )?;
                call((t.ncclGroupEnd)(), "ncclGroupEnd")?;
                got = recv;
                want = all[prev].clone();
            }
        }
    }
    if c.op == Op::PreMulSum {
        // SAFETY: op was created on this comm above.
        call(
            unsafe { (t.ncclRedOpDestroy)(op, comm) },
            "ncclRedOpDestroy",
        )?;
    }
    if got != want {
        return Err(format!("rank {r}/{w} {c:?}: got {got:?}, want {want:?}"));
    }
    Ok(())
}

#[test]
fn every_collective_dtype_op_world_size_and_placement() {
    let t = table();
    let total = AtomicUsize::new(0);
    let mut failures = Vec::new();
    // HOST_CONFORMANCE_WORLDS=2,3 runs a subset (scripts/valgrind-host.sh uses it).
    let worlds: Vec<usize> = std::env::var("HOST_CONFORMANCE_WORLDS")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 2, 3, 4, 8]);
    let full = worlds == [1, 2, 3, 4, 8];
    for w in worlds {
        let cs = cases(w);
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: valid out pointer.
        assert_eq!(unsafe { (t.ncclGetUniqueId)(&mut id) }, ncclSuccess);
        let results: Vec<Vec<String>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..w)
                .map(|r| {
                    let (t, cs, id, total) = (&t, &cs, id, &total);
                    s.spawn(move || {
                        let mut comm: ncclComm_t = core::ptr::null_mut();
                        // SAFETY: valid out pointer; every rank joins with the same id.
                        let rc = unsafe { (t.ncclCommInitRank)(&mut comm, w as i32, id, r as i32) };
                        assert_eq!(rc, ncclSuccess, "init rank {r}/{w}");
                        let mut errs = Vec::new();
                        for c in cs {
                            if let Err(e) = run_case(t, comm, r, w, c) {
                                errs.push(e);
                            }
                            if r == 0 {
                                total.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        // SAFETY: comm is live and destroyed once.
                        assert_eq!(unsafe { (t.ncclCommDestroy)(comm) }, ncclSuccess);
                        errs
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().expect("rank thread panicked"))
                .collect()
        });
        failures.extend(results.into_iter().flatten());
        let st = nccl_safe::host::stats_for(&id);
        assert_eq!(
            (st.created, st.destroyed, st.live, st.misused),
            (w as u64, w as u64, 0, 0)
        );
    }
    let n = total.load(Ordering::Relaxed);
    println!("host conformance matrix: {n} cases (collective x dtype x op x placement x world size 1,2,3,4,8)");
    assert!(!full || n > 2000, "matrix unexpectedly small: {n}");
    assert!(
        failures.is_empty(),
        "{} mismatches, first: {:#?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
}
