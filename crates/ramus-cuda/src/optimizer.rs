//! The optimizer step on the device: SGD, Adagrad and Adam / AdamW with
//! global gradient-norm clipping, as fused generated kernels, mirroring the
//! host reference [`ramus_exec::Optimizer`] operation for operation.
//!
//! Like the runtime-compiled Adam of NNVM-Fusion, the whole update rule of an
//! element (decay, moments, bias correction, the step) is one generated
//! CUDA C++ statement list, compiled through the [`KernelCache`]:
//!
//! * **Source.** [`UpdateKernelSpec::source`] depends only on the optimizer
//!   kind and on whether clipping is on, so identical configurations give
//!   identical source and the kernel cache serves every later
//!   [`DeviceOptimizer`] without compiling. The hyper-parameters and the
//!   step's bias corrections are kernel arguments ([`UpdateArgs`]), so a
//!   learning-rate schedule never recompiles.
//! * **One update launch.** Parameters are *segments*: maximal runs of
//!   dense parameters whose values and gradients are both contiguous (with
//!   the CUDA engine's layout, the dense prefix of the gradient buffer is
//!   one run, split only where a table sits between dense parameters in
//!   declaration order) and one segment per row-gradient table restricted
//!   to the rows the caller says were touched. Up to [`MAX_SEGMENTS`] segments
//!   go to one launch (`blockIdx.y` picks the segment), so one launch
//!   updates every dense parameter and every touched table row. Untouched
//!   rows are not visited: lazy updates, exactly as on the host (which keeps
//!   no per-row step counts: Adam's bias correction uses the global step for
//!   table rows too).
//! * **Clipping.** A deterministic reduction kernel sums the squared
//!   gradients (dense and touched rows) in `double`: a fixed per-thread
//!   order, a fixed tree per block, and the last block to finish adds the
//!   block sums in index order. It writes the factor
//!   `min(1, clip / norm)` to device memory, where the update kernel reads
//!   it: no host round trip. The norm itself is downloaded only when the
//!   caller asks for it.
//!
//! Every product, sum, quotient and square root of the update is rounded on
//! its own (`__fmul_rn`, `__fadd_rn`, ...; no FMA contraction), in the
//! host's order with the host's `f32` constants, so for the same clip factor
//! the device computes the host reference's values bit for bit.
//!
//! * **Non-finite steps.** The norm kernel also checks that every gradient
//!   it sums and the batch's loss are finite; if not, it raises the step's
//!   skip flag, which the update kernel reads first: a non-finite step
//!   changes neither the parameters nor the optimizer state (the host also
//!   takes the step back from its step count). Each thread that meets a
//!   non-finite gradient records its element (the lowest, in parameter
//!   order, wins), so the host can name the first offending parameter
//!   without reading the gradients. The step's status (flag, that element,
//!   the norm) comes back with one asynchronous copy that the host reads
//!   after its next synchronization ([`DeviceOptimizer::take_status`]): no
//!   host round trip of its own.
//! * **Buffers.** Non-trained buffers (batch normalisation's running
//!   statistics, updated by the forward pass) are copied aside before a
//!   step's forward pass ([`DeviceOptimizer::keep_buffers`]) and copied back
//!   when the step is skipped.
//!
//! Launches per step: one norm launch and one update launch, one more of
//! each for every further [`MAX_SEGMENTS`] segments; with buffers, one
//! launch to keep them and one to restore them (a no-op unless skipped).

use std::fmt::Write as _;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use ramus_core::Tensor;
use ramus_exec::{Optimizer, OptimizerConfig, OptimizerKind};

use crate::cache::KernelCache;
use crate::device::CudaDevice;
use crate::error::{CudaError, InCall, Result};
use crate::pinned::PinnedBuffer;
use crate::pool::{DevicePool, DeviceView, PoolBuffer};
use crate::rtc::LoadedModule;

mod layout;
mod plan;
mod status;
pub use layout::{GradLayout, ParamSlot, MAX_SEGMENTS};
use layout::{BLOCK, MAX_NORM_BLOCKS, STATUS_WORDS};
use plan::{addr, launch_chunks, Plan, RawSegment};
pub use status::StepStatus;

/// Blocks per segment of an update launch at most (grid-stride beyond).
const MAX_UPDATE_BLOCKS: u32 = 1024;
/// The norm kernel's name (the same in every module).
const NORM_KERNEL: &str = "ramus_grad_norm";
/// The kernel that keeps and restores buffers (the same in every module).
const KEEP_KERNEL: &str = "ramus_keep_buffers";

