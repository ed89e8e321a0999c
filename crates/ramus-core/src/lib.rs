//! Ramus core: host tensors, the op registry, the graph IR that vertex
//! functions, their derivatives and heads are written in, the passes over
//! it (autodiff, simplification, execution classification, elementwise
//! fusion with CUDA code generation), and model declaration.
//!
//! ```
//! use ramus_core::model::{HeadRows, Init, ModelBuilder};
//! // A tiny recursive net: h = tanh(W [h_left; h_right] + b), leaves embed words.
//! let (vocab, h) = (10, 4);
//! let mut m = ModelBuilder::new("tree-fc", h);
//! let emb = m.param("emb", &[vocab, h], Init::Normal { std: 0.1 });
//! let w = m.param("W", &[h, 2 * h], Init::Xavier);
//! let b = m.param("b", &[h], Init::Zeros);
//! let w_out = m.param("W_out", &[2, h], Init::Xavier);
//! m.vertex_fn("cell", |f| {
//!     let leaf = f.embed(emb);
//!     let (l, r) = (f.gather(0), f.gather(1));
//!     let lr = f.concat(&[l, r]);
//!     let (w, b) = (f.param(w), f.param(b));
//!     let z = f.linear(lr, w, Some(b));
//!     let z = f.add(z, leaf);
//!     let h = f.tanh(z);
//!     f.scatter(h);
//!     f.push(h);
//! }).unwrap();
//! m.head(HeadRows::Roots, h, |hd| {
//!     let x = hd.input();
//!     let w = hd.param(w_out);
//!     let logits = hd.linear(x, w, None);
//!     let labels = hd.labels();
//!     let l = hd.softmax_xent(logits, labels);
//!     let loss = hd.mean_rows(l);
//!     hd.loss(loss);
//!     hd.logits(logits);
//! }).unwrap();
//! let model = m.build().unwrap();
//! assert_eq!(model.functions[0].gather_arity, 2);
//! // a vertex with three children would lose one: refused
//! assert!(model.function_for(0, 3).is_err());
//! ```

pub mod arity;
pub mod autodiff;
pub mod builder_ops;
pub mod error;
pub mod fusion;
pub mod gradient;
pub mod graph;
pub mod isa;
pub mod lower;
pub mod model;
pub mod op;
pub mod ops;
pub mod params;
pub mod plan;
pub mod real;
pub mod recursion;
pub mod registry;
pub mod simplify;
pub mod tensor;
pub mod types;
pub mod vpps;

pub use arity::{Arity, VertexRules};
pub use error::{CoreError, Result};
pub use graph::{
    DType, Graph, GraphBuilder, Node, NodeId, NodeKind, Output, ParamId, Role, Source, Space, Sym,
    ValueType,
};
pub use model::{FunctionSelector, HeadRows, Init, Model, ModelBuilder, ParamKind, ParamSpec};
pub use op::OpDef;
pub use params::{Grads, Params};
pub use real::Real;
pub use registry::OpRegistry;
pub use tensor::Tensor;
