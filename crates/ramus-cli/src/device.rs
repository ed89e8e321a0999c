//! `--device`: which engine runs a command (the CPU batched engine or the
//! CUDA batched engine), and building it for a model; `--engine`: the
//! persistent (VPPS) training engine on CUDA; `--swap`: how the CUDA
//! engine trains a CNN under `--device-memory-budget`.

use std::str::FromStr;

use crate::limits::Training;
use crate::output::logln;
use ramus_core::{Model, Params};
use ramus_cpu::CpuTrainer;
use ramus_cuda::persistent::PersistentTrainer;
use ramus_cuda::{CudaEngine, CudaEngineOptions, CudaTrainer, SwapConfig, SwapMode, SwapTrainer};
use ramus_exec::data_parallel::{Alone, DataParallel};
use ramus_exec::memory::DeviceNeed;
use ramus_exec::{OptimizerConfig, TrainEngine};

// defined in a leaf module: `limits` reads it, and `device` reads `limits`
pub use crate::device_name::Device;

/// Which engine `ramus train` uses on CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrainEngineChoice {
    Batched,
    Persistent,
    Auto,
}

impl FromStr for TrainEngineChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "batched" => Ok(TrainEngineChoice::Batched),
            "persistent" => Ok(TrainEngineChoice::Persistent),
            "auto" => Ok(TrainEngineChoice::Auto),
            other => Err(format!(
                "unknown engine `{other}` (known: batched, persistent, auto)"
            )),
        }
    }
}

/// The engine choice that can honour `on_nonfinite`: the persistent
/// engine updates inside its kernel and cannot skip a batch, so with
/// `skip-batch` `persistent` is refused (before any work) and `auto` means
/// the batched engine.
pub fn engine_for_nonfinite(
    choice: TrainEngineChoice,
    on_nonfinite: ramus_exec::OnNonFinite,
) -> Result<TrainEngineChoice, String> {
    if on_nonfinite != ramus_exec::OnNonFinite::SkipBatch {
        return Ok(choice);
    }
    match choice {
        TrainEngineChoice::Persistent => {
            Err("--on-nonfinite skip-batch: the persistent engine applies \
             each update inside its training kernel and cannot skip a batch; use \
             --on-nonfinite stop or --engine batched"
                .into())
        }
        TrainEngineChoice::Auto => Ok(TrainEngineChoice::Batched),
        TrainEngineChoice::Batched => Ok(TrainEngineChoice::Batched),
    }
}

/// The persistent training engine when `choice` asks for it: `None` for
/// the batched engine (asked for, or `auto` falling back after printing
/// why the persistent one cannot run the model or does not fit), an error
/// if `persistent` was forced and cannot run. Its `rpw` search tunes for
/// the run's batch size; what it will allocate is checked against the
/// device (within `budget`) before it allocates ([`Training::fit_device`]).
pub fn persistent_trainer(
    choice: TrainEngineChoice,
    run: &Training<'_>,
    params: &Params<f32>,
    optimizer: OptimizerConfig,
    budget: Option<u64>,
) -> Result<Option<PersistentTrainer>, String> {
    if choice == TrainEngineChoice::Batched {
        return Ok(None);
    }
    if run.device != Device::Cuda {
        return match choice {
            TrainEngineChoice::Persistent => {
                Err("--engine persistent runs on --device cuda".into())
            }
            _ => Ok(None),
        };
    }
    let options = ramus_cuda::persistent::PersistentOptions {
        batch_size: Some(run.batch_size),
        memory_budget: budget,
        ..Default::default()
    };
    let check = |need: &DeviceNeed, room| run.fit_device(need, room);
    let made = PersistentTrainer::with_check(run.model, params, optimizer, &options, &check);
    match made {
        Ok(engine) => Ok(Some(engine)),
        Err(e) if choice == TrainEngineChoice::Auto => {
            logln!("persistent engine unavailable ({e}); training with the batched engine");
            Ok(None)
        }
        Err(e) => Err(format!("--engine persistent: {e}")),
    }
}

/// The training engine of gradient accumulation on one device: the
/// `persistent` trainer if given (its updates split out of its kernel),
/// else the batched engine of `device` (on the swap path if `swap` says),
/// trained data-parallel over a group of one ([`Alone`]), whose steps take
/// several batches.
pub fn accumulating(
    device: Device,
    model: &Model,
    (params, config): (Params<f32>, OptimizerConfig),
    budget: Option<u64>,
    (persistent, swap): (Option<PersistentTrainer>, SwapMode),
) -> Result<Box<dyn TrainEngine<f32>>, String> {
    let alone = || Box::new(Alone);
    if let Some(mut trainer) = persistent {
        trainer.split_updates().map_err(|e| e.to_string())?;
        return Ok(Box::new(DataParallel::new(trainer, alone())));
    }
    Ok(match device {
        Device::Cpu if budget.is_some() => {
            return Err("--device-memory-budget applies to --device cuda".into())
        }
        Device::Cpu => {
            let trainer = CpuTrainer::new(model.clone(), params, config);
            Box::new(DataParallel::new(trainer, alone()))
        }
        Device::Cuda if swap == SwapMode::Off => {
            let engine = cuda_engine(model, budget)?;
            let trainer = CudaTrainer::new(engine, model.clone(), params, config)
                .map_err(|e| format!("--device cuda: {e}"))?;
            Box::new(DataParallel::new(trainer, alone()))
        }
        Device::Cuda => {
            let swap = SwapConfig::with_mode(swap);
            let trainer = swap_trainer(model, (params, config), budget, swap)?;
            Box::new(DataParallel::new(trainer, alone()))
        }
    })
}

