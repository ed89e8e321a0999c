//! Convolutional-network ops on images stored as rows.
//!
//! A batch of images is a batch of single-vertex graphs: each image is one
//! **vertex row** of width `C*H*W` in CHW order (channel-major, then image
//! rows, then columns), and every op carries the image geometry as
//! attributes. CNNs therefore live in the same IR, autodiff, execution plans
//! and engines as the dynamic models; a static network is simply a vertex
//! function (or head) whose rows are images.
//!
//! Ops (forward, then the ops their gradient builders emit):
//! * [`Conv2d`] — `conv2d(x, w[, bias])`: input rows `[C*H*W]`, weight static
//!   `[O, C*kh*kw]` (or `[O, C, kh, kw]`, PyTorch layout), optional bias
//!   static `[O]` added per output channel; output rows `[O*Ho*Wo]`. Each row
//!   is lowered with im2col to a `[C*kh*kw, Ho*Wo]` matrix and multiplied by
//!   the weight with the crate's GEMM ([`crate::Real::gemm`]); 1x1 stride-1 unpadded
//!   convolutions skip im2col. Rows are split over threads.
//!   * [`Conv2dBackwardInput`] — `col2im(Wᵀ·dY)` per row: `d(input)`.
//!   * [`Conv2dBackwardWeight`] — `Σ_rows dY·im2col(x)ᵀ`: `d(weight)`, a static
//!     `[O, C*kh*kw]` reduced over the rows of a run (like the weight-gradient
//!     GEMMs lazy batching runs once per batch). Partial sums over fixed row
//!     blocks are added in a fixed order, so the result does not depend on
//!     the thread count.
//!   * [`ChannelSum`] — `d(bias)`.
//!
//!   The three conv ops are each other's adjoints, so their own gradients are
//!   conv ops again (second derivatives work).
//! * [`MaxPool2d`] — square window `k`, stride, padding (padded positions
//!   never win; `2 * padding <= k` as in PyTorch); [`MaxPool2dBackward`]
//!   recomputes each window's argmax from the forward input (first maximum in
//!   row-major window order wins ties) and routes the gradient there.
//! * [`GlobalAvgPool`] — rows `[C*H*W]` → rows `[C]`; its gradient
//!   [`GlobalAvgPoolBackward`] spreads each channel's gradient over the
//!   positions (the two are adjoint).
//! * [`ChannelSum`] / [`ChannelBroadcast`] — rows `[C*S]` summed over rows and
//!   the `S` positions into a static `[C]`, and a static `[C]` spread over
//!   positions and rows (per-channel bias add: `add(x, channel_broadcast(b, x))`).
//! * [`BatchNorm`] — training-mode batch normalisation: per-channel mean and
//!   (biased) variance over all rows of the run and all positions, then
//!   `gamma * x̂ + beta`; gradients [`BatchNormBackwardInput`],
//!   [`BatchNormBackwardGamma`] and [`ChannelSum`] (beta). Statistics are
//!   accumulated in f64. With two more inputs, the layer's **running
//!   statistics** (static `[C]` mean and variance, declared as
//!   [`crate::ParamKind::Buffer`]s), it is batch normalisation as PyTorch
//!   keeps it: the training pass still normalises with the batch's
//!   statistics and leaves the running ones out of the gradient, the engine
//!   updates them after every training pass (`ramus_cpu::kernels::update_running_stats`:
//!   momentum [`RUNNING_STATS_MOMENTUM`], unbiased batch variance), and
//!   evaluation and inference passes run [`BatchNormInference`] on them
//!   instead ([`Op::inference_op`](crate::ops::Op::inference_op)).
//! * [`BatchNormInference`] — `gamma * (x - mean) / sqrt(var + eps) + beta`
//!   with given per-channel statistics (static inputs, e.g. running averages
//!   computed outside the graph); rows stay independent. Its gradients
//!   ([`BatchNormInferenceBackwardInput`], [`BatchNormInferenceBackwardParam`],
//!   [`ChannelSum`]) are exact for every input, the statistics included, so
//!   statistics declared as trained parameters would be trained like any
//!   other (running statistics are buffers instead, see [`BatchNorm`]).
//!
//! Batch statistics couple the rows of a run: [`BatchNorm`] and its input
//! gradient declare [`OpDef::couples_rows`], and execution classification
//! rejects them between `gather` and `scatter`, where a batching task sees
//! only some rows (single-vertex graphs run their whole function eagerly,
//! over all rows at once; heads also run over all rows).
//!
//! ReLU, linear layers, dropout, residual adds (`add`) and softmax
//! cross-entropy are the existing ops.

