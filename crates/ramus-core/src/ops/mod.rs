//! The built-in primitive ops and the builder methods that apply them.

pub mod cnn;
pub mod elementwise;
pub mod loss;
pub mod matmul;
pub mod row_matrix;
mod set;
pub mod structure;

use crate::graph::{GraphBuilder, Sym};
use crate::types::ValueType;
use crate::op::PrimitiveMaker;

pub use cnn::{
    BatchNorm, BatchNormBackwardGamma, BatchNormBackwardInput, BatchNormInference,
    BatchNormInferenceBackwardInput, BatchNormInferenceBackwardParam, ChannelBroadcast, ChannelSum,
    Conv2d, Conv2dBackwardInput, Conv2dBackwardWeight, Conv2dGeom, GlobalAvgPool,
    GlobalAvgPoolBackward, MaxPool2d, MaxPool2dBackward, NormGeom, NormParam, Pool2dGeom,
    RUNNING_STATS_MOMENTUM,
};
pub use elementwise::*;
pub use loss::{SoftmaxXent, SoftmaxXentBackward};
pub use matmul::MatMul;
pub use row_matrix::RowMatMul;
pub use set::Op;
pub use structure::*;

fn attr(attrs: &[f64], i: usize, name: &str) -> Result<f64, String> {
    attrs
        .get(i)
        .copied()
        .ok_or_else(|| format!("missing attribute {i} ({name})"))
}

fn usize_attr(attrs: &[f64], i: usize, name: &str) -> Result<usize, String> {
    let v = attr(attrs, i, name)?;
    if v < 0.0 || v.fract() != 0.0 {
        return Err(format!(
            "attribute {name} must be a non-negative integer, got {v}"
        ));
    }
    Ok(v as usize)
}

fn prim(op: impl Into<Op>) -> Result<Op, String> {
    Ok(op.into())
}

/// `(name, doc, constructor from numeric attributes)` of one primitive.
type Primitive = (&'static str, &'static str, PrimitiveMaker);

/// `(name, doc, constructor from numeric attributes)` for every primitive,
/// family by family.
pub(crate) fn primitives() -> Vec<Primitive> {
    [
        elementwise(),
        matmul(),
        structure(),
        rows_and_loss(),
        conv_pool(),
        norm(),
    ]
    .concat()
}

/// The primitives of element-wise maps, scalar and binary arithmetic, their backward steps.
fn elementwise() -> Vec<Primitive> {
    vec![
        ("neg", "-x", |_| prim(Neg)),
        ("exp", "exp(x)", |_| prim(Exp)),
        ("log", "natural log", |_| prim(Log)),
        ("sigmoid", "logistic sigmoid", |_| prim(Sigmoid)),
        ("tanh", "hyperbolic tangent", |_| prim(Tanh)),
        ("relu", "max(x, 0)", |_| prim(Relu)),
        ("scale", "a * x; attrs [a]", |a| {
            prim(Scale(attr(a, 0, "a")?))
        }),
        ("add_scalar", "x + a; attrs [a]", |a| {
            prim(AddScalar(attr(a, 0, "a")?))
        }),
        ("rsub_scalar", "a - x; attrs [a]", |a| {
            prim(RsubScalar(attr(a, 0, "a")?))
        }),
        ("add", "a + b (static rows broadcast)", |_| prim(Add)),
        ("sub", "a - b (static rows broadcast)", |_| prim(Sub)),
        ("mul", "a * b (static rows broadcast)", |_| prim(Mul)),
        ("div", "a / b (static rows broadcast)", |_| prim(Div)),
        ("sigmoid_backward", "g * y * (1 - y)", |_| {
            prim(SigmoidBackward)
        }),
        ("tanh_backward", "g * (1 - y^2)", |_| prim(TanhBackward)),
        ("relu_backward", "x > 0 ? g : 0", |_| prim(ReluBackward)),
    ]
}

/// The primitives of the matrix product.
fn matmul() -> Vec<Primitive> {
    vec![(
        "matmul",
        "op(A)·op(B); attrs [trans_a, trans_b] as 0/1 (missing ones are 0)",
        |a| {
            if a.len() > 2 {
                return Err(format!("takes at most 2 attributes, got {}", a.len()));
            }
            let flag = |i: usize, name: &str| match a.get(i).copied() {
                None => Ok(false),
                Some(v) if v == 0.0 || v == 1.0 => Ok(v == 1.0),
                Some(v) => Err(format!("attribute {name} must be 0 or 1, got {v}")),
            };
            prim(MatMul {
                trans_a: flag(0, "trans_a")?,
                trans_b: flag(1, "trans_b")?,
            })
        },
    )]
}

