//! Gradient sums overlapped with the batched engine's backward pass. With
//! buckets small enough that a model has many, every bucket a data-parallel
//! step hands to its group holds that bucket's final gradients (a bucket
//! summed before its last gradient is in would hold a part of them), and
//! the step's update is that of the engine alone; the first bucket is
//! summed before the backward pass ends; an embedding table is summed as
//! the rows the step touched. The group here is a
//! stand-in for two ranks whose second adds nothing: it reads each buffer
//! when asked to sum it. Skips with a notice without a GPU.

mod common;

use cudarc::driver::{result as driver, sys as cu};
use ramus_conformance::close::{assert_close, Tolerance};
use ramus_conformance::zoo::{batch, Case};
use ramus_core::{Grads, Model, Params};
use ramus_cuda::persistent::{PersistentOptions, PersistentTrainer};
use ramus_cuda::{CudaEngine, CudaEngineOptions, CudaTrainer};
use ramus_exec::data_parallel::{Collective, GradBuffer, SplitStep, StepPlan};
use ramus_exec::{Batch, Mode, OptimizerConfig, OptimizerKind, TrainEngine};
use ramus_graph::InputGraph;

/// The same kernels in the same order: only atomics may reorder sums.
const SAME: Tolerance = Tolerance::tensor(1e-5);

/// Rank 0 of two, the other contributing zeros: records what each sum is
/// asked to sum at the moment it is asked, once the stream it is ordered
/// on has written it.
#[derive(Default)]
struct Recorder {
    sums: Vec<Vec<f32>>,
}

impl Collective<f32> for Recorder {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        2
    }
    fn sum_scalars(&mut self, _values: &mut [f64]) -> ramus_exec::Result<()> {
        Ok(())
    }
    fn sum_buffers(
        &mut self,
        buffers: Vec<GradBuffer<'_, f32>>,
        scale: f64,
    ) -> ramus_exec::Result<()> {
        assert_eq!(scale, 1.0, "a batch that is the whole step sums at scale 1");
        for b in buffers {
            let GradBuffer::Device(d) = b else { continue };
            let mut host = vec![0f32; d.len];
            // SAFETY: the engine hands over a live buffer of `len` floats
            // ordered on a live stream of the current context.
            unsafe {
                driver::stream::synchronize(d.stream as cu::CUstream).unwrap();
                driver::memcpy_dtoh_sync(&mut host, d.ptr).unwrap();
            }
            self.sums.push(host);
        }
        Ok(())
    }
}

/// The two figures of a trainer's report on its sums (milliseconds a
/// step): from the first bucket to the loss, and after the backward pass.
fn sum_times(report: &str) -> (f64, f64) {
    let ms: Vec<f64> = report
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(ms.len(), 2, "{report}");
    (ms[0], ms[1])
}

/// The batched engine's loss and gradients (trained parameters in order,
/// flattened) of `b` at `params`.
fn batched_grads(model: &Model, params: &Params<f32>, b: &Batch<'_>) -> (Option<f64>, Vec<f32>) {
    let mut engine = CudaEngine::new(model, &CudaEngineOptions::default()).unwrap();
    let loss = engine.forward(model, params, b, Mode::Train).unwrap().loss;
    let mut grads = Grads::zeros(model);
    engine.backward(model, params, b, &mut grads).unwrap();
    let trained = (0..model.params.len()).filter(|&p| !model.is_buffer(p));
    let flat = trained
        .flat_map(|p| grads.values[p].data().to_vec())
        .collect();
    (loss, flat)
}

fn sorted(mut v: Vec<f32>) -> Vec<f32> {
    v.sort_by(f32::total_cmp);
    v
}

/// One step of `name` on 6 graphs through the split step with 64-byte
/// buckets: each bucket's recorded sum against the engine's gradients
/// (as sorted values: the test does not know the buffer's layout), and
/// the parameters after it against the engine alone's step.
fn check(name: &'static str) {
    let case = Case::new(name, 6, 1, 17).unwrap();
    let model = &case.model;
    let graphs: Vec<&InputGraph> = case.graphs.iter().collect();
    let b = batch(model, &graphs);
    let config = OptimizerConfig::new(OptimizerKind::Adam, 1e-2);
    let params = case.params(5);

    let (loss, want) = batched_grads(model, &params, &b);

    let options = CudaEngineOptions {
        bucket_bytes: Some(64),
        ..CudaEngineOptions::default()
    };
    let engine = CudaEngine::new(model, &options).unwrap();
    let mut split = CudaTrainer::new(engine, model.clone(), params.clone(), config).unwrap();
    let mut recorder = Recorder::default();
    let plan = StepPlan::of(model, &graphs).unwrap();
    split.split_step(&mut recorder, Some(&b), &plan).unwrap();
    split.finish().unwrap();
    let (span, exposed) = sum_times(&split.timing_report().expect("a report of the sums"));
    // the first bucket was summed before the backward pass ended
    assert!(
        span > exposed && exposed >= 0.0,
        "{name}: {span} ms, {exposed} after the pass"
    );
    let summed = std::mem::take(&mut recorder.sums);
    assert!(
        summed.len() > 3,
        "{name}: {} sums: buckets of 64 bytes",
        summed.len()
    );
    let (last, buckets) = summed.split_last().unwrap();
    assert_eq!(last.len(), 1, "{name}: the loss is summed last");
    let want_loss = loss.unwrap() as f32;
    assert_close(&format!("{name}: summed loss"), &[want_loss], last, SAME);
    // an embedding table is summed as the rows the step touched, whose
    // gradients are the table's only ones that are not zero
    let nonzero = |v: Vec<f32>| sorted(v.into_iter().filter(|&x| x != 0.0).collect());
    let got: Vec<f32> = buckets.iter().flatten().copied().collect();
    if name == "treelstm" {
        let n = got.len();
        assert!(
            n < want.len(),
            "{name}: {n} floats summed, the table's untouched rows too"
        );
    }
    assert_close(
        &format!("{name}: buckets"),
        &nonzero(want),
        &nonzero(got),
        SAME,
    );

    assert_trains_as_alone(name, &mut split, (params, config), &b, SAME);
}

