//! The optimizer step on the device: SGD, Adagrad and Adam / AdamW with
//! global gradient-norm clipping, as fused generated kernels, mirroring the
//! host reference [`ramus_nn::Optimizer`] operation for operation.
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
//! Launches per step: one update launch (plus one norm launch when clipping
//! or when the norm is requested), one more of each for every further
//! [`MAX_SEGMENTS`] segments.

use std::fmt::Write as _;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use ramus_core::Tensor;
use ramus_nn::{Optimizer, OptimizerConfig, OptimizerKind};

use crate::cache::KernelCache;
use crate::device::CudaDevice;
use crate::error::{CudaError, InCall, Result};
use crate::pinned::PinnedBuffer;
use crate::pool::{DevicePool, DeviceView, PoolBuffer};
use crate::rtc::LoadedModule;

/// Segments (dense runs and tables) one launch covers (`RAMUS_MAX_SEGMENTS`
/// in the generated source).
pub const MAX_SEGMENTS: usize = 16;
/// Threads per block of both kernels (`RAMUS_BLOCK`).
const BLOCK: u32 = 256;
/// Blocks per segment of an update launch at most (grid-stride beyond).
const MAX_UPDATE_BLOCKS: u32 = 1024;
/// Blocks per segment of a norm launch at most: bounds the partial sums.
const MAX_NORM_BLOCKS: u32 = 128;
/// The norm kernel's name (the same in every module).
const NORM_KERNEL: &str = "ramus_grad_norm";

/// How a parameter's gradient arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradLayout {
    /// A gradient for every element: the whole parameter is updated.
    Dense,
    /// Row gradients of an embedding table with rows of `width` floats:
    /// only the rows named in each step's touched list are updated.
    Rows { width: usize },
    /// No gradient: a non-trained buffer (batch normalisation's running
    /// statistics, [`ramus_core::ParamKind::Buffer`]) that the optimizer
    /// leaves alone — no step, no weight decay, not in the clipping norm.
    Frozen,
}

/// One parameter as the optimizer sees it on the device.
#[derive(Clone, Copy, Debug)]
pub struct ParamSlot {
    /// The parameter's values (updated in place).
    pub value: DeviceView<f32>,
    /// Its gradient, as long as `value` (for tables, only touched rows are read).
    pub grad: DeviceView<f32>,
    pub layout: GradLayout,
}

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

    /// The kernels the module defines: the update, then the norm.
    pub fn kernel_names(&self) -> [String; 2] {
        [self.update_kernel_name(), NORM_KERNEL.to_string()]
    }

    /// The per-element update: statements reading `w` (the value), the
    /// segment `s`, offset `i` and arguments `a`, leaving the new value in
    /// `w`. Operand order and rounding follow `ramus_nn::optim` exactly.
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
                "w = sub_rn(w, mul_rn(a.lr, g));".into(),
            ],
            OptimizerKind::Adagrad => vec![
                format!("const float g = add_rn({g}, mul_rn(a.weight_decay, w));"),
                "const float acc = add_rn(s.second[i], mul_rn(g, g));".into(),
                "s.second[i] = acc;".into(),
                "w = sub_rn(w, div_rn(mul_rn(a.lr, g), add_rn(sqrt_rn(acc), a.eps)));".into(),
            ],
            OptimizerKind::Adam => vec![
                format!("const float g = {g};"),
                "const float m = add_rn(mul_rn(a.beta1, s.first[i]), mul_rn(a.one_minus_beta1, g));".into(),
                "const float v = add_rn(mul_rn(a.beta2, s.second[i]), mul_rn(mul_rn(a.one_minus_beta2, g), g));"
                    .into(),
                "s.first[i] = m;".into(),
                "s.second[i] = v;".into(),
                "// decoupled weight decay (AdamW), then the bias-corrected step".into(),
                "w = sub_rn(w, mul_rn(mul_rn(a.lr, a.weight_decay), w));".into(),
                "w = sub_rn(w, div_rn(mul_rn(a.lr, mul_rn(m, a.inv_bias_correction1)), \
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
        let mut s = format!("// Ramus optimizer step: {rule}; {clipping}.\n");
        s += PRELUDE;
        let name = self.update_kernel_name();
        // Writing to a String cannot fail.
        let _ = writeln!(
            s,
            "\nextern \"C\" __global__ void {name}(Segments segments, Args a, \
             const float* __restrict__ clip_scale) {{"
        );
        s += "    const Segment s = segments.s[blockIdx.y];\n";
        s += "    const u64 n = segment_elements(s);\n";
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

// What one grid row (blockIdx.y) works on: a dense run (width == 0: `len`
// consecutive elements) or a table (`len` touched rows of `width` floats,
// row ids in `rows`; ids >= table_rows are skipped, like the host does).
struct Segment {
    float* value;
    const float* grad;
    float* first;   // Adam: m
    float* second;  // Adagrad: sum of squares; Adam: v
    const u32* rows;
    u64 len;
    u32 width;
    u32 table_rows;
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
// the norm, and re-arms the counter `done` for the next step.
extern "C" __global__ void ramus_grad_norm(Segments segments, double* partials, u32 slot_base,
                                           u32 total_blocks, u32* done, double max_norm,
                                           float* clip_scale, double* norm_out) {
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
        const double factor = (norm > max_norm && norm > 0.0) ? max_norm / norm : 1.0;
        *clip_scale = (float)factor;
        *norm_out = norm;
        *done = 0;
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

/// One segment as the kernels read it (`struct Segment`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct RawSegment {
    value: u64,
    grad: u64,
    first: u64,
    second: u64,
    rows: u64,
    len: u64,
    width: u32,
    table_rows: u32,
}

impl RawSegment {
    fn elements(&self) -> u64 {
        if self.width == 0 {
            self.len
        } else {
            self.len * u64::from(self.width)
        }
    }
}

/// Up to [`MAX_SEGMENTS`] segments (`struct Segments`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RawSegments {
    s: [RawSegment; MAX_SEGMENTS],
}

// SAFETY: `RawSegments` is `repr(C)` plain data laid out exactly as `struct
// Segments` (each segment: six 8-byte fields, two u32, 56 bytes, no
// padding), passed by value (896 bytes, within the parameter limit).
unsafe impl DeviceRepr for RawSegments {}

/// One launch's share of a step's segments.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    segments: RawSegments,
    /// Segments in this launch (`gridDim.y`).
    count: u32,
    /// Blocks per segment (`gridDim.x`).
    grid_x: u32,
    /// First partial-sum slot of this launch (norm kernel).
    slot_base: u32,
}

