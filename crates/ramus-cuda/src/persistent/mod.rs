//! The persistent training kernel (VPPS) on the device: compiles the kernel
//! generated for a [`RegisterPlan`] ([`ramus_codegen::persistent`]) through
//! the kernel cache, checks that its weight registers stay registers (no
//! local-memory spill) and that every CTA of the plan can be resident at
//! once, uploads the plan's partition and matrix tables, and launches it
//! (cooperatively, so the scripts' signal/wait barriers cannot deadlock)
//! on a batch's packed scripts.
//!
//! Which tensors the scripts read and write is the caller's business: the
//! kernel only sees float offsets into one `pool` view (parameters,
//! gradients, optimizer moments and the batch's values alike) and the
//! script buffer.

mod engine;
mod program;
mod split;
mod train;
mod unroll;

pub use engine::{PersistentEngine, PersistentOptions, PersistentStep, HOST_PRODUCT_ITEMS};
pub use train::{prepared_ahead, PersistentTrainer};

/// Whether the persistent engine runs `model`, without a device
/// ([`checked_program`], the engine's first check on `model`).
pub fn support(model: &ramus_core::Model) -> Result<()> {
    checked_program(model).map(|_| ())
}

/// `model`'s persistent program, once every op it runs alone has an
/// instruction ([`unroll::instruction_support`]) and no graph pulls
/// inputs: what the engine builds first, so its first refusal is the
/// support table's. `Err` names the model, the graph, the node and the op.
pub(crate) fn checked_program(model: &ramus_core::Model) -> Result<program::PersistentProgram> {
    use ramus_core::graph::{NodeKind, Source};
    use ramus_core::OpDef;
    let prog = program::PersistentProgram::build(model)?;
    let head = [
        ("head", &model.head.forward),
        ("head backward", &model.head.backward),
    ];
    let functions = model.functions.iter().flat_map(|f| {
        [
            (f.name.as_str(), &f.forward),
            (f.name.as_str(), &f.backward),
        ]
    });
    for (label, g) in functions.chain(head) {
        for (n, node) in g.nodes.iter().enumerate() {
            let Some(op) = node.op() else { continue };
            if let Err(why) = unroll::instruction_support(op) {
                return Err(CudaError::Model(format!(
                    "model `{}`: op `{}` (node %{n} of {label}) {why}",
                    model.name,
                    op.signature()
                )));
            }
        }
        // the batch layout has no region for them (`unroll::node_region`)
        if let Some(n) = g
            .nodes
            .iter()
            .position(|node| matches!(node.kind, NodeKind::Input(Source::Pull)))
        {
            return Err(CudaError::Model(format!(
                "model `{}`: input %{n} of {label} is pulled (features), which the \
                 persistent engine does not support yet",
                model.name
            )));
        }
    }
    Ok(prog)
}

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use ramus_codegen::persistent::{kernel_source, matrix_table, KernelOptions, KERNEL_NAME};
use ramus_core::vpps::regplan::{RegisterPlan, CTA_THREADS};
use ramus_core::vpps::script::PackedScripts;

use crate::cache::KernelCache;
use crate::device::CudaDevice;
use crate::error::{CudaError, InCall, Result};
use crate::pinned::PinnedBuffer;
use crate::pool::{DevicePool, DeviceView, PoolBuffer};
use crate::rtc::LoadedModule;

/// Where a cached matrix lives in the pool (float offsets): its values,
/// the optimizer's first and second moments (unused by a rule that has
/// none; any offset will do then) and a zeroed gradient accumulator of the
/// matrix's size (the wide products' outer sums, or the whole gradient
/// when it does not fit in registers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatrixSlots {
    pub value: usize,
    pub first_moment: usize,
    pub second_moment: usize,
    pub gradient: usize,
}

/// The optimizer's scalars for one step (see `ramus_exec::Optimizer::step`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UpdateScalars {
    pub lr: f32,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// `1 / (1 − β₁ᵗ)` at this step (Adam).
    pub inv_bias_correction1: f32,
    /// `1 / (1 − β₂ᵗ)` at this step (Adam).
    pub inv_bias_correction2: f32,
    /// Gradient scale from global-norm clipping (1: none).
    pub clip: f32,
    /// The pool word an update sets when a gradient or updated value is
    /// not finite (zeroed before the batch); `NO_INDEX`: none.
    pub fault_at: u32,
}

/// What set-up measured and found.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelReport {
    pub registers_per_thread: u32,
    /// Local memory per thread (0: nothing spilled).
    pub local_bytes: u32,
    /// CTAs of 256 threads that can be resident per SM.
    pub resident_per_sm: u32,
    /// Seconds to get the module (compile or cache hit).
    pub build_seconds: f64,
    /// A bridge kernel (see [`PersistentKernel::bridge`]): compiled for
    /// speed of compilation, its weights possibly in local memory.
    pub bridge: bool,
    /// Built with the wide products' vector epilogue
    /// ([`KernelOptions::vector_epilogue`]; false for a bridge).
    pub vector_epilogue: bool,
}

