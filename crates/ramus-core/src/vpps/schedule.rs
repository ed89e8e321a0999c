//! Level scheduling, load balancing and signal/wait barriers for the virtual
//! persistent processors (VPPS §III-B1, Fig. 6).
//!
//! One batch — forward pass, backward pass and optimizer update of all its
//! samples — is a [`VppTaskGraph`]: a DAG of tasks, each one instruction for the
//! kernel's interpreter plus a [`Placement`] saying which virtual processors
//! (VPPs, one per persistent CTA) must execute it. The backward pass is not
//! special: its tasks simply depend on the forward tasks they read.
//!
//! [`Scheduler::schedule`] sorts the tasks by *level* — the length of the
//! longest dependency chain below them (Fig. 6b) — and emits the levels in
//! order. All tasks of a level run concurrently whatever their op type. Within
//! a level:
//! * `Holders` tasks (work on a register-cached matrix) run on every CTA that
//!   holds a piece of that matrix; tasks with equal `(op, arg)` on the same
//!   matrix are merged into one instruction per holder, `op arg [count,
//!   offset]`, whose operand lists lie concatenated at `offset` in the
//!   operand pool — or, with [`Scheduler::holder_item`] set and at most
//!   [`MAX_INLINE_ITEM_WORDS`] words of them, `op arg [count |
//!   INLINE_ITEMS, items…]` with the lists inside the instruction; a merged
//!   instruction of at least [`Scheduler::wide_items`] items goes instead
//!   to a range of VPPs, one per piece of its GEMM (all of them at most),
//!   its count flagged [`WIDE_ITEMS`] (the kernel deals the GEMM over
//!   them); a level's wide products share the VPPs the level's other work
//!   leaves idle, in proportion to their work;
//! * `Every` tasks run on all VPPs;
//! * `Any` tasks run on the VPP with the least load accumulated so far in
//!   their level (ties to the lowest index; see
//!   [`Scheduler::balance_per_level`] — or in the batch, as in VPPS).
//!
//! Between levels, every VPP with work at level `l` ends it with `SIGNAL
//! b_l`, and every VPP with work at level `l + 1` starts it with `WAIT b_l`,
//! where `b_l = l` and the barrier is complete when all of level `l`'s VPPs
//! signalled (Fig. 6d).
//!
//! **Why waiting on the previous level only is enough.** Claim: when `b_l`
//! is complete, every task of every level `≤ l` has completed. For `l = 0`
//! this is the definition of `b_0`'s expectation. For `l > 0`, level `l` is
//! not empty (a task has level `l` because a dependency has level `l − 1`,
//! so no level is skipped), hence some VPP signals `b_l`, and it does so only
//! after its `WAIT b_{l−1}`; so `b_l` complete implies `b_{l−1}` complete,
//! which by induction covers levels `< l`, while the signals themselves cover
//! level `l`. A task at level `l + 1` depends only on tasks of levels `≤ l`,
//! and its VPP waited on `b_l` before running it. The same induction shows
//! the scripts cannot deadlock: the signals of `b_l` only wait on `b_{l−1}`.
//!
//! [`simulate`](super::simulate) interprets packed scripts on the CPU (several VPPs round-robin,
//! `WAIT` blocking until its barrier's count reaches the expectation) and
//! checks every executed instruction against the task graph; tests use it as
//! the oracle.

use super::isa::{
    INLINE_ITEMS, MAX_BARRIERS, MAX_INLINE_ITEM_WORDS, OP_HOST, OP_SIGNAL, OP_WAIT, WIDE_ITEMS,
};
use super::regplan::RegisterPlan;
use super::script::{encode_parts, preamble, PackedScripts};
use super::task::{check_task, Placement, VppTask, VppTaskGraph};
use crate::error::{CoreError, Result};
use loads::{LevelLoads, MinLoad};
use ranges::{deal_wide_ranges, WideProduct};

mod loads;
mod ranges;
#[cfg(test)]
mod tests;

/// Load multiplier of cached-matrix work relative to other work (VPPS
/// §III-B1 gives matrix operations "a relatively higher load"); tunable
/// through [`Scheduler::matrix_load_factor`].
pub const DEFAULT_MATRIX_LOAD_FACTOR: u64 = 4;

const WHAT: &str = "schedule";

