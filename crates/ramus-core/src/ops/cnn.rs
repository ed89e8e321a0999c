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
//!   the weight with the crate's GEMM ([`Real::gemm`]); 1x1 stride-1 unpadded
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
//!   updates them after every training pass ([`update_running_stats`]:
//!   momentum [`RUNNING_STATS_MOMENTUM`], unbiased batch variance), and
//!   evaluation and inference passes run [`BatchNormInference`] on them
//!   instead ([`OpDef::inference_op`]).
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

use crate::error::{CoreError, Result};
use crate::graph::{GraphBuilder, Space, Sym, ValueType};
use crate::op::{want_arity, want_float, Cost, GradCtx, Kernel, KernelCtx, OpDef};
use crate::real::Real;

// ---------------------------------------------------------------- geometry

/// Window positions along one axis: `(size + 2·padding - kernel) / stride + 1`.
fn windows(size: usize, padding: usize, kernel: usize, stride: usize) -> usize {
    (size + 2 * padding).saturating_sub(kernel) / stride.max(1) + 1
}

/// Errs with "NAME must be positive" for the first of `named` that is 0.
fn want_positive(named: &[(&str, usize)]) -> std::result::Result<(), String> {
    match named.iter().find(|(_, v)| *v == 0) {
        Some((name, _)) => Err(format!("{name} must be positive")),
        None => Ok(()),
    }
}

/// Geometry of a 2-D convolution (one stride and padding for both axes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Conv2dGeom {
    pub in_channels: usize,
    pub height: usize,
    pub width: usize,
    pub out_channels: usize,
    pub kernel_h: usize,
    pub kernel_w: usize,
    pub stride: usize,
    pub padding: usize,
}

impl Conv2dGeom {
    /// Checks that every size is positive and the kernel fits the padded image.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let named = [
            ("in channels", self.in_channels),
            ("height", self.height),
            ("width", self.width),
            ("out channels", self.out_channels),
            ("kernel height", self.kernel_h),
            ("kernel width", self.kernel_w),
            ("stride", self.stride),
        ];
        want_positive(&named)?;
        if self.kernel_h > self.height + 2 * self.padding
            || self.kernel_w > self.width + 2 * self.padding
        {
            return Err(format!(
                "kernel {}x{} is larger than the padded image {}x{}",
                self.kernel_h,
                self.kernel_w,
                self.height + 2 * self.padding,
                self.width + 2 * self.padding
            ));
        }
        Ok(())
    }
    /// Output height `(H + 2p - kh) / s + 1`.
    pub fn out_h(&self) -> usize {
        windows(self.height, self.padding, self.kernel_h, self.stride)
    }
    /// Output width `(W + 2p - kw) / s + 1`.
    pub fn out_w(&self) -> usize {
        windows(self.width, self.padding, self.kernel_w, self.stride)
    }
    /// Width of an input row, `C*H*W`.
    pub fn in_len(&self) -> usize {
        self.in_channels * self.height * self.width
    }
    /// Width of an output row, `O*Ho*Wo`.
    pub fn out_len(&self) -> usize {
        self.out_channels * self.out_h() * self.out_w()
    }
    /// Length of one patch (a weight row), `C*kh*kw`.
    pub fn patch_len(&self) -> usize {
        self.in_channels * self.kernel_h * self.kernel_w
    }
    /// True when im2col is the identity (1x1 kernel, stride 1, no padding).
    fn pointwise(&self) -> bool {
        self.kernel_h == 1 && self.kernel_w == 1 && self.stride == 1 && self.padding == 0
    }
    fn attrs(&self) -> String {
        format!(
            "{}x{}x{}->{},k{}x{},s{},p{}",
            self.in_channels,
            self.height,
            self.width,
            self.out_channels,
            self.kernel_h,
            self.kernel_w,
            self.stride,
            self.padding
        )
    }
    /// Names the image input in shape errors.
    fn input_what(&self) -> String {
        format!(
            "input ({}x{}x{} image)",
            self.in_channels, self.height, self.width
        )
    }
    /// Scratch for one image's im2col matrix (empty when im2col is the identity).
    fn cols_buffer<T: Real>(&self) -> Vec<T> {
        if self.pointwise() {
            Vec::new()
        } else {
            vec![T::ZERO; self.patch_len() * self.out_h() * self.out_w()]
        }
    }
    /// One image `x` as the `[C*kh*kw, Ho*Wo]` GEMM operand: `x` itself when
    /// im2col is the identity, otherwise lowered into `cols` (a [`Self::cols_buffer`]).
    fn lowered<'a, T: Real>(&self, x: &'a [T], cols: &'a mut [T]) -> &'a [T] {
        if self.pointwise() {
            x
        } else {
            im2col(self, x, cols);
            cols
        }
    }
    /// Multiply-adds of one row's product.
    fn macs(&self) -> usize {
        self.out_channels * self.patch_len() * self.out_h() * self.out_w()
    }
    /// Checks a weight type: static `[O, C*kh*kw]` or `[O, C, kh, kw]`.
    fn check_weight(&self, w: &ValueType) -> std::result::Result<(), String> {
        want_float(w, "weight")?;
        let flat = [self.out_channels, self.patch_len()];
        let full = [
            self.out_channels,
            self.in_channels,
            self.kernel_h,
            self.kernel_w,
        ];
        if w.space != Space::Static || (w.shape != flat && w.shape != full) {
            return Err(format!(
                "weight must be static {flat:?} (O, C*kh*kw) or {full:?}, got {w}"
            ));
        }
        Ok(())
    }
}

/// Geometry of a 2-D max pooling (square window).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pool2dGeom {
    pub channels: usize,
    pub height: usize,
    pub width: usize,
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
}