use crate::op::{want_arity, want_float, Cost, OpDef};
use crate::types::ValueType;

mod geom;
pub use geom::{Conv2dGeom, NormGeom, Pool2dGeom};

// ---------------------------------------------------------------- checks

/// `t` is float rows of width `want` (`what` names the operand and the geometry).
fn want_rows(t: &ValueType, want: usize, what: &str) -> std::result::Result<(), String> {
    want_float(t, what)?;
    if !t.is_rows() {
        return Err(format!("{what} must be row values, got {t}"));
    }
    if t.width() != want {
        return Err(format!(
            "{what} has width {} but the geometry needs {want}",
            t.width()
        ));
    }
    Ok(())
}

/// `t` is a static per-channel vector of `c` elements (`[c]`, `[1, c]`, ...).
fn want_channels(t: &ValueType, c: usize, what: &str) -> std::result::Result<(), String> {
    want_float(t, what)?;
    if !t.is_broadcast_row(c) {
        return Err(format!("{what} must be a static [{c}] vector, got {t}"));
    }
    Ok(())
}

fn same_space(a: &ValueType, b: &ValueType) -> std::result::Result<(), String> {
    if a.space != b.space {
        return Err(format!("operands in different spaces: {a} vs {b}"));
    }
    Ok(())
}

/// `dy` is output-gradient rows of width `want` in the space of the forward
/// input `x`.
fn want_grad_rows(x: &ValueType, dy: &ValueType, want: usize) -> std::result::Result<(), String> {
    want_rows(dy, want, "output gradient")?;
    same_space(x, dy)
}

/// Shapes of the batch-norm gradient ops that read the forward input: input
/// rows `[C*S]`, then static `[C]` operands named by `params`, then
/// output-gradient rows `[C*S]` in the input's space.
fn want_norm_grad(
    n: &NormGeom,
    inputs: &[&ValueType],
    params: &[&str],
) -> std::result::Result<(), String> {
    n.validate()?;
    want_arity(inputs, params.len() + 2)?;
    want_rows(inputs[0], n.row_len(), "input")?;
    for (t, what) in inputs[1..].iter().zip(params) {
        want_channels(t, n.channels, what)?;
    }
    want_grad_rows(inputs[0], inputs[params.len() + 1], n.row_len())
}

// ---------------------------------------------------------------- conv2d

/// 2-D convolution of image rows; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2d(pub Conv2dGeom);

impl OpDef for Conv2d {
    fn name(&self) -> &'static str {
        "conv2d"
    }
    fn attrs(&self) -> String {
        self.0.attrs()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        let g = &self.0;
        g.validate()?;
        if inputs.len() != 2 && inputs.len() != 3 {
            return Err(format!(
                "takes 2 or 3 inputs (x, weight[, bias]), got {}",
                inputs.len()
            ));
        }
        want_rows(inputs[0], g.in_len(), &g.input_what())?;
        g.check_weight(inputs[1])?;
        if let Some(b) = inputs.get(2) {
            want_channels(b, g.out_channels, "bias")?;
        }
        Ok(ValueType::rows(inputs[0].space, g.out_len()))
    }
    fn cost(&self, inputs: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        conv_cost(&self.0, inputs.len() == 3, rows)
    }
}

