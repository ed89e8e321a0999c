//! The CUDA batched engine (Cavs on the GPU). Same passes as the CPU
//! reference engine (`ramus_cpu::engine`), with every tensor in a per-batch
//! arena of the device pool:
//!
//! * once per batch, all index arrays (tokens, child rows, CSR edges, head
//!   rows, labels) go up in one pinned copy, and all per-batch floats
//!   (dropout masks, pulled inputs) in another;
//! * each vertex function's *eager* steps run once over all its rows;
//! * per task: one gather launch copies every gathered symbol's child rows
//!   from the vertex-state buffer, the per-task steps run on the task's
//!   contiguous slices (GEMMs through cuBLAS, fused elementwise groups as
//!   generated kernels, structure ops as built-in kernels; CNN ops as in
//!   `engine/cnn.rs`), and one copy scatters the new states;
//! * the *lazy* steps (weight-gradient GEMMs in `∂F`) run once over all rows.
//!
//! Backward pops the tasks in reverse, accumulating child gradients into the
//! state-gradient buffer, and finally brings the parameter gradients back to
//! the host (dense ones in one copy, embedding rows only where touched).

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaFunction, CudaStream};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use ramus_core::fusion::{FusedGroup, InputKind, SliceView};
use ramus_core::graph::{DType, Graph, NodeId, NodeKind, Role, Source, Space};
use ramus_core::ops::{
    BroadcastRows, Concat, Embedding, EmbeddingUnk, EmbeddingUnkBackward, ExpandChildren, MatMul,
    Pad, Reshape, RowMatMul, Slice, SoftmaxXent, SoftmaxXentBackward, SumChildren, SumRows,
};
use ramus_core::{Grads, HeadRows, Model, Params};
use ramus_cpu::{fill_dropout_mask, Batch, ForwardOutput, Mode, Range};
use ramus_graph::{FunctionRows, Schedule, NO_LABEL};
use ramus_nn::{Optimizer, OptimizerConfig, StepOutcome};

use crate::blas::{Blas, Gemm};
use crate::cache::KernelCache;
use crate::device::CudaDevice;
use crate::error::InCall;
use crate::error::{CudaError, Result};
use crate::launch::{FusedArgs, Launcher, RowMove, NONE, SMALL_GEMM_ROWS};
use crate::optimizer::{DeviceOptimizer, GradLayout, ParamSlot};
use crate::pinned::PinnedBuffer;
use crate::pool::{Arena, DevicePool, DeviceScalar, DeviceView, PoolBuffer, PoolConfig};
use crate::program::{
    ExecStep, GraphProgram, PlannedStep, Program, EAGER, HEAD_ALL, HEAD_SCORES, LAZY, PER_TASK,
};
use crate::swap::{SwapConfig, SwapMode};

mod cnn;
mod nonfinite;
mod resume;
mod swap;

pub(crate) use cnn::cnn_workspace_floats;

/// How to set up a [`CudaEngine`].
#[derive(Clone, Debug, Default)]
pub struct CudaEngineOptions {
    /// Device ordinal.
    pub device: usize,
    pub pool: PoolConfig,
    /// Kernel cache directory (`None`: [`crate::default_cache_dir`]).
    pub cache_dir: Option<PathBuf>,
    /// Floats of a convolution's scratch columns beyond which it processes
    /// its images in chunks (`None`: [`CONV_WORKSPACE_FLOATS`]; at least one
    /// image per chunk whatever the limit).
    pub conv_workspace: Option<usize>,
    /// Training past the memory budget (`pool.max_bytes`): the swap path
    /// for static-graph and dynamic models (see [`crate::swap`]); off by
    /// default.
    pub swap: SwapConfig,
}

/// Default cap of a convolution's scratch columns: 16 Mi floats (64 MiB).
pub const CONV_WORKSPACE_FLOATS: usize = 1 << 24;

/// Where one node's value lives for the current batch.
#[derive(Clone, Copy, Debug)]
enum Buf {
    Absent,
    Floats(DeviceView<f32>),
    Indices(DeviceView<u32>),
}

/// Segments of the per-batch index upload for one vertex function.
#[derive(Clone, Copy, Debug, Default)]
struct Seg {
    offset: usize,
    len: usize,
}

#[derive(Clone, Debug, Default)]
struct FunctionSegs {
    tokens: Seg,
    /// Child vertex of each row for `gather(k)` (`NONE` if absent).
    children: Vec<Seg>,
    edge_child: Seg,
    edge_offsets: Seg,
    edge_parent: Seg,
    /// Head rows served by this function: head row and function row.
    head_rows: Seg,
    head_sources: Seg,
    max_token: u32,
}

/// Device views of one function's index arrays.
#[derive(Clone, Debug)]
struct Topology {
    tokens: DeviceView<u32>,
    children: Vec<DeviceView<u32>>,
    edge_child: DeviceView<u32>,
    edge_offsets: DeviceView<u32>,
    edge_parent: DeviceView<u32>,
    head_rows: DeviceView<u32>,
    head_sources: DeviceView<u32>,
    max_token: u32,
}

/// Parameters (and their gradients) on the device: one buffer each, dense
/// gradients first so they come back in one copy.
struct DeviceParams {
    _values: PoolBuffer<f32>,
    _grads: PoolBuffer<f32>,
    values: Vec<DeviceView<f32>>,
    grads: Vec<DeviceView<f32>>,
    /// Floats of dense gradients at the start of the gradient buffer.
    dense_len: usize,
    grad_all: DeviceView<f32>,
    version: (u64, u64),
    /// Bumped whenever the buffers are (re)allocated.
    generation: u64,
    /// A device optimizer step changed the values since the host's copy.
    host_stale: bool,
}

/// Per-batch state kept from forward to backward.
#[derive(Default)]
struct BatchState {
    fwd: Vec<Vec<Buf>>,
    head_fwd: Vec<Buf>,
    topo: Vec<Option<Topology>>,
    labels: Option<DeviceView<u32>>,
    max_label: u32,
    head_vertices: Vec<u32>,
    forward_done: bool,
}

/// A stream with its own cuBLAS handle: the main lane runs the
/// gather–scatter path, the eager lane runs eager steps ahead of it.
struct Lane {
    stream: Arc<CudaStream>,
    blas: Blas,
    /// Scratch memory of the ops run on this lane (convolution columns,
    /// per-channel coefficients), from the batch arena. Ops on one stream run
    /// in order, so each reuses it; the two lanes have their own.
    workspace: Cell<Option<DeviceView<f32>>>,
}

impl Lane {
    fn new(device: &CudaDevice, stream: Arc<CudaStream>) -> Result<Self> {
        Ok(Lane {
            blas: Blas::new(device, stream.clone())?,
            stream,
            workspace: Cell::new(None),
        })
    }
}

/// The CUDA batched engine. Compiles the model's kernels at set-up, then
/// runs batches with no device allocation beyond the pool's growth.
pub struct CudaEngine {
    device: Arc<CudaDevice>,
    pool: Arc<DevicePool>,
    cache: KernelCache,
    launcher: Launcher,
    main: Lane,
    eager: Lane,
    /// Recorded on the main lane once a pass's inputs are on the device.
    inputs_ready: CudaEvent,
    /// Per vertex function: recorded on the eager lane after its eager steps.
    eager_done: Vec<CudaEvent>,
    staging: PinnedBuffer,
    /// The batch arena; in a cell so that ops (run through `&self`) can take
    /// scratch memory from it.
    arena: RefCell<Arena>,
    /// Floats of convolution columns before images are chunked.
    conv_workspace: usize,
    program: Arc<Program>,
    params: Option<DeviceParams>,
    state: BatchState,
    rng: ChaCha8Rng,
    pull_values: Option<Vec<f32>>,
    setup_seconds: f64,
    /// The fused optimizer, with the parameter-buffer generation it serves.
    optimizer: Option<(u64, DeviceOptimizer)>,
    /// Optimizer state to load into the fused optimizer when it is built
    /// (a resumed run, see [`CudaEngine::load_optimizer_state`]).
    pending_optimizer: Option<ramus_nn::Optimizer<f32>>,
    pass_started: Option<std::time::Instant>,
    /// True while an evaluation or inference pass runs: ops with an
    /// inference form (batch normalisation with running statistics) run
    /// that instead.
    inference_pass: bool,
    /// True while a device training step ([`ramus_nn::Engine::train_step`],
    /// plain or swap path) runs: its forward pass blends the batch
    /// statistics into the running statistics of the device parameters. A
    /// bare train-mode forward pass leaves them alone, as on the CPU.
    track_running_stats: bool,
    enqueue_seconds: f64,
    /// The swap path's state, when it is on.
    swap: Option<swap::SwapRuntime>,
    /// The loss of the last device training step whose status (applied or
    /// skipped as non-finite) the host has not taken yet.
    pending_loss: Option<f64>,
    /// The model's parameter names, to name a non-finite one.
    param_names: Vec<String>,
}

