//! The compiled inference engine on the CPU (Cortex's CPU back end): the
//! same linearized schedule ([`ramus_graph::Linearizer`]) and the same
//! lowered cells ([`ramus_core::lower`]) as the CUDA compiled engine, run
//! level by level with every node of a level at once.
//!
//! Per level, a cell's vectors become row blocks (one row per node or per
//! child edge), its dot products one packed GEMM per input and weight (the
//! weight rows of every unit lane a group reads, packed once at load: the
//! CPU's model persistence), its unit scalars `rows × units` blocks run
//! through the ops' vectorized kernels, child sums segment sums over the
//! level's CSR edges. Leaves read a per-token table built at load (leaf
//! specialization), and the internal cell's values that depend on the
//! token alone another (hoisting, [`ramus_core::lower::CellProgram::hoist_token_values`]).
//! All buffers are kept between calls, so a steady stream of batches
//! allocates nothing once they have grown. Large products and elementwise
//! passes split over a spinning helper thread.

use crate::parallel::SpinHelper;
use ramus_core::recursion::{lower_scheduled, Backend, RecursionSchedule, ResolvedRecursion};
use ramus_core::{Model, Params, VertexRules};
use ramus_graph::{InputGraph, LinearBatch, Linearizer, UnrolledPlan, NO_CHILD};

use ramus_exec::Result;

mod cell;
use cell::{err, tabulate, Cell, LevelInputs, Nodes, TABLE_CHUNK};

/// Child state rows an unrolled step keeps together in one tile (children
/// pass, then their parents): about a core's L2 share, so the parents read
/// their children's fresh rows from cache.
pub const UNROLL_TILE_BYTES: usize = 256 << 10;

/// Tokens [`CpuCompiledEngine::estimate_setup_seconds`] tabulates: three
/// chunks.
pub const SETUP_SAMPLE_TOKENS: usize = 3 * TABLE_CHUNK;

/// The CPU compiled engine's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuCompiledSchedule {
    /// Leaf specialization with hoisting: per-token tables built at load.
    pub leaf_table: bool,
    /// Recursive refactoring and unrolling (`None`: the best known default,
    /// [`RecursionSchedule::resolve`] with [`Backend::Cpu`]).
    pub recursion: RecursionSchedule,
}

impl Default for CpuCompiledSchedule {
    fn default() -> Self {
        CpuCompiledSchedule {
            leaf_table: true,
            recursion: RecursionSchedule::default(),
        }
    }
}

/// What a node-list pass reads besides its nodes: the parameters, the
/// batch, the leaf table and the state and push widths.
struct ListInputs<'a> {
    params: &'a [Vec<f32>],
    batch: &'a LinearBatch,
    table: Option<&'a (Vec<f32>, Vec<f32>)>,
    widths: (usize, usize),
}

/// Runs `cell` on the nodes `nodes` (any order; their children computed
/// already) and writes their state and pushed rows into `state` / `push`
/// (through `out`, since the cell reads `state` meanwhile).
fn run_node_list(
    cell: &mut Cell,
    inputs: &ListInputs<'_>,
    nodes: &[u32],
    state: &mut [f32],
    push: &mut [f32],
    out: &mut (Vec<f32>, Vec<f32>),
) -> Result<()> {
    let rows = nodes.len();
    if rows == 0 {
        return Ok(());
    }
    let ListInputs {
        params,
        batch,
        table,
        widths: (s, p),
    } = *inputs;
    let ni = batch.num_internal();
    out.0.resize(rows * s, 0.0);
    out.1.resize(rows * p, 0.0);
    {
        let tokens = batch.tokens();
        let st: &[f32] = state;
        let child_row = |c: u32| -> &[f32] {
            let c = c as usize;
            match table {
                Some((t, _)) if c >= ni => &t[tokens[c] as usize * s..(tokens[c] as usize + 1) * s],
                _ => &st[c * s..(c + 1) * s],
            }
        };
        let level = LevelInputs {
            nodes: Nodes::List(nodes),
            batch,
            child_row: &child_row,
            head_input: None,
            token_of: None,
        };
        let (os, op) = (&mut out.0, &mut out.1);
        cell.run(params, &level, &mut |o, r, row| match o {
            0 => os[r * s..(r + 1) * s].copy_from_slice(row),
            _ => op[r * p..(r + 1) * p].copy_from_slice(row),
        })?;
    }
    for (r, &n) in nodes.iter().enumerate() {
        let n = n as usize;
        state[n * s..(n + 1) * s].copy_from_slice(&out.0[r * s..(r + 1) * s]);
        push[n * p..(n + 1) * p].copy_from_slice(&out.1[r * p..(r + 1) * p]);
    }
    Ok(())
}