fn conv_cost(g: &Conv2dGeom, bias: bool, rows: usize) -> Cost {
    let per_row = 2 * g.macs() + if bias { g.out_len() } else { 0 };
    let im2col = if g.pointwise() {
        0
    } else {
        2 * g.patch_len() * g.out_h() * g.out_w()
    };
    Cost {
        flops: (rows * per_row) as f64,
        bytes: 4.0
            * (rows * (g.in_len() + g.out_len() + im2col)
                + g.out_channels * g.patch_len()
                + g.out_channels) as f64,
    }
}

/// `d(input)` of [`Conv2d`]: `col2im(Wᵀ · dY)` per row. Inputs: the output
/// gradient rows `[O*Ho*Wo]` and the weight; output rows `[C*H*W]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dBackwardInput(pub Conv2dGeom);

impl OpDef for Conv2dBackwardInput {
    fn name(&self) -> &'static str {
        "conv2d_backward_input"
    }
    fn attrs(&self) -> String {
        self.0.attrs()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        let g = &self.0;
        g.validate()?;
        want_arity(inputs, 2)?;
        want_rows(inputs[0], g.out_len(), "output gradient")?;
        g.check_weight(inputs[1])?;
        Ok(ValueType::rows(inputs[0].space, g.in_len()))
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        conv_cost(&self.0, false, rows)
    }
}

/// `d(weight)` of [`Conv2d`]: `Σ_rows dY · im2col(x)ᵀ`, a static
/// `[O, C*kh*kw]`. Inputs: the forward input rows and the output gradient rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dBackwardWeight(pub Conv2dGeom);

impl OpDef for Conv2dBackwardWeight {
    fn name(&self) -> &'static str {
        "conv2d_backward_weight"
    }
    fn attrs(&self) -> String {
        self.0.attrs()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        let g = &self.0;
        g.validate()?;
        want_arity(inputs, 2)?;
        want_rows(inputs[0], g.in_len(), &g.input_what())?;
        want_grad_rows(inputs[0], inputs[1], g.out_len())?;
        Ok(ValueType::fixed(&[g.out_channels, g.patch_len()]))
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        conv_cost(&self.0, false, rows)
    }
}

// ---------------------------------------------------------------- max pool

/// Max pooling of image rows; see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxPool2d(pub Pool2dGeom);

impl OpDef for MaxPool2d {
    fn name(&self) -> &'static str {
        "max_pool2d"
    }
    fn attrs(&self) -> String {
        self.0.attrs()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        let g = &self.0;
        g.validate()?;
        want_arity(inputs, 1)?;
        want_rows(inputs[0], g.in_len(), &g.input_what())?;
        Ok(ValueType::rows(inputs[0].space, g.out_len()))
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        pool_cost(&self.0, rows)
    }
}

fn pool_cost(g: &Pool2dGeom, rows: usize) -> Cost {
    Cost {
        flops: (rows * g.out_len() * g.kernel * g.kernel) as f64,
        bytes: 4.0 * (rows * (g.in_len() + g.out_len())) as f64,
    }
}

/// Gradient of [`MaxPool2d`]: each output gradient goes to its window's
/// argmax, recomputed from the forward input (first maximum wins ties).
/// Inputs: the forward input rows and the output gradient rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxPool2dBackward(pub Pool2dGeom);

impl OpDef for MaxPool2dBackward {
    fn name(&self) -> &'static str {
        "max_pool2d_backward"
    }
    fn attrs(&self) -> String {
        self.0.attrs()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        let g = &self.0;
        g.validate()?;
        want_arity(inputs, 2)?;
        want_rows(inputs[0], g.in_len(), &g.input_what())?;
        want_grad_rows(inputs[0], inputs[1], g.out_len())?;
        Ok(inputs[0].clone())
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        pool_cost(&self.0, rows)
    }
}

// ---------------------------------------------------------------- global average pool

/// Mean over each channel's positions: rows `[C*H*W]` → rows `[C]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalAvgPool {
    pub channels: usize,
    pub height: usize,
    pub width: usize,
}

