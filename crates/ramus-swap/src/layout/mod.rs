//! Memory layout: where in device memory each tensor of a swap
//! plan lives.
//!
//! A plan that keeps the bytes resident at every op within the budget can
//! still fail on a real device: an allocator that frees blocks one by one
//! (the CUDA pool's best-fit [`OffsetAllocator`](crate::OffsetAllocator))
//! fragments its memory as tensors of many sizes come and go, offload and
//! come back, until a large tensor finds no free range although more than
//! enough bytes are free in all. Rather than hoping the allocator does
//! well, the planner fixes every address ahead of time, as SwapAdvisor
//! (Huang et al., ASPLOS 2020) plans memory allocation together with
//! swapping: the iteration's tensors live in one **arena**, and a
//! [`Layout`] gives each allocation of each tensor (its first use, and each
//! prefetch) an offset in it.
//!
//! * **Blocks.** Walking the plan in the executor's own order, each
//!   allocation opens a [`Block`](crate::Block) *from* an op (the op whose first use or
//!   prefetch allocates it) *until* the op from which its memory may be
//!   reused: the op after its last use, or — for an offloaded tensor — the
//!   op whose allocations the planner's replay found its copy complete
//!   ([`TransferRecord::released_before_op`](crate::TransferRecord)). An
//!   executor that reuses the memory before the copy is known complete
//!   orders the new tensor's writes after the copy on the device (an event
//!   wait, not a host wait), so a slower link costs a short stall, never
//!   corrupt data.
//! * **Packing.** Two blocks whose lifetimes overlap must not overlap in
//!   memory; within that, offsets are chosen to keep the arena small. This
//!   is dynamic storage allocation (NP-hard in general); the greedy
//!   heuristics used for static memory planning of neural networks — place
//!   the largest blocks first, each at the lowest (first fit) or tightest
//!   (best fit) gap among the blocks it coexists with, and keep the best of
//!   a few orders — followed by a local search that moves the block on top
//!   of the arena earlier in the order, come within a few percent of the
//!   lower bound, the most bytes live at once ([`Layout::max_live_bytes`]).
//!   Offloaded memory may be held for only part of its copy's predicted
//!   time (`hold`); the packer then still avoids such memory wherever the
//!   arena allows, so that few reuses wait.
//! * **Planner loop.** With [`PlannerConfig::layout`](crate::PlannerConfig)
//!   the planner lays out each plan it makes within the budget less the
//!   persistent tensors (which keep their own memory): holding offloaded
//!   memory until its copy completes or, while nothing fits, for less of
//!   the copy; else it plans again under a smaller budget (more copies).
//!   Candidates are replayed on the [`Simulator`](crate::Simulator) with
//!   their layout — each reuse waiting for the copy it overwrites — and
//!   the fastest is kept.
//!
//! [`Layout::check`] verifies a layout against its trace and plan; the
//! executor follows it (see [`exec`](crate::exec)) and the simulated device
//! checks every block for overlaps.
//!
//! The code: this file finds the blocks a plan allocates and checks a
//! layout; `pack.rs` packs the blocks.

mod pack;

use crate::error::LayoutError;
use crate::plan::{Action, Layout, SwapPlan};
use crate::sim::{Direction, SimReport};
use crate::trace::Trace;
use pack::{pack_with, Span};
use std::collections::BTreeMap;

impl Layout {
    /// Lays out `plan` for `trace`: the blocks of every allocation the
    /// executor makes (persistent tensors excluded: they keep their own
    /// memory), packed as tightly as the heuristics manage. An offloaded
    /// tensor's memory is reusable from the op after its offload is issued
    /// plus `hold` (0 to 1) of the ops until `replay` (the planner's replay
    /// of this plan) found the copy complete: with `hold` 1 no reuse is
    /// expected to wait for a copy; with 0 (or no replay) memory is reused
    /// soonest, each reuse waiting on the device for the copy still
    /// reading it.
    pub fn of(
        trace: &Trace,
        plan: &SwapPlan,
        replay: Option<&SimReport>,
        hold: f64,
    ) -> Result<Layout, LayoutError> {
        let spans = spans(trace, plan, replay, hold)?;
        Ok(pack_with(&spans, 0, false))
    }

    /// [`Layout::of`], searching no further for a smaller arena once it
    /// fits in `arena_bytes`; with `hold` below 1, memory an offload may
    /// still read (by the replay) is reused only where no other range fits
    /// without raising the arena, so that few reuses wait for a copy.
    pub fn within(
        trace: &Trace,
        plan: &SwapPlan,
        replay: Option<&SimReport>,
        hold: f64,
        arena_bytes: u64,
    ) -> Result<Layout, LayoutError> {
        let spans = spans(trace, plan, replay, hold)?;
        let soft = hold < 1.0 && spans.iter().any(|s| s.soft_until > s.until);
        Ok(pack_with(&spans, arena_bytes, soft))
    }

