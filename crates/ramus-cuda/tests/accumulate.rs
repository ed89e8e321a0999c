//! Gradient accumulation with batch norm on the CUDA engines: each batch
//! of a step blends its statistics into the running ones, as the CPU
//! engine does, and a step skipped as not finite puts back those of before
//! its first batch. Skips with a notice without a GPU.

mod common;

use ramus_conformance::close::{assert_close, Tolerance};
use ramus_conformance::zoo::{batch, with_nan_pixel, Case};
use ramus_cpu::CpuTrainer;
use ramus_cuda::{CudaEngine, CudaEngineOptions, CudaTrainer};
use ramus_cuda::{SwapConfig, SwapMode, SwapTrainer};
use ramus_exec::data_parallel::{Alone, DataParallel, SplitStep, StepPlan};
use ramus_exec::{Batch, OptimizerConfig, OptimizerKind, TrainEngine};
use ramus_graph::InputGraph;

/// Statistics summed in another order on the device.
const DEVICE: Tolerance = Tolerance::tensor(1e-5);

/// Two steps of two batches at a learning rate of 0, the second skipped
/// (a NaN pixel in its second batch): the buffers after each.
fn buffers_after_steps<E: SplitStep<f32>>(engine: E, case: &Case) -> [Vec<Vec<f32>>; 2] {
    let of = |ids: std::ops::Range<usize>| -> Vec<&InputGraph> {
        ids.map(|i| &case.graphs[i]).collect()
    };
    let broken = with_nan_pixel(&case.graphs[4]);
    let mut nan = of(5..8);
    nan.insert(0, &broken);
    let batches: [Batch; 3] = [
        batch(&case.model, &of(0..4)),
        batch(&case.model, &of(4..8)),
        batch(&case.model, &nan),
    ];
    let plan = StepPlan::of(&case.model, &of(0..8)).unwrap();
    let earlier = StepPlan {
        last: false,
        ..plan.clone()
    };
    let mut dp = DataParallel::new(engine, Box::new(Alone));
    let buffers = |dp: &mut DataParallel<f32, E>| -> Vec<Vec<f32>> {
        let state = dp.state().unwrap();
        (0..case.model.params.len())
            .filter(|&p| case.model.is_buffer(p))
            .map(|p| state.params.values[p].data().to_vec())
            .collect()
    };
    dp.step(Some(&batches[0]), &earlier).unwrap();
    dp.step_shard(Some(&batches[1]), &plan).unwrap();
    let after_one = buffers(&mut dp);
    dp.step(Some(&batches[0]), &earlier).unwrap();
    let skipped = dp.step_shard(Some(&batches[2]), &plan);
    assert!(skipped.is_err(), "a NaN pixel gave {skipped:?}");
    [after_one, buffers(&mut dp)]
}

#[test]
fn accumulated_steps_blend_every_batch_and_a_skipped_one_puts_them_back() {
    if !common::cuda_ready("skipping accumulation with batch norm on CUDA") {
        return;
    }
    let case = Case::new("resnet", 8, 1, 17).unwrap();
    let config = OptimizerConfig::new(OptimizerKind::Sgd, 0.0);
    let params = || case.params(5);
    let cpu = CpuTrainer::new(case.model.clone(), params(), config);
    let [want, _] = buffers_after_steps(cpu, &case);
    let engine = || CudaEngine::new(&case.model, &CudaEngineOptions::default()).unwrap();
    let batched = CudaTrainer::new(engine(), case.model.clone(), params(), config).unwrap();
    let swap = SwapConfig::with_mode(SwapMode::Naive);
    let options = CudaEngineOptions::default();
    let swapping = SwapTrainer::new(case.model.clone(), &options, swap, params(), config).unwrap();
    let runs = [
        ("batched", buffers_after_steps(batched, &case)),
        ("swap path", buffers_after_steps(swapping, &case)),
    ];
    for (name, [one, skipped]) in runs {
        for (b, (w, g)) in want.iter().zip(&one).enumerate() {
            assert_close(&format!("{name}: buffer {b}"), w, g, DEVICE);
        }
        assert_eq!(one, skipped, "{name}: the skipped step's statistics stayed");
    }
}