/// The rows of `range` (in the value's space) of a buffer of type `ty`.
fn rows_of_view<T: DeviceScalar>(
    v: DeviceView<T>,
    ty: &ramus_core::ValueType,
    range: Range,
) -> Result<DeviceView<T>> {
    let (lo, hi) = range.span(ty.space);
    v.slice(lo * ty.width()..hi * ty.width())
}

fn node_label(g: &Graph, n: NodeId) -> String {
    format!("node %{n} ({})", g.nodes[n].describe(&[]))
}

fn no_buffer(g: &Graph, n: NodeId, kind: &str) -> CudaError {
    model_err(format!(
        "node %{n} ({}) has no {kind} buffer on the device",
        g.nodes[n].describe(&[])
    ))
}

fn u32_of(value: usize, what: &str) -> Result<u32> {
    u32::try_from(value)
        .map_err(|_| CudaError::BadArgument(format!("{what} {value} does not fit 32 bits")))
}

fn model_err(message: impl Into<String>) -> CudaError {
    CudaError::Model(message.into())
}

impl CudaEngine {
    /// Opens the device, compiles (or loads from the kernel cache) the
    /// built-in kernels and every fused kernel of `model`.
    pub fn new(model: &Model, options: &CudaEngineOptions) -> Result<Self> {
        let started = std::time::Instant::now();
        let device = CudaDevice::open(options.device)?;
        let swapping = options.swap.mode != SwapMode::Off;
        let mut pool_config = options.pool;
        if let (true, Some(budget)) = (swapping, pool_config.max_bytes) {
            // one chunk of exactly the budget: tensors come and go inside it
            pool_config.initial_bytes = budget;
        }
        let pool = DevicePool::new(&device, pool_config);
        let dir = options
            .cache_dir
            .clone()
            .or_else(crate::cache::default_cache_dir);
        let cache = KernelCache::for_device(&device, dir)?;
        let launcher = Launcher::new(&cache)?;
        let program = Arc::new(Program::build(model, &cache)?);
        let main = Lane::new(&device, device.stream().clone())?;
        let eager = Lane::new(&device, device.new_stream()?)?;
        let inputs_ready = device.new_event()?;
        let eager_done = (0..model.functions.len())
            .map(|_| device.new_event())
            .collect::<Result<_>>()?;
        let staging = PinnedBuffer::new(&device)?;
        // on the swap path the arena holds only index arrays
        let arena = pool.arena(if swapping { 1 << 20 } else { 64 << 20 });
        let swap = if swapping {
            Some(swap::SwapRuntime::new(&device, options.swap.clone())?)
        } else {
            None
        };
        Ok(CudaEngine {
            device,
            pool,
            cache,
            launcher,
            main,
            eager,
            inputs_ready,
            eager_done,
            staging,
            arena: RefCell::new(arena),
            conv_workspace: options.conv_workspace.unwrap_or(CONV_WORKSPACE_FLOATS),
            program,
            params: None,
            state: BatchState::default(),
            rng: ChaCha8Rng::seed_from_u64(0),
            pull_values: None,
            setup_seconds: started.elapsed().as_secs_f64(),
            optimizer: None,
            pending_optimizer: None,
            pass_started: None,
            inference_pass: false,
            track_running_stats: false,
            enqueue_seconds: 0.0,
            swap,
            pending_loss: None,
            param_names: model.params.iter().map(|p| p.name.clone()).collect(),
        })
    }

    /// The device this engine runs on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Kernel launches (built-in, fused and cuBLAS) so far.
    pub fn launches(&self) -> u64 {
        self.launcher.launches()
    }

    /// Kernel-cache statistics (kernels compiled, hits, compile time).
    pub fn cache_stats(&self) -> crate::cache::KernelCacheStats {
        self.cache.stats()
    }

    /// Device memory the engine can still take: what the device has free
    /// plus what the pool holds unused, within the pool's budget.
    pub fn memory_room(&self) -> Result<u64> {
        let free = self.device.free_memory()? as u64;
        let stats = self.pool.stats();
        let room = free.saturating_add(stats.reserved_bytes.saturating_sub(stats.in_use_bytes));
        Ok(match self.pool.max_bytes() {
            Some(max) => room.min(max.saturating_sub(stats.in_use_bytes)),
            None => room,
        })
    }

    /// Pool statistics (driver allocations, bytes reserved and in use).
    pub fn pool_stats(&self) -> crate::pool::PoolStats {
        self.pool.stats()
    }

    /// Seconds spent in [`CudaEngine::new`] (device, compilation, cache).
    pub fn setup_seconds(&self) -> f64 {
        self.setup_seconds
    }

    /// Host time of the last forward pass up to its first download: how
    /// long enqueueing its work took (when close to the pass's wall time,
    /// the pass is bound by the host, not the device).
    pub fn last_enqueue_seconds(&self) -> f64 {
        self.enqueue_seconds
    }

    /// Fused kernels compiled for the model.
    pub fn fused_kernels(&self) -> usize {
        self.program.fused_kernels
    }

    /// The fusion plan of every phase, for reports.
    pub fn fusion_listing(&self) -> &str {
        &self.program.listing
    }

    /// Seeds the dropout masks (same stream of draws as the CPU engine).
    pub fn set_seed(&mut self, seed: u64) {
        self.rng = ChaCha8Rng::seed_from_u64(seed);
    }

    /// External inputs for `pull()`, `num_vertices x width` by vertex number.
    pub fn set_pull_values(&mut self, values: Option<Vec<f32>>) {
        self.pull_values = values;
    }

    fn check_model(&self, model: &Model) -> Result<()> {
        if crate::program::fingerprint(model) != self.program.fingerprint {
            return Err(model_err(format!(
                "the CUDA engine was set up for another model than `{}`; create one per model",
                model.name
            )));
        }
        Ok(())
    }

    /// Uploads the parameters when their version changed.
    fn sync_params(&mut self, model: &Model, params: &Params<f32>) -> Result<()> {
        if self
            .params
            .as_ref()
            .is_some_and(|p| p.version == params.version())
        {
            return Ok(());
        }
        let total: usize = params.values.iter().map(|t| t.data().len()).sum();
        let stream = self.device.stream().clone();
        let (values_buf, grads_buf, generation) = match self.params.take() {
            Some(old) if old.values.iter().map(|v| v.len()).sum::<usize>() == total => {
                (old._values, old._grads, old.generation)
            }
            old => (
                self.pool.alloc::<f32>(total.max(1))?,
                self.pool.alloc::<f32>(total.max(1))?,
                old.map_or(0, |o| o.generation + 1),
            ),
        };
        let host = self.staging.host_mut::<f32>(total)?;
        let mut values = Vec::with_capacity(params.values.len());
        let mut at = 0;
        for t in &params.values {
            let d = t.data();
            host[at..at + d.len()].copy_from_slice(d);
            values.push(values_buf.view().slice(at..at + d.len())?);
            at += d.len();
        }
        self.staging
            .upload(values_buf.view().slice(0..total)?, &stream)?;
        // gradients: dense parameters first
        let rows = &self.program.row_grad_params;
        let mut grads = vec![values_buf.view().slice(0..0)?; params.values.len()];
        let mut at = 0;
        for pass_rows in [false, true] {
            for (p, t) in params.values.iter().enumerate() {
                if rows.contains(&p) == pass_rows {
                    let len = t.data().len();
                    grads[p] = grads_buf.view().slice(at..at + len)?;
                    at += len;
                }
            }
        }
        let dense_len = params
            .values
            .iter()
            .enumerate()
            .filter(|(p, _)| !rows.contains(p))
            .map(|(_, t)| t.data().len())
            .sum();
        if model.params.len() != params.values.len() {
            return Err(model_err(format!(
                "{} parameter tensors for a model with {}",
                params.values.len(),
                model.params.len()
            )));
        }
        self.params = Some(DeviceParams {
            grad_all: grads_buf.view().slice(0..total)?,
            _values: values_buf,
            _grads: grads_buf,
            values,
            grads,
            dense_len,
            version: params.version(),
            generation,
            host_stale: false,
        });
        Ok(())
    }

    fn param_views(&self) -> Result<&DeviceParams> {
        self.params
            .as_ref()
            .ok_or_else(|| model_err("parameters were not uploaded"))
    }

