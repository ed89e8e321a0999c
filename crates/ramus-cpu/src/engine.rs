//! The CPU batched engine (Cavs on the CPU) — the numerical reference.
//!
//! Forward: every vertex function first runs its *eager* ops once over all
//! of its rows (embeddings, input projections); then, task by task in
//! schedule order, one gather fills the task's `gather` rows from the vertex
//! state buffer, the *per-task* ops run on the task's contiguous row range
//! of each dynamic tensor, and one copy scatters the new states; finally the
//! *lazy* ops (e.g. what only feeds `push`) run once over all rows and the
//! head runs over the pushed values of its rows.
//!
//! Backward mirrors it: the head's backward seeds the push gradients, `∂F`'s
//! eager ops run once, tasks are popped in reverse with child gradients
//! scatter-added into the state-gradient buffer, and the lazy ops — the
//! weight-gradient GEMMs among them — run once over all tasks' rows (lazy
//! batching). Kernels split large ops over threads.
//!
//! A batch's dropout masks and pulled values are drawn in `engine/inputs.rs`;
//! the op nodes run, and their gradients are gathered, in `engine/nodes.rs`.

use std::collections::HashMap;

use crate::parallel::SpinHelper;
use ramus_core::graph::{Graph, NodeId, NodeKind, ParamId, Role, Source};
use ramus_core::plan::{token_hoist, TokenHoist};
use ramus_core::{Grads, HeadRows, Model, Params, Real};
use ramus_graph::{Schedule, NO_LABEL};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use ramus_exec::data_parallel::Collective;
use ramus_exec::{Batch, ExecError, ForwardOutput, Mode, Range, Result};

mod arena;
mod inputs;
mod nodes;
mod norm_sync;
use arena::{Arena, Packs, Span};
use inputs::{copy_vertex_rows, fill_dropout_masks};
use nodes::{
    accumulate_param_grads, ancestors, local_edges, resolve_floats, run_all_rows, run_node,
    run_nodes, running_stat_updates,
};
use norm_sync::{NormShare, NormSync};
use ramus_exec::memory::embedding_rows;
use ramus_exec::pulled_values;

/// The CPU batched engine. Holds its buffers between batches so steady-state
/// training does not reallocate.
pub struct CpuEngine<T> {
    fwd: Vec<Arena<T>>,
    bwd: Vec<Arena<T>>,
    head_fwd: Arena<T>,
    head_bwd: Arena<T>,
    state: Vec<T>,
    state_grad: Vec<T>,
    edge_local: Vec<u32>,
    head_vertices: Vec<u32>,
    pull_values: Option<Vec<T>>,
    pull_grads: Vec<Vec<T>>,
    forward_done: bool,
    rng: ChaCha8Rng,
    packs: Packs<T>,
    /// Version of the parameters the packs were made from.
    packs_source: (u64, u64),
    table_vocab: Option<usize>,
    tables: Option<TokenTables<T>>,
    spin: bool,
    helper: Option<SpinHelper>,
    /// New values of the running-statistics buffers from the last
    /// train-mode forward pass, not yet applied ([`CpuEngine::apply_running_stats`]).
    running_stats: Vec<(ParamId, Vec<T>)>,
    /// Synchronized batch normalisation's group handle (a data-parallel
    /// rank with `--sync-bn`).
    norm_sync: Option<NormShare<T>>,
}

/// Per-token tables of each vertex function's token-only values (see
/// [`ramus_core::plan::TokenHoist`]), valid for one parameter generation.
struct TokenTables<T> {
    /// Version of the parameters the tables were computed from.
    source: (u64, u64),
    vocab: usize,
    /// Per function: the hoisting plan, one `rows x width` table per
    /// tabulated node, the eager nodes that still run per batch, and the
    /// tabulated tokens `rows` (`vocab`, or fewer when the function's
    /// embedding tables are smaller: a character table beside a word one).
    functions: Vec<FunctionTables<T>>,
}

/// One function's share of [`TokenTables`].
struct FunctionTables<T> {
    hoist: TokenHoist,
    tables: Vec<Vec<T>>,
    kept: Vec<NodeId>,
    rows: usize,
}