/// Turns task graphs into packed scripts for a fixed set of VPPs and a fixed
/// register plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scheduler {
    /// Virtual processors (persistent CTAs).
    pub vpps: usize,
    /// For each cached matrix, the CTAs holding a piece of it, ascending.
    pub holders: Vec<Vec<u32>>,
    /// For each cached matrix, the rows each of `holders` holds (same order).
    pub holder_rows: Vec<Vec<u64>>,
    /// A `Holders` task adds `load × matrix_load_factor × rows_held /
    /// total_rows` (rounded up) to each holder's load.
    pub matrix_load_factor: u64,
    /// Chain dependent work onto one processor: an `Any` task whose latest
    /// dependencies all run on one VPP (as `Any` tasks) runs on that VPP in
    /// the same level, right after them, instead of a level later behind a
    /// barrier (the VPP's own instructions run in order; the kernel
    /// separates instructions with a block barrier). Of the tasks that only
    /// sinks wait for (tasks that depend on every task before them, e.g.
    /// gradient sums read by the update after the batch's sink), one per
    /// VPP and level is chained; more would lengthen that VPP's critical
    /// path for nothing, so they run a level later on the least-loaded
    /// VPPs instead (with [`Scheduler::defer_terminal`], such tasks come
    /// to this only at the batch's last level).
    pub chain: bool,
    /// Run the tasks that only sinks wait for (gradient sums over rows, the
    /// loss, the weight gradients' outer products), except those on every
    /// VPP, at the batch's end: together at the last level before their
    /// sink or the next task on every VPP (a level later where one depends
    /// on that level's work and cannot chain onto it), the `Any` ones on the
    /// least-loaded VPPs.
    /// Chained, a Tree-LSTM's two bias-gradient sums were 2 of the 7
    /// instructions of every backward level's critical chain, and its
    /// recurrent weights' outer products took a level of their own; at the
    /// end they share one level over all processors. Off: each in the
    /// level its dependencies allow (`Any` tasks chained as
    /// [`Scheduler::chain`] says).
    pub defer_terminal: bool,
    /// Balance `Any` tasks over each level's load (the VPP with the least
    /// `Any` work in the task's level; products are spread over their
    /// holders or every VPP anyway, and counting each holder's share cost
    /// more host time than it gained) instead of VPPS' load accumulated
    /// over the whole batch. The levels are separated by barriers, so a
    /// level takes as long as its busiest VPP: balancing the batch's totals
    /// let the VPPs that hold fewer rows (less accumulated product load)
    /// collect all of a wide level's
    /// elementwise work — 17 of 132 processors ran a whole level of a
    /// 128-tree batch (`docs/benchmarks.md#vpps-scheduler-balance-per-level`).
    pub balance_per_level: bool,
    /// Record which VPPs run each task and which tasks each VPP runs
    /// ([`BatchScripts::task_vpps`], [`BatchScripts::vpp_tasks`]: what [`simulate`](super::simulate)
    /// checks). Off, both stay empty — an engine does not need them, and at
    /// a hundred holders per product they cost more than the scheduling.
    pub record: bool,
    /// Words per item of a `Holders` task's operands. 0: a task is one
    /// item (merged tasks must have equal operand counts; the instruction's
    /// count is the number of tasks). `k > 0`: a task carries any number
    /// of `k`-word items (e.g. `(input, output)` pairs for a whole range of
    /// rows), merged tasks' items are concatenated and the count is the
    /// number of items.
    pub holder_item: usize,
    /// A merged product instruction (`holder_item > 0`) of at least this
    /// many items goes, flagged [`WIDE_ITEMS`], to as many VPPs as it has
    /// GEMM pieces ([`wide_tiles`](super::wide::wide_tiles), at most all of them; a level's wide
    /// products share the VPPs its other work leaves idle, see
    /// `deal_wide_ranges`) instead of to the matrix's holders (see
    /// [`WIDE_PRODUCT_ITEMS`](super::wide::WIDE_PRODUCT_ITEMS));
    /// `None`: never.
    pub wide_items: Option<usize>,
    /// Rows and columns of each cached matrix (a wide product's tiles);
    /// a matrix without an entry never runs wide.
    pub matrix_shapes: Vec<(usize, usize)>,
}

/// The scripts for one batch and how they were made: what
/// [`Scheduler::schedule`] returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchScripts {
    /// Scripts, barrier expectations and operand pool in one buffer.
    pub packed: PackedScripts,
    /// Number of levels (barriers are `levels − 1`).
    pub levels: usize,
    /// Level of each task.
    pub task_levels: Vec<u32>,
    /// The VPPs that run each task, ascending.
    pub task_vpps: Vec<Vec<u32>>,
    /// The tasks each VPP runs, in script order (a merged instruction's tasks
    /// in operand-pool order).
    pub vpp_tasks: Vec<Vec<u32>>,
    /// Load accumulated by each VPP over the batch.
    pub loads: Vec<u64>,
    /// The scheduler's [`Scheduler::holder_item`] (how merged counts read).
    pub holder_item: usize,
}