/// What the generated source depends on: the update rule and whether it
/// reads a clip factor. Everything else is an argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UpdateKernelSpec {
    pub kind: OptimizerKind,
    pub clip: bool,
}

impl UpdateKernelSpec {
    /// The spec of `config`'s kernels.
    pub fn of(config: &OptimizerConfig) -> Self {
        Self {
            kind: config.kind,
            clip: config.clip_norm.is_some(),
        }
    }

    fn kind_name(&self) -> &'static str {
        match self.kind {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adagrad => "adagrad",
            OptimizerKind::Adam => "adam",
        }
    }

    /// The update kernel's name, e.g. `ramus_adam_clipped_update`.
    pub fn update_kernel_name(&self) -> String {
        let clipped = if self.clip { "_clipped" } else { "" };
        format!("ramus_{}{clipped}_update", self.kind_name())
    }

    /// The kernels the module defines: the update, the norm, and the
    /// buffers' keeping.
    pub fn kernel_names(&self) -> [String; 3] {
        [
            self.update_kernel_name(),
            NORM_KERNEL.to_string(),
            KEEP_KERNEL.to_string(),
        ]
    }

    /// The per-element update: statements reading `w` (the value), the
    /// segment `s`, offset `i` and arguments `a`, leaving the new value in
    /// `w`. Operand order and rounding follow `ramus_exec::optim` exactly.
    fn update_statements(&self) -> Vec<String> {
        // The host multiplies by the clip factor (1 without clipping, exact).
        let g = if self.clip {
            "mul_rn(s.grad[i], scale)"
        } else {
            "s.grad[i]"
        };
        let lines: Vec<String> = match self.kind {
            OptimizerKind::Sgd => vec![
                format!("const float g = add_rn({g}, mul_rn(a.weight_decay, w));"),
                "w = sub_rn(w, mul_rn(lr, g));".into(),
            ],
            OptimizerKind::Adagrad => vec![
                format!("const float g = add_rn({g}, mul_rn(a.weight_decay, w));"),
                "const float acc = add_rn(s.second[i], mul_rn(g, g));".into(),
                "s.second[i] = acc;".into(),
                "w = sub_rn(w, div_rn(mul_rn(lr, g), add_rn(sqrt_rn(acc), a.eps)));".into(),
            ],
            OptimizerKind::Adam => vec![
                format!("const float g = {g};"),
                "const float m = add_rn(mul_rn(a.beta1, s.first[i]), mul_rn(a.one_minus_beta1, g));".into(),
                "const float v = add_rn(mul_rn(a.beta2, s.second[i]), mul_rn(mul_rn(a.one_minus_beta2, g), g));"
                    .into(),
                "s.first[i] = m;".into(),
                "s.second[i] = v;".into(),
                "// decoupled weight decay (AdamW), then the bias-corrected step".into(),
                "w = sub_rn(w, mul_rn(mul_rn(lr, a.weight_decay), w));".into(),
                "w = sub_rn(w, div_rn(mul_rn(lr, mul_rn(m, a.inv_bias_correction1)), \
                 add_rn(sqrt_rn(mul_rn(v, a.inv_bias_correction2)), a.eps)));"
                    .into(),
            ],
        };
        lines
    }

    /// The module's CUDA C++ source: the shared definitions, the norm
    /// kernel and the generated update kernel.
    pub fn source(&self) -> String {
        let rule = match self.kind {
            OptimizerKind::Sgd => "SGD with L2 weight decay",
            OptimizerKind::Adagrad => "Adagrad with L2 weight decay",
            OptimizerKind::Adam => "Adam with decoupled weight decay (AdamW)",
        };
        let clipping = if self.clip {
            "gradients scaled by the clip factor the norm kernel left in *clip_scale"
        } else {
            "no clipping (clip_scale is not read)"
        };
        // nothing changes in a step the norm kernel found non-finite
        let mut s = format!("// Ramus optimizer step: {rule}; {clipping}.\n");
        s += PRELUDE;
        let name = self.update_kernel_name();
        // Writing to a String cannot fail.
        let _ = writeln!(
            s,
            "\nextern \"C\" __global__ void {name}(Segments segments, Args a, \
             const float* __restrict__ clip_scale, const u32* __restrict__ status) {{"
        );
        s += "    if (status[RAMUS_SKIP] != 0u) return;\n";
        s += "    const Segment s = segments.s[blockIdx.y];\n";
        s += "    const u64 n = segment_elements(s);\n";
        // the segment's own rate (times 1: exact, as on the host)
        s += "    const float lr = mul_rn(a.lr, s.lr_scale);\n";
        if self.clip {
            s += "    const float scale = *clip_scale;\n";
        }
        s += "    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < n;\n";
        s += "         j += (u64)gridDim.x * blockDim.x) {\n";
        s += "        u64 i;\n";
        s += "        if (!segment_offset(s, j, &i)) continue;\n";
        s += "        float w = s.value[i];\n";
        for line in self.update_statements() {
            let _ = writeln!(s, "        {line}");
        }
        s += "        s.value[i] = w;\n";
        s += "    }\n}\n";
        s
    }
}

