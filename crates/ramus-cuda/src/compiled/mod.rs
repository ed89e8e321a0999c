//! The compiled inference engine on CUDA (Cortex): a recursive model's
//! cells lowered ([`ramus_core::lower`]) and generated
//! ([`ramus_codegen::compiled`]) into one persistent kernel per
//! (model, schedule, device) that runs a whole linearized batch — every
//! level (ordered by node counters or grid barriers), and the head — in a single
//! cooperative launch.
//!
//! At set-up the engine uploads the parameters once, compiles the kernels
//! through the kernel cache and, with leaf specialization, runs the table
//! kernel once to tabulate the leaf cell for every token (the per-word leaf
//! projections hoisted out of inference). Per batch it linearizes the
//! graphs on the host and launches once — a small batch's index arrays
//! travel by value with the launch ([`INLINE_INDEX_WORDS`]), a larger one's
//! in one upload first — and the kernel writes the root scores into mapped
//! host memory, read after one stream synchronization. Each launch clears
//! the node counters the next one uses (two arrays in turn).

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaFunction, DeviceRepr, LaunchConfig, PushKernelArg};

use ramus_codegen::compiled::{used_stages, INLINE_INDEX_WORDS};
use ramus_core::{Model, Params, VertexRules};
use ramus_graph::{InputGraph, LinearBatch, Linearizer, UnrolledPlan};

use crate::cache::KernelCache;
use crate::device::CudaDevice;
use crate::error::{InCall, Result};
use crate::memory::{device_room, local_memory_bytes, model_fits, run_check, DeviceCheck};
use crate::pinned::{MappedBuffer, PinnedBuffer};
use memory::{Cells, CounterPair};
use setup::{
    engine_pool, kernel_spec, model_err, open_device, param_offsets, resident_blocks,
    spilled_bytes, u32_of, upload_params, KernelNames, LeafTables, LevelOrderTuning, TableRun,
};

mod memory;
mod options;
mod setup;
use crate::pool::{Arena, DeviceView, PoolBuffer};
pub use options::{CompiledOptions, CompiledSchedule, COUNTERS_MAX_UNITS, LEVEL_ORDER_SAMPLES};

/// A small batch's index arrays passed by value with the level kernel's
/// launch (the generated `InlineIndices`, same layout): `count` words,
/// array `a` at word `at[a]` (child offsets, child rows, tokens, level
/// begins, level lengths, roots). `count == 0`: the pointers are used.
#[repr(C)]
struct InlineIndices {
    count: u32,
    at: [u32; 6],
    words: [u32; INLINE_INDEX_WORDS],
}

// SAFETY: plain `u32`s in the generated struct's order and layout (C, no
// padding: every field is 4-byte aligned), passed by value.
unsafe impl DeviceRepr for InlineIndices {}

impl InlineIndices {
    /// No arrays packed (the pointers are used).
    fn empty() -> Self {
        InlineIndices {
            count: 0,
            at: [0; 6],
            words: [0; INLINE_INDEX_WORDS],
        }
    }

    /// Packs `arrays` if they fit (else sets `count` to 0).
    fn pack(&mut self, arrays: [&[u32]; 6]) -> bool {
        let total: usize = arrays.iter().map(|a| a.len()).sum();
        if total > INLINE_INDEX_WORDS {
            self.count = 0;
            return false;
        }
        let mut at = 0;
        for (slot, a) in arrays.iter().enumerate() {
            self.at[slot] = at as u32;
            self.words[at..at + a.len()].copy_from_slice(a);
            at += a.len();
        }
        self.count = total as u32;
        true
    }
}

/// A pair of timing events recorded around a launch.
fn timing_events(device: &CudaDevice) -> Result<(CudaEvent, CudaEvent)> {
    let timed = || {
        device
            .context()
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .in_call("cuEventCreate")
    };
    Ok((timed()?, timed()?))
}

/// The median of `samples` (not empty).
fn median(samples: &[f32]) -> f32 {
    let mut sorted = samples.to_vec();
    sorted.sort_by(f32::total_cmp);
    sorted[sorted.len() / 2]
}

