//! The CNN ops of `ramus_core::ops::cnn` on the device: convolutions as
//! im2col / col2im kernels around cuBLAS products, pooling, per-channel
//! reductions and batch normalisation as built-in kernels
//! (`launch/cnn.rs`). Images are rows of `C*H*W` floats (CHW order).
//!
//! The products, per convolution with `K = C*kh*kw` patch rows, `P = Ho*Wo`
//! output positions and `O` output channels:
//!
//! * forward — every image's output `[O, P]` is `W [O, K] · cols [K, P]`:
//!   one **strided-batched** GEMM over the images (the weight shared with
//!   stride 0) writes each image's output rows in place, so the result needs
//!   no transposition; a bias is broadcast into the output first and the
//!   product adds to it (`beta = 1`). A 1x1 stride-1 unpadded convolution
//!   reads the image itself as its columns (no im2col).
//! * input gradient — `cols = Wᵀ · dY` per image (strided-batched again),
//!   then col2im gathers each pixel's entries (no atomics); pointwise
//!   convolutions write `Wᵀ · dY` straight into the gradient.
//! * weight gradient — **one** GEMM over all images' columns:
//!   `dW [O, K] = dYᵀ-rows [O, N·P] · colsᵀ [N·P, K]`, with im2col laying the
//!   `N` images' columns side by side (`[K, N·P]`) and the same kernel with a
//!   1x1 geometry rearranging `dY` to `[O, N·P]`. A single long-`k` product
//!   keeps cuBLAS busy and sums over images inside the product instead of
//!   through `N` accumulating launches.
//!
//! Columns live in the lane's workspace (from the batch arena, reused by
//! every op of the lane). When a convolution's columns for all images exceed
//! [`CudaEngineOptions::conv_workspace`](super::CudaEngineOptions) floats,
//! it runs over chunks of images (the weight gradient accumulating with
//! `beta = 1` after the first chunk).

use ramus_core::graph::{Graph, NodeId, Space};
use ramus_core::ops::{
    BatchNorm, BatchNormBackwardGamma, BatchNormBackwardInput, BatchNormInference,
    BatchNormInferenceBackwardInput, Conv2d, Conv2dBackwardInput, Conv2dBackwardWeight, Conv2dGeom,
    MaxPool2d, MaxPool2dBackward, NormGeom, Op,
};
use ramus_core::OpDef;
use ramus_exec::Range;

use super::{model_err, Buf, CudaEngine, GraphBufs, Lane};
use crate::blas::{Gemm, StridedBatch};
use crate::error::Result;
use crate::launch::{BatchNormOperands, ChannelShape, ColumnLayout, NormGradOperands, NormStats};
use crate::pool::DeviceView;

/// Whether im2col is the identity (1x1 kernel, stride 1, no padding).
fn pointwise(g: &Conv2dGeom) -> bool {
    g.kernel_h == 1 && g.kernel_w == 1 && g.stride == 1 && g.padding == 0
}

/// The 1x1 geometry under which im2col rearranges rows of `[channels,
/// positions]` into one `[channels, images·positions]` matrix.
fn rows_to_columns(channels: usize, positions: usize) -> Conv2dGeom {
    Conv2dGeom {
        in_channels: channels,
        height: 1,
        width: positions,
        out_channels: channels,
        kernel_h: 1,
        kernel_w: 1,
        stride: 1,
        padding: 0,
    }
}

/// A convolution's `(K, P, O)`: patch rows, output positions per image and
/// output channels.
fn conv_dims(g: &Conv2dGeom) -> (usize, usize, usize) {
    (g.patch_len(), g.out_h() * g.out_w(), g.out_channels)
}

/// Images per chunk of `rows` when each needs `per_image` floats of
/// columns and a convolution's columns are capped at `cap` floats (at least
/// one image per chunk).
fn chunk_images(cap: usize, per_image: usize, rows: usize) -> usize {
    (cap / per_image.max(1)).clamp(1, rows.max(1))
}

