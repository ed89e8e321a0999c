//! Address-aware placement: where in device memory each tensor of a swap
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
//!   allocation opens a [`Block`] *from* an op (the op whose first use or
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
//! checks every placement for overlaps.

use std::collections::BTreeMap;

use crate::cost::human_bytes;
use crate::plan::{Action, SwapPlan};
use crate::sim::{Direction, SimReport};
use crate::trace::{TensorId, Trace};
use serde::{Deserialize, Serialize};

/// One allocation of one tensor at a fixed offset of the arena.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Block {
    /// The tensor.
    pub tensor: TensorId,
    /// Offset in the arena, bytes.
    pub offset: u64,
    /// Size, bytes.
    pub bytes: u64,
    /// Allocated before this op runs (at its first use or its prefetch).
    pub from_op: usize,
    /// Its memory may be reused by allocations made before this op on
    /// (the number of ops: only after the iteration).
    pub until_op: usize,
}

impl Block {
    /// Whether the two blocks are alive at the same time.
    pub fn coexists_with(&self, other: &Block) -> bool {
        self.from_op < other.until_op && other.from_op < self.until_op
    }

    /// Whether the two blocks share bytes of the arena.
    pub fn overlaps(&self, other: &Block) -> bool {
        self.offset < other.offset + other.bytes && other.offset < self.offset + self.bytes
    }

    /// One past the block's last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.bytes
    }
}

/// Where every allocation of a plan's iteration lives; see the module docs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// Bytes of the arena: the end of the highest block.
    pub arena_bytes: u64,
    /// The most bytes alive at once: no layout can use a smaller arena.
    pub max_live_bytes: u64,
    /// Every allocation in the order the executor makes them.
    pub blocks: Vec<Block>,
}

/// Why a layout does not fit its trace and plan.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("memory layout: {0}")]
pub struct LayoutError(pub String);