impl Scheduler {
    /// A scheduler for the CTAs and cached matrices of `plan`, with
    /// [`DEFAULT_MATRIX_LOAD_FACTOR`].
    pub fn new(plan: &RegisterPlan) -> Self {
        let holders: Vec<Vec<u32>> = (0..plan.matrices.len()).map(|m| plan.holders(m)).collect();
        let holder_rows = holders
            .iter()
            .enumerate()
            .map(|(m, ctas)| {
                ctas.iter()
                    .map(|&c| plan.load_share(m, c as usize) as u64)
                    .collect()
            })
            .collect();
        Scheduler {
            vpps: plan.ctas,
            holders,
            holder_rows,
            matrix_shapes: plan.matrices.iter().map(|m| (m.rows, m.cols)).collect(),
            matrix_load_factor: DEFAULT_MATRIX_LOAD_FACTOR,
            chain: true,
            defer_terminal: true,
            balance_per_level: true,
            record: true,
            holder_item: 0,
            wide_items: None,
        }
    }

    /// A scheduler for `vpps` processors and no cached matrices (graphs with
    /// `Holders` tasks are rejected).
    pub fn with_vpps(vpps: usize) -> Self {
        Scheduler {
            vpps,
            holders: Vec::new(),
            holder_rows: Vec::new(),
            matrix_load_factor: DEFAULT_MATRIX_LOAD_FACTOR,
            chain: true,
            defer_terminal: true,
            balance_per_level: true,
            record: true,
            holder_item: 0,
            wide_items: None,
            matrix_shapes: Vec::new(),
        }
    }

    /// Checks the public fields; returns the total rows of each matrix.
    fn check(&self) -> Result<Vec<u64>> {
        if self.vpps == 0 || self.vpps > u32::MAX as usize {
            return Err(CoreError::vpps(
                WHAT,
                format!("{} virtual processors", self.vpps),
            ));
        }
        if self.holder_rows.len() != self.holders.len() {
            return Err(CoreError::vpps(
                WHAT,
                format!(
                    "holder rows given for {} matrices, holders for {}",
                    self.holder_rows.len(),
                    self.holders.len()
                ),
            ));
        }
        if self.wide_items.is_some() && self.vpps > usize::from(u16::MAX) {
            return Err(CoreError::vpps(
                WHAT,
                format!(
                    "{} virtual processors: wide products name their VPPs in 16 bits",
                    self.vpps
                ),
            ));
        }
        let mut totals = Vec::with_capacity(self.holders.len());
        for (m, (ctas, rows)) in self.holders.iter().zip(&self.holder_rows).enumerate() {
            let sorted = ctas.windows(2).all(|w| w[0] < w[1]);
            let in_range = ctas.iter().all(|&c| (c as usize) < self.vpps);
            let total: u64 = rows.iter().fold(0u64, |a, &r| a.saturating_add(r));
            if ctas.is_empty() || !sorted || !in_range || rows.len() != ctas.len() || total == 0 {
                return Err(CoreError::vpps(
                    WHAT,
                    format!(
                        "matrix {m}: holders {ctas:?} holding rows {rows:?} are not a non-empty \
                         ascending set of VPPs below {} with rows held",
                        self.vpps
                    ),
                ));
            }
            totals.push(total);
        }
        Ok(totals)
    }

    /// Schedules `g` into packed scripts (see the module docs). Errors for an
    /// invalid graph or scheduler (naming the task or matrix), `Holders`
    /// tasks merged into one instruction with unequal operand counts, more
    /// than [`MAX_BARRIERS`] barriers, or a buffer beyond 32-bit offsets.
    pub fn schedule(&self, g: &VppTaskGraph) -> Result<BatchScripts> {
        let totals = self.check()?;
        let n = g.tasks.len();
        if n > u32::MAX as usize {
            return Err(CoreError::vpps(WHAT, "more than 2^32 tasks in one batch"));
        }
        let Leveling {
            task_levels,
            any_vpp,
            loads,
            levels,
            ..
        } = self.level(g, &totals)?;
        if levels.saturating_sub(1) > MAX_BARRIERS {
            return Err(CoreError::vpps(
                WHAT,
                format!(
                    "the batch has {levels} levels and needs {} barriers, at most {MAX_BARRIERS} \
                     are addressable",
                    levels - 1
                ),
            ));
        }
        let (starts, order) = bucket_by_level(&task_levels, levels);
        let mut emit = Emitter::new(self, g, &any_vpp);
        for l in 0..levels {
            let level_tasks = &order[starts[l]..starts[l + 1]];
            emit.group_products(level_tasks);
            emit.deal_wide(level_tasks);
            emit.products(l)?;
            emit.others(level_tasks, l)?;
        }
        let packed = assemble(self.vpps, levels, &emit.code, &emit.pieces, &emit.pool)?;
        Ok(BatchScripts {
            packed,
            levels,
            task_levels,
            task_vpps: emit.task_vpps,
            vpp_tasks: emit.vpp_tasks,
            loads: loads.loads,
            holder_item: self.holder_item,
        })
    }