impl GlobalAvgPool {
    /// Positions per channel, `H*W`.
    pub fn spatial(&self) -> usize {
        self.height * self.width
    }
    /// Checks that the sizes are positive.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.channels == 0 || self.height == 0 || self.width == 0 {
            return Err(format!(
                "channels, height and width must be positive, got {}x{}x{}",
                self.channels, self.height, self.width
            ));
        }
        Ok(())
    }
    fn sig(&self) -> String {
        format!("{}x{}x{}", self.channels, self.height, self.width)
    }
}

impl OpDef for GlobalAvgPool {
    fn name(&self) -> &'static str {
        "global_avg_pool"
    }
    fn attrs(&self) -> String {
        self.sig()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        self.check()?;
        want_arity(inputs, 1)?;
        want_rows(
            inputs[0],
            self.channels * self.spatial(),
            &format!("input ({} image)", self.sig()),
        )?;
        Ok(ValueType::rows(inputs[0].space, self.channels))
    }
}

/// Gradient of [`GlobalAvgPool`]: rows `[C]` → rows `[C*H*W]`, each
/// channel's value divided by `H*W` at every position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalAvgPoolBackward {
    pub pool: GlobalAvgPool,
}

impl OpDef for GlobalAvgPoolBackward {
    fn name(&self) -> &'static str {
        "global_avg_pool_backward"
    }
    fn attrs(&self) -> String {
        self.pool.sig()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        self.pool.check()?;
        want_arity(inputs, 1)?;
        want_rows(inputs[0], self.pool.channels, "output gradient")?;
        Ok(ValueType::rows(
            inputs[0].space,
            self.pool.channels * self.pool.spatial(),
        ))
    }
}

// ---------------------------------------------------------------- channel sum / broadcast

/// Rows `[C*S]` summed over rows and the `S` positions of each channel into
/// a static `[C]` (bias and beta gradients).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelSum {
    pub channels: usize,
    pub spatial: usize,
}

/// Checks that channels `c` and positions `s` are positive.
pub fn check_cs(c: usize, s: usize) -> std::result::Result<(), String> {
    if c == 0 || s == 0 {
        return Err(format!(
            "channels ({c}) and positions ({s}) must be positive"
        ));
    }
    Ok(())
}

impl OpDef for ChannelSum {
    fn name(&self) -> &'static str {
        "channel_sum"
    }
    fn attrs(&self) -> String {
        format!("C{},S{}", self.channels, self.spatial)
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        check_cs(self.channels, self.spatial)?;
        want_arity(inputs, 1)?;
        want_rows(
            inputs[0],
            self.channels * self.spatial,
            &format!("operand ({} channels x {})", self.channels, self.spatial),
        )?;
        Ok(ValueType::fixed(&[self.channels]))
    }
}

/// A static `[C]` spread over the `S` positions of each channel, for every
/// row of a reference value: rows `[C*S]` in the reference's space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChannelBroadcast {
    pub channels: usize,
    pub spatial: usize,
}

impl OpDef for ChannelBroadcast {
    fn name(&self) -> &'static str {
        "channel_broadcast"
    }
    fn attrs(&self) -> String {
        format!("C{},S{}", self.channels, self.spatial)
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        check_cs(self.channels, self.spatial)?;
        want_arity(inputs, 2)?;
        want_channels(inputs[0], self.channels, "per-channel operand")?;
        if !inputs[1].is_rows() {
            return Err(format!(
                "the reference must be row values, got {}",
                inputs[1]
            ));
        }
        Ok(ValueType::rows(
            inputs[1].space,
            self.channels * self.spatial,
        ))
    }
}

// ---------------------------------------------------------------- batch norm

/// Momentum of batch normalisation's running statistics (PyTorch's
/// default): `running = (1 - momentum)·running + momentum·batch`.
pub const RUNNING_STATS_MOMENTUM: f64 = 0.1;

/// Training-mode batch normalisation; see the module docs. Inputs: rows
/// `[C*S]`, gamma and beta static `[C]`, and optionally the running mean
/// and variance (static `[C]` buffers the output does not depend on).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNorm(pub NormGeom);

