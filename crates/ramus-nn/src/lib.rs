//! Ramus models and training: the model zoo (dynamic models and CNNs), checkpoints, resumable
//! runs and the training / evaluation loops. The engine contract, optimizers, errors and memory
//! estimates they use are `ramus-exec`'s.
//!
//! ```
//! use ramus_core::Params;
//! use ramus_exec::{OptimizerConfig, OptimizerKind};
//! use ramus_graph::{ptb, synthetic, Vocab, VocabMode};
//! use ramus_nn::{build_model, checkpoint, ModelConfig, Trainer};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Part of the built-in synthetic sentiment treebank.
//! let tb = synthetic::generate(synthetic::DEFAULT_SEED, (300, 50, 1));
//! let mut vocab = Vocab::new();
//! let train = ptb::parse_trees(&tb.train.join("\n"), "train", VocabMode::Grow(&mut vocab))?;
//! let dev = ptb::parse_trees(&tb.dev.join("\n"), "dev", VocabMode::Frozen(&vocab))?;
//!
//! // A zoo model (the binary Tree-LSTM), trained on the CPU batched engine.
//! let cfg = ModelConfig { vocab: vocab.len(), hidden: 16, classes: 5 };
//! let model = build_model("treelstm-nary", &cfg)?;
//! let params = Params::<f32>::init(&model, 1);
//! let optimizer = OptimizerConfig::new(OptimizerKind::Adagrad, 0.05);
//! let mut trainer = Trainer::new(model, params, optimizer);
//! let before = trainer.evaluate(&dev, 50)?;
//! let mut rng = ramus_nn::train::rng(1);
//! for _ in 0..3 {
//!     trainer.train_epoch(&train, 25, &mut rng, |_, _, _| {})?;
//! }
//! let after = trainer.evaluate(&dev, 50)?;
//! assert!(after.loss < before.loss);
//!
//! // A checkpoint: the parameters, the model's name and sizes, the vocabulary.
//! let state = trainer.state()?;
//! let path = std::env::temp_dir().join("ramus-nn-doc-example.safetensors");
//! checkpoint::save(&path, trainer.model(), &state.params, &vocab)?;
//! let (info, bytes) = checkpoint::read_info(&path)?;
//! assert_eq!(info.model, "treelstm-nary");
//! let loaded = checkpoint::load_params(&path, &bytes, trainer.model())?;
//! assert_eq!(loaded, state.params);
//! # std::fs::remove_file(&path)?;
//! # Ok(())
//! # }
//! ```

mod blocks;
pub mod checkpoint;
pub mod models;
pub mod resume;
pub mod schedule;
pub mod sequence_models;
pub mod train;
pub mod vision;

pub use models::{
    build_model, build_model_with, build_mvrnn, data_kind, DataKind, ModelConfig, ModelOptions,
    MODEL_NAMES, MVRNN_MATRIX_WORDS,
};
pub use sequence_models::{
    build_sequence_model, is_sequence_model, SequenceConfig, SEQUENCE_MODELS,
};
pub use train::{evaluate, EvalResult, Trainer};
pub use vision::{build_vision_model, ImageShape, VisionConfig};

/// The README's library example, compiled and run as a doc test
/// (`cargo test --release -p ramus-nn --doc`); its other code blocks are
/// marked `sh`, `text` or `toml`, which rustdoc leaves alone.
#[doc = include_str!("../../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
