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
//! [`simulate`] interprets packed scripts on the CPU (several VPPs round-robin,
//! `WAIT` blocking until its barrier's count reaches the expectation) and
//! checks every executed instruction against the task graph; tests use it as
//! the oracle.

use super::isa::{
    INLINE_ITEMS, MAX_BARRIERS, MAX_INLINE_ITEM_WORDS, OP_FIRST_ENGINE, OP_HOST, OP_SIGNAL,
    OP_WAIT, WIDE_ITEMS,
};
use super::kernel::{wide_tiles, wide_work};
use super::regplan::RegisterPlan;
use super::script::{encode_parts, preamble, Instr, PackedScripts, MAX_OPERANDS};
use crate::error::{CoreError, Result};

/// Load multiplier of cached-matrix work relative to other work (VPPS
/// §III-B1 gives matrix operations "a relatively higher load"); tunable
/// through [`Scheduler::matrix_load_factor`].
pub const DEFAULT_MATRIX_LOAD_FACTOR: u64 = 4;

const WHAT: &str = "schedule";

/// Which virtual processors execute a task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Exactly one VPP, the one with the least accumulated load.
    Any,
    /// Every CTA holding a piece of this register-cached matrix (an index
    /// into [`RegisterPlan::matrices`]), each on its own rows.
    Holders {
        /// The cached matrix.
        matrix: u16,
    },
    /// All VPPs (e.g. the final optimizer update).
    Every,
}

/// One node of a batch's task DAG: an interpreter instruction and where it
/// runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VppTask {
    /// Engine opcode (at least [`OP_FIRST_ENGINE`]).
    pub op: u8,
    /// The instruction's 16-bit immediate.
    pub arg: u16,
    /// Operand words (pool offsets, counts). `Any`/`Every` tasks carry them
    /// inline (at most [`MAX_OPERANDS`]); `Holders` tasks through the operand
    /// pool, and merged tasks must have equal operand counts.
    pub operands: Vec<u32>,
    /// Tasks that must complete (on all their VPPs) before this one starts.
    pub deps: Vec<u32>,
    /// Estimated cost, for load balancing.
    pub load: u64,
    /// Where the task runs.
    pub placement: Placement,
}

/// A batch's tasks; dependencies always point to earlier tasks, so the graph
/// is acyclic by construction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VppTaskGraph {
    /// Tasks in push order; a task's id is its index.
    pub tasks: Vec<VppTask>,
}

/// Checks what can be checked about task `index` without a scheduler.
fn check_task(index: usize, task: &VppTask) -> Result<()> {
    if let Some(&dep) = task.deps.iter().find(|&&d| d as usize >= index) {
        return Err(CoreError::vpps(
            WHAT,
            format!("task {index} depends on task {dep}, which is not an earlier task"),
        ));
    }
    if task.op < OP_FIRST_ENGINE {
        return Err(CoreError::vpps(
            WHAT,
            format!(
                "task {index} has opcode {}, below the first engine opcode {OP_FIRST_ENGINE}",
                task.op
            ),
        ));
    }
    if !matches!(task.placement, Placement::Holders { .. }) && task.operands.len() > MAX_OPERANDS {
        return Err(CoreError::vpps(
            WHAT,
            format!(
                "task {index} has {} operands, at most {MAX_OPERANDS} fit in an instruction",
                task.operands.len()
            ),
        ));
    }
    Ok(())
}

impl VppTaskGraph {
    /// An empty graph.
    pub fn new() -> Self {
        VppTaskGraph::default()
    }

    /// Appends `task` and returns its id. Errors (and does not append) if it
    /// depends on a task not pushed yet, has a control opcode, or carries more
    /// inline operands than an instruction holds.
    pub fn push(&mut self, task: VppTask) -> Result<u32> {
        let index = self.tasks.len();
        let id = u32::try_from(index)
            .map_err(|_| CoreError::vpps(WHAT, "more than 2^32 tasks in one batch"))?;
        check_task(index, &task)?;
        self.tasks.push(task);
        Ok(id)
    }

    /// Number of tasks.
    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    /// Whether there are no tasks.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }
}

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
    /// 128-tree batch, 360 µs instead of about 25.
    pub balance_per_level: bool,
    /// Record which VPPs run each task and which tasks each VPP runs
    /// ([`BatchScripts::task_vpps`], [`BatchScripts::vpp_tasks`]: what [`simulate`]
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
    /// GEMM pieces ([`wide_tiles`], at most all of them; a level's wide
    /// products share the VPPs its other work leaves idle, see
    /// `deal_wide_ranges`) instead of to the matrix's holders (see
    /// [`kernel::WIDE_PRODUCT_ITEMS`](super::kernel::WIDE_PRODUCT_ITEMS));
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

/// Minimum-load lookup over VPPs: a tournament tree whose nodes hold the
/// index of the least-loaded VPP below them (ties to the lower index).
/// Cached-matrix work adds load to a hundred holders at once; those adds
/// ([`MinLoad::add_lazy`]) only mark the leaves, and the tree catches up
/// at a lookup when few are marked, else every [`MinLoad::FLUSH_EVERY`]
/// lookups.
struct MinLoad {
    size: usize,
    tree: Vec<u32>,
    loads: Vec<u64>,
    dirty: Vec<bool>,
    dirty_list: Vec<u32>,
    lookups: u32,
}

impl MinLoad {
    const NONE: u32 = u32::MAX;

    fn new(n: usize) -> Self {
        let size = n.max(1).next_power_of_two();
        let mut tree = vec![Self::NONE; 2 * size];
        for (i, slot) in tree[size..size + n].iter_mut().enumerate() {
            *slot = i as u32;
        }
        let mut m = MinLoad {
            size,
            tree,
            loads: vec![0; n],
            dirty: vec![false; n],
            dirty_list: Vec::new(),
            lookups: 0,
        };
        for k in (1..size).rev() {
            m.tree[k] = lighter(&m.loads, m.tree[2 * k], m.tree[2 * k + 1]);
        }
        m
    }

    /// Lookups between two catch-ups of lazily added load.
    const FLUSH_EVERY: u32 = 16;

    /// Fewer lazily added leaves than this are caught up at every lookup.
    const FLUSH_SMALL: usize = 32;

    fn argmin(&mut self) -> u32 {
        self.lookups += 1;
        if self.lookups >= Self::FLUSH_EVERY || self.dirty_list.len() <= Self::FLUSH_SMALL {
            self.flush();
        }
        self.tree[1]
    }

    /// Brings the tree up to date with every lazily added load.
    fn flush(&mut self) {
        self.lookups = 0;
        while let Some(v) = self.dirty_list.pop() {
            self.dirty[v as usize] = false;
            self.update(v as usize);
        }
    }

    fn add(&mut self, vpp: usize, amount: u64) {
        self.loads[vpp] = self.loads[vpp].saturating_add(amount);
        self.update(vpp);
    }