impl OpDef for BatchNorm {
    fn name(&self) -> &'static str {
        "batch_norm"
    }
    fn attrs(&self) -> String {
        self.0.attrs()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        let n = &self.0;
        n.validate()?;
        if inputs.len() != 3 && inputs.len() != 5 {
            return Err(format!(
                "takes 3 inputs (x, gamma, beta) or 5 (and the running mean and variance), got {}",
                inputs.len()
            ));
        }
        want_rows(inputs[0], n.row_len(), &n.input_what())?;
        let names = ["gamma", "beta", "running mean", "running variance"];
        for (t, what) in inputs[1..].iter().zip(names) {
            want_channels(t, n.channels, what)?;
        }
        Ok(inputs[0].clone())
    }
    fn couples_rows(&self) -> bool {
        true
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        self.0.cost(rows, 6, 3)
    }
}

/// `d(input)` of [`BatchNorm`]:
/// `gamma·inv/M · (M·dy - Σdy - x̂·Σ(dy·x̂))` per channel, `M` = rows x positions.
/// Inputs: the forward input rows, gamma and the output gradient rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormBackwardInput(pub NormGeom);

impl OpDef for BatchNormBackwardInput {
    fn name(&self) -> &'static str {
        "batch_norm_backward_input"
    }
    fn attrs(&self) -> String {
        self.0.attrs()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_norm_grad(&self.0, inputs, &["gamma"])?;
        Ok(inputs[0].clone())
    }
    fn couples_rows(&self) -> bool {
        true
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        self.0.cost(rows, 12, 5)
    }
}

/// `d(gamma)` of [`BatchNorm`]: `Σ dy·x̂` per channel, a static `[C]`.
/// Inputs: the forward input rows and the output gradient rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormBackwardGamma(pub NormGeom);

impl OpDef for BatchNormBackwardGamma {
    fn name(&self) -> &'static str {
        "batch_norm_backward_gamma"
    }
    fn attrs(&self) -> String {
        self.0.attrs()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_norm_grad(&self.0, inputs, &[])?;
        Ok(ValueType::fixed(&[self.0.channels]))
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        self.0.cost(rows, 8, 2)
    }
}

/// Inference-mode batch normalisation with given statistics:
/// `gamma·(x - mean)/sqrt(var + eps) + beta`. Inputs: rows `[C*S]`, then
/// static `[C]` gamma, beta, mean and var. Rows stay independent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormInference(pub NormGeom);

impl OpDef for BatchNormInference {
    fn name(&self) -> &'static str {
        "batch_norm_inference"
    }
    fn attrs(&self) -> String {
        self.0.attrs()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        let n = &self.0;
        n.validate()?;
        want_arity(inputs, 5)?;
        want_rows(inputs[0], n.row_len(), &n.input_what())?;
        for (t, what) in inputs[1..].iter().zip(["gamma", "beta", "mean", "var"]) {
            want_channels(t, n.channels, what)?;
        }
        Ok(inputs[0].clone())
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        self.0.cost(rows, 2, 2)
    }
}

/// `d(input)` of [`BatchNormInference`]: `dy·gamma/sqrt(var + eps)`.
/// Inputs: gamma, var and the output gradient rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormInferenceBackwardInput(pub NormGeom);

impl OpDef for BatchNormInferenceBackwardInput {
    fn name(&self) -> &'static str {
        "batch_norm_inference_backward_input"
    }
    fn attrs(&self) -> String {
        self.0.attrs()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        let n = &self.0;
        n.validate()?;
        want_arity(inputs, 3)?;
        want_channels(inputs[0], n.channels, "gamma")?;
        want_channels(inputs[1], n.channels, "var")?;
        want_rows(inputs[2], n.row_len(), "output gradient")?;
        Ok(inputs[2].clone())
    }
}

