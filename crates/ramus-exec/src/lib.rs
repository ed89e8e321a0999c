//! Ramus's backend-neutral execution layer: what every engine (the CPU
//! engines in `ramus-cpu`, the CUDA engines in `ramus-cuda`) takes, returns
//! and shares, and what the training crate (`ramus-nn`) drives them through.
//! It depends on the IR (`ramus-core`) and the inputs (`ramus-graph`) only,
//! so an engine crate never depends on another engine or on the trainer.
//!
//! | what | where |
//! |---|---|
//! | a batch with its schedule, the pass's mode, a forward pass's output, row runs, dropout masks, pulled values | [`batch`] |
//! | the training contract engines implement ([`TrainEngine`]), the state it reads back and restores ([`TrainState`], [`HostState`]) and a step's outcome | [`engine`] |
//! | the inference contract ([`InferEngine`]), a batched engine as one ([`BatchedInfer`]) | [`infer`] |
//! | the measuring chooser among inference engines ([`AutoInfer`]) | [`auto`] |
//! | data-parallel training: the split step, collectives, the wrapper ([`data_parallel::DataParallel`]) | [`data_parallel`] |
//! | optimizer settings and host state (SGD, Adagrad, Adam) | [`optim`] |
//! | the one error type of engines and training ([`ExecError`]) | [`error`] |
//! | non-finite losses and gradients: detection and reports | [`nonfinite`] |
//! | what a run needs in device or host memory, checked before allocating | [`memory`] |
//! | files written whole or not at all | [`atomic`] |
//!
//! ```
//! use ramus_exec::{fill_dropout_mask, ForwardOutput, Mode, OptimizerConfig, OptimizerKind};
//! use rand::SeedableRng;
//!
//! // A forward pass's scores for two head rows of two classes each.
//! let out = ForwardOutput::<f32> {
//!     loss: None,
//!     head_vertices: vec![0, 1],
//!     logits: vec![0.1, 0.9, 0.7, 0.2],
//!     classes: 2,
//! };
//! assert_eq!(out.predictions(), vec![1, 0]);
//!
//! // Outside training every dropout mask keeps everything.
//! let mut mask = vec![0.0f32; 4];
//! let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
//! fill_dropout_mask(&mut mask, 5_000, Mode::Evaluate == Mode::Train, &mut rng);
//! assert_eq!(mask, vec![1.0; 4]);
//!
//! // Settings no one can mean are refused, naming the flag.
//! let bad = OptimizerConfig::new(OptimizerKind::Adam, -1.0);
//! let err = bad.validate().unwrap_err();
//! assert!(err.to_string().contains("--lr"), "{err}");
//! ```

pub mod atomic;
pub mod auto;
pub mod batch;
pub mod bucket;
pub mod data_parallel;
pub mod engine;
pub mod error;
pub mod infer;
pub mod memory;
pub mod nonfinite;
pub mod optim;
pub mod step_plan;

pub use auto::{AutoInfer, BatchShape, Build, Clock, LazyOffer, Offer, WallClock};
pub use batch::{fill_dropout_mask, pulled_values, Batch, ForwardOutput, Mode, Range};
pub use engine::{step_outcome, steps_in_flight, HostState, StepOutcome, TrainEngine, TrainState};
pub use error::{ExecError, Result, Setting};
pub use infer::{BatchedInfer, InferEngine, Scores};
pub use nonfinite::{NonFiniteFault, NonFiniteParam, NonFiniteStep, OnNonFinite, TensorPart};
pub use optim::{Optimizer, OptimizerConfig, OptimizerKind};