/// Definitions shared by every optimizer module, and the norm kernel.
const PRELUDE: &str = r#"
typedef unsigned int u32;
typedef unsigned long long u64;

#define RAMUS_MAX_SEGMENTS 16
#define RAMUS_BLOCK 256

// The status block (u32 words after the norm's double and the counter):
// the step's skip flag, the lowest key of a non-finite gradient seen so
// far (stored complemented, so 0 means none), the step's reported key,
// the loss the step checked (its bits; 0 without one).
#define RAMUS_SKIP 0
#define RAMUS_KEY_SEEN 1
#define RAMUS_KEY_REPORT 3
#define RAMUS_LOSS 5

// What one grid row (blockIdx.y) works on: a dense run (width == 0: `len`
// consecutive elements) or a table (`len` touched rows of `width` floats,
// row ids in `rows`; ids >= table_rows are skipped, like the host does).
// `slot` is the segment's first parameter: a non-finite gradient at
// offset i is reported as the key (slot << 40) | i.
struct Segment {
    float* value;
    const float* grad;
    float* first;   // Adam: m; a buffer segment: the buffer's kept copy
    float* second;  // Adagrad: sum of squares; Adam: v
    const u32* rows;
    u64 len;
    u32 width;
    u32 table_rows;
    u32 slot;
    float lr_scale;  // the segment's learning-rate multiplier
};

struct Segments {
    Segment s[RAMUS_MAX_SEGMENTS];
};

// Hyper-parameters as f32, and the step's bias corrections (host-computed
// in double, like the host reference).
struct Args {
    float lr;
    float weight_decay;
    float beta1;
    float beta2;
    float one_minus_beta1;
    float one_minus_beta2;
    float eps;
    float inv_bias_correction1;
    float inv_bias_correction2;
};

// Each operation rounded on its own, as on the host (no FMA contraction).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }

__device__ __forceinline__ u64 segment_elements(const Segment& s) {
    return s.width == 0 ? s.len : s.len * s.width;
}

// Element j of the segment as an offset into its buffers; false for a row
// id outside the table.
__device__ __forceinline__ bool segment_offset(const Segment& s, u64 j, u64* at) {
    if (s.width == 0) {
        *at = j;
        return true;
    }
    const u32 row = s.rows[j / s.width];
    if (row >= s.table_rows) return false;
    *at = (u64)row * s.width + j % s.width;
    return true;
}

// Squared L2 norm of the segments' gradients, in double and deterministic:
// a fixed order per thread, a fixed tree per block, one partial sum per
// block at partials[slot_base + blockIdx.y * gridDim.x + blockIdx.x], and
// the last of the step's `total_blocks` blocks (over all its launches) adds
// the partial sums in index order. That block writes the clip factor
// (max_norm / norm when the norm exceeds max_norm, else 1, like the host),
// the norm, the step's skip flag (the norm or the loss, if given, is not
// finite: a sum of squares of floats is finite exactly when every one is)
// and the key of its first non-finite gradient, and re-arms the counter
// `done` and the key for the next step.
extern "C" __global__ void ramus_grad_norm(Segments segments, double* partials, u32 slot_base,
                                           u32 total_blocks, u32* done, double max_norm,
                                           float* clip_scale, double* norm_out,
                                           const float* loss, u32* status) {
    __shared__ double sums[RAMUS_BLOCK];
    __shared__ u32 ticket;
    const Segment s = segments.s[blockIdx.y];
    const u64 n = segment_elements(s);
    double acc = 0.0;
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < n;
         j += (u64)gridDim.x * blockDim.x) {
        u64 i;
        if (segment_offset(s, j, &i)) {
            const double g = s.grad[i];
            acc += g * g;  // exact product: an FMA changes nothing
            if (!isfinite(g)) {
                atomicMax((unsigned long long*)(status + RAMUS_KEY_SEEN),
                          ~(((u64)s.slot << 40) | i));
            }
        }
    }
    sums[threadIdx.x] = acc;
    __syncthreads();
    for (u32 half = RAMUS_BLOCK / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        partials[slot_base + blockIdx.y * gridDim.x + blockIdx.x] = sums[0];
        __threadfence();
        ticket = atomicAdd(done, 1u);
    }
    __syncthreads();
    if (ticket != total_blocks - 1) return;
    __threadfence();
    const volatile double* all = partials;
    acc = 0.0;
    for (u32 k = threadIdx.x; k < total_blocks; k += RAMUS_BLOCK) acc += all[k];
    sums[threadIdx.x] = acc;
    __syncthreads();
    for (u32 half = RAMUS_BLOCK / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) sums[threadIdx.x] += sums[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        const double norm = sqrt(sums[0]);
        const bool finite = isfinite(norm) && (loss == 0 || isfinite(*loss));
        const double factor = (finite && norm > max_norm && norm > 0.0) ? max_norm / norm : 1.0;
        *clip_scale = (float)factor;
        *norm_out = norm;
        status[RAMUS_SKIP] = finite ? 0u : 1u;
        status[RAMUS_LOSS] = loss == 0 ? 0u : __float_as_uint(*loss);
        volatile u64* seen = (volatile u64*)(status + RAMUS_KEY_SEEN);
        *(u64*)(status + RAMUS_KEY_REPORT) = *seen;
        *seen = 0;
        *done = 0;
    }
}

