//! The CUDA batched engine (Cavs on the GPU). Same passes as the CPU
//! reference engine (`ramus_cpu::CpuEngine`), with every tensor in a per-batch
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
//!
//! This file sets up the engine, uploads a batch and runs the forward pass;
//! `engine/exec.rs` runs a program's steps and ops, `engine/backward.rs`
//! the backward pass, `engine/train.rs` the device training step and the
//! training engine ([`CudaTrainer`], a [`ramus_exec::TrainEngine`]).

use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use ramus_core::graph::{DType, Graph, NodeId, NodeKind, Role, Source, Space};
use ramus_core::{HeadRows, Model, Params};
use ramus_exec::{fill_dropout_mask, Batch, ForwardOutput, Mode, Range};
use ramus_graph::{FunctionRows, Schedule};

pub(crate) use crate::batch::head_vertices;
use crate::batch::{Buf, GraphBufs};
use crate::blas::Blas;
use crate::cache::KernelCache;
use crate::device::CudaDevice;
use crate::error::{model_err, CudaError, Result};
use crate::launch::{Launcher, RowMove, NONE};
use crate::optimizer::DeviceOptimizer;
use crate::pinned::PinnedBuffer;
use crate::pool::{Arena, DevicePool, DeviceScalar, DeviceView, PoolBuffer, PoolConfig};
use crate::program::{GraphProgram, Program, HEAD_ALL, HEAD_SCORES, LAZY, PER_TASK};
pub(crate) use nonfinite::StepLoss;

mod backward;
mod cnn;
mod exec;
mod nonfinite;
mod norm_sync;
mod overlap;
mod resume;
mod split;
mod train;

pub(crate) use split::SplitUpdate;
pub(crate) use train::mid_step;
pub use train::CudaTrainer;

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
    /// Bytes of gradients summed together over the ranks of a
    /// data-parallel run (`None`: [`ramus_exec::bucket::DEFAULT_BUCKET_BYTES`]).
    pub bucket_bytes: Option<usize>,
}

/// Default cap of a convolution's scratch columns: 16 Mi floats (64 MiB).
pub const CONV_WORKSPACE_FLOATS: usize = 1 << 24;

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
pub(crate) struct Topology {
    pub(crate) tokens: DeviceView<u32>,
    children: Vec<DeviceView<u32>>,
    edge_child: DeviceView<u32>,
    edge_offsets: DeviceView<u32>,
    edge_parent: DeviceView<u32>,
    pub(crate) head_rows: DeviceView<u32>,
    pub(crate) head_sources: DeviceView<u32>,
    max_token: u32,
}

/// Parameters (and their gradients) on the device: one buffer each, dense
/// gradients first so they come back in one copy.
pub(crate) struct DeviceParams {
    _values: PoolBuffer<f32>,
    _grads: PoolBuffer<f32>,
    values: Vec<DeviceView<f32>>,
    grads: Vec<DeviceView<f32>>,
    /// Floats of dense gradients at the start of the gradient buffer.
    dense_len: usize,
    pub(crate) grad_all: DeviceView<f32>,
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
pub(crate) struct Lane {
    pub(crate) stream: Arc<CudaStream>,
    blas: Blas,
    /// Scratch memory of the ops run on this lane (convolution columns,
    /// per-channel coefficients), from the batch arena. Ops on one stream run
    /// in order, so each reuses it; the two lanes have their own.
    pub(crate) workspace: Cell<Option<DeviceView<f32>>>,
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
    pub(crate) device: Arc<CudaDevice>,
    pub(crate) pool: Arc<DevicePool>,
    cache: KernelCache,
    pub(crate) launcher: Launcher,
    pub(crate) main: Lane,
    eager: Lane,
    /// Recorded on the main lane once a pass's inputs are on the device.
    inputs_ready: CudaEvent,
    /// Per vertex function: recorded on the eager lane after its eager steps.
    eager_done: Vec<CudaEvent>,
    pub(crate) staging: PinnedBuffer,
    /// The batch arena; in a cell so that ops (run through `&self`) can take
    /// scratch memory from it.
    arena: RefCell<Arena>,
    /// Floats of convolution columns before images are chunked.
    pub(crate) conv_workspace: usize,
    pub(crate) program: Arc<Program>,
    params: Option<DeviceParams>,
    state: BatchState,
    pub(crate) rng: ChaCha8Rng,
    pub(crate) pull_values: Option<Vec<f32>>,
    setup_seconds: f64,
    /// The fused optimizer, with the parameter-buffer generation it serves.
    pub(crate) optimizer: Option<(u64, DeviceOptimizer)>,
    /// Optimizer state to load into the fused optimizer when it is built
    /// (a resumed run, see [`CudaEngine::load_optimizer_state`]).
    pending_optimizer: Option<ramus_exec::Optimizer<f32>>,
    /// Each parameter's learning-rate multiplier (empty: 1 for every one),
    /// given to the fused optimizer (see [`CudaEngine::set_lr_scales`]).
    lr_scales: Vec<f64>,
    pass_started: Option<std::time::Instant>,
    /// True while an evaluation or inference pass runs: ops with an
    /// inference form (batch normalisation with running statistics) run
    /// that instead.
    pub(crate) inference_pass: bool,
    /// True while a device training step ([`ramus_exec::TrainEngine::submit`],
    /// plain or through a wrapper such as the swap path) runs: its forward pass blends the batch
    /// statistics into the running statistics of the device parameters. A
    /// bare train-mode forward pass leaves them alone, as on the CPU.
    pub(crate) track_running_stats: bool,
    enqueue_seconds: f64,
    /// The loss of the last device training step whose status (applied or
    /// skipped as non-finite) the host has not taken yet.
    pending_loss: Option<StepLoss>,
    /// The model's parameter names, to name a non-finite one.
    param_names: Vec<String>,
    /// Synchronized batch normalisation's group handle and buffers (a
    /// data-parallel rank with `--sync-bn`); in a cell: ops run through
    /// `&self`.
    norm_sync: Option<RefCell<norm_sync::NormSync>>,
    /// Data-parallel gradient sums: their bucket size and side lane.
    sums: overlap::SumsSetup,
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

impl CudaEngine {
    /// Opens the device, compiles (or loads from the kernel cache) the
    /// built-in kernels and every fused kernel of `model`.
    pub fn new(model: &Model, options: &CudaEngineOptions) -> Result<Self> {
        Self::with_arena(model, options, 64 << 20)
    }