/// Floats of lane workspace that CNN op `op` asks for over `rows` rows with
/// convolution columns capped at `cap` floats (0 for other ops): what
/// [`CudaEngine::run_cnn_op`] requests, so a caller can reserve it up front.
pub(crate) fn cnn_workspace_floats(op: &Op, rows: usize, cap: usize) -> usize {
    let columns = |per_image: usize| chunk_images(cap, per_image, rows) * per_image;
    if rows == 0 {
        return 0;
    }
    match op {
        Op::Conv2d(Conv2d(g)) | Op::Conv2dBackwardInput(Conv2dBackwardInput(g)) => {
            let (k, p, _) = conv_dims(g);
            if pointwise(g) {
                0
            } else {
                columns(k * p)
            }
        }
        Op::Conv2dBackwardWeight(Conv2dBackwardWeight(g)) => {
            let (k, p, o) = conv_dims(g);
            columns((k + o) * p)
        }
        Op::BatchNorm(BatchNorm(n))
        | Op::BatchNormInference(BatchNormInference(n))
        | Op::BatchNormInferenceBackwardInput(BatchNormInferenceBackwardInput(n)) => 2 * n.channels,
        Op::BatchNormBackwardInput(BatchNormBackwardInput(n)) => 3 * n.channels,
        _ => 0,
    }
}

/// What an image op reads: its node, its buffers and the rows of this run.
pub(super) struct CnnArgs<'a> {
    pub(super) g: &'a Graph,
    pub(super) n: NodeId,
    own: &'a [Buf],
    fwd: Option<&'a [Buf]>,
    range: Range,
    pub(super) lane: &'a Lane,
}

impl CnnArgs<'_> {
    /// The node's input `i`.
    pub(super) fn arg(&self, i: usize) -> NodeId {
        self.g.nodes[self.n].inputs[i]
    }

    /// The number of inputs of the node.
    fn arity(&self) -> usize {
        self.g.nodes[self.n].inputs.len()
    }

    /// Rows of input `i` in this run.
    fn rows(&self, i: usize) -> usize {
        let space: Space = self.g.nodes[self.arg(i)].ty.space;
        let (lo, hi) = self.range.span(space);
        hi - lo
    }

    /// The rows of input `i` as images of `channels` channels of `spatial`
    /// positions.
    fn channel_shape(&self, i: usize, channels: usize, spatial: usize) -> ChannelShape {
        ChannelShape {
            rows: self.rows(i),
            channels,
            spatial,
        }
    }
}

impl CudaEngine {
    /// Input `i` of the image op in `a`, as floats of this run's rows.
    fn cnn_in(&self, a: &CnnArgs<'_>, i: usize) -> Result<DeviceView<f32>> {
        self.float_view(a.g, a.arg(i), a.own, a.fwd, a.range)
    }

    /// The output of the image op in `a`, as floats of this run's rows.
    fn cnn_out(&self, a: &CnnArgs<'_>) -> Result<DeviceView<f32>> {
        self.float_view(a.g, a.n, a.own, a.fwd, a.range)
    }

    /// Batch normalisation once its coefficients are in `coef`: `y` is `x`
    /// (r rows) scaled and shifted per channel.
    fn norm_affine(
        &self,
        a: &CnnArgs<'_>,
        [y, x, coef]: [DeviceView<f32>; 3],
        r: usize,
        norm: &NormGeom,
    ) -> Result<()> {
        let stream = &*a.lane.stream;
        let shape = ChannelShape {
            rows: r,
            channels: norm.channels,
            spatial: norm.spatial,
        };
        (self.launcher).channel_affine(stream, y, x, coef, shape)
    }