    /// Levels by longest dependency chain (dependencies point backwards),
    /// with `Any` tasks placed on the least-loaded VPP as they come, or
    /// chained onto the one VPP their latest dependencies ran on; tasks
    /// only sinks wait for deferred to the sink (`defer_terminal`).
    fn level(&self, g: &VppTaskGraph, totals: &[u64]) -> Result<Leveling> {
        let n = g.tasks.len();
        let mut levels = Leveling {
            task_levels: vec![u32::MAX; n],
            any_vpp: vec![u32::MAX; n],
            loads: MinLoad::new(self.vpps),
            level_loads: LevelLoads::new(self.vpps),
            levels: 0,
            terminal_chained: vec![u32::MAX; self.vpps],
        };
        let waited_for = waited_for_beyond_sinks(g);
        let mut deferred: Vec<usize> = Vec::new();
        for (i, t) in g.tasks.iter().enumerate() {
            self.check_placement(i, t)?;
            let sink = is_sink(i, t);
            if self.defer_terminal && !waited_for[i] && !sink && t.placement != Placement::Every {
                deferred.push(i);
                continue;
            }
            // a task on every VPP (the update) may overwrite what a
            // deferred one reads (the weights) without depending on it: the
            // deferred tasks go before it, as before a sink
            if sink || t.placement == Placement::Every {
                levels.place_deferred(self, g, totals, &mut deferred);
            }
            let latest = t.deps.iter().map(|&d| levels.task_levels[d as usize]).max();
            let chained = match (t.placement, latest) {
                (Placement::Any, Some(l)) if self.chain => {
                    levels.chain_vpp(t, l, waited_for[i]).map(|v| (l, v))
                }
                _ => None,
            };
            let level = chained.map_or_else(|| latest.map_or(0, |l| l + 1), |(l, _)| l);
            levels.place(self, totals, i, t, level, chained.map(|(_, v)| v));
        }
        levels.place_deferred(self, g, totals, &mut deferred);
        Ok(levels)
    }