/// `model`'s cells lowered for the compiled engine under `options`, and
/// the generated kernels' preconditions checked
/// ([`TreeKernelSpec::check`](ramus_codegen::compiled::TreeKernelSpec::check):
/// a one-stage head, the block size), no device needed: the check
/// [`CompiledEngine::new`] starts with, and [`lowers`]'s.
fn lowered(model: &Model, options: &CompiledOptions) -> Result<Cells> {
    let cells = Cells::lower(model, options)?;
    // the check reads no parameter offset: placeholders stand in
    let offsets = vec![0; model.params.len()];
    kernel_spec(model, &cells, &offsets, options.block_threads)
        .check()
        .map_err(|e| model_err(format!("model `{}`: {e}", model.name)))?;
    Ok(cells)
}

/// Whether the compiled engine takes `model` under `options`, no device
/// needed ([`lowered`], the engine's first check): the support table's.
pub(crate) fn lowers(model: &Model, options: &CompiledOptions) -> Result<()> {
    lowered(model, options).map(|_| ())
}

/// Root scores of one batch: `scores[r * classes..(r + 1) * classes]` for
/// root `r`, roots graph by graph (`root_graph[r]` is the graph).
#[derive(Clone, Debug, Default)]
pub struct CompiledOutput {
    pub scores: Vec<f32>,
    pub classes: usize,
    pub root_graph: Vec<u32>,
}

impl CompiledOutput {
    /// The highest-scoring class of each root.
    pub fn predictions(&self) -> Vec<u32> {
        self.scores
            .chunks(self.classes.max(1))
            .map(|row| {
                let mut best = 0;
                for (c, &x) in row.iter().enumerate() {
                    if x > row[best] {
                        best = c;
                    }
                }
                best as u32
            })
            .collect()
    }
}

/// The compiled inference engine on one device; see the module docs.
pub struct CompiledEngine {
    device: Arc<CudaDevice>,
    cache: KernelCache,
    /// The level kernel, or the unrolled one.
    levels: CudaFunction,
    /// The unrolled groups of the current batch (unrolled schedule).
    plan: UnrolledPlan,
    staging: PinnedBuffer,
    arena: Arena,
    _params: PoolBuffer<f32>,
    params: DeviceView<f32>,
    _tables: Option<(PoolBuffer<f32>, PoolBuffer<f32>)>,
    _token_table: Option<PoolBuffer<f32>>,
    table_state: u64,
    table_push: u64,
    /// The internal cell's hoisted token values (0: none).
    token_table: u64,
    _barrier: PoolBuffer<u32>,
    barrier: DeviceView<u32>,
    /// What a vertex must be to run (checked before linearizing).
    rules: VertexRules,
    linearizer: Linearizer,
    /// Per-batch scratch: the child row codes uploaded.
    child_rows: Vec<u32>,
    /// The batch's index arrays when they fit the launch.
    inline: Box<InlineIndices>,
    /// The node counters (level kernels).
    counters: CounterPair,
    /// The root scores, written by the kernel straight to the host.
    scores_out: MappedBuffer,
    /// Stages of the internal cell (node counters per internal node).
    stages: usize,
    /// Blocks that can be resident at once (the cooperative launch's
    /// limit), capped by the options.
    max_blocks: u32,
    /// Blocks needed for a warp per unit of every cell.
    min_blocks: u32,
    /// Threads per block.
    block: u32,
    units: usize,
    /// Floats of a node's scratch row (multi-stage cells: the wider of
    /// the leaf's and the internal cell's).
    scratch_width: usize,
    state_width: usize,
    push_width: usize,
    classes: usize,
    /// Token ids must stay below this (the embedding / table rows).
    vocab: Option<usize>,
    schedule: CompiledSchedule,
    setup_seconds: f64,
    leaf_table_seconds: f64,
    last_enqueue_seconds: f64,
    /// Recorded around each launch for the kernel's own time, if asked for
    /// (or while the level ordering is measured).
    kernel_events: Option<(CudaEvent, CudaEvent)>,
    /// Schedule `node_counters: None`: the level orderings being timed.
    tuning: Option<LevelOrderTuning>,
    /// The kernel's own time was asked for (else the events go once the
    /// level ordering is settled).
    time_kernel: bool,
    last_kernel_seconds: Option<f64>,
}

