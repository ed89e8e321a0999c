//! Steps 1–2: offload candidates (Listing 3.1) and selection (Belady's
//! rule under the budget).

use super::config::Selection;
use super::{AutoVmPlanner, Candidate};
use crate::analysis::{analyze, Analysis, ReuseGap};
use crate::error::PlanError;
use crate::trace::Trace;

/// A selected round trip while planning.
#[derive(Clone, Debug)]
pub(super) struct Trip {
    pub(super) tensor: usize,
    pub(super) bytes: u64,
    /// Offload after this op.
    pub(super) a: usize,
    /// Needed by this op.
    pub(super) b: usize,
    pub(super) wraps: bool,
    /// Earliest possible issue point.
    pub(super) lo: usize,
    /// Issue point (prefetch before this op).
    pub(super) p: usize,
    pub(super) gap: ReuseGap,
}

/// Adds `bytes` to `r[from..to]`.
pub(super) fn add(r: &mut [u64], from: usize, to: usize, bytes: u64) {
    for x in &mut r[from..to] {
        *x += bytes;
    }
}

/// Subtracts `bytes` from `r[from..to]`.
pub(super) fn sub(r: &mut [u64], from: usize, to: usize, bytes: u64) {
    for x in &mut r[from..to] {
        *x -= bytes;
    }
}

impl AutoVmPlanner {
    /// The offload candidates of a trace (Listing 3.1), with the analysis
    /// they were derived from.
    pub fn candidates(&self, trace: &Trace) -> (Vec<Candidate>, Analysis) {
        let an = analyze(trace, &self.config.cost);
        let c = self.candidates_of(&an);
        (c, an)
    }

    fn candidates_of(&self, an: &Analysis) -> Vec<Candidate> {
        let cfg = &self.config;
        let mut out = Vec::new();
        for l in &an.tensors {
            if !cfg.offload_kinds.contains(&l.kind) || l.bytes < cfg.size_threshold_bytes {
                continue;
            }
            for g in &l.gaps {
                if self.gap_ok(g) {
                    out.push(Candidate {
                        tensor: l.tensor,
                        bytes: l.bytes,
                        gap: *g,
                    });
                }
            }
        }
        out
    }

    fn gap_ok(&self, g: &ReuseGap) -> bool {
        g.ops_between >= self.config.min_reuse_ops
            && self
                .config
                .min_reuse_time_s
                .is_none_or(|t| g.time_between_s >= t)
    }

    /// Why tensor `t`, live and idle at op `op`, could not be offloaded.
    fn why_not(&self, an: &Analysis, t: usize, op: usize) -> String {
        let l = &an.tensors[t];
        let cfg = &self.config;
        if !cfg.offload_kinds.contains(&l.kind) {
            return format!("its kind ({}) is not offloadable", l.kind.label());
        }
        if l.bytes < cfg.size_threshold_bytes {
            return format!(
                "it is smaller than the size threshold of {} bytes",
                cfg.size_threshold_bytes
            );
        }
        match l.gaps.iter().find(|g| g.covers(op)) {
            Some(g) if g.ops_between < cfg.min_reuse_ops => format!(
                "its reuse distance of {} ops (op {} to op {}) is below the threshold of {} ops",
                g.ops_between, g.after_op, g.before_op, cfg.min_reuse_ops
            ),
            Some(g) => format!(
                "its reuse distance of {:.6} s (op {} to op {}) is below the threshold of {:.6} s",
                g.time_between_s,
                g.after_op,
                g.before_op,
                cfg.min_reuse_time_s.unwrap_or(0.0)
            ),
            None => "it is never used in the iteration".to_string(),
        }
    }

    fn no_plan(
        &self,
        trace: &Trace,
        an: &Analysis,
        absent: &[bool],
        op: usize,
        resident: u64,
    ) -> PlanError {
        let budget = self.config.budget_bytes;
        let uses = trace.uses(op);
        let blocker = an
            .tensors
            .iter()
            .filter(|l| l.live_at(op) && !absent[l.tensor.index()] && !uses.contains(&l.tensor))
            .max_by_key(|l| (l.bytes, std::cmp::Reverse(l.tensor)));
        match blocker {
            Some(l) => {
                let t = l.tensor;
                PlanError::NoPlan {
                    op,
                    op_name: trace.ops()[op].name.clone(),
                    tensor: t,
                    tensor_name: trace.tensor(t).name.clone(),
                    tensor_bytes: l.bytes,
                    resident,
                    budget,
                    reason: self.why_not(an, t.index(), op),
                }
            }
            None => PlanError::working_set_exceeded(trace, op, budget),
        }
    }