// Buffers (running statistics, which a training step's forward pass
// updates): with restore == 0, copies each segment's `len` values to its
// `first`; with restore != 0 and the step skipped, copies them back.
extern "C" __global__ void ramus_keep_buffers(Segments segments, const u32* status, u32 restore) {
    if (restore != 0u && status[RAMUS_SKIP] == 0u) return;
    const Segment s = segments.s[blockIdx.y];
    for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < s.len;
         j += (u64)gridDim.x * blockDim.x) {
        if (restore != 0u) {
            s.value[j] = s.first[j];
        } else {
            s.first[j] = s.value[j];
        }
    }
}
"#;

/// The update kernel's scalar arguments (`struct Args` in the source):
/// the configuration's hyper-parameters as `f32` and the step's inverse
/// bias corrections, computed exactly as the host reference does.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct UpdateArgs {
    pub lr: f32,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub one_minus_beta1: f32,
    pub one_minus_beta2: f32,
    pub eps: f32,
    pub inv_bias_correction1: f32,
    pub inv_bias_correction2: f32,
}

// SAFETY: `UpdateArgs` is `repr(C)` plain data, nine f32 laid out exactly as
// `struct Args` in the generated source, passed by value.
unsafe impl DeviceRepr for UpdateArgs {}

impl UpdateArgs {
    /// The arguments of step `step` (1 for the first step).
    pub fn for_step(config: &OptimizerConfig, step: u64) -> Self {
        let t = step as f64;
        let (bc1, bc2) = (1.0 - config.beta1.powf(t), 1.0 - config.beta2.powf(t));
        let (beta1, beta2) = (config.beta1 as f32, config.beta2 as f32);
        Self {
            lr: config.lr as f32,
            weight_decay: config.weight_decay as f32,
            beta1,
            beta2,
            one_minus_beta1: 1.0 - beta1,
            one_minus_beta2: 1.0 - beta2,
            eps: config.eps as f32,
            inv_bias_correction1: (1.0 / bc1) as f32,
            inv_bias_correction2: (1.0 / bc2) as f32,
        }
    }
}

/// One parameter's optimizer state, as long as the parameter.
#[derive(Clone, Copy, Debug)]
pub struct ParamState {
    /// Adam's first moments (`None` for SGD and Adagrad).
    pub first: Option<DeviceView<f32>>,
    /// Adagrad's sums of squared gradients, Adam's second moments (`None`
    /// for SGD).
    pub second: Option<DeviceView<f32>>,
}

/// What one [`DeviceOptimizer::step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceStep {
    /// Kernels launched (norm, update and, with buffers, their restore).
    pub launches: usize,
    /// The global gradient norm before clipping, when asked for.
    pub norm: Option<f64>,
}

/// The optimizer's device memory: state in slot order, the norm's partial
/// sums, counter and result, the clip factor; and the plan over it.
struct State {
    plan: Plan,
    /// Adam's first moments.
    first: Option<PoolBuffer<f32>>,
    /// Adagrad's sums of squares, Adam's second moments.
    second: Option<PoolBuffer<f32>>,
    /// State offset and length of each slot.
    offsets: Vec<(usize, usize)>,
    /// Per-block partial sums of the norm (doubles: two words each).
    partials: PoolBuffer<u32>,
    /// [`STATUS_WORDS`] words: 0-1 the norm (a double), 2 the norm
    /// kernel's counter, from 3 the status block (`RAMUS_SKIP` and the
    /// keys in the source's words).
    words: PoolBuffer<u32>,
    /// The clip factor.
    scale: PoolBuffer<f32>,
    /// A copy of the batch's loss, for callers whose loss does not outlive
    /// the step's forward pass ([`DeviceOptimizer::loss_slot`]).
    loss: PoolBuffer<f32>,
    /// The buffers' segments (their kept copies in `kept`).
    buffers: Vec<RawSegment>,
    _kept: Option<PoolBuffer<f32>>,
    /// Every slot, to name a non-finite gradient's parameter.
    slots: Vec<ParamSlot>,
}