impl CompiledEngine {
    /// Lowers, generates and compiles `model`'s cells, uploads `params` and
    /// (with leaf specialization) tabulates the leaf cell over the
    /// vocabulary; refuses a model whose parameters and tables cannot fit
    /// the device (see [`with_check`](Self::with_check)).
    pub fn new(model: &Model, params: &Params<f32>, options: &CompiledOptions) -> Result<Self> {
        Self::with_check(model, params, options, &model_fits)
    }

    /// [`new`](Self::new), asking `check` whether what the engine will
    /// allocate fits the device ([`memory::need`]): within
    /// [`CompiledOptions::memory_budget`] before the kernels compile, and
    /// within the free memory (less the local memory the level kernel's
    /// spilled registers take) once they are loaded, before the pool holds
    /// anything. A refusal is [`CudaError::DoesNotFit`]; the pool then
    /// reserves what fits, its arena sized for the largest batch.
    pub fn with_check(
        model: &Model,
        params: &Params<f32>,
        options: &CompiledOptions,
        check: DeviceCheck<'_>,
    ) -> Result<Self> {
        let started = Instant::now();
        let cells = lowered(model, options)?;
        let mut need = memory::need(model, &cells)?;
        let (device, cache) = open_device(options, check, &need)?;
        let leaf_stages = used_stages(&cells.leaf.program);
        let table_lens = cells.table_lens()?;
        let [state_width, push_width, scratch_width] = cells.row_widths();
        let (offsets, total) = param_offsets(model, params);
        let spec = kernel_spec(model, &cells, &offsets, options.block_threads);
        let (leaf, internal, head) = (&cells.leaf.program, &cells.internal.program, &cells.head);
        let (vocab, schedule, unroll) = (cells.vocab, cells.schedule, cells.unroll);
        let token_table_program = &cells.token_table;
        let block = spec.block_threads;
        let kernels = KernelNames::new(unroll, leaf_stages, token_table_program.is_some());
        let measure = options.schedule.node_counters.is_none();
        let (module, levels, tuning) = kernels.compile(&cache, &spec, measure)?;
        let pooled = need.parts_bytes();
        // the level kernels' spilled registers take local memory at launch
        let spilled = spilled_bytes(&levels, tuning.as_ref())?;
        need.parts.push((
            "local memory of spilled registers",
            local_memory_bytes(&device, spilled)?,
        ));
        let fitted = run_check(check, &need, device_room(&device, options.memory_budget)?)?;
        let pool = engine_pool(&device, options, pooled, &fitted);
        let stream = device.stream().clone();
        let mut staging = PinnedBuffer::new(&device)?;
        let param_buf = pool.alloc::<f32>(total.max(1))?;
        let param_view = param_buf.view().slice(0..total)?;
        upload_params(&mut staging, params, &offsets, param_view, &stream)?;
        let barrier = pool.alloc::<u32>(2)?;
        barrier.view().fill_zero(&stream)?;

        let (max_blocks, min_blocks) = {
            let widest_cell = leaf.units.max(internal.units).max(head.units);
            let levels = (&levels, tuning.as_ref().map(|t| &t.other));
            resident_blocks(&device, levels, options, &spec, widest_cell)?
        };
        let table_started = Instant::now();
        let built = if schedule.leaf_table {
            let token = token_table_program.as_ref().map(|(t, _)| t.units);
            let run = TableRun {
                module: &module,
                names: &kernels.leaf_tables,
                params: param_view,
                units: (leaf.units, token),
                vocab: vocab.ok_or_else(|| model_err("leaf table without a vocabulary"))?,
                block,
            };
            run.build(&device, &pool, &table_lens)?
        } else {
            LeafTables::default()
        };
        device.synchronize()?;
        let leaf_table_seconds = if schedule.leaf_table {
            table_started.elapsed().as_secs_f64()
        } else {
            0.0
        };
        let arena = pool.arena(memory::arena_bytes(fitted.eval_batch));
        let kernel_events = if options.time_kernel || tuning.is_some() {
            Some(timing_events(&device)?)
        } else {
            None
        };
        Ok(CompiledEngine {
            kernel_events,
            tuning,
            time_kernel: options.time_kernel,
            last_kernel_seconds: None,
            cache,
            levels,
            plan: UnrolledPlan::new(),
            staging,
            arena,
            params: param_view,
            _params: param_buf,
            table_state: built.state,
            table_push: built.push,
            token_table: built.token,
            _tables: built.tables,
            _token_table: built.token_buffer,
            barrier: barrier.view(),
            _barrier: barrier,
            rules: VertexRules::of(model),
            linearizer: Linearizer::new(),
            child_rows: Vec::new(),
            inline: Box::new(InlineIndices::empty()),
            counters: CounterPair::new(Arc::clone(&pool)),
            scores_out: MappedBuffer::new(&device),
            stages: internal.stages,
            max_blocks,
            min_blocks,
            block,
            units: internal.units,
            scratch_width,
            state_width,
            push_width,
            classes: head.output_width(0),
            vocab,
            schedule,
            setup_seconds: started.elapsed().as_secs_f64(),
            leaf_table_seconds,
            last_enqueue_seconds: 0.0,
            device,
        })
    }