/// One compiled persistent kernel with its device-side tables.
pub struct PersistentKernel {
    device: Arc<CudaDevice>,
    function: CudaFunction,
    plan: RegisterPlan,
    _parts: PoolBuffer<u32>,
    parts: DeviceView<u32>,
    _mats: PoolBuffer<u32>,
    mats: DeviceView<u32>,
    report: KernelReport,
}

fn u32_of(value: usize, what: &str) -> Result<u32> {
    u32::try_from(value)
        .map_err(|_| CudaError::BadArgument(format!("{what} = {value} does not fit 32 bits")))
}

/// Errors unless there is a slot per cached matrix of `plan`.
fn check_slots(plan: &RegisterPlan, slots: &[MatrixSlots]) -> Result<()> {
    if slots.len() != plan.matrices.len() {
        return Err(CudaError::BadArgument(format!(
            "{} matrix slots for a plan of {} cached matrices",
            slots.len(),
            plan.matrices.len()
        )));
    }
    Ok(())
}

/// The kernel's device tables for `plan`: its partitions' and its cached
/// matrices' (where `slots` places each in the pool).
pub(crate) fn kernel_tables(plan: &RegisterPlan, slots: &[MatrixSlots]) -> Result<[Vec<u32>; 2]> {
    let mats = matrix_table(plan, |m| {
        let s = &slots[m];
        [s.value, s.first_moment, s.second_moment, s.gradient]
    })?;
    Ok([plan.table(), mats])
}

fn model_err(message: impl Into<String>) -> CudaError {
    CudaError::Model(message.into())
}

impl PersistentKernel {
    /// Generates, compiles (or loads from `cache`) and checks the kernel
    /// for `plan`, `options` (the update rule, tracing) and the model's
    /// fused groups (`fused_cases`, see [`kernel_source`]); `slots[m]`
    /// places cached matrix `m` in the pool the launches will pass.
    pub fn build(
        device: &Arc<CudaDevice>,
        cache: &KernelCache,
        pool: &Arc<DevicePool>,
        plan: RegisterPlan,
        options: KernelOptions,
        fused_cases: &str,
        slots: &[MatrixSlots],
    ) -> Result<Self> {
        check_slots(&plan, slots)?;
        let started = Instant::now();
        let source = kernel_source(&plan, options, fused_cases);
        let module = cache.get_or_compile(&source, &[KERNEL_NAME])?;
        let mut kernel = Self::from_module(device, pool, plan, &module, slots, started, false)?;
        kernel.report.vector_epilogue = options.vector_epilogue;
        Ok(kernel)
    }

    /// A bridge kernel: `module`, the source for `plan` compiled for speed
    /// of compilation ([`NvrtcCompiler::with_fast_compile`](crate::NvrtcCompiler::with_fast_compile),
    /// from `compile_started` on) and loaded. It computes what the kernel
    /// proper computes, more slowly (its weights may live in local memory,
    /// which is not checked), and trains while that one compiles.
    pub fn bridge(
        device: &Arc<CudaDevice>,
        pool: &Arc<DevicePool>,
        plan: RegisterPlan,
        module: &LoadedModule,
        slots: &[MatrixSlots],
        compile_started: Instant,
    ) -> Result<Self> {
        check_slots(&plan, slots)?;
        Self::from_module(device, pool, plan, module, slots, compile_started, true)
    }