    /// Runs node `n`, an image op (`ramus_core::image_op!()`); any other
    /// op is refused with the node named.
    pub(super) fn run_cnn_op(
        &self,
        op: &Op,
        bufs: GraphBufs<'_>,
        n: NodeId,
        range: Range,
        lane: &Lane,
    ) -> Result<()> {
        let GraphBufs { g, own, fwd } = bufs;
        let a = &CnnArgs {
            g,
            n,
            own,
            fwd,
            range,
            lane,
        };
        let stream = &*lane.stream;
        let launcher = &self.launcher;
        let fv = |i: usize| self.cnn_in(a, i);
        let out = || self.cnn_out(a);
        let rows = |i: usize| a.rows(i);
        let shape =
            |i: usize, channels: usize, spatial: usize| a.channel_shape(i, channels, spatial);
        match op {
            Op::Conv2d(Conv2d(geom)) => {
                let bias = if a.arity() > 2 { Some(fv(2)?) } else { None };
                self.conv2d(lane, geom, rows(0), [fv(0)?, fv(1)?], bias, out()?)
            }
            Op::Conv2dBackwardInput(Conv2dBackwardInput(geom)) => {
                self.conv2d_backward_input(lane, geom, rows(0), fv(0)?, fv(1)?, out()?)
            }
            Op::Conv2dBackwardWeight(Conv2dBackwardWeight(geom)) => {
                self.conv2d_backward_weight(lane, geom, rows(0), fv(0)?, fv(1)?, out()?)
            }
            Op::MaxPool2d(MaxPool2d(geom)) => {
                launcher.max_pool2d(stream, out()?, fv(0)?, geom, rows(0))
            }
            Op::MaxPool2dBackward(MaxPool2dBackward(geom)) => {
                launcher.max_pool2d_backward(stream, out()?, fv(0)?, fv(1)?, geom, rows(0))
            }
            Op::GlobalAvgPool(p) => {
                let spatial = p.height * p.width;
                launcher.global_avg_pool(stream, out()?, fv(0)?, shape(0, p.channels, spatial))
            }
            Op::GlobalAvgPoolBackward(b) => {
                let p = &b.pool;
                let (x, spatial) = (fv(0)?, p.height * p.width);
                let shape = shape(0, p.channels, spatial);
                launcher.global_avg_pool_backward(stream, out()?, x, shape)
            }
            Op::ChannelSum(cs) => {
                let shape = shape(0, cs.channels, cs.spatial);
                launcher.channel_sum(stream, out()?, fv(0)?, shape)
            }
            // rows of the reference operand
            Op::ChannelBroadcast(cb) => {
                let x = fv(0)?;
                let shape = shape(1, cb.channels, cb.spatial);
                launcher.channel_broadcast(stream, out()?, x, shape)
            }
            Op::BatchNorm(BatchNorm(norm)) => self.batch_norm(a, norm),
            Op::BatchNormBackwardInput(BatchNormBackwardInput(norm)) => {
                self.batch_norm_backward_input(a, norm)
            }
            Op::BatchNormBackwardGamma(BatchNormBackwardGamma(norm)) => {
                let views = (out()?, fv(0)?, fv(1)?);
                self.batch_norm_backward_gamma(a, norm, views, rows(0))
            }
            Op::BatchNormInference(BatchNormInference(norm)) => self.batch_norm_inference(a, norm),
            Op::BatchNormInferenceBackwardInput(BatchNormInferenceBackwardInput(norm)) => {
                self.batch_norm_inference_backward_input(a, norm)
            }
            Op::BatchNormInferenceBackwardParam(p) => {
                // inputs: x, gamma, mean, var, dy
                let xs = [fv(0)?, fv(1)?, fv(2)?, fv(3)?, fv(4)?];
                launcher.batch_norm_inference_param(stream, out()?, xs, rows(0), &p.geom, p.param)
            }
            ramus_core::elementwise_op!()
            | Op::MatMul(_)
            | Op::RowMatMul(_)
            | Op::Concat(_)
            | Op::Slice(_)
            | Op::Pad(_)
            | Op::SumChildren(_)
            | Op::ExpandChildren(_)
            | Op::SumRows(_)
            | Op::BroadcastRows(_)
            | Op::Reshape(_)
            | Op::Embedding(_)
            | Op::EmbeddingUnk(_)
            | Op::EmbeddingUnkBackward(_)
            | Op::SoftmaxXent(_)
            | Op::SoftmaxXentBackward(_) => Err(model_err(format!(
                "op `{}` (node %{n}) is not an image op",
                op.signature()
            ))),
        }
    }