    /// The device this engine runs on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// The schedule in effect (leaf tables need a token vocabulary; while
    /// the level ordering is being measured, `node_counters` is the one
    /// tried first).
    pub fn schedule(&self) -> CompiledSchedule {
        self.schedule
    }

    /// Whether the engine is still timing the two level orderings.
    pub fn measuring_level_order(&self) -> bool {
        self.tuning.is_some()
    }

    /// Kernel-cache counters (compiled, memory and disk hits, compile time).
    pub fn cache_stats(&self) -> crate::cache::KernelCacheStats {
        self.cache.stats()
    }

    /// The pool's counters (bytes reserved, in use, the peak in use).
    pub fn pool_stats(&self) -> crate::pool::PoolStats {
        self.counters.pool.stats()
    }

    /// Seconds spent in [`CompiledEngine::new`].
    pub fn setup_seconds(&self) -> f64 {
        self.setup_seconds
    }

    /// Seconds the leaf table took to build (0 without one).
    pub fn leaf_table_seconds(&self) -> f64 {
        self.leaf_table_seconds
    }

    /// Times each launch with device events from now on (or stops, once
    /// the level ordering is settled): [`CompiledOptions::time_kernel`].
    pub fn set_time_kernel(&mut self, on: bool) -> Result<()> {
        self.time_kernel = on;
        if on && self.kernel_events.is_none() {
            self.kernel_events = Some(timing_events(&self.device)?);
        }
        if !on && self.tuning.is_none() {
            self.kernel_events = None;
            self.last_kernel_seconds = None;
        }
        Ok(())
    }

    /// Host seconds of the last [`infer`](Self::infer) up to its launch.
    pub fn last_enqueue_seconds(&self) -> f64 {
        self.last_enqueue_seconds
    }

    /// Device seconds of the last [`infer`](Self::infer)'s kernel (with
    /// [`CompiledOptions::time_kernel`]).
    pub fn last_kernel_seconds(&self) -> Option<f64> {
        self.last_kernel_seconds
    }

    /// Once both level orderings have their samples, keeps the faster
    /// (by median kernel time).
    fn settle_level_order(&mut self) {
        let done = self
            .tuning
            .as_ref()
            .is_some_and(|t| t.samples.iter().all(|s| s.len() >= LEVEL_ORDER_SAMPLES));
        if !done {
            return;
        }
        if let Some(t) = self.tuning.take() {
            if median(&t.samples[1]) < median(&t.samples[0]) {
                self.levels = t.other;
                self.schedule.node_counters = Some(t.other_counters);
            }
        }
        if !self.time_kernel {
            self.kernel_events = None;
            self.last_kernel_seconds = None;
        }
    }