impl State {
    /// Allocates (uninitialised) state for `slots` from `pool`.
    fn new(pool: &Arc<DevicePool>, kind: OptimizerKind, slots: &[ParamSlot]) -> Result<Self> {
        let total: usize = slots.iter().map(|s| s.value.len()).sum();
        let buffer = |used: bool| -> Result<Option<PoolBuffer<f32>>> {
            used.then(|| pool.alloc::<f32>(total.max(1))).transpose()
        };
        let first = buffer(kind == OptimizerKind::Adam)?;
        let second = buffer(kind != OptimizerKind::Sgd)?;
        let view = |b: &Option<PoolBuffer<f32>>| -> Result<Option<DeviceView<f32>>> {
            b.as_ref().map(|b| b.view().slice(0..total)).transpose()
        };
        let plan = Plan::new(slots, view(&first)?, view(&second)?)?;
        let mut offsets = Vec::with_capacity(slots.len());
        let mut at = 0;
        for slot in slots {
            offsets.push((at, slot.value.len()));
            at += slot.value.len();
        }
        let (buffers, kept) = status::buffer_segments(pool, slots)?;
        Ok(Self {
            partials: pool.alloc::<u32>(2 * Plan::max_norm_slots(slots).max(plan.norm_slots()))?,
            words: pool.alloc::<u32>(STATUS_WORDS)?,
            scale: pool.alloc::<f32>(1)?,
            loss: pool.alloc::<f32>(1)?,
            plan,
            first,
            second,
            offsets,
            buffers,
            _kept: kept,
            slots: slots.to_vec(),
        })
    }

    /// The norm kernel's counter.
    fn counter(&self) -> Result<DeviceView<u32>> {
        self.words.view().slice(2..3)
    }

    /// The status block the kernels read and write.
    fn status(&self) -> Result<DeviceView<u32>> {
        self.words.view().slice(3..STATUS_WORDS)
    }
}

/// Optimizer state and generated kernels for parameters living on the
/// device; [`DeviceOptimizer::step`] is the device twin of
/// [`ramus_exec::Optimizer::step`].
pub struct DeviceOptimizer {
    config: OptimizerConfig,
    spec: UpdateKernelSpec,
    state: State,
    steps: u64,
    launches: u64,
    _module: Arc<LoadedModule>,
    update: CudaFunction,
    norm: CudaFunction,
    keep: CudaFunction,
    /// False after a failed norm launch may have left the counter armed.
    counter_clean: bool,
    /// The last step's status words, copied back behind it.
    staging: PinnedBuffer,
    /// Whether `staging` holds a step's status the host has not read.
    status_pending: bool,
    /// Statuses read but not yet taken, oldest first.
    statuses: std::collections::VecDeque<StepStatus>,
}

impl DeviceOptimizer {
    /// State for the parameters `slots` (in declaration order; row-gradient
    /// tables are numbered in this order for [`DeviceOptimizer::step`]),
    /// allocated from `pool` and initialised like the host's (zeros); the
    /// kernels come from `cache` (compiled only if no earlier optimizer with
    /// the same [`UpdateKernelSpec`] compiled them).
    pub fn new(
        device: &CudaDevice,
        pool: &Arc<DevicePool>,
        cache: &KernelCache,
        config: &OptimizerConfig,
        slots: &[ParamSlot],
    ) -> Result<Self> {
        let spec = UpdateKernelSpec::of(config);
        let names = spec.kernel_names();
        let module = cache.get_or_compile(&spec.source(), &[&names[0], &names[1], &names[2]])?;
        let update = module.function(&names[0])?.clone();
        let norm = module.function(&names[1])?.clone();
        let keep = module.function(&names[2])?.clone();
        let state = State::new(pool, config.kind, slots)?;
        let stream = device.stream();
        for buffer in [&state.first, &state.second].into_iter().flatten() {
            buffer.view().fill_zero(stream)?;
        }
        state.words.view().fill_zero(stream)?;
        // Zeroed on the main stream; waiting here lets `step` use any stream.
        stream.synchronize().in_call("cuStreamSynchronize")?;
        Ok(Self {
            config: *config,
            spec,
            state,
            steps: 0,
            launches: 0,
            _module: module,
            update,
            norm,
            keep,
            counter_clean: true,
            staging: PinnedBuffer::new(device)?,
            status_pending: false,
            statuses: std::collections::VecDeque::new(),
        })
    }

