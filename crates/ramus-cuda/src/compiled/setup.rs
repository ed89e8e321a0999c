//! Setting the compiled engine up: the kernel description of the lowered
//! cells, compiling the kernels (both level orderings while they are to be
//! measured), the resident block count, the parameter upload and the leaf
//! tables.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, LaunchConfig, PushKernelArg};

use ramus_codegen::compiled::{token_stage_kernel, LoweredCell, TreeKernelSpec, CELL_BLOCK};
use ramus_core::{Model, Params};

use super::memory::{Cells, TableLens};
use super::options::CompiledOptions;
use crate::cache::KernelCache;
use crate::device::CudaDevice;
use crate::error::{CudaError, InCall, Result};
use crate::memory::{run_check, DeviceCheck};
use crate::pinned::PinnedBuffer;
use crate::pool::{DevicePool, DeviceView, PoolBuffer, PoolConfig};
use crate::rtc::LoadedModule;
use ramus_exec::memory::{DeviceNeed, DeviceRoom, Fitted};

/// The choice between the two level orderings while it is being measured.
pub(super) struct LevelOrderTuning {
    /// The level kernel of the other ordering.
    pub(super) other: CudaFunction,
    /// Whether the other ordering uses node counters.
    pub(super) other_counters: bool,
    /// Kernel milliseconds per timed batch: the current ordering's, the
    /// other's.
    pub(super) samples: [Vec<f32>; 2],
}

pub(super) fn model_err(message: impl Into<String>) -> CudaError {
    CudaError::Model(message.into())
}

pub(super) fn u32_of(value: usize, what: &str) -> Result<u32> {
    u32::try_from(value)
        .map_err(|_| CudaError::BadArgument(format!("{what} = {value} does not fit 32 bits")))
}

