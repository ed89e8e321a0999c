//! `--engine compiled|batched|auto` with `--device cpu|cuda`: building an
//! inference engine ([`ramus_exec::InferEngine`]) for a model and its
//! parameters, checking ahead that the run fits in host and device memory.
//! `auto` offers both engines of the device to [`ramus_exec::AutoInfer`],
//! which builds each when first needed, leaves out one that cannot run the
//! model or whose set-up cannot pay for itself over the run's batches, and
//! measures the others on the first batch of each shape.

use std::str::FromStr;

use ramus_core::{Model, Params};
use ramus_cpu::compiled::{CpuCompiledEngine, CpuCompiledSchedule};
use ramus_cuda::compiled::{CompiledEngine, CompiledOptions, CompiledSchedule};
use ramus_exec::memory::{DeviceNeed, Pass};
use ramus_exec::{AutoInfer, BatchShape, BatchedInfer, InferEngine, LazyOffer};
use ramus_graph::InputGraph;

use crate::device::{self, Device};
use crate::limits::{HostBudgetArgs, Inference};
use crate::output::noteln;

/// Which inference engine runs (`--engine`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InferKind {
    /// The compiled engine of the device (one generated kernel, or a level
    /// loop on the CPU, per batch).
    Compiled,
    /// The batched engine of the device (the training engine's forward pass).
    Batched,
    /// The faster of the two for each batch shape, measured.
    Auto,
}

impl FromStr for InferKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "compiled" => Ok(InferKind::Compiled),
            "batched" => Ok(InferKind::Batched),
            "auto" => Ok(InferKind::Auto),
            other => Err(format!(
                "unknown engine `{other}` (expected compiled, batched or auto)"
            )),
        }
    }
}

/// How the engines run and what the run will feed them, besides the model
/// and its parameters.
pub struct InferSetup<'a> {
    pub device: Device,
    /// The compiled engines' schedule (leaf tables, recursion); on CUDA
    /// also weight persistence and level ordering.
    pub schedule: CompiledSchedule,
    /// The graphs the run scores, `batch_size` at a time, and the token
    /// vocabulary a per-token table spans: checked against the memory
    /// available before an engine allocates.
    pub graphs: &'a [InputGraph],
    pub batch_size: usize,
    pub vocab: usize,
    pub host: HostBudgetArgs,
    /// The GPU (with `Device::Cuda`).
    pub gpu: usize,
}

impl InferSetup<'_> {
    /// What the run needs, with the compiled engine's per-token tables.
    fn need<'m>(&'m self, model: &'m Model, compiled: bool) -> Inference<'m> {
        let tables = (compiled && self.schedule.leaf_table).then_some(self.vocab);
        let (graphs, b) = (self.graphs, self.batch_size);
        Inference::loaded(model, graphs, b, Pass::Infer, tables, self.device)
    }
}

/// The engine `kind` on `setup.device` for `model` with `params`, after
/// checking that the run fits; an error names what to change. `auto`
/// builds each candidate when a batch shape first needs it, and leaves
/// the compiled engine unbuilt where its estimated set-up (the CPU's
/// per-token tables) exceeds what the batched engine needs for all the
/// run's batches of a shape.
pub fn build_infer_engine<'a>(
    kind: InferKind,
    model: &'a Model,
    params: &'a Params<f32>,
    setup: &'a InferSetup<'a>,
) -> Result<Box<dyn InferEngine<f32> + 'a>, String> {
    match kind {
        InferKind::Compiled => compiled(model, params, setup),
        InferKind::Batched => batched(model, params, setup),
        InferKind::Auto => {
            let (c, b) = match setup.device {
                Device::Cpu => ("cpu-compiled", "cpu-batched"),
                Device::Cuda => ("cuda-compiled", "cuda-batched"),
            };
            let offers = vec![
                LazyOffer {
                    name: c,
                    setup_estimate: compiled_setup_estimate(model, params, setup),
                    speedup_bound: compiled_speedup_bound(setup.device),
                    build: Box::new(move || compiled(model, params, setup)),
                },
                LazyOffer {
                    name: b,
                    setup_estimate: None,
                    speedup_bound: f64::INFINITY,
                    build: Box::new(move || batched(model, params, setup)),
                },
            ];
            let auto = AutoInfer::lazy(offers, |line: &str| noteln!("{line}"))
                .map_err(|e| e.to_string())?
                .with_run(BatchShape::of_chunks(setup.graphs, setup.batch_size));
            Ok(Box::new(auto))
        }
    }
}

/// The compiled engine's set-up, estimated by building it with a sample
/// of its per-token tables (CPU); `None` on CUDA (kernel compilation,
/// often cached, is not estimated: the engine is built and timed) or
/// where the engine cannot be built (the build then says why).
fn compiled_setup_estimate(
    model: &Model,
    params: &Params<f32>,
    setup: &InferSetup<'_>,
) -> Option<f64> {
    match setup.device {
        Device::Cpu => {
            let schedule = cpu_schedule(setup.schedule);
            CpuCompiledEngine::estimate_setup_seconds(model, params, &schedule).ok()
        }
        Device::Cuda => None,
    }
}

/// At most how many times faster a batch the compiled engine runs than the
/// batched one: on the CPU about twice (SST, Tree-LSTM at hidden 64, batches
/// of 10: 0.23 against 0.47 ms), bounded at 2.5; unknown on CUDA.
fn compiled_speedup_bound(device: Device) -> f64 {
    match device {
        Device::Cpu => 2.5,
        Device::Cuda => f64::INFINITY,
    }
}

/// The CPU compiled engine's part of the compiled schedule.
fn cpu_schedule(s: CompiledSchedule) -> CpuCompiledSchedule {
    CpuCompiledSchedule {
        leaf_table: s.leaf_table,
        recursion: s.recursion,
    }
}

/// The compiled engine of the device.
fn compiled<'a>(
    model: &'a Model,
    params: &'a Params<f32>,
    setup: &InferSetup<'_>,
) -> Result<Box<dyn InferEngine<f32> + 'a>, String> {
    let need = setup.need(model, true);
    need.check_host(setup.host)?;
    let s = setup.schedule;
    Ok(match setup.device {
        Device::Cpu => {
            let schedule = cpu_schedule(s);
            let engine = CpuCompiledEngine::with_schedule(model, params, &schedule);
            Box::new(engine.map_err(|e| e.to_string())?)
        }
        Device::Cuda => {
            let options = CompiledOptions {
                schedule: s,
                device: setup.gpu,
                ..CompiledOptions::default()
            };
            let check = |n: &DeviceNeed, room| need.fit_device(n, room);
            let engine = CompiledEngine::with_check(model, params, &options, &check)
                .map_err(|e| format!("--device cuda: {e}"))?;
            Box::new(engine)
        }
    })
}

/// The batched engine of the device.
fn batched<'a>(
    model: &'a Model,
    params: &'a Params<f32>,
    setup: &InferSetup<'_>,
) -> Result<Box<dyn InferEngine<f32> + 'a>, String> {
    let need = setup.need(model, false);
    need.check_host(setup.host)?;
    let engine = match setup.device {
        Device::Cuda => device::cuda_evaluator(model, params.clone(), setup.gpu)?,
        Device::Cpu => device::evaluator(setup.device, model, params.clone(), None)?,
    };
    need.check_device(engine.as_ref(), None)?;
    Ok(Box::new(BatchedInfer::new(engine)))
}