    /// The configuration in use.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// Changes hyper-parameters (learning rate, decay, betas, eps, clip
    /// threshold) without recompiling. The kind and whether clipping is on
    /// select the kernel, so they cannot change.
    pub fn set_config(&mut self, config: &OptimizerConfig) -> Result<()> {
        if UpdateKernelSpec::of(config) != self.spec {
            return Err(CudaError::BadArgument(format!(
                "cannot switch a device optimizer from {:?} to {:?} (make a new one)",
                self.spec,
                UpdateKernelSpec::of(config)
            )));
        }
        self.config = *config;
        Ok(())
    }

    /// Makes slot `p`'s step take the learning rate times `scales[p]` (0:
    /// the parameter stays; empty: 1 for every slot), from the next step
    /// on. The state stays where it is.
    pub fn set_lr_scales(&mut self, scales: &[f64]) -> Result<()> {
        ramus_exec::optim::check_lr_scales(scales, self.state.slots.len())
            .map_err(|e| CudaError::BadArgument(e.to_string()))?;
        let scales: Vec<f32> = scales.iter().map(|&s| s as f32).collect();
        let total: usize = self.state.slots.iter().map(|s| s.value.len()).sum();
        let view = |b: &Option<PoolBuffer<f32>>| -> Result<Option<DeviceView<f32>>> {
            b.as_ref().map(|b| b.view().slice(0..total)).transpose()
        };
        let (first, second) = (view(&self.state.first)?, view(&self.state.second)?);
        self.state.plan = Plan::with_scales(&self.state.slots, &scales, first, second)?;
        Ok(())
    }

    /// Steps taken (applied: a skipped step is taken back once its status
    /// is read).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Kernels launched over all steps.
    pub fn launches(&self) -> u64 {
        self.launches
    }

    /// What the kernels were generated from.
    pub fn spec(&self) -> UpdateKernelSpec {
        self.spec
    }

    /// Copies the moments and the step count into `host`, the host twin
    /// for the same parameters (a checkpoint of a device run); waits for
    /// `stream`.
    pub fn download_into(&mut self, stream: &CudaStream, host: &mut Optimizer<f32>) -> Result<()> {
        self.check_kind(host)?;
        let first = self.download_moments(true, host.first_moments(), stream)?;
        let second = self.download_moments(false, host.second_moments(), stream)?;
        host.restore(self.steps, first, second)
            .map_err(CudaError::BadArgument)
    }

    /// Makes `host`'s moments and step count the device's (a resumed run);
    /// later steps on `stream` follow the copy.
    pub fn upload_from(&mut self, stream: &CudaStream, host: &Optimizer<f32>) -> Result<()> {
        self.check_kind(host)?;
        for (buffer, moments) in [
            (&self.state.first, host.first_moments()),
            (&self.state.second, host.second_moments()),
        ] {
            let Some(buffer) = buffer else { continue };
            let mut flat = Vec::new();
            for (p, &(_, len)) in self.state.offsets.iter().enumerate() {
                match moments.get(p) {
                    Some(t) if t.len() == len => flat.extend_from_slice(t.data()),
                    _ => {
                        return Err(CudaError::BadArgument(format!(
                            "host optimizer state of parameter {p} does not match its {len} values"
                        )))
                    }
                }
            }
            self.staging
                .upload_slice(&flat, buffer.view().slice(0..flat.len())?, stream)?;
        }
        stream.synchronize().in_call("cuStreamSynchronize")?;
        self.steps = host.steps();
        Ok(())
    }

    fn check_kind(&self, host: &Optimizer<f32>) -> Result<()> {
        if host.config.kind != self.config.kind {
            return Err(CudaError::BadArgument(format!(
                "host optimizer {:?}, device optimizer {:?}",
                host.config.kind, self.config.kind
            )));
        }
        Ok(())
    }

    /// The first (`first`) or second moments, shaped as `like` (the host's:
    /// empty where the rule keeps none).
    fn download_moments(
        &mut self,
        first: bool,
        like: &[Tensor<f32>],
        stream: &CudaStream,
    ) -> Result<Vec<Tensor<f32>>> {
        let buffer = if first {
            &self.state.first
        } else {
            &self.state.second
        };
        let Some(buffer) = buffer else {
            return Ok(like.to_vec());
        };
        let total: usize = self.state.offsets.iter().map(|&(_, len)| len).sum();
        let all = self
            .staging
            .download_to_vec(buffer.view().slice(0..total)?, stream)?;
        like.iter()
            .zip(&self.state.offsets)
            .map(|(t, &(at, len))| {
                Tensor::from_vec(t.shape(), all[at..at + len].to_vec())
                    .map_err(|e| CudaError::BadArgument(format!("optimizer state: {e}")))
            })
            .collect()
    }