impl Pool2dGeom {
    /// Checks sizes; padding may be at most half the window (as in PyTorch),
    /// so every window holds at least one image element.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let named = [
            ("channels", self.channels),
            ("height", self.height),
            ("width", self.width),
            ("kernel", self.kernel),
            ("stride", self.stride),
        ];
        want_positive(&named)?;
        if 2 * self.padding > self.kernel {
            return Err(format!(
                "padding {} exceeds half the window {}",
                self.padding, self.kernel
            ));
        }
        if self.kernel > self.height + 2 * self.padding
            || self.kernel > self.width + 2 * self.padding
        {
            return Err(format!(
                "window {k}x{k} is larger than the padded image {}x{}",
                self.height + 2 * self.padding,
                self.width + 2 * self.padding,
                k = self.kernel
            ));
        }
        Ok(())
    }
    pub fn out_h(&self) -> usize {
        windows(self.height, self.padding, self.kernel, self.stride)
    }
    pub fn out_w(&self) -> usize {
        windows(self.width, self.padding, self.kernel, self.stride)
    }
    /// Width of an input row, `C*H*W`.
    pub fn in_len(&self) -> usize {
        self.channels * self.height * self.width
    }
    /// Width of an output row, `C*Ho*Wo`.
    pub fn out_len(&self) -> usize {
        self.channels * self.out_h() * self.out_w()
    }
    fn attrs(&self) -> String {
        format!(
            "{}x{}x{},k{},s{},p{}",
            self.channels, self.height, self.width, self.kernel, self.stride, self.padding
        )
    }
    /// Names the image input in shape errors.
    fn input_what(&self) -> String {
        format!(
            "input ({}x{}x{} image)",
            self.channels, self.height, self.width
        )
    }
}

/// Attributes of the batch-normalisation ops: channels, positions per
/// channel (`H*W`) and the variance epsilon.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormGeom {
    pub channels: usize,
    pub spatial: usize,
    pub eps: f64,
}

impl NormGeom {
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.channels == 0 || self.spatial == 0 {
            return Err(format!(
                "channels ({}) and positions ({}) must be positive",
                self.channels, self.spatial
            ));
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(format!(
                "eps must be finite and non-negative, got {}",
                self.eps
            ));
        }
        Ok(())
    }
    fn attrs(&self) -> String {
        format!("C{},S{},eps{}", self.channels, self.spatial, self.eps)
    }
    fn len(&self) -> usize {
        self.channels * self.spatial
    }
    /// Names the input rows in the forward ops' shape errors.
    fn input_what(&self) -> String {
        format!("input ({} channels x {})", self.channels, self.spatial)
    }
    /// Cost over `rows` rows: `flops` and `words` (4-byte reads and writes)
    /// per element of a row.
    fn cost(&self, rows: usize, flops: usize, words: usize) -> Cost {
        Cost {
            flops: (flops * rows * self.len()) as f64,
            bytes: 4.0 * (words * rows * self.len()) as f64,
        }
    }
}

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
    want_rows(inputs[0], n.len(), "input")?;
    for (t, what) in inputs[1..].iter().zip(params) {
        want_channels(t, n.channels, what)?;
    }
    want_grad_rows(inputs[0], inputs[params.len() + 1], n.len())
}

/// The float data of argument `i`, checked to hold at least `len` elements.
fn floats<'a, T>(ctx: &KernelCtx<'a, T>, op: &str, i: usize, len: usize) -> Result<&'a [T]> {
    let a = ctx
        .args
        .get(i)
        .ok_or_else(|| CoreError::kernel(op, format!("missing argument {i}")))?;
    let d = a.floats(op)?;
    if d.len() < len {
        return Err(CoreError::kernel(
            op,
            format!("argument {i} holds {} elements, expected {len}", d.len()),
        ));
    }
    Ok(&d[..len])
}

/// Rows of argument `i` (checked against `want` when given).
fn rows_of<T>(ctx: &KernelCtx<'_, T>, op: &str, i: usize, want: Option<usize>) -> Result<usize> {
    let r = ctx
        .args
        .get(i)
        .ok_or_else(|| CoreError::kernel(op, format!("missing argument {i}")))?
        .rows;
    match want {
        Some(w) if w != r => Err(CoreError::kernel(
            op,
            format!("argument {i} has {r} rows, expected {w}"),
        )),
        _ => Ok(r),
    }
}

/// Kernels re-check their attributes (ops built directly skip `infer`).
fn valid(op: &str, r: std::result::Result<(), String>) -> Result<()> {
    r.map_err(|m| CoreError::kernel(op, m))
}

fn check_out<T>(ctx: &KernelCtx<'_, T>, op: &str, len: usize) -> Result<()> {
    if ctx.out.len() != len {
        return Err(CoreError::kernel(
            op,
            format!("output holds {} elements, expected {len}", ctx.out.len()),
        ));
    }
    Ok(())
}

/// Gradient of a gradient op `op` that has none: records "second
/// derivatives of `of` are not supported" on the builder.
fn no_second_derivative(g: &mut GradCtx<'_>, op: &str, of: &str) {
    g.b.fail(op, format!("second derivatives of {of} are not supported"));
}

/// Sets input `i`'s gradient to the static value `s`, reshaped to the
/// input's shape when they differ (a `[1, C]` bias, a 4-D weight).
fn set_static(g: &mut GradCtx<'_>, i: usize, s: Sym) {
    let want = g.input_type(i).map(|t| t.shape).unwrap_or_default();
    let s = match g.b.ty(s) {
        Some(t) if t.shape != want => g.b.reshape(s, &want),
        _ => s,
    };
    g.set(i, s);
}

// ---------------------------------------------------------------- threads

/// Runs `f(scratch, row, out_row)` for each of the `rows` rows of `out`
/// (each `row_len` long), split over threads in contiguous row blocks when
/// `work_per_row * rows` is large enough to pay for it. Each block makes
/// its own `scratch()` once and reuses it for its rows.
fn split_rows<T: Real, S>(
    out: &mut [T],
    row_len: usize,
    rows: usize,
    work_per_row: usize,
    scratch: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, usize, &mut [T]) + Sync,
) {
    let out = &mut out[..rows * row_len];
    if rows == 0 || row_len == 0 {
        return;
    }
    let run_block = |r0: usize, chunk: &mut [T]| {
        let mut sc = scratch();
        for (i, o) in chunk.chunks_mut(row_len).enumerate() {
            f(&mut sc, r0 + i, o);
        }
    };
    let threads = crate::parallel::threads();
    if threads > 1 && rows > 1 && rows.saturating_mul(work_per_row) >= 1 << 16 {
        let block = rows.div_ceil(threads);
        crate::parallel::for_each_chunk_mut(out, block * row_len, |i, c| run_block(i * block, c));
    } else {
        run_block(0, out);
    }
}

