//! Steps 3–5: where each selected round trip's prefetch is issued —
//! earliest (Listing 3.4), reordered (Fig. 3.5) or profiled (Listing 3.3,
//! refined by replays) — and the plan they make.

use super::config::PlacementOrder;
use super::select::{add, sub, Trip};
use super::AutoVmPlanner;
use crate::analysis::Analysis;
use crate::error::PlanError;
use crate::plan::{Action, OffloadDecision, Policy, SwapPlan};
use crate::sim::{Direction, SimReport};
use crate::trace::{TensorId, Trace};

impl AutoVmPlanner {
    /// Step 3 (Listing 3.4): one tensor at a time (in need order, or in
    /// offload order as the thesis does), each prefetch as early as the
    /// budget allows. Returns the planned profile.
    pub(super) fn place_earliest(&self, trips: &mut [Trip], r_off: &[u64]) -> Vec<u64> {
        let budget = self.config.budget_bytes;
        let mut r = r_off.to_vec();
        let mut idx: Vec<usize> = (0..trips.len()).collect();
        if self.config.placement_order == PlacementOrder::Offload {
            idx.sort_by_key(|&i| (trips[i].a, trips[i].tensor));
        }
        for i in idx {
            let t = &mut trips[i];
            let mut p = t.b;
            while p > t.lo && r[p - 1] + t.bytes <= budget {
                p -= 1;
            }
            t.p = p;
            add(&mut r, p, t.b, t.bytes);
        }
        r
    }

    /// Step 4 (Fig. 3.5): make issue order follow need order.
    pub(super) fn reorder(&self, trips: &mut [Trip], r: &mut [u64]) {
        let budget = self.config.budget_bytes;
        for i in 1..trips.len() {
            let mut j = i;
            while j > 0 && trips[j - 1].p > trips[j].p {
                let (px, py) = (trips[j - 1].p, trips[j].p);
                let (bx, by) = (trips[j - 1].bytes, trips[j].bytes);
                // Swap: the one needed sooner takes the earlier slot.
                let swap_ok = py >= trips[j - 1].lo
                    && (bx <= by || r[py..px].iter().all(|&v| v - by + bx <= budget));
                if swap_ok {
                    sub(r, py, px, by);
                    add(r, py, px, bx);
                    trips[j - 1].p = py;
                    trips[j].p = px;
                    j -= 1;
                } else {
                    // Issue the later one right after the sooner one.
                    sub(r, py, px, by);
                    trips[j].p = px;
                    break;
                }
            }
        }
    }

    /// Step 5 (Listing 3.3). Timing: from the latest-needed prefetch
    /// backwards, each as late as the measured op times allow while its
    /// copy — queued on the stream ahead of the ones needed after it — still
    /// completes before its consumer. Memory: in need order (the prefetch
    /// needed sooner has the first claim), each at that target but never
    /// earlier than `floor` or than the prefetch needed before it, and only
    /// from an op on which the budget holds it.
    pub(super) fn place_profiled(
        &self,
        trips: &mut [Trip],
        r_off: &[u64],
        an: &Analysis,
        floor: &[usize],
    ) {
        let budget = self.config.budget_bytes;
        let s = &an.op_start_s;
        let mut target = vec![0; trips.len()];
        let mut next_start = f64::INFINITY;
        for (i, t) in trips.iter().enumerate().rev() {
            let start = s[t.b].min(next_start) - self.config.cost.h2d_time(t.bytes);
            // Latest k in [lo, b] with s[k] <= start.
            let k = s[t.lo..=t.b].partition_point(|&v| v <= start);
            target[i] = if k == 0 { t.lo } else { t.lo + k - 1 };
            next_start = start.max(s[target[i]]);
        }
        let mut r = r_off.to_vec();
        let mut prev = 0;
        for (i, t) in trips.iter_mut().enumerate() {
            let mut p = target[i].max(floor[i]).max(prev).min(t.b);
            if let Some(last) = (p..t.b).rev().find(|&op| r[op] + t.bytes > budget) {
                p = last + 1;
            }
            t.p = p;
            add(&mut r, p, t.b, t.bytes);
            prev = p;
        }
    }

