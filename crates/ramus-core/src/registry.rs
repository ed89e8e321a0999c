//! [`OpRegistry`]: ops by name — the built-in primitives (one table per op
//! family, each entry `(name, doc, constructor from numeric attributes)`)
//! plus user-defined composites.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::error::{CoreError, Result};
use crate::graph::{GraphBuilder, Sym};
use crate::op::{attr, usize_attr};
use crate::ops::*;

/// A user-defined op composed from registered ones.
pub type CompositeBuilder = Arc<dyn Fn(&mut GraphBuilder, &[Sym]) -> Sym + Send + Sync>;

/// Makes a primitive op from numeric attributes.
pub type PrimitiveMaker = fn(&[f64]) -> std::result::Result<Op, String>;

enum Entry {
    Primitive {
        doc: &'static str,
        make: PrimitiveMaker,
    },
    Composite {
        doc: String,
        arity: usize,
        build: CompositeBuilder,
    },
}

/// Ops by name: the built-in primitives plus user composites.
pub struct OpRegistry {
    entries: BTreeMap<String, Entry>,
}

impl OpRegistry {
    /// A registry with every built-in primitive op.
    pub fn standard() -> Self {
        let mut r = OpRegistry {
            entries: BTreeMap::new(),
        };
        for (name, doc, make) in primitives() {
            r.entries
                .insert(name.to_string(), Entry::Primitive { doc, make });
        }
        r
    }

    /// Registers `name` as a composition of registered ops taking `arity`
    /// inputs. Its gradient, fusion and kernels come from the ops it uses.
    pub fn register_composite(
        &mut self,
        name: &str,
        arity: usize,
        doc: &str,
        build: impl Fn(&mut GraphBuilder, &[Sym]) -> Sym + Send + Sync + 'static,
    ) -> Result<()> {
        if self.entries.contains_key(name) {
            return Err(CoreError::Model {
                model: "op registry".into(),
                message: format!("op `{name}` already exists"),
            });
        }
        self.entries.insert(
            name.to_string(),
            Entry::Composite {
                doc: doc.to_string(),
                arity,
                build: Arc::new(build),
            },
        );
        Ok(())
    }

    /// Applies op `name` with numeric attributes `attrs` to `inputs`.
    pub fn call(&self, b: &mut GraphBuilder, name: &str, inputs: &[Sym], attrs: &[f64]) -> Sym {
        match self.entries.get(name) {
            None => b.fail(
                name,
                format!("no such op (known: {})", self.names().join(", ")),
            ),
            Some(Entry::Primitive { make, .. }) => match make(attrs) {
                Ok(op) => b.apply(op, inputs),
                Err(e) => b.fail(name, e),
            },
            Some(Entry::Composite { arity, build, .. }) => {
                if inputs.len() != *arity {
                    b.fail(name, format!("takes {arity} inputs, got {}", inputs.len()))
                } else {
                    build(b, inputs)
                }
            }
        }
    }

    /// Registered names in order.
    pub fn names(&self) -> Vec<&str> {
        self.entries.keys().map(String::as_str).collect()
    }

    /// One-line documentation of `name`.
    pub fn doc(&self, name: &str) -> Option<String> {
        self.entries.get(name).map(|e| match e {
            Entry::Primitive { doc, .. } => doc.to_string(),
            Entry::Composite { doc, .. } => format!("(composite) {doc}"),
        })
    }
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