/// Launches a table kernel (`cortex_leaf_table`, `cortex_token_table`):
/// `kernel(params, tables..., vocab)` with a warp per unit of the cell and
/// up to 64 tokens at a time per unit.
pub(super) fn launch_table_kernel(
    stream: &CudaStream,
    kernel: &CudaFunction,
    params: DeviceView<f32>,
    tables: &[DeviceView<f32>],
    units: usize,
    vocab: u32,
    block: u32,
) -> Result<()> {
    let warps = (units * (vocab as usize).min(64)).max(1);
    let blocks = u32_of(warps.div_ceil((block / 32) as usize), "table blocks")?;
    let mut launch = stream.launch_builder(kernel);
    launch.arg(params.kernel_arg());
    for t in tables {
        launch.arg(t.kernel_arg());
    }
    launch.arg(&vocab);
    let cfg = LaunchConfig {
        grid_dim: (blocks.min(65_535), 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: a table kernel takes the parameter buffer (every parameter at
    // its compiled-in offset), one table pointer per output (each `vocab`
    // rows of that output's width) and the vocabulary size, in this order.
    unsafe { launch.launch(cfg) }.in_call("cuLaunchKernel(table kernel)")?;
    Ok(())
}

/// Refuses a run over `options.memory_budget` before anything compiles
/// (asking `check` about `need`), then opens the device and its kernel
/// cache.
pub(super) fn open_device(
    options: &CompiledOptions,
    check: DeviceCheck<'_>,
    need: &DeviceNeed,
) -> Result<(Arc<CudaDevice>, KernelCache)> {
    if let Some(budget) = options.memory_budget {
        // a run over the budget is refused before anything compiles
        let room = DeviceRoom {
            free: u64::MAX,
            budget: Some(budget),
        };
        run_check(check, need, room)?;
    }
    let device = CudaDevice::open(options.device)?;
    let dir = options
        .cache_dir
        .clone()
        .or_else(crate::cache::default_cache_dir);
    let cache = KernelCache::for_device(&device, dir)?;
    Ok((device, cache))
}

/// The engine's pool: what the check found fits (`pooled` bytes of
/// model-sized parts and the largest batch), in one chunk.
pub(super) fn engine_pool(
    device: &CudaDevice,
    options: &CompiledOptions,
    pooled: u64,
    fitted: &Fitted,
) -> Arc<DevicePool> {
    DevicePool::new(
        device,
        PoolConfig {
            initial_bytes: PoolConfig::default()
                .initial_bytes
                .max(pooled + fitted.eval_batch + fitted.eval_extra),
            max_bytes: options.memory_budget,
        },
    )
}

/// The generated kernels' description of `cells` (parameters at
/// `offsets`; `block_threads: None`: by the weight registers).
pub(super) fn kernel_spec<'a>(
    model: &'a Model,
    cells: &'a Cells,
    offsets: &'a [usize],
    block_threads: Option<u32>,
) -> TreeKernelSpec<'a> {
    let (leaf, internal) = (&cells.leaf, &cells.internal);
    let schedule = cells.schedule;
    let mut spec = TreeKernelSpec {
        name: "cortex",
        leaf: LoweredCell {
            graph: &leaf.graph,
            program: &leaf.program,
        },
        internal: LoweredCell {
            graph: &internal.graph,
            program: &internal.program,
        },
        head: LoweredCell {
            graph: &model.head.forward,
            program: &cells.head,
        },
        param_offsets: offsets,
        persistent_weights: schedule.persistent_weights,
        leaf_table: schedule.leaf_table,
        block_threads: CELL_BLOCK,
        node_counters: schedule.node_counters == Some(true),
        token_table: cells.token_table.as_ref().map(|(table, _)| LoweredCell {
            graph: &internal.graph,
            program: table,
        }),
    };
    spec.block_threads = block_threads.unwrap_or_else(|| spec.default_block_threads());
    spec
}

/// Each parameter's offset in the one parameter buffer, and the floats
/// of them all.
pub(super) fn param_offsets(model: &Model, params: &Params<f32>) -> (Vec<usize>, usize) {
    let mut offsets = Vec::with_capacity(model.params.len());
    let mut total = 0usize;
    for p in &params.values {
        offsets.push(total);
        total += p.data().len();
    }
    (offsets, total)
}

/// Uploads `params` (each at its offset) into `view` through `staging`.
pub(super) fn upload_params(
    staging: &mut PinnedBuffer,
    params: &Params<f32>,
    offsets: &[usize],
    view: DeviceView<f32>,
    stream: &Arc<CudaStream>,
) -> Result<()> {
    {
        let host = staging.host_mut::<f32>(view.len())?;
        for (p, &off) in params.values.iter().zip(offsets) {
            host[off..off + p.data().len()].copy_from_slice(p.data());
        }
    }
    staging.upload(view, stream)
}

/// The kernels of one compiled module: the level kernel (or the unrolled
/// one) and the table kernels.
pub(super) struct KernelNames {
    pub(super) unroll: bool,
    /// A refactored leaf has a stage per moved product: a table kernel each.
    pub(super) leaf_tables: Vec<String>,
    pub(super) token_table: bool,
}

impl KernelNames {
    pub(super) fn new(unroll: bool, leaf_stages: usize, token_table: bool) -> Self {
        let leaf_tables = (0..leaf_stages)
            .map(|stage| token_stage_kernel("cortex_leaf_table", stage))
            .collect();
        KernelNames {
            unroll,
            leaf_tables,
            token_table,
        }
    }

    /// Compiles (or loads) `spec`'s kernels: the module, its level kernel
    /// and, with `measure` (no level ordering asked for), the other
    /// ordering's level kernel to be timed against it.
    pub(super) fn compile(
        &self,
        cache: &KernelCache,
        spec: &TreeKernelSpec<'_>,
        measure: bool,
    ) -> Result<(Arc<LoadedModule>, CudaFunction, Option<LevelOrderTuning>)> {
        let source = if self.unroll {
            spec.unrolled_source()?
        } else {
            spec.source()?
        };
        let level_kernel = if self.unroll {
            "cortex_unrolled"
        } else {
            "cortex_levels"
        };
        let mut kernels = vec!["cortex_levels"];
        if self.unroll {
            kernels.push("cortex_unrolled");
        }
        kernels.extend(self.leaf_tables.iter().map(String::as_str));
        if self.token_table {
            kernels.push("cortex_token_table");
        }
        let module = cache.get_or_compile(&source, &kernels)?;
        let levels = module.function(level_kernel)?.clone();
        // no ordering asked for: the other one too, to be timed
        let tuning = if measure && !self.unroll {
            let other_counters = !spec.node_counters;
            let other_source = TreeKernelSpec {
                node_counters: other_counters,
                ..*spec
            }
            .source()?;
            let other_module = cache.get_or_compile(&other_source, &["cortex_levels"])?;
            Some(LevelOrderTuning {
                other: other_module.function("cortex_levels")?.clone(),
                other_counters,
                samples: [Vec::new(), Vec::new()],
            })
        } else {
            None
        };
        Ok((module, levels, tuning))
    }
}

/// Local memory bytes per thread that the level kernel (and the other
/// ordering's, while measured) spill registers into: the larger.
pub(super) fn spilled_bytes(
    levels: &CudaFunction,
    tuning: Option<&LevelOrderTuning>,
) -> Result<u64> {
    let mut spilled = 0;
    for f in std::iter::once(levels).chain(tuning.map(|t| &t.other)) {
        let bytes = f
            .local_size_bytes()
            .in_call("cuFuncGetAttribute(LOCAL_SIZE_BYTES)")?;
        spilled = spilled.max(u64::try_from(bytes).unwrap_or(0));
    }
    Ok(spilled)
}

/// `(max_blocks, min_blocks)`: the blocks of `spec.block_threads` threads
/// that can be resident at once for the level kernel (and the other
/// ordering's), capped by `options`, and those a warp per unit of the
/// widest cell needs; an error when fewer fit than are needed.
pub(super) fn resident_blocks(
    device: &CudaDevice,
    (levels, other): (&CudaFunction, Option<&CudaFunction>),
    options: &CompiledOptions,
    spec: &TreeKernelSpec<'_>,
    widest_cell: usize,
) -> Result<(u32, u32)> {
    let block = spec.block_threads;
    let sm = device.sm_count();
    let mut per_sm = levels
        .occupancy_max_active_blocks_per_multiprocessor(block, 0, None)
        .in_call("cuOccupancyMaxActiveBlocksPerMultiprocessor")?;
    if let Some(other) = other {
        per_sm = per_sm.min(
            other
                .occupancy_max_active_blocks_per_multiprocessor(block, 0, None)
                .in_call("cuOccupancyMaxActiveBlocksPerMultiprocessor")?,
        );
    }
    let max_blocks = per_sm
        .min(options.blocks_per_sm.max(1))
        .saturating_mul(sm)
        .min(options.max_blocks.unwrap_or(u32::MAX));
    // every unit of every cell needs a warp of its own
    let min_blocks = u32_of(widest_cell.div_ceil((block / 32) as usize), "blocks")?;
    if max_blocks < min_blocks {
        return Err(model_err(format!(
            "the compiled kernel needs {min_blocks} resident blocks of {block} threads \
             (a warp per unit of a {widest_cell}-unit cell) but only {max_blocks} fit \
             ({} weight registers per thread); switch persistence off or allow more blocks",
            spec.weight_registers()
        )));
    }
    Ok((max_blocks, min_blocks))
}

/// The leaf tables (leaf specialization) and the internal cell's token
/// table, with the device addresses the level kernel reads (0: none).
#[derive(Default)]
pub(super) struct LeafTables {
    pub(super) tables: Option<(PoolBuffer<f32>, PoolBuffer<f32>)>,
    pub(super) token_buffer: Option<PoolBuffer<f32>>,
    pub(super) state: u64,
    pub(super) push: u64,
    pub(super) token: u64,
}

/// What the table kernels run with: the module holding them, the leaf
/// table kernels' names, the parameters, the units of the leaf cell and of
/// the token-table program (if any), the vocabulary and the block size.
pub(super) struct TableRun<'a> {
    pub(super) module: &'a LoadedModule,
    pub(super) names: &'a [String],
    pub(super) params: DeviceView<f32>,
    pub(super) units: (usize, Option<usize>),
    pub(super) vocab: usize,
    pub(super) block: u32,
}