    /// Checks task `i` and that the scheduler can place it: no host task,
    /// products only on cached matrices.
    fn check_placement(&self, i: usize, t: &VppTask) -> Result<()> {
        check_task(i, t)?;
        if t.op == OP_HOST {
            return Err(CoreError::vpps(
                WHAT,
                format!("task {i} is a host task: split the graph into launches first"),
            ));
        }
        if let Placement::Holders { matrix } = t.placement {
            if usize::from(matrix) >= self.holders.len() {
                return Err(CoreError::vpps(
                    WHAT,
                    format!(
                        "task {i} runs on the holders of matrix {matrix}, but only {} \
                         matrices are cached",
                        self.holders.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Appends the operands of the tasks of a merged `group` (on `matrix`)
    /// to `pool`, checking that they merge; returns the instruction's
    /// count: items, or tasks without items.
    fn merge_operands(
        &self,
        g: &VppTaskGraph,
        group: &[u32],
        matrix: u16,
        pool: &mut Vec<u32>,
    ) -> Result<u32> {
        let first = &g.tasks[group[0] as usize];
        let width = first.operands.len();
        let offset = pool.len();
        let item = self.holder_item;
        for &t in group {
            let task = &g.tasks[t as usize];
            if item > 0 && (task.operands.is_empty() || !task.operands.len().is_multiple_of(item)) {
                return Err(CoreError::vpps(
                    WHAT,
                    format!(
                        "task {t} (opcode {}, matrix {matrix}) has {} operands, not a \
                         positive multiple of {item}-word items",
                        task.op,
                        task.operands.len()
                    ),
                ));
            }
            if item == 0 && task.operands.len() != width {
                return Err(CoreError::vpps(
                    WHAT,
                    format!(
                        "tasks {} and {t} (opcode {}, arg {}, matrix {matrix}) merge into \
                         one instruction but have {width} and {} operands",
                        group[0],
                        task.op,
                        task.arg,
                        task.operands.len()
                    ),
                ));
            }
            pool.extend_from_slice(&task.operands);
        }
        let words = pool.len() - offset;
        let count = words.checked_div(item).unwrap_or(group.len());
        u32::try_from(count)
            .ok()
            .filter(|&c| c & (INLINE_ITEMS | WIDE_ITEMS) == 0)
            .ok_or_else(|| CoreError::vpps(WHAT, "more than 2^30 items in one instruction"))
    }
}

/// The tasks bucketed by level, in id order within a level: level `l`'s
/// tasks are `order[starts[l]..starts[l + 1]]`.
fn bucket_by_level(task_levels: &[u32], levels: usize) -> (Vec<usize>, Vec<u32>) {
    let mut starts = vec![0usize; levels + 1];
    for &l in task_levels {
        starts[l as usize + 1] += 1;
    }
    for l in 0..levels {
        starts[l + 1] += starts[l];
    }
    let mut order = vec![0u32; task_levels.len()];
    let mut fill = starts.clone();
    for (i, &l) in task_levels.iter().enumerate() {
        order[fill[l as usize]] = i as u32;
        fill[l as usize] += 1;
    }
    (starts, order)
}

/// The instructions of the levels as they are emitted: every instruction
/// encoded once into `code`; a piece names the VPP, level and words of one
/// instruction in a VPP's script (a merged product's instruction is one
/// piece per holder). The per-level buffers are reused from level to level.
struct Emitter<'a> {
    s: &'a Scheduler,
    g: &'a VppTaskGraph,
    /// The VPP of each `Any` task.
    any_vpp: &'a [u32],
    code: Vec<u32>,
    pieces: Vec<Piece>,
    /// With [`Scheduler::record`]: the tasks of each VPP and the VPPs of
    /// each task (empty otherwise).
    vpp_tasks: Vec<Vec<u32>>,
    task_vpps: Vec<Vec<u32>>,
    /// The operand pool.
    pool: Vec<u32>,
    every: Vec<u32>,
    /// Where the next wide product's VPP range starts, and its VPPs.
    wide_next: usize,
    wide_runners: Vec<u32>,
    /// Per VPP: runs other work at this level (see `deal_wide_ranges`).
    busy: Vec<bool>,
    wide_products: Vec<WideProduct>,
    wide_ranges: Vec<(usize, usize)>,
    /// Per merged group of the level: its wide product's index, if wide.
    group_wide: Vec<Option<usize>>,
    /// (op, arg, matrix) of each merged group of the level (few: a scan),
    /// and its tasks.
    group_of: Vec<(u8, u16, u16)>,
    groups: Vec<Vec<u32>>,
}

impl<'a> Emitter<'a> {
    fn new(s: &'a Scheduler, g: &'a VppTaskGraph, any_vpp: &'a [u32]) -> Self {
        let (n, vpps, record) = (g.tasks.len(), s.vpps, s.record);
        Emitter {
            s,
            g,
            any_vpp,
            code: Vec::with_capacity(2 * n),
            pieces: Vec::with_capacity(n),
            vpp_tasks: vec![Vec::new(); if record { vpps } else { 0 }],
            task_vpps: vec![Vec::new(); if record { n } else { 0 }],
            pool: Vec::new(),
            every: (0..vpps as u32).collect(),
            wide_next: 0,
            wide_runners: Vec::new(),
            busy: vec![false; vpps],
            wide_products: Vec::new(),
            wide_ranges: Vec::new(),
            group_wide: Vec::new(),
            group_of: Vec::new(),
            groups: Vec::new(),
        }
    }

    /// The level's cached-matrix work, merged per (op, arg, matrix).
    fn group_products(&mut self, level_tasks: &[u32]) {
        self.group_of.clear();
        self.groups.clear();
        for &t in level_tasks {
            let task = &self.g.tasks[t as usize];
            if let Placement::Holders { matrix } = task.placement {
                let key = (task.op, task.arg, matrix);
                let at = match self.group_of.iter().position(|&k| k == key) {
                    Some(at) => at,
                    None => {
                        self.group_of.push(key);
                        self.groups.push(Vec::new());
                        self.groups.len() - 1
                    }
                };
                self.groups[at].push(t);
            }
        }
    }

    /// The level's wide products, dealt over disjoint VPP ranges.
    fn deal_wide(&mut self, level_tasks: &[u32]) {
        let (s, g) = (self.s, self.g);
        self.wide_products.clear();
        self.group_wide.clear();
        self.busy.fill(false);
        for group in &self.groups {
            let first = &g.tasks[group[0] as usize];
            let at = self.group_wide.len();
            self.group_wide.push(None);
            let Placement::Holders { matrix } = first.placement else {
                continue;
            };
            let m = usize::from(matrix);
            let items = group
                .iter()
                .map(|&t| g.tasks[t as usize].operands.len())
                .sum::<usize>()
                .checked_div(s.holder_item);
            match (s.wide_items, s.matrix_shapes.get(m), items) {
                (Some(w), Some(&(rows, cols)), Some(count)) if count >= w => {
                    self.group_wide[at] = Some(self.wide_products.len());
                    self.wide_products.push(WideProduct {
                        op: first.op,
                        rows,
                        cols,
                        count,
                    });
                }
                _ => {
                    for &h in &s.holders[m] {
                        self.busy[h as usize] = true;
                    }
                }
            }
        }
        for &t in level_tasks {
            if g.tasks[t as usize].placement == Placement::Any {
                self.busy[self.any_vpp[t as usize] as usize] = true;
            }
        }
        deal_wide_ranges(
            &self.busy,
            &mut self.wide_next,
            &self.wide_products,
            &mut self.wide_ranges,
        );
    }

    /// One instruction per merged group of level `l`, on its holders or,
    /// wide, on its range of VPPs.
    fn products(&mut self, l: usize) -> Result<()> {
        let (s, g, vpps, record) = (self.s, self.g, self.s.vpps, self.s.record);
        let Emitter {
            code,
            pieces,
            vpp_tasks,
            task_vpps,
            pool,
            wide_runners,
            wide_ranges,
            group_wide,
            groups,
            ..
        } = self;
        for (group, wide) in groups.iter().zip(group_wide.iter()) {
            let first = &g.tasks[group[0] as usize];
            let Placement::Holders { matrix } = first.placement else {
                continue;
            };
            let m = usize::from(matrix);
            let offset = pool.len();
            let count = s.merge_operands(g, group, matrix, pool)?;
            let words = pool.len() - offset;
            // a wide one runs on a range of VPPs, one per GEMM piece
            let wide = wide.and_then(|at| wide_ranges.get(at).copied());
            let mut operands = Vec::with_capacity(2 + words.min(MAX_INLINE_ITEM_WORDS));
            let runners = match wide {
                Some((first_vpp, n)) => {
                    operands.push(count | WIDE_ITEMS);
                    // vpps fits in 16 bits (checked with the wide option)
                    operands.push((first_vpp | n << 16) as u32);
                    // ascending: the wrapped part first
                    let end = first_vpp + n;
                    wide_runners.clear();
                    wide_runners.extend(
                        (0..end.saturating_sub(vpps))
                            .chain(first_vpp..end.min(vpps))
                            .map(|v| v as u32),
                    );
                    &*wide_runners
                }
                None => {
                    operands.push(count);
                    &s.holders[m]
                }
            };
            // a short item list travels inside the instruction (the
            // processor reads it from its script in shared memory, not
            // from the operand pool in device memory)
            if s.holder_item > 0 && words <= MAX_INLINE_ITEM_WORDS {
                operands[0] |= INLINE_ITEMS;
                operands.extend(pool.drain(offset..));
            } else {
                let offset = u32::try_from(offset)
                    .map_err(|_| CoreError::vpps(WHAT, "operand pool exceeds 32-bit offsets"))?;
                operands.push(offset);
            }
            let words = encode_piece(first.op, first.arg, &operands, code)?;
            for &h in runners {
                pieces.push(Piece::new(h, l, words));
                if record {
                    vpp_tasks[h as usize].extend_from_slice(group);
                }
            }
            if record {
                for &t in group {
                    task_vpps[t as usize] = runners.to_vec();
                }
            }
        }
        Ok(())
    }

    /// Everything else of level `l`, in id order.
    fn others(&mut self, level_tasks: &[u32], l: usize) -> Result<()> {
        let (g, vpps, record) = (self.g, self.s.vpps, self.s.record);
        for &t in level_tasks {
            let task = &g.tasks[t as usize];
            match task.placement {
                Placement::Holders { .. } => {}
                Placement::Every => {
                    let words = encode_piece(task.op, task.arg, &task.operands, &mut self.code)?;
                    self.pieces
                        .extend((0..vpps as u32).map(|v| Piece::new(v, l, words)));
                    if record {
                        for tasks in &mut self.vpp_tasks {
                            tasks.push(t);
                        }
                        self.task_vpps[t as usize] = self.every.clone();
                    }
                }
                Placement::Any => {
                    let v = self.any_vpp[t as usize];
                    let words = encode_piece(task.op, task.arg, &task.operands, &mut self.code)?;
                    self.pieces.push(Piece::new(v, l, words));
                    if record {
                        self.vpp_tasks[v as usize].push(t);
                        self.task_vpps[t as usize] = vec![v];
                    }
                }
            }
        }
        Ok(())
    }
}

/// A sink: a task past the first two that depends on every task before it.
fn is_sink(i: usize, t: &VppTask) -> bool {
    i >= 2 && t.deps.len() == i
}

/// The levels and processors given to tasks so far, and the loads they
/// add up to.
struct Leveling {
    /// Level of each task (`u32::MAX`: not placed yet).
    task_levels: Vec<u32>,
    /// The VPP of each placed `Any` task.
    any_vpp: Vec<u32>,
    loads: MinLoad,
    /// With per-level balancing, each level's `Any` loads.
    level_loads: LevelLoads,
    /// One past the highest level given.
    levels: usize,
    /// Per VPP, the level a task nothing but sinks waits for was last
    /// chained at.
    terminal_chained: Vec<u32>,
}

impl Leveling {
    /// Gives task `i` level `level` and, for an `Any` task, the VPP
    /// `chained` onto or else the least-loaded one; adds its load.
    fn place(
        &mut self,
        sched: &Scheduler,
        totals: &[u64],
        i: usize,
        t: &VppTask,
        level: u32,
        chained: Option<u32>,
    ) {
        if t.placement == Placement::Any {
            self.any_vpp[i] = match chained {
                Some(v) => v,
                None if sched.balance_per_level => self.level_loads.argmin(level as usize),
                None => self.loads.argmin(),
            };
        }
        match t.placement {
            Placement::Any => {
                let v = self.any_vpp[i] as usize;
                if sched.balance_per_level {
                    // the batch's totals are only reported: their tree
                    // catches up if ever looked up
                    self.loads.add_lazy(v, t.load);
                    self.level_loads.add(level as usize, v, t.load);
                } else {
                    self.loads.add(v, t.load);
                }
            }
            Placement::Every => {
                // the same on every VPP: no level's balance changes
                for v in 0..sched.vpps {
                    self.loads.add_lazy(v, t.load);
                }
            }
            Placement::Holders { matrix } => {
                let m = usize::from(matrix);
                for (&h, &rows) in sched.holders[m].iter().zip(&sched.holder_rows[m]) {
                    let share = holder_share(t.load, sched.matrix_load_factor, rows, totals[m]);
                    self.loads.add_lazy(h as usize, share);
                }
            }
        }
        self.levels = self.levels.max(level as usize + 1);
        self.task_levels[i] = level;
    }

    /// The VPP that task `t`, with latest dependency level `l`, can chain
    /// onto at level `l`: the one all its dependencies of level `l` ran on
    /// (as `Any` tasks). A task nothing but sinks waits for (`waited_for`
    /// false) chains only where no other such task chained at that level.
    fn chain_vpp(&mut self, t: &VppTask, l: u32, waited_for: bool) -> Option<u32> {
        let mut on = t
            .deps
            .iter()
            .filter(|&&d| self.task_levels[d as usize] == l)
            .map(|&d| self.any_vpp[d as usize]);
        let first = on.next();
        let v = first.filter(|&v| v != u32::MAX && on.all(|w| w == v))?;
        if waited_for {
            return Some(v);
        }
        let last = &mut self.terminal_chained[v as usize];
        (*last != l).then(|| {
            *last = l;
            v
        })
    }

    /// Places the `deferred` tasks (only sinks wait for them) together at
    /// the batch's last level so far — one level later where one of them
    /// depends on that level's work — on the least-loaded VPPs; an `Any`
    /// one whose dependencies ran on one VPP at the last level chains onto
    /// it instead (one per VPP). Deferred products (the weight gradients'
    /// outer products) run on their holders there, beside the rest: in
    /// parallel with one another instead of each in the level its operands
    /// were ready (where it lengthened the backward pass's critical path
    /// by its whole time). The `Any` tasks are balanced as in any level,
    /// over every VPP (weighing the products' shares there crowded them
    /// onto the few processors that hold no rows).
    fn place_deferred(
        &mut self,
        sched: &Scheduler,
        g: &VppTaskGraph,
        totals: &[u64],
        deferred: &mut Vec<usize>,
    ) {
        let last = self.levels.saturating_sub(1) as u32;
        let mut unchained = Vec::with_capacity(deferred.len());
        let mut level = last;
        for i in deferred.drain(..) {
            let t = &g.tasks[i];
            let latest = t.deps.iter().map(|&d| self.task_levels[d as usize]).max();
            match latest {
                Some(l) if l == last && sched.chain && t.placement == Placement::Any => {
                    if let Some(v) = self.chain_vpp(t, l, false) {
                        self.place(sched, totals, i, t, l, Some(v));
                        continue;
                    }
                    level = level.max(l + 1);
                }
                Some(l) => level = level.max(l + 1),
                None => {}
            }
            unchained.push(i);
        }
        for i in unchained {
            self.place(sched, totals, i, &g.tasks[i], level, None);
        }
    }
}

/// A holder's share of a product's load: `load × factor × rows / total`
/// (`total` the matrix's rows, checked non-zero), rounded up; in 128 bits
/// where 64 would overflow, saturating.
fn holder_share(load: u64, factor: u64, rows: u64, total: u64) -> u64 {
    let scaled = load.saturating_mul(factor);
    match scaled.checked_mul(rows) {
        Some(x) => x.div_ceil(total),
        None => u64::try_from((u128::from(scaled) * u128::from(rows)).div_ceil(u128::from(total)))
            .unwrap_or(u64::MAX),
    }
}

/// Per task, whether a task other than a sink depends on it; a sink (a task
/// past the first two that depends on every task before it) waits for
/// everything, so only what other tasks wait for is on a critical path.
/// Dependencies that are out of range are left to `check_task`.
fn waited_for_beyond_sinks(g: &VppTaskGraph) -> Vec<bool> {
    let mut waited = vec![false; g.tasks.len()];
    for (i, t) in g.tasks.iter().enumerate() {
        if is_sink(i, t) {
            continue;
        }
        for &d in &t.deps {
            if let Some(w) = waited.get_mut(d as usize) {
                *w = true;
            }
        }
    }
    waited
}

/// One instruction of a VPP's script: its level and its words in the
/// scheduler's `code` buffer.
#[derive(Clone, Copy, Debug)]
struct Piece {
    vpp: u32,
    level: u32,
    start: u32,
    len: u32,
}

impl Piece {
    fn new(vpp: u32, level: usize, (start, len): (u32, u32)) -> Self {
        // levels are at most MAX_BARRIERS + 1, checked before
        Piece {
            vpp,
            level: level as u32,
            start,
            len,
        }
    }

    fn words(self) -> std::ops::Range<usize> {
        self.start as usize..(self.start + self.len) as usize
    }
}

/// Encodes one instruction at the end of `code`; returns where its words
/// start and how many there are.
fn encode_piece(op: u8, arg: u16, operands: &[u32], code: &mut Vec<u32>) -> Result<(u32, u32)> {
    let start = code.len();
    encode_parts(op, arg, operands, code)?;
    let start = u32::try_from(start)
        .map_err(|_| CoreError::vpps(WHAT, "instructions beyond 32-bit offsets"))?;
    Ok((start, (operands.len() + 1) as u32))
}

/// Packs the pieces into every VPP's script (its pieces in level order,
/// each level it works in opened by a `WAIT` on the previous level's
/// barrier and closed by a `SIGNAL` of its own, except the first and the
/// last level) and counts each barrier's signals, in one pass with no
/// per-VPP buffers.
fn assemble(
    vpps: usize,
    levels: usize,
    code: &[u32],
    pieces: &[Piece],
    pool: &[u32],
) -> Result<PackedScripts> {
    // the pieces grouped by VPP, in their order (a stable counting sort)
    let mut starts = vec![0usize; vpps + 1];
    for p in pieces {
        starts[p.vpp as usize + 1] += 1;
    }
    for v in 0..vpps {
        starts[v + 1] += starts[v];
    }
    let mut by_vpp = vec![0u32; pieces.len()];
    let mut fill = starts.clone();
    for (i, p) in pieces.iter().enumerate() {
        by_vpp[fill[p.vpp as usize]] = i as u32;
        fill[p.vpp as usize] += 1;
    }
    let barriers = levels.saturating_sub(1);
    let mut expect = vec![0u32; barriers];
    // at most: every piece's words, and a WAIT and a SIGNAL per piece
    let most: usize = pieces.iter().map(|p| p.len as usize + 2).sum();
    let mut words: Vec<u32> = Vec::with_capacity(vpps + 1 + most + levels + pool.len());
    words.resize(vpps + 1, 0);
    let scripts_at = vpps + 1;
    for v in 0..vpps {
        let mut open: Option<usize> = None;
        for &i in &by_vpp[starts[v]..starts[v + 1]] {
            let p = pieces[i as usize];
            let level = p.level as usize;
            if open != Some(level) {
                if let Some(prev) = open.filter(|&prev| prev < barriers) {
                    words.push(preamble(OP_SIGNAL, 1, prev as u16));
                }
                if level > 0 {
                    words.push(preamble(OP_WAIT, 1, (level - 1) as u16));
                }
                if level < barriers {
                    expect[level] += 1;
                }
                open = Some(level);
            }
            words.extend_from_slice(&code[p.words()]);
        }
        if let Some(prev) = open.filter(|&prev| prev < barriers) {
            words.push(preamble(OP_SIGNAL, 1, prev as u16));
        }
        words[v + 1] = u32::try_from(words.len() - scripts_at)
            .map_err(|_| CoreError::vpps(WHAT, "scripts beyond 32-bit offsets"))?;
    }
    PackedScripts::assemble(words, vpps, &expect, pool)
}