/// Splits `segments` into launches of at most [`MAX_SEGMENTS`], each as
/// wide as its largest segment needs (at most `max_blocks`). Returns the
/// launches and their total block count.
fn launch_chunks(segments: &[RawSegment], max_blocks: u32) -> Result<(Vec<Chunk>, u32)> {
    let mut out = Vec::with_capacity(segments.len().div_ceil(MAX_SEGMENTS));
    let mut total: u32 = 0;
    for part in segments.chunks(MAX_SEGMENTS) {
        let widest = part.iter().map(RawSegment::elements).max().unwrap_or(0);
        let grid_x = widest
            .div_ceil(u64::from(BLOCK))
            .clamp(1, u64::from(max_blocks)) as u32;
        let mut raw = RawSegments::default();
        raw.s[..part.len()].copy_from_slice(part);
        let count = part.len() as u32; // at most MAX_SEGMENTS
        out.push(Chunk {
            segments: raw,
            count,
            grid_x,
            slot_base: total,
        });
        total = grid_x
            .checked_mul(count)
            .and_then(|blocks| total.checked_add(blocks))
            .ok_or_else(|| CudaError::BadArgument("too many optimizer segments".into()))?;
    }
    Ok((out, total))
}

/// A run of dense parameters contiguous in values, gradients and state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    value: u64,
    grad: u64,
    first: u64,
    second: u64,
    len: usize,
}

/// A row-gradient table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Table {
    value: u64,
    grad: u64,
    first: u64,
    second: u64,
    width: u32,
    rows: u32,
}

/// Where everything is: dense runs and tables, with their state. Pure data
/// (device addresses), built and checked without touching the device.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Plan {
    runs: Vec<Run>,
    tables: Vec<Table>,
}

fn addr(view: Option<DeviceView<f32>>) -> u64 {
    view.map_or(0, |v| v.device_ptr())
}

fn end(view: &DeviceView<f32>) -> u64 {
    view.device_ptr() + view.byte_len() as u64
}

fn overlap(a: &DeviceView<f32>, b: &DeviceView<f32>) -> bool {
    !a.is_empty() && !b.is_empty() && a.device_ptr() < end(b) && b.device_ptr() < end(a)
}

impl Plan {
    /// Checks `slots` and lays the optimizer state out in slot order
    /// (`first` and `second` hold the total of all slots' lengths).
    fn new(
        slots: &[ParamSlot],
        first: Option<DeviceView<f32>>,
        second: Option<DeviceView<f32>>,
    ) -> Result<Self> {
        let bad = |p: usize, what: String| CudaError::BadArgument(format!("parameter {p}: {what}"));
        for (p, slot) in slots.iter().enumerate() {
            if slot.value.len() != slot.grad.len() {
                return Err(bad(
                    p,
                    format!(
                        "{} values but a gradient of {}",
                        slot.value.len(),
                        slot.grad.len()
                    ),
                ));
            }
            if let GradLayout::Rows { width } = slot.layout {
                if width == 0 || slot.value.len() % width != 0 {
                    return Err(bad(
                        p,
                        format!("{} values are not rows of {width}", slot.value.len()),
                    ));
                }
                if u32::try_from(width).is_err() || u32::try_from(slot.value.len() / width).is_err()
                {
                    return Err(bad(p, "table too large for 32-bit row ids".into()));
                }
            }
            for (q, other) in slots.iter().enumerate() {
                let values_clash = q > p && overlap(&slot.value, &other.value);
                if values_clash || overlap(&slot.value, &other.grad) {
                    return Err(bad(
                        p,
                        format!("its values overlap parameter {q}'s values or gradient"),
                    ));
                }
            }
        }
        let total: usize = slots.iter().map(|s| s.value.len()).sum();
        for state in [first, second].into_iter().flatten() {
            if state.len() != total {
                return Err(CudaError::BadArgument(format!(
                    "optimizer state of {} floats for {total} parameters",
                    state.len()
                )));
            }
        }
        let mut plan = Plan {
            runs: Vec::new(),
            tables: Vec::new(),
        };
        let mut at = 0;
        let mut previous: Option<(&ParamSlot, usize)> = None; // last dense slot, its run
        for slot in slots {
            let len = slot.value.len();
            let state = |v: Option<DeviceView<f32>>| -> Result<u64> {
                v.map(|v| v.slice(at..at + len)).transpose().map(addr)
            };
            let (first_at, second_at) = (state(first)?, state(second)?);
            at += len;
            match slot.layout {
                GradLayout::Rows { width } => {
                    previous = None;
                    plan.tables.push(Table {
                        value: slot.value.device_ptr(),
                        grad: slot.grad.device_ptr(),
                        first: first_at,
                        second: second_at,
                        width: width as u32,        // checked above
                        rows: (len / width) as u32, // checked above
                    });
                }
                GradLayout::Frozen => previous = None,
                GradLayout::Dense if len == 0 => {}
                GradLayout::Dense => {
                    let extends = previous.filter(|(last, _)| {
                        end(&last.value) == slot.value.device_ptr()
                            && end(&last.grad) == slot.grad.device_ptr()
                    });
                    match extends {
                        Some((_, run)) => plan.runs[run].len += len,
                        None => plan.runs.push(Run {
                            value: slot.value.device_ptr(),
                            grad: slot.grad.device_ptr(),
                            first: first_at,
                            second: second_at,
                            len,
                        }),
                    }
                    previous = Some((slot, plan.runs.len() - 1));
                }
            }
        }
        Ok(plan)
    }

    /// Segments of one step: every dense run, then every table with touched
    /// rows (`touched[t]`: the touched row ids of table `t`).
    fn segments(&self, touched: &[DeviceView<u32>]) -> Result<Vec<RawSegment>> {
        if touched.len() != self.tables.len() {
            return Err(CudaError::BadArgument(format!(
                "{} touched-row lists for {} row-gradient tables",
                touched.len(),
                self.tables.len()
            )));
        }
        let mut out = Vec::with_capacity(self.runs.len() + self.tables.len());
        out.extend(self.runs.iter().map(|r| RawSegment {
            value: r.value,
            grad: r.grad,
            first: r.first,
            second: r.second,
            rows: 0,
            len: r.len as u64,
            width: 0,
            table_rows: 0,
        }));
        for (t, (table, rows)) in self.tables.iter().zip(touched).enumerate() {
            if rows.is_empty() {
                continue;
            }
            if rows.len() > table.rows as usize {
                return Err(CudaError::BadArgument(format!(
                    "{} touched rows for table {t} of {} rows (row ids must be unique)",
                    rows.len(),
                    table.rows
                )));
            }
            out.push(RawSegment {
                value: table.value,
                grad: table.grad,
                first: table.first,
                second: table.second,
                rows: rows.device_ptr(),
                len: rows.len() as u64,
                width: table.width,
                table_rows: table.rows,
            });
        }
        Ok(out)
    }

    /// Partial-sum slots the norm kernel may need in one step.
    fn norm_slots(&self) -> usize {
        (self.runs.len() + self.tables.len()).max(1) * MAX_NORM_BLOCKS as usize
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
    /// Kernels launched (update, plus norm when clipping or asked).
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
    /// Words 0-1: the norm (a double); word 2: the norm kernel's counter.
    words: PoolBuffer<u32>,
    /// The clip factor.
    scale: PoolBuffer<f32>,
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
        Ok(Self {
            partials: pool.alloc::<u32>(2 * plan.norm_slots())?,
            words: pool.alloc::<u32>(4)?,
            scale: pool.alloc::<f32>(1)?,
            plan,
            first,
            second,
            offsets,
        })
    }