/// Which static input of [`BatchNormInference`] a
/// [`BatchNormInferenceBackwardParam`] differentiates.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NormParam {
    Gamma,
    Mean,
    Var,
}

/// Gradient of [`BatchNormInference`] for gamma, mean or var, a static `[C]`:
/// with `u = Σ dy·(x - mean)` and `v = Σ dy` per channel (over rows and
/// positions), `d gamma = u / sqrt(var + eps)`,
/// `d mean = -gamma·v / sqrt(var + eps)`, `d var = -gamma·u / (2 (var + eps)^1.5)`.
/// Inputs: the forward input rows, gamma, mean, var and the output gradient rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormInferenceBackwardParam {
    pub geom: NormGeom,
    pub param: NormParam,
}

impl OpDef for BatchNormInferenceBackwardParam {
    fn name(&self) -> &'static str {
        match self.param {
            NormParam::Gamma => "batch_norm_inference_backward_gamma",
            NormParam::Mean => "batch_norm_inference_backward_mean",
            NormParam::Var => "batch_norm_inference_backward_var",
        }
    }
    fn attrs(&self) -> String {
        self.geom.attrs()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_norm_grad(&self.geom, inputs, &["gamma", "mean", "var"])?;
        Ok(ValueType::fixed(&[self.geom.channels]))
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        self.geom.cost(rows, 4, 2)
    }
}

// ---------------------------------------------------------------- registry

fn attrs_usize(attrs: &[f64], names: &[&str]) -> std::result::Result<Vec<usize>, String> {
    names
        .iter()
        .enumerate()
        .map(|(i, n)| crate::op::usize_attr(attrs, i, n))
        .collect()
}

/// Optional attribute `i` (`default` when absent).
fn opt_usize(
    a: &[f64],
    i: usize,
    name: &str,
    default: usize,
) -> std::result::Result<usize, String> {
    if a.len() > i {
        crate::op::usize_attr(a, i, name)
    } else {
        Ok(default)
    }
}

pub(crate) fn conv_geom(a: &[f64]) -> std::result::Result<Conv2dGeom, String> {
    let v = attrs_usize(a, &["C", "H", "W", "O", "kh", "kw"])?;
    let g = Conv2dGeom {
        in_channels: v[0],
        height: v[1],
        width: v[2],
        out_channels: v[3],
        kernel_h: v[4],
        kernel_w: v[5],
        stride: opt_usize(a, 6, "stride", 1)?,
        padding: opt_usize(a, 7, "padding", 0)?,
    };
    g.validate()?;
    Ok(g)
}

pub(crate) fn pool_geom(a: &[f64]) -> std::result::Result<Pool2dGeom, String> {
    let v = attrs_usize(a, &["C", "H", "W", "kernel"])?;
    let g = Pool2dGeom {
        channels: v[0],
        height: v[1],
        width: v[2],
        kernel: v[3],
        stride: opt_usize(a, 4, "stride", v[3])?,
        padding: opt_usize(a, 5, "padding", 0)?,
    };
    g.validate()?;
    Ok(g)
}

pub(crate) fn norm_geom(a: &[f64]) -> std::result::Result<NormGeom, String> {
    let v = attrs_usize(a, &["C", "S"])?;
    let eps = if a.len() > 2 { a[2] } else { 1e-5 };
    let g = NormGeom {
        channels: v[0],
        spatial: v[1],
        eps,
    };
    g.validate()?;
    Ok(g)
}

pub(crate) fn global_pool(a: &[f64]) -> std::result::Result<GlobalAvgPool, String> {
    let v = attrs_usize(a, &["C", "H", "W"])?;
    let p = GlobalAvgPool {
        channels: v[0],
        height: v[1],
        width: v[2],
    };
    p.check()?;
    Ok(p)
}

pub(crate) fn cs_attrs(a: &[f64]) -> std::result::Result<(usize, usize), String> {
    let v = attrs_usize(a, &["C", "S"])?;
    check_cs(v[0], v[1])?;
    Ok((v[0], v[1]))
}
