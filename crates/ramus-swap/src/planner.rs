//! The AutoVM planner: which tensors leave the device, after which op, and
//! when they come back.
//!
//! The steps follow the thesis (chapter 3) with a device memory budget in
//! place of managed memory. Bytes are accounted per op: while op `k` runs,
//! the device holds every live tensor not on the host, plus every tensor
//! whose prefetch has been issued.
//!
//! 1. **Candidates** (Listing 3.1). Every gap between two consecutive uses of
//!    a tensor of an offloadable kind is a candidate if the tensor is at
//!    least [`PlannerConfig::size_threshold_bytes`] and the gap's reuse
//!    distance is at least [`PlannerConfig::min_reuse_ops`] ops (and
//!    [`PlannerConfig::min_reuse_time_s`] seconds, if set). For a CNN
//!    activation this is the gap between its last forward use and its first
//!    backward use; the offload is issued right after the op that opens the
//!    gap (Listing 3.2). Gaps of persistent tensors may wrap around the
//!    iteration boundary (optimizer state then lives on the host between
//!    updates).
//! 2. **Selection.** Walking the ops in order, wherever the bytes that must
//!    be resident exceed the budget, the candidate covering that op whose
//!    next use is farthest away (Belady's rule) is offloaded, until the op
//!    fits. Choices a later one made redundant are then undone, largest
//!    first. [`Selection::AllCandidates`] offloads every candidate instead,
//!    as the thesis does. An op that cannot fit is an error naming it, the
//!    tensor in the way (and why it cannot move) and the budget.
//! 3. **Earliest placement** (Listing 3.4). One tensor at a time, each
//!    prefetch is issued at the earliest op from which every op up to its
//!    consumer holds it within the budget, together with everything resident
//!    and every prefetch placed before it.
//! 4. **Reordering** (Fig. 3.5). The host→device stream is a FIFO, so a
//!    prefetch issued earlier for a later consumer delays one needed sooner
//!    (Fig. 3.4). Such pairs swap issue points where the budget permits;
//!    otherwise the later one is issued right after the sooner one. Copies
//!    then complete in the order they are needed.
//! 5. **Profiled placement** (Listing 3.3, the thesis' future work), with
//!    measured op times. Working back from the last consumer, each prefetch
//!    gets the latest op at which its copy — queued behind the prefetches
//!    needed before it — still completes before its consumer starts. In
//!    need order each then takes that op, or the first op after it where
//!    the budget holds it; a prefetch that was on time in step 4's
//!    placement is never issued earlier than there, one that was late may
//!    move earlier. The plan is replayed on the [`Simulator`] and
//!    prefetches that still arrive late are moved earlier where the budget
//!    allows. A profiled plan is never predicted to stall more than step
//!    4's; if it would, step 4's is kept and a note says so.
//!
//! 6. **Layout** ([`PlannerConfig::layout`]; see [`layout`](crate::layout)):
//!    every allocation gets a fixed offset in one arena of the budget less
//!    the persistent tensors, planning under a smaller budget where no
//!    layout fits; of the candidates, the one whose replay is fastest.
//!
//! The plan's prediction (peak memory, bytes each way, stall) comes from a
//! replay on the [`Simulator`] with the same cost model.

use crate::analysis::{analyze, Analysis, ReuseGap};
use crate::cost::{human_bytes, CostModel};
use crate::error::PlanError;
use crate::plan::{Action, Layout, OffloadDecision, Policy, SwapPlan};
use crate::sim::{Direction, SimReport, Simulator};
use crate::trace::{TensorId, TensorKind, Trace};
use serde::{Deserialize, Serialize};

/// Anything that turns a trace into a [`SwapPlan`]: the AutoVM planner and
/// the baselines.
pub trait Planner {
    /// Which policy the planner implements.
    fn policy(&self) -> Policy;
    /// Plans one iteration of `trace`.
    fn plan(&self, trace: &Trace) -> Result<SwapPlan, PlanError>;
}

/// How many candidates to offload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Selection {
    /// Only as many as the budget requires (farthest next use first).
    Needed,
    /// Every candidate, as the thesis does.
    AllCandidates,
}