    /// Batch normalisation (inputs: x, gamma, beta[, running mean, running
    /// var]): with the running statistics in evaluation and inference, with
    /// the batch's in training (blended into the running ones during device
    /// training steps).
    fn batch_norm(&self, a: &CnnArgs<'_>, norm: &NormGeom) -> Result<()> {
        let (stream, launcher) = (&*a.lane.stream, &self.launcher);
        let (x, r) = (self.cnn_in(a, 0)?, a.rows(0));
        if r == 0 {
            return Ok(());
        }
        let tracked = a.arity() == 5;
        let coef = self.workspace(a.lane, 2 * norm.channels)?;
        let (gamma, beta) = (self.cnn_in(a, 1)?, self.cnn_in(a, 2)?);
        if tracked && self.inference_pass {
            let (mean, var) = (self.cnn_in(a, 3)?, self.cnn_in(a, 4)?);
            let stats = NormStats {
                gamma,
                beta: Some(beta),
                mean: Some(mean),
                var,
            };
            launcher.batch_norm_inference_coef(stream, coef, stats, norm)?;
        } else {
            let running = if tracked && self.track_running_stats {
                Some((self.cnn_in(a, 3)?, self.cnn_in(a, 4)?))
            } else {
                None
            };
            let operands = BatchNormOperands {
                x,
                gamma,
                beta,
                running,
            };
            if self.norm_synced() {
                self.batch_norm_synced(a, norm, operands, (coef, r))?;
            } else {
                launcher.batch_norm_coef(stream, coef, operands, r, norm)?;
            }
        }
        self.norm_affine(a, [self.cnn_out(a)?, x, coef], r, norm)
    }

    /// The input gradient of training batch normalisation (inputs: x,
    /// gamma, dy).
    fn batch_norm_backward_input(&self, a: &CnnArgs<'_>, norm: &NormGeom) -> Result<()> {
        let r = a.rows(0);
        if r == 0 {
            return Ok(());
        }
        let coef = self.workspace(a.lane, 3 * norm.channels)?;
        let operands = NormGradOperands {
            x: self.cnn_in(a, 0)?,
            gamma: self.cnn_in(a, 1)?,
            dy: self.cnn_in(a, 2)?,
        };
        let dx = self.cnn_out(a)?;
        if self.norm_synced() {
            return self.batch_norm_backward_input_synced(a, norm, operands, (dx, coef, r));
        }
        (self.launcher).batch_norm_backward_input(&a.lane.stream, dx, operands, coef, r, norm)
    }

    /// Gamma's gradient of training batch normalisation (inputs: x, dy).
    fn batch_norm_backward_gamma(
        &self,
        a: &CnnArgs<'_>,
        norm: &NormGeom,
        (out, x, dy): (DeviceView<f32>, DeviceView<f32>, DeviceView<f32>),
        r: usize,
    ) -> Result<()> {
        if self.norm_synced() {
            return self.batch_norm_backward_gamma_synced(a, norm, (out, x, dy), r);
        }
        (self.launcher).batch_norm_backward_gamma(&a.lane.stream, out, x, dy, r, norm)
    }

    /// Batch normalisation with given statistics (inputs: x, gamma, beta,
    /// mean, var).
    fn batch_norm_inference(&self, a: &CnnArgs<'_>, norm: &NormGeom) -> Result<()> {
        let (x, r) = (self.cnn_in(a, 0)?, a.rows(0));
        if r == 0 {
            return Ok(());
        }
        let coef = self.workspace(a.lane, 2 * norm.channels)?;
        let [gamma, beta, mean, var] = [1, 2, 3, 4].map(|i| self.cnn_in(a, i));
        let stats = NormStats {
            gamma: gamma?,
            beta: Some(beta?),
            mean: Some(mean?),
            var: var?,
        };
        (self.launcher).batch_norm_inference_coef(&a.lane.stream, coef, stats, norm)?;
        self.norm_affine(a, [self.cnn_out(a)?, x, coef], r, norm)
    }