    /// Parameter `p`'s optimizer state on the device.
    pub fn state(&self, p: usize) -> Result<ParamState> {
        let &(at, len) = self.state.offsets.get(p).ok_or_else(|| {
            CudaError::BadArgument(format!(
                "parameter {p} of {} has no optimizer state",
                self.state.offsets.len()
            ))
        })?;
        let part = |b: &Option<PoolBuffer<f32>>| -> Result<Option<DeviceView<f32>>> {
            b.as_ref().map(|b| b.view().slice(at..at + len)).transpose()
        };
        Ok(ParamState {
            first: part(&self.state.first)?,
            second: part(&self.state.second)?,
        })
    }

    /// One update on `stream`, ordered after the work that wrote the
    /// gradients, from the gradients in the slots' views, unless a gradient
    /// or `loss` (the batch's loss, one float, if given) is not finite:
    /// then nothing changes (see the module docs). `touched[t]` holds the
    /// touched row ids of the `t`-th row-gradient table (unique, in any
    /// order; ids past the table's end are skipped; an empty view leaves
    /// the table alone); it and `loss` must stay allocated until the stream
    /// has passed the step. The step's status comes back behind it: read
    /// it with [`DeviceOptimizer::take_status`]. The step first reads the
    /// previous step's status (its step count depends on it), which waits
    /// only if the host has not synchronized with the stream since. With
    /// `want_norm`, the global gradient norm before clipping (dense
    /// gradients plus touched rows) is returned, which waits for the step.
    /// Use one stream for all steps (or order them with events): the state
    /// is read and written by each step.
    pub fn step(
        &mut self,
        stream: &CudaStream,
        touched: &[DeviceView<u32>],
        loss: Option<DeviceView<f32>>,
        want_norm: bool,
    ) -> Result<DeviceStep> {
        self.settle()?;
        let segments = self.state.plan.segments(touched)?;
        self.steps += 1;
        let args = UpdateArgs::for_step(&self.config, self.steps);
        // with nothing to update, one empty segment: the loss is still checked
        let empty = [RawSegment::default()];
        let checked = if segments.is_empty() {
            &empty[..]
        } else {
            &segments
        };
        let max_norm = self.config.clip_norm.unwrap_or(f64::INFINITY);
        let mut launches = self.launch_norm(stream, checked, max_norm, addr(loss))?;
        launches += self.launch_update(stream, &segments, &args)?;
        launches += self.launch_keep(stream, true)?;
        self.staging
            .download(self.state.words.view().slice(0..STATUS_WORDS)?, stream)?;
        self.status_pending = true;
        let norm = if want_norm {
            self.settle()?;
            self.statuses.back().map(|s| s.norm)
        } else {
            None
        };
        Ok(DeviceStep { launches, norm })
    }

    /// One float of the optimizer's own, for a caller to copy the batch's
    /// loss into and pass to [`DeviceOptimizer::step`] when its own loss
    /// buffer is freed before the step runs.
    pub fn loss_slot(&self) -> Result<DeviceView<f32>> {
        self.state.loss.view().slice(0..1)
    }

    /// Copies the buffers aside (before a training step's forward pass
    /// updates them), so that a skipped step restores them. Nothing to do
    /// for a model without buffers.
    pub fn keep_buffers(&mut self, stream: &CudaStream) -> Result<usize> {
        self.launch_keep(stream, false)
    }

    /// Reads the status of the last step if it has not been read (waiting
    /// for its copy, which the host's next synchronization with the stream
    /// has already finished): a skipped step is taken back from the step
    /// count, and the status joins those [`DeviceOptimizer::take_status`]
    /// returns.
    fn settle(&mut self) -> Result<()> {
        if !std::mem::take(&mut self.status_pending) {
            return Ok(());
        }
        let words = self.staging.host::<u32>(STATUS_WORDS)?;
        let status = status::decode(words, &self.state.slots);
        if !status.applied {
            self.steps -= 1;
        }
        self.statuses.push_back(status);
        Ok(())
    }

    /// The status of the oldest step not yet taken (see
    /// [`DeviceOptimizer::step`]), `None` if every step's was.
    pub fn take_status(&mut self) -> Result<Option<StepStatus>> {
        self.settle()?;
        Ok(self.statuses.pop_front())
    }