/// A block's lifetime and size, before it has an offset.
#[derive(Clone, Copy, Debug)]
struct Span {
    tensor: usize,
    bytes: u64,
    from: usize,
    until: usize,
    /// Until the replay found the copy complete (offloaded blocks; else
    /// `until`): memory reused before then makes the reuse wait.
    soft_until: usize,
}

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

    /// A one-line summary.
    pub fn summary(&self) -> String {
        format!(
            "{} blocks in an arena of {} (at least {} live at once)",
            self.blocks.len(),
            human_bytes(self.arena_bytes),
            human_bytes(self.max_live_bytes)
        )
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
    let mut last_use = vec![None; nt];
    for op in 0..n {
        for &t in trace.uses(op) {
            last_use[t.index()] = Some(op);
        }
    }
    // where each offload's memory became free in the replay, by action
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
    let mut at: Vec<Vec<usize>> = vec![Vec::new(); 2 * n];
    for (i, a) in plan.actions.iter().enumerate() {
        let pos = a.position();
        if pos >= 2 * n || a.tensor().index() >= nt {
            return Err(LayoutError(format!(
                "plan action {i} names an op or a tensor the trace does not have"
            )));
        }
        at[pos].push(i);
    }
    let persistent = |t: usize| trace.tensors()[t].kind.is_persistent();
    let mut spans: Vec<Span> = Vec::new();
    // the open block of each tensor, and whether it was ever allocated
    let mut open: Vec<Option<usize>> = vec![None; nt];
    let mut seen = vec![false; nt];
    let moved_persistent = |t: usize, i: usize| {
        LayoutError(format!(
            "plan action {i} moves persistent tensor t{t} `{}`; a layout places only the \
             iteration's own tensors",
            trace.tensors()[t].name
        ))
    };
    for op in 0..n {
        for &i in &at[2 * op] {
            let a = &plan.actions[i];
            let t = a.tensor().index();
            if persistent(t) {
                return Err(moved_persistent(t, i));
            }
            match a {
                Action::Prefetch { .. } | Action::Fetch { .. } => {
                    if open[t].is_some() {
                        return Err(LayoutError(format!(
                            "plan action {i} brings back t{t}, which is on the device"
                        )));
                    }
                    open[t] = Some(spans.len());
                    spans.push(Span {
                        tensor: t,
                        bytes: trace.tensors()[t].bytes,
                        from: op,
                        until: n,
                        soft_until: 0,
                    });
                }
                Action::Evict { .. } => {
                    let Some(s) = open[t].take() else {
                        return Err(LayoutError(format!(
                            "plan action {i} evicts t{t}, which is not on the device"
                        )));
                    };
                    spans[s].until = op;
                }
                Action::Offload { .. } => {}
            }
        }
        for &tid in trace.uses(op) {
            let t = tid.index();
            if persistent(t) || seen[t] {
                continue;
            }
            seen[t] = true;
            open[t] = Some(spans.len());
            spans.push(Span {
                tensor: t,
                bytes: trace.tensors()[t].bytes,
                from: op,
                until: n,
                soft_until: 0,
            });
        }
        for &t in trace.uses(op) {
            let t = t.index();
            if persistent(t) {
                continue;
            }
            seen[t] = true;
            if last_use[t] == Some(op) {
                if let Some(s) = open[t].take() {
                    spans[s].until = op + 1;
                }
            }
        }
        for &i in &at[2 * op + 1] {
            let a = &plan.actions[i];
            let t = a.tensor().index();
            if persistent(t) {
                return Err(moved_persistent(t, i));
            }
            if let Action::Offload { .. } = a {
                let Some(s) = open[t].take() else {
                    return Err(LayoutError(format!(
                        "plan action {i} offloads t{t}, which is not on the device after op {op}"
                    )));
                };
                let soonest = op + 1;
                let complete = released[i].unwrap_or(soonest).clamp(soonest, n);
                let held = ((complete - soonest) as f64 * hold.clamp(0.0, 1.0)).round() as usize;
                spans[s].until = soonest + held;
                spans[s].soft_until = complete;
            }
        }
    }
    for s in &mut spans {
        s.soft_until = s.soft_until.max(s.until);
    }
    Ok(spans)
}

/// The most bytes alive at once.
fn max_live(spans: &[Span], n: usize) -> u64 {
    let mut delta = vec![0i128; n + 2];
    for s in spans {
        delta[s.from] += i128::from(s.bytes);
        delta[s.until.min(n + 1)] -= i128::from(s.bytes);
    }
    let mut live = 0i128;
    let mut best = 0i128;
    for d in delta {
        live += d;
        best = best.max(live);
    }
    u64::try_from(best).unwrap_or(u64::MAX)
}

/// For each span, the spans it coexists with, each living until `until`.
fn conflicts(spans: &[Span], until: impl Fn(&Span) -> usize) -> Vec<Vec<usize>> {
    let mut by_from: Vec<usize> = (0..spans.len()).collect();
    by_from.sort_by_key(|&i| spans[i].from);
    let mut conf = vec![Vec::new(); spans.len()];
    for (k, &i) in by_from.iter().enumerate() {
        // later-starting spans that start before this one ends
        for &j in &by_from[k + 1..] {
            if spans[j].from >= until(&spans[i]) {
                break;
            }
            conf[i].push(j);
            conf[j].push(i);
        }
    }
    conf
}

/// The offset for `bytes` among the sorted `busy` ranges: the lowest gap
/// (first fit) or the tightest (best fit) ending at most at `limit`, the
/// space between the last range and `limit` included; `None` if none.
fn fit(busy: &[(u64, u64)], bytes: u64, best_fit: bool, limit: u64) -> Option<u64> {
    let mut at = None::<(u64, u64)>; // (gap, offset)
    let mut cursor = 0u64;
    let gaps = busy
        .iter()
        .map(|&(lo, hi)| (lo, hi))
        .chain(std::iter::once((limit, limit)));
    for (lo, hi) in gaps {
        let lo = lo.min(limit);
        if lo > cursor {
            let gap = lo - cursor;
            if gap >= bytes && at.is_none_or(|(g, _)| best_fit && gap < g) {
                at = Some((gap, cursor));
                if !best_fit {
                    break;
                }
            }
        }
        cursor = cursor.max(hi);
        if cursor >= limit {
            break;
        }
    }
    at.map(|(_, o)| o)
}