impl TableRun<'_> {
    /// Tabulates the leaf cell (stage by stage) and the internal cell's
    /// token values over the vocabulary, into tables from `pool`.
    pub(super) fn build(
        &self,
        device: &CudaDevice,
        pool: &Arc<DevicePool>,
        lens: &TableLens,
    ) -> Result<LeafTables> {
        let stream = device.stream().clone();
        let (leaf_units, token_units) = self.units;
        let ts = pool.alloc::<f32>(lens.state.max(1))?;
        let tp = pool.alloc::<f32>(lens.push.max(1))?;
        let vocab_arg = u32_of(self.vocab, "vocabulary")?;
        // stage by stage (stream order separates them), a scratch row per token
        let leaf_scratch = lens
            .scratch
            .map(|n| pool.alloc::<f32>(n.max(1)))
            .transpose()?;
        let mut outputs = vec![ts.view(), tp.view()];
        if let Some(scratch) = &leaf_scratch {
            outputs.push(scratch.view());
        }
        for name in self.names {
            let kernel = self.module.function(name)?;
            launch_table_kernel(
                &stream,
                kernel,
                self.params,
                &outputs,
                leaf_units,
                vocab_arg,
                self.block,
            )?;
        }
        // the scratch may go once the kernels ran (synchronized below)
        device.synchronize()?;
        drop(leaf_scratch);
        let mut built = LeafTables {
            state: ts.view().device_ptr(),
            push: tp.view().device_ptr(),
            tables: Some((ts, tp)),
            ..LeafTables::default()
        };
        if let (Some(units), Some(n)) = (token_units, lens.token) {
            let tt = pool.alloc::<f32>(n.max(1))?;
            let token_fn = self.module.function("cortex_token_table")?;
            let tt_view = tt.view();
            launch_table_kernel(
                &stream,
                token_fn,
                self.params,
                &[tt_view],
                units,
                vocab_arg,
                self.block,
            )?;
            built.token = tt_view.device_ptr();
            built.token_buffer = Some(tt);
        }
        Ok(built)
    }
}