/// The primitives of row and child structure: concatenation, slices, reductions, broadcasts, embeddings.
fn structure() -> Vec<Primitive> {
    vec![
        ("concat", "concatenate rows along features", |_| prim(Concat)),
        (
            "slice",
            "columns start..start+len; attrs [start, len]",
            |a| {
                prim(Slice {
                    start: usize_attr(a, 0, "start")?,
                    len: usize_attr(a, 1, "len")?,
                })
            },
        ),
        (
            "pad",
            "place rows at column start of zero rows of width total; attrs [start, total]",
            |a| {
                prim(Pad {
                    start: usize_attr(a, 0, "start")?,
                    total: usize_attr(a, 1, "total")?,
                })
            },
        ),
        (
            "sum_children",
            "sum of edge rows into their parent vertex",
            |_| prim(SumChildren),
        ),
        (
            "expand_children",
            "copy vertex rows to their child edges",
            |_| prim(ExpandChildren),
        ),
        ("sum_rows", "sum over rows", |_| {
            prim(SumRows { mean: false })
        }),
        ("mean_rows", "mean over rows", |_| {
            prim(SumRows { mean: true })
        }),
        (
            "broadcast_rows",
            "repeat a static row for each row of a reference",
            |_| prim(BroadcastRows { mean: false }),
        ),
        (
            "broadcast_rows_mean",
            "repeat a static row divided by the row count for each row of a reference",
            |_| prim(BroadcastRows { mean: true }),
        ),
        (
            "reshape",
            "a static value viewed with another shape; attrs = the new shape",
            |a| {
                if a.is_empty() {
                    return Err("needs the new shape as attributes".into());
                }
                let shape = (0..a.len())
                    .map(|i| usize_attr(a, i, "dimension"))
                    .collect::<Result<Vec<_>, _>>()?;
                prim(Reshape { shape })
            },
        ),
        ("embedding", "table rows looked up by token", |_| {
            prim(Embedding)
        }),
        (
            "embedding_unk",
            "table rows looked up by token; a token beyond the table reads row 0 (the unknown word's)",
            |_| prim(EmbeddingUnk),
        ),
        (
            "embedding_unk_backward",
            "gradient of embedding_unk's table from (gradient rows, tokens) -> static [rows, H]; attrs [rows]",
            |a| {
                prim(EmbeddingUnkBackward {
                    rows: usize_attr(a, 0, "rows")?,
                })
            },
        ),
    ]
}

/// The primitives of per-row matrices and the softmax cross-entropy loss.
fn rows_and_loss() -> Vec<Primitive> {
    vec![
        (
            "row_matmul",
            "per-row op(A)·op(B) of [m,k]·[k,n] matrices held in rows (or one static operand); attrs [m, k, n, trans_a, trans_b]",
            |a| {
                let flag = |i: usize, name: &str| match a.get(i).copied() {
                    None => Ok(false),
                    Some(v) if v == 0.0 || v == 1.0 => Ok(v == 1.0),
                    Some(v) => Err(format!("attribute {name} must be 0 or 1, got {v}")),
                };
                prim(RowMatMul {
                    m: usize_attr(a, 0, "m")?,
                    k: usize_attr(a, 1, "k")?,
                    n: usize_attr(a, 2, "n")?,
                    trans_a: flag(3, "trans_a")?,
                    trans_b: flag(4, "trans_b")?,
                })
            },
        ),
        (
            "softmax_xent",
            "per-row softmax cross-entropy against labels",
            |_| prim(SoftmaxXent),
        ),
        (
            "softmax_xent_backward",
            "gradient of softmax_xent from (scores, labels, upstream [1]-wide rows)",
            |_| prim(SoftmaxXentBackward),
        ),
    ]
}