    /// Stages every index array of the batch and uploads them in one copy.
    fn upload_indices(
        &mut self,
        model: &Model,
        s: &Schedule,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<()> {
        let mut ix: Vec<u32> = Vec::new();
        let push = |data: &mut dyn Iterator<Item = u32>, ix: &mut Vec<u32>| {
            let offset = ix.len();
            ix.extend(data);
            Seg {
                offset,
                len: ix.len() - offset,
            }
        };
        // head rows
        let head_vertices = head_vertices(rows, s);
        if head_vertices.is_empty() {
            return Err(model_err(
                "the batch has no vertex for the head (no labelled vertex)",
            ));
        }
        let mut segs = Vec::with_capacity(model.functions.len());
        for (f, func) in model.functions.iter().enumerate() {
            let fr = &s.functions[f];
            let mut seg = FunctionSegs {
                tokens: push(
                    &mut fr.vertex.iter().map(|&v| s.tokens[v as usize]),
                    &mut ix,
                ),
                ..FunctionSegs::default()
            };
            seg.max_token = fr
                .vertex
                .iter()
                .map(|&v| s.tokens[v as usize])
                .max()
                .unwrap_or(0);
            for k in 0..func.gather_arity {
                seg.children.push(push(
                    &mut (0..fr.rows()).map(|r| fr.child(r, k).unwrap_or(NONE)),
                    &mut ix,
                ));
            }
            seg.edge_child = push(&mut fr.edge_child.iter().copied(), &mut ix);
            seg.edge_offsets = push(&mut fr.edge_offsets.iter().copied(), &mut ix);
            seg.edge_parent = push(&mut fr.edge_parent.iter().copied(), &mut ix);
            let mine: Vec<(u32, u32)> = head_vertices
                .iter()
                .enumerate()
                .filter(|(_, &v)| s.vertex_function[v as usize] as usize == f)
                .map(|(i, &v)| (i as u32, s.vertex_row[v as usize]))
                .collect();
            seg.head_rows = push(&mut mine.iter().map(|p| p.0), &mut ix);
            seg.head_sources = push(&mut mine.iter().map(|p| p.1), &mut ix);
            segs.push(seg);
        }
        let needs_labels = mode != Mode::Infer;
        let mut label_seg = None;
        let mut max_label = 0;
        if needs_labels {
            let mut labels = Vec::with_capacity(head_vertices.len());
            for &v in &head_vertices {
                let l = s.labels[v as usize];
                if l < 0 {
                    return Err(model_err(format!(
                        "graph {} of the batch has a head vertex without a label",
                        s.graph[v as usize]
                    )));
                }
                labels.push(l as u32);
                max_label = max_label.max(l as u32);
            }
            label_seg = Some(push(&mut labels.into_iter(), &mut ix));
        }
        let all =
            self.arena_alloc::<u32>(ix.len().max(1), &|| "the batch's index arrays".into())?;
        let stream = self.device.stream().clone();
        self.staging
            .upload_slice(&ix, all.slice(0..ix.len())?, &stream)?;
        self.launcher.count();
        let view = |seg: Seg| all.slice(seg.offset..seg.offset + seg.len);
        let mut topo = Vec::with_capacity(segs.len());
        for seg in segs {
            topo.push(Some(Topology {
                tokens: view(seg.tokens)?,
                children: seg
                    .children
                    .iter()
                    .map(|&c| view(c))
                    .collect::<Result<_>>()?,
                edge_child: view(seg.edge_child)?,
                edge_offsets: view(seg.edge_offsets)?,
                edge_parent: view(seg.edge_parent)?,
                head_rows: view(seg.head_rows)?,
                head_sources: view(seg.head_sources)?,
                max_token: seg.max_token,
            }));
        }
        self.state.topo = topo;
        self.state.labels = label_seg.map(view).transpose()?;
        self.state.max_label = max_label;
        self.state.head_vertices = head_vertices;
        Ok(())
    }

    /// Allocates the buffers of `g` for `rows` vertex rows and `edges`
    /// edge rows; float inputs get what `float_input` supplies.
    fn alloc_bufs(
        &mut self,
        g: &Graph,
        prog: &GraphProgram,
        rows: usize,
        edges: usize,
        tokens: Option<DeviceView<u32>>,
    ) -> Result<Vec<Buf>> {
        let mut bufs = vec![Buf::Absent; g.nodes.len()];
        for (n, node) in g.nodes.iter().enumerate() {
            let count = match node.ty.space {
                Space::Vertex => rows,
                Space::Edge => edges,
                Space::Static => 1,
            };
            let len = count * node.ty.width();
            bufs[n] = match (&node.kind, node.ty.dtype) {
                (NodeKind::Param(_), _) | (NodeKind::Input(Source::Forward(_)), _) => Buf::Absent,
                (NodeKind::Input(Source::Token), _) => Buf::Indices(
                    tokens.ok_or_else(|| model_err("token input outside a vertex function"))?,
                ),
                // absent when inferring: no step that runs then reads labels
                (NodeKind::Input(Source::Label), _) => {
                    self.state.labels.map_or(Buf::Absent, Buf::Indices)
                }
                _ if !prog.materialized[n] => Buf::Absent,
                (_, DType::Float) => {
                    Buf::Floats(self.arena_alloc::<f32>(len, &|| node_label(g, n))?)
                }
                (_, DType::Index) => {
                    Buf::Indices(self.arena_alloc::<u32>(len, &|| node_label(g, n))?)
                }
            };
        }
        Ok(bufs)
    }

    /// `len` elements from the batch arena; a request over the device
    /// memory budget is an error naming the tensor (`what`), its size and
    /// the budget.
    fn arena_alloc<T: DeviceScalar>(
        &self,
        len: usize,
        what: &dyn Fn() -> String,
    ) -> Result<DeviceView<T>> {
        let allocated = self.arena.borrow_mut().alloc::<T>(len);
        allocated.map_err(|e| match e {
            CudaError::OutOfPoolMemory { pool_size, .. } => model_err(format!(
                "the device memory budget is exceeded: {} ({} bytes) does not fit ({e}); \
                 the pool holds {pool_size} bytes; raise --device-memory-budget or lower \
                 the batch size",
                what(),
                len * std::mem::size_of::<T>()
            )),
            e => e,
        })
    }

    /// Row moves adding the head's input gradients (`src`: `pw` floats per
    /// head row) into each function's pushed-value gradient, whose buffer
    /// `buf(f, node)` gives.
    fn push_grad_moves(
        &self,
        model: &Model,
        src: DeviceView<f32>,
        pw: usize,
        buf: impl Fn(usize, NodeId) -> Buf,
    ) -> Result<Vec<RowMove>> {
        let mut moves = Vec::new();
        for (f, func) in model.functions.iter().enumerate() {
            let topo = self.topology(f)?;
            let Some(pg) = func.output_grad_node(Role::Push) else {
                continue;
            };
            let Buf::Floats(dst) = buf(f, pg) else {
                continue;
            };
            moves.push(RowMove {
                dst,
                src,
                dst_rows: Some(topo.head_sources),
                src_rows: Some(topo.head_rows),
                rows: topo.head_rows.len(),
                width: pw,
                accumulate: true,
            });
        }
        Ok(moves)
    }

    /// Draws (on the host, same order as the CPU engine) and uploads the
    /// dropout masks of `g`.
    fn fill_masks(&mut self, g: &Graph, bufs: &[Buf], training: bool) -> Result<()> {
        let stream = self.device.stream().clone();
        for (n, node) in g.nodes.iter().enumerate() {
            if let (NodeKind::Input(Source::DropoutMask { rate, .. }), Buf::Floats(v)) =
                (&node.kind, bufs[n])
            {
                if training {
                    let mut mask = vec![0f32; v.len()];
                    fill_dropout_mask(&mut mask, *rate, true, &mut self.rng);
                    self.staging.upload_slice(&mask, v, &stream)?;
                    self.launcher.count();
                } else {
                    self.launcher.fill(&stream, v, 1.0)?;
                }
            }
        }
        Ok(())
    }

    fn forward_pass(
        &mut self,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> Result<ForwardOutput<f32>> {
        self.check_model(model)?;
        // on the swap path, forward-only passes go op by op too (tensors
        // freed after their last use)
        if mode != Mode::Train
            && self.swap.is_some()
            && (crate::swap::steps::check_static(model, &self.program).is_ok()
                || crate::swap::steps::check_dynamic(model, &self.program).is_ok())
        {
            return self.swap_forward(model, params, batch, mode, rows);
        }
        self.pass_started = Some(std::time::Instant::now());
        self.inference_pass = mode != Mode::Train;
        let program = self.program.clone();
        let s = &batch.schedule;
        self.state.forward_done = false;
        self.arena.borrow_mut().reset()?;
        // the lanes' scratch memory was part of the last batch
        self.main.workspace.set(None);
        self.eager.workspace.set(None);
        self.sync_params(model, params)?;
        self.upload_indices(model, s, mode, rows)?;
        let stream = self.device.stream().clone();
        let w = model.state_width;
        let state =
            self.arena_alloc::<f32>(s.num_vertices() * w, &|| "the vertex states".into())?;
        let training = mode == Mode::Train;
        // without a backward pass to follow, fusion keeps fewer values
        let programs: Vec<&GraphProgram> = if training {
            program.functions.iter().map(|p| &p.0).collect()
        } else {
            program.infer_functions.iter().collect()
        };
        let mut fwd = Vec::with_capacity(model.functions.len());
        for (f, func) in model.functions.iter().enumerate() {
            let fr = &s.functions[f];
            let tokens = self.state.topo[f].as_ref().map(|t| t.tokens);
            let bufs =
                self.alloc_bufs(&func.forward, programs[f], fr.rows(), fr.edges(), tokens)?;
            self.fill_masks(&func.forward, &bufs, training)?;
            if let Some(pull) = func.forward.input_node(Source::Pull) {
                self.upload_pull(&func.forward, pull, &bufs, fr, s, &func.name)?;
            }
            fwd.push(bufs);
        }
        let graphs: Vec<&Graph> = model.functions.iter().map(|f| &f.forward).collect();
        self.run_eager(&graphs, &programs, &fwd, None, s)?;
        let mut joined = vec![false; model.functions.len()];
        for task in &s.tasks {
            let f = task.function;
            let func = &model.functions[f];
            let range = Range::task(task);
            self.join_eager(f, &mut joined)?;
            let topo = self.topology(f)?;
            let mut moves = Vec::new();
            for (n, node) in func.forward.nodes.iter().enumerate() {
                let (src_rows, lo, hi) = match node.kind {
                    NodeKind::Input(Source::Gather(k)) => (
                        topo.children.get(k).copied().ok_or_else(|| {
                            model_err(format!("gather({k}) beyond the function's arity"))
                        })?,
                        range.r0,
                        range.r1,
                    ),
                    NodeKind::Input(Source::GatherAll) => (topo.edge_child, range.e0, range.e1),
                    _ => continue,
                };
                let Buf::Floats(dst) = fwd[f][n] else {
                    continue;
                };
                moves.push(RowMove {
                    dst: dst.slice(lo * w..hi * w)?,
                    src: state,
                    dst_rows: None,
                    src_rows: Some(src_rows.slice(lo..hi)?),
                    rows: hi - lo,
                    width: w,
                    accumulate: false,
                });
            }
            self.launcher.move_rows(&stream, &moves)?;
            // A scattered node written in place gets, for this task, a view
            // whose rows `r0..r1` (all that per-task steps touch) are the
            // task's state rows (a task's vertices are consecutive).
            let (begin, len) = (task.begin as usize, task.len as usize);
            let in_place = programs[f].scatter_in_place;
            let own_buffer = match in_place {
                Some(sc) => {
                    let own = fwd[f][sc];
                    fwd[f][sc] = Buf::Floats(state.shifted(begin * w, range.r0 * w, len * w)?);
                    Some((sc, own))
                }
                None => None,
            };
            let ran = self.run_steps(
                &func.forward,
                programs[f],
                PER_TASK,
                &fwd[f],
                None,
                range,
                Some(f),
                &self.main,
            );
            if let Some((sc, own)) = own_buffer {
                fwd[f][sc] = own;
            }
            ran?;
            if let (Some(sc), None) = (func.scatter, in_place) {
                let src = self.float_view(&func.forward, sc, &fwd[f], None, range)?;
                let dst = state.slice(begin * w..(begin + len) * w)?;
                self.launcher
                    .copy_columns(&stream, dst, w, 0, src, w, 0, w, len)?;
            }
        }
        for (f, func) in model.functions.iter().enumerate() {
            self.join_eager(f, &mut joined)?;
            let range = Range::all(&s.functions[f]);
            self.run_steps(
                &func.forward,
                programs[f],
                LAZY,
                &fwd[f],
                None,
                range,
                Some(f),
                &self.main,
            )?;
        }
        self.state.fwd = fwd;
        let out = self.run_head(model, mode)?;
        self.state.forward_done = training;
        Ok(out)
    }

    fn upload_pull(
        &mut self,
        g: &Graph,
        pull: NodeId,
        bufs: &[Buf],
        fr: &FunctionRows,
        s: &Schedule,
        name: &str,
    ) -> Result<()> {
        let pw = g.nodes[pull].ty.width();
        let explicit = self.pull_values.is_some();
        let values = self.pull_values.as_deref().unwrap_or(&s.features);
        let values = ramus_cpu::pulled_values(values, s, pw, name, explicit)
            .map_err(|e| model_err(e.to_string()))?;
        let mut rows = Vec::with_capacity(fr.rows() * pw);
        for &v in &fr.vertex {
            rows.extend_from_slice(&values[v as usize * pw..(v as usize + 1) * pw]);
        }
        if let Buf::Floats(dst) = bufs[pull] {
            let stream = self.device.stream().clone();
            self.staging.upload_slice(&rows, dst, &stream)?;
            self.launcher.count();
        }
        Ok(())
    }

    fn topology(&self, f: usize) -> Result<&Topology> {
        self.state
            .topo
            .get(f)
            .and_then(Option::as_ref)
            .ok_or_else(|| model_err("batch topology missing"))
    }

    fn run_head(&mut self, model: &Model, mode: Mode) -> Result<ForwardOutput<f32>> {
        let head = &model.head;
        let g = &head.forward;
        let h = self.state.head_vertices.len();
        let stream = self.device.stream().clone();
        let program = self.program.clone();
        let head_program = if mode == Mode::Train {
            &program.head_forward
        } else {
            &program.head_forward_infer
        };
        let bufs = self.alloc_bufs(g, head_program, h, 0, None)?;
        self.fill_masks(g, &bufs, mode == Mode::Train)?;
        if let Some(inp) = g.input_node(Source::HeadInput) {
            let Buf::Floats(dst) = bufs[inp] else {
                return Err(model_err("head input has no buffer"));
            };
            let pw = g.nodes[inp].ty.width();
            let mut moves = Vec::new();
            for (f, func) in model.functions.iter().enumerate() {
                let topo = self.topology(f)?;
                if topo.head_rows.is_empty() {
                    continue;
                }
                let push = func
                    .push
                    .ok_or_else(|| model_err(format!("function `{}` pushes nothing", func.name)))?;
                let src = self.whole_view(&func.forward, push, &self.state.fwd[f], None)?;
                moves.push(RowMove {
                    dst,
                    src,
                    dst_rows: Some(topo.head_rows),
                    src_rows: Some(topo.head_sources),
                    rows: topo.head_rows.len(),
                    width: pw,
                    accumulate: false,
                });
            }
            self.launcher.move_rows(&stream, &moves)?;
        }
        let phase = if mode == Mode::Infer {
            HEAD_SCORES
        } else {
            HEAD_ALL
        };
        self.run_steps(
            g,
            head_program,
            phase,
            &bufs,
            None,
            Range::rows_only(h),
            None,
            &self.main,
        )?;
        if let Some(t) = self.pass_started.take() {
            self.enqueue_seconds = t.elapsed().as_secs_f64();
        }
        let loss = if mode != Mode::Infer {
            let v = self.float_view(g, head.loss, &bufs, None, Range::rows_only(h))?;
            let host = self.staging.download_to_vec(v, &stream)?;
            Some(f64::from(host.first().copied().unwrap_or(f32::NAN)))
        } else {
            None
        };
        let (logits, classes) = match head.logits {
            Some(l) => {
                let v = self.float_view(g, l, &bufs, None, Range::rows_only(h))?;
                (
                    self.staging.download_to_vec(v, &stream)?,
                    g.nodes[l].ty.width(),
                )
            }
            None => (Vec::new(), 0),
        };
        self.state.head_fwd = bufs;
        Ok(ForwardOutput {
            loss,
            head_vertices: self.state.head_vertices.clone(),
            logits,
            classes,
        })
    }

    /// Runs phase `phase` of graph `g`'s program over `range`; `f` names the vertex
    /// function whose topology (edges, children) the steps may use.
    #[allow(clippy::too_many_arguments)] // graph, steps, buffers, rows, function, lane
    fn run_steps(
        &self,
        g: &Graph,
        prog: &GraphProgram,
        phase: usize,
        bufs: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
        f: Option<usize>,
        lane: &Lane,
    ) -> Result<()> {
        let topo = f.map(|f| self.topology(f)).transpose()?;
        for step in &prog.phases[phase] {
            self.run_step(g, step, bufs, fwd, range, topo, lane, &prog.views)?;
        }
        Ok(())
    }

    /// Runs every function's eager steps on the eager lane once the pass's
    /// inputs are on the device, recording one event per function.
    fn run_eager(
        &self,
        graphs: &[&Graph],
        programs: &[&GraphProgram],
        bufs: &[Vec<Buf>],
        fwd: Option<&[Vec<Buf>]>,
        s: &Schedule,
    ) -> Result<()> {
        self.inputs_ready
            .record(&self.main.stream)
            .in_call("cuEventRecord")?;
        self.eager
            .stream
            .wait(&self.inputs_ready)
            .in_call("cuStreamWaitEvent")?;
        for (f, g) in graphs.iter().enumerate() {
            let range = Range::all(&s.functions[f]);
            let fwd_f = fwd.map(|b| b[f].as_slice());
            self.run_steps(
                g,
                programs[f],
                EAGER,
                &bufs[f],
                fwd_f,
                range,
                Some(f),
                &self.eager,
            )?;
            self.eager_done[f]
                .record(&self.eager.stream)
                .in_call("cuEventRecord")?;
        }
        Ok(())
    }

    /// Makes the main lane wait for function `f`'s eager steps (once).
    fn join_eager(&self, f: usize, joined: &mut [bool]) -> Result<()> {
        if !joined[f] {
            self.main
                .stream
                .wait(&self.eager_done[f])
                .in_call("cuStreamWaitEvent")?;
            joined[f] = true;
        }
        Ok(())
    }

    /// The buffer of node `n` (a backward graph's `Forward(m)` inputs live
    /// in the forward buffers; parameters in the parameter buffer).
    fn buf(&self, g: &Graph, n: NodeId, own: &[Buf], fwd: Option<&[Buf]>) -> Result<Buf> {
        match g.nodes[n].kind {
            NodeKind::Param(p) => Ok(Buf::Floats(
                *self
                    .param_views()?
                    .values
                    .get(p)
                    .ok_or_else(|| model_err(format!("no parameter {p}")))?,
            )),
            NodeKind::Input(Source::Forward(m)) => {
                let fwd = fwd
                    .ok_or_else(|| model_err("forward value requested outside a backward graph"))?;
                Ok(fwd[m])
            }
            _ => Ok(own[n]),
        }
    }

    /// Node `n`'s floats restricted to `range` (whole for static values).
    fn float_view(
        &self,
        g: &Graph,
        n: NodeId,
        own: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
    ) -> Result<DeviceView<f32>> {
        let v = self.whole_view(g, n, own, fwd)?;
        rows_of_view(v, &g.nodes[n].ty, range)
    }

    /// Node `n`'s whole float buffer.
    fn whole_view(
        &self,
        g: &Graph,
        n: NodeId,
        own: &[Buf],
        fwd: Option<&[Buf]>,
    ) -> Result<DeviceView<f32>> {
        match self.buf(g, n, own, fwd)? {
            Buf::Floats(v) => Ok(v),
            _ => Err(no_buffer(g, n, "float")),
        }
    }

    /// Node `n`'s indices restricted to `range`.
    fn index_view(
        &self,
        g: &Graph,
        n: NodeId,
        own: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
    ) -> Result<DeviceView<u32>> {
        match self.buf(g, n, own, fwd)? {
            Buf::Indices(v) => rows_of_view(v, &g.nodes[n].ty, range),
            _ => Err(no_buffer(g, n, "index")),
        }
    }

    #[allow(clippy::too_many_arguments)] // graph, step, buffers, rows, topology, lane, views
    fn run_step(
        &self,
        g: &Graph,
        step: &ExecStep,
        own: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
        topo: Option<&Topology>,
        lane: &Lane,
        views: &HashMap<NodeId, SliceView>,
    ) -> Result<()> {
        match &step.step {
            PlannedStep::Fused(group) => {
                self.run_fused(g, group, step.kernel()?, own, fwd, range, topo, lane)
            }
            PlannedStep::GemmBias {
                matmul,
                bias,
                group,
            } => {
                let a_space = g.nodes[g.nodes[*matmul].inputs[0]].ty.space;
                let (lo, hi) = range.span(a_space);
                if hi - lo > SMALL_GEMM_ROWS {
                    self.run_op(g, *matmul, own, fwd, range, topo, lane, views)?;
                    return self.run_fused(g, group, step.kernel()?, own, fwd, range, topo, lane);
                }
                let bias = self.float_view(g, *bias, own, fwd, range)?;
                let out = self.float_view(g, group.nodes[0], own, fwd, range)?;
                self.run_matmul(g, *matmul, own, fwd, range, lane, views, Some(bias), out)
            }
            PlannedStep::Op(n) => self.run_op(g, *n, own, fwd, range, topo, lane, views),
        }
    }

    /// Launches fused group `group` (compiled as `kernel`) over `range`
    /// (child-sum and parent-row inputs read `topo`).
    #[allow(clippy::too_many_arguments)] // graph, group, kernel, buffers, rows, topology, lane
    fn run_fused(
        &self,
        g: &Graph,
        group: &FusedGroup,
        kernel: &CudaFunction,
        own: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
        topo: Option<&Topology>,
        lane: &Lane,
    ) -> Result<()> {
        let stream = &lane.stream;
        let need_topo = || {
            topo.ok_or_else(|| {
                model_err("a child-sum or parent-row read outside a vertex function")
            })
        };
        let (lo, hi) = range.span(group.space);
        let n = (hi - lo) * group.width;
        if n == 0 {
            return Ok(());
        }
        let mut args = FusedArgs {
            n,
            width: group.width,
            ..FusedArgs::default()
        };
        let mut concat_strides = Vec::new();
        for input in &group.inputs {
            let view = match input.kind {
                InputKind::Window {
                    source,
                    offset,
                    stride,
                } => {
                    args.strides.push([
                        u32_of(stride, "window stride")?,
                        u32_of(offset, "window offset")?,
                    ]);
                    self.float_view(g, source, own, fwd, range)?
                }
                InputKind::PerElement | InputKind::Broadcast => {
                    self.float_view(g, input.node, own, fwd, range)?
                }
                InputKind::ChildSum { source } => {
                    let t = need_topo()?;
                    args.csr.push((
                        t.edge_offsets.slice(range.r0..range.r1 + 1)?,
                        u32_of(range.e0, "edge base")?,
                    ));
                    self.float_view(g, source, own, fwd, range)?
                }
                InputKind::ParentRow { source } => {
                    let t = need_topo()?;
                    args.csr.push((
                        t.edge_parent.slice(range.e0..range.e1)?,
                        u32_of(range.r0, "row base")?,
                    ));
                    self.float_view(g, source, own, fwd, range)?
                }
            };
            args.inputs.push(view);
        }
        for &o in &group.outputs {
            args.outputs.push(self.float_view(g, o, own, fwd, range)?);
        }
        for cw in &group.concat_writes {
            args.concats
                .push(self.float_view(g, cw.concat, own, fwd, range)?);
            concat_strides.push([
                u32_of(cw.stride, "concat stride")?,
                u32_of(cw.offset, "concat offset")?,
            ]);
        }
        args.strides.extend(concat_strides);
        self.launcher.fused(stream, kernel, &args)
    }

    /// Matmul node `n` into `c`, plus a broadcast `bias` row if given:
    /// over few rows a product `A·Bᵀ` with a static `B` runs on the
    /// small-product kernel (which also adds the bias), anything else on
    /// cuBLAS (a bias needs the small kernel: callers fall back before).
    #[allow(clippy::too_many_arguments)] // graph, node, buffers, rows, lane, views, bias, output
    fn run_matmul(
        &self,
        g: &Graph,
        n: NodeId,
        own: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
        lane: &Lane,
        views: &HashMap<NodeId, SliceView>,
        bias: Option<DeviceView<f32>>,
        c: DeviceView<f32>,
    ) -> Result<()> {
        let node = &g.nodes[n];
        let mm = node
            .op_as::<MatMul>()
            .ok_or_else(|| model_err(format!("%{n} is not a matmul")))?;
        let arg = |i: usize| node.inputs[i];
        let (a, b) = (&g.nodes[arg(0)].ty, &g.nodes[arg(1)].ty);
        let rows_of = |space: Space| {
            let (lo, hi) = range.span(space);
            hi - lo
        };
        let dims = |t: &ramus_core::ValueType, rows: usize| {
            if t.is_rows() {
                (rows, t.width())
            } else {
                (t.shape[0], t.shape[1])
            }
        };
        let (ar, ac) = dims(a, rows_of(a.space));
        let (br, bc) = dims(b, rows_of(b.space));
        let (m, k) = if mm.trans_a { (ac, ar) } else { (ar, ac) };
        let nn = if mm.trans_b { br } else { bc };
        if m * nn == 0 {
            return Ok(());
        }
        // a viewed slice is read in place: its source, from the column
        // offset, with the source's row width as leading dimension
        let operand = |i: usize| -> Result<(DeviceView<f32>, Option<usize>)> {
            match views.get(&arg(i)) {
                Some(v) => {
                    let (lo, hi) = range.span(g.nodes[v.source].ty.space);
                    let src = self.whole_view(g, v.source, own, fwd)?;
                    Ok((
                        src.slice(lo * v.stride + v.offset..hi * v.stride)?,
                        Some(v.stride),
                    ))
                }
                None => Ok((self.float_view(g, arg(i), own, fwd, range)?, None)),
            }
        };
        let ((a_view, lda), (b_view, ldb)) = (operand(0)?, operand(1)?);
        let stream = &lane.stream;
        let small = !mm.trans_a && mm.trans_b && !b.is_rows() && ldb.is_none();
        if small && m <= SMALL_GEMM_ROWS && k > 0 {
            let lda = lda.unwrap_or(k);
            return self
                .launcher
                .gemm_abt_small(stream, c, a_view, lda, b_view, bias, (m, nn, k));
        }
        if bias.is_some() {
            return Err(model_err(format!(
                "%{n}: a bias is added in the product only over at most {SMALL_GEMM_ROWS} rows"
            )));
        }
        if k == 0 {
            return self.launcher.fill(stream, c, 0.0);
        }
        let gemm = Gemm {
            trans_a: mm.trans_a,
            trans_b: mm.trans_b,
            lda,
            ldb,
            ..Gemm::new(m, nn, k)
        };
        lane.blas.sgemm(&gemm, a_view, b_view, c)?;
        self.launcher.count();
        Ok(())
    }

    #[allow(clippy::too_many_arguments)] // graph, node, buffers, rows, topology, lane, views
    fn run_op(
        &self,
        g: &Graph,
        n: NodeId,
        own: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
        topo: Option<&Topology>,
        lane: &Lane,
        views: &HashMap<NodeId, SliceView>,
    ) -> Result<()> {
        let stream = lane.stream.clone();
        let node = &g.nodes[n];
        let NodeKind::Op(op) = &node.kind else {
            return Ok(());
        };
        let any: &dyn Any = op.as_ref();
        let rows_of = |space: Space| {
            let (lo, hi) = range.span(space);
            hi - lo
        };
        let out_rows = rows_of(node.ty.space);
        let arg = |i: usize| node.inputs[i];
        let fv = |i: usize| self.float_view(g, arg(i), own, fwd, range);
        let out = || self.float_view(g, n, own, fwd, range);
        let in_ty = |i: usize| &g.nodes[arg(i)].ty;
        let need_topo =
            || topo.ok_or_else(|| model_err(format!("{} outside a vertex function", op.name())));
        if any.downcast_ref::<MatMul>().is_some() {
            return self.run_matmul(g, n, own, fwd, range, lane, views, None, out()?);
        }
        if any.downcast_ref::<Concat>().is_some() {
            let (o, ow) = (out()?, node.ty.width());
            let mut start = 0;
            for i in 0..node.inputs.len() {
                let w = in_ty(i).width();
                self.launcher
                    .copy_columns(&stream, o, ow, start, fv(i)?, w, 0, w, out_rows)?;
                start += w;
            }
            return Ok(());
        }
        if let Some(sl) = any.downcast_ref::<Slice>() {
            let w = in_ty(0).width();
            return self.launcher.copy_columns(
                &stream,
                out()?,
                sl.len,
                0,
                fv(0)?,
                w,
                sl.start,
                sl.len,
                out_rows,
            );
        }
        if let Some(pad) = any.downcast_ref::<Pad>() {
            let (o, w) = (out()?, in_ty(0).width());
            self.launcher.fill(&stream, o, 0.0)?;
            return self.launcher.copy_columns(
                &stream,
                o,
                pad.total,
                pad.start,
                fv(0)?,
                w,
                0,
                w,
                out_rows,
            );
        }
        if any.downcast_ref::<SumChildren>().is_some() {
            let t = need_topo()?;
            let offsets = t.edge_offsets.slice(range.r0..range.r1 + 1)?;
            let width = node.ty.width();
            // a viewed slice: the rows of its source, read with a stride
            let (src, window) = match views.get(&arg(0)) {
                Some(v) => (
                    self.float_view(g, v.source, own, fwd, range)?,
                    (v.stride, v.offset),
                ),
                None => (fv(0)?, (width, 0)),
            };
            return self.launcher.sum_children(
                &stream,
                out()?,
                src,
                window,
                offsets,
                range.e0,
                out_rows,
                width,
            );
        }
        if any.downcast_ref::<ExpandChildren>().is_some() {
            let t = need_topo()?;
            let parent = t.edge_parent.slice(range.e0..range.e1)?;
            return self.launcher.expand_children(
                &stream,
                out()?,
                fv(0)?,
                parent,
                range.r0,
                out_rows,
                node.ty.width(),
            );
        }
        if let Some(sr) = any.downcast_ref::<SumRows>() {
            let rows = rows_of(in_ty(0).space);
            let scale = if sr.mean && rows > 0 {
                1.0 / rows as f32
            } else {
                1.0
            };
            return self
                .launcher
                .sum_rows(&stream, out()?, fv(0)?, rows, in_ty(0).width(), scale);
        }
        if let Some(br) = any.downcast_ref::<BroadcastRows>() {
            let rows = rows_of(in_ty(1).space);
            let scale = if br.mean && rows > 0 {
                1.0 / rows as f32
            } else {
                1.0
            };
            return self.launcher.broadcast_rows(
                &stream,
                out()?,
                fv(0)?,
                rows,
                node.ty.width(),
                scale,
            );
        }
        if any.downcast_ref::<Reshape>().is_some() {
            let len = node.ty.width();
            return self
                .launcher
                .copy_columns(&stream, out()?, len, 0, fv(0)?, len, 0, len, 1);
        }
        if any.downcast_ref::<Embedding>().is_some() {
            let table = in_ty(0);
            let (vocab, h) = (table.shape[0], table.shape[1]);
            let idx = self.index_view(g, arg(1), own, fwd, range)?;
            match topo {
                Some(t) if is_tokens(idx, t, range) => {
                    if t.max_token as usize >= vocab {
                        return Err(model_err(format!(
                            "embedding: token id {} out of range for a table of {vocab} rows",
                            t.max_token
                        )));
                    }
                }
                _ => {
                    return Err(model_err(
                        "embedding: the CUDA engine looks up rows by the vertex tokens only",
                    ))
                }
            }
            return self.launcher.move_rows(
                &stream,
                &[RowMove {
                    dst: out()?,
                    src: fv(0)?,
                    dst_rows: None,
                    src_rows: Some(idx),
                    rows: out_rows,
                    width: h,
                    accumulate: false,
                }],
            );
        }
        if let Some(product) = any.downcast_ref::<RowMatMul>() {
            return self.launcher.row_matmul(
                &stream,
                out()?,
                fv(0)?,
                in_ty(0).is_rows(),
                fv(1)?,
                in_ty(1).is_rows(),
                out_rows,
                product,
            );
        }
        let unk_forward = any.downcast_ref::<EmbeddingUnk>().is_some();
        let unk_backward = any.downcast_ref::<EmbeddingUnkBackward>();
        if unk_forward || unk_backward.is_some() {
            let tokens = self.index_view(g, arg(1), own, fwd, range)?;
            let (table_rows, width) = match unk_backward {
                Some(b) => (b.rows, in_ty(0).width()),
                None => (in_ty(0).shape[0], in_ty(0).shape[1]),
            };
            let rows = rows_of(in_ty(1).space);
            return self.launcher.embedding_unk(
                &stream,
                out()?,
                fv(0)?,
                tokens,
                rows,
                table_rows,
                width,
                unk_backward.is_some(),
            );
        }
        let xent = any.downcast_ref::<SoftmaxXent>().is_some();
        if xent || any.downcast_ref::<SoftmaxXentBackward>().is_some() {
            let classes = in_ty(0).width();
            if self.state.max_label as usize >= classes {
                return Err(model_err(format!(
                    "softmax_xent: label {} out of range for {classes} classes",
                    self.state.max_label
                )));
            }
            let labels = self.index_view(g, arg(1), own, fwd, range)?;
            let up = if xent { None } else { Some(fv(2)?) };
            return self.launcher.softmax_xent(
                &stream,
                out()?,
                fv(0)?,
                labels,
                up,
                out_rows,
                classes,
            );
        }
        if self.run_cnn_op(any, g, n, own, fwd, range, lane)? {
            return Ok(());
        }
        Err(model_err(format!(
            "op `{}` (node %{n}) has no CUDA implementation",
            op.signature()
        )))
    }

    fn backward_pass(
        &mut self,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        grads: &mut Grads<f32>,
    ) -> Result<()> {
        self.backward_on_device(model, params, batch)?;
        self.download_grads(model, &batch.schedule, grads)
    }

    /// The backward pass up to the parameter gradients in device memory.
    fn backward_on_device(
        &mut self,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
    ) -> Result<()> {
        if !std::mem::take(&mut self.state.forward_done) {
            return Err(model_err(
                "backward needs a preceding forward pass in train mode",
            ));
        }
        self.check_model(model)?;
        if self.params.as_ref().map(|p| p.version) != Some(params.version()) {
            return Err(model_err(
                "the parameters changed between the forward and the backward pass",
            ));
        }
        let s = &batch.schedule;
        let stream = self.device.stream().clone();
        let w = model.state_width;
        let grad_all = self.param_views()?.grad_all;
        self.launcher.fill(&stream, grad_all, 0.0)?;
        // head backward
        let head = &model.head;
        let hb = &head.backward;
        let h = self.state.head_vertices.len();
        let program = self.program.clone();
        let head_bwd = self.alloc_bufs(hb, &program.head_backward, h, 0, None)?;
        self.seed_output_grads(hb, &head_bwd, &head.forward)?;
        let head_fwd = std::mem::take(&mut self.state.head_fwd);
        self.run_steps(
            hb,
            &program.head_backward,
            0,
            &head_bwd,
            Some(&head_fwd),
            Range::rows_only(h),
            None,
            &self.main,
        )?;
        self.accumulate_param_grads(hb, &head_bwd, Some(&head_fwd), Range::rows_only(h), None)?;
        // per function backward buffers; push gradients from the head
        let fwd = std::mem::take(&mut self.state.fwd);
        let mut bwd = Vec::with_capacity(model.functions.len());
        for (f, func) in model.functions.iter().enumerate() {
            let fr = &s.functions[f];
            let tokens = self.state.topo[f].as_ref().map(|t| t.tokens);
            let bufs = self.alloc_bufs(
                &func.backward,
                &program.functions[f].1,
                fr.rows(),
                fr.edges(),
                tokens,
            )?;
            self.seed_output_grads(&func.backward, &bufs, &func.forward)?;
            bwd.push(bufs);
        }
        if let Some(out) = hb.output(Role::HeadInputGrad) {
            let src = self.float_view(
                hb,
                out.node,
                &head_bwd,
                Some(&head_fwd),
                Range::rows_only(h),
            )?;
            let pw = hb.nodes[out.node].ty.width();
            let moves = self.push_grad_moves(model, src, pw, |f, pg| bwd[f][pg])?;
            self.launcher.move_rows(&stream, &moves)?;
        }
        let state_grad = self.arena_alloc::<f32>(s.num_vertices() * w, &|| {
            "the vertex-state gradients".into()
        })?;
        self.launcher.fill(&stream, state_grad, 0.0)?;
        let graphs: Vec<&Graph> = model.functions.iter().map(|f| &f.backward).collect();
        let programs: Vec<&GraphProgram> = program.functions.iter().map(|p| &p.1).collect();
        self.run_eager(&graphs, &programs, &bwd, Some(&fwd), s)?;
        let mut joined = vec![false; model.functions.len()];
        for task in s.tasks.iter().rev() {
            let f = task.function;
            let func = &model.functions[f];
            let range = Range::task(task);
            self.join_eager(f, &mut joined)?;
            let topo = self.topology(f)?;
            if let Some(sg) = func.output_grad_node(Role::Scatter) {
                if let Buf::Floats(dst) = bwd[f][sg] {
                    let len = task.len as usize;
                    let src = state_grad
                        .slice(task.begin as usize * w..(task.begin as usize + len) * w)?;
                    let dst = dst.slice(range.r0 * w..range.r1 * w)?;
                    self.launcher
                        .copy_columns(&stream, dst, w, 0, src, w, 0, w, len)?;
                }
            }
            self.run_steps(
                &func.backward,
                &program.functions[f].1,
                PER_TASK,
                &bwd[f],
                Some(&fwd[f]),
                range,
                Some(f),
                &self.main,
            )?;
            let mut moves = Vec::new();
            for o in &func.backward.outputs {
                let (dst_rows, lo, hi) = match o.role {
                    Role::ChildGrad(k) => (
                        topo.children
                            .get(k)
                            .copied()
                            .ok_or_else(|| model_err(format!("child gradient {k} beyond arity")))?,
                        range.r0,
                        range.r1,
                    ),
                    Role::ChildGradAll => (topo.edge_child, range.e0, range.e1),
                    _ => continue,
                };
                let src = self.float_view(&func.backward, o.node, &bwd[f], Some(&fwd[f]), range)?;
                moves.push(RowMove {
                    dst: state_grad,
                    src,
                    dst_rows: Some(dst_rows.slice(lo..hi)?),
                    src_rows: None,
                    rows: hi - lo,
                    width: w,
                    accumulate: true,
                });
            }
            self.launcher.move_rows(&stream, &moves)?;
        }
        for (f, func) in model.functions.iter().enumerate() {
            self.join_eager(f, &mut joined)?;
            let range = Range::all(&s.functions[f]);
            self.run_steps(
                &func.backward,
                &program.functions[f].1,
                LAZY,
                &bwd[f],
                Some(&fwd[f]),
                range,
                Some(f),
                &self.main,
            )?;
            let topo = self.topology(f)?;
            self.accumulate_param_grads(&func.backward, &bwd[f], Some(&fwd[f]), range, Some(topo))?;
        }
        Ok(())
    }

    /// Zeroes every `OutputGrad` input of a backward graph, then seeds the
    /// loss gradient with 1.
    fn seed_output_grads(&mut self, g: &Graph, bufs: &[Buf], forward: &Graph) -> Result<()> {
        let stream = self.device.stream().clone();
        for (n, node) in g.nodes.iter().enumerate() {
            if let (NodeKind::Input(Source::OutputGrad(i)), Buf::Floats(v)) = (&node.kind, bufs[n])
            {
                let is_loss = forward
                    .outputs
                    .get(*i)
                    .is_some_and(|o| o.role == Role::Loss);
                self.launcher
                    .fill(&stream, v, if is_loss { 1.0 } else { 0.0 })?;
            }
        }
        Ok(())
    }

    /// Adds a backward graph's parameter-gradient outputs into the device
    /// gradient buffer.
    fn accumulate_param_grads(
        &self,
        g: &Graph,
        own: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
        topo: Option<&Topology>,
    ) -> Result<()> {
        for o in &g.outputs {
            self.accumulate_output(g, o, own, fwd, range, topo)?;
        }
        Ok(())
    }

    /// Adds output `o` of backward graph `g` over `range` into its
    /// parameter's device gradient if it is one (dense, or an embedding
    /// table's rows indexed by the vertex tokens).
    fn accumulate_output(
        &self,
        g: &Graph,
        o: &ramus_core::graph::Output,
        own: &[Buf],
        fwd: Option<&[Buf]>,
        range: Range,
        topo: Option<&Topology>,
    ) -> Result<()> {
        let stream = self.device.stream().clone();
        match o.role {
            Role::ParamGrad(p) => {
                let src = self.float_view(g, o.node, own, fwd, range)?;
                let dst = self.param_views()?.grads[p];
                self.launcher.add_into(&stream, dst, src)?;
            }
            Role::ParamRowGrad(p) => {
                let values = self.float_view(g, o.node, own, fwd, range)?;
                let index_node = o.aux.unwrap_or(o.node);
                let index = self.index_view(g, index_node, own, fwd, range)?;
                let dst = self.param_views()?.grads[p];
                let rows = index.len();
                let width = values.len().checked_div(rows).unwrap_or(0);
                // the index must be the vertex tokens, whose range the
                // host checked when it staged them
                match topo {
                    Some(t) if is_tokens(index, t, range) => {
                        if rows > 0 && (t.max_token as usize + 1) * width > dst.len() {
                            return Err(model_err(format!(
                                "row gradient: token {} outside parameter {p}",
                                t.max_token
                            )));
                        }
                    }
                    _ => {
                        return Err(model_err(
                            "row gradients are supported for token-indexed tables only",
                        ))
                    }
                }
                self.launcher.move_rows(
                    &stream,
                    &[RowMove {
                        dst,
                        src: values,
                        dst_rows: Some(index),
                        src_rows: None,
                        rows,
                        width,
                        accumulate: true,
                    }],
                )?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Adds the device gradients into `grads`: dense ones in one copy, row
    /// gradients of each table only for the rows the batch touched.
    fn download_grads(
        &mut self,
        model: &Model,
        s: &Schedule,
        grads: &mut Grads<f32>,
    ) -> Result<()> {
        let stream = self.device.stream().clone();
        let dp = self.param_views()?;
        let (dense_len, grad_all) = (dp.dense_len, dp.grad_all);
        let grad_views = dp.grads.clone();
        let dense = self
            .staging
            .download_to_vec(grad_all.slice(0..dense_len)?, &stream)?;
        let rows_params = &self.program.row_grad_params;
        let mut at = 0;
        for (p, t) in grads.values.iter_mut().enumerate() {
            if rows_params.contains(&p) {
                continue;
            }
            let len = t.data().len();
            for (d, &x) in t.data_mut().iter_mut().zip(&dense[at..at + len]) {
                *d += x;
            }
            at += len;
        }
        for p in 0..grads.values.len() {
            if !rows_params.contains(&p) {
                grads.mark_dense(p);
            }
        }
        for (p, touched) in self.touched_rows(model, s)? {
            let width = grads.row_width(p);
            let gathered = self.arena_alloc::<f32>(touched.len() * width, &|| {
                format!("touched rows of parameter {p}")
            })?;
            self.launcher.move_rows(
                &stream,
                &[RowMove {
                    dst: gathered,
                    src: grad_views[p],
                    dst_rows: None,
                    src_rows: Some(touched),
                    rows: touched.len(),
                    width,
                    accumulate: false,
                }],
            )?;
            let host = self.staging.download_to_vec(gathered, &stream)?;
            let rows = self.staging.download_to_vec(touched, &stream)?;
            for (i, &row) in rows.iter().enumerate() {
                grads.mark_row(p, row);
                let dst = &mut grads.values[p].data_mut()
                    [row as usize * width..(row as usize + 1) * width];
                for (d, &x) in dst.iter_mut().zip(&host[i * width..(i + 1) * width]) {
                    *d += x;
                }
            }
        }
        grads.finish_rows();
        Ok(())
    }
}

impl CudaEngine {
    /// Per row-gradient table, in parameter order: the rows this batch
    /// touches (the distinct tokens of the rows of every function whose
    /// backward graph adds rows into the table, as the CPU engine marks
    /// them), uploaded as one sorted device list per table.
    fn touched_rows(
        &mut self,
        model: &Model,
        s: &Schedule,
    ) -> Result<Vec<(usize, DeviceView<u32>)>> {
        let stream = self.device.stream().clone();
        let mut lists = Vec::new();
        for &p in &self.program.row_grad_params {
            let mut rows: Vec<u32> = Vec::new();
            for (f, func) in model.functions.iter().enumerate() {
                if func
                    .backward
                    .outputs
                    .iter()
                    .any(|o| o.role == Role::ParamRowGrad(p))
                {
                    rows.extend(s.functions[f].vertex.iter().map(|&v| s.tokens[v as usize]));
                }
            }
            rows.sort_unstable();
            rows.dedup();
            lists.push((p, rows));
        }
        let mut out = Vec::with_capacity(lists.len());
        for (p, rows) in lists {
            let view = self.arena_alloc::<u32>(rows.len(), &|| "touched row ids".into())?;
            self.staging.upload_slice(&rows, view, &stream)?;
            self.launcher.count();
            out.push((p, view));
        }
        Ok(out)
    }

    /// The optimizer on the device for the current parameter buffers,
    /// (re)built when missing, when the buffers moved, or when the
    /// optimizer kind or clipping changed.
    fn device_optimizer(
        &mut self,
        model: &Model,
        config: &OptimizerConfig,
    ) -> Result<&mut DeviceOptimizer> {
        let generation = self.param_views()?.generation;
        let reusable = match &mut self.optimizer {
            Some((built_for, opt)) if *built_for == generation => opt.set_config(config).is_ok(),
            _ => false,
        };
        if !reusable {
            let dp = self.param_views()?;
            let slots: Vec<ParamSlot> = (0..dp.values.len())
                .map(|p| ParamSlot {
                    value: dp.values[p],
                    grad: dp.grads[p],
                    layout: if model.is_buffer(p) {
                        GradLayout::Frozen
                    } else if self.program.row_grad_params.contains(&p) {
                        GradLayout::Rows {
                            width: model.params[p].shape.get(1).copied().unwrap_or(1),
                        }
                    } else {
                        GradLayout::Dense
                    },
                })
                .collect();
            let mut opt =
                DeviceOptimizer::new(&self.device, &self.pool, &self.cache, config, &slots)?;
            if let Some(host) = self.pending_optimizer.take() {
                opt.upload_from(self.device.stream(), &host)?;
            }
            self.optimizer = Some((generation, opt));
        }
        match &mut self.optimizer {
            Some((_, opt)) => Ok(opt),
            None => Err(model_err("device optimizer missing")),
        }
    }

    /// Forward, backward and the fused optimizer update (held back if the
    /// loss or a gradient is not finite), all on the device; the host
    /// parameters lag until [`CudaEngine::download_params`]. Returns the
    /// outcome of the step before, which the loss's download has brought
    /// back (see [`CudaEngine::settle_step`]); this step's stays pending.
    fn device_train_step(
        &mut self,
        model: &Model,
        params: &mut Params<f32>,
        config: &OptimizerConfig,
        batch: &Batch<'_>,
    ) -> Result<Option<StepOutcome>> {
        if self.swap.is_some() {
            return self.swap_train_step(model, params, config, batch);
        }
        self.check_model(model)?;
        self.sync_params(model, params)?;
        let stream = self.device.stream().clone();
        // a skipped step puts back the running statistics its forward pass blends
        let kept = self
            .device_optimizer(model, config)?
            .keep_buffers(&stream)?;
        (0..kept).for_each(|_| self.launcher.count());
        self.track_running_stats = true;
        let out = self.forward_pass(model, params, batch, Mode::Train, model.head.rows);
        self.track_running_stats = false;
        let out = out?;
        let loss = out
            .loss
            .ok_or_else(|| model_err("forward pass returned no loss"))?;
        let previous = self.settle_step()?;
        let loss_view = self.loss_view(model)?;
        self.backward_on_device(model, params, batch)?;
        let touched: Vec<DeviceView<u32>> = self
            .touched_rows(model, &batch.schedule)?
            .into_iter()
            .map(|(_, v)| v)
            .collect();
        let report = self
            .device_optimizer(model, config)?
            .step(&stream, &touched, loss_view, false)?;
        for _ in 0..report.launches {
            self.launcher.count();
        }
        self.pending_loss = Some(loss);
        // the device copy is now ahead of the host values
        params.touch();
        if let Some(dp) = self.params.as_mut() {
            dp.version = params.version();
            dp.host_stale = true;
        }
        Ok(previous)
    }

    /// Copies the device parameters into `params` if a device step changed them.
    pub fn download_params(&mut self, params: &mut Params<f32>) -> Result<()> {
        let stream = self.device.stream().clone();
        let Some(dp) = self.params.as_ref() else {
            return Ok(());
        };
        if !dp.host_stale || dp.version != params.version() {
            return Ok(());
        }
        let all = dp._values.view();
        let total: usize = params.values.iter().map(|t| t.data().len()).sum();
        let host = self
            .staging
            .download_to_vec(all.slice(0..total)?, &stream)?;
        let mut at = 0;
        for t in params.values.iter_mut() {
            let len = t.data().len();
            t.data_mut().copy_from_slice(&host[at..at + len]);
            at += len;
        }
        params.touch();
        if let Some(dp) = self.params.as_mut() {
            dp.version = params.version();
            dp.host_stale = false;
        }
        Ok(())
    }
}

/// The vertices the head runs on, in head-row order.
pub(crate) fn head_vertices(rows: HeadRows, s: &Schedule) -> Vec<u32> {
    match rows {
        HeadRows::Roots => s.roots.clone(),
        HeadRows::Labelled => s
            .number
            .iter()
            .copied()
            .filter(|&v| s.labels[v as usize] != NO_LABEL)
            .collect(),
    }
}

/// Whether `index` is the vertex tokens of `range` (the one index array
/// whose values the host has checked).
fn is_tokens(index: DeviceView<u32>, t: &Topology, range: Range) -> bool {
    t.tokens
        .slice(range.r0..range.r1)
        .is_ok_and(|own| own.device_ptr() == index.device_ptr() && own.len() == index.len())
}

impl ramus_nn::Engine<f32> for CudaEngine {
    fn name(&self) -> &'static str {
        "cuda-batched"
    }
    fn forward_rows(
        &mut self,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        mode: Mode,
        rows: HeadRows,
    ) -> ramus_nn::Result<ForwardOutput<f32>> {
        Ok(self.forward_pass(model, params, batch, mode, rows)?)
    }
    fn backward(
        &mut self,
        model: &Model,
        params: &Params<f32>,
        batch: &Batch<'_>,
        grads: &mut Grads<f32>,
    ) -> ramus_nn::Result<()> {
        Ok(self.backward_pass(model, params, batch, grads)?)
    }
    fn set_seed(&mut self, seed: u64) {
        CudaEngine::set_seed(self, seed)
    }
    fn dropout_rng(&self) -> ChaCha8Rng {
        self.rng.clone()
    }
    fn set_dropout_rng(&mut self, rng: ChaCha8Rng) {
        self.rng = rng;
    }
    fn sync_host_optimizer(&mut self, optimizer: &mut Optimizer<f32>) -> ramus_nn::Result<()> {
        Ok(self.download_optimizer(optimizer)?)
    }
    fn load_optimizer_state(&mut self, optimizer: &Optimizer<f32>) -> ramus_nn::Result<()> {
        Ok(self.upload_optimizer(optimizer)?)
    }
    fn memory_report(&self) -> Option<String> {
        self.last_swap_report().map(|r| r.to_string())
    }
    fn device_memory_room(&self) -> Option<u64> {
        self.memory_room().ok()
    }
    fn sync_host_params(&mut self, params: &mut Params<f32>) -> ramus_nn::Result<()> {
        Ok(self.download_params(params)?)
    }
    /// One step, waiting for its own outcome (a non-finite step is
    /// [`ramus_nn::NnError::NonFinite`]); the trainer's loop submits steps
    /// instead, learning each outcome with the next step's loss.
    fn train_step(
        &mut self,
        model: &Model,
        params: &mut Params<f32>,
        _grads: &mut Grads<f32>,
        optimizer: &mut Optimizer<f32>,
        batch: &Batch<'_>,
    ) -> ramus_nn::Result<f64> {
        // a step submitted before and not yet settled is settled first
        if let Some(Err(step)) = self.settle_step()? {
            return Err(step.into());
        }
        self.device_train_step(model, params, &optimizer.config, batch)?;
        match self.settle_step()? {
            Some(outcome) => outcome.map_err(Into::into),
            None => Err(model_err("the training step left no outcome").into()),
        }
    }
    fn submit_train_step(
        &mut self,
        model: &Model,
        params: &mut Params<f32>,
        _grads: &mut Grads<f32>,
        optimizer: &mut Optimizer<f32>,
        batch: &Batch<'_>,
    ) -> ramus_nn::Result<Option<StepOutcome>> {
        Ok(self.device_train_step(model, params, &optimizer.config, batch)?)
    }
    fn finish_train_steps(&mut self) -> ramus_nn::Result<Vec<StepOutcome>> {
        Ok(self.settle_step()?.into_iter().collect())
    }
}

impl From<CudaError> for ramus_nn::NnError {
    fn from(e: CudaError) -> Self {
        ramus_nn::NnError::Device(e.to_string())
    }
}