// ---------------------------------------------------------------- im2col

/// Lowers one image `x` (`[C, H, W]`) to `cols` (`[C*kh*kw, Ho*Wo]`):
/// row `(c*kh + i)*kw + j` holds input pixel `(c, oy*s + i - p, ox*s + j - p)`
/// for every output position, 0 outside the image.
fn im2col<T: Real>(g: &Conv2dGeom, x: &[T], cols: &mut [T]) {
    let (ho, wo) = (g.out_h(), g.out_w());
    let (h, w, s, p) = (g.height, g.width, g.stride, g.padding);
    let np = ho * wo;
    for c in 0..g.in_channels {
        let img = &x[c * h * w..(c + 1) * h * w];
        for ki in 0..g.kernel_h {
            for kj in 0..g.kernel_w {
                let r = (c * g.kernel_h + ki) * g.kernel_w + kj;
                let row = &mut cols[r * np..(r + 1) * np];
                for oy in 0..ho {
                    let dst = &mut row[oy * wo..(oy + 1) * wo];
                    let iy = oy * s + ki;
                    if iy < p || iy - p >= h {
                        dst.iter_mut().for_each(|v| *v = T::ZERO);
                        continue;
                    }
                    let src = &img[(iy - p) * w..(iy - p + 1) * w];
                    for (ox, d) in dst.iter_mut().enumerate() {
                        let ix = ox * s + kj;
                        *d = if ix < p || ix - p >= w {
                            T::ZERO
                        } else {
                            src[ix - p]
                        };
                    }
                }
            }
        }
    }
}

/// The adjoint of [`im2col`]: adds every column entry back into its pixel
/// of `x` (`x` is overwritten).
fn col2im<T: Real>(g: &Conv2dGeom, cols: &[T], x: &mut [T]) {
    let (ho, wo) = (g.out_h(), g.out_w());
    let (h, w, s, p) = (g.height, g.width, g.stride, g.padding);
    let np = ho * wo;
    x.iter_mut().for_each(|v| *v = T::ZERO);
    for c in 0..g.in_channels {
        let img = &mut x[c * h * w..(c + 1) * h * w];
        for ki in 0..g.kernel_h {
            for kj in 0..g.kernel_w {
                let r = (c * g.kernel_h + ki) * g.kernel_w + kj;
                let row = &cols[r * np..(r + 1) * np];
                for oy in 0..ho {
                    let iy = oy * s + ki;
                    if iy < p || iy - p >= h {
                        continue;
                    }
                    let dst = &mut img[(iy - p) * w..(iy - p + 1) * w];
                    for (ox, &v) in row[oy * wo..(oy + 1) * wo].iter().enumerate() {
                        let ix = ox * s + kj;
                        if ix >= p && ix - p < w {
                            dst[ix - p] += v;
                        }
                    }
                }
            }
        }
    }
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
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let geom = self.0;
        let (x, w, dy) = (g.input(0), g.input(1), g.grad());
        let dx = g.b.conv2d_backward_input(dy, w, geom);
        g.set(0, dx);
        let dw = g.b.conv2d_backward_weight(x, dy, geom);
        set_static(g, 1, dw);
        if g.inputs_len() == 3 {
            let db =
                g.b.channel_sum(dy, geom.out_channels, geom.out_h() * geom.out_w());
            set_static(g, 2, db);
        }
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

impl Kernel for Conv2d {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "conv2d";
        valid(OP, self.0.validate())?;
        let g = self.0;
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        let (np, k, o) = (g.out_h() * g.out_w(), g.patch_len(), g.out_channels);
        let x = floats(ctx, OP, 0, rows * g.in_len())?;
        let w = floats(ctx, OP, 1, o * k)?;
        let bias = if ctx.args.len() > 2 {
            Some(floats(ctx, OP, 2, o)?)
        } else {
            None
        };
        check_out(ctx, OP, rows * g.out_len())?;
        let in_len = g.in_len();
        split_rows(
            ctx.out,
            g.out_len(),
            rows,
            g.macs(),
            || g.cols_buffer(),
            |cols, r, out| {
                let b = g.lowered(&x[r * in_len..(r + 1) * in_len], cols);
                // out [O, P] = W [O, K] · cols [K, P]
                T::gemm(
                    o,
                    k,
                    np,
                    T::ONE,
                    w,
                    (k as isize, 1),
                    b,
                    (np as isize, 1),
                    T::ZERO,
                    out,
                    np as isize,
                );
                if let Some(bias) = bias {
                    for (c, &bv) in out.chunks_mut(np).zip(bias) {
                        c.iter_mut().for_each(|v| *v += bv);
                    }
                }
            },
        );
        Ok(())
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
    fn gradient(&self, g: &mut GradCtx<'_>) {
        // adjoint pair: <G, col2im(Wᵀ dY)> = <conv(G, W), dY> = <dY·im2col(G)ᵀ, W>
        let geom = self.0;
        let (dy, w, gr) = (g.input(0), g.input(1), g.grad());
        let d_dy = g.b.conv2d(gr, w, None, geom);
        g.set(0, d_dy);
        let d_w = g.b.conv2d_backward_weight(gr, dy, geom);
        set_static(g, 1, d_w);
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        conv_cost(&self.0, false, rows)
    }
}

impl Kernel for Conv2dBackwardInput {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "conv2d_backward_input";
        valid(OP, self.0.validate())?;
        let g = self.0;
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        let (np, k, o) = (g.out_h() * g.out_w(), g.patch_len(), g.out_channels);
        let dy = floats(ctx, OP, 0, rows * g.out_len())?;
        let w = floats(ctx, OP, 1, o * k)?;
        check_out(ctx, OP, rows * g.in_len())?;
        let in_len = g.in_len();
        split_rows(
            ctx.out,
            in_len,
            rows,
            g.macs(),
            || g.cols_buffer(),
            |cols, r, dx| {
                let dyr = &dy[r * o * np..(r + 1) * o * np];
                // cols [K, P] = Wᵀ [K, O] · dY [O, P]
                let dst: &mut [T] = if g.pointwise() { dx } else { cols };
                T::gemm(
                    k,
                    o,
                    np,
                    T::ONE,
                    w,
                    (1, k as isize),
                    dyr,
                    (np as isize, 1),
                    T::ZERO,
                    dst,
                    np as isize,
                );
                if !g.pointwise() {
                    col2im(&g, cols, dx);
                }
            },
        );
        Ok(())
    }
}

