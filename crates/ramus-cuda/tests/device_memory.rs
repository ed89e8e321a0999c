//! The persistent and compiled engines check what they will allocate
//! against the device before they allocate it (issue 30, class 3): with a
//! budget too small they are refused, with the check's message, before
//! anything large is taken from the device; with room, what a run takes
//! (the pools' buffers at their peak, and the device's free memory before
//! and after) stays within the estimate, and the estimate is not more than
//! twice what the run took. Skips with a notice where no CUDA driver is
//! found.

mod common;

use std::cell::RefCell;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ramus_core::{Model, Params};
use ramus_cuda::compiled::{CompiledEngine, CompiledOptions};
use ramus_cuda::persistent::{PersistentEngine, PersistentOptions, PersistentTrainer};
use ramus_cuda::{CudaDevice, CudaError, PoolStats};
use ramus_exec::memory::{DeviceNeed, DeviceRoom, Fitted};
use ramus_exec::{OptimizerConfig, OptimizerKind};
use ramus_graph::random::random_tree;
use ramus_graph::InputGraph;
use ramus_nn::{build_model, ModelConfig};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const MIB: u64 = 1 << 20;

/// The tests measure the device's free memory: one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The device, held by this test alone (`None` without CUDA).
fn device() -> Option<(MutexGuard<'static, ()>, std::sync::Arc<CudaDevice>)> {
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    common::device().map(|d| (guard, d))
}

/// What the estimates leave out (`ramus_cuda::memory`): the kernels' code,
/// cuBLAS's workspaces and the driver's own reservations, which the device
/// loses beside the pools.
const NOT_COUNTED: u64 = 256 * MIB;

fn cache_dir() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("ramus-device-memory-{}", std::process::id()))
}

fn model(hidden: usize, vocab: usize) -> Model {
    let cfg = ModelConfig {
        vocab,
        hidden,
        classes: 5,
    };
    build_model("treelstm", &cfg).expect("model")
}

fn trees(count: usize, leaves: usize, vocab: usize, seed: u64) -> Vec<InputGraph> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..count)
        .map(|_| random_tree(&mut rng, leaves, &[2], vocab as u32, 5).expect("tree"))
        .collect()
}

fn free(device: &CudaDevice) -> u64 {
    device.free_memory().expect("cuMemGetInfo") as u64
}

/// Asserts that `made` was refused by the check, with `needle` in its
/// message, without the device losing more than a few MiB.
fn refused<T>(
    what: &str,
    device: &CudaDevice,
    before: u64,
    made: Result<T, CudaError>,
    needle: &str,
) {
    let Err(e) = made else {
        panic!("{what}: set up although it cannot fit");
    };
    assert!(matches!(e, CudaError::DoesNotFit(_)), "{what}: {e}");
    assert!(e.to_string().contains(needle), "{what}: {e}");
    let taken = before.saturating_sub(free(device));
    assert!(
        taken < 8 * MIB,
        "{what}: {} MiB taken by a refused set-up",
        taken / MIB
    );
}

/// What a run took: the device's free memory before it less after, and
/// the pools' buffers at their peak, less what the pools reserved and never
/// used (their geometric growth, which they do without when the device is
/// short). Prints the numbers.
fn compare(what: &str, estimate: u64, before: u64, after: u64, pools: &[PoolStats]) {
    let taken = before.saturating_sub(after);
    let peak: u64 = pools.iter().map(|p| p.peak_in_use_bytes).sum();
    let unused: u64 = pools
        .iter()
        .map(|p| p.reserved_bytes - p.peak_in_use_bytes)
        .sum();
    let used = taken.saturating_sub(unused);
    println!(
        "{what}: estimate {} MiB; the device lost {} MiB ({} MiB once the pools' unused \
         reservations are taken off); the pools' buffers peaked at {} MiB",
        estimate / MIB,
        taken / MIB,
        used / MIB,
        peak / MIB
    );
    assert!(
        peak <= estimate,
        "{what}: buffers peaked at {peak} over the estimate {estimate}"
    );
    assert!(
        used <= estimate + NOT_COUNTED,
        "{what}: the device lost {used} bytes, over the estimate {estimate} and what it leaves out"
    );
    assert!(
        estimate <= 2 * taken,
        "{what}: the estimate {estimate} is over twice the {taken} taken"
    );
}

/// What [`check_run`] found: the model-sized parts and the whole run.
#[derive(Clone, Copy, Debug, Default)]
struct Checked {
    parts: u64,
    total: u64,
}