    /// Scores every root of `graphs` in one launch.
    pub fn infer(&mut self, graphs: &[&InputGraph]) -> Result<CompiledOutput> {
        let started = Instant::now();
        let rules = &self.rules;
        ramus_graph::check_structure(graphs.iter().copied(), |kind, children| {
            rules.check(kind, children)
        })?;
        let batch = self
            .linearizer
            .linearize(graphs)
            .map_err(|e| model_err(format!("the batch cannot be linearized: {e}")))?;
        check_tokens(batch, self.vocab)?;
        let nodes = batch.num_nodes();
        let roots = batch.root_nodes().len();
        let widest = batch.batch_length().iter().copied().max().unwrap_or(0) as usize;
        let ni = batch.num_internal();
        child_row_codes(&mut self.child_rows, batch, self.schedule.leaf_table);
        let unroll = self.schedule.recursion.unroll == Some(true);
        if unroll {
            self.plan
                .plan(batch)
                .map_err(|e| model_err(format!("the batch cannot be unrolled: {e}")))?;
        }
        // while measuring, the orderings alternate (fewer samples first)
        let try_other = self
            .tuning
            .as_ref()
            .is_some_and(|t| t.samples[1].len() < t.samples[0].len());
        let stream = self.device.stream().clone();
        // the index arrays: carried by the launch when they fit (level
        // kernel), else one upload
        let inline = !unroll
            && self.inline.pack([
                batch.child_offsets(),
                &self.child_rows,
                batch.tokens(),
                batch.batch_begin(),
                batch.batch_length(),
                batch.root_nodes(),
            ]);
        let parts = if inline {
            Vec::new()
        } else {
            index_parts(batch, &self.child_rows, &self.plan, unroll)
        };
        let root_graph: Vec<u32> = batch
            .root_nodes()
            .iter()
            .map(|&r| batch.origin(r).0 as u32)
            .collect();
        let counts = LevelCounts::of(batch, &self.plan)?;
        self.arena.reset()?;
        let views = upload_parts(&mut self.staging, &mut self.arena, &parts, &stream)?;
        // the node counters of every internal node and stage (level
        // kernels; zero, and the next launch's cleared by this one)
        let counters = if unroll {
            None
        } else {
            Some(self.counters.for_launch(ni * self.stages, &stream)?)
        };
        let done_clear = u32_of(self.counters.capacity, "node counters")?;
        let widths = [self.state_width, self.push_width, self.scratch_width];
        let [state_len, push_len, scratch_len] = memory::batch_lens(nodes, widths);
        let state = self.arena.alloc::<f32>(state_len)?;
        let push = self.arena.alloc::<f32>(push_len)?;
        let score_len = roots * self.classes;
        let scores = self.scores_out.device_ptr_for::<f32>(score_len, &stream)?;
        let scratch = self.arena.alloc::<f32>(scratch_len)?;
        let args = LevelArgs {
            rows: [state, push, scratch],
            views: &views,
            unroll,
            counts,
            scores,
            counters,
            done_clear,
            blocks: self.level_blocks(unroll, widest)?,
        };
        self.launch_levels(&args, try_other, &stream)?;
        if counters.is_some() {
            self.counters.launched();
        }
        let out = self.finish_launch(score_len, try_other, started, &stream)?;
        Ok(CompiledOutput {
            scores: out,
            classes: self.classes,
            root_graph,
        })
    }

    /// Blocks of a launch: enough warps for every unit of the widest level
    /// (`widest` nodes; unrolled: a block per group of the widest step), as
    /// far as fit.
    fn level_blocks(&self, unroll: bool, widest: usize) -> Result<u32> {
        let wanted = if unroll {
            u32_of(self.plan.widest_step(), "groups")?
        } else {
            let warps = self.units * widest.max(1);
            u32_of(warps.div_ceil((self.block / 32) as usize), "blocks")?
        };
        Ok(wanted.clamp(self.min_blocks, self.max_blocks))
    }