/// `d(weight)` of [`Conv2d`]: `Σ_rows dY · im2col(x)ᵀ`, a static
/// `[O, C*kh*kw]`. Inputs: the forward input rows and the output gradient rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv2dBackwardWeight(pub Conv2dGeom);

/// Row blocks whose partial weight gradients are summed (a fixed number,
/// so the summation order does not depend on the thread count).
const WEIGHT_GRAD_PARTS: usize = 8;

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
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let geom = self.0;
        let (x, dy, gr) = (g.input(0), g.input(1), g.grad());
        let d_x = g.b.conv2d_backward_input(dy, gr, geom);
        g.set(0, d_x);
        let d_dy = g.b.conv2d(x, gr, None, geom);
        g.set(1, d_dy);
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        conv_cost(&self.0, false, rows)
    }
}

impl Kernel for Conv2dBackwardWeight {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "conv2d_backward_weight";
        valid(OP, self.0.validate())?;
        let g = self.0;
        let rows = rows_of(ctx, OP, 0, None)?;
        rows_of(ctx, OP, 1, Some(rows))?;
        let (np, k, o) = (g.out_h() * g.out_w(), g.patch_len(), g.out_channels);
        let (in_len, out_len) = (g.in_len(), g.out_len());
        let x = floats(ctx, OP, 0, rows * in_len)?;
        let dy = floats(ctx, OP, 1, rows * out_len)?;
        check_out(ctx, OP, o * k)?;
        // dW [O, K] += dY_r [O, P] · cols_rᵀ [P, K] for rows r0..r1
        let accumulate = |r0: usize, r1: usize, dw: &mut [T]| {
            dw.iter_mut().for_each(|v| *v = T::ZERO);
            let mut cols = g.cols_buffer();
            for r in r0..r1 {
                let b = g.lowered(&x[r * in_len..(r + 1) * in_len], &mut cols);
                T::gemm(
                    o,
                    np,
                    k,
                    T::ONE,
                    &dy[r * out_len..(r + 1) * out_len],
                    (np as isize, 1),
                    b,
                    (1, np as isize),
                    T::ONE,
                    dw,
                    k as isize,
                );
            }
        };
        let parts = if rows.saturating_mul(g.macs()) >= 1 << 18 {
            rows.min(WEIGHT_GRAD_PARTS)
        } else {
            1
        };
        if parts <= 1 {
            accumulate(0, rows, ctx.out);
            return Ok(());
        }
        let block = rows.div_ceil(parts);
        let mut partial = vec![T::ZERO; parts * o * k];
        crate::parallel::for_each_chunk_mut(&mut partial, o * k, |i, dw| {
            accumulate((i * block).min(rows), ((i + 1) * block).min(rows), dw)
        });
        ctx.out.copy_from_slice(&partial[..o * k]);
        for p in partial[o * k..].chunks(o * k) {
            for (d, &v) in ctx.out.iter_mut().zip(p) {
                *d += v;
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------- max pool

/// Visits every output position `(c, oy, ox)` of one image with the index
/// (into the image) of its window's first maximum.
fn pool_argmax<T: Real>(g: &Pool2dGeom, x: &[T], mut f: impl FnMut(usize, usize)) {
    let (ho, wo) = (g.out_h(), g.out_w());
    let (h, w, s, p, k) = (g.height, g.width, g.stride, g.padding, g.kernel);
    for c in 0..g.channels {
        let base = c * h * w;
        for oy in 0..ho {
            // window rows iy in [y0, y1) of the image (padding never wins)
            let y0 = (oy * s).saturating_sub(p);
            let y1 = (oy * s + k - p).min(h);
            for ox in 0..wo {
                let x0 = (ox * s).saturating_sub(p);
                let x1 = (ox * s + k - p).min(w);
                let mut best = base + y0 * w + x0;
                let mut best_v = x[best];
                for iy in y0..y1 {
                    for ix in x0..x1 {
                        let i = base + iy * w + ix;
                        if x[i] > best_v {
                            best = i;
                            best_v = x[i];
                        }
                    }
                }
                f((c * ho + oy) * wo + ox, best);
            }
        }
    }
}

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
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let (x, dy) = (g.input(0), g.grad());
        let dx = g.b.max_pool2d_backward(x, dy, self.0);
        g.set(0, dx);
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

impl Kernel for MaxPool2d {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "max_pool2d";
        valid(OP, self.0.validate())?;
        let g = self.0;
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        let (in_len, out_len) = (g.in_len(), g.out_len());
        let x = floats(ctx, OP, 0, rows * in_len)?;
        check_out(ctx, OP, rows * out_len)?;
        let work = out_len * g.kernel * g.kernel;
        split_rows(
            ctx.out,
            out_len,
            rows,
            work,
            || (),
            |_, r, out| {
                let xr = &x[r * in_len..(r + 1) * in_len];
                pool_argmax(&g, xr, |o, a| out[o] = xr[a]);
            },
        );
        Ok(())
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
    fn gradient(&self, g: &mut GradCtx<'_>) {
        no_second_derivative(g, "max_pool2d_backward", "max pooling");
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        pool_cost(&self.0, rows)
    }
}

impl Kernel for MaxPool2dBackward {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "max_pool2d_backward";
        valid(OP, self.0.validate())?;
        let g = self.0;
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        rows_of(ctx, OP, 1, Some(rows))?;
        let (in_len, out_len) = (g.in_len(), g.out_len());
        let x = floats(ctx, OP, 0, rows * in_len)?;
        let dy = floats(ctx, OP, 1, rows * out_len)?;
        check_out(ctx, OP, rows * in_len)?;
        let work = out_len * g.kernel * g.kernel;
        split_rows(
            ctx.out,
            in_len,
            rows,
            work,
            || (),
            |_, r, dx| {
                let (xr, dyr) = (
                    &x[r * in_len..(r + 1) * in_len],
                    &dy[r * out_len..(r + 1) * out_len],
                );
                dx.iter_mut().for_each(|v| *v = T::ZERO);
                pool_argmax(&g, xr, |o, a| dx[a] += dyr[o]);
            },
        );
        Ok(())
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
    fn spatial(&self) -> usize {
        self.height * self.width
    }
    fn check(&self) -> std::result::Result<(), String> {
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
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let dy = g.grad();
        let op = GlobalAvgPoolBackward { pool: *self };
        let dx = g.b.apply(op, &[dy]);
        g.set(0, dx);
    }
}

impl Kernel for GlobalAvgPool {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "global_avg_pool";
        valid(OP, self.check())?;
        let (c, s) = (self.channels, self.spatial());
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        let x = floats(ctx, OP, 0, rows * c * s)?;
        check_out(ctx, OP, rows * c)?;
        let inv = T::ONE / T::from_f64(s as f64);
        for (o, xs) in ctx.out.iter_mut().zip(x.chunks(s)) {
            *o = xs.iter().copied().sum::<T>() * inv;
        }
        Ok(())
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
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let gr = g.grad();
        let d = g.b.apply(self.pool, &[gr]);
        g.set(0, d);
    }
}

impl Kernel for GlobalAvgPoolBackward {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "global_avg_pool_backward";
        valid(OP, self.pool.check())?;
        let (c, s) = (self.pool.channels, self.pool.spatial());
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        let dy = floats(ctx, OP, 0, rows * c)?;
        check_out(ctx, OP, rows * c * s)?;
        let inv = T::ONE / T::from_f64(s as f64);
        for (o, &d) in ctx.out.chunks_mut(s).zip(dy) {
            o.iter_mut().for_each(|v| *v = d * inv);
        }
        Ok(())
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

fn check_cs(c: usize, s: usize) -> std::result::Result<(), String> {
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
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let (x, gr) = (g.input(0), g.grad());
        let d = g.b.channel_broadcast(gr, x, self.channels, self.spatial);
        g.set(0, d);
    }
}

impl Kernel for ChannelSum {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "channel_sum";
        valid(OP, check_cs(self.channels, self.spatial))?;
        let (c, s) = (self.channels, self.spatial);
        let rows = rows_of(ctx, OP, 0, None)?;
        let x = floats(ctx, OP, 0, rows * c * s)?;
        check_out(ctx, OP, c)?;
        let mut acc = vec![0f64; c];
        for row in x.chunks(c * s) {
            for (a, xs) in acc.iter_mut().zip(row.chunks(s)) {
                *a += xs.iter().map(|v| v.to_f64()).sum::<f64>();
            }
        }
        for (o, a) in ctx.out.iter_mut().zip(acc) {
            *o = T::from_f64(a);
        }
        Ok(())
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
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let gr = g.grad();
        let s = g.b.channel_sum(gr, self.channels, self.spatial);
        set_static(g, 0, s);
    }
}

impl Kernel for ChannelBroadcast {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "channel_broadcast";
        valid(OP, check_cs(self.channels, self.spatial))?;
        let (c, s) = (self.channels, self.spatial);
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 1, Some(rows))?;
        let b = floats(ctx, OP, 0, c)?;
        check_out(ctx, OP, rows * c * s)?;
        for row in ctx.out.chunks_mut(c * s) {
            for (o, &v) in row.chunks_mut(s).zip(b) {
                o.iter_mut().for_each(|x| *x = v);
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------- batch norm

/// Per-channel `(mean, biased variance)` over all rows and positions of
/// `x` (two passes in f64). Channels are split over threads for large
/// inputs.
fn channel_moments<T: Real>(n: &NormGeom, x: &[T], rows: usize) -> Vec<(f64, f64)> {
    let (c, s) = (n.channels, n.spatial);
    let count = (rows * s) as f64;
    let mut stats = vec![(0.0, 0.0); c];
    if rows == 0 {
        return stats;
    }
    let stat = |ch: usize| {
        let chan = |r: usize| &x[r * c * s + ch * s..r * c * s + (ch + 1) * s];
        let mean = (0..rows)
            .map(|r| chan(r).iter().map(|v| v.to_f64()).sum::<f64>())
            .sum::<f64>()
            / count;
        let var = (0..rows)
            .map(|r| {
                chan(r)
                    .iter()
                    .map(|v| (v.to_f64() - mean).powi(2))
                    .sum::<f64>()
            })
            .sum::<f64>()
            / count;
        (mean, var)
    };
    let threads = crate::parallel::threads();
    if threads > 1 && c > 1 && rows * c * s >= crate::parallel::min_split_elements() {
        let block = c.div_ceil(threads);
        crate::parallel::for_each_chunk_mut(&mut stats, block, |i, st| {
            for (j, v) in st.iter_mut().enumerate() {
                *v = stat(i * block + j);
            }
        });
    } else {
        stats
            .iter_mut()
            .enumerate()
            .for_each(|(ch, v)| *v = stat(ch));
    }
    stats
}

/// Per-channel `(mean, 1/sqrt(var + eps))` over all rows and positions of
/// `x` (biased variance; see [`channel_moments`]).
fn channel_stats<T: Real>(n: &NormGeom, x: &[T], rows: usize) -> Vec<(f64, f64)> {
    let mut stats = channel_moments(n, x, rows);
    if rows > 0 {
        for st in &mut stats {
            st.1 = 1.0 / (st.1 + n.eps).sqrt();
        }
    }
    stats
}

/// Per-channel `(Σ dy, Σ dy·x̂)` over rows and positions, with
/// `x̂ = (x - mean)·inv` from `stats[ch] = (mean, inv)` (any centre and scale:
/// the inference gradients pass the given means and a scale of 1).
fn channel_grad_sums<T: Real>(
    n: &NormGeom,
    x: &[T],
    dy: &[T],
    rows: usize,
    stats: &[(f64, f64)],
) -> Vec<(f64, f64)> {
    let (c, s) = (n.channels, n.spatial);
    let mut sums = vec![(0.0, 0.0); c];
    for r in 0..rows {
        for (ch, ((sd, sdx), &(mean, inv))) in sums.iter_mut().zip(stats).enumerate() {
            let o = r * c * s + ch * s;
            for (&xv, &d) in x[o..o + s].iter().zip(&dy[o..o + s]) {
                let d = d.to_f64();
                *sd += d;
                *sdx += d * (xv.to_f64() - mean) * inv;
            }
        }
    }
    sums
}

/// Momentum of batch normalisation's running statistics (PyTorch's
/// default): `running = (1 - momentum)·running + momentum·batch`.
pub const RUNNING_STATS_MOMENTUM: f64 = 0.1;

/// One training pass's update of a layer's running statistics: the batch's
/// per-channel mean and variance over `rows` rows of `x` (`[C*S]` each; the
/// variance unbiased, `Σ(x - mean)² / (M - 1)` with `M = rows·S`, or the
/// biased one when `M = 1`) blended into `mean` and `var` with
/// [`RUNNING_STATS_MOMENTUM`], in f64, each result rounded once. Nothing
/// changes for an empty batch. The CUDA kernel computes the same.
pub fn update_running_stats<T: Real>(
    n: &NormGeom,
    x: &[T],
    rows: usize,
    mean: &mut [T],
    var: &mut [T],
) -> Result<()> {
    const OP: &str = "batch_norm running statistics";
    valid(OP, n.validate())?;
    let (c, s) = (n.channels, n.spatial);
    if x.len() != rows * c * s || mean.len() != c || var.len() != c {
        return Err(CoreError::kernel(
            OP,
            format!(
                "{} input values for {rows} rows of {c}x{s}, running statistics of {} and {} channels",
                x.len(),
                mean.len(),
                var.len()
            ),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    let count = rows * s;
    let unbias = if count > 1 {
        count as f64 / (count - 1) as f64
    } else {
        1.0
    };
    let m = RUNNING_STATS_MOMENTUM;
    for ((rm, rv), (batch_mean, batch_var)) in mean
        .iter_mut()
        .zip(var.iter_mut())
        .zip(channel_moments(n, x, rows))
    {
        *rm = T::from_f64((1.0 - m) * rm.to_f64() + m * batch_mean);
        *rv = T::from_f64((1.0 - m) * rv.to_f64() + m * batch_var * unbias);
    }
    Ok(())
}

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
        want_rows(inputs[0], n.len(), &n.input_what())?;
        let names = ["gamma", "beta", "running mean", "running variance"];
        for (t, what) in inputs[1..].iter().zip(names) {
            want_channels(t, n.channels, what)?;
        }
        Ok(inputs[0].clone())
    }
    fn inference_op(&self, arity: usize) -> Option<crate::ops::Op> {
        (arity == 5).then_some(crate::ops::Op::BatchNormInference(BatchNormInference(
            self.0,
        )))
    }
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let n = self.0;
        let (x, gamma, dy) = (g.input(0), g.input(1), g.grad());
        let dx = g.b.apply(BatchNormBackwardInput(n), &[x, gamma, dy]);
        g.set(0, dx);
        let dgamma = g.b.apply(BatchNormBackwardGamma(n), &[x, dy]);
        set_static(g, 1, dgamma);
        let dbeta = g.b.channel_sum(dy, n.channels, n.spatial);
        set_static(g, 2, dbeta);
    }
    fn couples_rows(&self) -> bool {
        true
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        self.0.cost(rows, 6, 3)
    }
}

impl Kernel for BatchNorm {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "batch_norm";
        valid(OP, self.0.validate())?;
        let n = self.0;
        let (c, s) = (n.channels, n.spatial);
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        let x = floats(ctx, OP, 0, rows * c * s)?;
        let gamma = floats(ctx, OP, 1, c)?;
        let beta = floats(ctx, OP, 2, c)?;
        check_out(ctx, OP, rows * c * s)?;
        let stats = channel_stats(&n, x, rows);
        // y = x * a + b per channel, a = gamma * inv, b = beta - mean * a
        let ab: Vec<(T, T)> = stats
            .iter()
            .zip(gamma.iter().zip(beta))
            .map(|(&(mean, inv), (&gm, &bt))| {
                let a = gm.to_f64() * inv;
                (T::from_f64(a), T::from_f64(bt.to_f64() - mean * a))
            })
            .collect();
        channel_affine(ctx.out, x, s, &ab, rows);
        Ok(())
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
    fn gradient(&self, g: &mut GradCtx<'_>) {
        no_second_derivative(g, "batch_norm_backward_input", "batch normalisation");
    }
    fn couples_rows(&self) -> bool {
        true
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        self.0.cost(rows, 12, 5)
    }
}

impl Kernel for BatchNormBackwardInput {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "batch_norm_backward_input";
        valid(OP, self.0.validate())?;
        let n = self.0;
        let (c, s) = (n.channels, n.spatial);
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        rows_of(ctx, OP, 2, Some(rows))?;
        let x = floats(ctx, OP, 0, rows * c * s)?;
        let gamma = floats(ctx, OP, 1, c)?;
        let dy = floats(ctx, OP, 2, rows * c * s)?;
        check_out(ctx, OP, rows * c * s)?;
        let stats = channel_stats(&n, x, rows);
        let sums = channel_grad_sums(&n, x, dy, rows, &stats);
        let m = (rows * s) as f64;
        // dx = k * (dy - sd/M - (x - mean)*inv * sdx/M), k = gamma * inv
        //    = k*dy + (x*q + p) with q = -k*inv*sdx/M, p = -k*sd/M - mean*q
        let coef: Vec<(T, T, T)> = stats
            .iter()
            .zip(&sums)
            .zip(gamma)
            .map(|((&(mean, inv), &(sd, sdx)), &gm)| {
                let k = gm.to_f64() * inv;
                let q = -k * inv * sdx / m;
                let p = -k * sd / m - mean * q;
                (T::from_f64(k), T::from_f64(q), T::from_f64(p))
            })
            .collect();
        split_rows(
            ctx.out,
            c * s,
            rows,
            c * s,
            || (),
            |_, r, out| {
                let o0 = r * c * s;
                let (xr, dyr) = (&x[o0..o0 + c * s], &dy[o0..o0 + c * s]);
                for (((o, xs), ds), &(k, q, p)) in out
                    .chunks_mut(s)
                    .zip(xr.chunks(s))
                    .zip(dyr.chunks(s))
                    .zip(&coef)
                {
                    for ((o, &xv), &d) in o.iter_mut().zip(xs).zip(ds) {
                        *o = k * d + xv * q + p;
                    }
                }
            },
        );
        Ok(())
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
    fn gradient(&self, g: &mut GradCtx<'_>) {
        no_second_derivative(g, "batch_norm_backward_gamma", "batch normalisation");
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        self.0.cost(rows, 8, 2)
    }
}

impl Kernel for BatchNormBackwardGamma {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "batch_norm_backward_gamma";
        valid(OP, self.0.validate())?;
        let n = self.0;
        let rows = rows_of(ctx, OP, 0, None)?;
        rows_of(ctx, OP, 1, Some(rows))?;
        let x = floats(ctx, OP, 0, rows * n.len())?;
        let dy = floats(ctx, OP, 1, rows * n.len())?;
        check_out(ctx, OP, n.channels)?;
        let stats = channel_stats(&n, x, rows);
        let sums = channel_grad_sums(&n, x, dy, rows, &stats);
        for (o, &(_, sdx)) in ctx.out.iter_mut().zip(&sums) {
            *o = T::from_f64(sdx);
        }
        Ok(())
    }
}

/// Inference-mode batch normalisation with given statistics:
/// `gamma·(x - mean)/sqrt(var + eps) + beta`. Inputs: rows `[C*S]`, then
/// static `[C]` gamma, beta, mean and var. Rows stay independent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchNormInference(pub NormGeom);

/// Per-channel `(scale, shift)` with `y = x·scale + shift`, checking the variances.
fn inference_affine<T: Real>(
    op: &str,
    n: &NormGeom,
    gamma: &[T],
    beta: Option<&[T]>,
    mean: &[T],
    var: &[T],
) -> Result<Vec<(T, T)>> {
    (0..n.channels)
        .map(|ch| {
            let v = var[ch].to_f64() + n.eps;
            if v.is_nan() || v <= 0.0 {
                return Err(CoreError::kernel(
                    op,
                    format!(
                        "variance {} of channel {ch} plus eps is not positive",
                        var[ch].to_f64()
                    ),
                ));
            }
            let a = gamma[ch].to_f64() / v.sqrt();
            let b = beta.map(|b| b[ch].to_f64()).unwrap_or(0.0) - mean[ch].to_f64() * a;
            Ok((T::from_f64(a), T::from_f64(b)))
        })
        .collect()
}

/// `out = x·a + b` per channel (`ab[ch] = (a, b)`) over `rows` rows of
/// `[C*s]`, rows split over threads.
fn channel_affine<T: Real>(out: &mut [T], x: &[T], s: usize, ab: &[(T, T)], rows: usize) {
    let len = s * ab.len();
    split_rows(
        out,
        len,
        rows,
        len,
        || (),
        |_, r, o| {
            let xr = &x[r * len..(r + 1) * len];
            for ((o, xs), &(a, b)) in o.chunks_mut(s).zip(xr.chunks(s)).zip(ab) {
                for (o, &v) in o.iter_mut().zip(xs) {
                    *o = v * a + b;
                }
            }
        },
    );
}

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
        want_rows(inputs[0], n.len(), &n.input_what())?;
        for (t, what) in inputs[1..].iter().zip(["gamma", "beta", "mean", "var"]) {
            want_channels(t, n.channels, what)?;
        }
        Ok(inputs[0].clone())
    }
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let n = self.0;
        let (x, gamma, mean, var, dy) = (g.input(0), g.input(1), g.input(3), g.input(4), g.grad());
        let dx =
            g.b.apply(BatchNormInferenceBackwardInput(n), &[gamma, var, dy]);
        g.set(0, dx);
        let dbeta = g.b.channel_sum(dy, n.channels, n.spatial);
        set_static(g, 2, dbeta);
        for (i, param) in [
            (1, NormParam::Gamma),
            (3, NormParam::Mean),
            (4, NormParam::Var),
        ] {
            let op = BatchNormInferenceBackwardParam { geom: n, param };
            let d = g.b.apply(op, &[x, gamma, mean, var, dy]);
            set_static(g, i, d);
        }
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        self.0.cost(rows, 2, 2)
    }
}