/// Root scores of a batch (see the CUDA engine's `CompiledOutput`).
#[derive(Clone, Debug, Default)]
pub struct CpuCompiledOutput {
    pub scores: Vec<f32>,
    pub classes: usize,
    pub root_graph: Vec<u32>,
}

/// The compiled inference engine on the CPU; see the module docs.
pub struct CpuCompiledEngine {
    leaf: Cell,
    internal: Cell,
    head: Cell,
    params: Vec<Vec<f32>>,
    /// Per-token leaf state and pushed rows.
    table: Option<(Vec<f32>, Vec<f32>)>,
    vocab: Option<usize>,
    state_width: usize,
    push_width: usize,
    classes: usize,
    /// What a vertex must be to run (checked before linearizing).
    rules: VertexRules,
    linearizer: Linearizer,
    state: Vec<f32>,
    push: Vec<f32>,
    table_seconds: f64,
    /// The tables' seconds for the whole vocabulary at their median
    /// chunk's rate (an estimate's sample tabulates a few chunks only).
    full_table_seconds: f64,
    /// Refactoring and unrolling in effect.
    recursion: ResolvedRecursion,
    /// The unrolled groups of the current batch.
    plan: UnrolledPlan,
    /// Rows a node-list pass computes before they are scattered.
    list_rows: (Vec<f32>, Vec<f32>),
    /// A spinning second thread that takes half of each large product and
    /// elementwise pass (latency: a split costs well under a microsecond).
    helper: Option<SpinHelper>,
}

impl CpuCompiledEngine {
    /// Lowers `model`'s cells, packs their weights and (with `leaf_table`
    /// and a token vocabulary) tabulates the leaf cell over every token;
    /// refactoring and unrolling as the model's default
    /// ([`CpuCompiledEngine::with_schedule`]).
    pub fn new(model: &Model, params: &Params<f32>, leaf_table: bool) -> Result<Self> {
        Self::with_schedule(
            model,
            params,
            &CpuCompiledSchedule {
                leaf_table,
                recursion: RecursionSchedule::default(),
            },
        )
    }

    /// The engine under `schedule`: refactoring rewrites the cells before
    /// they are lowered ([`ramus_core::recursion`]); unrolling runs each
    /// pair of levels as children-then-parents tiles of the
    /// [`UnrolledPlan`]'s groups (at most [`UNROLL_TILE_BYTES`] of child
    /// states per tile) instead of one level at a time.
    pub fn with_schedule(
        model: &Model,
        params: &Params<f32>,
        schedule: &CpuCompiledSchedule,
    ) -> Result<Self> {
        Self::build(model, params, schedule, None)
    }

    /// Seconds [`CpuCompiledEngine::with_schedule`] is expected to take:
    /// the engine built with tables of only the first
    /// [`SETUP_SAMPLE_TOKENS`] tokens, each table's time taken as its
    /// median chunk of tokens times the chunks of the whole vocabulary
    /// (tabulating is linear in the tokens; the median leaves out the
    /// first chunk's warm-up and a preempted one).
    pub fn estimate_setup_seconds(
        model: &Model,
        params: &Params<f32>,
        schedule: &CpuCompiledSchedule,
    ) -> Result<f64> {
        let started = std::time::Instant::now();
        let sample = Self::build(model, params, schedule, Some(SETUP_SAMPLE_TOKENS))?;
        let whole = started.elapsed().as_secs_f64();
        Ok(whole - sample.table_seconds + sample.full_table_seconds)
    }