    /// The norm kernel's counter.
    fn counter(&self) -> Result<DeviceView<u32>> {
        self.words.view().slice(2..3)
    }
}

/// Optimizer state and generated kernels for parameters living on the
/// device; [`DeviceOptimizer::step`] is the device twin of
/// [`ramus_nn::Optimizer::step`].
pub struct DeviceOptimizer {
    config: OptimizerConfig,
    spec: UpdateKernelSpec,
    state: State,
    steps: u64,
    launches: u64,
    _module: Arc<LoadedModule>,
    update: CudaFunction,
    norm: CudaFunction,
    /// False after a failed norm launch may have left the counter armed.
    counter_clean: bool,
    staging: PinnedBuffer,
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
        let module = cache.get_or_compile(&spec.source(), &[&names[0], &names[1]])?;
        let update = module.function(&names[0])?.clone();
        let norm = module.function(&names[1])?.clone();
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
            counter_clean: true,
            staging: PinnedBuffer::new(device)?,
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

    /// Steps taken.
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
    /// gradients, from the gradients in the slots' views. `touched[t]`
    /// holds the touched row ids of the `t`-th row-gradient table (unique,
    /// in any order; ids past the table's end are skipped; an empty view
    /// leaves the table alone); it must stay allocated until the stream has
    /// passed the step. With `want_norm`, the global gradient norm before
    /// clipping (dense gradients plus touched rows) is computed, downloaded
    /// and returned, which waits for the step; otherwise nothing waits. Use
    /// one stream for all steps (or order them with events): the state is
    /// read and written by each step.
    pub fn step(
        &mut self,
        stream: &CudaStream,
        touched: &[DeviceView<u32>],
        want_norm: bool,
    ) -> Result<DeviceStep> {
        let segments = self.state.plan.segments(touched)?;
        self.steps += 1;
        let args = UpdateArgs::for_step(&self.config, self.steps);
        let mut launches = 0;
        let clip = self.config.clip_norm;
        let mut norm = None;
        if clip.is_some() || want_norm {
            if segments.is_empty() {
                norm = Some(0.0); // nothing to sum, nothing to scale
            } else {
                launches += self.launch_norm(stream, &segments, clip.unwrap_or(f64::INFINITY))?;
            }
        }
        launches += self.launch_update(stream, &segments, &args)?;
        if want_norm && norm.is_none() {
            let words = self
                .staging
                .download_to_vec(self.state.words.view().slice(0..2)?, stream)?;
            let [low, high] = words[..] else {
                return Err(CudaError::BadArgument("the norm did not come back".into()));
            };
            norm = Some(f64::from_bits(u64::from(low) | (u64::from(high) << 32)));
        }
        Ok(DeviceStep {
            launches,
            norm: if want_norm { norm } else { None },
        })
    }