/// The spans' conflicts: those alive at once (`hard`: they must not
/// share bytes) and, with reuse waits avoided where possible, those alive
/// at once until their copies complete (`soft`, a superset).
struct Conflicts {
    hard: Vec<Vec<usize>>,
    soft: Option<Vec<Vec<usize>>>,
}

/// Offsets for `spans` placed in `order`, keeping the offsets `previous`
/// gave the first `keep` of them (placed in the same order before, so they
/// come out the same). Each span goes to the lowest gap (first fit) or the
/// tightest (best fit) among the spans it coexists with — with soft
/// conflicts, first among gaps clear of them too, then among those clear
/// of the hard ones, in both cases without raising the arena — else on top.
/// Returns the offsets, the arena size and the span that reaches the top.
fn place_from(
    spans: &[Span],
    conf: &Conflicts,
    order: &[usize],
    best_fit: bool,
    keep: usize,
    previous: &[u64],
) -> (Vec<u64>, u64, usize) {
    let mut offset: Vec<Option<u64>> = vec![None; spans.len()];
    let mut arena = 0;
    let mut top = 0;
    let keep = keep.min(order.len());
    for &i in &order[..keep] {
        let o = previous.get(i).copied().unwrap_or_default();
        offset[i] = Some(o);
        if o + spans[i].bytes > arena {
            arena = o + spans[i].bytes;
            top = i;
        }
    }
    let mut busy: Vec<(u64, u64)> = Vec::new();
    let fill = |busy: &mut Vec<(u64, u64)>, with: &[usize], offset: &[Option<u64>]| {
        busy.clear();
        busy.extend(
            with.iter()
                .filter_map(|&j| offset[j].map(|o| (o, o + spans[j].bytes))),
        );
        busy.sort_unstable();
    };
    for &i in &order[keep..] {
        let bytes = spans[i].bytes;
        let mut at = None;
        if let Some(soft) = &conf.soft {
            fill(&mut busy, &soft[i], &offset);
            at = fit(&busy, bytes, best_fit, arena);
        }
        fill(&mut busy, &conf.hard[i], &offset);
        if at.is_none() && conf.soft.is_some() {
            at = fit(&busy, bytes, best_fit, arena);
        }
        let o = at
            .or_else(|| fit(&busy, bytes, best_fit, u64::MAX))
            .unwrap_or(arena);
        offset[i] = Some(o);
        if o + bytes > arena {
            arena = o + bytes;
            top = i;
        }
    }
    (
        offset.into_iter().map(Option::unwrap_or_default).collect(),
        arena,
        top,
    )
}

/// Iterations of the local search over placement orders, and how many it
/// tries without making the arena smaller before it stops.
const SEARCH_STEPS: usize = 400;
const SEARCH_PATIENCE: usize = 150;

/// A small deterministic generator (xorshift64*), so that a trace always
/// gets the same layout.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..=max`.
    fn up_to(&mut self, max: usize) -> usize {
        (self.next() % (max as u64 + 1)) as usize
    }
}