impl<T: Real> Default for CpuEngine<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Real> CpuEngine<T> {
    pub fn new() -> Self {
        CpuEngine {
            fwd: Vec::new(),
            bwd: Vec::new(),
            head_fwd: Arena::default(),
            head_bwd: Arena::default(),
            state: Vec::new(),
            state_grad: Vec::new(),
            edge_local: Vec::new(),
            head_vertices: Vec::new(),
            pull_values: None,
            pull_grads: Vec::new(),
            forward_done: false,
            rng: ChaCha8Rng::seed_from_u64(0),
            packs: HashMap::new(),
            packs_source: (0, 0),
            table_vocab: None,
            tables: None,
            spin: rayon::current_num_threads() > 1,
            helper: None,
            running_stats: Vec::new(),
            norm_sync: None,
        }
    }

    /// Makes training passes normalise batches with the statistics of
    /// every rank's rows, summed through `collective` (another handle on
    /// the rank's data-parallel group, [`Collective::handle`]).
    pub fn sync_batch_norm(&mut self, collective: Box<dyn Collective<T>>) {
        self.norm_sync = Some(NormSync::share(collective));
    }

    /// Synchronized batch normalisation: before a step's passes on this
    /// rank's rows, or (`rows` false) in their stead, summing zeros where
    /// they would have summed statistics.
    pub(crate) fn start_norm_step(&mut self, rows: bool, params: &Params<T>) -> Result<()> {
        let Some(share) = &self.norm_sync else {
            return Ok(());
        };
        let mut sync = norm_sync::lock(share)?;
        if rows {
            sync.start_step();
        } else {
            self.running_stats = sync.stand_in(params)?;
        }
        Ok(())
    }

    /// The group handle for an arena of a pass in `mode`.
    fn norm_share(&self, mode: Mode) -> Option<NormShare<T>> {
        self.norm_sync.clone().filter(|_| mode == Mode::Train)
    }

    /// Leaf specialisation for evaluation and inference: with `Some(vocab)`,
    /// values that depend only on a vertex's token (e.g. a leaf's whole cell)
    /// are computed once per token id below `vocab` and looked up per batch.
    /// Tables are rebuilt whenever the parameters change (their generation);
    /// training passes never use them.
    pub fn use_token_tables(&mut self, vocab: Option<usize>) {
        self.table_vocab = vocab;
        self.tables = None;
    }

    /// Builds the token tables now if they are enabled and stale (so that a
    /// timed pass does not pay for it); returns whether tables were built.
    pub fn prepare_token_tables(&mut self, model: &Model, params: &Params<T>) -> Result<bool> {
        let Some(vocab) = self.table_vocab else {
            return Ok(false);
        };
        let fresh = self
            .tables
            .as_ref()
            .is_some_and(|t| t.source == params.version() && t.vocab == vocab);
        if fresh {
            return Ok(false);
        }
        const CHUNK: usize = 512;
        let mut functions = Vec::new();
        let mut packs = Packs::new();
        for func in &model.functions {
            let hoist = token_hoist(&func.forward);
            let g = &func.forward;
            let vocab = embedding_rows(model, g).map_or(vocab, |r| r.min(vocab));
            let mut tables: Vec<Vec<T>> = hoist
                .tabulated
                .iter()
                .map(|&n| vec![T::ZERO; vocab * g.nodes[n].ty.width()])
                .collect();
            if !hoist.tabulated.is_empty() {
                let mut arena = Arena::default();
                for start in (0..vocab).step_by(CHUNK) {
                    let rows = CHUNK.min(vocab - start);
                    arena.prepare(g, rows, 0);
                    fill_dropout_masks(g, &mut arena, false, &mut self.rng);
                    if let Some(tok) = g.input_node(Source::Token) {
                        for (i, t) in arena.idx[tok].iter_mut().enumerate() {
                            *t = (start + i) as u32;
                        }
                    }
                    let all = Range::rows_only(rows);
                    run_nodes(
                        g,
                        &hoist.build,
                        &mut arena,
                        None,
                        params,
                        Span::rows_only(all),
                        &mut packs,
                    )?;
                    for (table, &n) in tables.iter_mut().zip(&hoist.tabulated) {
                        let w = g.nodes[n].ty.width();
                        table[start * w..(start + rows) * w]
                            .copy_from_slice(&arena.vals[n][..rows * w]);
                    }
                }
            }
            let kept: Vec<NodeId> = func
                .forward_plan
                .eager
                .iter()
                .copied()
                .filter(|&n| hoist.keep[n])
                .collect();
            functions.push(FunctionTables {
                hoist,
                tables,
                kept,
                rows: vocab,
            });
        }
        self.tables = Some(TokenTables {
            source: params.version(),
            vocab,
            functions,
        });
        Ok(true)
    }