    /// Steps 1–2: candidates and selection. Returns the chosen round trips
    /// in need order (prefetches at their consumers) and the resident bytes
    /// per op with every chosen gap spent on the host.
    pub(super) fn select(
        &self,
        trace: &Trace,
        an: &Analysis,
    ) -> Result<(Vec<Trip>, Vec<u64>), PlanError> {
        let n = trace.num_ops();
        let budget = self.config.budget_bytes;
        if let Some(op) = (0..n).find(|&op| an.working_set_bytes[op] > budget) {
            return Err(PlanError::working_set_exceeded(trace, op, budget));
        }
        let cands = self.candidates_of(an);
        let mut r = an.resident_bytes.clone();
        let chosen = match self.config.selection {
            Selection::AllCandidates => {
                for c in &cands {
                    gap_ranges(&c.gap, n, |from, to| sub(&mut r, from, to, c.bytes));
                }
                let chosen = vec![true; cands.len()];
                if let Some(op) = (0..n).find(|&op| r[op] > budget) {
                    let absent = absent_at(trace, &cands, &chosen, op);
                    return Err(self.no_plan(trace, an, &absent, op, r[op]));
                }
                chosen
            }
            Selection::Needed => self.select_needed(trace, an, &cands, &mut r)?,
        };
        let mut trips: Vec<Trip> = cands
            .iter()
            .zip(&chosen)
            .filter(|(_, &on)| on)
            .map(|(c, _)| {
                let g = c.gap;
                Trip {
                    tensor: c.tensor.index(),
                    bytes: c.bytes,
                    a: g.after_op,
                    b: g.before_op,
                    wraps: g.wraps,
                    lo: if g.wraps { 0 } else { g.after_op + 1 },
                    p: g.before_op,
                    gap: g,
                }
            })
            .collect();
        trips.sort_by_key(|t| (t.b, t.a, t.tensor));
        Ok((trips, r))
    }

    /// [`Selection::Needed`]: wherever the resident bytes `r` exceed the
    /// budget, the candidate covering the op whose next use is farthest
    /// away (Belady's rule), until it fits; then every choice a later one
    /// made redundant is undone, largest first. Returns which candidates
    /// are chosen; `r` then counts them on the host.
    fn select_needed(
        &self,
        trace: &Trace,
        an: &Analysis,
        cands: &[Candidate],
        r: &mut [u64],
    ) -> Result<Vec<bool>, PlanError> {
        let n = trace.num_ops();
        let budget = self.config.budget_bytes;
        let mut chosen = vec![false; cands.len()];
        let mut order = Vec::new();
        for op in 0..n {
            while r[op] > budget {
                let dist = |g: &ReuseGap| {
                    if g.before_op > op {
                        g.before_op - op
                    } else {
                        n - op + g.before_op
                    }
                };
                let best = cands
                    .iter()
                    .enumerate()
                    .filter(|&(i, c)| !chosen[i] && c.gap.covers(op))
                    .max_by_key(|&(i, c)| (dist(&c.gap), c.bytes, std::cmp::Reverse(i)));
                let Some((i, c)) = best else {
                    let absent = absent_at(trace, cands, &chosen, op);
                    return Err(self.no_plan(trace, an, &absent, op, r[op]));
                };
                chosen[i] = true;
                order.push(i);
                gap_ranges(&c.gap, n, |from, to| sub(r, from, to, c.bytes));
            }
        }
        // Greedy choices made for early ops can be made redundant by later
        // ones: keep on the device, largest first, every chosen gap the
        // budget does not need.
        order.sort_by_key(|&i| (std::cmp::Reverse(cands[i].bytes), i));
        for i in order {
            let c = &cands[i];
            let mut fits = true;
            gap_ranges(&c.gap, n, |from, to| {
                fits &= r[from..to].iter().all(|&v| v + c.bytes <= budget);
            });
            if fits {
                chosen[i] = false;
                gap_ranges(&c.gap, n, |from, to| add(r, from, to, c.bytes));
            }
        }
        Ok(chosen)
    }
}

/// Calls `f(from, to)` for the op ranges a gap spends on the host when the
/// prefetch is issued at its consumer.
fn gap_ranges(g: &ReuseGap, n: usize, mut f: impl FnMut(usize, usize)) {
    if g.wraps {
        f(g.after_op + 1, n);
        f(0, g.before_op);
    } else {
        f(g.after_op + 1, g.before_op);
    }
}

/// Per tensor, whether a chosen candidate's gap has it on the host at op
/// `op`.
fn absent_at(trace: &Trace, cands: &[Candidate], chosen: &[bool], op: usize) -> Vec<bool> {
    let mut absent = vec![false; trace.num_tensors()];
    for (c, &on) in cands.iter().zip(chosen) {
        if on && c.gap.covers(op) {
            absent[c.tensor.index()] = true;
        }
    }
    absent
}