/// A check of `need` for batches of `batch` of `train` and of `dev`, in
/// order (training and evaluation), and what the largest need beyond
/// (measured on the costliest graphs once the rest fits); records what it
/// counted.
fn check_run(
    model: &Model,
    train: &[InputGraph],
    dev: &[InputGraph],
    batch: usize,
    need: &DeviceNeed,
    room: DeviceRoom,
    checked: &RefCell<Checked>,
) -> Result<Fitted, String> {
    let train_batch = need
        .train
        .as_ref()
        .map_or(0, |c| c.graph_costs(model, train).largest_chunk(batch));
    let eval_batch = need
        .eval
        .as_ref()
        .map_or(0, |c| c.graph_costs(model, dev).largest_chunk(batch));
    let parts = need.parts_bytes();
    let fits = |total: u64| {
        *checked.borrow_mut() = Checked { parts, total };
        match total <= room.bytes() {
            true => Ok(()),
            false => Err(format!(
                "device memory: the run needs {total} bytes, more than the {} it may take",
                room.bytes()
            )),
        }
    };
    fits(parts + train_batch + eval_batch)?;
    let extra = |measure: &Option<ramus_exec::memory::BatchExtra>,
                 cost: Option<&ramus_exec::memory::ActivationCost>,
                 graphs: &[InputGraph]| {
        match (measure, cost) {
            (Some(measure), Some(cost)) if !graphs.is_empty() => {
                let costs = cost.graph_costs(model, graphs);
                let costliest = costs.costliest_graphs(batch);
                let refs: Vec<&InputGraph> = costliest.into_iter().map(|i| &graphs[i]).collect();
                measure(&refs)
            }
            _ => Ok(0),
        }
    };
    let train_extra = extra(&need.train_extra, need.train.as_ref(), train)?;
    let eval_extra = extra(&need.eval_extra, need.eval.as_ref(), dev)?;
    fits(parts + train_batch + train_extra + eval_batch + eval_extra)?;
    Ok(Fitted {
        train_batch,
        train_extra,
        eval_batch,
        eval_extra,
    })
}