    /// The input gradient of [`Self::batch_norm_inference`] (inputs: gamma,
    /// var, dy): dx = dy · gamma / sqrt(var + eps).
    fn batch_norm_inference_backward_input(&self, a: &CnnArgs<'_>, norm: &NormGeom) -> Result<()> {
        let r = a.rows(2);
        if r == 0 {
            return Ok(());
        }
        let coef = self.workspace(a.lane, 2 * norm.channels)?;
        let (gamma, var) = (self.cnn_in(a, 0)?, self.cnn_in(a, 1)?);
        let stats = NormStats {
            gamma,
            beta: None,
            mean: None,
            var,
        };
        (self.launcher).batch_norm_inference_coef(&a.lane.stream, coef, stats, norm)?;
        self.norm_affine(a, [self.cnn_out(a)?, self.cnn_in(a, 2)?, coef], r, norm)
    }

    /// `len` floats of `lane`'s scratch memory, valid until the next op on
    /// the lane asks for some (ops on one stream run in order). Grows from
    /// the batch arena, at least doubling (up to the convolution cap), so a
    /// batch allocates it a few times at most.
    fn workspace(&self, lane: &Lane, len: usize) -> Result<DeviceView<f32>> {
        let old = lane.workspace.get();
        if let Some(ws) = old.filter(|ws| ws.len() >= len) {
            return ws.slice(0..len);
        }
        let doubled = old.map_or(0, |ws| 2 * ws.len());
        let size = len.max(doubled.min(self.conv_workspace));
        let ws = self.arena_alloc::<f32>(size, &|| "a convolution workspace".into())?;
        lane.workspace.set(Some(ws));
        ws.slice(0..len)
    }

    /// Images per chunk when each needs `per_image` floats of columns.
    fn chunk_images(&self, per_image: usize, rows: usize) -> usize {
        chunk_images(self.conv_workspace, per_image, rows)
    }

    /// The strided-batched product `c = a · b` (per `gemm` and `batch`) on
    /// `lane`'s cuBLAS handle, counted as a launch.
    fn strided_product(
        &self,
        lane: &Lane,
        gemm: &Gemm,
        batch: &StridedBatch,
        [a, b]: [DeviceView<f32>; 2],
        c: DeviceView<f32>,
    ) -> Result<()> {
        lane.blas.sgemm_strided_batched(gemm, batch, a, b, c)?;
        self.launcher.count();
        Ok(())
    }

    /// `y = conv2d(x, w) (+ bias)` over `rows` image rows.
    fn conv2d(
        &self,
        lane: &Lane,
        geom: &Conv2dGeom,
        rows: usize,
        [x, w]: [DeviceView<f32>; 2],
        bias: Option<DeviceView<f32>>,
        y: DeviceView<f32>,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let stream = &*lane.stream;
        let (k, p, o) = conv_dims(geom);
        let (in_len, out_len) = (geom.in_len(), geom.out_len());
        let beta = match bias {
            Some(b) => {
                let shape = ChannelShape {
                    rows,
                    channels: o,
                    spatial: p,
                };
                self.launcher.channel_broadcast(stream, y, b, shape)?;
                1.0
            }
            None => 0.0,
        };
        // y_r [O, P] = W [O, K] · cols_r [K, P] (+ y_r holding the bias)
        let gemm = Gemm {
            beta,
            ..Gemm::new(o, p, k)
        };
        let batch = |count: usize| StridedBatch {
            count,
            stride_a: 0,
            stride_b: k * p,
            stride_c: o * p,
        };
        if pointwise(geom) {
            self.strided_product(lane, &gemm, &batch(rows), [w, x], y)?;
            return Ok(());
        }
        let chunk = self.chunk_images(k * p, rows);
        let cols = self.workspace(lane, chunk * k * p)?;
        for r0 in (0..rows).step_by(chunk) {
            let nb = chunk.min(rows - r0);
            let xs = x.slice(r0 * in_len..(r0 + nb) * in_len)?;
            let ys = y.slice(r0 * out_len..(r0 + nb) * out_len)?;
            self.launcher
                .im2col(stream, cols, xs, geom, nb, ColumnLayout::per_image(k, p))?;
            self.strided_product(lane, &gemm, &batch(nb), [w, cols], ys)?;
        }
        Ok(())
    }

