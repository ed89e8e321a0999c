//! `--device`: which engine runs a command (the CPU batched engine or the
//! CUDA batched engine), and building it for a model.

use std::str::FromStr;

use ramus_core::Model;
use ramus_cpu::CpuEngine;
use ramus_cuda::{CudaEngine, CudaEngineOptions};
use ramus_nn::Engine;

/// Where a command runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
}

impl FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda),
            other => Err(format!("unknown device `{other}` (known: cpu, cuda)")),
        }
    }
}

/// Sets up the CUDA engine for `model`, using at most `budget` bytes of
/// device memory if given, with an error that says what is missing when
/// CUDA cannot be used here.
pub fn cuda_engine(model: &Model, budget: Option<u64>) -> Result<CudaEngine, String> {
    let mut options = CudaEngineOptions::default();
    options.pool.max_bytes = budget;
    CudaEngine::new(model, &options).map_err(|e| format!("--device cuda: {e}"))
}

/// The engine for `device`; a memory budget applies to CUDA only.
pub fn engine(
    device: Device,
    model: &Model,
    budget: Option<u64>,
) -> Result<Box<dyn Engine<f32>>, String> {
    Ok(match device {
        Device::Cpu if budget.is_some() => {
            return Err("--device-memory-budget applies to --device cuda".into())
        }
        Device::Cpu => Box::new(CpuEngine::<f32>::new()),
        Device::Cuda => Box::new(cuda_engine(model, budget)?),
    })
}