    /// Adds load without updating the tree until the next catch-up.
    fn add_lazy(&mut self, vpp: usize, amount: u64) {
        self.loads[vpp] = self.loads[vpp].saturating_add(amount);
        if !self.dirty[vpp] {
            self.dirty[vpp] = true;
            self.dirty_list.push(vpp as u32);
        }
    }

    fn update(&mut self, vpp: usize) {
        repick_above(&mut self.tree, &self.loads, vpp);
    }
}

/// Of two entries of a load tree (VPP indices, or [`MinLoad::NONE`]), the
/// one with less load (ties to `a`).
fn lighter(loads: &[u64], a: u32, b: u32) -> u32 {
    match (a, b) {
        (MinLoad::NONE, _) => b,
        (_, MinLoad::NONE) => a,
        _ if loads[b as usize] < loads[a as usize] => b,
        _ => a,
    }
}

/// Re-picks the nodes of the load tree `tree` (a power-of-two leaf count:
/// half its length) on the path above leaf `vpp`.
fn repick_above(tree: &mut [u32], loads: &[u64], vpp: usize) {
    let mut k = (tree.len() / 2 + vpp) / 2;
    while k >= 1 {
        tree[k] = lighter(loads, tree[2 * k], tree[2 * k + 1]);
        k /= 2;
    }
}

/// Per level, the `Any` load of every VPP and a tournament tree over it
/// (see [`MinLoad`]; no lazy adds): the levels' trees side by side in one
/// buffer, a new level's copied from the all-zero template.
struct LevelLoads {
    n: usize,
    size: usize,
    template: Vec<u32>,
    trees: Vec<u32>,
    loads: Vec<u64>,
}

impl LevelLoads {
    fn new(n: usize) -> Self {
        let zero = MinLoad::new(n);
        LevelLoads {
            n,
            size: zero.size,
            template: zero.tree,
            trees: Vec::new(),
            loads: Vec::new(),
        }
    }

    /// Makes room for `level` (levels appear at most one past the deepest).
    fn reach(&mut self, level: usize) {
        while self.loads.len() <= level * self.n {
            self.trees.extend_from_slice(&self.template);
            self.loads.resize(self.loads.len() + self.n, 0);
        }
    }

    fn argmin(&mut self, level: usize) -> u32 {
        self.reach(level);
        self.trees[level * 2 * self.size + 1]
    }

    fn add(&mut self, level: usize, vpp: usize, amount: u64) {
        self.reach(level);
        let loads = &mut self.loads[level * self.n..(level + 1) * self.n];
        loads[vpp] = loads[vpp].saturating_add(amount);
        let tree = &mut self.trees[level * 2 * self.size..(level + 1) * 2 * self.size];
        repick_above(tree, loads, vpp);
    }
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

        // Levels by longest dependency chain (dependencies point backwards),
        // with `Any` tasks placed on the least-loaded VPP as they come, or
        // chained onto the one VPP their latest dependencies ran on; tasks
        // only sinks wait for deferred to the sink (`defer_terminal`).
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
            let sink = is_sink(i, t);
            if self.defer_terminal && !waited_for[i] && !sink && t.placement != Placement::Every {
                deferred.push(i);
                continue;
            }
            // a task on every VPP (the update) may overwrite what a
            // deferred one reads (the weights) without depending on it: the
            // deferred tasks go before it, as before a sink
            if sink || t.placement == Placement::Every {
                levels.place_deferred(self, g, &totals, &mut deferred);
            }
            let latest = t.deps.iter().map(|&d| levels.task_levels[d as usize]).max();
            let chained = match (t.placement, latest) {
                (Placement::Any, Some(l)) if self.chain => {
                    levels.chain_vpp(t, l, waited_for[i]).map(|v| (l, v))
                }
                _ => None,
            };
            let level = chained.map_or_else(|| latest.map_or(0, |l| l + 1), |(l, _)| l);
            levels.place(self, &totals, i, t, level, chained.map(|(_, v)| v));
        }
        levels.place_deferred(self, g, &totals, &mut deferred);
        let Leveling {
            task_levels,
            any_vpp,
            loads,
            levels,
            ..
        } = levels;
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

        // Tasks bucketed by level, in id order within a level.
        let mut starts = vec![0usize; levels + 1];
        for &l in &task_levels {
            starts[l as usize + 1] += 1;
        }
        for l in 0..levels {
            starts[l + 1] += starts[l];
        }
        let mut order = vec![0u32; n];
        let mut fill = starts.clone();
        for (i, &l) in task_levels.iter().enumerate() {
            order[fill[l as usize]] = i as u32;
            fill[l as usize] += 1;
        }

        let vpps = self.vpps;
        // every instruction encoded once into `code`; a piece names the
        // VPP, level and words of one instruction in a VPP's script (a
        // merged product's instruction is one piece per holder)
        let mut code: Vec<u32> = Vec::with_capacity(2 * n);
        let mut pieces: Vec<Piece> = Vec::with_capacity(n);
        let record = self.record;
        let mut vpp_tasks: Vec<Vec<u32>> = vec![Vec::new(); if record { vpps } else { 0 }];
        let mut task_vpps: Vec<Vec<u32>> = vec![Vec::new(); if record { n } else { 0 }];
        let mut pool: Vec<u32> = Vec::new();
        let every: Vec<u32> = (0..vpps as u32).collect();
        // where the next wide product's VPP range starts, and its VPPs
        let mut wide_next = 0usize;
        let mut wide_runners: Vec<u32> = Vec::new();
        // per VPP: runs other work at this level (see `deal_wide_ranges`)
        let mut busy = vec![false; vpps];
        let mut wide_products: Vec<WideProduct> = Vec::new();
        let mut wide_ranges: Vec<(usize, usize)> = Vec::new();
        // per merged group of the level: its wide product's index, if wide
        let mut group_wide: Vec<Option<usize>> = Vec::new();
        // (op, arg, matrix) of each merged group of the level (few: a scan)
        let mut group_of: Vec<(u8, u16, u16)> = Vec::new();
        let mut groups: Vec<Vec<u32>> = Vec::new();

        for l in 0..levels {
            let level_tasks = &order[starts[l]..starts[l + 1]];

            // Cached-matrix work, merged per (op, arg, matrix).
            group_of.clear();
            groups.clear();
            for &t in level_tasks {
                let task = &g.tasks[t as usize];
                if let Placement::Holders { matrix } = task.placement {
                    let key = (task.op, task.arg, matrix);
                    let at = match group_of.iter().position(|&k| k == key) {
                        Some(at) => at,
                        None => {
                            group_of.push(key);
                            groups.push(Vec::new());
                            groups.len() - 1
                        }
                    };
                    groups[at].push(t);
                }
            }
            // The level's wide products, dealt over disjoint VPP ranges.
            wide_products.clear();
            group_wide.clear();
            busy.fill(false);
            for group in &groups {
                let first = &g.tasks[group[0] as usize];
                let at = group_wide.len();
                group_wide.push(None);
                let Placement::Holders { matrix } = first.placement else {
                    continue;
                };
                let m = usize::from(matrix);
                let items = group
                    .iter()
                    .map(|&t| g.tasks[t as usize].operands.len())
                    .sum::<usize>()
                    .checked_div(self.holder_item);
                match (self.wide_items, self.matrix_shapes.get(m), items) {
                    (Some(w), Some(&(rows, cols)), Some(count)) if count >= w => {
                        group_wide[at] = Some(wide_products.len());
                        wide_products.push(WideProduct {
                            op: first.op,
                            rows,
                            cols,
                            count,
                        });
                    }
                    _ => {
                        for &h in &self.holders[m] {
                            busy[h as usize] = true;
                        }
                    }
                }
            }
            for &t in level_tasks {
                if g.tasks[t as usize].placement == Placement::Any {
                    busy[any_vpp[t as usize] as usize] = true;
                }
            }
            deal_wide_ranges(&busy, &mut wide_next, &wide_products, &mut wide_ranges);

            for (group, wide) in groups.iter().zip(&group_wide) {
                let first = &g.tasks[group[0] as usize];
                let Placement::Holders { matrix } = first.placement else {
                    continue;
                };
                let m = usize::from(matrix);
                let width = first.operands.len();
                let offset = pool.len();
                let item = self.holder_item;
                for &t in group {
                    let task = &g.tasks[t as usize];
                    if item > 0
                        && (task.operands.is_empty() || !task.operands.len().is_multiple_of(item))
                    {
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
                let count = u32::try_from(count)
                    .ok()
                    .filter(|&c| c & (INLINE_ITEMS | WIDE_ITEMS) == 0)
                    .ok_or_else(|| {
                        CoreError::vpps(WHAT, "more than 2^30 items in one instruction")
                    })?;
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
                        &wide_runners
                    }
                    None => {
                        operands.push(count);
                        &self.holders[m]
                    }
                };
                // a short item list travels inside the instruction (the
                // processor reads it from its script in shared memory, not
                // from the operand pool in device memory)
                if item > 0 && words <= MAX_INLINE_ITEM_WORDS {
                    operands[0] |= INLINE_ITEMS;
                    operands.extend(pool.drain(offset..));
                } else {
                    let offset = u32::try_from(offset).map_err(|_| {
                        CoreError::vpps(WHAT, "operand pool exceeds 32-bit offsets")
                    })?;
                    operands.push(offset);
                }
                let words = encode_piece(first.op, first.arg, &operands, &mut code)?;
                for &h in runners {
                    pieces.push(Piece::new(h, l, words));
                    if record {
                        vpp_tasks[h as usize].extend_from_slice(group);
                    }
                }
                if record {
                    for &t in group {
                        task_vpps[t as usize] = runners.clone();
                    }
                }
            }

            // Everything else, in id order.
            for &t in level_tasks {
                let task = &g.tasks[t as usize];
                match task.placement {
                    Placement::Holders { .. } => {}
                    Placement::Every => {
                        let words = encode_piece(task.op, task.arg, &task.operands, &mut code)?;
                        pieces.extend((0..vpps as u32).map(|v| Piece::new(v, l, words)));
                        if record {
                            for tasks in &mut vpp_tasks {
                                tasks.push(t);
                            }
                            task_vpps[t as usize] = every.clone();
                        }
                    }
                    Placement::Any => {
                        let v = any_vpp[t as usize];
                        let vu = v as usize;
                        let words = encode_piece(task.op, task.arg, &task.operands, &mut code)?;
                        pieces.push(Piece::new(v, l, words));
                        if record {
                            vpp_tasks[vu].push(t);
                            task_vpps[t as usize] = vec![v];
                        }
                    }
                }
            }
        }

        let packed = assemble(vpps, levels, &code, &pieces, &pool)?;
        Ok(BatchScripts {
            packed,
            levels,
            task_levels,
            task_vpps,
            vpp_tasks,
            loads: loads.loads,
            holder_item: self.holder_item,
        })
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