    /// The engine under `schedule`; with `sample`, its tables over only
    /// that many tokens (an estimate's sample).
    fn build(
        model: &Model,
        params: &Params<f32>,
        schedule: &CpuCompiledSchedule,
        sample: Option<usize>,
    ) -> Result<Self> {
        let leaf_table = schedule.leaf_table;
        let recursion = schedule
            .recursion
            .resolve(model, Backend::Cpu, leaf_table)?;
        let cells = lower_scheduled(model, recursion.refactor)?;
        let vocab = cells.vocab;
        let leaf = Cell::new(cells.leaf.program, params)?;
        let internal = Cell::new(cells.internal.program, params)?;
        let head = Cell::new(cells.head, params)?;
        let mut engine = CpuCompiledEngine {
            state_width: internal.program.output_width(0),
            push_width: internal.program.output_width(1),
            classes: head.program.output_width(0),
            leaf,
            internal,
            head,
            params: params.values.iter().map(|t| t.data().to_vec()).collect(),
            table: None,
            vocab,
            rules: VertexRules::of(model),
            linearizer: Linearizer::new(),
            state: Vec::new(),
            push: Vec::new(),
            table_seconds: 0.0,
            full_table_seconds: 0.0,
            recursion,
            plan: UnrolledPlan::new(),
            list_rows: (Vec::new(), Vec::new()),
            // without a helper thread the kernels fall back to rayon
            helper: if rayon::current_num_threads() > 1 {
                SpinHelper::new().ok()
            } else {
                None
            },
        };
        if let (true, Some(full)) = (leaf_table, vocab) {
            let v = sample.map_or(full, |n| n.min(full));
            // a table's median chunk, for every chunk of the vocabulary
            let whole = |chunk: f64| full.div_ceil(TABLE_CHUNK) as f64 * chunk;
            let started = std::time::Instant::now();
            let (tables, chunk) = tabulate(&mut engine.leaf, &engine.params, v)?;
            engine.full_table_seconds = whole(chunk);
            let mut tables = tables.into_iter();
            engine.table = tables.next().zip(tables.next());
            // hoisting: the internal cell's token-only values from a table
            if let Some(h) = engine.internal.program.hoist_token_values() {
                let mut builder = Cell::new(h.table, params)?;
                let (mut tables, chunk) = tabulate(&mut builder, &engine.params, v)?;
                engine.full_table_seconds += whole(chunk);
                let table = tables.pop().unwrap_or_default();
                let mut hoisted = Cell::new(h.program, params)?;
                hoisted.token_table = table;
                hoisted.token_width = h.width;
                engine.internal = hoisted;
            }
            engine.table_seconds = started.elapsed().as_secs_f64();
        }
        Ok(engine)
    }

    /// Seconds the leaf table took to build (0 without one).
    pub fn leaf_table_seconds(&self) -> f64 {
        self.table_seconds
    }

    /// The schedule in effect (every choice made; leaf tables need a
    /// token vocabulary).
    pub fn schedule(&self) -> CpuCompiledSchedule {
        CpuCompiledSchedule {
            leaf_table: self.table.is_some(),
            recursion: RecursionSchedule::fixed(self.recursion.refactor, self.recursion.unroll),
        }
    }

    /// Scores every root of `graphs`.
    pub fn infer(&mut self, graphs: &[&InputGraph]) -> Result<CpuCompiledOutput> {
        let rules = &self.rules;
        ramus_graph::check_structure(graphs.iter().copied(), |kind, children| {
            rules.check(kind, children)
        })?;
        match self.helper.take() {
            Some(h) => {
                let out = h.install(|| self.infer_levels(graphs));
                self.helper = Some(h);
                out
            }
            None => self.infer_levels(graphs),
        }
    }

    fn infer_levels(&mut self, graphs: &[&InputGraph]) -> Result<CpuCompiledOutput> {
        // the batch lives in the linearizer, taken out while the levels run
        let mut linearizer = std::mem::take(&mut self.linearizer);
        let out = match linearizer.linearize(graphs) {
            Ok(batch) => self.run_batch(batch),
            Err(e) => Err(err(format!("the batch cannot be linearized: {e}"))),
        };
        self.linearizer = linearizer;
        out
    }

    /// Runs a linearized batch: leaves, then the internal levels (unrolled
    /// or one at a time), then the head over the roots.
    fn run_batch(&mut self, batch: &LinearBatch) -> Result<CpuCompiledOutput> {
        if let Some(v) = self.vocab {
            if let Some(n) = batch.tokens().iter().position(|&t| t as usize >= v) {
                let (g, vertex) = batch.origin(n as u32);
                return Err(err(format!(
                    "graph {g} vertex {vertex}: token {} is beyond the model's {v} embedding rows",
                    batch.tokens()[n]
                )));
            }
        }
        let (s, p) = (self.state_width, self.push_width);
        let nodes = batch.num_nodes();
        // every row is written before it is read (levels run children
        // first; leaves with a table are read from the table): no clearing
        self.state.resize(nodes * s, 0.0);
        self.push.resize(nodes * p, 0.0);
        self.run_leaves(batch)?;
        if self.recursion.unroll {
            self.run_unrolled(batch)?;
        } else {
            self.run_levels(batch)?;
        }
        self.run_head(batch)
    }

    /// Leaves without a table: the leaf cell once over all of them.
    fn run_leaves(&mut self, batch: &LinearBatch) -> Result<()> {
        let (s, p) = (self.state_width, self.push_width);
        let (nodes, ni) = (batch.num_nodes(), batch.num_internal());
        if self.table.is_some() || ni >= nodes {
            return Ok(());
        }
        let no_rows = |_: u32| -> &[f32] { &[] };
        let level = LevelInputs {
            nodes: Nodes::Range(ni, nodes),
            batch,
            child_row: &no_rows,
            head_input: None,
            token_of: None,
        };
        let (state, push) = (&mut self.state, &mut self.push);
        self.leaf.run(&self.params, &level, &mut |o, r, row| {
            let n = ni + r;
            match o {
                0 => state[n * s..(n + 1) * s].copy_from_slice(row),
                _ => push[n * p..(n + 1) * p].copy_from_slice(row),
            }
        })
    }