impl Kernel for BatchNormInference {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "batch_norm_inference";
        valid(OP, self.0.validate())?;
        let n = self.0;
        let (c, s) = (n.channels, n.spatial);
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        let x = floats(ctx, OP, 0, rows * c * s)?;
        let (gamma, beta) = (floats(ctx, OP, 1, c)?, floats(ctx, OP, 2, c)?);
        let (mean, var) = (floats(ctx, OP, 3, c)?, floats(ctx, OP, 4, c)?);
        check_out(ctx, OP, rows * c * s)?;
        let ab = inference_affine(OP, &n, gamma, Some(beta), mean, var)?;
        channel_affine(ctx.out, x, s, &ab, rows);
        Ok(())
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
        want_rows(inputs[2], n.len(), "output gradient")?;
        Ok(inputs[2].clone())
    }
    fn gradient(&self, g: &mut GradCtx<'_>) {
        no_second_derivative(
            g,
            "batch_norm_inference_backward_input",
            "batch normalisation",
        );
    }
}

impl Kernel for BatchNormInferenceBackwardInput {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "batch_norm_inference_backward_input";
        valid(OP, self.0.validate())?;
        let n = self.0;
        let (c, s) = (n.channels, n.spatial);
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 2, Some(rows))?;
        let (gamma, var) = (floats(ctx, OP, 0, c)?, floats(ctx, OP, 1, c)?);
        let dy = floats(ctx, OP, 2, rows * c * s)?;
        check_out(ctx, OP, rows * c * s)?;
        let zeros = vec![T::ZERO; c];
        let ab = inference_affine(OP, &n, gamma, None, &zeros, var)?;
        channel_affine(ctx.out, dy, s, &ab, rows);
        Ok(())
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
    fn gradient(&self, g: &mut GradCtx<'_>) {
        no_second_derivative(g, self.name(), "batch normalisation");
    }
    fn cost(&self, _: &[&ValueType], _: &ValueType, rows: usize) -> Cost {
        self.geom.cost(rows, 4, 2)
    }
}