    pub(super) fn build(
        &self,
        trace: &Trace,
        an: &Analysis,
        trips: &[Trip],
        policy: Policy,
    ) -> SwapPlan {
        let name = |t: usize| trace.tensors()[t].name.clone();
        // (sort key, action); trips are in need order, which orders
        // prefetches issued at the same op.
        let mut keyed: Vec<((usize, usize), Action)> = Vec::with_capacity(2 * trips.len());
        for (i, t) in trips.iter().enumerate() {
            let off = Action::Offload {
                tensor: TensorId(t.tensor as u32),
                name: name(t.tensor),
                bytes: t.bytes,
                after_op: t.a,
            };
            keyed.push(((off.position(), t.tensor), off));
            let pre = Action::Prefetch {
                tensor: TensorId(t.tensor as u32),
                name: name(t.tensor),
                bytes: t.bytes,
                issue_before_op: t.p,
                needed_by_op: t.b,
            };
            keyed.push(((pre.position(), i), pre));
        }
        keyed.sort_by_key(|(k, _)| *k);
        let mut homed: Vec<TensorId> = trips
            .iter()
            .filter(|t| t.wraps)
            .map(|t| TensorId(t.tensor as u32))
            .collect();
        homed.sort();
        homed.dedup();
        let mut offloads: Vec<OffloadDecision> = trips
            .iter()
            .map(|t| OffloadDecision {
                tensor: TensorId(t.tensor as u32),
                name: name(t.tensor),
                bytes: t.bytes,
                offload_after_op: t.a,
                prefetch_before_op: t.p,
                needed_by_op: t.b,
                wraps: t.wraps,
                reuse_ops: t.gap.ops_between,
                reuse_time_s: t.gap.time_between_s,
            })
            .collect();
        offloads.sort_by_key(|o| (o.offload_after_op, o.tensor));
        SwapPlan {
            policy,
            budget_bytes: Some(self.config.budget_bytes),
            unplanned_peak_bytes: an.peak_bytes,
            num_ops: trace.num_ops(),
            host_resident_at_start: homed,
            actions: keyed.into_iter().map(|(_, a)| a).collect(),
            offloads,
            predicted: Default::default(),
            notes: Vec::new(),
            layout: None,
        }
    }

    /// For each round trip (in need order), whether its prefetch made its
    /// consumer wait in this replay.
    pub(super) fn late_in(plan: &SwapPlan, rep: &SimReport, trips: &[Trip]) -> Vec<bool> {
        let mut late = vec![false; trips.len()];
        for rec in &rep.transfers {
            if rec.direction != Direction::ToDevice || rec.wait_s <= 0.0 {
                continue;
            }
            if let Some(Action::Prefetch { needed_by_op, .. }) = plan.actions.get(rec.action) {
                if let Some(i) = trips
                    .iter()
                    .position(|t| t.tensor == rec.tensor.index() && t.b == *needed_by_op)
                {
                    late[i] = true;
                }
            }
        }
        late
    }

    /// Replays the plan and moves prefetches that arrive late earlier
    /// (never below `floor`, never before the prefetch needed before them,
    /// only where the budget holds them); repeats until nothing improves.
    pub(super) fn refine(
        &self,
        trace: &Trace,
        an: &Analysis,
        trips: &mut [Trip],
        floor: &[usize],
        r_off: &[u64],
    ) -> Result<(SwapPlan, SimReport), PlanError> {
        const EPS: f64 = 1e-12;
        const MAX_PASSES: usize = 64;
        let budget = self.config.budget_bytes;
        let mut pass = 0;
        loop {
            let plan = self.build(trace, an, trips, Policy::AutoVmProfiled);
            let rep = self.simulate(trace, &plan)?;
            pass += 1;
            if pass >= MAX_PASSES {
                return Ok((plan, rep));
            }
            let mut r = r_off.to_vec();
            for t in trips.iter() {
                add(&mut r, t.p, t.b, t.bytes);
            }
            let recs: Vec<_> = rep
                .transfers
                .iter()
                .filter(|r| r.direction == Direction::ToDevice)
                .collect();
            let mut moved = vec![false; trips.len()];
            let mut any = false;
            for q in 0..recs.len() {
                let late = recs[q].wait_s;
                if late <= EPS {
                    continue;
                }
                // Walk back over copies that started only when the one
                // before them finished: the head of that chain decides.
                let mut j = q;
                while j > 0
                    && recs[j].start_s > recs[j].issue_s + EPS
                    && (recs[j].start_s - recs[j - 1].end_s).abs() <= EPS
                {
                    j -= 1;
                }
                let head = recs[j];
                if head.start_s > head.issue_s + EPS {
                    continue; // waiting for its own offload or for memory
                }
                let Some(Action::Prefetch { needed_by_op, .. }) = plan.actions.get(head.action)
                else {
                    continue;
                };
                let Some(i) = trips
                    .iter()
                    .position(|t| t.tensor == head.tensor.index() && t.b == *needed_by_op)
                else {
                    continue;
                };
                if moved[i] {
                    continue;
                }
                let old = trips[i].p;
                let mut lower = floor[i];
                if i > 0 {
                    lower = lower.max(trips[i - 1].p);
                }
                // Not below an op that cannot hold it as well.
                if let Some(last) = (lower..old)
                    .rev()
                    .find(|&op| r[op] + trips[i].bytes > budget)
                {
                    lower = last + 1;
                }
                if old <= lower {
                    continue;
                }
                let target = head.issue_s - late;
                let k = rep.op_start_s[lower..old].partition_point(|&v| v <= target + EPS);
                let p = if k == 0 { lower } else { lower + k - 1 };
                add(&mut r, p, old, trips[i].bytes);
                trips[i].p = p;
                moved[i] = true;
                any = true;
            }
            if !any {
                return Ok((plan, rep));
            }
        }
    }
}
