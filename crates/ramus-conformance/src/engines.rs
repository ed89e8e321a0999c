//! The engines the suite runs, each built in one place through its public
//! constructor, and what each claims to support, asked of the engines' own
//! code as `ramus inspect --support` asks it: the CPU compiled engine is
//! constructed, the CUDA engines' device-free checks (`ramus_cuda::support`)
//! run their plans, lowerings and instruction sets. A new engine is a
//! variant here; the compiler then lists every `match` that must say how
//! to build it and what it supports.

use ramus_core::{Model, Params};
use ramus_cpu::compiled::CpuCompiledEngine;
use ramus_cpu::CpuTrainer;
use ramus_cuda::compiled::{CompiledEngine, CompiledOptions};
use ramus_cuda::persistent::{PersistentOptions, PersistentTrainer};
use ramus_cuda::{CudaEngine, CudaEngineOptions, CudaTrainer, SwapConfig, SwapMode, SwapTrainer};
use ramus_exec::{BatchedInfer, InferEngine, OptimizerConfig, TrainEngine};

/// Where an engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
}

/// A training engine ([`TrainEngine`]) of the suite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrainKind {
    /// `CpuTrainer`, the reference's own engine, driven through the
    /// contract's other calls (`submit` of several batches, `restore`).
    CpuBatched,
    /// `CudaTrainer` over `CudaEngine`.
    CudaBatched,
    /// `PersistentTrainer` (the VPPS kernel).
    CudaPersistent,
    /// `CudaTrainer` over `CudaEngine` on the swap path
    /// (tensors allocated at first use, freed after the last).
    Swap,
}

impl TrainKind {
    pub const ALL: [TrainKind; 4] = [
        TrainKind::CpuBatched,
        TrainKind::CudaBatched,
        TrainKind::CudaPersistent,
        TrainKind::Swap,
    ];

    /// The column of `ramus inspect --support`.
    pub fn label(self) -> &'static str {
        match self {
            TrainKind::CpuBatched => "cpu batched",
            TrainKind::CudaBatched => "cuda batched",
            TrainKind::CudaPersistent => "cuda persistent",
            TrainKind::Swap => "swap",
        }
    }

    pub fn device(self) -> Device {
        match self {
            TrainKind::CpuBatched => Device::Cpu,
            _ => Device::Cuda,
        }
    }

    /// Whether this engine claims to train `model`; `Err` is its reason.
    pub fn supports(self, model: &Model) -> Result<(), String> {
        let shown = |e: ramus_cuda::CudaError| e.to_string();
        match self {
            // every op has a CPU kernel: `Kernel for Op` matches each variant
            TrainKind::CpuBatched => Ok(()),
            TrainKind::CudaBatched => ramus_cuda::support::batched(model).map_err(shown),
            TrainKind::CudaPersistent => ramus_cuda::support::persistent(model).map_err(shown),
            TrainKind::Swap => ramus_cuda::support::swap(model).map_err(shown),
        }
    }

    /// The engine for `model` from `params` with a fresh optimizer of
    /// `config`, set up for batches of `batch_size` graphs.
    pub fn build(
        self,
        model: &Model,
        params: &Params<f32>,
        config: OptimizerConfig,
        batch_size: usize,
    ) -> Result<Box<dyn TrainEngine<f32>>, String> {
        let on_cuda = |engine: CudaEngine| -> Result<Box<dyn TrainEngine<f32>>, String> {
            let trainer = CudaTrainer::new(engine, model.clone(), params.clone(), config);
            Ok(Box::new(trainer.map_err(|e| e.to_string())?))
        };
        match self {
            TrainKind::CpuBatched => Ok(Box::new(reference_trainer(model, params, config))),
            TrainKind::CudaBatched => on_cuda(
                CudaEngine::new(model, &CudaEngineOptions::default()).map_err(|e| e.to_string())?,
            ),
            TrainKind::CudaPersistent => {
                let options = PersistentOptions {
                    batch_size: Some(batch_size),
                    ..PersistentOptions::default()
                };
                let engine = PersistentTrainer::new(model, params, config, &options);
                Ok(Box::new(engine.map_err(|e| e.to_string())?))
            }
            TrainKind::Swap => Ok(Box::new(
                swap_trainer(model, params, config).map_err(|e| e.to_string())?,
            )),
        }
    }
}