    /// The internal nodes as the unrolled plan's steps: per tile of
    /// groups, the children, then their parents.
    fn run_unrolled(&mut self, batch: &LinearBatch) -> Result<()> {
        let s = self.state_width;
        self.plan
            .plan(batch)
            .map_err(|e| err(format!("the batch cannot be unrolled: {e}")))?;
        let plan = &self.plan;
        let inputs = ListInputs {
            params: &self.params,
            batch,
            table: self.table.as_ref(),
            widths: (s, self.push_width),
        };
        let begin = plan.group_child_begin();
        for step in 0..plan.num_steps() {
            let groups = plan.step(step);
            let mut g0 = groups.start;
            while g0 < groups.end {
                // a tile: groups whose children's rows fit the budget
                let mut g1 = g0 + 1;
                while g1 < groups.end
                    && (begin[g1 + 1] - begin[g0]) as usize * s * 4 <= UNROLL_TILE_BYTES
                {
                    g1 += 1;
                }
                let children = &plan.group_children()[begin[g0] as usize..begin[g1] as usize];
                // groups with a parent come first in a step
                let parents = &plan.group_parent()[g0..g1];
                let with_parent = parents.iter().take_while(|&&p| p != NO_CHILD).count();
                for nodes in [children, &parents[..with_parent]] {
                    run_node_list(
                        &mut self.internal,
                        &inputs,
                        nodes,
                        &mut self.state,
                        &mut self.push,
                        &mut self.list_rows,
                    )?;
                }
                g0 = g1;
            }
        }
        Ok(())
    }

    /// The internal nodes level by level, every node of a level at once.
    fn run_levels(&mut self, batch: &LinearBatch) -> Result<()> {
        let (s, p) = (self.state_width, self.push_width);
        let ni = batch.num_internal();
        for b in 0..batch.num_batches() {
            let range = batch.batch(b);
            let (lo, hi) = (range.start as usize, range.end as usize);
            // the level writes rows lo..hi and reads its children's, which
            // the linearizer numbers above every parent (at or after hi)
            let (front, children) = self.state.split_at_mut(hi * s);
            let level_state = &mut front[lo * s..];
            let level_push = &mut self.push[lo * p..hi * p];
            let table = self.table.as_ref();
            let tokens = batch.tokens();
            let child_row = |c: u32| -> &[f32] {
                let c = c as usize;
                match table {
                    Some((t, _)) if c >= ni => {
                        &t[tokens[c] as usize * s..(tokens[c] as usize + 1) * s]
                    }
                    _ => &children[(c - hi) * s..(c - hi + 1) * s],
                }
            };
            let level = LevelInputs {
                nodes: Nodes::Range(lo, hi),
                batch,
                child_row: &child_row,
                head_input: None,
                token_of: None,
            };
            self.internal
                .run(&self.params, &level, &mut |o, r, row| match o {
                    0 => level_state[r * s..(r + 1) * s].copy_from_slice(row),
                    _ => level_push[r * p..(r + 1) * p].copy_from_slice(row),
                })?;
        }
        Ok(())
    }

    /// The head over the roots' pushed rows: the batch's scores.
    fn run_head(&mut self, batch: &LinearBatch) -> Result<CpuCompiledOutput> {
        let p = self.push_width;
        let ni = batch.num_internal();
        let roots = batch.root_nodes();
        let classes = self.classes;
        let mut scores = vec![0.0; roots.len() * classes];
        let push = &self.push;
        let table = self.table.as_ref();
        let tokens = batch.tokens();
        let head_input = |r: usize| -> &[f32] {
            let n = roots[r] as usize;
            match table {
                Some((_, t)) if n >= ni => &t[tokens[n] as usize * p..(tokens[n] as usize + 1) * p],
                _ => &push[n * p..(n + 1) * p],
            }
        };
        let no_rows = |_: u32| -> &[f32] { &[] };
        let no_tok = |_: usize| 0u32;
        let level = LevelInputs {
            nodes: Nodes::Range(0, roots.len()),
            batch,
            child_row: &no_rows,
            head_input: Some(&head_input),
            token_of: Some(&no_tok),
        };
        self.head.run(&self.params, &level, &mut |_, r, row| {
            scores[r * classes..(r + 1) * classes].copy_from_slice(row);
        })?;
        Ok(CpuCompiledOutput {
            scores,
            classes,
            root_graph: roots.iter().map(|&r| batch.origin(r).0 as u32).collect(),
        })
    }
}