    /// Checks that the layout places exactly the allocations the executor
    /// makes for `plan` (same tensors, sizes and order, each from the op
    /// that allocates it and at least until the op after its last use or
    /// its offload), inside the arena, and that blocks alive at the same
    /// time never share bytes.
    pub fn check(&self, trace: &Trace, plan: &SwapPlan) -> Result<(), LayoutError> {
        let expected = spans(trace, plan, None, 0.0)?;
        if expected.len() != self.blocks.len() {
            return Err(LayoutError(format!(
                "the plan makes {} allocations, the layout places {}",
                expected.len(),
                self.blocks.len()
            )));
        }
        for (i, (s, b)) in expected.iter().zip(&self.blocks).enumerate() {
            let name = &trace.tensors()[s.tensor].name;
            if b.tensor.index() != s.tensor || b.bytes != s.bytes || b.from_op != s.from {
                return Err(LayoutError(format!(
                    "allocation {i} is t{} `{name}` ({} bytes) before op {}; the layout places \
                     {} ({} bytes) from op {}",
                    s.tensor, s.bytes, s.from, b.tensor, b.bytes, b.from_op
                )));
            }
            // `spans` without a replay ends offloaded blocks right after
            // the offload: the earliest a layout may end them
            if b.until_op < s.until || b.until_op > trace.num_ops() {
                return Err(LayoutError(format!(
                    "block {i} of t{} `{name}` ends before op {}; it is in use until op {}",
                    s.tensor, b.until_op, s.until
                )));
            }
            if b.end() > self.arena_bytes {
                return Err(LayoutError(format!(
                    "block {i} of t{} `{name}` ends at byte {}, past the arena's {}",
                    s.tensor,
                    b.end(),
                    self.arena_bytes
                )));
            }
        }
        // sweep over ops: blocks alive at once, ordered by offset
        let mut by_from: Vec<usize> = (0..self.blocks.len()).collect();
        by_from.sort_by_key(|&i| self.blocks[i].from_op);
        let mut alive: BTreeMap<(u64, usize), usize> = BTreeMap::new();
        let mut next = 0;
        for op in 0..=trace.num_ops() {
            alive.retain(|_, &mut i| self.blocks[i].until_op > op);
            while next < by_from.len() && self.blocks[by_from[next]].from_op == op {
                let i = by_from[next];
                let b = &self.blocks[i];
                let below = alive.range(..(b.offset, usize::MAX)).next_back();
                let above = alive.range((b.offset, 0)..).next();
                for &(_, &j) in below.iter().chain(above.iter()) {
                    let other = &self.blocks[j];
                    if j != i && b.overlaps(other) && b.coexists_with(other) {
                        return Err(LayoutError(format!(
                            "blocks {j} ({} at {}..{}, ops {}..{}) and {i} ({} at {}..{}, ops \
                             {}..{}) overlap",
                            other.tensor,
                            other.offset,
                            other.end(),
                            other.from_op,
                            other.until_op,
                            b.tensor,
                            b.offset,
                            b.end(),
                            b.from_op,
                            b.until_op
                        )));
                    }
                }
                alive.insert((b.offset, i), i);
                next += 1;
            }
        }
        Ok(())
    }
}

/// The allocations the executor makes for `plan`, in its order; an
/// offloaded block ends `hold` of the way from the op after its offload to
/// where `replay` found the copy complete (see [`Layout::of`]).
fn spans(
    trace: &Trace,
    plan: &SwapPlan,
    replay: Option<&SimReport>,
    hold: f64,
) -> Result<Vec<Span>, LayoutError> {
    let n = trace.num_ops();
    if plan.num_ops != n {
        return Err(LayoutError(format!(
            "the plan is for {} ops, the trace has {n}",
            plan.num_ops
        )));
    }
    let nt = trace.num_tensors();
    let released = released_before(plan, replay);
    let at = actions_by_position(trace, plan)?;
    let mut walk = Walk {
        trace,
        plan,
        last_use: trace.last_uses(),
        spans: Vec::new(),
        open: vec![None; nt],
        seen: vec![false; nt],
    };
    for op in 0..n {
        for &i in &at[2 * op] {
            walk.before(op, i)?;
        }
        walk.uses(op);
        for &i in &at[2 * op + 1] {
            walk.after(op, i, released[i], hold)?;
        }
    }
    let mut spans = walk.spans;
    for s in &mut spans {
        s.soft_until = s.soft_until.max(s.until);
    }
    Ok(spans)
}

/// Per plan action, for an offload: the op whose allocations the replay
/// found its memory released (the copy complete).
fn released_before(plan: &SwapPlan, replay: Option<&SimReport>) -> Vec<Option<usize>> {
    let mut released: Vec<Option<usize>> = vec![None; plan.actions.len()];
    if let Some(rep) = replay {
        for r in &rep.transfers {
            if r.direction == Direction::ToHost {
                if let Some(slot) = released.get_mut(r.action) {
                    *slot = r.released_before_op;
                }
            }
        }
    }
    released
}