/// The swap path (a `SwapTrainer` around the CUDA trainer): the one place
/// the suite reaches it.
fn swap_trainer(
    model: &Model,
    params: &Params<f32>,
    config: OptimizerConfig,
) -> ramus_cuda::Result<SwapTrainer> {
    SwapTrainer::new(
        model.clone(),
        &CudaEngineOptions::default(),
        SwapConfig::with_mode(SwapMode::Resident),
        params.clone(),
        config,
    )
}

/// An inference engine ([`InferEngine`]) of the suite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InferKind {
    /// `CpuCompiledEngine` without per-token tables.
    CpuCompiled,
    /// `CpuCompiledEngine` with per-token tables (leaf results looked up).
    CpuCompiledTables,
    /// The CUDA `CompiledEngine`.
    CudaCompiled,
    /// `BatchedInfer` over `CudaTrainer`.
    CudaBatched,
}

impl InferKind {
    pub const ALL: [InferKind; 4] = [
        InferKind::CpuCompiled,
        InferKind::CpuCompiledTables,
        InferKind::CudaCompiled,
        InferKind::CudaBatched,
    ];

    /// The column of `ramus inspect --support`.
    pub fn label(self) -> &'static str {
        match self {
            InferKind::CpuCompiled | InferKind::CpuCompiledTables => "cpu compiled",
            InferKind::CudaCompiled => "cuda compiled",
            InferKind::CudaBatched => "cuda batched",
        }
    }

    pub fn device(self) -> Device {
        match self {
            InferKind::CpuCompiled | InferKind::CpuCompiledTables => Device::Cpu,
            _ => Device::Cuda,
        }
    }

    /// Whether this engine claims to run `model`; `Err` is its reason.
    pub fn supports(self, model: &Model) -> Result<(), String> {
        let shown = |e: ramus_cuda::CudaError| e.to_string();
        match self {
            InferKind::CpuCompiled | InferKind::CpuCompiledTables => {
                let params = Params::init(model, 0);
                let built =
                    CpuCompiledEngine::new(model, &params, self == InferKind::CpuCompiledTables);
                built.map(|_| ()).map_err(|e| e.to_string())
            }
            InferKind::CudaCompiled => ramus_cuda::support::compiled(model).map_err(shown),
            InferKind::CudaBatched => ramus_cuda::support::batched(model).map_err(shown),
        }
    }

    /// The engine for `model` with `params`.
    pub fn build<'a>(
        self,
        model: &'a Model,
        params: &'a Params<f32>,
    ) -> Result<Box<dyn InferEngine<f32> + 'a>, String> {
        let shown = |e: &dyn std::fmt::Display| e.to_string();
        Ok(match self {
            InferKind::CpuCompiled | InferKind::CpuCompiledTables => {
                let tables = self == InferKind::CpuCompiledTables;
                Box::new(CpuCompiledEngine::new(model, params, tables).map_err(|e| shown(&e))?)
            }
            InferKind::CudaCompiled => {
                let options = CompiledOptions::default();
                Box::new(CompiledEngine::new(model, params, &options).map_err(|e| shown(&e))?)
            }
            InferKind::CudaBatched => {
                let config = OptimizerConfig::forward_only();
                let engine = TrainKind::CudaBatched.build(model, params, config, 1)?;
                Box::new(BatchedInfer::new(engine))
            }
        })
    }
}

/// The CPU reference trainer: `CpuTrainer` from `params` with `config`.
pub fn reference_trainer(
    model: &Model,
    params: &Params<f32>,
    config: OptimizerConfig,
) -> CpuTrainer<f32> {
    CpuTrainer::new(model.clone(), params.clone(), config)
}

/// The CPU reference scores: `BatchedInfer` over `CpuTrainer`.
pub fn reference_infer(model: &Model, params: &Params<f32>) -> BatchedInfer<'static, f32> {
    let trainer = reference_trainer(model, params, OptimizerConfig::forward_only());
    BatchedInfer::new(Box::new(trainer))
}