/// How prefetches are placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PrefetchTiming {
    /// As early as the budget allows (Listing 3.4); op times not needed.
    Earliest,
    /// As late as measured op times allow (Listing 3.3); every op of the
    /// trace must carry a measured duration.
    Profiled,
    /// Profiled if every op has a measured duration, else earliest.
    Auto,
}

/// The order in which Listing 3.4 places prefetches. The greedy favours the
/// tensors placed first (thesis §3.3.2.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlacementOrder {
    /// The tensor needed soonest first: it gets first claim on memory.
    Need,
    /// The tensor offloaded first first, as the thesis iterates; later
    /// consumers then often get earlier slots, which step 4 reorders.
    Offload,
}

/// Settings of the AutoVM planner.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannerConfig {
    /// Device memory the iteration may use, bytes.
    pub budget_bytes: u64,
    /// Tensors smaller than this are never offloaded (Listing 3.1).
    pub size_threshold_bytes: u64,
    /// Gaps with fewer ops inside are never offloaded (Listing 3.1).
    pub min_reuse_ops: usize,
    /// Gaps shorter than this many (estimated) seconds are never offloaded.
    pub min_reuse_time_s: Option<f64>,
    /// Kinds of tensor that may be offloaded.
    pub offload_kinds: Vec<TensorKind>,
    /// How many candidates to offload.
    pub selection: Selection,
    /// How prefetches are placed.
    pub timing: PrefetchTiming,
    /// The order of the earliest placement (Listing 3.4).
    pub placement_order: PlacementOrder,
    /// Whether to reorder prefetches that would complete out of order.
    pub reorder_prefetches: bool,
    /// Copy and op times.
    pub cost: CostModel,
    /// Lay the iteration out (see [`layout`](crate::layout)): fix every
    /// allocation's offset in one arena of the budget less the persistent
    /// tensors, planning under a smaller budget until the layout fits.
    /// Persistent tensors must then stay resident (no persistent kind in
    /// [`PlannerConfig::offload_kinds`]).
    #[serde(default)]
    pub layout: bool,
}

impl PlannerConfig {
    /// Defaults for a budget: 1 MiB size threshold; reuse distance of at
    /// least 2 ops (the thesis' default skips the last two layers'
    /// outputs); every kind but workspaces offloadable (the thesis keeps
    /// weights resident as ≈ 1 % of memory; here selection only offloads
    /// what the budget needs, and VGG's 400 MB fc6 weight can be what makes
    /// Nm = 2 fit); only as many offloads as needed; profiled placement when
    /// the trace has op times; PCIe 3.0 costs.
    pub fn new(budget_bytes: u64) -> PlannerConfig {
        PlannerConfig {
            budget_bytes,
            size_threshold_bytes: 1 << 20,
            min_reuse_ops: 2,
            min_reuse_time_s: None,
            offload_kinds: vec![
                TensorKind::Parameter,
                TensorKind::Activation,
                TensorKind::Gradient,
                TensorKind::OptimizerState,
            ],
            selection: Selection::Needed,
            timing: PrefetchTiming::Auto,
            placement_order: PlacementOrder::Need,
            reorder_prefetches: true,
            cost: CostModel::default(),
            layout: false,
        }
    }

    fn validate(&self) -> Result<(), PlanError> {
        self.cost.validate().map_err(PlanError::Config)?;
        if self.layout {
            if let Some(k) = self.offload_kinds.iter().find(|k| k.is_persistent()) {
                return Err(PlanError::Config(format!(
                    "a memory layout places the iteration's own tensors; {} tensors are \
                     persistent and cannot be offloaded with one (remove them from offload_kinds)",
                    k.label()
                )));
            }
        }
        if let Some(t) = self.min_reuse_time_s {
            if !(t.is_finite() && t >= 0.0) {
                return Err(PlanError::Config(format!(
                    "min_reuse_time_s must be finite and non-negative, got {t}"
                )));
            }
        }
        Ok(())
    }
}

/// One offload candidate: a tensor and a gap between two of its uses.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// The tensor.
    pub tensor: TensorId,
    /// Its size.
    pub bytes: u64,
    /// The gap it would spend on the host.
    pub gap: ReuseGap,
}