/// The plan's action indices by position (`2 * op` before the op,
/// `2 * op + 1` after it), in plan order.
fn actions_by_position(trace: &Trace, plan: &SwapPlan) -> Result<Vec<Vec<usize>>, LayoutError> {
    let n = trace.num_ops();
    let mut at: Vec<Vec<usize>> = vec![Vec::new(); 2 * n];
    for (i, a) in plan.actions.iter().enumerate() {
        let pos = a.position();
        if pos >= 2 * n || a.tensor().index() >= trace.num_tensors() {
            return Err(LayoutError(format!(
                "plan action {i} names an op or a tensor the trace does not have"
            )));
        }
        at[pos].push(i);
    }
    Ok(at)
}

/// A walk over a plan's iteration in the executor's order, opening a span
/// at each allocation and closing it where its memory may be reused.
struct Walk<'a> {
    trace: &'a Trace,
    plan: &'a SwapPlan,
    last_use: Vec<Option<usize>>,
    spans: Vec<Span>,
    /// The open span of each tensor.
    open: Vec<Option<usize>>,
    /// Whether the tensor was ever allocated.
    seen: Vec<bool>,
}

impl Walk<'_> {
    /// Opens a span for tensor `t` allocated before op `op`.
    fn open(&mut self, t: usize, op: usize) {
        self.open[t] = Some(self.spans.len());
        self.spans.push(Span {
            tensor: t,
            bytes: self.trace.tensors()[t].bytes,
            from: op,
            until: self.trace.num_ops(),
            soft_until: 0,
        });
    }

    /// Plan action `i` moves tensor `t`, which must not be persistent.
    fn movable(&self, t: usize, i: usize) -> Result<(), LayoutError> {
        let info = &self.trace.tensors()[t];
        if info.kind.is_persistent() {
            return Err(LayoutError(format!(
                "plan action {i} moves persistent tensor t{t} `{}`; a layout places only the \
                 iteration's own tensors",
                info.name
            )));
        }
        Ok(())
    }

    /// Action `i`, placed before op `op`: a copy back opens a span, an
    /// eviction closes one.
    fn before(&mut self, op: usize, i: usize) -> Result<(), LayoutError> {
        let a = &self.plan.actions[i];
        let t = a.tensor().index();
        self.movable(t, i)?;
        match a {
            Action::Prefetch { .. } | Action::Fetch { .. } => {
                if self.open[t].is_some() {
                    return Err(LayoutError(format!(
                        "plan action {i} brings back t{t}, which is on the device"
                    )));
                }
                self.open(t, op);
            }
            Action::Evict { .. } => {
                let Some(s) = self.open[t].take() else {
                    return Err(LayoutError(format!(
                        "plan action {i} evicts t{t}, which is not on the device"
                    )));
                };
                self.spans[s].until = op;
            }
            Action::Offload { .. } => {}
        }
        Ok(())
    }

    /// Op `op`'s uses: first uses open spans, last uses close them.
    fn uses(&mut self, op: usize) {
        let trace = self.trace;
        let persistent = |t: usize| trace.tensors()[t].kind.is_persistent();
        for &tid in trace.uses(op) {
            let t = tid.index();
            if persistent(t) || self.seen[t] {
                continue;
            }
            self.seen[t] = true;
            self.open(t, op);
        }
        for &t in trace.uses(op) {
            let t = t.index();
            if persistent(t) {
                continue;
            }
            self.seen[t] = true;
            if self.last_use[t] == Some(op) {
                if let Some(s) = self.open[t].take() {
                    self.spans[s].until = op + 1;
                }
            }
        }
    }

    /// Action `i`, placed after op `op`: an offload closes its span `hold`
    /// of the way from the op after it to `released`, where the replay
    /// found its copy complete.
    fn after(
        &mut self,
        op: usize,
        i: usize,
        released: Option<usize>,
        hold: f64,
    ) -> Result<(), LayoutError> {
        let a = &self.plan.actions[i];
        let t = a.tensor().index();
        self.movable(t, i)?;
        if let Action::Offload { .. } = a {
            let Some(s) = self.open[t].take() else {
                return Err(LayoutError(format!(
                    "plan action {i} offloads t{t}, which is not on the device after op {op}"
                )));
            };
            let n = self.trace.num_ops();
            let soonest = op + 1;
            let complete = released.unwrap_or(soonest).clamp(soonest, n);
            let held = ((complete - soonest) as f64 * hold.clamp(0.0, 1.0)).round() as usize;
            self.spans[s].until = soonest + held;
            self.spans[s].soft_until = complete;
        }
        Ok(())
    }
}