/// A level's wide product: its opcode, matrix shape and item count.
#[derive(Clone, Copy, Debug)]
struct WideProduct {
    op: u8,
    rows: usize,
    cols: usize,
    count: usize,
}

/// Deals a level's wide products (`products`, in instruction order) over
/// VPP ranges, `ranges[i] = (first, n)`: VPPs `first, first + 1, …
/// (mod vpps)`, one per GEMM piece.
///
/// The products share a *region*: the longest circular run of VPPs that are
/// not `busy` with the level's other work (its `Any` tasks, its register
/// products' holders) where that is at least half of them, else every VPP
/// starting at `next` (which then moves past the last range, so that
/// successive levels' small products rotate over the VPPs). Each product
/// gets a share of the region in proportion to its tile steps
/// ([`wide_work`]) and as many of those VPPs as it has pieces; the shares
/// do not overlap (unless there are more products than VPPs in the
/// region). Sharing, a level's
/// two products run side by side rather than one after the other on every
/// VPP, and its elementwise work beside them: at hidden 512, a
/// Tree-LSTM's two recurrent products of a level took 5.9–7.5 µs each
/// over all VPPs, and a gate's fused work 2–3 µs after them on one.
fn deal_wide_ranges(
    busy: &[bool],
    next: &mut usize,
    products: &[WideProduct],
    ranges: &mut Vec<(usize, usize)>,
) {
    ranges.clear();
    let vpps = busy.len();
    if products.is_empty() || vpps == 0 {
        return;
    }
    // the longest circular run of idle VPPs: (start, length)
    let mut best = (0usize, 0usize);
    let mut run = 0usize;
    for i in 0..2 * vpps {
        if busy[i % vpps] {
            run = 0;
        } else {
            run += 1;
            if run > best.1 && run <= vpps {
                best = ((i + 1 - run) % vpps, run);
            }
        }
    }
    let (start, len) = if best.1 * 2 >= vpps && best.1 < vpps {
        best
    } else {
        (*next, vpps)
    };
    let weight = |p: &WideProduct| wide_work(p.op, p.rows, p.cols, p.count) as u128;
    let total: u128 = products.iter().map(weight).sum::<u128>().max(1);
    let shares: Vec<usize> = if products.len() > len {
        vec![len; products.len()]
    } else {
        let mut shares: Vec<usize> = products
            .iter()
            .map(|p| ((len as u128 * weight(p) / total) as usize).max(1))
            .collect();
        // rounding: take from the largest shares, give to the heaviest
        while shares.iter().sum::<usize>() > len {
            let at = (0..shares.len()).max_by_key(|&i| shares[i]).unwrap_or(0);
            shares[at] -= 1;
        }
        let mut order: Vec<usize> = (0..products.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(weight(&products[i])));
        let spare = len - shares.iter().sum::<usize>();
        for &i in order.iter().cycle().take(spare) {
            shares[i] += 1;
        }
        shares
    };
    let mut offset = 0usize;
    for (p, &share) in products.iter().zip(&shares) {
        let n = wide_tiles(p.op, p.rows, p.cols, p.count, share).clamp(1, share);
        let first = (start + offset) % vpps;
        ranges.push((first, n));
        *next = (first + n) % vpps;
        if products.len() <= len {
            offset += share;
        }
    }
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

/// What a simulated run did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Simulation {
    /// Task ids in the order they completed (on the last of their VPPs).
    pub order: Vec<u32>,
    /// Every `(vpp, task)` execution, in simulated time order.
    pub executions: Vec<(u32, u32)>,
    /// Final signal count of each barrier.
    pub barrier_counts: Vec<u32>,
    /// Instructions executed, control instructions included.
    pub steps: usize,
}