/// `split`'s parameters against those of the batched engine alone after
/// one step on `b` from `params`, within `tol`.
fn assert_trains_as_alone(
    what: &str,
    split: &mut dyn TrainEngine<f32>,
    (params, config): (Params<f32>, OptimizerConfig),
    b: &Batch<'_>,
    tol: Tolerance,
) {
    let model = split.model().clone();
    let engine = CudaEngine::new(&model, &CudaEngineOptions::default()).unwrap();
    let mut alone = CudaTrainer::new(engine, model.clone(), params, config).unwrap();
    alone.submit(std::slice::from_ref(b)).unwrap();
    alone.finish().unwrap();
    let (a, s) = (alone.state().unwrap(), split.state().unwrap());
    for (p, (x, y)) in a.params.values.iter().zip(&s.params.values).enumerate() {
        let what = format!("{what}: parameter {}", model.params[p].name);
        assert_close(&what, x.data(), y.data(), tol);
    }
}

#[test]
fn every_bucket_is_summed_once_its_gradients_are_final() {
    if !common::cuda_ready("skipping overlapped gradient sums") {
        return;
    }
    for name in ["resnet", "treelstm"] {
        check(name);
    }
}

/// Two batches as one accumulated step through the split step (the
/// earlier one's gradients are added to each bucket before its sum): the
/// parameters after it against the engine alone on one batch of both.
fn check_accumulated(name: &'static str) {
    let case = Case::new(name, 6, 1, 17).unwrap();
    let model = &case.model;
    let graphs: Vec<&InputGraph> = case.graphs.iter().collect();
    let config = OptimizerConfig::new(OptimizerKind::Sgd, 0.1);
    let params = case.params(5);
    let options = CudaEngineOptions {
        bucket_bytes: Some(64),
        ..CudaEngineOptions::default()
    };
    let engine = CudaEngine::new(model, &options).unwrap();
    let mut split = CudaTrainer::new(engine, model.clone(), params.clone(), config).unwrap();
    let plan = StepPlan::of(model, &graphs).unwrap();
    let earlier = StepPlan {
        last: false,
        ..plan.clone()
    };
    let mut recorder = Recorder::default();
    let (first, second) = (batch(model, &graphs[..2]), batch(model, &graphs[2..]));
    split
        .split_step(&mut recorder, Some(&first), &earlier)
        .unwrap();
    split
        .split_step(&mut recorder, Some(&second), &plan)
        .unwrap();
    split.finish().unwrap();
    let what = format!("{name}, accumulated");
    assert_trains_as_alone(
        &what,
        &mut split,
        (params, config),
        &batch(model, &graphs),
        SAME,
    );
}

#[test]
fn an_accumulated_step_sums_its_earlier_batches_with_the_last() {
    if !common::cuda_ready("skipping overlapped gradient sums") {
        return;
    }
    // AlexNet: a CNN without batch norm, whose batches' gradients add up
    // to those of one batch of them all
    for name in ["alexnet", "treelstm"] {
        check_accumulated(name);
    }
}

/// The persistent engine's split step sums its gradient slots after its
/// kernel, an embedding table as the rows the step touched: what it hands
/// over holds every non-zero gradient of the batched engine's backward
/// pass (float tolerance: another kernel), in fewer floats than the
/// gradients; the parameters after the step are the batched engine's.
#[test]
fn the_persistent_engine_sums_a_tables_touched_rows() {
    if !common::cuda_ready("skipping the persistent engine's sums") {
        return;
    }
    let case = Case::new("treelstm", 6, 1, 17).unwrap();
    let model = &case.model;
    let graphs: Vec<&InputGraph> = case.graphs.iter().collect();
    let b = batch(model, &graphs);
    let config = OptimizerConfig::new(OptimizerKind::Sgd, 0.1);
    let params = case.params(5);
    let (_, want) = batched_grads(model, &params, &b);

    let options = PersistentOptions::default();
    let mut persistent = PersistentTrainer::new(model, &params, config, &options).unwrap();
    persistent.split_updates().unwrap();
    let mut recorder = Recorder::default();
    let plan = StepPlan::of(model, &graphs).unwrap();
    persistent
        .split_step(&mut recorder, Some(&b), &plan)
        .unwrap();
    persistent.finish().unwrap();
    let (last, slots) = recorder.sums.split_last().unwrap();
    assert_eq!(last.len(), 1, "the loss is summed last");
    let got: Vec<f32> = slots.iter().flatten().copied().collect();
    assert!(
        got.len() < want.len(),
        "{} floats summed of {}",
        got.len(),
        want.len()
    );
    let nonzero = |v: Vec<f32>| sorted(v.into_iter().filter(|&x| x != 0.0).collect());
    let kernels = Tolerance::tensor(1e-4);
    assert_close("persistent sums", &nonzero(want), &nonzero(got), kernels);
    let start = (params, config);
    assert_trains_as_alone("persistent", &mut persistent, start, &b, kernels);
}