impl Kernel for BatchNormInferenceBackwardParam {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let op = self.name();
        valid(op, self.geom.validate())?;
        let n = self.geom;
        let (c, s) = (n.channels, n.spatial);
        let rows = rows_of(ctx, op, 0, None)?;
        rows_of(ctx, op, 4, Some(rows))?;
        let x = floats(ctx, op, 0, rows * c * s)?;
        let gamma = floats(ctx, op, 1, c)?;
        let (mean, var) = (floats(ctx, op, 2, c)?, floats(ctx, op, 3, c)?);
        let dy = floats(ctx, op, 4, rows * c * s)?;
        check_out(ctx, op, c)?;
        // validates the variances
        inference_affine(op, &n, gamma, None, mean, var)?;
        // (v, u) = (Σ dy, Σ dy·(x - mean)): unit scale in channel_grad_sums
        let centre: Vec<(f64, f64)> = mean.iter().map(|m| (m.to_f64(), 1.0)).collect();
        let sums = channel_grad_sums(&n, x, dy, rows, &centre);
        for (ch, (o, &(v, u))) in ctx.out.iter_mut().zip(&sums).enumerate() {
            let ve = var[ch].to_f64() + n.eps;
            let gm = gamma[ch].to_f64();
            *o = T::from_f64(match self.param {
                NormParam::Gamma => u / ve.sqrt(),
                NormParam::Mean => -gm * v / ve.sqrt(),
                NormParam::Var => -0.5 * gm * u / (ve * ve.sqrt()),
            });
        }
        Ok(())
    }
}

