//! Liveness and reuse analysis of a trace.
//!
//! For every tensor: the ops that use it, its first and last use, its last
//! forward use and first backward use, and the *gaps* between consecutive
//! uses with their reuse distance in ops and in (estimated) time. For every
//! op: the bytes resident if nothing is swapped, and its working set.
//!
//! A gap is where a tensor could live on the host: it is offloaded after the
//! op that opens the gap and must be back before the op that closes it. For
//! a persistent tensor the gap from its last use to its first use *wraps*
//! around the iteration boundary (offloaded at the end of one iteration,
//! prefetched in the next), so such a tensor can be homed on the host between
//! iterations — how optimizer state is kept off the device.

use crate::cost::CostModel;
use crate::trace::{Phase, TensorId, TensorKind, Trace};
use serde::{Deserialize, Serialize};

/// An interval between two consecutive uses of one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReuseGap {
    /// The use that opens the gap (the tensor can be offloaded after it).
    pub after_op: usize,
    /// The use that closes the gap (the tensor must be resident again).
    pub before_op: usize,
    /// Whether the gap crosses the iteration boundary (`after_op >= before_op`).
    pub wraps: bool,
    /// Reuse distance in ops: the number of ops strictly inside the gap.
    pub ops_between: usize,
    /// Reuse distance in time: estimated seconds of the ops inside the gap.
    pub time_between_s: f64,
}

impl ReuseGap {
    /// Whether op `op` lies strictly inside the gap.
    pub fn covers(&self, op: usize) -> bool {
        if self.wraps {
            op > self.after_op || op < self.before_op
        } else {
            op > self.after_op && op < self.before_op
        }
    }
}

/// Liveness of one tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorLiveness {
    /// The tensor.
    pub tensor: TensorId,
    /// Its size.
    pub bytes: u64,
    /// Its kind.
    pub kind: TensorKind,
    /// Whether it lives across iterations.
    pub persistent: bool,
    /// The ops that read or write it, ascending.
    pub uses: Vec<usize>,
    /// Its last use in the forward pass.
    pub last_forward_use: Option<usize>,
    /// Its first use after [`TensorLiveness::last_forward_use`] in the
    /// backward pass or the optimizer.
    pub first_backward_use: Option<usize>,
    /// The gap between the last forward and the first backward use: the
    /// reuse distance of AutoVM's Listing 3.1.
    pub forward_backward: Option<ReuseGap>,
    /// Every gap between consecutive uses (for a persistent tensor also the
    /// one that wraps around the iteration boundary).
    pub gaps: Vec<ReuseGap>,
}

impl TensorLiveness {
    /// The first op that uses the tensor.
    pub fn first_use(&self) -> Option<usize> {
        self.uses.first().copied()
    }

    /// The last op that uses the tensor.
    pub fn last_use(&self) -> Option<usize> {
        self.uses.last().copied()
    }

    /// Whether the tensor occupies device memory while op `op` runs, if
    /// nothing is swapped.
    pub fn live_at(&self, op: usize) -> bool {
        if self.persistent {
            return true;
        }
        match (self.first_use(), self.last_use()) {
            (Some(f), Some(l)) => f <= op && op <= l,
            _ => false,
        }
    }
}

/// Liveness of a whole trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Analysis {
    /// Per tensor, indexed by [`TensorId::index`].
    pub tensors: Vec<TensorLiveness>,
    /// Per op: bytes on the device while it runs if nothing is swapped.
    pub resident_bytes: Vec<u64>,
    /// Per op: bytes of the distinct tensors it reads and writes.
    pub working_set_bytes: Vec<u64>,
    /// Bytes of parameters and optimizer state.
    pub persistent_bytes: u64,
    /// The largest of [`Analysis::resident_bytes`]: peak memory without swapping.
    pub peak_bytes: u64,
    /// The op at which that peak is reached (the first one).
    pub peak_op: usize,
    /// The largest working set: no budget below it can work.
    pub max_working_set_bytes: u64,
    /// The op with the largest working set.
    pub max_working_set_op: usize,
    /// Per op: duration used for time estimates (measured or default).
    pub op_time_s: Vec<f64>,
    /// Per op: start time in an iteration without stalls; one more entry
    /// holds the iteration's compute time.
    pub op_start_s: Vec<f64>,
    /// Whether every duration was measured (otherwise times are estimates
    /// from [`CostModel::default_op_time_s`]).
    pub durations_measured: bool,
}

impl Analysis {
    /// Liveness of one tensor.
    pub fn tensor(&self, id: TensorId) -> &TensorLiveness {
        &self.tensors[id.index()]
    }

    /// Estimated seconds of the ops strictly between `after` and `before`
    /// (wrapping around the iteration when `after >= before`).
    pub fn time_between(&self, after: usize, before: usize) -> f64 {
        let total = self.op_start_s[self.resident_bytes.len()];
        time_between(&self.op_start_s, total, after, before)
    }
}

/// [`Analysis::time_between`] over op start times and the iteration's
/// compute time `total`.
fn time_between(op_start_s: &[f64], total: f64, after: usize, before: usize) -> f64 {
    if after < before {
        op_start_s[before] - op_start_s[after + 1]
    } else {
        (total - op_start_s[after + 1]) + op_start_s[before]
    }
}