/// Sets up the CUDA engine for `model`, using at most `budget` bytes of
/// device memory if given, with an error that says what is missing when
/// CUDA cannot be used here.
pub fn cuda_engine(model: &Model, budget: Option<u64>) -> Result<CudaEngine, String> {
    CudaEngine::new(model, &cuda_options(budget)).map_err(|e| format!("--device cuda: {e}"))
}

/// The CUDA batched engine on GPU `gpu` evaluating `params` of `model`.
pub fn cuda_evaluator(
    model: &Model,
    params: Params<f32>,
    gpu: usize,
) -> Result<Box<dyn TrainEngine<f32>>, String> {
    let options = CudaEngineOptions {
        device: gpu,
        ..CudaEngineOptions::default()
    };
    let err = |e: String| format!("--device cuda, GPU {gpu}: {e}");
    let engine = CudaEngine::new(model, &options).map_err(|e| err(e.to_string()))?;
    let config = OptimizerConfig::forward_only();
    let trainer = CudaTrainer::new(engine, model.clone(), params, config);
    Ok(Box::new(trainer.map_err(|e| err(e.to_string()))?))
}

/// The CUDA engine's options under a device memory `budget`.
fn cuda_options(budget: Option<u64>) -> CudaEngineOptions {
    let mut options = CudaEngineOptions::default();
    options.pool.max_bytes = budget;
    options
}

/// The CUDA batched engine for `model` wrapped for swapping as `swap`
/// says (with [`SwapMode::Off`], the plain engine underneath), training
/// from `params` with a fresh optimizer of `config`.
pub fn swap_trainer(
    model: &Model,
    (params, config): (Params<f32>, OptimizerConfig),
    budget: Option<u64>,
    swap: SwapConfig,
) -> Result<SwapTrainer, String> {
    SwapTrainer::new(model.clone(), &cuda_options(budget), swap, params, config)
        .map_err(|e| format!("--device cuda: {e}"))
}

/// The swap mode of a command: the one given (CUDA only), else `auto` for a
/// CNN on CUDA under a budget (the planner if the iteration does not fit,
/// no swapping if it does), else the plain engine.
pub fn swap_mode(
    device: Device,
    model: &str,
    budget: Option<u64>,
    given: Option<SwapMode>,
) -> Result<SwapMode, String> {
    match (device, given) {
        (Device::Cpu, Some(_)) => Err("--swap applies to --device cuda".into()),
        (Device::Cpu, None) => Ok(SwapMode::Off),
        (Device::Cuda, Some(mode)) => Ok(mode),
        (Device::Cuda, None) if budget.is_some() && ramus_nn::vision::is_vision_model(model) => {
            Ok(SwapMode::Auto)
        }
        (Device::Cuda, None) => Ok(SwapMode::Off),
    }
}

/// The batched training engine for `device`, built for `model` and
/// holding `params` and a fresh optimizer of `config`; a memory budget
/// applies to CUDA only, and so does `swap` (the CUDA engine's swap path).
pub fn engine(
    device: Device,
    model: &Model,
    (params, config): (Params<f32>, OptimizerConfig),
    budget: Option<u64>,
    swap: SwapMode,
) -> Result<Box<dyn TrainEngine<f32>>, String> {
    Ok(match device {
        Device::Cpu if budget.is_some() => {
            return Err("--device-memory-budget applies to --device cuda".into())
        }
        Device::Cpu => Box::new(CpuTrainer::new(model.clone(), params, config)),
        Device::Cuda if swap == SwapMode::Off => {
            let engine = cuda_engine(model, budget)?;
            Box::new(
                CudaTrainer::new(engine, model.clone(), params, config)
                    .map_err(|e| format!("--device cuda: {e}"))?,
            )
        }
        Device::Cuda => Box::new(swap_trainer(
            model,
            (params, config),
            budget,
            SwapConfig::with_mode(swap),
        )?),
    })
}

/// The batched engine for `device` evaluating `params` of `model` (it
/// never trains: its optimizer, plain SGD, keeps no state).
pub fn evaluator(
    device: Device,
    model: &Model,
    params: Params<f32>,
    budget: Option<u64>,
) -> Result<Box<dyn TrainEngine<f32>>, String> {
    let config = OptimizerConfig::forward_only();
    engine(device, model, (params, config), budget, SwapMode::Off)
}

/// `--swap` given (`asked`, not off) with the persistent engine (or auto
/// choosing it): refused, the swap path runs on the batched engine.
pub fn refuse_persistent_swap(asked: Option<SwapMode>, persistent: bool) -> Result<(), String> {
    match asked.filter(|_| persistent) {
        Some(mode) => Err(format!(
            "--swap {mode}: the swap path runs on the batched engine, not on --engine persistent"
        )),
        None => Ok(()),
    }
}

/// `--sync-bn` where it cannot apply: a model without batch norm is
/// refused; a run on one GPU (`ranks` false, e.g. a run of several resumed
/// on one) says that its statistics are already every GPU's.
pub fn check_sync_bn(sync_bn: bool, model: &Model, ranks: bool) -> Result<(), String> {
    if !sync_bn {
        return Ok(());
    }
    let graphs = model.functions.iter().map(|f| &f.forward);
    let normalises = graphs.chain([&model.head.forward]).any(|g| {
        g.nodes
            .iter()
            .any(|n| matches!(n.op(), Some(ramus_core::ops::Op::BatchNorm(_))))
    });
    if !normalises {
        return Err(format!(
            "--sync-bn: model `{}` has no batch norm",
            model.name
        ));
    }
    if !ranks {
        crate::output::noteln!(
            "--sync-bn: one rank, whose batch statistics are already every rank's: nothing to \
             synchronize"
        );
    }
    Ok(())
}
