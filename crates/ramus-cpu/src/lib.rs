//! Ramus on the CPU: the batched engine (Cavs' scheduling, dynamic tensors
//! and lazy batching) that every other engine is checked against, the
//! compiled (Cortex) inference engine ([`compiled::CpuCompiledEngine`]),
//! and the kernels, fused-group evaluator and traces they share.
//!
//! [`CpuTrainer`] is the batched engine behind the
//! [`TrainEngine`](ramus_exec::TrainEngine) contract (what
//! `ramus_nn::Trainer` drives); the compiled engine is an
//! [`InferEngine`](ramus_exec::InferEngine).
//!
//! ```
//! use ramus_core::model::{FunctionSelector, HeadRows, Init, ModelBuilder};
//! use ramus_core::Params;
//! use ramus_cpu::{compiled::CpuCompiledEngine, CpuTrainer};
//! use ramus_exec::{Batch, InferEngine, OptimizerConfig, OptimizerKind, TrainEngine};
//! use ramus_graph::{ptb, BatchingPolicy, Vocab, VocabMode};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut vocab = Vocab::new();
//! let text = "(1 (2 not) (3 good))\n(3 (2 very) (3 good))";
//! let trees = ptb::parse_trees(text, "<example>", VocabMode::Grow(&mut vocab))?;
//! // h = tanh(W [h_l; h_r] + b) over embedded words, a classifier at the root
//! let (v, h) = (vocab.len(), 8);
//! let mut m = ModelBuilder::new("tree-fc", h);
//! # let emb = m.param("emb", &[v, h], Init::Normal { std: 0.1 });
//! # let w = m.param("W", &[h, 2 * h], Init::Xavier);
//! # let w_out = m.param("W_out", &[5, h], Init::Xavier);
//! # let leaf = m.vertex_fn("leaf", |f| {
//! #     let x = f.embed(emb);
//! #     f.scatter(x);
//! #     f.push(x);
//! # })?;
//! # let internal = m.vertex_fn("internal", |f| {
//! #     let lr = [f.gather(0), f.gather(1)];
//! #     let lr = f.concat(&lr);
//! #     let w = f.param(w);
//! #     let z = f.linear(lr, w, None);
//! #     let h = f.tanh(z);
//! #     f.scatter(h);
//! #     f.push(h);
//! # })?;
//! # m.select(FunctionSelector::LeafInternal { leaf, internal });
//! # m.head(HeadRows::Roots, h, |hd| {
//! #     let x = hd.input();
//! #     let w = hd.param(w_out);
//! #     let logits = hd.linear(x, w, None);
//! #     let labels = hd.labels();
//! #     let l = hd.softmax_xent(logits, labels);
//! #     let loss = hd.mean_rows(l);
//! #     hd.loss(loss);
//! #     hd.logits(logits);
//! # })?;
//! let model = m.build()?;
//! let params = Params::<f32>::init(&model, 1);
//!
//! // Train: one batch of both trees, a few Adagrad steps; the loss falls.
//! let config = OptimizerConfig::new(OptimizerKind::Adagrad, 0.1);
//! let mut engine = CpuTrainer::new(model.clone(), params, config);
//! let batch = Batch::new(&model, trees.iter().collect(), BatchingPolicy::Cavs)?;
//! let first = engine.train_step(&batch)?;
//! for _ in 0..20 {
//!     engine.train_step(&batch)?;
//! }
//! assert!(engine.train_step(&batch)? < first);
//!
//! // Infer with the trained parameters on the compiled engine: a row of
//! // scores per tree.
//! let trained = engine.state()?.params;
//! let mut compiled = CpuCompiledEngine::new(&model, &trained, true)?;
//! let scores = InferEngine::infer(&mut compiled, &[&trees[0], &trees[1]])?;
//! assert_eq!(scores.predictions(), vec![1, 3]);
//! # Ok(())
//! # }
//! ```

pub mod cell_eval;
pub mod compiled;
mod contract;
pub mod engine;
pub mod fused;
mod infer;
pub mod kernels;
pub mod parallel;
pub mod trace;

pub use contract::CpuTrainer;
pub use engine::CpuEngine;
pub use trace::training_trace;