    /// [`CudaEngine::new`] with a batch arena of `arena_bytes` to start
    /// with (a wrapper that allocates its tensors elsewhere asks for less).
    pub(crate) fn with_arena(
        model: &Model,
        options: &CudaEngineOptions,
        arena_bytes: u64,
    ) -> Result<Self> {
        let started = std::time::Instant::now();
        let device = CudaDevice::open(options.device)?;
        let pool = DevicePool::new(&device, options.pool);
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
        let arena = pool.arena(arena_bytes);
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
            lr_scales: Vec::new(),
            pass_started: None,
            inference_pass: false,
            track_running_stats: false,
            enqueue_seconds: 0.0,
            pending_loss: None,
            param_names: model.params.iter().map(|p| p.name.clone()).collect(),
            norm_sync: None,
            sums: overlap::SumsSetup::new(options.bucket_bytes),
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

    pub(crate) fn check_model(&self, model: &Model) -> Result<()> {
        if crate::program::fingerprint(model) != self.program.fingerprint {
            return Err(model_err(format!(
                "the CUDA engine was set up for another model than `{}`; create one per model",
                model.name
            )));
        }
        Ok(())
    }

    /// Starts a batch: the last one's arena memory, and the lanes' scratch
    /// memory in it, are free again; `trim` also gives the pool back what
    /// the arena grew beyond its first chunk (earlier work is ordered on
    /// the main stream).
    pub(crate) fn reset_batch(&mut self, trim: bool) -> Result<()> {
        self.state.forward_done = false;
        {
            let mut arena = self.arena.borrow_mut();
            arena.reset()?;
            if trim {
                arena.trim();
            }
        }
        self.main.workspace.set(None);
        self.eager.workspace.set(None);
        Ok(())
    }

    /// The vertices the head runs on in the current batch.
    pub(crate) fn batch_head_vertices(&self) -> &[u32] {
        &self.state.head_vertices
    }

    /// The current batch's labels on the device (not uploaded to infer).
    pub(crate) fn batch_labels(&self) -> Option<DeviceView<u32>> {
        self.state.labels
    }

    /// Uploads the parameters when their version changed.
    pub(crate) fn sync_params(&mut self, model: &Model, params: &Params<f32>) -> Result<()> {
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

    pub(crate) fn param_views(&self) -> Result<&DeviceParams> {
        self.params
            .as_ref()
            .ok_or_else(|| model_err("parameters were not uploaded"))
    }

    /// Stages every index array of the batch and uploads them in one copy.
    pub(crate) fn upload_indices(
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

    /// `words` uploaded into the batch arena (`what` names them should
    /// they not fit).
    pub(crate) fn upload_indices_of(
        &mut self,
        words: &[u32],
        what: &dyn Fn() -> String,
    ) -> Result<DeviceView<u32>> {
        let view = self.arena_alloc::<u32>(words.len(), what)?;
        let stream = self.device.stream().clone();
        self.staging.upload_slice(words, view, &stream)?;
        self.launcher.count();
        Ok(view)
    }

    /// Row moves adding the head's input gradients (`src`: `pw` floats per
    /// head row) into each function's pushed-value gradient, whose buffer
    /// `buf(f, node)` gives.
    pub(crate) fn push_grad_moves(
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
        self.pass_started = Some(std::time::Instant::now());
        self.inference_pass = mode != Mode::Train;
        let program = self.program.clone();
        let s = &batch.schedule;
        self.reset_batch(false)?;
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
        let graphs = GraphBufs::each(model.functions.iter().map(|f| &f.forward), &fwd, None);
        self.run_eager(&graphs, &programs, s, None)?;
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
                GraphBufs::new(&func.forward, &fwd[f], None),
                programs[f],
                PER_TASK,
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
                self.launcher.copy_rows(&stream, dst, src, w, len)?;
            }
        }
        for (f, func) in model.functions.iter().enumerate() {
            self.join_eager(f, &mut joined)?;
            let range = Range::all(&s.functions[f]);
            self.run_steps(
                GraphBufs::new(&func.forward, &fwd[f], None),
                programs[f],
                LAZY,
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
        let values = ramus_exec::pulled_values(values, s, pw, name, explicit)
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

    pub(crate) fn topology(&self, f: usize) -> Result<&Topology> {
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
            GraphBufs::new(g, &bufs, None),
            head_program,
            phase,
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
}

/// Whether `index` is the vertex tokens of `range` (the one index array
/// whose values the host has checked).
fn is_tokens(index: DeviceView<u32>, t: &Topology, range: Range) -> bool {
    t.tokens
        .slice(range.r0..range.r1)
        .is_ok_and(|own| own.device_ptr() == index.device_ptr() && own.len() == index.len())
}