/// The model-sized parts of what `set_up` is about to allocate: asked of
/// the check it is given, which then refuses it (before anything compiles,
/// the budget being set).
fn parts<T>(
    set_up: impl FnOnce(ramus_cuda::memory::DeviceCheck<'_>) -> Result<T, CudaError>,
) -> u64 {
    let seen = RefCell::new(None);
    let probe = |need: &DeviceNeed, _: DeviceRoom| {
        *seen.borrow_mut() = Some(need.parts_bytes());
        Err("probed".to_string())
    };
    assert!(set_up(&probe).is_err());
    seen.into_inner().expect("the check was asked")
}

/// `set_up` (given a budget and a check) is refused by `check`, which
/// records what it counted, on a budget of the model's parts and 64 MiB:
/// room for the model, not for its batches.
fn refused_for_the_batch<T>(
    what: &str,
    device: &CudaDevice,
    checked: &RefCell<Checked>,
    check: ramus_cuda::memory::DeviceCheck<'_>,
    set_up: impl Fn(u64, ramus_cuda::memory::DeviceCheck<'_>) -> Result<T, CudaError>,
) {
    let budget = parts(|probe| set_up(u64::MAX, probe)) + 64 * MIB;
    let before = free(device);
    let made = set_up(budget, check);
    let what = format!("{what}, batch over budget");
    refused(&what, device, before, made, "device memory: the run needs");
    let Checked { parts, total } = *checked.borrow();
    assert!(
        parts < budget && budget < total,
        "{what}: {parts} {budget} {total}"
    );
}

fn persistent_options(budget: Option<u64>) -> PersistentOptions {
    PersistentOptions {
        rpw: Some(2),
        bridge: Some(false),
        cache_dir: Some(cache_dir()),
        memory_budget: budget,
        ..PersistentOptions::default()
    }
}

#[test]
fn the_persistent_engine_is_refused_before_it_allocates_what_cannot_fit() {
    let Some((_alone, device)) = device() else {
        return;
    };
    let model = model(512, 20_000);
    let params = Params::<f32>::init(&model, 1);
    let config = OptimizerConfig::new(OptimizerKind::Adam, 0.001);
    let param_bytes = ramus_exec::memory::param_bytes(&model);
    // a budget under the parameters alone: refused before anything compiles
    let before = free(&device);
    let started = Instant::now();
    let made = PersistentTrainer::new(
        &model,
        &params,
        config,
        &persistent_options(Some(param_bytes / 2)),
    );
    refused(
        "persistent, model over budget",
        &device,
        before,
        made,
        "the budget of",
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    // the trainer's check sees the engine that evaluates beside it
    let seen = RefCell::new(None);
    let probe = |need: &DeviceNeed, _: DeviceRoom| {
        *seen.borrow_mut() = Some(need.clone());
        Err("probed".to_string())
    };
    let options = persistent_options(Some(u64::MAX));
    assert!(PersistentTrainer::with_check(&model, &params, config, &options, &probe).is_err());
    let need = seen.into_inner().expect("the check was asked");
    let named: Vec<&str> = need.parts.iter().map(|p| p.0).collect();
    assert!(
        named.contains(&"the evaluating engine's parameters"),
        "{named:?}"
    );
    assert!(need.train.is_some() && need.eval.is_some() && need.train_kept);
    assert!(need.train_extra.is_some(), "the scripts are measured");
    // room for the model, not for a batch of long sentences
    let train = trees(64, 400, 20_000, 1);
    let checked = RefCell::new(Checked::default());
    let check =
        |need: &DeviceNeed, room| check_run(&model, &train, &train, 64, need, room, &checked);
    refused_for_the_batch("persistent", &device, &checked, &check, |budget, check| {
        let options = persistent_options(Some(budget));
        PersistentTrainer::with_check(&model, &params, config, &options, check)
    });
}

#[test]
fn a_persistent_run_takes_what_was_estimated_and_not_half_as_little() {
    let Some((_alone, device)) = device() else {
        return;
    };
    let model = model(512, 20_000);
    let params = Params::<f32>::init(&model, 1);
    let config = OptimizerConfig::new(OptimizerKind::Adam, 0.001);
    let train = trees(1024, 60, 20_000, 2);
    let batch = 128;
    let checked = RefCell::new(Checked::default());
    let check =
        |need: &DeviceNeed, room| check_run(&model, &train, &[], batch, need, room, &checked);
    let before = free(&device);
    let options = persistent_options(None);
    let mut engine = PersistentEngine::with_check(&model, &params, config, &options, &check)
        .expect("a run that fits is set up");
    // windows of batches in flight, as the trainer submits them
    let batches: Vec<Vec<&InputGraph>> = train.chunks(batch).map(|c| c.iter().collect()).collect();
    for window in batches.chunks(ramus_cuda::persistent::prepared_ahead()) {
        for step in engine.submit_many(&model, window).expect("steps") {
            assert!(step.loss.is_finite(), "{step:?}");
        }
    }
    engine.finish().expect("steps");
    device.synchronize().expect("synchronize");
    let after = free(&device);
    compare(
        "persistent",
        checked.borrow().total,
        before,
        after,
        &[engine.pool_stats()],
    );
}

fn compiled_options(budget: Option<u64>) -> CompiledOptions {
    CompiledOptions {
        cache_dir: Some(cache_dir()),
        memory_budget: budget,
        ..CompiledOptions::default()
    }
}

#[test]
fn the_compiled_engine_is_refused_before_it_allocates_what_cannot_fit() {
    let Some((_alone, device)) = device() else {
        return;
    };
    // per-token tables of 200000 words
    let model = model(256, 200_000);
    let params = Params::<f32>::init(&model, 1);
    let param_bytes = ramus_exec::memory::param_bytes(&model);
    let before = free(&device);
    let made = CompiledEngine::new(&model, &params, &compiled_options(Some(param_bytes + MIB)));
    refused(
        "compiled, tables over budget",
        &device,
        before,
        made,
        "per-token tables",
    );
    let trees = trees(256, 600, 200_000, 4);
    let checked = RefCell::new(Checked::default());
    let check = |need: &DeviceNeed, room| check_run(&model, &[], &trees, 256, need, room, &checked);
    refused_for_the_batch("compiled", &device, &checked, &check, |budget, check| {
        CompiledEngine::with_check(&model, &params, &compiled_options(Some(budget)), check)
    });
}

#[test]
fn a_compiled_run_takes_what_was_estimated_and_not_half_as_little() {
    let Some((_alone, device)) = device() else {
        return;
    };
    let model = model(256, 200_000);
    let params = Params::<f32>::init(&model, 1);
    let trees = trees(1024, 60, 200_000, 5);
    let batch = 512;
    let checked = RefCell::new(Checked::default());
    let check =
        |need: &DeviceNeed, room| check_run(&model, &[], &trees, batch, need, room, &checked);
    let before = free(&device);
    let mut engine = CompiledEngine::with_check(&model, &params, &compiled_options(None), &check)
        .expect("a run that fits is set up");
    for chunk in trees.chunks(batch) {
        let refs: Vec<&InputGraph> = chunk.iter().collect();
        engine.infer(&refs).expect("scores");
    }
    device.synchronize().expect("synchronize");
    let after = free(&device);
    compare(
        "compiled",
        checked.borrow().total,
        before,
        after,
        &[engine.pool_stats()],
    );
}