/// Analyses liveness and reuse distances; `cost` supplies durations for ops
/// without a measured one.
pub fn analyze(trace: &Trace, cost: &CostModel) -> Analysis {
    let n = trace.num_ops();
    let mut uses: Vec<Vec<usize>> = vec![Vec::new(); trace.num_tensors()];
    for op in 0..n {
        for &t in trace.uses(op) {
            uses[t.index()].push(op);
        }
    }
    let op_time_s: Vec<f64> = trace.ops().iter().map(|o| cost.op_time(o)).collect();
    let mut op_start_s = Vec::with_capacity(n + 1);
    let mut acc = 0.0;
    for &d in &op_time_s {
        op_start_s.push(acc);
        acc += d;
    }
    op_start_s.push(acc);
    // The gap from the use `after` to the use `before` (wrapping around the
    // iteration when `wraps`).
    let gap = |after: usize, before: usize, wraps: bool| ReuseGap {
        after_op: after,
        before_op: before,
        wraps,
        ops_between: if wraps {
            (n - 1 - after) + before
        } else {
            before - after - 1
        },
        time_between_s: time_between(&op_start_s, acc, after, before),
    };

    let persistent_bytes = trace.persistent_bytes();
    // Difference array of non-persistent lifetimes.
    let mut delta = vec![0i128; n + 1];
    let mut tensors = Vec::with_capacity(trace.num_tensors());
    for (i, info) in trace.tensors().iter().enumerate() {
        let id = TensorId(i as u32);
        let u = std::mem::take(&mut uses[i]);
        let persistent = info.kind.is_persistent();
        if !persistent {
            if let (Some(&f), Some(&l)) = (u.first(), u.last()) {
                delta[f] += info.bytes as i128;
                delta[l + 1] -= info.bytes as i128;
            }
        }
        let mut gaps: Vec<ReuseGap> = u.windows(2).map(|w| gap(w[0], w[1], false)).collect();
        if persistent {
            if let (Some(&f), Some(&l)) = (u.first(), u.last()) {
                gaps.push(gap(l, f, true));
            }
        }
        let last_forward_use = u
            .iter()
            .copied()
            .filter(|&op| trace.ops()[op].phase == Phase::Forward)
            .max();
        let first_backward_use = last_forward_use.and_then(|lf| {
            u.iter()
                .copied()
                .find(|&op| op > lf && trace.ops()[op].phase != Phase::Forward)
        });
        let forward_backward = match (last_forward_use, first_backward_use) {
            (Some(a), Some(b)) => Some(gap(a, b, false)),
            _ => None,
        };
        tensors.push(TensorLiveness {
            tensor: id,
            bytes: info.bytes,
            kind: info.kind,
            persistent,
            uses: u,
            last_forward_use,
            first_backward_use,
            forward_backward,
            gaps,
        });
    }
    let mut resident_bytes = Vec::with_capacity(n);
    let mut cur: i128 = 0;
    for d in delta.iter().take(n) {
        cur += d;
        resident_bytes.push(persistent_bytes + cur.max(0) as u64);
    }
    let working_set_bytes: Vec<u64> = (0..n).map(|op| trace.working_set_bytes(op)).collect();
    let (peak_op, peak_bytes) = argmax(&resident_bytes);
    let (max_working_set_op, max_working_set_bytes) = argmax(&working_set_bytes);
    Analysis {
        tensors,
        resident_bytes,
        working_set_bytes,
        persistent_bytes,
        peak_bytes,
        peak_op,
        max_working_set_bytes,
        max_working_set_op,
        op_time_s,
        op_start_s,
        durations_measured: trace.has_durations(),
    }
}

/// Index and value of the first maximum (0, 0 for an empty slice).
fn argmax(v: &[u64]) -> (usize, u64) {
    let mut best = (0, 0);
    for (i, &x) in v.iter().enumerate() {
        if x > best.1 {
            best = (i, x);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceBuilder;

    #[test]
    fn liveness_and_reuse_of_a_tiny_network() {
        let mut b = TraceBuilder::new();
        let w = b.tensor("w", 10, TensorKind::Parameter);
        let x = b.tensor("x", 100, TensorKind::Activation);
        let y = b.tensor("y", 200, TensorKind::Activation);
        let dy = b.tensor("dy", 200, TensorKind::Gradient);
        let dw = b.tensor("dw", 10, TensorKind::Gradient);
        b.timed_op("f1", Phase::Forward, &[x, w], &[y], 1.0); // 0
        b.timed_op("loss", Phase::Forward, &[y], &[dy], 2.0); // 1
        b.timed_op("b1", Phase::Backward, &[dy, x], &[dw], 3.0); // 2
        b.timed_op("opt", Phase::Optimizer, &[w, dw], &[w], 4.0); // 3
        let t = b.build().unwrap();
        let a = analyze(&t, &CostModel::default());
        assert_eq!(a.resident_bytes, vec![310, 510, 320, 20]);
        assert_eq!(a.peak_bytes, 510);
        assert_eq!(a.peak_op, 1);
        assert_eq!(a.working_set_bytes, vec![310, 400, 310, 20]);
        let lx = a.tensor(x);
        assert_eq!(lx.last_forward_use, Some(0));
        assert_eq!(lx.first_backward_use, Some(2));
        let g = lx.forward_backward.unwrap();
        assert_eq!((g.ops_between, g.time_between_s), (1, 2.0));
        // The parameter's wrap-around gap: after op 3, before op 0.
        let lw = a.tensor(w);
        let wrap = lw.gaps.iter().find(|g| g.wraps).unwrap();
        assert_eq!((wrap.after_op, wrap.before_op, wrap.ops_between), (3, 0, 0));
        assert_eq!(lw.gaps[0].ops_between, 2);
        assert!(lw.gaps[0].covers(1) && !lw.gaps[0].covers(3));
        assert!(a.durations_measured);
        assert_eq!(a.time_between(3, 1), 1.0);
    }
}