    fn launch_norm(
        &mut self,
        stream: &CudaStream,
        segments: &[RawSegment],
        max_norm: f64,
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
        let (partials, scale, norm_out) = (
            self.state.partials.view().device_ptr(),
            self.state.scale.view().device_ptr(),
            self.state.words.view().device_ptr(),
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
                .arg(&norm_out);
            // SAFETY: the arguments match `ramus_grad_norm`; every segment
            // addresses live pool memory checked by `Plan` (gradients of
            // `len` floats or `len` touched rows of a table whose ids the
            // kernel bounds-checks); the partial sums hold `total_blocks`
            // doubles (checked above); the counter, norm and factor are
            // this optimizer's own buffers.
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
        for chunk in &chunks {
            let cfg = LaunchConfig {
                grid_dim: (chunk.grid_x, chunk.count, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            let mut launch = stream.launch_builder(&self.update);
            launch.arg(&chunk.segments).arg(args).arg(&scale);
            // SAFETY: the arguments match the generated update kernel; the
            // segments address live pool memory checked by `Plan` (values,
            // gradients and state of `len` floats, or touched rows of
            // tables, ids bounds-checked in the kernel, unique per the
            // caller's contract so no element is written twice); the clip
            // factor, read only when clipping, was written by the norm
            // kernel launched before on this stream.
            unsafe { launch.launch(cfg) }.in_call("cuLaunchKernel(optimizer update)")?;
            self.launches += 1;
        }
        Ok(chunks.len())
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use ramus_core::model::{FunctionSelector, HeadRows, Init, ModelBuilder};
    use ramus_core::{Grads, Model, Params, Tensor};
    use ramus_nn::Optimizer;

    use super::*;
    use crate::pool::{ChunkMemory, PoolConfig};

    fn config(
        kind: OptimizerKind,
        lr: f64,
        weight_decay: f64,
        clip: Option<f64>,
    ) -> OptimizerConfig {
        OptimizerConfig {
            weight_decay,
            clip_norm: clip,
            ..OptimizerConfig::new(kind, lr)
        }
    }

    const KINDS: [OptimizerKind; 3] = [
        OptimizerKind::Sgd,
        OptimizerKind::Adagrad,
        OptimizerKind::Adam,
    ];

    #[test]
    fn identical_configs_give_identical_source() {
        for kind in KINDS {
            for clip in [None, Some(1.0)] {
                let a = UpdateKernelSpec::of(&config(kind, 0.1, 0.0, clip));
                let b = UpdateKernelSpec::of(&config(kind, 0.1, 0.0, clip));
                assert_eq!(a, b);
                assert_eq!(a.source(), b.source());
                assert_eq!(a.kernel_names(), b.kernel_names());
                assert!(a
                    .source()
                    .contains(&format!("void {}(", a.update_kernel_name())));
                assert!(a.source().contains("void ramus_grad_norm("));
            }
        }
    }

    #[test]
    fn hyper_parameters_are_arguments_and_structure_is_source() {
        let base = config(OptimizerKind::Adam, 0.01, 0.0, Some(1.0));
        let variants = [
            OptimizerConfig { lr: 0.02, ..base },
            OptimizerConfig {
                weight_decay: 0.1,
                ..base
            },
            OptimizerConfig { beta1: 0.8, ..base },
            OptimizerConfig {
                beta2: 0.99,
                ..base
            },
            OptimizerConfig { eps: 1e-6, ..base },
            OptimizerConfig {
                clip_norm: Some(5.0),
                ..base
            },
        ];
        let spec = UpdateKernelSpec::of(&base);
        for v in &variants {
            // same kernel...
            assert_eq!(UpdateKernelSpec::of(v).source(), spec.source(), "{v:?}");
        }
        // ...different arguments (the clip threshold is the norm kernel's)
        for v in &variants[..5] {
            assert_ne!(
                UpdateArgs::for_step(v, 3),
                UpdateArgs::for_step(&base, 3),
                "{v:?}"
            );
        }
        assert_ne!(variants[5].clip_norm, base.clip_norm);

        // the rule and clipping change the source and the kernel names
        let mut sources = Vec::new();
        let mut names = Vec::new();
        for kind in KINDS {
            for clip in [None, Some(1.0)] {
                let spec = UpdateKernelSpec::of(&config(kind, 0.1, 0.0, clip));
                sources.push(spec.source());
                names.push(spec.update_kernel_name());
            }
        }
        for i in 0..sources.len() {
            for j in 0..i {
                assert_ne!(sources[i], sources[j]);
                assert_ne!(names[i], names[j]);
            }
        }
        // weight decay on or off is the same kernel (AdamW is Adam's kernel)
        assert_eq!(
            UpdateKernelSpec::of(&config(OptimizerKind::Adam, 0.1, 0.05, None)),
            UpdateKernelSpec::of(&config(OptimizerKind::Adam, 0.1, 0.0, None))
        );
    }

    #[test]
    fn the_clip_factor_is_read_only_when_clipping() {
        for kind in KINDS {
            let clipped = UpdateKernelSpec::of(&config(kind, 0.1, 0.0, Some(1.0))).source();
            let plain = UpdateKernelSpec::of(&config(kind, 0.1, 0.0, None)).source();
            assert!(clipped.contains("*clip_scale;"));
            assert!(!plain.contains("*clip_scale;"));
            // no FMA contraction anywhere in the update
            assert!(clipped.contains("__fmul_rn") && clipped.contains("__fadd_rn"));
        }
    }

    #[test]
    fn bias_corrections_follow_the_host() {
        let c = config(OptimizerKind::Adam, 0.001, 0.01, None);
        for step in [1u64, 2, 10, 1000] {
            let a = UpdateArgs::for_step(&c, step);
            let t = step as f64;
            assert_eq!(
                a.inv_bias_correction1,
                (1.0 / (1.0 - 0.9f64.powf(t))) as f32
            );
            assert_eq!(
                a.inv_bias_correction2,
                (1.0 / (1.0 - 0.999f64.powf(t))) as f32
            );
            assert_eq!(a.lr, 0.001f32);
            assert_eq!(a.weight_decay, 0.01f32);
            assert_eq!(a.one_minus_beta1, 1.0f32 - 0.9f32);
            assert_eq!(a.one_minus_beta2, 1.0f32 - 0.999f32);
            assert_eq!(a.eps, 1e-8f32);
        }
        assert_ne!(UpdateArgs::for_step(&c, 1), UpdateArgs::for_step(&c, 2));
    }

    #[test]
    fn raw_structs_match_the_cuda_layout() {
        assert_eq!(std::mem::size_of::<RawSegment>(), 56);
        assert_eq!(std::mem::size_of::<RawSegments>(), 56 * MAX_SEGMENTS);
        assert_eq!(std::mem::size_of::<UpdateArgs>(), 36);
        assert!(PRELUDE.contains(&format!("#define RAMUS_MAX_SEGMENTS {MAX_SEGMENTS}")));
        assert!(PRELUDE.contains(&format!("#define RAMUS_BLOCK {BLOCK}")));
    }

    // ------------------------------------------------------------------
    // Plans over fake device addresses
    // ------------------------------------------------------------------

    const BASE: u64 = 1 << 32;
    const CHUNK: u64 = 1 << 20;

    /// One fake chunk of device memory at `BASE`.
    #[derive(Debug)]
    struct OneChunk(bool);

    impl ChunkMemory for OneChunk {
        fn allocate(&mut self, bytes: u64) -> Result<Option<u64>> {
            if self.0 || bytes > CHUNK {
                return Ok(None);
            }
            self.0 = true;
            Ok(Some(BASE))
        }
        fn release(&mut self, _base: u64) -> Result<()> {
            Ok(())
        }
    }

    fn fake_pool() -> Arc<DevicePool> {
        DevicePool::with_memory(
            Box::new(OneChunk(false)),
            PoolConfig {
                initial_bytes: CHUNK,
                max_bytes: Some(CHUNK),
            },
        )
    }

    /// Parameters laid out like the CUDA engine does: values in declaration
    /// order in one buffer, gradients dense-first in another.
    struct EngineLayout {
        values: PoolBuffer<f32>,
        grads: PoolBuffer<f32>,
        slots: Vec<ParamSlot>,
        /// Gradient offset of each parameter.
        grad_at: Vec<usize>,
    }

    /// `params[p]`: (length, row width if a table).
    fn engine_layout(pool: &Arc<DevicePool>, params: &[(usize, Option<usize>)]) -> EngineLayout {
        let total: usize = params.iter().map(|p| p.0).sum();
        let values = pool.alloc::<f32>(total).unwrap();
        let grads = pool.alloc::<f32>(total).unwrap();
        let mut grad_at = vec![0; params.len()];
        let mut at = 0;
        for tables in [false, true] {
            for (p, &(len, width)) in params.iter().enumerate() {
                if width.is_some() == tables {
                    grad_at[p] = at;
                    at += len;
                }
            }
        }
        let mut value_at = 0;
        let slots = params
            .iter()
            .enumerate()
            .map(|(p, &(len, width))| {
                let slot = ParamSlot {
                    value: values.view().slice(value_at..value_at + len).unwrap(),
                    grad: grads.view().slice(grad_at[p]..grad_at[p] + len).unwrap(),
                    layout: width.map_or(GradLayout::Dense, |width| GradLayout::Rows { width }),
                };
                value_at += len;
                slot
            })
            .collect();
        EngineLayout {
            values,
            grads,
            slots,
            grad_at,
        }
    }

    #[test]
    fn a_leading_table_leaves_one_dense_run() {
        let pool = fake_pool();
        let l = engine_layout(
            &pool,
            &[(40 * 6, Some(6)), (72, None), (6, None), (30, None)],
        );
        let state = State::new(&pool, OptimizerKind::Adam, &l.slots).unwrap();
        let plan = &state.plan;
        assert_eq!(plan.runs.len(), 1);
        let run = plan.runs[0];
        assert_eq!(run.len, 108);
        assert_eq!(run.grad, l.grads.view().device_ptr()); // the dense prefix
        assert_eq!(run.value, l.values.view().device_ptr() + 4 * 240);
        let first = state.first.as_ref().unwrap().view().device_ptr();
        assert_eq!(run.first, first + 4 * 240);
        assert_eq!(plan.tables.len(), 1);
        let t = plan.tables[0];
        assert_eq!((t.width, t.rows), (6, 40));
        assert_eq!(t.grad, l.grads.view().device_ptr() + 4 * 108);
        assert_eq!(t.first, first);
        assert_eq!(t.second, state.second.as_ref().unwrap().view().device_ptr());
        assert_eq!(
            state.offsets,
            vec![(0, 240), (240, 72), (312, 6), (318, 30)]
        );
    }

    #[test]
    fn tables_between_dense_parameters_split_the_runs() {
        let pool = fake_pool();
        // W, emb, b, W_out, tags, W_leaf: runs [W], [b, W_out], [W_leaf]
        let l = engine_layout(
            &pool,
            &[
                (72, None),
                (240, Some(6)),
                (6, None),
                (30, None),
                (120, Some(4)),
                (60, None),
            ],
        );
        let state = State::new(&pool, OptimizerKind::Sgd, &l.slots).unwrap();
        let plan = &state.plan;
        assert!(state.first.is_none() && state.second.is_none());
        let lens: Vec<usize> = plan.runs.iter().map(|r| r.len).collect();
        assert_eq!(lens, [72, 36, 60]);
        assert!(plan.runs.iter().all(|r| r.first == 0 && r.second == 0));
        assert_eq!(plan.runs[1].grad, l.grads.view().device_ptr() + 4 * 72);
        assert_eq!(plan.tables.len(), 2);

        let rows = pool.alloc::<u32>(16).unwrap();
        let touched = [
            rows.view().slice(0..5).unwrap(),
            rows.view().slice(5..5).unwrap(),
        ];
        let segs = plan.segments(&touched).unwrap();
        assert_eq!(segs.len(), 4, "the empty table is left out");
        assert_eq!(segs[3].rows, rows.view().device_ptr());
        assert_eq!((segs[3].len, segs[3].width, segs[3].table_rows), (5, 6, 40));
        assert_eq!(segs[3].elements(), 30);
        assert_eq!(segs[0].elements(), 72);
        assert_eq!(l.grad_at, vec![0, 168, 72, 78, 408, 108]);

        assert!(plan.segments(&touched[..1]).is_err(), "one list per table");
        let too_many = pool.alloc::<u32>(41).unwrap();
        assert!(plan.segments(&[too_many.view(), touched[1]]).is_err());
    }

    #[test]
    fn frozen_buffers_are_left_out_of_every_segment() {
        let pool = fake_pool();
        let buf = pool.alloc::<f32>(1000).unwrap();
        let v = |a: usize, b: usize| buf.view().slice(a..b).unwrap();
        let slot = |value, grad, layout| ParamSlot {
            value,
            grad,
            layout,
        };
        let (dense, frozen) = (GradLayout::Dense, GradLayout::Frozen);
        // dense, frozen, dense, dense: the frozen slot splits the run and
        // no segment covers it
        let slots = [
            slot(v(0, 10), v(500, 510), dense),
            slot(v(10, 14), v(510, 514), frozen),
            slot(v(14, 20), v(514, 520), dense),
            slot(v(20, 30), v(520, 530), dense),
        ];
        let state = State::new(&pool, OptimizerKind::Adam, &slots).unwrap();
        let segs = state.plan.segments(&[]).unwrap();
        assert_eq!(segs.len(), 2);
        assert_eq!((segs[0].value, segs[0].len), (v(0, 10).device_ptr(), 10));
        assert_eq!((segs[1].value, segs[1].len), (v(14, 20).device_ptr(), 16));
        let covered: u64 = segs.iter().map(|s| s.elements()).sum();
        assert_eq!(covered, 26, "the 4 frozen values are not updated");
        // a model of buffers only has nothing to update
        let only = [slot(v(0, 4), v(500, 504), frozen)];
        let state = State::new(&pool, OptimizerKind::Sgd, &only).unwrap();
        assert!(state.plan.segments(&[]).unwrap().is_empty());
    }

    #[test]
    fn bad_layouts_are_errors() {
        let pool = fake_pool();
        let buf = pool.alloc::<f32>(1000).unwrap();
        let v = |a: usize, b: usize| buf.view().slice(a..b).unwrap();
        let slot = |value, grad, layout| ParamSlot {
            value,
            grad,
            layout,
        };
        let dense = GradLayout::Dense;
        let ok = [slot(v(0, 10), v(500, 510), dense)];
        assert!(State::new(&pool, OptimizerKind::Adam, &ok).is_ok());
        let bad: [&[ParamSlot]; 5] = [
            &[slot(v(0, 10), v(500, 509), dense)],
            &[slot(v(0, 10), v(500, 510), GradLayout::Rows { width: 3 })],
            &[slot(v(0, 10), v(500, 510), GradLayout::Rows { width: 0 })],
            &[
                slot(v(0, 10), v(500, 510), dense),
                slot(v(5, 15), v(600, 610), dense),
            ],
            &[slot(v(0, 10), v(5, 15), dense)],
        ];
        for slots in bad {
            assert!(
                matches!(
                    State::new(&pool, OptimizerKind::Sgd, slots),
                    Err(CudaError::BadArgument(_))
                ),
                "{slots:?}"
            );
        }
    }

    #[test]
    fn chunks_split_at_max_segments_and_number_the_norm_slots() {
        let seg = |len: u64, width: u32| RawSegment {
            len,
            width,
            ..RawSegment::default()
        };
        let mut segments: Vec<RawSegment> = (0..20).map(|i| seg(100 + i, 0)).collect();
        segments[3] = seg(1 << 20, 0);
        segments[18] = seg(1000, 64); // 64000 elements
        let (chunks, total) = launch_chunks(&segments, MAX_NORM_BLOCKS).unwrap();
        assert_eq!(chunks.len(), 2);
        assert_eq!((chunks[0].count, chunks[0].grid_x), (16, MAX_NORM_BLOCKS));
        assert_eq!((chunks[1].count, chunks[1].grid_x), (4, MAX_NORM_BLOCKS));
        assert_eq!(chunks[1].slot_base, 16 * MAX_NORM_BLOCKS);
        assert_eq!(total, 20 * MAX_NORM_BLOCKS);
        assert_eq!(chunks[1].segments.s[2], segments[18]);
        assert_eq!(chunks[1].segments.s[4], RawSegment::default());
        // updates: as wide as the largest segment of the launch needs
        let (chunks, total) = launch_chunks(&segments, MAX_UPDATE_BLOCKS).unwrap();
        assert_eq!(
            (chunks[0].grid_x, chunks[1].grid_x),
            (MAX_UPDATE_BLOCKS, 250)
        );
        assert_eq!(total, 16 * MAX_UPDATE_BLOCKS + 4 * 250);
        let (small, total) = launch_chunks(&segments[..2], MAX_UPDATE_BLOCKS).unwrap();
        assert_eq!((small.len(), small[0].grid_x, total), (1, 1, 2));
        assert_eq!(launch_chunks(&[], MAX_NORM_BLOCKS).unwrap().1, 0);
    }

    // ------------------------------------------------------------------
    // The generated kernels, compiled and run on the host
    // ------------------------------------------------------------------

    /// The parameters of the test model: (name, shape, row width if a table).
    fn test_model() -> Model {
        let h = 6;
        let mut m = ModelBuilder::new("optimizer-test", h);
        let w = m.param("W", &[h, 2 * h], Init::Xavier);
        let emb = m.param("emb", &[40, h], Init::Normal { std: 0.5 });
        let b = m.param("b", &[h], Init::Uniform { bound: 0.5 });
        let w_out = m.param("W_out", &[5, h], Init::LinearDefault);
        let tags = m.param("tags", &[30, 4], Init::Normal { std: 0.5 });
        let w_leaf = m.param("W_leaf", &[h, h + 4], Init::Xavier);
        let leaf = m
            .vertex_fn("leaf", |f| {
                let x = f.embed(emb);
                let t = f.embed(tags);
                let xt = f.concat(&[x, t]);
                let w = f.param(w_leaf);
                let z = f.linear(xt, w, None);
                let y = f.tanh(z);
                f.scatter(y);
                f.push(y);
            })
            .unwrap();
        let internal = m
            .vertex_fn("internal", |f| {
                let (l, r) = (f.gather(0), f.gather(1));
                let lr = f.concat(&[l, r]);
                let (w, b) = (f.param(w), f.param(b));
                let z = f.linear(lr, w, Some(b));
                let y = f.tanh(z);
                f.scatter(y);
                f.push(y);
            })
            .unwrap();
        m.select(FunctionSelector::LeafInternal { leaf, internal });
        m.head(HeadRows::Roots, h, |hd| {
            let x = hd.input();
            let w = hd.param(w_out);
            let logits = hd.linear(x, w, None);
            let labels = hd.labels();
            let loss = hd.softmax_xent(logits, labels);
            let loss = hd.mean_rows(loss);
            hd.loss(loss);
            hd.logits(logits);
        })
        .unwrap();
        m.build().unwrap()
    }

    const TABLES: [usize; 2] = [1, 4];

    /// Deterministic values in [-1, 1).
    fn random_values(len: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Step `step`'s gradients (every element, untouched rows included:
    /// they must be ignored) and touched rows per table, in the order the
    /// device gets them (not sorted; the tags table also names a row past
    /// its end, which both sides skip; step 3 touches no tags row).
    fn step_data(model: &Model, step: u64) -> (Vec<Vec<f32>>, Vec<Vec<u32>>) {
        let grads = model
            .params
            .iter()
            .enumerate()
            .map(|(p, spec)| {
                let n = spec.shape.iter().product();
                random_values(n, step * 100 + p as u64)
            })
            .collect();
        let pick = |rows: u32, seed: u64, count: usize| -> Vec<u32> {
            let mut out = Vec::new();
            for x in random_values(4 * count, seed) {
                let r = ((x + 1.0) * 0.5 * rows as f32) as u32 % rows;
                if !out.contains(&r) && out.len() < count {
                    out.push(r);
                }
            }
            out
        };
        let emb = pick(40, step * 7 + 1, 9);
        let tags = if step == 3 {
            Vec::new()
        } else {
            let mut t = pick(30, step * 7 + 2, 5);
            t.insert(1, 30);
            t
        };
        (grads, vec![emb, tags])
    }

    /// The host reference's gradients for step data.
    fn host_grads(model: &Model, grads: &[Vec<f32>], touched: &[Vec<u32>]) -> Grads<f32> {
        let mut g = Grads::zeros(model);
        for (p, data) in grads.iter().enumerate() {
            g.values[p] = Tensor::from_vec(&model.params[p].shape, data.clone()).unwrap();
            match TABLES.iter().position(|&t| t == p) {
                None => g.mark_dense(p),
                Some(t) => touched[t].iter().for_each(|&r| g.mark_row(p, r)),
            }
        }
        g.finish_rows();
        g
    }

    fn flat(params: &Params<f32>) -> Vec<f32> {
        params
            .values
            .iter()
            .flat_map(|t| t.data().iter().copied())
            .collect()
    }

    /// Enough CUDA to run the generated source as C++ on the host: blocks
    /// one after another, each on 256 threads with a barrier for
    /// `__syncthreads`; device addresses are offsets into `mem`.
    const HOST_SHIM: &str = r#"
#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

struct dim3 { unsigned x = 0, y = 0, z = 0; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim, gridDim;

struct Threads {
    static constexpr unsigned N = 256;
    std::barrier<> start{N + 1}, finish{N + 1}, sync{N};
    std::function<void()> job;
    bool quit = false;
    std::vector<std::thread> threads;
    Threads() {
        for (unsigned t = 0; t < N; ++t)
            threads.emplace_back([this, t] {
                threadIdx.x = t;
                for (;;) {
                    start.arrive_and_wait();
                    if (quit) return;
                    job();
                    finish.arrive_and_wait();
                }
            });
    }
    ~Threads() {
        quit = true;
        start.arrive_and_wait();
        for (auto& t : threads) t.join();
    }
    template <class F> void launch(unsigned gx, unsigned gy, F kernel) {
        gridDim.x = gx; gridDim.y = gy; blockDim.x = N; blockDim.y = 1;
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                job = [&] { blockIdx.x = x; blockIdx.y = y; kernel(); };
                start.arrive_and_wait();
                finish.arrive_and_wait();
            }
    }
};
static Threads* pool;

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline void __syncthreads() { pool->sync.arrive_and_wait(); }
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fsqrt_rn(float a) { return std::sqrt(a); }

static unsigned char* mem;
static const unsigned long long BASE = 0x100000000ull;
static void* at(unsigned long long a) { return a ? mem + (a - BASE) : nullptr; }
static void put(unsigned long long a, const unsigned* bits, unsigned long n) { std::memcpy(at(a), bits, 4 * n); }
static void dump(unsigned long long a, unsigned long n) {
    const unsigned* w = (const unsigned*)at(a);
    for (unsigned long i = 0; i < n; ++i) std::printf("%u ", w[i]);
    std::printf("\n");
}
static float F(unsigned bits) { return std::bit_cast<float>(bits); }
static double D(unsigned long long bits) { return std::bit_cast<double>(bits); }
"#;

    fn host_compiler() -> Option<&'static str> {
        ["c++", "g++", "clang++"].into_iter().find(|cc| {
            Command::new(cc)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
    }

    /// Compiles `src` (the shim, then the modules and a `main`) with the
    /// host C++ compiler, runs it, and returns its output lines as words;
    /// `None` (with a notice) without a compiler.
    fn run_on_host(tag: &str, src: &str) -> Option<Vec<Vec<u32>>> {
        let Some(cc) = host_compiler() else {
            eprintln!("NOTICE: no C++ compiler found; skipping the host run of generated kernels");
            return None;
        };
        let dir =
            std::env::temp_dir().join(format!("ramus-optimizer-host-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (file, exe) = (dir.join("optimizer.cpp"), dir.join("optimizer"));
        std::fs::write(&file, src).unwrap();
        let out = Command::new(cc)
            .args([
                "-std=c++20",
                "-O1",
                "-ffp-contract=off",
                "-Wall",
                "-Werror",
                "-pthread",
                "-o",
            ])
            .arg(&exe)
            .arg(&file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{cc} rejected the generated code ({}):\n{}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let run = Command::new(&exe).output().unwrap();
        assert!(run.status.success(), "host program failed");
        let _ = std::fs::remove_dir_all(&dir);
        let text = String::from_utf8_lossy(&run.stdout).to_string();
        Some(
            text.lines()
                .map(|l| l.split_whitespace().map(|w| w.parse().unwrap()).collect())
                .collect(),
        )
    }

    /// A C++ array expression of `data`.
    fn words(data: &[u32]) -> String {
        let w: Vec<String> = data.iter().map(|x| format!("{x}u")).collect();
        format!("(const unsigned[]){{{}}}", w.join(", "))
    }

    /// C++ that copies `data` to device address `addr`.
    fn put_cpp(addr: u64, data: &[u32]) -> String {
        if data.is_empty() {
            return String::new();
        }
        format!("    put({addr}ull, {}, {});\n", words(data), data.len())
    }

    fn bits(data: &[f32]) -> Vec<u32> {
        data.iter().map(|x| x.to_bits()).collect()
    }

    /// C++ that fills `segs` with a launch's segments.
    fn segments_cpp(ns: &str, chunk: &Chunk) -> String {
        let mut s = format!("{ns}::Segments segs{{}};\n");
        for (k, g) in chunk.segments.s[..chunk.count as usize].iter().enumerate() {
            let _ = writeln!(
                s,
                "        segs.s[{k}] = {ns}::Segment{{(float*)at({}ull), (const float*)at({}ull), \
                 (float*)at({}ull), (float*)at({}ull), (const unsigned*)at({}ull), {}ull, {}u, {}u}};",
                g.value, g.grad, g.first, g.second, g.rows, g.len, g.width, g.table_rows
            );
        }
        s
    }

    /// C++ for the norm launches of one step, as [`DeviceOptimizer::step`]
    /// makes them.
    fn norm_cpp(ns: &str, state: &State, segments: &[RawSegment], max_norm: f64) -> String {
        let (chunks, total_blocks) = launch_chunks(segments, MAX_NORM_BLOCKS).unwrap();
        assert!(2 * total_blocks as usize <= state.partials.len());
        let mut s = String::new();
        for chunk in &chunks {
            let _ = writeln!(
                s,
                "    {{\n        {}        threads.launch({}, {}, [&] {{ {ns}::ramus_grad_norm(segs, \
                 (double*)at({}ull), {}u, {total_blocks}u, (unsigned*)at({}ull), D({}ull), \
                 (float*)at({}ull), (double*)at({}ull)); }});\n    }}",
                segments_cpp(ns, chunk),
                chunk.grid_x,
                chunk.count,
                state.partials.view().device_ptr(),
                chunk.slot_base,
                state.counter().unwrap().device_ptr(),
                max_norm.to_bits(),
                state.scale.view().device_ptr(),
                state.words.view().device_ptr(),
            );
        }
        s
    }

    /// C++ for the update launches of one step.
    fn update_cpp(
        ns: &str,
        spec: UpdateKernelSpec,
        state: &State,
        segments: &[RawSegment],
        args: &UpdateArgs,
    ) -> String {
        let (chunks, _) = launch_chunks(segments, MAX_UPDATE_BLOCKS).unwrap();
        let a = [
            args.lr,
            args.weight_decay,
            args.beta1,
            args.beta2,
            args.one_minus_beta1,
            args.one_minus_beta2,
            args.eps,
            args.inv_bias_correction1,
            args.inv_bias_correction2,
        ]
        .map(|x| format!("F({}u)", x.to_bits()))
        .join(", ");
        let scale = if spec.clip {
            state.scale.view().device_ptr()
        } else {
            0
        };
        let mut s = String::new();
        for chunk in &chunks {
            let _ = writeln!(
                s,
                "    {{\n        {}        {ns}::Args args{{{a}}};\n        threads.launch({}, {}, [&] {{ \
                 {ns}::{}(segs, args, (const float*)at({scale}ull)); }});\n    }}",
                segments_cpp(ns, chunk),
                chunk.grid_x,
                chunk.count,
                spec.update_kernel_name(),
            );
        }
        s
    }

    /// The start of a host program: the shim, then `spec`'s module in
    /// namespace `ns` for each `(ns, spec)`.
    fn host_program(modules: &[(String, UpdateKernelSpec)]) -> String {
        let mut src = String::from(HOST_SHIM);
        for (ns, spec) in modules {
            let _ = writeln!(
                src,
                "namespace {ns} {{\n{}\n}}",
                spec.source().replace("extern \"C\" ", "")
            );
        }
        src += "int main() {\n    mem = (unsigned char*)std::aligned_alloc(256, 1 << 20);\n    \
                Threads threads;\n    pool = &threads;\n";
        src
    }

    const STEPS: u64 = 5;

    /// Runs `configs` for [`STEPS`] steps through the generated kernels on
    /// the host and through `ramus_nn::Optimizer`, and compares every
    /// parameter after every step, bit for bit.
    fn compare_with_host(configs: &[OptimizerConfig]) {
        let model = test_model();
        let shapes: Vec<(usize, Option<usize>)> = model
            .params
            .iter()
            .enumerate()
            .map(|(p, spec)| {
                let len = spec.shape.iter().product();
                (len, TABLES.contains(&p).then(|| spec.shape[1]))
            })
            .collect();
        let total: usize = shapes.iter().map(|s| s.0).sum();
        let initial = Params::<f32>::init(&model, 7);
        let modules: Vec<(String, UpdateKernelSpec)> = configs
            .iter()
            .enumerate()
            .map(|(c, config)| (format!("c{c}"), UpdateKernelSpec::of(config)))
            .collect();
        let mut src = host_program(&modules);
        // The host reference: per config, per step, (values, norm).
        let mut expected: Vec<Vec<(Vec<f32>, Option<f64>)>> = Vec::new();
        for (config, (ns, spec)) in configs.iter().zip(&modules) {
            // The device: the engine's layout and the optimizer's own state.
            let pool = fake_pool();
            let layout = engine_layout(&pool, &shapes);
            let state = State::new(&pool, config.kind, &layout.slots).unwrap();
            let values_at = layout.values.view().device_ptr();
            src += "    std::memset(mem, 0, 1 << 20);\n";
            src += &put_cpp(values_at, &bits(&flat(&initial)));
            let mut params = initial.clone();
            let mut host = Optimizer::new(*config, &params);
            let mut steps = Vec::new();
            for step in 1..=STEPS {
                let (grads, touched) = step_data(&model, step);
                let g = host_grads(&model, &grads, &touched);
                let norm = host.step(&mut params, &g);
                steps.push((flat(&params), norm));

                for (p, data) in grads.iter().enumerate() {
                    let addr = layout.grads.view().device_ptr() + 4 * layout.grad_at[p] as u64;
                    src += &put_cpp(addr, &bits(data));
                }
                let mut views = Vec::new();
                let mut keep = Vec::new();
                for rows in &touched {
                    let buffer = pool.alloc::<u32>(rows.len().max(1)).unwrap();
                    let view = buffer.view().slice(0..rows.len()).unwrap();
                    src += &put_cpp(view.device_ptr(), rows);
                    views.push(view);
                    keep.push(buffer);
                }
                let segments = state.plan.segments(&views).unwrap();
                if let Some(max) = config.clip_norm {
                    src += &norm_cpp(ns, &state, &segments, max);
                }
                let args = UpdateArgs::for_step(config, step);
                src += &update_cpp(ns, *spec, &state, &segments, &args);
                let _ = writeln!(
                    src,
                    "    dump({values_at}ull, {total});\n    dump({}ull, 2);",
                    state.words.view().device_ptr()
                );
            }
            expected.push(steps);
        }
        src += "    return 0;\n}\n";
        let Some(output) = run_on_host("compare", &src) else {
            return;
        };

        let mut lines = output.into_iter();
        let tables: Vec<(usize, usize, usize)> = TABLES
            .iter()
            .map(|&p| {
                let at: usize = shapes[..p].iter().map(|s| s.0).sum();
                (p, at, shapes[p].1.unwrap_or(1))
            })
            .collect();
        for (c, config) in configs.iter().enumerate() {
            let mut before = flat(&initial);
            for (step, (want, want_norm)) in expected[c].iter().enumerate() {
                let got: Vec<f32> = lines
                    .next()
                    .unwrap()
                    .into_iter()
                    .map(f32::from_bits)
                    .collect();
                let norm = lines.next().unwrap();
                let what = format!("{config:?}, step {}", step + 1);
                assert_eq!(got.len(), total);
                for (i, (g, w)) in got.iter().zip(want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{what}: value {i}: kernel {g} vs host {w}"
                    );
                }
                // untouched table rows did not move
                let (_, touched) = step_data(&model, step as u64 + 1);
                for (t, &(p, at, width)) in tables.iter().enumerate() {
                    let rows = shapes[p].0 / width;
                    for r in (0..rows as u32).filter(|r| !touched[t].contains(r)) {
                        let range = at + r as usize * width..at + (r as usize + 1) * width;
                        assert_eq!(
                            got[range.clone()],
                            before[range],
                            "{what}: row {r} of table {p}"
                        );
                    }
                }
                if let Some(want_norm) = want_norm {
                    let norm = f64::from_bits(u64::from(norm[0]) | (u64::from(norm[1]) << 32));
                    assert!(
                        (norm - want_norm).abs() <= 1e-12 * want_norm,
                        "{what}: norm {norm} vs host {want_norm}"
                    );
                    assert!(norm > 1.0, "{what}: the clipping threshold is crossed");
                }
                before = got;
            }
        }
    }

    #[test]
    fn generated_kernels_match_the_host_reference_bit_for_bit() {
        let mut configs = Vec::new();
        for clip in [None, Some(1.0)] {
            configs.push(config(OptimizerKind::Sgd, 0.1, 0.01, clip));
            configs.push(config(OptimizerKind::Adagrad, 0.1, 0.001, clip));
            configs.push(config(OptimizerKind::Adam, 0.01, 0.0, clip));
            configs.push(config(OptimizerKind::Adam, 0.01, 0.1, clip)); // AdamW
        }
        compare_with_host(&configs);
    }

    /// More segments than one launch takes: the norm's last block is in
    /// the last launch and sums every launch's partial sums; the update
    /// reaches every segment. Two steps check that the counter re-arms.
    #[test]
    fn the_norm_and_update_span_several_launches() {
        // 37 dense parameters and 3 tables, interleaved so that nothing merges
        let mut shapes = Vec::new();
        for p in 0..40usize {
            shapes.push(if p % 13 == 5 {
                (12 * 4, Some(4))
            } else {
                (1 + p * 37 % 300, None)
            });
        }
        // gaps between dense gradients keep the parameters separate runs
        let pool = fake_pool();
        let total: usize = shapes.iter().map(|s| s.0).sum();
        let values = pool.alloc::<f32>(total).unwrap();
        let grads = pool.alloc::<f32>(2 * total).unwrap();
        let mut slots = Vec::new();
        let (mut v, mut g) = (0, 0);
        for &(len, width) in &shapes {
            slots.push(ParamSlot {
                value: values.view().slice(v..v + len).unwrap(),
                grad: grads.view().slice(g..g + len).unwrap(),
                layout: width.map_or(GradLayout::Dense, |width| GradLayout::Rows { width }),
            });
            v += len;
            g += 2 * len;
        }
        let state = State::new(&pool, OptimizerKind::Sgd, &slots).unwrap();
        assert_eq!((state.plan.runs.len(), state.plan.tables.len()), (37, 3));
        let rows = pool.alloc::<u32>(3).unwrap();
        let touched = [
            rows.view().slice(0..1).unwrap(),
            rows.view().slice(1..3).unwrap(),
            rows.view().slice(3..3).unwrap(),
        ];
        let segments = state.plan.segments(&touched).unwrap();
        assert_eq!(segments.len(), 39);
        assert_eq!(
            launch_chunks(&segments, MAX_NORM_BLOCKS).unwrap().0.len(),
            3
        );

        let cfg = config(OptimizerKind::Sgd, 0.5, 0.0, Some(2.0));
        let spec = UpdateKernelSpec::of(&cfg);
        let mut src = host_program(&[("c0".to_string(), spec)]);
        src += "    std::memset(mem, 0, 1 << 20);\n";
        src += &put_cpp(rows.view().device_ptr(), &[7, 2, 11]);
        let mut expected = Vec::new();
        for step in 1..=2u64 {
            let all = random_values(2 * total, 1000 + step);
            src += &put_cpp(grads.view().device_ptr(), &bits(&all));
            src += &norm_cpp("c0", &state, &segments, 2.0);
            src += &update_cpp(
                "c0",
                spec,
                &state,
                &segments,
                &UpdateArgs::for_step(&cfg, step),
            );
            let _ = writeln!(
                src,
                "    dump({}ull, {total});\n    dump({}ull, 2);",
                values.view().device_ptr(),
                state.words.view().device_ptr()
            );
            // the reference: every dense gradient, rows 7 of table 0 and 2
            // and 11 of table 1
            let mut sum = 0.0f64;
            let mut read = Vec::new(); // (value index, grad index)
            let (mut v, mut g, mut table) = (0, 0, 0);
            for &(len, width) in &shapes {
                match width {
                    None => read.extend((0..len).map(|i| (v + i, g + i))),
                    Some(w) => {
                        let picked: &[usize] = [&[7][..], &[2, 11][..], &[][..]][table];
                        for &r in picked {
                            read.extend((0..w).map(|i| (v + r * w + i, g + r * w + i)));
                        }
                        table += 1;
                    }
                }
                v += len;
                g += 2 * len;
            }
            for &(_, gi) in &read {
                sum += f64::from(all[gi]) * f64::from(all[gi]);
            }
            let norm = sum.sqrt();
            let scale = if norm > 2.0 { (2.0 / norm) as f32 } else { 1.0 };
            expected.push((norm, scale, read, all));
        }
        src += "    return 0;\n}\n";
        let Some(output) = run_on_host("chunks", &src) else {
            return;
        };
        let mut lines = output.into_iter();
        let mut now = vec![0.0f32; total];
        for (step, (norm, scale, read, all)) in expected.iter().enumerate() {
            for &(vi, gi) in read {
                now[vi] -= 0.5 * (all[gi] * scale);
            }
            let got: Vec<f32> = lines
                .next()
                .unwrap()
                .into_iter()
                .map(f32::from_bits)
                .collect();
            let words = lines.next().unwrap();
            let got_norm = f64::from_bits(u64::from(words[0]) | (u64::from(words[1]) << 32));
            assert!(
                (got_norm - norm).abs() <= 1e-12 * norm,
                "step {step}: norm {got_norm} vs {norm}"
            );
            assert_eq!(bits(&got), bits(&now), "step {step}");
        }
    }
}