// ---------------------------------------------------------------- builder methods

/// Builder methods for the CNN ops.
impl GraphBuilder {
    /// 2-D convolution of image rows `[C*H*W]` with a weight `[O, C*kh*kw]`
    /// (or `[O, C, kh, kw]`) and an optional per-channel bias `[O]`.
    pub fn conv2d(&mut self, x: Sym, w: Sym, bias: Option<Sym>, geom: Conv2dGeom) -> Sym {
        let op = Conv2d(geom);
        match bias {
            Some(b) => self.apply(op, &[x, w, b]),
            None => self.apply(op, &[x, w]),
        }
    }
    /// `d(input)` of [`Conv2d`] from the output gradient rows and the weight.
    pub fn conv2d_backward_input(&mut self, dy: Sym, w: Sym, geom: Conv2dGeom) -> Sym {
        self.apply(Conv2dBackwardInput(geom), &[dy, w])
    }
    /// `d(weight)` of [`Conv2d`] (a static `[O, C*kh*kw]`, summed over rows).
    pub fn conv2d_backward_weight(&mut self, x: Sym, dy: Sym, geom: Conv2dGeom) -> Sym {
        self.apply(Conv2dBackwardWeight(geom), &[x, dy])
    }
    /// Max pooling of image rows.
    pub fn max_pool2d(&mut self, x: Sym, geom: Pool2dGeom) -> Sym {
        self.apply(MaxPool2d(geom), &[x])
    }
    /// Gradient of [`MaxPool2d`] from the forward input and the output gradient.
    pub fn max_pool2d_backward(&mut self, x: Sym, dy: Sym, geom: Pool2dGeom) -> Sym {
        self.apply(MaxPool2dBackward(geom), &[x, dy])
    }
    /// Per-channel mean over positions: rows `[C*H*W]` → rows `[C]`.
    pub fn global_avg_pool(&mut self, x: Sym, channels: usize, height: usize, width: usize) -> Sym {
        let op = GlobalAvgPool {
            channels,
            height,
            width,
        };
        self.apply(op, &[x])
    }
    /// Sum over rows and positions per channel: rows `[C*S]` → static `[C]`.
    pub fn channel_sum(&mut self, x: Sym, channels: usize, spatial: usize) -> Sym {
        self.apply(ChannelSum { channels, spatial }, &[x])
    }
    /// A static `[C]` spread over positions and over the rows of `like`.
    pub fn channel_broadcast(&mut self, s: Sym, like: Sym, channels: usize, spatial: usize) -> Sym {
        self.apply(ChannelBroadcast { channels, spatial }, &[s, like])
    }
    /// Training-mode batch normalisation over all rows of the run (see the
    /// module docs for where it may be used).
    pub fn batch_norm(&mut self, x: Sym, gamma: Sym, beta: Sym, geom: NormGeom) -> Sym {
        self.apply(BatchNorm(geom), &[x, gamma, beta])
    }
    /// Training-mode batch normalisation that keeps running statistics
    /// `running = (mean, var)` (buffers the engines update after each
    /// training pass; evaluation normalises with them). See [`BatchNorm`].
    pub fn batch_norm_tracked(
        &mut self,
        x: Sym,
        gamma: Sym,
        beta: Sym,
        running: (Sym, Sym),
        geom: NormGeom,
    ) -> Sym {
        self.apply(BatchNorm(geom), &[x, gamma, beta, running.0, running.1])
    }
    /// Batch normalisation with given per-channel statistics `stats = (mean, var)`.
    pub fn batch_norm_inference(
        &mut self,
        x: Sym,
        gamma: Sym,
        beta: Sym,
        stats: (Sym, Sym),
        geom: NormGeom,
    ) -> Sym {
        self.apply(
            BatchNormInference(geom),
            &[x, gamma, beta, stats.0, stats.1],
        )
    }
}

// ---------------------------------------------------------------- registry

fn attrs_usize(attrs: &[f64], names: &[&str]) -> std::result::Result<Vec<usize>, String> {
    names
        .iter()
        .enumerate()
        .map(|(i, n)| super::usize_attr(attrs, i, n))
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
        super::usize_attr(a, i, name)
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
