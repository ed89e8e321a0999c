//! Ramus's engine conformance suite and the test kit the engines' own
//! tests share (as candle's `test_device!` or burn's backend test suite).
//!
//! The suite (`tests/conformance.rs`) runs every model of the zoo on every
//! engine that claims to support it, on the CPU and (with a driver) on
//! CUDA, against the CPU reference (`CpuTrainer`): losses, gradients,
//! updated parameters and optimizer state after training steps, scores of
//! the inference engines; and checks that every engine refuses, naming
//! the op or the model, what the support table says it does not run.
//!
//! | what | where |
//! |---|---|
//! | the zoo at small sizes with its data, seeded parameters | [`zoo`] |
//! | the engines, built in one place, and what each claims to support | [`engines`] |
//! | comparing with a tolerance, naming the tensor and element | [`close`] |
//! | whether a CUDA driver is here, with a notice when not | [`gpu`] |
//! | deterministic values and small fixture models for engine tests | [`fixtures`] |
//! | the CUDA device optimizer's test model and step data | [`optimizer_fixture`] |
//!
//! ```
//! use ramus_conformance::close::{assert_close, Tolerance};
//! use ramus_conformance::zoo::Case;
//!
//! let case = Case::new("treefc", 2, 3, 7).unwrap();
//! assert_eq!(case.batches().len(), 2);
//! assert_close("same", &[1.0f32, 2.0], &[1.0, 2.0], Tolerance::EXACT);
//! ```

pub mod close;
pub mod engines;
pub mod fixtures;
pub mod gpu;
pub mod optimizer_fixture;
pub mod zoo;