    fn launch_norm(
        &mut self,
        stream: &CudaStream,
        segments: &[RawSegment],
        max_norm: f64,
        loss: u64,
    ) -> Result<usize> {
        let (chunks, total_blocks) = launch_chunks(segments, MAX_NORM_BLOCKS)?;
        if 2 * total_blocks as usize > self.state.partials.len() {
            return Err(CudaError::BadArgument(format!(
                "{total_blocks} norm blocks for {} partial sums",
                self.state.partials.len() / 2
            )));
        }
        let counter = self.state.counter()?;
        if !self.counter_clean {
            counter.fill_zero(stream)?;
        }
        self.counter_clean = false;
        let (partials, scale, norm_out, status) = (
            self.state.partials.view().device_ptr(),
            self.state.scale.view().device_ptr(),
            self.state.words.view().device_ptr(),
            self.state.status()?.device_ptr(),
        );
        for chunk in &chunks {
            let cfg = LaunchConfig {
                grid_dim: (chunk.grid_x, chunk.count, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = stream.launch_builder(&self.norm);
            launch
                .arg(&chunk.segments)
                .arg(&partials)
                .arg(&chunk.slot_base)
                .arg(&total_blocks)
                .arg(counter.kernel_arg())
                .arg(&max_norm)
                .arg(&scale)
                .arg(&norm_out)
                .arg(&loss)
                .arg(&status);
            // SAFETY: the arguments match `ramus_grad_norm`; every segment
            // addresses live pool memory checked by `Plan` (gradients of
            // `len` floats or `len` touched rows of a table whose ids the
            // kernel bounds-checks), or is empty; the partial sums hold
            // `total_blocks` doubles (checked above); the counter, norm,
            // factor and status block are this optimizer's own buffers;
            // `loss` is 0 or one float the caller keeps alive (`step`).
            unsafe { launch.launch(cfg) }.in_call("cuLaunchKernel(ramus_grad_norm)")?;
            self.launches += 1;
        }
        self.counter_clean = true;
        Ok(chunks.len())
    }

    fn launch_update(
        &mut self,
        stream: &CudaStream,
        segments: &[RawSegment],
        args: &UpdateArgs,
    ) -> Result<usize> {
        let (chunks, _) = launch_chunks(segments, MAX_UPDATE_BLOCKS)?;
        let scale = if self.spec.clip {
            self.state.scale.view().device_ptr()
        } else {
            0
        };
        let status = self.state.status()?.device_ptr();
        for chunk in &chunks {
            let cfg = LaunchConfig {
                grid_dim: (chunk.grid_x, chunk.count, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = stream.launch_builder(&self.update);
            launch
                .arg(&chunk.segments)
                .arg(args)
                .arg(&scale)
                .arg(&status);
            // SAFETY: the arguments match the generated update kernel; the
            // segments address live pool memory checked by `Plan` (values,
            // gradients and state of `len` floats, or touched rows of
            // tables, ids bounds-checked in the kernel, unique per the
            // caller's contract so no element is written twice); the clip
            // factor, read only when clipping, and the skip flag in the
            // status block were written by the norm kernel launched before
            // on this stream.
            unsafe { launch.launch(cfg) }.in_call("cuLaunchKernel(optimizer update)")?;
            self.launches += 1;
        }
        Ok(chunks.len())
    }

    /// Keeps the buffers (`restore` false) or restores them if the step
    /// was skipped (`restore` true).
    fn launch_keep(&mut self, stream: &CudaStream, restore: bool) -> Result<usize> {
        if self.state.buffers.is_empty() {
            return Ok(0);
        }
        let (chunks, _) = launch_chunks(&self.state.buffers, MAX_UPDATE_BLOCKS)?;
        let status = self.state.status()?.device_ptr();
        let restore = u32::from(restore);
        for chunk in &chunks {
            let cfg = LaunchConfig {
                grid_dim: (chunk.grid_x, chunk.count, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = stream.launch_builder(&self.keep);
            launch.arg(&chunk.segments).arg(&status).arg(&restore);
            // SAFETY: the arguments match `ramus_keep_buffers`; each
            // segment is a buffer's live values and its kept copy of the
            // same length (`status::buffer_segments`); the skip flag, read
            // only when restoring, was written by this step's norm kernel
            // earlier on this stream.
            unsafe { launch.launch(cfg) }.in_call("cuLaunchKernel(ramus_keep_buffers)")?;
            self.launches += 1;
        }
        Ok(chunks.len())
    }
}

#[cfg(test)]
mod host;
#[cfg(test)]
mod tests;