/// The AutoVM planner.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoVmPlanner {
    /// Its settings.
    pub config: PlannerConfig,
}

/// A selected round trip while planning.
#[derive(Clone, Debug)]
struct Trip {
    tensor: usize,
    bytes: u64,
    /// Offload after this op.
    a: usize,
    /// Needed by this op.
    b: usize,
    wraps: bool,
    /// Earliest possible issue point.
    lo: usize,
    /// Issue point (prefetch before this op).
    p: usize,
    gap: ReuseGap,
}

/// Adds `bytes` to `r[from..to]`.
fn add(r: &mut [u64], from: usize, to: usize, bytes: u64) {
    for x in &mut r[from..to] {
        *x += bytes;
    }
}

/// Subtracts `bytes` from `r[from..to]`.
fn sub(r: &mut [u64], from: usize, to: usize, bytes: u64) {
    for x in &mut r[from..to] {
        *x -= bytes;
    }
}

impl AutoVmPlanner {
    /// A planner with these settings.
    pub fn new(config: PlannerConfig) -> AutoVmPlanner {
        AutoVmPlanner { config }
    }

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
    fn select(&self, trace: &Trace, an: &Analysis) -> Result<(Vec<Trip>, Vec<u64>), PlanError> {
        let n = trace.num_ops();
        let budget = self.config.budget_bytes;
        if let Some(op) = (0..n).find(|&op| an.working_set_bytes[op] > budget) {
            return Err(PlanError::working_set_exceeded(trace, op, budget));
        }
        let cands = self.candidates_of(an);
        let mut r = an.resident_bytes.clone();
        let mut chosen = vec![false; cands.len()];
        let absent_at = |op: usize, chosen: &[bool]| -> Vec<bool> {
            let mut absent = vec![false; trace.num_tensors()];
            for (c, &on) in cands.iter().zip(chosen) {
                if on && c.gap.covers(op) {
                    absent[c.tensor.index()] = true;
                }
            }
            absent
        };
        match self.config.selection {
            Selection::AllCandidates => {
                for (i, c) in cands.iter().enumerate() {
                    chosen[i] = true;
                    gap_ranges(&c.gap, n, |from, to| sub(&mut r, from, to, c.bytes));
                }
                if let Some(op) = (0..n).find(|&op| r[op] > budget) {
                    let absent = absent_at(op, &chosen);
                    return Err(self.no_plan(trace, an, &absent, op, r[op]));
                }
            }
            Selection::Needed => {
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
                        match best {
                            Some((i, c)) => {
                                chosen[i] = true;
                                order.push(i);
                                gap_ranges(&c.gap, n, |from, to| sub(&mut r, from, to, c.bytes));
                            }
                            None => {
                                let absent = absent_at(op, &chosen);
                                return Err(self.no_plan(trace, an, &absent, op, r[op]));
                            }
                        }
                    }
                }
                // Greedy choices made for early ops can be made redundant
                // by later ones: keep on the device, largest first, every
                // chosen gap the budget does not need.
                order.sort_by_key(|&i| (std::cmp::Reverse(cands[i].bytes), i));
                for i in order {
                    let c = &cands[i];
                    let mut fits = true;
                    gap_ranges(&c.gap, n, |from, to| {
                        fits &= r[from..to].iter().all(|&v| v + c.bytes <= budget);
                    });
                    if fits {
                        chosen[i] = false;
                        gap_ranges(&c.gap, n, |from, to| add(&mut r, from, to, c.bytes));
                    }
                }
            }
        }
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

    /// Step 3 (Listing 3.4): one tensor at a time (in need order, or in
    /// offload order as the thesis does), each prefetch as early as the
    /// budget allows. Returns the planned profile.
    fn place_earliest(&self, trips: &mut [Trip], r_off: &[u64]) -> Vec<u64> {
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
    fn reorder(&self, trips: &mut [Trip], r: &mut [u64]) {
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
    fn place_profiled(&self, trips: &mut [Trip], r_off: &[u64], an: &Analysis, floor: &[usize]) {
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

    fn build(&self, trace: &Trace, an: &Analysis, trips: &[Trip], policy: Policy) -> SwapPlan {
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

    fn simulate(&self, trace: &Trace, plan: &SwapPlan) -> Result<SimReport, PlanError> {
        Ok(Simulator::new(self.config.cost, plan.budget_bytes).run(trace, plan)?)
    }

    /// For each round trip (in need order), whether its prefetch made its
    /// consumer wait in this replay.
    fn late_in(plan: &SwapPlan, rep: &SimReport, trips: &[Trip]) -> Vec<bool> {
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
    fn refine(
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

impl Planner for AutoVmPlanner {
    fn policy(&self) -> Policy {
        match self.config.timing {
            PrefetchTiming::Earliest => Policy::AutoVmEarliest,
            _ => Policy::AutoVmProfiled,
        }
    }

    fn plan(&self, trace: &Trace) -> Result<SwapPlan, PlanError> {
        self.config.validate()?;
        if self.config.layout {
            self.plan_laid_out(trace)
        } else {
            Ok(self.plan_with_replay(trace)?.0)
        }
    }
}

/// Laying out never tries more planning budgets than this, nor more than
/// the second for a layout that holds memory until copies complete once
/// one that does not was found.
const MAX_LAYOUT_ATTEMPTS: usize = 12;
const MAX_EXTRA_LAYOUT_ATTEMPTS: usize = 4;

impl AutoVmPlanner {
    /// Step 6 (see [`layout`](crate::layout)): plans and lays the plan
    /// out holding offloaded memory until the replay finds the copy
    /// complete; while no layout fits, also holding it for half, a quarter
    /// or none of the copy (the reuse then waits for the copy on the
    /// device). While nothing fits, or for a few more attempts until a
    /// layout holding memory for the whole copy does, plans again under a
    /// smaller budget: smaller by the excess (at least 0.1 % of the
    /// budget), doubling with every attempt as the arena need not shrink
    /// with the budget at once, and halfway back up to the last budget that
    /// did not lay out once one is too small to plan for at all. Of the
    /// candidates, replayed with their layout, the fastest is kept. A
    /// profiled placement that cannot be laid out falls back to the
    /// earliest placement.
    fn plan_laid_out(&self, trace: &Trace) -> Result<SwapPlan, PlanError> {
        match self.lay_out(trace, &self.config) {
            Err(e @ PlanError::LayoutDoesNotFit { .. })
                if self.config.timing != PrefetchTiming::Earliest =>
            {
                let earliest = PlannerConfig {
                    timing: PrefetchTiming::Earliest,
                    ..self.config.clone()
                };
                match self.lay_out(trace, &earliest) {
                    Ok(mut plan) => {
                        plan.notes.push(format!(
                            "the profiled placement could not be laid out ({e}); the earliest \
                             placement is kept"
                        ));
                        Ok(plan)
                    }
                    Err(_) => Err(e),
                }
            }
            other => other,
        }
    }

    /// [`AutoVmPlanner::plan_laid_out`] with settings `cfg`.
    fn lay_out(&self, trace: &Trace, cfg: &PlannerConfig) -> Result<SwapPlan, PlanError> {
        let persistent = trace.persistent_bytes();
        let arena = cfg.budget_bytes.saturating_sub(persistent);
        let min_step = (cfg.budget_bytes / 1024).max(1);
        let mut budget = cfg.budget_bytes;
        // the smallest budget known not to lay out with memory held until
        // copies complete, the largest known to be too small to plan for
        let mut too_large = cfg.budget_bytes;
        let mut too_small: Option<(u64, PlanError)> = None;
        let mut last = None;
        // the fastest laid-out plan so far (predicted), with its hold and
        // planning budget, and how many plans were made since the first
        let mut best: Option<(SwapPlan, f64, u64)> = None;
        let mut since_first = 0;
        for attempt in 0..MAX_LAYOUT_ATTEMPTS {
            let inner = AutoVmPlanner::new(PlannerConfig {
                budget_bytes: budget,
                layout: false,
                ..cfg.clone()
            });
            let (plan, replay) = match inner.plan_with_replay(trace) {
                Ok(p) => p,
                Err(e) if attempt == 0 => return Err(e),
                Err(e) => {
                    too_small = Some((budget, e));
                    budget = budget + (too_large - budget) / 2;
                    if too_large - budget < min_step {
                        break;
                    }
                    continue;
                }
            };
            // Offloaded memory held until the replay's copy completes; as
            // long as no layout fits yet, also shorter (the reuse waits
            // for the copy it overwrites). The candidates are replayed
            // with their layout and the fastest is kept: waiting for some
            // copies can beat more copies under a smaller budget, and the
            // other way round.
            let mut smallest = u64::MAX;
            let holds: &[f64] = if best.is_none() {
                &[1.0, 0.5, 0.25, 0.0]
            } else {
                &[1.0]
            };
            let mut held_fits = false;
            for &hold in holds {
                let layout = Layout::within(trace, &plan, Some(&replay), hold, arena)?;
                smallest = smallest.min(layout.arena_bytes);
                if layout.arena_bytes > arena {
                    continue;
                }
                let mut laid = plan.clone();
                laid.layout = Some(layout);
                let rep = self.simulate(trace, &laid)?;
                laid.predicted = rep.prediction();
                let faster = best
                    .as_ref()
                    .is_none_or(|(b, _, _)| rep.total_s < b.predicted.total_s);
                if faster {
                    best = Some((laid, hold, budget));
                }
                if hold == 1.0 {
                    held_fits = true;
                    break; // nothing waits for a copy: as good as this budget gets
                }
            }
            if held_fits {
                break; // smaller budgets only copy more
            }
            if best.is_some() {
                since_first += 1;
                if since_first > MAX_EXTRA_LAYOUT_ATTEMPTS {
                    break;
                }
            }
            last = Some(smallest);
            too_large = budget;
            budget = match &too_small {
                Some((small, _)) => small + (too_large - small) / 2,
                None => {
                    let step = smallest.saturating_sub(arena).max(min_step);
                    budget.saturating_sub(step.saturating_mul(1 << attempt.min(16)))
                }
            };
            if too_large - budget < min_step {
                break;
            }
        }
        if let Some((mut plan, hold, planned_for)) = best {
            if hold < 1.0 {
                plan.notes.push(format!(
                    "offloaded memory is reused after {:.0} % of its copy's predicted time (the \
                     reuse waits for the copy on the device) so that the layout fits",
                    hold * 100.0
                ));
            }
            if planned_for < cfg.budget_bytes {
                plan.notes.push(format!(
                    "planned for {} so that the layout fits the {} the budget leaves the \
                     iteration's tensors",
                    human_bytes(planned_for),
                    human_bytes(arena)
                ));
            }
            return Ok(plan);
        }
        Err(PlanError::LayoutDoesNotFit {
            arena,
            laid_out: last.unwrap_or(0),
            budget: cfg.budget_bytes,
            reason: match too_small {
                Some((small, e)) => format!(
                    "a planning budget of {small} bytes ({}) is too small: {e}",
                    human_bytes(small)
                ),
                None => format!("no layout fitted after {MAX_LAYOUT_ATTEMPTS} plans"),
            },
        })
    }

    /// Steps 1–5 and the replay of the plan they make.
    fn plan_with_replay(&self, trace: &Trace) -> Result<(SwapPlan, SimReport), PlanError> {
        let cfg = &self.config;
        let profiled = match cfg.timing {
            PrefetchTiming::Earliest => false,
            PrefetchTiming::Auto => trace.has_durations(),
            PrefetchTiming::Profiled => {
                if let Some((op, o)) = trace
                    .ops()
                    .iter()
                    .enumerate()
                    .find(|(_, o)| o.duration_s.is_none())
                {
                    return Err(PlanError::MissingDuration {
                        op,
                        op_name: o.name.clone(),
                    });
                }
                true
            }
        };
        let an = analyze(trace, &cfg.cost);
        let (mut trips, r_off) = self.select(trace, &an)?;
        let mut r = self.place_earliest(&mut trips, &r_off);
        if cfg.reorder_prefetches {
            self.reorder(&mut trips, &mut r);
        }
        let mut plan = self.build(trace, &an, &trips, Policy::AutoVmEarliest);
        let mut rep = self.simulate(trace, &plan)?;
        if profiled {
            // Prefetches that were on time stay at or after their earliest
            // placement; late ones may move earlier.
            let late = Self::late_in(&plan, &rep, &trips);
            let floor: Vec<usize> = trips
                .iter()
                .zip(&late)
                .map(|(t, &l)| if l { t.lo } else { t.p })
                .collect();
            let mut alap = trips.clone();
            self.place_profiled(&mut alap, &r_off, &an, &floor);
            let (p2, rep2) = self.refine(trace, &an, &mut alap, &floor, &r_off)?;
            if rep2.stall_s <= rep.stall_s * (1.0 + 1e-9) + 1e-12 {
                plan = p2;
                rep = rep2;
            } else {
                plan.policy = Policy::AutoVmProfiled;
                plan.notes.push(format!(
                    "profiled placement predicted {:.6} s of stall against {:.6} s for the \
                     earliest placement; the earliest placement is kept",
                    rep2.stall_s, rep.stall_s
                ));
            }
        }
        plan.predicted = rep.prediction();
        if cfg.selection == Selection::AllCandidates {
            plan.notes
                .push("every candidate is offloaded (thesis behaviour)".to_string());
        }
        if plan.actions.is_empty() {
            plan.notes.push(format!(
                "the iteration fits in {} without swapping",
                human_bytes(cfg.budget_bytes)
            ));
        }
        Ok((plan, rep))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Phase, TraceBuilder};

    /// A chain of `k` forward layers and their backward, every activation
    /// `mib` MiB, each op 1 ms.
    fn chain(k: usize, mib: u64) -> Trace {
        let mut b = TraceBuilder::new();
        let mut acts = vec![b.tensor("x0", mib << 20, TensorKind::Activation)];
        for i in 0..k {
            let y = b.tensor(format!("y{}", i + 1), mib << 20, TensorKind::Activation);
            b.timed_op(
                format!("f{}", i + 1),
                Phase::Forward,
                &[acts[i]],
                &[y],
                1e-3,
            );
            acts.push(y);
        }
        let mut d = b.tensor(format!("d{k}"), mib << 20, TensorKind::Gradient);
        b.timed_op("loss", Phase::Forward, &[acts[k]], &[d], 1e-3);
        for i in (0..k).rev() {
            let dx = b.tensor(format!("d{i}"), mib << 20, TensorKind::Gradient);
            b.timed_op(
                format!("b{}", i + 1),
                Phase::Backward,
                &[d, acts[i], acts[i + 1]],
                &[dx],
                1e-3,
            );
            d = dx;
        }
        b.build().unwrap()
    }

    #[test]
    fn fits_without_swapping_when_the_budget_allows() {
        let t = chain(6, 10);
        let an = analyze(&t, &CostModel::default());
        let plan = AutoVmPlanner::new(PlannerConfig::new(an.peak_bytes))
            .plan(&t)
            .unwrap();
        assert!(plan.actions.is_empty());
        assert_eq!(plan.predicted.peak_bytes, an.peak_bytes);
    }

    #[test]
    fn needed_selection_fits_the_budget() {
        let t = chain(8, 10);
        let an = analyze(&t, &CostModel::default());
        let budget = an.peak_bytes * 6 / 10;
        let mut cfg = PlannerConfig::new(budget);
        cfg.timing = PrefetchTiming::Earliest;
        let plan = AutoVmPlanner::new(cfg).plan(&t).unwrap();
        assert!(!plan.actions.is_empty());
        assert!(plan.predicted.peak_bytes <= budget);
        // The earliest activations (needed last) leave first.
        assert_eq!(plan.offloads[0].name, "x0");
    }

    #[test]
    fn impossible_budget_names_op_tensor_and_budget() {
        let t = chain(4, 10);
        let e = AutoVmPlanner::new(PlannerConfig::new(25 << 20))
            .plan(&t)
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            matches!(e, PlanError::WorkingSetExceedsBudget { .. }),
            "{msg}"
        );
        assert!(msg.contains("`loss`") || msg.contains("`b"), "{msg}");
        assert!(msg.contains(&(25u64 << 20).to_string()), "{msg}");
    }
}