/// Runs `schedule`'s packed scripts on the CPU, one instruction per turn,
/// visiting the VPPs round-robin, and returns the order in which tasks
/// completed. See [`simulate_with`] for the checks.
pub fn simulate(schedule: &BatchScripts, g: &VppTaskGraph) -> Result<Vec<u32>> {
    let mut last: Option<u32> = None;
    let sim = simulate_with(schedule, g, |runnable| {
        let at = last
            .and_then(|p| runnable.iter().position(|&v| v > p))
            .unwrap_or(0);
        last = runnable.get(at).copied();
        at
    })?;
    Ok(sim.order)
}

/// One VPP's place in its decoded script.
struct Cursor {
    instrs: Vec<Instr>,
    pc: usize,
    task: usize,
}

fn sim_err(message: String) -> CoreError {
    CoreError::vpps("simulation", message)
}

/// Runs `schedule`'s packed scripts on the CPU. Before each instruction,
/// `choose` gets the VPPs that can run (not finished, not blocked on a `WAIT`
/// whose barrier is short of its expectation), ascending, and returns the
/// position of the one that runs next (taken modulo the list's length).
///
/// Errors when the graph has a forward dependency, the scripts deadlock, a
/// barrier is unknown or signalled more often than expected, an instruction
/// does not match the task [`BatchScripts::vpp_tasks`] says it runs (opcode, arg,
/// operands, or for a merged instruction the operand-pool slice), a task runs
/// before all its dependencies completed on all their VPPs, or a task does
/// not run on exactly the VPPs of [`BatchScripts::task_vpps`].
pub fn simulate_with(
    schedule: &BatchScripts,
    g: &VppTaskGraph,
    mut choose: impl FnMut(&[u32]) -> usize,
) -> Result<Simulation> {
    let packed = &schedule.packed;
    let n = g.tasks.len();
    if schedule.task_vpps.len() != n || schedule.vpp_tasks.len() != packed.vpps {
        return Err(sim_err(format!(
            "schedule for {} tasks on {} VPPs does not match a graph of {n} tasks and {} scripts",
            schedule.task_vpps.len(),
            schedule.vpp_tasks.len(),
            packed.vpps
        )));
    }
    for (i, t) in g.tasks.iter().enumerate() {
        check_task(i, t)?;
    }
    let mut cursors = Vec::with_capacity(packed.vpps);
    for v in 0..packed.vpps {
        cursors.push(Cursor {
            instrs: packed.decode_script(v)?,
            pc: 0,
            task: 0,
        });
    }
    let expect = packed.barrier_expects();
    let pool = packed.operand_pool();
    let mut counts = vec![0u32; packed.barriers];
    let mut done = vec![0usize; n];
    let mut sim = Simulation {
        order: Vec::new(),
        executions: Vec::new(),
        barrier_counts: Vec::new(),
        steps: 0,
    };
    let mut runnable: Vec<u32> = Vec::with_capacity(packed.vpps);
    loop {
        runnable.clear();
        let mut blocked = Vec::new();
        for (v, c) in cursors.iter().enumerate() {
            let Some(instr) = c.instrs.get(c.pc) else {
                continue;
            };
            if instr.op == OP_WAIT {
                let b = usize::from(instr.arg);
                let (Some(&have), Some(&want)) = (counts.get(b), expect.get(b)) else {
                    return Err(sim_err(format!("vpp {v} waits on unknown barrier {b}")));
                };
                if have < want {
                    blocked.push(format!("vpp {v} waits on barrier {b} ({have} of {want})"));
                    continue;
                }
            }
            runnable.push(v as u32);
        }
        if runnable.is_empty() {
            if blocked.is_empty() {
                break;
            }
            return Err(sim_err(format!("deadlock: {}", blocked.join("; "))));
        }
        let v = runnable[choose(&runnable) % runnable.len()] as usize;
        let c = &mut cursors[v];
        let instr = &c.instrs[c.pc];
        c.pc += 1;
        sim.steps += 1;
        match instr.op {
            OP_WAIT => {}
            OP_SIGNAL => {
                let b = usize::from(instr.arg);
                let (Some(have), Some(&want)) = (counts.get_mut(b), expect.get(b)) else {
                    return Err(sim_err(format!("vpp {v} signals unknown barrier {b}")));
                };
                *have += 1;
                if *have > want {
                    return Err(sim_err(format!(
                        "vpp {v} signals barrier {b} beyond its expected {want}"
                    )));
                }
            }
            op if op < OP_FIRST_ENGINE => {
                return Err(sim_err(format!(
                    "vpp {v}: reserved opcode {op} at instruction {}",
                    c.pc - 1
                )));
            }
            _ => {
                let tasks = &schedule.vpp_tasks[v];
                let Some(&first) = tasks.get(c.task) else {
                    return Err(sim_err(format!(
                        "vpp {v}: instruction {} has no scheduled task",
                        c.pc - 1
                    )));
                };
                let task = g.tasks.get(first as usize).ok_or_else(|| {
                    sim_err(format!(
                        "vpp {v}: scheduled task {first} is not in the graph"
                    ))
                })?;
                let mismatch = |what: &str| {
                    sim_err(format!(
                        "vpp {v}: instruction {} does not match task {first}: {what}",
                        c.pc - 1
                    ))
                };
                if instr.op != task.op || instr.arg != task.arg {
                    return Err(mismatch("opcode or arg"));
                }
                let ran: &[u32] = if let Placement::Holders { .. } = task.placement {
                    // the merged items: inline after the count, or at an
                    // offset of the operand pool
                    // (a wide one's VPP range follows the count)
                    let skip = match instr.operands.first() {
                        Some(&count) if count & WIDE_ITEMS != 0 => 1,
                        _ => 0,
                    };
                    let (count, items): (u32, &[u32]) = match instr.operands[..] {
                        [count, ..] if count & INLINE_ITEMS != 0 => (
                            count & !(INLINE_ITEMS | WIDE_ITEMS),
                            instr.operands.get(1 + skip..).unwrap_or(&[]),
                        ),
                        [count, .., offset] if instr.operands.len() == 2 + skip => (
                            count & !WIDE_ITEMS,
                            pool.get(offset as usize..).unwrap_or(&[]),
                        ),
                        _ => {
                            return Err(mismatch(
                                "a merged instruction needs [count, offset] or inline items",
                            ))
                        }
                    };
                    // tasks merged into the instruction: `count` tasks, or
                    // as many as carry `count` items
                    let merged = match schedule.holder_item {
                        0 => count as usize,
                        item => {
                            let (mut items, mut k) = (0usize, 0usize);
                            while items < count as usize {
                                let t = tasks.get(c.task + k).ok_or_else(|| {
                                    mismatch("count runs past the scheduled tasks")
                                })?;
                                let words =
                                    g.tasks.get(*t as usize).map_or(0, |x| x.operands.len());
                                items += words / item;
                                k += 1;
                            }
                            if items != count as usize {
                                return Err(mismatch("count splits a task's items"));
                            }
                            k
                        }
                    };
                    let ran = tasks
                        .get(c.task..c.task + merged)
                        .ok_or_else(|| mismatch("count runs past the scheduled tasks"))?;
                    let mut at = 0;
                    for &t in ran {
                        let other = g.tasks.get(t as usize).ok_or_else(|| {
                            sim_err(format!("vpp {v}: scheduled task {t} is not in the graph"))
                        })?;
                        if other.op != task.op
                            || other.arg != task.arg
                            || other.placement != task.placement
                        {
                            return Err(mismatch("merged tasks differ in opcode, arg or matrix"));
                        }
                        let end = at + other.operands.len();
                        if items.get(at..end) != Some(&other.operands[..]) {
                            return Err(mismatch("merged operand items"));
                        }
                        at = end;
                    }
                    ran
                } else {
                    if instr.operands != task.operands {
                        return Err(mismatch("operands"));
                    }
                    std::slice::from_ref(&tasks[c.task])
                };
                c.task += ran.len();
                for &t in ran {
                    let tu = t as usize;
                    for &d in &g.tasks[tu].deps {
                        let du = d as usize;
                        if done[du] < schedule.task_vpps[du].len() {
                            return Err(sim_err(format!(
                                "task {t} ran on vpp {v} before its dependency {d} completed \
                                 ({} of {} VPPs)",
                                done[du],
                                schedule.task_vpps[du].len()
                            )));
                        }
                    }
                    if !schedule.task_vpps[tu].contains(&(v as u32)) {
                        return Err(sim_err(format!(
                            "task {t} ran on vpp {v}, not one of its VPPs {:?}",
                            schedule.task_vpps[tu]
                        )));
                    }
                    done[tu] += 1;
                    sim.executions.push((v as u32, t));
                    if done[tu] == schedule.task_vpps[tu].len() {
                        sim.order.push(t);
                    }
                }
            }
        }
    }
    for (v, c) in cursors.iter().enumerate() {
        if c.task != schedule.vpp_tasks[v].len() {
            return Err(sim_err(format!(
                "vpp {v} finished its script after {} of its {} tasks",
                c.task,
                schedule.vpp_tasks[v].len()
            )));
        }
    }
    if let Some(t) = (0..n).find(|&t| done[t] != schedule.task_vpps[t].len() || done[t] == 0) {
        return Err(sim_err(format!(
            "task {t} ran {} times, scheduled on VPPs {:?}",
            done[t], schedule.task_vpps[t]
        )));
    }
    sim.barrier_counts = counts;
    Ok(sim)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(op: u8, operands: &[u32], deps: &[u32], load: u64, placement: Placement) -> VppTask {
        VppTask {
            op,
            arg: 0,
            operands: operands.to_vec(),
            deps: deps.to_vec(),
            load,
            placement,
        }
    }

    /// Four VPPs; matrix 0 cached on all of them, matrix 1 on VPPs 1 and 2
    /// (the setting of VPPS Fig. 6d).
    fn fig6_scheduler() -> Scheduler {
        Scheduler {
            vpps: 4,
            holders: vec![vec![0, 1, 2, 3], vec![1, 2]],
            holder_rows: vec![vec![8; 4], vec![8; 2]],
            matrix_load_factor: 1,
            chain: false,
            defer_terminal: false,
            // the figure balances the batch's accumulated load
            balance_per_level: false,
            record: true,
            holder_item: 0,
            wide_items: None,
            matrix_shapes: Vec::new(),
        }
    }

    fn fig6_graph() -> VppTaskGraph {
        let h0 = Placement::Holders { matrix: 0 };
        let mut g = VppTaskGraph::new();
        g.push(task(20, &[100], &[], 5, Placement::Any)).unwrap();
        g.push(task(16, &[10, 11], &[], 4, h0)).unwrap();
        g.push(task(16, &[12, 13], &[], 4, h0)).unwrap();
        g.push(task(
            16,
            &[14, 15],
            &[],
            2,
            Placement::Holders { matrix: 1 },
        ))
        .unwrap();
        g.push(task(21, &[200], &[0, 1], 1, Placement::Any))
            .unwrap();
        g.push(task(30, &[], &[4], 1, Placement::Every)).unwrap();
        g
    }

    #[test]
    fn wide_products_go_to_a_rotating_range_of_vpps_one_per_tile() {
        let mut scheduler = fig6_scheduler();
        scheduler.holder_item = 3;
        scheduler.wide_items = Some(3);
        // matrix 1: 128 rows, so a product has two row tiles (32 columns:
        // too shallow a reduction to split)
        scheduler.matrix_shapes = vec![(8, 8), (128, 32)];
        let h1 = Placement::Holders { matrix: 1 };
        let mut g = VppTaskGraph::new();
        // three items on matrix 1 (held by VPPs 1 and 2): wide, two tiles;
        // then two items on it a level later: narrow, on the holders
        g.push(task(OP_FIRST_ENGINE, &[1, 2, 3, 4, 5, 6], &[], 1, h1))
            .unwrap();
        g.push(task(OP_FIRST_ENGINE, &[7, 8, 9], &[], 1, h1))
            .unwrap();
        g.push(task(17, &[10, 11, 12, 13, 14, 15], &[0, 1], 1, h1))
            .unwrap();
        let s = scheduler.schedule(&g).unwrap();
        assert_eq!(wide_tiles(OP_FIRST_ENGINE, 128, 32, 3, 4), 2);
        let p = |op, len, arg| preamble(op, len, arg);
        let wide = [
            p(OP_FIRST_ENGINE, 12, 0),
            3 | INLINE_ITEMS | WIDE_ITEMS,
            2 << 16, // VPPs 0 and 1
            1,
            2,
            3,
            4,
            5,
            6,
            7,
            8,
            9,
        ];
        let narrow = [p(17, 8, 0), 2 | INLINE_ITEMS, 10, 11, 12, 13, 14, 15];
        let (signal, wait) = (p(OP_SIGNAL, 1, 0), p(OP_WAIT, 1, 0));
        assert_eq!(s.packed.script(0), &[&wide[..], &[signal]].concat()[..]);
        assert_eq!(
            s.packed.script(1),
            &[&wide[..], &[signal, wait], &narrow[..]].concat()[..]
        );
        assert_eq!(s.packed.script(2), &[&[wait][..], &narrow[..]].concat()[..]);
        assert!(s.packed.script(3).is_empty());
        assert_eq!(s.packed.barrier_expects(), &[2]);
        assert_eq!(s.task_vpps[0], vec![0, 1]);
        assert_eq!(s.task_vpps[2], vec![1, 2]);
        assert_eq!(simulate(&s, &g).unwrap().len(), 3);
        // a long list goes to the operand pool; two wide products of a
        // level share the VPPs in proportion to their work
        let items: Vec<u32> = (0..30).collect();
        let mut g = VppTaskGraph::new();
        g.push(task(OP_FIRST_ENGINE, &items, &[], 1, h1)).unwrap();
        g.push(task(OP_FIRST_ENGINE + 1, &items, &[], 1, h1))
            .unwrap();
        g.push(task(OP_FIRST_ENGINE + 1, &items[..3], &[], 1, h1))
            .unwrap();
        scheduler.matrix_shapes = vec![(8, 8), (64, 96)];
        let s = scheduler.schedule(&g).unwrap();
        // MATVEC (10 items) gets one VPP of four, MATVEC_T (the one-item
        // task merged in: 11 items) the other three: one row tile on VPP 0,
        // its reduction not split; 2 column tiles on VPPs 1 and 2
        let first = [p(OP_FIRST_ENGINE, 4, 0), 10 | WIDE_ITEMS, 1 << 16, 0];
        let second = [
            p(OP_FIRST_ENGINE + 1, 4, 0),
            11 | WIDE_ITEMS,
            1 | 2 << 16,
            30,
        ];
        assert_eq!(s.packed.script(0), &first[..]);
        assert_eq!(s.packed.script(1), &second[..]);
        assert_eq!(s.task_vpps[1], vec![1, 2]);
        assert!(s.packed.script(3).is_empty());
        assert_eq!(simulate(&s, &g).unwrap().len(), 3);
    }

    #[test]
    fn wide_ranges_share_the_vpps_the_level_leaves_idle() {
        let product = |count| WideProduct {
            op: OP_FIRST_ENGINE,
            rows: 1024,
            cols: 64,
            count,
        };
        // 32 tiles each: more than any share, so each fills its share
        assert_eq!(wide_tiles(OP_FIRST_ENGINE, 1024, 64, 100, 8), 32);
        let mut ranges = Vec::new();
        let mut next = 5;
        // VPPs 0 and 7 busy: the region is 1..=6, shared 1 : 3 by work
        // (1.5 and 4.5 rounded down, the spare VPP to the heavier)
        let mut busy = [false; 8];
        busy[0] = true;
        busy[7] = true;
        deal_wide_ranges(&busy, &mut next, &[product(100), product(300)], &mut ranges);
        assert_eq!(ranges, vec![(1, 1), (2, 5)]);
        // the idle run may wrap around: VPPs 3 and 4 busy, region 5..=2
        let mut busy = [false; 8];
        busy[3] = true;
        busy[4] = true;
        deal_wide_ranges(&busy, &mut next, &[product(100)], &mut ranges);
        assert_eq!(ranges, vec![(5, 6)]);
        // nothing else at the level: every VPP, from where the last range
        // ended; a product with fewer pieces than VPPs takes only those
        next = 6;
        let small = WideProduct {
            op: OP_FIRST_ENGINE,
            rows: 128,
            cols: 32,
            count: 3,
        };
        assert_eq!(wide_tiles(OP_FIRST_ENGINE, 128, 32, 3, 8), 2);
        deal_wide_ranges(&[false; 8], &mut next, &[small], &mut ranges);
        assert_eq!(ranges, vec![(6, 2)]);
        assert_eq!(next, 0);
        // less than half idle: every VPP again (the level's other work is
        // spread over them), from `next`
        let mut busy = [true; 8];
        busy[2] = false;
        deal_wide_ranges(&busy, &mut next, &[product(100), product(100)], &mut ranges);
        assert_eq!(ranges, vec![(0, 4), (4, 4)]);
        // more products than VPPs: each may use all of them
        deal_wide_ranges(&[false; 2], &mut next, &[small, small, small], &mut ranges);
        assert_eq!(ranges.len(), 3);
        assert!(ranges.iter().all(|&(_, n)| (1..=2).contains(&n)));
    }

    #[test]
    fn a_levels_wide_products_share_the_vpps_by_tile_steps() {
        use crate::vpps::kernel::split_depth;
        // a Tree-LSTM level at h 512: U_iou h over 17 parents, U_f h over
        // their 34 children; one row of tiles each, U_iou three times the
        // tiles, so 3/4 of the VPPs (by multiply-adds it had 3/5: pieces 6
        // steps deep against U_f's 3)
        let u_iou = WideProduct {
            op: OP_FIRST_ENGINE,
            rows: 1536,
            cols: 512,
            count: 17,
        };
        let u_f = WideProduct {
            rows: 512,
            count: 34,
            ..u_iou
        };
        assert_eq!(wide_work(OP_FIRST_ENGINE, 1536, 512, 17), 24 * 32);
        assert_eq!(wide_work(OP_FIRST_ENGINE, 512, 512, 34), 8 * 32);
        let mut ranges = Vec::new();
        deal_wide_ranges(&[false; 264], &mut 0, &[u_iou, u_f], &mut ranges);
        assert_eq!(ranges, vec![(0, 192), (198, 64)]);
        // both split 512 columns 64 deep: 4 steps a piece
        assert_eq!(split_depth(512, 192 / 24), (8, 64));
        assert_eq!(split_depth(512, 64 / 8), (8, 64));
    }

    #[test]
    fn fig6_scripts() {
        let g = fig6_graph();
        let s = fig6_scheduler().schedule(&g).unwrap();
        assert_eq!(s.levels, 3);
        assert_eq!(s.task_levels, vec![0, 0, 0, 0, 1, 2]);
        let p = |op, len, arg| preamble(op, len, arg);
        let merged0 = [p(16, 3, 0), 2, 0];
        let merged1 = [p(16, 3, 0), 1, 4];
        let (s0, w0, s1, w1) = (p(1, 1, 0), p(2, 1, 0), p(1, 1, 1), p(2, 1, 1));
        let update = p(30, 1, 0);
        let vpp0 = [&merged0[..], &[p(20, 2, 0), 100, s0, w1, update]].concat();
        let vpp1 = [&merged0[..], &merged1[..], &[s0, w1, update]].concat();
        let vpp3 = [&merged0[..], &[s0, w0, p(21, 2, 0), 200, s1, w1, update]].concat();
        assert_eq!(s.packed.script(0), &vpp0[..]);
        assert_eq!(s.packed.script(1), &vpp1[..]);
        assert_eq!(s.packed.script(2), &vpp1[..]);
        assert_eq!(s.packed.script(3), &vpp3[..]);
        assert_eq!(s.packed.barrier_expects(), &[4, 1]);
        assert_eq!(s.packed.operand_pool(), &[10, 11, 12, 13, 14, 15]);
        // Holder loads: 8 x 8/32 = 2 each, matrix 1: 2 x 8/16 = 1; then the
        // Any tasks go to VPP 0 (tie, lowest index) and VPP 3.
        assert_eq!(s.loads, vec![8, 4, 4, 4]);
        assert_eq!(s.task_vpps[0], vec![0]);
        assert_eq!(s.task_vpps[3], vec![1, 2]);
        assert_eq!(s.task_vpps[4], vec![3]);
        assert_eq!(s.task_vpps[5], vec![0, 1, 2, 3]);
        assert_eq!(s.vpp_tasks[1], vec![1, 2, 3, 5]);
        let order = simulate(&s, &g).unwrap();
        assert_eq!(order.len(), 6);
        assert_eq!(order.last(), Some(&5));
    }

    #[test]
    fn simulator_catches_broken_scripts() {
        let g = fig6_graph();
        let s = fig6_scheduler().schedule(&g).unwrap();
        let repack = |s: &BatchScripts, scripts: Vec<Vec<u32>>, expect: &[u32], pool: &[u32]| {
            let mut t = s.clone();
            t.packed = PackedScripts::pack(&scripts, expect, pool).unwrap();
            t
        };
        let scripts: Vec<Vec<u32>> = (0..4).map(|v| s.packed.script(v).to_vec()).collect();
        let pool = s.packed.operand_pool().to_vec();
        // VPP 3 without its WAIT 0, running ahead of everyone else.
        let mut broken = scripts.clone();
        broken[3].remove(4);
        let t = repack(&s, broken, &[4, 1], &pool);
        let err = simulate_with(&t, &g, |r| r.len() - 1).unwrap_err();
        assert!(err.to_string().contains("before its dependency"), "{err}");
        // A graph that is not the scheduled one (and not a DAG).
        let mut other = g.clone();
        other.tasks[0].deps = vec![5];
        let err = simulate(&s, &other).unwrap_err();
        assert!(
            err.to_string().contains("task 0 depends on task 5"),
            "{err}"
        );
        // An expectation nobody meets.
        let t = repack(&s, scripts.clone(), &[4, 2], &pool);
        let err = simulate(&t, &g).unwrap_err();
        assert!(err.to_string().contains("deadlock"), "{err}");
        // Over-signalling.
        let t = repack(&s, scripts.clone(), &[3, 1], &pool);
        assert!(simulate(&t, &g).is_err());
        // A corrupted operand pool.
        let mut bad_pool = pool.clone();
        bad_pool[3] += 1;
        let t = repack(&s, scripts.clone(), &[4, 1], &bad_pool);
        let err = simulate(&t, &g).unwrap_err();
        assert!(err.to_string().contains("merged operand items"), "{err}");
        // A task dropped from a VPP's script.
        let mut broken = scripts;
        broken[0].truncate(3);
        let t = repack(&s, broken, &[4, 1], &pool);
        assert!(simulate(&t, &g).is_err());
    }

    #[test]
    fn invalid_graphs_are_rejected() {
        let mut g = VppTaskGraph::new();
        let err = g.push(task(16, &[], &[0], 1, Placement::Any)).unwrap_err();
        assert!(
            err.to_string().contains("task 0 depends on task 0"),
            "{err}"
        );
        let err = g
            .push(task(OP_WAIT, &[], &[], 1, Placement::Any))
            .unwrap_err();
        assert!(err.to_string().contains("opcode 2"), "{err}");
        let err = g
            .push(task(16, &[0; 255], &[], 1, Placement::Every))
            .unwrap_err();
        assert!(err.to_string().contains("255 operands"), "{err}");
        assert!(g.is_empty());
        // Many operands are fine through the pool.
        g.push(task(
            16,
            &[0; 300],
            &[],
            1,
            Placement::Holders { matrix: 1 },
        ))
        .unwrap();
        g.push(task(16, &[0; 2], &[], 1, Placement::Holders { matrix: 1 }))
            .unwrap();
        let err = fig6_scheduler().schedule(&g).unwrap_err();
        assert!(err.to_string().contains("300 and 2 operands"), "{err}");
        let err = Scheduler::with_vpps(4).schedule(&g).unwrap_err();
        assert!(
            err.to_string()
                .contains("task 0 runs on the holders of matrix 1"),
            "{err}"
        );
        // A hand-built graph with a forward edge.
        let g = VppTaskGraph {
            tasks: vec![
                task(16, &[], &[1], 1, Placement::Any),
                task(16, &[], &[], 1, Placement::Any),
            ],
        };
        let err = Scheduler::with_vpps(2).schedule(&g).unwrap_err();
        assert!(
            err.to_string().contains("task 0 depends on task 1"),
            "{err}"
        );
        let mut bad = fig6_scheduler();
        bad.holders[1] = vec![2, 1];
        assert!(bad.schedule(&VppTaskGraph::new()).is_err());
        bad.holders[1] = vec![1, 4];
        assert!(bad.schedule(&VppTaskGraph::new()).is_err());
        assert!(Scheduler::with_vpps(0)
            .schedule(&VppTaskGraph::new())
            .is_err());
    }

    #[test]
    fn empty_graph_gives_empty_scripts() {
        let s = Scheduler::with_vpps(3)
            .schedule(&VppTaskGraph::new())
            .unwrap();
        assert_eq!((s.levels, s.packed.barriers, s.packed.vpps), (0, 0, 3));
        assert!(s.packed.script(1).is_empty());
        assert!(simulate(&s, &VppTaskGraph::new()).unwrap().is_empty());
    }

    #[test]
    fn holder_tasks_of_item_pairs_merge_by_items() {
        let mut s = fig6_scheduler();
        s.holder_item = 2;
        let mut g = VppTaskGraph::new();
        let a = g
            .push(task(20, &[1, 2], &[], 1, Placement::Holders { matrix: 0 }))
            .unwrap();
        g.push(task(
            20,
            &[3, 4, 5, 6],
            &[],
            1,
            Placement::Holders { matrix: 0 },
        ))
        .unwrap();
        g.push(task(21, &[7], &[a], 1, Placement::Any)).unwrap();
        let sc = s.schedule(&g).unwrap();
        let first = sc.packed.decode_script(0).unwrap();
        assert_eq!(
            first[0].operands,
            [3 | INLINE_ITEMS, 1, 2, 3, 4, 5, 6],
            "three pairs inside one instruction"
        );
        assert!(sc.packed.operand_pool().is_empty());
        assert_eq!(simulate(&sc, &g).unwrap().len(), 3);
        // a list longer than the inline limit goes to the operand pool
        let mut long = g.clone();
        let many: Vec<u32> = (100..100 + MAX_INLINE_ITEM_WORDS as u32).collect();
        long.push(task(20, &many, &[], 1, Placement::Holders { matrix: 0 }))
            .unwrap();
        let sc = s.schedule(&long).unwrap();
        let first = sc.packed.decode_script(0).unwrap();
        let items = (6 + MAX_INLINE_ITEM_WORDS) / 2;
        assert_eq!(first[0].operands, [items as u32, 0]);
        assert_eq!(
            &sc.packed.operand_pool()[..8],
            &[1, 2, 3, 4, 5, 6, 100, 101]
        );
        assert_eq!(simulate(&sc, &long).unwrap().len(), 4);
        // the simulator checks inline items against the tasks'
        let mut bad = s.schedule(&g).unwrap();
        let mut scripts: Vec<Vec<u32>> = (0..bad.packed.vpps)
            .map(|v| bad.packed.script(v).to_vec())
            .collect();
        scripts[0][2] += 1;
        bad.packed = PackedScripts::pack(&scripts, bad.packed.barrier_expects(), &[]).unwrap();
        let err = simulate(&bad, &g).unwrap_err().to_string();
        assert!(err.contains("merged operand items"), "{err}");
        g.push(task(
            20,
            &[1, 2, 3],
            &[],
            1,
            Placement::Holders { matrix: 0 },
        ))
        .unwrap();
        let err = s.schedule(&g).unwrap_err().to_string();
        assert!(
            err.contains("not a positive multiple of 2-word items"),
            "{err}"
        );
    }

    #[test]
    fn only_one_task_that_only_a_sink_waits_for_chains_per_processor_and_level() {
        // a producer, four siblings nothing but the sink waits for, the sink
        let mut g = VppTaskGraph::new();
        g.push(task(16, &[0], &[], 1, Placement::Any)).unwrap();
        for k in 1..=4 {
            g.push(task(16, &[k], &[0], 1, Placement::Any)).unwrap();
        }
        g.push(task(16, &[5], &[0, 1, 2, 3, 4], 1, Placement::Any))
            .unwrap();
        let s = Scheduler::with_vpps(4).schedule(&g).unwrap();
        assert_eq!(s.task_levels, vec![0, 0, 1, 1, 1, 2]);
        assert_eq!(s.task_vpps[1], s.task_vpps[0], "the first sibling chains");
        let spread: std::collections::BTreeSet<u32> = (2..5).map(|t| s.task_vpps[t][0]).collect();
        assert_eq!(spread.len(), 3, "the others run side by side");
        assert_eq!(simulate(&s, &g).unwrap().len(), 6);
    }

    #[test]
    fn tasks_only_a_sink_waits_for_run_at_the_end() {
        // a three-level chain, a sum of its first task's rows that only
        // the sink waits for, the sink
        let mut g = VppTaskGraph::new();
        g.push(task(16, &[0], &[], 1, Placement::Any)).unwrap();
        g.push(task(16, &[1], &[0], 1, Placement::Any)).unwrap();
        g.push(task(16, &[2], &[1], 1, Placement::Any)).unwrap();
        g.push(task(17, &[3], &[0], 1, Placement::Any)).unwrap();
        g.push(task(16, &[4], &[0, 1, 2, 3], 1, Placement::Any))
            .unwrap();
        let mut s = Scheduler::with_vpps(2);
        s.chain = false;
        let deferred = s.schedule(&g).unwrap();
        assert_eq!(deferred.task_levels, vec![0, 1, 2, 2, 3]);
        assert_ne!(
            deferred.task_vpps[3], deferred.task_vpps[2],
            "beside the last level's work"
        );
        assert_eq!(simulate(&deferred, &g).unwrap().len(), 5);
        s.defer_terminal = false;
        assert_eq!(s.schedule(&g).unwrap().task_levels, vec![0, 1, 2, 1, 3]);
    }

    #[test]
    fn products_only_a_sink_waits_for_run_together_at_the_end() {
        // a backward pass's end: two levels' weight-gradient outer products
        // (tasks 1 and 4, on the holders of different matrices) that only
        // the sink waits for
        let mut g = VppTaskGraph::new();
        let (h0, h1) = (
            Placement::Holders { matrix: 0 },
            Placement::Holders { matrix: 1 },
        );
        g.push(task(20, &[0], &[], 1, Placement::Any)).unwrap();
        g.push(task(18, &[1], &[0], 1, h1)).unwrap();
        g.push(task(17, &[2], &[0], 1, h0)).unwrap();
        g.push(task(20, &[3], &[2], 1, Placement::Any)).unwrap();
        g.push(task(18, &[4], &[3], 1, h0)).unwrap();
        g.push(task(27, &[], &[0, 1, 2, 3, 4], 1, Placement::Any))
            .unwrap();
        let mut s = fig6_scheduler();
        s.defer_terminal = true;
        let deferred = s.schedule(&g).unwrap();
        assert_eq!(deferred.task_levels, vec![0, 3, 1, 2, 3, 4]);
        assert_eq!(simulate(&deferred, &g).unwrap().len(), 6);
        s.defer_terminal = false;
        assert_eq!(s.schedule(&g).unwrap().task_levels, vec![0, 1, 1, 2, 3, 4]);
        // an update on every VPP that waits for the outer product only
        // still runs after the transposed product nothing waits for (it
        // overwrites the weights that product reads)
        let mut g = VppTaskGraph::new();
        g.push(task(16, &[0], &[], 1, h0)).unwrap();
        g.push(task(17, &[1], &[0], 1, h0)).unwrap();
        g.push(task(18, &[2], &[0], 1, h0)).unwrap();
        g.push(task(19, &[], &[2], 1, Placement::Every)).unwrap();
        s.defer_terminal = true;
        assert_eq!(s.schedule(&g).unwrap().task_levels, vec![0, 1, 1, 2]);
    }

    #[test]
    fn barrier_limit() {
        let chain = |n: u32| {
            let mut g = VppTaskGraph::new();
            for i in 0..n {
                let deps = if i == 0 { vec![] } else { vec![i - 1] };
                g.push(task(16, &[i], &deps, 1, Placement::Any)).unwrap();
            }
            g
        };
        let mut unchained = Scheduler::with_vpps(2);
        unchained.chain = false;
        let s = unchained.schedule(&chain(65536)).unwrap();
        assert_eq!(s.packed.barriers, MAX_BARRIERS);
        assert_eq!(s.packed.barrier_expect(65534), Some(1));
        let err = unchained.schedule(&chain(65537)).unwrap_err();
        assert!(err.to_string().contains("65537 levels"), "{err}");
        // chained, the same dependency chain is one processor's one level
        let s = Scheduler::with_vpps(2).schedule(&chain(65537)).unwrap();
        assert_eq!((s.levels, s.packed.barriers), (1, 0));
        assert!(s.task_vpps.iter().all(|v| v == &s.task_vpps[0]));
        assert_eq!(simulate(&s, &chain(65537)).unwrap().len(), 65537);
    }

    #[test]
    fn min_load_matches_a_scan() {
        for n in [1usize, 2, 3, 5, 8, 13] {
            let mut m = MinLoad::new(n);
            let mut naive = vec![0u64; n];
            for step in 0..200u64 {
                let want = (0..n).min_by_key(|&v| (naive[v], v)).unwrap_or(0);
                assert_eq!(m.argmin() as usize, want, "n {n} step {step}");
                let v = ((step * 7 + 3) % n as u64) as usize;
                let amount = (step * 31) % 11;
                m.add(v, amount);
                naive[v] += amount;
            }
        }
    }
}