/// Packs the spans: the best of a few orders and both fits, then a local
/// search that moves the block reaching the top of the arena (or one it
/// sits on) earlier in the order, keeping every change that does not make
/// the arena larger, until the arena is as small as the bytes alive at
/// once (or `target`) or the steps run out. With `soft`, memory offloads
/// may still read is avoided where the arena allows (see [`place_from`]).
fn pack_with(spans: &[Span], target: u64, soft: bool) -> Layout {
    let n = spans.iter().map(|s| s.soft_until).max().unwrap_or(0);
    let lower = max_live(spans, n);
    let conf = Conflicts {
        hard: conflicts(spans, |s| s.until),
        soft: soft.then(|| conflicts(spans, |s| s.soft_until)),
    };
    let place = |order: &[usize], best_fit: bool, keep: usize, previous: &[u64]| {
        place_from(spans, &conf, order, best_fit, keep, previous)
    };
    let idx: Vec<usize> = (0..spans.len()).collect();
    let life = |s: &Span| (s.until - s.from) as u64;
    let mut orders: Vec<Vec<usize>> = Vec::new();
    // largest first, longer-lived first among equals
    let mut o = idx.clone();
    o.sort_by_key(|&i| {
        (
            std::cmp::Reverse(spans[i].bytes),
            std::cmp::Reverse(life(&spans[i])),
            i,
        )
    });
    orders.push(o);
    // largest area (bytes x ops) first
    let mut o = idx.clone();
    o.sort_by_key(|&i| {
        (
            std::cmp::Reverse(u128::from(spans[i].bytes) * u128::from(life(&spans[i]))),
            i,
        )
    });
    orders.push(o);
    // longest-lived first, then largest
    let mut o = idx.clone();
    o.sort_by_key(|&i| {
        (
            std::cmp::Reverse(life(&spans[i])),
            std::cmp::Reverse(spans[i].bytes),
            i,
        )
    });
    orders.push(o);
    // in allocation order (what an allocator at run time would see)
    orders.push(idx);
    // (order, best fit?, offsets, arena, top span)
    type Packing = (Vec<usize>, bool, Vec<u64>, u64, usize);
    let mut best: Option<Packing> = None;
    for order in orders {
        for best_fit in [true, false] {
            let (offsets, arena, top) = place(&order, best_fit, 0, &[]);
            if best.as_ref().is_none_or(|b| arena < b.3) {
                best = Some((order.clone(), best_fit, offsets, arena, top));
            }
        }
    }
    let Some((mut order, best_fit, mut offsets, mut arena, mut top)) = best else {
        return Layout {
            arena_bytes: 0,
            max_live_bytes: 0,
            blocks: Vec::new(),
        };
    };
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ spans.len() as u64);
    let mut position = vec![0; spans.len()];
    let mut since_better = 0;
    for _ in 0..SEARCH_STEPS {
        if arena <= lower.max(target) || since_better >= SEARCH_PATIENCE {
            break;
        }
        since_better += 1;
        // the top block, or one of those below it that reach near the top
        let near: Vec<usize> = conf.hard[top]
            .iter()
            .copied()
            .filter(|&j| offsets[j] + spans[j].bytes + spans[top].bytes > arena)
            .collect();
        let pick = if near.is_empty() || rng.next().is_multiple_of(2) {
            top
        } else {
            near[rng.up_to(near.len() - 1)]
        };
        for (k, &i) in order.iter().enumerate() {
            position[i] = k;
        }
        let from = position[pick];
        if from == 0 {
            continue;
        }
        let to = rng.up_to(from - 1);
        let mut candidate = order.clone();
        let moved = candidate.remove(from);
        candidate.insert(to, moved);
        // the spans before the moved one keep their offsets
        let (o, a, t) = place(&candidate, best_fit, to, &offsets);
        if a < arena {
            since_better = 0;
        }
        if a <= arena {
            order = candidate;
            offsets = o;
            arena = a;
            top = t;
        }
    }
    Layout {
        arena_bytes: arena,
        max_live_bytes: lower,
        blocks: spans
            .iter()
            .zip(offsets)
            .map(|(s, offset)| Block {
                tensor: TensorId(s.tensor as u32),
                offset,
                bytes: s.bytes,
                from_op: s.from,
                until_op: s.until,
            })
            .collect(),
    }
}