    /// Launches the level kernel (the other ordering's with `try_other`
    /// while they are measured) with `args`, between the timing events.
    fn launch_levels(
        &self,
        args: &LevelArgs<'_>,
        try_other: bool,
        stream: &Arc<cudarc::driver::CudaStream>,
    ) -> Result<()> {
        let kernel = match (&self.tuning, try_other) {
            (Some(t), true) => &t.other,
            _ => &self.levels,
        };
        let [state, push, scratch] = &args.rows;
        let c = &args.counts;
        // the index pointers (unused, null, when the launch carries them)
        let null = 0u64;
        let index = |slot: usize| {
            args.views
                .get(slot)
                .map_or(&null, |v: &DeviceView<u32>| v.kernel_arg())
        };
        let mut launch = stream.launch_builder(kernel);
        launch
            .arg(self.params.kernel_arg())
            .arg(state.kernel_arg())
            .arg(push.kernel_arg())
            .arg(&self.table_state)
            .arg(&self.table_push)
            .arg(&self.token_table)
            .arg(scratch.kernel_arg())
            .arg(index(0))
            .arg(index(1))
            .arg(index(2));
        if args.unroll {
            launch
                .arg(index(3))
                .arg(&c.steps)
                .arg(index(4))
                .arg(index(5))
                .arg(index(6))
                .arg(&c.internal)
                .arg(&c.nodes)
                .arg(index(7));
        } else {
            launch
                .arg(index(3))
                .arg(index(4))
                .arg(&c.levels)
                .arg(&c.internal)
                .arg(&c.nodes)
                .arg(index(5));
        }
        launch
            .arg(&c.roots)
            .arg(&args.scores)
            .arg(self.barrier.kernel_arg());
        if let Some((done, done_next)) = &args.counters {
            launch
                .arg(done.kernel_arg())
                .arg(&*self.inline)
                .arg(done_next.kernel_arg())
                .arg(&args.done_clear);
        }
        let cfg = LaunchConfig {
            grid_dim: (args.blocks, 1, 1),
            block_dim: (self.block, 1, 1),
            shared_mem_bytes: 0,
        };
        if let Some((start, _)) = &self.kernel_events {
            start.record(stream).in_call("cuEventRecord")?;
        }
        // SAFETY: the arguments match `cortex_levels`' (or, unrolled,
        // `cortex_unrolled`'s) parameters in order; state, pushed and
        // scratch buffers have a row per node, scores (mapped host memory)
        // a row per root, the index arrays (inline, or the views) hold the
        // linearized arrays and the plan's steps and groups (every node and
        // token checked above), the tables a row per token, `done` (levels
        // only) zeroed counters for every internal node and stage and
        // `done_next` `done_clear` words; the launch is cooperative with at
        // most the resident block count, so neither the grid barrier nor a
        // counter wait can deadlock.
        unsafe { launch.launch_cooperative(cfg) }
            .in_call("cuLaunchCooperativeKernel(cortex_levels)")
            .map(|_| ())
    }

    /// After the launch: records the end event and the enqueue time, reads
    /// the `score_len` root scores and, when timed, the kernel's time (a
    /// sample of the ordering tried while they are measured).
    fn finish_launch(
        &mut self,
        score_len: usize,
        try_other: bool,
        started: Instant,
        stream: &Arc<cudarc::driver::CudaStream>,
    ) -> Result<Vec<f32>> {
        if let Some((_, end)) = &self.kernel_events {
            end.record(stream).in_call("cuEventRecord")?;
        }
        self.last_enqueue_seconds = started.elapsed().as_secs_f64();
        let out = self.scores_out.read::<f32>(score_len, stream)?.to_vec();
        if let Some((start, end)) = &self.kernel_events {
            let ms = start.elapsed_ms(end).in_call("cuEventElapsedTime")?;
            self.last_kernel_seconds = Some(f64::from(ms) / 1e3);
            if let Some(t) = &mut self.tuning {
                t.samples[usize::from(try_other)].push(ms);
            }
        }
        self.settle_level_order();
        Ok(out)
    }
}

/// Refuses a token at or beyond the model's `vocab` embedding rows, naming
/// its graph and vertex.
fn check_tokens(batch: &LinearBatch, vocab: Option<usize>) -> Result<()> {
    if let Some(v) = vocab {
        if let Some(n) = batch.tokens().iter().position(|&t| t as usize >= v) {
            let (g, vertex) = batch.origin(n as u32);
            return Err(model_err(format!(
                "graph {g} vertex {vertex}: token {} is beyond the model's {v} embedding rows",
                batch.tokens()[n]
            )));
        }
    }
    Ok(())
}

/// The child row codes of `batch` into `rows`: a leaf's is
/// `num_internal + token` with a leaf table (the kernel then reads the
/// table without loading the token).
fn child_row_codes(rows: &mut Vec<u32>, batch: &LinearBatch, leaf_table: bool) {
    let ni = batch.num_internal();
    rows.clear();
    rows.extend(batch.child_nodes().iter().map(|&c| {
        if leaf_table && c as usize >= ni {
            (ni as u32).saturating_add(batch.tokens()[c as usize])
        } else {
            c
        }
    }));
}

