//! `ramus bench --engine persistent`: training throughput of the persistent
//! (VPPS) engine per batch size, against the batched CUDA engine on the
//! same batches in the same process (and the PyTorch anchor with
//! `--anchor`).

use ramus_core::{Model, Params};
use ramus_cuda::persistent::{prepared_ahead, PersistentEngine, PersistentOptions, PersistentStep};
use ramus_cuda::CudaTrainer;
use ramus_exec::{OptimizerConfig, OptimizerKind};
use ramus_graph::{BatchingPolicy, InputGraph};

use super::common::{median_time, run_anchor, train_time, BenchArgs};
use crate::result::AnyResult;

use crate::device::{cuda_engine, Device};
use crate::limits::Inference;
use crate::output::outln;
use ramus_exec::memory::{DeviceNeed, Pass};

/// The batched engine the persistent one is compared with, training
/// `params` with `config`.
fn batched_trainer(
    a: &BenchArgs,
    model: &Model,
    params: &Params<f32>,
    config: OptimizerConfig,
) -> AnyResult<CudaTrainer> {
    let engine = cuda_engine(model, a.device_memory_budget)?;
    Ok(CudaTrainer::new(
        engine,
        model.clone(),
        params.clone(),
        config,
    )?)
}

pub fn run(
    a: &BenchArgs,
    model: &Model,
    params: &Params<f32>,
    trees: &[InputGraph],
    sizes: &[usize],
) -> AnyResult<Vec<serde_json::Value>> {
    if a.device != Device::Cuda {
        return Err("--engine persistent runs on --device cuda".into());
    }
    let config = OptimizerConfig::new(OptimizerKind::Sgd, 0.05);
    // made after the first persistent engine, whose set-up then includes
    // the CUDA context as a training run's does
    let mut batched = None;
    let mut results = Vec::new();
    for &bs in sizes {
        // an engine tuned for this batch size, as training at it would be
        // (the previous size's is dropped first: one holds the device's
        // pool at a time)
        let mut persistent = tuned_engine(a, model, params, config, &trees[..bs])?;
        let batched = match &mut batched {
            Some(engine) => engine,
            None => batched.insert(batched_trainer(a, model, params, config)?),
        };
        let batch: Vec<&InputGraph> = trees[..bs].iter().collect();
        let nodes: usize = batch.iter().map(|g| g.len()).sum();
        // one synchronous batch for the step's own numbers, then the
        // overlapped stream of batches the trainer runs: windows of batches
        // prepared in parallel while the device runs the window before.
        // Throughput is the stream's steady state: `submit_many` returns
        // once the window before the one it queued is done, so the time
        // between the second call's return and the last one's is the period
        // of the windows in between, whichever of host and device is the
        // slower. The pipeline's fill (the first window prepared with the
        // device idle, once per epoch in training) is left out of it and
        // reported on its own (`stream_ms`: the whole stream, fill and
        // drain included, per batch).
        let last = Some(persistent.train_batch(model, &batch)?);
        let window = prepared_ahead();
        let batches = vec![batch.clone(); window];
        // untimed: two windows make the staging buffers of every batch in
        // flight (pinned memory, slow to allocate; kept while training)
        for _ in 0..2 {
            persistent.submit_many(model, &batches)?;
        }
        persistent.finish()?;
        let Stream {
            steps,
            wall,
            steady,
            stream,
        } = stream(&mut persistent, model, &batches, a.reps)?;
        // the host's preparation of a batch (scheduling, lowering and
        // encoding on one core) and the kernels' device time, medians over
        // the overlapped stream; the share of the stream's wall time the
        // device spent in kernels
        let median = |of: fn(&PersistentStep) -> f64| {
            let mut v: Vec<f64> = steps.iter().map(of).collect();
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
        };
        let host = median(|s| s.host_seconds);
        let host_max = steps.iter().map(|s| s.host_seconds).fold(0.0, f64::max);
        let stream_kernel = median(|s| s.kernel_seconds);
        let busy = steps.iter().map(|s| s.kernel_seconds).sum::<f64>() / wall;
        let sync_train = median_time(a.reps, || {
            persistent.train_batch(model, &batch)?;
            Ok(())
        })?;
        let kernel_ms = persistent
            .last_kernel_seconds()
            .map(|s| (s * 1e6).round() / 1e3);
        let batched_train = train_time(batched, model, &batch, BatchingPolicy::Cavs, a.reps)?;
        let step = last.ok_or("no step ran")?;
        let per_s = |t: f64| ((bs as f64 / t) * 10.0).round() / 10.0;
        let line = serde_json::json!({
            "system": "ramus", "model": a.model, "engine": "persistent", "hidden": a.hidden, "batch": bs, "nodes": nodes,
            "train_ms": (steady * 1e6).round() / 1e3, "train_sent_per_s": per_s(steady),
            "stream_ms": (stream * 1e6).round() / 1e3, "stream_sent_per_s": per_s(stream),
            "sync_train_ms": (sync_train * 1e6).round() / 1e3, "kernel_ms": kernel_ms,
            "batched_train_sent_per_s": per_s(batched_train),
            "speedup_vs_batched": ((batched_train / steady) * 100.0).round() / 100.0,
            "host_ms": (host * 1e6).round() / 1e3, "host_max_ms": (host_max * 1e6).round() / 1e3,
            "prepared_ahead": window,
            "stream_kernel_ms": (stream_kernel * 1e6).round() / 1e3, "device_busy": (busy * 100.0).round() / 100.0,
            "tasks": step.tasks, "levels": step.levels,
        });
        outln!("{line}")?;
        results.push(line);
    }
    if let Some(anchor) = &a.anchor {
        let ratios = run_anchor(a, anchor, &results)?;
        results.extend(ratios);
    }
    Ok(results)
}