    /// Whether passes run with a spinning helper thread that takes half of
    /// each large kernel (default: on when the thread pool has 2+ threads).
    pub fn set_spin_helper(&mut self, on: bool) {
        self.spin = on;
        if !on {
            self.helper = None;
        }
    }

    /// Runs `f` with the spinning helper installed (started on first use).
    fn with_helper<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        if self.spin && self.helper.is_none() {
            // without a helper thread kernels fall back to rayon
            self.helper = SpinHelper::new().ok();
        }
        match self.helper.take() {
            Some(h) => {
                let r = h.install(|| f(self));
                self.helper = Some(h);
                r
            }
            None => f(self),
        }
    }

    /// Drops packed weights made from other parameter values.
    fn invalidate_packs(&mut self, params: &Params<T>) {
        let source = params.version();
        if source != self.packs_source {
            self.packs.clear();
            self.packs_source = source;
        }
    }

    /// Reseeds the stream dropout masks are drawn from.
    pub fn set_seed(&mut self, seed: u64) {
        self.rng = ChaCha8Rng::seed_from_u64(seed);
    }

    /// The stream dropout masks are drawn from, where it stands (saved in a
    /// resumable checkpoint).
    pub fn dropout_rng(&self) -> &ChaCha8Rng {
        &self.rng
    }

    /// Continues the dropout masks from `rng` (a resumed run).
    pub fn set_dropout_rng(&mut self, rng: ChaCha8Rng) {
        self.rng = rng;
    }

    /// Supplies `pull()` inputs, `width` floats per vertex number, in place
    /// of the graphs' own features (`None`: read the features).
    pub fn set_pull_values(&mut self, values: Option<Vec<T>>) {
        self.pull_values = values;
    }

    /// Gradients of `pull()` inputs from the last backward pass, per function, by row.
    pub fn pull_grads(&self) -> &[Vec<T>] {
        &self.pull_grads
    }

    /// Runs the forward pass over `batch`.
    pub fn forward(
        &mut self,
        model: &Model,
        params: &Params<T>,
        batch: &Batch<'_>,
        mode: Mode,
    ) -> Result<ForwardOutput<T>> {
        self.forward_rows(model, params, batch, mode, model.head.rows)
    }

    /// Runs the forward pass with the head applied to `rows` instead of the
    /// model's own choice (e.g. every labelled node for all-node accuracy).
    pub fn forward_rows(
        &mut self,
        model: &Model,
        params: &Params<T>,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<ForwardOutput<T>> {
        self.with_helper(|e| e.forward_pass(model, params, batch, mode, rows))
    }

    fn forward_pass(
        &mut self,
        model: &Model,
        params: &Params<T>,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<ForwardOutput<T>> {
        let s = &batch.schedule;
        self.invalidate_packs(params);
        let use_tables = mode != Mode::Train && self.table_vocab.is_some();
        if use_tables {
            self.prepare_token_tables(model, params)?;
        }
        let n_fn = model.functions.len();
        self.fwd.resize_with(n_fn, Arena::default);
        let w = model.state_width;
        self.state.clear();
        self.state.resize(s.num_vertices() * w, T::ZERO);
        for f in 0..n_fn {
            self.forward_eager(model, params, s, f, mode, use_tables)?;
        }
        self.forward_tasks(model, params, s)?;
        for (f, func) in model.functions.iter().enumerate() {
            let rows = &s.functions[f];
            run_all_rows(
                &func.forward,
                &func.forward_plan.lazy,
                &mut self.fwd[f],
                None,
                params,
                rows,
                &mut self.packs,
            )?;
        }
        let out = self.run_head(model, params, s, mode, rows)?;
        if mode == Mode::Train {
            let mut updates = Vec::new();
            for (f, func) in model.functions.iter().enumerate() {
                let rows = s.functions[f].rows();
                running_stat_updates(&func.forward, &self.fwd[f], params, rows, &mut updates)?;
            }
            let h = self.head_vertices.len();
            running_stat_updates(&model.head.forward, &self.head_fwd, params, h, &mut updates)?;
            self.running_stats = updates;
        }
        self.forward_done = mode == Mode::Train;
        Ok(out)
    }

    /// Function `f`'s rows before the tasks: its arena sized, dropout
    /// masks drawn, tokens and pulled values read, and its eager ops run
    /// (those read from the per-token tables when `use_tables`).
    fn forward_eager(
        &mut self,
        model: &Model,
        params: &Params<T>,
        s: &Schedule,
        f: usize,
        mode: Mode,
        use_tables: bool,
    ) -> Result<()> {
        let func = &model.functions[f];
        let rows = &s.functions[f];
        let share = self.norm_share(mode);
        let arena = &mut self.fwd[f];
        arena.prepare(&func.forward, rows.rows(), rows.edges());
        arena.inference = mode != Mode::Train;
        arena.norm_sync = share;
        fill_dropout_masks(&func.forward, arena, mode == Mode::Train, &mut self.rng);
        if let Some(tok) = func.forward.input_node(Source::Token) {
            for (dst, &v) in arena.idx[tok].iter_mut().zip(&rows.vertex) {
                *dst = s.tokens[v as usize];
            }
        }
        if let Some(pull) = func.forward.input_node(Source::Pull) {
            let pw = func.forward.nodes[pull].ty.width();
            let dst = &mut arena.vals[pull];
            // explicit pull values, else the graphs' own (f32) features,
            // converted for this function's rows only
            match &self.pull_values {
                Some(v) => {
                    let values = pulled_values(v, s, pw, &func.name, true)?;
                    copy_vertex_rows(dst, values, &rows.vertex, pw, |x| x);
                }
                None => {
                    let values = pulled_values(&s.features, s, pw, &func.name, false)?;
                    copy_vertex_rows(dst, values, &rows.vertex, pw, |x| T::from_f64(f64::from(x)));
                }
            }
        }
        let eager: &[NodeId] = match self
            .tables
            .as_ref()
            .filter(|_| use_tables)
            .map(|t| &t.functions[f])
        {
            Some(FunctionTables {
                hoist,
                tables,
                kept,
                rows: vocab,
            }) => {
                let vocab = *vocab;
                for (table, &n) in tables.iter().zip(&hoist.tabulated) {
                    let w = func.forward.nodes[n].ty.width();
                    for (r, &v) in rows.vertex.iter().enumerate() {
                        let t = s.tokens[v as usize] as usize;
                        if t >= vocab {
                            return Err(ExecError::Input(format!(
                                "token id {t} is outside the {vocab} tabulated tokens"
                            )));
                        }
                        arena.vals[n][r * w..(r + 1) * w]
                            .copy_from_slice(&table[t * w..(t + 1) * w]);
                    }
                }
                kept
            }
            None => &func.forward_plan.eager,
        };
        run_all_rows(
            &func.forward,
            eager,
            arena,
            None,
            params,
            rows,
            &mut self.packs,
        )?;
        Ok(())
    }

    /// The tasks in schedule order: each one's gather, its per-task ops
    /// and its scatter into the state buffer.
    fn forward_tasks(&mut self, model: &Model, params: &Params<T>, s: &Schedule) -> Result<()> {
        let w = model.state_width;
        for task in &s.tasks {
            let f = task.function;
            let func = &model.functions[f];
            let rows = &s.functions[f];
            let arena = &mut self.fwd[f];
            let range = Range::task(task);
            // gather: one copy pass per gathered symbol
            for (n, node) in func.forward.nodes.iter().enumerate() {
                match node.kind {
                    NodeKind::Input(Source::Gather(k)) => {
                        for r in range.r0..range.r1 {
                            let dst = &mut arena.vals[n][r * w..(r + 1) * w];
                            match rows.child(r, k) {
                                Some(c) => dst.copy_from_slice(
                                    &self.state[c as usize * w..(c as usize + 1) * w],
                                ),
                                None => dst.iter_mut().for_each(|x| *x = T::ZERO),
                            }
                        }
                    }
                    NodeKind::Input(Source::GatherAll) => {
                        for e in range.e0..range.e1 {
                            let c = rows.edge_child[e] as usize;
                            arena.vals[n][e * w..(e + 1) * w]
                                .copy_from_slice(&self.state[c * w..(c + 1) * w]);
                        }
                    }
                    _ => {}
                }
            }
            local_edges(
                &mut self.edge_local,
                &rows.edge_parent[range.e0..range.e1],
                range.r0,
            );
            run_nodes(
                &func.forward,
                &func.forward_plan.per_task,
                arena,
                None,
                params,
                Span {
                    range,
                    edge_parent: &self.edge_local,
                },
                &mut self.packs,
            )?;
            // scatter: the task's rows are contiguous in both the dynamic
            // tensor and the state buffer, so this is one copy
            if let Some(sc) = func.scatter {
                let src = &arena.vals[sc][range.r0 * w..range.r1 * w];
                self.state[task.begin as usize * w..(task.begin + task.len) as usize * w]
                    .copy_from_slice(src);
            }
        }
        Ok(())
    }

    /// Writes the running statistics of the last train-mode forward pass
    /// (batch normalisation with running statistics, see
    /// [`ramus_core::ops::BatchNorm`]) into their buffers in `params`, once;
    /// returns whether any buffer changed. The training step of `ramus_nn`'s
    /// engine interface calls this after its forward pass; a bare forward
    /// pass leaves the buffers as they are.
    pub fn apply_running_stats(&mut self, params: &mut Params<T>) -> Result<bool> {
        if self.running_stats.is_empty() {
            return Ok(false);
        }
        for (p, values) in self.running_stats.drain(..) {
            let target = params.values.get_mut(p).ok_or_else(|| {
                ExecError::Input(format!("running statistics for missing parameter {p}"))
            })?;
            if target.len() != values.len() {
                return Err(ExecError::Input(format!(
                    "running statistics of {} values for parameter {p} of {}",
                    values.len(),
                    target.len()
                )));
            }
            target.data_mut().copy_from_slice(&values);
        }
        params.touch();
        Ok(true)
    }

    fn run_head(
        &mut self,
        model: &Model,
        params: &Params<T>,
        s: &Schedule,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<ForwardOutput<T>> {
        let head = &model.head;
        self.head_vertices.clear();
        match rows {
            HeadRows::Roots => self.head_vertices.extend_from_slice(&s.roots),
            HeadRows::Labelled => self.head_vertices.extend(
                s.number
                    .iter()
                    .copied()
                    .filter(|&v| s.labels[v as usize] != NO_LABEL),
            ),
        }
        let h = self.head_vertices.len();
        if h == 0 {
            return Err(ExecError::Input(
                "the batch has no vertex for the head (no labelled vertex)".into(),
            ));
        }
        let g = &head.forward;
        self.head_fwd.prepare(g, h, 0);
        self.head_fwd.inference = mode != Mode::Train;
        self.head_fwd.norm_sync = self.norm_share(mode);
        fill_dropout_masks(g, &mut self.head_fwd, mode == Mode::Train, &mut self.rng);
        if let Some(inp) = g.input_node(Source::HeadInput) {
            let pw = g.nodes[inp].ty.width();
            for (i, &v) in self.head_vertices.iter().enumerate() {
                let (f, r) = (
                    s.vertex_function[v as usize] as usize,
                    s.vertex_row[v as usize] as usize,
                );
                let push = model.functions[f]
                    .push
                    .ok_or_else(|| ExecError::Input("no push".into()))?;
                self.head_fwd.vals[inp][i * pw..(i + 1) * pw]
                    .copy_from_slice(&self.fwd[f].vals[push][r * pw..(r + 1) * pw]);
            }
        }
        let needed = match (mode, head.logits) {
            (Mode::Infer, Some(l)) => ancestors(g, &[l]),
            (Mode::Infer, None) => vec![false; g.nodes.len()],
            (Mode::Train | Mode::Evaluate, _) => vec![true; g.nodes.len()],
        };
        if let Some(lab) = g.input_node(Source::Label) {
            if needed[lab] {
                for (i, &v) in self.head_vertices.iter().enumerate() {
                    let l = s.labels[v as usize];
                    if l < 0 {
                        let gi = s.graph[v as usize];
                        return Err(ExecError::Input(format!(
                            "graph {gi} of the batch has a head vertex without a label"
                        )));
                    }
                    self.head_fwd.idx[lab][i] = l as u32;
                }
            }
        }
        let all = Range::rows_only(h);
        for (n, node) in g.nodes.iter().enumerate() {
            if needed[n] && matches!(node.kind, NodeKind::Op(_)) {
                run_node(
                    g,
                    n,
                    &mut self.head_fwd,
                    None,
                    params,
                    Span::rows_only(all),
                    &mut self.packs,
                )?;
            }
        }
        let loss = (mode != Mode::Infer).then(|| self.head_fwd.vals[head.loss][0].to_f64());
        let (logits, classes) = match head.logits {
            Some(l) => (self.head_fwd.vals[l].clone(), g.nodes[l].ty.width()),
            None => (Vec::new(), 0),
        };
        Ok(ForwardOutput {
            loss,
            head_vertices: self.head_vertices.clone(),
            logits,
            classes,
        })
    }

    /// Runs the backward pass for the last `forward(.., Mode::Train)` and
    /// adds the parameter gradients into `grads`.
    pub fn backward(
        &mut self,
        model: &Model,
        params: &Params<T>,
        batch: &Batch<'_>,
        grads: &mut Grads<T>,
    ) -> Result<()> {
        self.with_helper(|e| e.backward_pass(model, params, batch, grads))
    }

    fn backward_pass(
        &mut self,
        model: &Model,
        params: &Params<T>,
        batch: &Batch<'_>,
        grads: &mut Grads<T>,
    ) -> Result<()> {
        if !std::mem::take(&mut self.forward_done) {
            return Err(ExecError::Input(
                "backward needs a preceding forward pass in train mode".into(),
            ));
        }
        let s = &batch.schedule;
        self.invalidate_packs(params);
        let w = model.state_width;
        self.backward_head(model, params, s, grads)?;
        self.state_grad.clear();
        self.state_grad.resize(s.num_vertices() * w, T::ZERO);
        for (f, func) in model.functions.iter().enumerate() {
            self.backward_all_rows(f, &func.backward, &func.backward_plan.eager, params, s)?;
        }
        self.backward_tasks(model, params, s)?;
        self.pull_grads.resize_with(model.functions.len(), Vec::new);
        for (f, func) in model.functions.iter().enumerate() {
            self.backward_all_rows(f, &func.backward, &func.backward_plan.lazy, params, s)?;
            accumulate_param_grads(&func.backward, &self.bwd[f], Some(&self.fwd[f]), grads)?;
            self.pull_grads[f].clear();
            if let Some(o) = func.backward.output(Role::PullGrad) {
                self.pull_grads[f].extend_from_slice(resolve_floats(
                    &func.backward,
                    o.node,
                    &self.bwd[f],
                    Some(&self.fwd[f]),
                )?);
            }
        }
        grads.finish_rows();
        Ok(())
    }

    /// Runs `nodes` of function `f`'s backward graph `g` (its eager or its
    /// lazy phase) once over all of the function's rows.
    fn backward_all_rows(
        &mut self,
        f: usize,
        g: &Graph,
        nodes: &[NodeId],
        params: &Params<T>,
        s: &Schedule,
    ) -> Result<()> {
        run_all_rows(
            g,
            nodes,
            &mut self.bwd[f],
            Some(&self.fwd[f]),
            params,
            &s.functions[f],
            &mut self.packs,
        )
    }

    /// The head's backward pass (seeded at the loss), its parameter
    /// gradients, and its input gradients added into each function's
    /// push gradient (the functions' backward arenas zeroed first).
    fn backward_head(
        &mut self,
        model: &Model,
        params: &Params<T>,
        s: &Schedule,
        grads: &mut Grads<T>,
    ) -> Result<()> {
        let head = &model.head;
        let hb = &head.backward;
        let h = self.head_vertices.len();
        self.head_bwd.prepare(hb, h, 0);
        self.head_bwd.norm_sync = self.norm_share(Mode::Train);
        let loss_output = head
            .forward
            .outputs
            .iter()
            .position(|o| o.role == Role::Loss);
        if let Some(seed) = loss_output.and_then(|i| hb.input_node(Source::OutputGrad(i))) {
            self.head_bwd.vals[seed][0] = T::ONE;
        }
        let all = Range::rows_only(h);
        for n in 0..hb.nodes.len() {
            if matches!(hb.nodes[n].kind, NodeKind::Op(_)) {
                run_node(
                    hb,
                    n,
                    &mut self.head_bwd,
                    Some(&self.head_fwd),
                    params,
                    Span::rows_only(all),
                    &mut self.packs,
                )?;
            }
        }
        accumulate_param_grads(hb, &self.head_bwd, Some(&self.head_fwd), grads)?;
        // push gradients into each function's backward arena
        self.bwd.resize_with(model.functions.len(), Arena::default);
        for (f, func) in model.functions.iter().enumerate() {
            let rows = &s.functions[f];
            self.bwd[f].prepare(&func.backward, rows.rows(), rows.edges());
            self.bwd[f].norm_sync = self.norm_share(Mode::Train);
            for v in self.bwd[f].vals.iter_mut() {
                v.iter_mut().for_each(|x| *x = T::ZERO);
            }
        }
        if let Some(out) = hb.output(Role::HeadInputGrad) {
            let pw = hb.nodes[out.node].ty.width();
            let src = resolve_floats(hb, out.node, &self.head_bwd, Some(&self.head_fwd))?;
            for (i, &v) in self.head_vertices.iter().enumerate() {
                let (f, r) = (
                    s.vertex_function[v as usize] as usize,
                    s.vertex_row[v as usize] as usize,
                );
                let func = &model.functions[f];
                if let Some(pg) = func.output_grad_node(Role::Push) {
                    for (d, &x) in self.bwd[f].vals[pg][r * pw..(r + 1) * pw]
                        .iter_mut()
                        .zip(&src[i * pw..(i + 1) * pw])
                    {
                        *d += x;
                    }
                }
            }
        }
        Ok(())
    }

    /// The tasks in reverse schedule order: each one's state gradient in,
    /// its per-task ops, and its child gradients added into the state
    /// gradients of its children.
    fn backward_tasks(&mut self, model: &Model, params: &Params<T>, s: &Schedule) -> Result<()> {
        let w = model.state_width;
        for task in s.tasks.iter().rev() {
            let f = task.function;
            let func = &model.functions[f];
            let rows = &s.functions[f];
            let range = Range::task(task);
            if let Some(sg) = func.output_grad_node(Role::Scatter) {
                let src =
                    &self.state_grad[task.begin as usize * w..(task.begin + task.len) as usize * w];
                self.bwd[f].vals[sg][range.r0 * w..range.r1 * w].copy_from_slice(src);
            }
            local_edges(
                &mut self.edge_local,
                &rows.edge_parent[range.e0..range.e1],
                range.r0,
            );
            run_nodes(
                &func.backward,
                &func.backward_plan.per_task,
                &mut self.bwd[f],
                Some(&self.fwd[f]),
                params,
                Span {
                    range,
                    edge_parent: &self.edge_local,
                },
                &mut self.packs,
            )?;
            for o in &func.backward.outputs {
                match o.role {
                    Role::ChildGrad(k) => {
                        let src = resolve_floats(
                            &func.backward,
                            o.node,
                            &self.bwd[f],
                            Some(&self.fwd[f]),
                        )?;
                        for r in range.r0..range.r1 {
                            if let Some(c) = rows.child(r, k) {
                                let dst =
                                    &mut self.state_grad[c as usize * w..(c as usize + 1) * w];
                                for (d, &x) in dst.iter_mut().zip(&src[r * w..(r + 1) * w]) {
                                    *d += x;
                                }
                            }
                        }
                    }
                    Role::ChildGradAll => {
                        let src = resolve_floats(
                            &func.backward,
                            o.node,
                            &self.bwd[f],
                            Some(&self.fwd[f]),
                        )?;
                        for e in range.e0..range.e1 {
                            let c = rows.edge_child[e] as usize;
                            for (d, &x) in self.state_grad[c * w..(c + 1) * w]
                                .iter_mut()
                                .zip(&src[e * w..(e + 1) * w])
                            {
                                *d += x;
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }
}
