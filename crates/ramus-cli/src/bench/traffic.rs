//! `ramus bench --profile-inputs N`: one training pass per batch size over
//! the first N trees on the batched or the persistent engine, each pass the
//! one stretch an attached profiler records, so that
//! `ncu --replay-mode app-range --metrics …` counts the bytes an engine
//! loads to train N inputs (VPPS Table I). Nothing is timed; each pass
//! prints a line with its batches and the weights' size: all parameters for
//! the batched engine, the matrices held in registers (loaded once per
//! batch) for the persistent one.

use ramus_core::{Model, Params};
use ramus_cuda::{CudaDevice, CudaTrainer};
use ramus_exec::Batch;
use ramus_exec::{OptimizerConfig, OptimizerKind, TrainEngine};
use ramus_graph::{BatchingPolicy, InputGraph};

use super::common::BenchArgs;
use super::persistent::tuned_engine;
use crate::device::{cuda_engine, Device};
use crate::output::outln;
use crate::result::AnyResult;

pub fn run(
    a: &BenchArgs,
    inputs: usize,
    model: &Model,
    params: &Params<f32>,
    trees: &[InputGraph],
    sizes: &[usize],
) -> AnyResult {
    if inputs == 0 || inputs > trees.len() {
        return Err(format!(
            "--profile-inputs {inputs}: expected 1 to the {} trees in {}",
            trees.len(),
            a.trees.display()
        )
        .into());
    }
    if a.device != Device::Cuda {
        return Err("--profile-inputs runs on --device cuda".into());
    }
    let device = CudaDevice::open(0)?;
    let config = OptimizerConfig::new(OptimizerKind::Sgd, 0.05);
    let profiled: Vec<&InputGraph> = trees[..inputs].iter().collect();
    // `size`: what the pass's line says of the weights' size
    let report = |bs: usize, size: (&str, usize)| -> AnyResult {
        outln!(
            "{}",
            serde_json::json!({
                "profiled": a.engine, "model": a.model, "hidden": a.hidden, "batch": bs,
                "inputs": inputs, "batches": inputs.div_ceil(bs),
                "nodes": profiled.iter().map(|g| g.len()).sum::<usize>(),
                size.0: size.1,
            })
        )
    };
    match a.engine.as_str() {
        "batched" => {
            let engine = cuda_engine(model, a.device_memory_budget)?;
            let mut engine = CudaTrainer::new(engine, model.clone(), params.clone(), config)?;
            let param_bytes = 4 * params.values.iter().map(|t| t.len()).sum::<usize>();
            for &bs in sizes {
                let mut step = |batch: &[&InputGraph]| -> AnyResult {
                    let b = Batch::new(model, batch.to_vec(), BatchingPolicy::Cavs)?;
                    engine.train_step(&b)?;
                    Ok(())
                };
                // unprofiled: the first step of a size compiles and allocates
                step(&profiled[..bs.min(inputs)])?;
                device.profiled(|| profiled.chunks(bs).try_for_each(&mut step))?;
                report(bs, ("param_bytes", param_bytes))?;
            }
        }
        "persistent" => {
            let largest = sizes.iter().copied().max().unwrap_or(1).min(inputs);
            let mut engine = tuned_engine(a, model, params, config, &trees[..largest])?;
            let plan = engine.register_plan();
            let weight_bytes = 4 * plan.matrices.iter().map(|m| m.rows * m.cols).sum::<usize>();
            for &bs in sizes {
                engine.train_batch(model, &profiled[..bs.min(inputs)])?;
                device.profiled(|| {
                    profiled
                        .chunks(bs)
                        .try_for_each(|batch| engine.train_batch(model, batch).map(drop))
                })?;
                report(bs, ("register_weight_bytes", weight_bytes))?;
            }
        }
        other => {
            return Err(format!(
                "--profile-inputs profiles the batched or the persistent engine, not `{other}`"
            )
            .into())
        }
    }
    Ok(())
}
