//! [`GraphBuilder`] methods, one per built-in op (plus `linear` and
//! `split`, which compose). Apart from the op definitions so that the ops
//! need not know the graph builder.

use crate::graph::{GraphBuilder, Sym};
use crate::ops::*;
use crate::types::ValueType;

/// Builder methods, one per op (plus `linear` and `split`, which compose).
impl GraphBuilder {
    fn op1(&mut self, op: impl Into<Op>, x: Sym) -> Sym {
        self.apply(op, &[x])
    }
    fn op2(&mut self, op: impl Into<Op>, a: Sym, b: Sym) -> Sym {
        self.apply(op, &[a, b])
    }
    pub fn neg(&mut self, x: Sym) -> Sym {
        self.op1(Neg, x)
    }
    pub fn exp(&mut self, x: Sym) -> Sym {
        self.op1(Exp, x)
    }
    pub fn log(&mut self, x: Sym) -> Sym {
        self.op1(Log, x)
    }
    pub fn sigmoid(&mut self, x: Sym) -> Sym {
        self.op1(Sigmoid, x)
    }
    pub fn tanh(&mut self, x: Sym) -> Sym {
        self.op1(Tanh, x)
    }
    pub fn relu(&mut self, x: Sym) -> Sym {
        self.op1(Relu, x)
    }
    /// `a * x`
    pub fn scale(&mut self, x: Sym, a: f64) -> Sym {
        self.op1(Scale(a), x)
    }
    /// `x + a`
    pub fn add_scalar(&mut self, x: Sym, a: f64) -> Sym {
        self.op1(AddScalar(a), x)
    }
    /// `a - x`
    pub fn rsub_scalar(&mut self, x: Sym, a: f64) -> Sym {
        self.op1(RsubScalar(a), x)
    }
    pub fn add(&mut self, a: Sym, b: Sym) -> Sym {
        self.op2(Add, a, b)
    }
    pub fn sub(&mut self, a: Sym, b: Sym) -> Sym {
        self.op2(Sub, a, b)
    }
    pub fn mul(&mut self, a: Sym, b: Sym) -> Sym {
        self.op2(Mul, a, b)
    }
    pub fn div(&mut self, a: Sym, b: Sym) -> Sym {
        self.op2(Div, a, b)
    }
    /// `g * y * (1 - y)`
    pub fn sigmoid_backward(&mut self, y: Sym, g: Sym) -> Sym {
        self.op2(SigmoidBackward, y, g)
    }
    /// `g * (1 - y^2)`
    pub fn tanh_backward(&mut self, y: Sym, g: Sym) -> Sym {
        self.op2(TanhBackward, y, g)
    }
    /// `x > 0 ? g : 0`
    pub fn relu_backward(&mut self, x: Sym, g: Sym) -> Sym {
        self.op2(ReluBackward, x, g)
    }
    /// `op(a) · op(b)`
    pub fn matmul(&mut self, a: Sym, b: Sym, trans_a: bool, trans_b: bool) -> Sym {
        self.op2(MatMul { trans_a, trans_b }, a, b)
    }
    /// `x · Wᵀ (+ bias)` for a PyTorch-layout weight `W: [out, in]`.
    pub fn linear(&mut self, x: Sym, w: Sym, bias: Option<Sym>) -> Sym {
        let y = self.matmul(x, w, false, true);
        match bias {
            Some(b) => self.add(y, b),
            None => y,
        }
    }
    pub fn concat(&mut self, xs: &[Sym]) -> Sym {
        self.apply(Concat, xs)
    }
    /// Columns `start..start + len`.
    pub fn slice(&mut self, x: Sym, start: usize, len: usize) -> Sym {
        self.op1(Slice { start, len }, x)
    }
    /// Splits the features into `parts` equal slices.
    pub fn split(&mut self, x: Sym, parts: usize) -> Vec<Sym> {
        let w = self.width(x);
        if parts == 0 || !w.is_multiple_of(parts) {
            let s = self.fail(
                "split",
                format!("width {w} does not split into {parts} equal parts"),
            );
            return vec![s; parts];
        }
        (0..parts)
            .map(|i| self.slice(x, i * w / parts, w / parts))
            .collect()
    }
    /// Places `x` at column `start` of zero rows of width `total`.
    pub fn pad(&mut self, x: Sym, start: usize, total: usize) -> Sym {
        self.op1(Pad { start, total }, x)
    }
    /// Child-sum: edge rows summed into their parent vertex.
    pub fn sum_children(&mut self, x: Sym) -> Sym {
        self.op1(SumChildren, x)
    }
    /// Each vertex row copied to the vertex's child edges.
    pub fn expand_children(&mut self, x: Sym) -> Sym {
        self.op1(ExpandChildren, x)
    }
    pub fn sum_rows(&mut self, x: Sym) -> Sym {
        self.op1(SumRows { mean: false }, x)
    }
    pub fn mean_rows(&mut self, x: Sym) -> Sym {
        self.op1(SumRows { mean: true }, x)
    }
    /// A static row repeated for every row of `like` (divided by the row count when `mean`).
    pub fn broadcast_rows(&mut self, s: Sym, like: Sym, mean: bool) -> Sym {
        self.op2(BroadcastRows { mean }, s, like)
    }
    pub fn reshape(&mut self, x: Sym, shape: &[usize]) -> Sym {
        self.op1(
            Reshape {
                shape: shape.to_vec(),
            },
            x,
        )
    }
    /// Rows of `table` selected by index rows `tokens`.
    pub fn embedding(&mut self, table: Sym, tokens: Sym) -> Sym {
        self.op2(Embedding, table, tokens)
    }
    /// Inverted dropout: while training each element is zeroed with
    /// probability `rate` and the rest scaled by `1 / (1 - rate)`; outside
    /// training it is the identity. `rate` is rounded to 1e-4.
    pub fn dropout(&mut self, x: Sym, rate: f64) -> Sym {
        if !(0.0..1.0).contains(&rate) {
            return self.fail("dropout", format!("rate {rate} is not in [0, 1)"));
        }
        let rate = (rate * 1e4).round() as u16;
        if rate == 0 {
            return x;
        }
        let Some(ty) = self.ty(x).cloned() else {
            return x;
        };
        if !ty.is_rows() {
            return self.fail("dropout", format!("operand must be row values, got {ty}"));
        }
        let site = self.dropout_sites() as u16;
        let mask = self.input(
            crate::graph::Source::DropoutMask { site, rate },
            ValueType::rows(ty.space, ty.width()),
        );
        self.mul(x, mask)
    }
    /// Rows of `table` selected by index rows `tokens`, a token beyond the
    /// table reading row 0 ([`EmbeddingUnk`]).
    pub fn embedding_unk(&mut self, table: Sym, tokens: Sym) -> Sym {
        self.op2(EmbeddingUnk, table, tokens)
    }
    /// Per-row matrix product ([`RowMatMul`]).
    pub fn row_matmul(&mut self, a: Sym, b: Sym, product: RowMatMul) -> Sym {
        self.op2(product, a, b)
    }
    /// Per-row softmax cross-entropy of `scores` against index rows `labels`.
    pub fn softmax_xent(&mut self, scores: Sym, labels: Sym) -> Sym {
        self.op2(SoftmaxXent, scores, labels)
    }
}

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
