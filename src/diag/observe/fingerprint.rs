//! The fingerprint check (opt-in: `Config::check_collectives`): before each collective the
//! ranks of a clique in this process compare (sequence number, operation, type, count,
//! root) through the clique's fingerprint exchange (`Clique::exchange`); on a mismatch
//! every rank gets the table of what each rank called and where.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Instant;

use crate::diag::supervise::clique::{
    Clique, Exchanged, Fingerprint, TimeoutReport, FINGERPRINT_DEPTH,
};

/// Whether two ranks' fingerprints agree: the same call, type, count and root.
fn same_shape(a: &Fingerprint, b: &Fingerprint) -> bool {
    (a.op, a.dtype, a.count, a.root) == (b.op, b.dtype, b.count, b.root)
}

/// How a fingerprint comparison ended.
pub(crate) enum Agreement {
    Agree,
    /// The table of what each rank called.
    Mismatch(String),
    /// The clique timed out (the report), or our wait ran out (`None`: build the report).
    TimedOut(Option<Arc<TimeoutReport>>),
}

/// Posts `fp` for rank `rank` to the clique's exchange and waits (until `deadline`) for
/// every rank's fingerprint of the same sequence number, then compares them.
pub(crate) fn agree(c: &Clique, rank: usize, fp: Fingerprint, deadline: Instant) -> Agreement {
    let compared = c.exchange(rank, fp, deadline, |fingerprints, slot| {
        if (fingerprints.iter()).all(|b| b[slot].is_some_and(|p| same_shape(&p, &fp))) {
            Agreement::Agree
        } else {
            Agreement::Mismatch(table(fingerprints, slot))
        }
    });
    match compared {
        Exchanged::Posted(a) => a,
        Exchanged::TimedOut(r) => Agreement::TimedOut(r),
    }
}

fn table(fingerprints: &[[Option<Fingerprint>; FINGERPRINT_DEPTH]], slot: usize) -> String {
    let mut t = String::from("  rank  seq   call                                      called at\n");
    let first = fingerprints.first().and_then(|b| b[slot]);
    for (r, b) in fingerprints.iter().enumerate() {
        match b[slot] {
            Some(p) => {
                let differs = first.is_some_and(|f| !same_shape(&f, &p));
                let _ = writeln!(
                    t,
                    "  {r:>4}  {:<4}  {:<40}  {}{}",
                    p.seq,
                    p.signature(),
                    p.at(),
                    if differs {
                        "   <-- differs from rank 0"
                    } else {
                        ""
                    }
                );
            }
            None => {
                let _ = writeln!(t, "  {r:>4}  -     (nothing posted)");
            }
        }
    }
    t.truncate(t.trim_end().len());
    t
}