    /// `dx = col2im(Wᵀ · dY)` per image.
    fn conv2d_backward_input(
        &self,
        lane: &Lane,
        geom: &Conv2dGeom,
        rows: usize,
        dy: DeviceView<f32>,
        w: DeviceView<f32>,
        dx: DeviceView<f32>,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let stream = &*lane.stream;
        let (k, p, o) = conv_dims(geom);
        let (in_len, out_len) = (geom.in_len(), geom.out_len());
        // cols_r [K, P] = Wᵀ [K, O] · dY_r [O, P] (W stored [O, K])
        let gemm = Gemm {
            trans_a: true,
            ..Gemm::new(k, p, o)
        };
        let batch = |count: usize| StridedBatch {
            count,
            stride_a: 0,
            stride_b: o * p,
            stride_c: k * p,
        };
        if pointwise(geom) {
            // the columns are the input gradient itself
            self.strided_product(lane, &gemm, &batch(rows), [w, dy], dx)?;
            return Ok(());
        }
        let chunk = self.chunk_images(k * p, rows);
        let cols = self.workspace(lane, chunk * k * p)?;
        for r0 in (0..rows).step_by(chunk) {
            let nb = chunk.min(rows - r0);
            let dys = dy.slice(r0 * out_len..(r0 + nb) * out_len)?;
            let dxs = dx.slice(r0 * in_len..(r0 + nb) * in_len)?;
            self.strided_product(lane, &gemm, &batch(nb), [w, dys], cols)?;
            self.launcher
                .col2im(stream, dxs, cols, geom, nb, ColumnLayout::per_image(k, p))?;
        }
        Ok(())
    }

    /// `dW = Σ_r dY_r · cols_rᵀ`, one product per chunk of images.
    fn conv2d_backward_weight(
        &self,
        lane: &Lane,
        geom: &Conv2dGeom,
        rows: usize,
        x: DeviceView<f32>,
        dy: DeviceView<f32>,
        dw: DeviceView<f32>,
    ) -> Result<()> {
        let stream = &*lane.stream;
        let (k, p, o) = conv_dims(geom);
        if dw.len() < o * k {
            return Err(model_err(format!(
                "conv2d_backward_weight: the output holds {} floats, needs {}",
                dw.len(),
                o * k
            )));
        }
        let dw = dw.slice(0..o * k)?;
        if rows == 0 {
            return self.launcher.fill(stream, dw, 0.0);
        }
        let (in_len, out_len) = (geom.in_len(), geom.out_len());
        let chunk = self.chunk_images((k + o) * p, rows);
        // one request: the columns, then dY rearranged
        let ws = self.workspace(lane, chunk * (k + o) * p)?;
        let dy_geom = rows_to_columns(o, p);
        for r0 in (0..rows).step_by(chunk) {
            let nb = chunk.min(rows - r0);
            let layout = ColumnLayout::side_by_side(nb, p);
            let cols = ws.slice(0..k * nb * p)?;
            let dyt = ws.slice(k * nb * p..(k + o) * nb * p)?;
            let xs = x.slice(r0 * in_len..(r0 + nb) * in_len)?;
            let dys = dy.slice(r0 * out_len..(r0 + nb) * out_len)?;
            // cols [K, nb·P] and dYt [O, nb·P], image i in columns i·P..
            self.launcher.im2col(stream, cols, xs, geom, nb, layout)?;
            self.launcher
                .im2col(stream, dyt, dys, &dy_geom, nb, layout)?;
            // dW [O, K] (+)= dYt [O, nb·P] · colsᵀ [nb·P, K]
            let gemm = Gemm {
                trans_b: true,
                beta: if r0 == 0 { 0.0 } else { 1.0 },
                ..Gemm::new(o, k, nb * p)
            };
            lane.blas.sgemm(&gemm, dyt, cols, dw)?;
            self.launcher.count();
        }
        Ok(())
    }
}