    /// The kernel of `module`, checked (unless a `bridge`, for spills; for
    /// residency always) and given its tables.
    fn from_module(
        device: &Arc<CudaDevice>,
        pool: &Arc<DevicePool>,
        plan: RegisterPlan,
        module: &LoadedModule,
        slots: &[MatrixSlots],
        started: Instant,
        bridge: bool,
    ) -> Result<Self> {
        let function = module.function(KERNEL_NAME)?.clone();
        let build_seconds = started.elapsed().as_secs_f64();
        let local_bytes = function
            .local_size_bytes()
            .in_call("cuFuncGetAttribute(LOCAL_SIZE_BYTES)")?;
        let registers = function
            .num_regs()
            .in_call("cuFuncGetAttribute(NUM_REGS)")?;
        if local_bytes > 0 && !bridge {
            return Err(model_err(format!(
                "the persistent kernel spills {local_bytes} bytes per thread to local memory \
                 ({} partitions × {} rows × {} registers of weights{} per thread, {registers} \
                 registers in all): choose a smaller rpw or fewer CTAs per SM",
                plan.partitions,
                plan.rpw,
                plan.regs_per_row,
                if plan.grads_in_registers {
                    " and as many of gradients"
                } else {
                    ""
                },
            )));
        }
        let block = u32_of(CTA_THREADS, "block")?;
        let resident_per_sm = function
            .occupancy_max_active_blocks_per_multiprocessor(block, 0, None)
            .in_call("cuOccupancyMaxActiveBlocksPerMultiprocessor")?;
        let sms = device.sm_count() as usize;
        if (resident_per_sm as usize) * sms < plan.ctas {
            return Err(model_err(format!(
                "the persistent kernel needs {} resident CTAs but only {resident_per_sm} per SM \
                 × {sms} SMs fit ({registers} registers per thread)",
                plan.ctas
            )));
        }
        let stream = device.stream().clone();
        let mut staging = PinnedBuffer::new(device)?;
        let [table, mats_host] = kernel_tables(&plan, slots)?;
        let parts_buf = pool.alloc::<u32>(table.len().max(1))?;
        let parts = parts_buf.view().slice(0..table.len().max(1))?;
        staging.upload_slice(&table, parts.slice(0..table.len())?, &stream)?;
        let mats_buf = pool.alloc::<u32>(mats_host.len().max(1))?;
        let mats = mats_buf.view().slice(0..mats_host.len().max(1))?;
        if !mats_host.is_empty() {
            staging.upload_slice(&mats_host, mats.slice(0..mats_host.len())?, &stream)?;
        }
        staging.wait()?;
        Ok(PersistentKernel {
            device: Arc::clone(device),
            function,
            plan,
            _parts: parts_buf,
            parts,
            _mats: mats_buf,
            mats,
            report: KernelReport {
                registers_per_thread: registers.max(0) as u32,
                local_bytes: local_bytes.max(0) as u32,
                resident_per_sm,
                build_seconds,
                bridge,
                vector_epilogue: false,
            },
        })
    }

    /// The plan the kernel was generated for.
    pub fn plan(&self) -> &RegisterPlan {
        &self.plan
    }

    /// What set-up measured.
    pub fn report(&self) -> &KernelReport {
        &self.report
    }

    /// Enqueues one launch on the device's stream: `script` holds
    /// `packed.words` (already uploaded), `barriers` at least
    /// `packed.barriers` counters, zeroed by this call first. With
    /// `flush_grads` (a launch before the batch's last) the register
    /// gradients are added to the pool's accumulator at the end.
    pub fn launch(
        &self,
        pool: DeviceView<f32>,
        script: DeviceView<u32>,
        packed: &PackedScripts,
        barriers: DeviceView<u32>,
        scalars: &UpdateScalars,
        flush_grads: bool,
    ) -> Result<()> {
        if packed.vpps != self.plan.ctas {
            return Err(model_err(format!(
                "scripts for {} processors, but the kernel runs {} CTAs",
                packed.vpps, self.plan.ctas
            )));
        }
        if script.len() < packed.words.len() {
            return Err(CudaError::BadArgument(format!(
                "script buffer of {} words for {} words of scripts",
                script.len(),
                packed.words.len()
            )));
        }
        if barriers.len() < packed.barriers.max(1) {
            return Err(CudaError::BadArgument(format!(
                "{} barrier counters for {} barriers",
                barriers.len(),
                packed.barriers
            )));
        }
        let stream = self.device.stream().clone();
        barriers.fill_zero(&stream)?;
        let layout = [
            u32_of(packed.prefix_at, "prefix offset")?,
            u32_of(packed.scripts_at, "scripts offset")?,
            u32_of(packed.barrier_expect_at, "barrier table offset")?,
            u32_of(packed.operands_at, "operand pool offset")?,
        ];
        let s = scalars;
        let flush = u32::from(flush_grads);
        let mut launch = stream.launch_builder(&self.function);
        launch
            .arg(pool.kernel_arg())
            .arg(script.kernel_arg())
            .arg(barriers.kernel_arg())
            .arg(self.parts.kernel_arg())
            .arg(self.mats.kernel_arg())
            .arg(&layout[0])
            .arg(&layout[1])
            .arg(&layout[2])
            .arg(&layout[3])
            .arg(&s.lr)
            .arg(&s.weight_decay)
            .arg(&s.beta1)
            .arg(&s.beta2)
            .arg(&s.eps)
            .arg(&s.inv_bias_correction1)
            .arg(&s.inv_bias_correction2)
            .arg(&s.clip)
            .arg(&flush)
            .arg(&s.fault_at);
        let cfg = LaunchConfig {
            grid_dim: (u32_of(self.plan.ctas, "CTAs")?, 1, 1),
            block_dim: (u32_of(CTA_THREADS, "block")?, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `vpps_train`'s parameters in order
        // (see `ramus_codegen::persistent`); the partition and matrix tables
        // were built from this kernel's plan; the script buffer holds the
        // packed words (checked above) whose offsets the scheduler built for
        // `pool` and `params`; the barrier counters cover every barrier and
        // were zeroed on this stream; the launch is cooperative with the
        // plan's CTA count, checked resident at build, so no wait can
        // deadlock.
        unsafe { launch.launch_cooperative(cfg) }
            .in_call("cuLaunchCooperativeKernel(vpps_train)")?;
        Ok(())
    }
}