/// The overlapped stream of windows of batches, timed.
struct Stream {
    steps: Vec<PersistentStep>,
    /// Seconds of the whole stream.
    wall: f64,
    /// Seconds per batch between the second window's return and the
    /// last one's (the steady state).
    steady: f64,
    /// Seconds per batch of the whole stream (fill and drain included).
    stream: f64,
}

/// Submits windows of `batches` (`reps` batches, at least 10 windows) to
/// `persistent` and times the stream.
fn stream(
    persistent: &mut PersistentEngine,
    model: &Model,
    batches: &[Vec<&InputGraph>],
    reps: usize,
) -> AnyResult<Stream> {
    let window = batches.len();
    let windows = reps.div_ceil(window).max(10);
    let started = std::time::Instant::now();
    let mut returned = Vec::with_capacity(windows);
    let mut steps = Vec::with_capacity(windows * window);
    for _ in 0..windows {
        steps.extend(persistent.submit_many(model, batches)?);
        returned.push(started.elapsed().as_secs_f64());
    }
    steps.extend(persistent.finish()?);
    let wall = started.elapsed().as_secs_f64();
    Ok(Stream {
        steps,
        wall,
        steady: (returned[windows - 1] - returned[1]) / ((windows - 2) * window) as f64,
        stream: wall / (windows * window) as f64,
    })
}

/// The persistent engine with its `rpw` chosen for batches like `warm`:
/// the profile-guided search runs on it (its choice is remembered for later
/// runs at batch sizes of its power-of-two class). Prints the set-up line.
pub(super) fn tuned_engine(
    a: &BenchArgs,
    model: &Model,
    params: &Params<f32>,
    config: OptimizerConfig,
    warm: &[InputGraph],
) -> AnyResult<PersistentEngine> {
    let options = PersistentOptions {
        rpw: a.rpw,
        ctas_per_sm: a.ctas_per_sm.map(usize::from),
        grads_in_registers: a.grads_in_registers,
        batch_size: Some(warm.len()),
        memory_budget: a.device_memory_budget,
        ..PersistentOptions::default()
    };
    // it trains on `warm` alone, as one batch
    let need = Inference::bench(
        model,
        warm,
        warm.len(),
        Pass::Train,
        0,
        a.hidden,
        Device::Cuda,
    );
    let check = |n: &DeviceNeed, room| need.fit_device(n, room);
    let mut persistent = PersistentEngine::with_check(model, params, config, &options, &check)?;
    let warm: Vec<&InputGraph> = warm.iter().collect();
    let search_started = std::time::Instant::now();
    // the bridge kernel (while the kernel proper compiles) and the search
    // train on the warm-up batch; their time is bounded, this only guards
    // against a search that would not end
    let mut searched = 0;
    while persistent.tuning() {
        if search_started.elapsed() > std::time::Duration::from_secs(600) {
            return Err(
                format!("the rpw search still ran after {searched} batches and 600 s").into(),
            );
        }
        persistent.submit(model, &warm)?;
        searched += 1;
    }
    persistent.latest()?;
    let search_s = search_started.elapsed().as_secs_f64();
    let plan = persistent.register_plan();
    let report = persistent.kernel_report();
    let bridge = persistent.bridge_batches();
    outln!(
        "{}",
        serde_json::json!({
            "setup": "persistent", "setup_s": (persistent.setup_seconds() * 1e3).round() / 1e3,
            "context_s": (persistent.context_seconds() * 1e3).round() / 1e3,
            "kernel_ready_s": persistent.kernel_ready_seconds().map(|s| (s * 1e3).round() / 1e3),
            "setup_phases": persistent.setup_phases().iter().map(|(p, s)| (p.to_string(), serde_json::json!((s * 1e3).round() / 1e3))).collect::<serde_json::Map<String, serde_json::Value>>(),
            "bridge_batches": bridge.0, "bridge_kernel_ms": (bridge.0 > 0).then(|| (bridge.1 / bridge.0 as f64 * 1e6).round() / 1e3),
            "ctas": plan.ctas, "ctas_per_sm": plan.ctas_per_sm, "rpw": plan.rpw,
            "partitions": plan.partitions, "grads_in_registers": plan.grads_in_registers,
            "registers_per_thread": report.registers_per_thread, "vector_epilogue": report.vector_epilogue,
            "kernel_build_s": (report.build_seconds * 1e3).round() / 1e3,
            "rpw_compiled": persistent.compiled_rpws(), "rpw_search_batches": searched,
            "rpw_search_s": (search_s * 1e3).round() / 1e3,
        })
    )?;
    Ok(persistent)
}