/// The index arrays a batch uploads, in the kernel's order: offsets, child
/// rows, tokens, the level ranges (batch begin / length, or the unrolled
/// steps and groups), roots.
fn index_parts<'a>(
    batch: &'a LinearBatch,
    child_rows: &'a [u32],
    plan: &'a UnrolledPlan,
    unroll: bool,
) -> Vec<&'a [u32]> {
    let mut parts: Vec<&[u32]> = Vec::new();
    parts.extend([batch.child_offsets(), child_rows, batch.tokens()]);
    if unroll {
        parts.extend([
            plan.step_begin(),
            plan.group_parent(),
            plan.group_child_begin(),
            plan.group_children(),
        ]);
    } else {
        parts.extend([batch.batch_begin(), batch.batch_length()]);
    }
    parts.push(batch.root_nodes());
    parts
}

/// Uploads `parts` in one copy into the arena: a view of each (none for
/// no parts, when the launch carries the indices).
fn upload_parts(
    staging: &mut PinnedBuffer,
    arena: &mut Arena,
    parts: &[&[u32]],
    stream: &Arc<cudarc::driver::CudaStream>,
) -> Result<Vec<DeviceView<u32>>> {
    let mut views = Vec::with_capacity(parts.len());
    if parts.is_empty() {
        return Ok(views);
    }
    let total: usize = parts.iter().map(|p| p.len()).sum();
    {
        let host = staging.host_mut::<u32>(total)?;
        let mut at = 0;
        for p in parts {
            host[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
    }
    let indices = arena.alloc::<u32>(total.max(1))?;
    staging.upload(indices.slice(0..total)?, stream)?;
    let mut at = 0;
    for p in parts {
        views.push(indices.slice(at..at + p.len())?);
        at += p.len();
    }
    Ok(views)
}

/// The counts the level kernel reads: unrolled steps, levels, internal
/// nodes, nodes and roots.
struct LevelCounts {
    steps: u32,
    levels: u32,
    internal: u32,
    nodes: u32,
    roots: u32,
}

impl LevelCounts {
    /// The counts of `batch` (and of its unrolled `plan`), checked to fit
    /// 32 bits.
    fn of(batch: &LinearBatch, plan: &UnrolledPlan) -> Result<Self> {
        Ok(LevelCounts {
            internal: u32_of(batch.num_internal(), "internal nodes")?,
            nodes: u32_of(batch.num_nodes(), "nodes")?,
            levels: u32_of(batch.num_batches(), "levels")?,
            roots: u32_of(batch.root_nodes().len(), "roots")?,
            steps: u32_of(plan.num_steps(), "unrolled steps")?,
        })
    }
}

/// One batch's arguments of the level kernel (see
/// [`CompiledEngine::launch_levels`]).
struct LevelArgs<'a> {
    /// State, pushed and scratch rows, one per node.
    rows: [DeviceView<f32>; 3],
    /// The uploaded index arrays (empty when the launch carries them).
    views: &'a [DeviceView<u32>],
    unroll: bool,
    counts: LevelCounts,
    /// Device address of the mapped root scores.
    scores: u64,
    /// This launch's node counters and the next's (level kernels).
    counters: Option<(DeviceView<u32>, DeviceView<u32>)>,
    /// Words of the next launch's counters to clear.
    done_clear: u32,
    blocks: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_indices_have_the_generated_layout_and_pack_what_fits() {
        // count, at[6], words: 4-byte fields, no padding
        assert_eq!(
            std::mem::size_of::<InlineIndices>(),
            4 * (7 + INLINE_INDEX_WORDS)
        );
        let mut inline = InlineIndices::empty();
        let (offsets, rows, tokens) = ([0, 2, 2], [5, 6], [1, 2, 3, 4, 5, 6, 7]);
        assert!(inline.pack([&offsets, &rows, &tokens, &[0], &[1], &[6]]));
        assert_eq!(inline.count, 15);
        assert_eq!(inline.at, [0, 3, 5, 12, 13, 14]);
        assert_eq!(
            &inline.words[..15],
            &[0, 2, 2, 5, 6, 1, 2, 3, 4, 5, 6, 7, 0, 1, 6]
        );
        // one word too many: the pointers are used instead
        let big = vec![7u32; INLINE_INDEX_WORDS - 4];
        assert!(!inline.pack([&big, &rows, &tokens, &[], &[], &[]]));
        assert_eq!(inline.count, 0);
        let fits = vec![7u32; INLINE_INDEX_WORDS - 9];
        assert!(inline.pack([&fits, &rows, &tokens, &[], &[], &[]]));
        assert_eq!(inline.count as usize, INLINE_INDEX_WORDS);
    }
}