/// The primitives of convolution and pooling.
fn conv_pool() -> Vec<Primitive> {
    vec![
        (
            "conv2d",
            "2-D convolution of image rows [C*H*W] (CHW) by weight [O, C*kh*kw] (+ bias [O]) -> rows [O*Ho*Wo]; attrs [C, H, W, O, kh, kw, stride=1, padding=0]",
            |a| prim(Conv2d(cnn::conv_geom(a)?)),
        ),
        (
            "conv2d_backward_input",
            "d(input) of conv2d: col2im(Wᵀ·dY) from (dY rows, weight); attrs as conv2d",
            |a| prim(Conv2dBackwardInput(cnn::conv_geom(a)?)),
        ),
        (
            "conv2d_backward_weight",
            "d(weight) of conv2d: Σ_rows dY·im2col(x)ᵀ from (x rows, dY rows) -> static [O, C*kh*kw]; attrs as conv2d",
            |a| prim(Conv2dBackwardWeight(cnn::conv_geom(a)?)),
        ),
        (
            "max_pool2d",
            "max pooling of image rows [C*H*W] over k x k windows -> rows [C*Ho*Wo]; attrs [C, H, W, k, stride=k, padding=0]",
            |a| prim(MaxPool2d(cnn::pool_geom(a)?)),
        ),
        (
            "max_pool2d_backward",
            "gradient of max_pool2d from (x rows, dY rows), routed to each window's first maximum; attrs as max_pool2d",
            |a| prim(MaxPool2dBackward(cnn::pool_geom(a)?)),
        ),
        (
            "global_avg_pool",
            "per-channel mean over positions: rows [C*H*W] -> rows [C]; attrs [C, H, W]",
            |a| prim(cnn::global_pool(a)?),
        ),
        (
            "global_avg_pool_backward",
            "gradient of global_avg_pool: rows [C] spread over H*W positions / (H*W); attrs [C, H, W]",
            |a| {
                prim(GlobalAvgPoolBackward {
                    pool: cnn::global_pool(a)?,
                })
            },
        ),
    ]
}

/// The primitives of channel reductions and batch normalization.
fn norm() -> Vec<Primitive> {
    vec![
        (
            "channel_sum",
            "rows [C*S] summed over rows and positions -> static [C]; attrs [C, S]",
            |a| {
                let (channels, spatial) = cnn::cs_attrs(a)?;
                prim(ChannelSum { channels, spatial })
            },
        ),
        (
            "channel_broadcast",
            "static [C] spread over S positions for every row of a reference -> rows [C*S]; attrs [C, S]",
            |a| {
                let (channels, spatial) = cnn::cs_attrs(a)?;
                prim(ChannelBroadcast { channels, spatial })
            },
        ),
        (
            "batch_norm",
            "training-mode batch normalisation of rows [C*S] with batch statistics over all rows of the run, (x, gamma [C], beta [C][, running mean [C], running var [C]]: buffers updated by training passes and used by evaluation); attrs [C, S, eps=1e-5]",
            |a| prim(BatchNorm(cnn::norm_geom(a)?)),
        ),
        (
            "batch_norm_backward_input",
            "d(input) of batch_norm from (x rows, gamma, dY rows); attrs as batch_norm",
            |a| prim(BatchNormBackwardInput(cnn::norm_geom(a)?)),
        ),
        (
            "batch_norm_backward_gamma",
            "d(gamma) of batch_norm from (x rows, dY rows) -> static [C]; attrs as batch_norm",
            |a| prim(BatchNormBackwardGamma(cnn::norm_geom(a)?)),
        ),
        (
            "batch_norm_inference",
            "batch normalisation with given statistics, (x, gamma, beta, mean, var) all [C] but x; attrs [C, S, eps=1e-5]",
            |a| prim(BatchNormInference(cnn::norm_geom(a)?)),
        ),
        (
            "batch_norm_inference_backward_input",
            "d(input) of batch_norm_inference from (gamma, var, dY rows); attrs as batch_norm",
            |a| prim(BatchNormInferenceBackwardInput(cnn::norm_geom(a)?)),
        ),
        (
            "batch_norm_inference_backward_gamma",
            "d(gamma) of batch_norm_inference from (x rows, gamma, mean, var, dY rows) -> static [C]; attrs as batch_norm",
            |a| {
                prim(BatchNormInferenceBackwardParam {
                    geom: cnn::norm_geom(a)?,
                    param: NormParam::Gamma,
                })
            },
        ),
        (
            "batch_norm_inference_backward_mean",
            "d(mean) of batch_norm_inference from (x rows, gamma, mean, var, dY rows) -> static [C]; attrs as batch_norm",
            |a| {
                prim(BatchNormInferenceBackwardParam {
                    geom: cnn::norm_geom(a)?,
                    param: NormParam::Mean,
                })
            },
        ),
        (
            "batch_norm_inference_backward_var",
            "d(var) of batch_norm_inference from (x rows, gamma, mean, var, dY rows) -> static [C]; attrs as batch_norm",
            |a| {
                prim(BatchNormInferenceBackwardParam {
                    geom: cnn::norm_geom(a)?,
                    param: NormParam::Var,
                })
            },
        ),
    ]
}

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
