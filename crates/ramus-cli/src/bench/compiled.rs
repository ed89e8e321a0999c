//! `ramus bench --engine compiled`: inference latency percentiles of the
//! compiled (Cortex) engine on the CUDA device or the CPU, per batch size,
//! for the default schedule or the ablation of Cortex Fig. 11(a)–(c).

use ramus_core::recursion::{analyze, RecursionSchedule};
use ramus_core::{Model, Params};
use ramus_cpu::compiled::{CpuCompiledEngine, CpuCompiledSchedule};
use ramus_cuda::compiled::{CompiledEngine, CompiledOptions, CompiledSchedule};
use ramus_graph::InputGraph;

use super::common::{bench_engine, bench_optimizer, run_anchor, samples, BenchArgs};
use crate::device::Device;
use crate::limits::Inference;
use crate::output::outln;
use crate::result::AnyResult;
use ramus_exec::memory::{DeviceNeed, Pass};

/// The recursion steps of the ablation on top of the best schedule
/// `base` (Cortex Fig. 11(b), (c)): refactoring (where the model has
/// something to refactor), unrolling, both.
fn recursion_steps(
    model: &Model,
    base: &str,
    trees: &[InputGraph],
) -> AnyResult<Vec<(String, RecursionSchedule)>> {
    let refactorable = !analyze(model)?.is_empty();
    let mut steps = vec![(base.to_string(), RecursionSchedule::fixed(false, false))];
    if refactorable {
        steps.push((
            format!("{base}+refactoring"),
            RecursionSchedule::fixed(true, false),
        ));
    }
    // unrolling runs on trees and sequences only (a DAG is refused)
    if !trees.iter().all(InputGraph::is_forest) {
        return Ok(steps);
    }
    steps.push((
        format!("{base}+unrolling"),
        RecursionSchedule::fixed(false, true),
    ));
    if refactorable {
        steps.push((
            format!("{base}+refactoring+unrolling"),
            RecursionSchedule::fixed(true, true),
        ));
    }
    Ok(steps)
}

/// The CUDA ablation: fusion only, + leaf specialization, + persistence
/// (all three with grid barriers between levels, as in Cortex), + per-node
/// completion counters instead of the barriers, then the recursion steps
/// on top (unrolling gives persistence and counters up).
fn cuda_ablation(
    model: &Model,
    trees: &[InputGraph],
) -> AnyResult<Vec<(String, CompiledSchedule)>> {
    let off = RecursionSchedule::fixed(false, false);
    let mut steps = vec![
        (
            "fusion".to_string(),
            CompiledSchedule {
                leaf_table: false,
                persistent_weights: false,
                node_counters: Some(false),
                recursion: off,
            },
        ),
        (
            "fusion+specialization".to_string(),
            CompiledSchedule {
                leaf_table: true,
                persistent_weights: false,
                node_counters: Some(false),
                recursion: off,
            },
        ),
        (
            "fusion+specialization+persistence".to_string(),
            CompiledSchedule {
                leaf_table: true,
                persistent_weights: true,
                node_counters: Some(false),
                recursion: off,
            },
        ),
    ];
    for (name, recursion) in recursion_steps(
        model,
        "fusion+specialization+persistence+node-counters",
        trees,
    )? {
        steps.push((
            name,
            CompiledSchedule {
                leaf_table: true,
                persistent_weights: true,
                node_counters: Some(true),
                recursion,
            },
        ));
    }
    Ok(steps)
}

/// The resolved recursion choices of a schedule, for the latency line.
fn recursion_fields(r: RecursionSchedule) -> serde_json::Value {
    serde_json::json!({
        "refactor": r.refactor.unwrap_or(false),
        "unroll": r.unroll.unwrap_or(false),
    })
}

/// Percentile `p` (0–100) of sorted samples, in milliseconds (3 decimals).
fn percentile_ms(sorted: &[f64], p: f64) -> f64 {
    let at = ((sorted.len() - 1) as f64 * p / 100.0).round() as usize;
    (sorted[at.min(sorted.len() - 1)] * 1e6).round() / 1e3
}

pub(super) fn run(
    a: &BenchArgs,
    model: &Model,
    params: &Params<f32>,
    trees: &[InputGraph],
    sizes: &[usize],
) -> AnyResult<Vec<serde_json::Value>> {
    let last = match a.device {
        Device::Cpu => run_cpu(a, model, params, trees, sizes)?,
        Device::Cuda => run_cuda(a, model, params, trees, sizes)?,
    };
    let mut lines = last.clone();
    if a.compare_batched {
        lines.extend(compare_with_batched(a, model, params, trees, &last)?);
    }
    if let Some(anchor) = &a.anchor {
        if a.model != "treelstm" {
            return Err("the PyTorch anchor runs the reference treelstm only".into());
        }
        lines.extend(run_anchor(a, anchor, &last)?);
    }
    Ok(lines)
}

/// Times the batched engine's inference on the same batches and device and
/// prints (and returns) its median and the compiled engine's speed-up over
/// it.
fn compare_with_batched(
    a: &BenchArgs,
    model: &Model,
    params: &Params<f32>,
    trees: &[InputGraph],
    compiled: &[serde_json::Value],
) -> AnyResult<Vec<serde_json::Value>> {
    // the batched engine as `ramus bench` runs it (per-token tables on the CPU)
    let vocab = model
        .settings
        .get("vocab")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let trained = (params.clone(), bench_optimizer());
    let (mut engine, _) = bench_engine(a, model, trained, vocab)?;
    let engine = engine.engine();
    let mut ratios = Vec::with_capacity(compiled.len());
    for line in compiled {
        let bs = line["batch"].as_u64().unwrap_or(1) as usize;
        let batch: Vec<&InputGraph> = trees[..bs].iter().collect();
        let times = samples(a.reps, || {
            let b =
                ramus_exec::Batch::new(model, batch.clone(), ramus_graph::BatchingPolicy::Cavs)?;
            engine.forward(&b, ramus_exec::Mode::Infer)?;
            Ok(())
        })?;
        let batched_ms = percentile_ms(&times, 50.0);
        let compiled_ms = line["infer_ms"].as_f64().unwrap_or(f64::NAN);
        let line = serde_json::json!({
            "ratio": "compiled_vs_batched", "model": a.model, "hidden": a.hidden, "batch": bs,
            "engine": engine.name(), "batched_infer_ms": batched_ms,
            "speedup": ((batched_ms / compiled_ms) * 100.0).round() / 100.0,
        });
        outln!("{line}")?;
        ratios.push(line);
    }
    Ok(ratios)
}

/// The latency line of one batch size.
fn latency_line(
    a: &BenchArgs,
    device: &str,
    schedule: &str,
    bs: usize,
    nodes: usize,
    times: &[f64],
) -> serde_json::Value {
    serde_json::json!({
        "system": "ramus", "engine": "compiled", "schedule": schedule, "model": a.model,
        "device": device, "hidden": a.hidden, "batch": bs, "nodes": nodes,
        "threads": rayon::current_num_threads(),
        "infer_ms": percentile_ms(times, 50.0), "infer_p90_ms": percentile_ms(times, 90.0),
        "infer_p99_ms": percentile_ms(times, 99.0),
    })
}

/// Times `infer` on the first `bs` graphs for each batch size and prints a
/// latency line per size, plus the fields `describe` returns (called once
/// per size after the timed calls, e.g. to time the kernel on its own).
fn time_batches(
    a: &BenchArgs,
    trees: &[InputGraph],
    sizes: &[usize],
    device: &str,
    schedule: &str,
    mut infer: impl FnMut(&[&InputGraph]) -> AnyResult,
    mut describe: impl FnMut(&[&InputGraph]) -> AnyResult<serde_json::Value>,
) -> AnyResult<Vec<serde_json::Value>> {
    let mut lines = Vec::with_capacity(sizes.len());
    for &bs in sizes {
        let batch: Vec<&InputGraph> = trees[..bs].iter().collect();
        let nodes: usize = batch.iter().map(|g| g.len()).sum();
        let times = samples(a.reps, || infer(&batch))?;
        let mut line = latency_line(a, device, schedule, bs, nodes, &times);
        if let (serde_json::Value::Object(fields), serde_json::Value::Object(map)) =
            (describe(&batch)?, &mut line)
        {
            map.extend(fields);
        }
        outln!("{line}")?;
        lines.push(line);
    }
    Ok(lines)
}

/// The CPU back end: default schedule (tables, the recursion flags) or
/// the ablation: without tables, with, then the recursion steps.
fn run_cpu(
    a: &BenchArgs,
    model: &Model,
    params: &Params<f32>,
    trees: &[InputGraph],
    sizes: &[usize],
) -> AnyResult<Vec<serde_json::Value>> {
    let schedules: Vec<(String, CpuCompiledSchedule)> = if a.ablation {
        let mut steps = vec![(
            "fusion".to_string(),
            CpuCompiledSchedule {
                leaf_table: false,
                recursion: RecursionSchedule::fixed(false, false),
            },
        )];
        for (name, recursion) in recursion_steps(model, "fusion+specialization", trees)? {
            steps.push((
                name,
                CpuCompiledSchedule {
                    leaf_table: true,
                    recursion,
                },
            ));
        }
        steps
    } else {
        vec![(
            "default".to_string(),
            CpuCompiledSchedule {
                leaf_table: true,
                recursion: a.recursion.schedule(),
            },
        )]
    };
    let mut last = Vec::new();
    for (name, schedule) in &schedules {
        let mut engine = CpuCompiledEngine::with_schedule(model, params, schedule)?;
        let resolved = recursion_fields(engine.schedule().recursion);
        if a.verbose {
            outln!(
                "{}",
                serde_json::json!({"setup": "compiled-cpu", "schedule": name,
                    "leaf_table_build_ms": (engine.leaf_table_seconds() * 1e6).round() / 1e3})
            )?;
        }
        last = time_batches(
            a,
            trees,
            sizes,
            "cpu",
            name,
            |batch| {
                engine.infer(batch)?;
                Ok(())
            },
            |_| Ok(resolved.clone()),
        )?;
    }
    Ok(last)
}

/// Launches timed with events per batch size for the kernel's own time.
const KERNEL_TIMINGS: usize = 9;

/// The CUDA engine: default schedule or the three ablation steps.
/// The CUDA compiled engine under `options` (schedule `name`), checked
/// against the device memory for the largest size's batch (the first
/// inputs); with `--verbose` its set-up is printed.
fn cuda_engine(
    a: &BenchArgs,
    (model, params): (&Model, &Params<f32>),
    (trees, sizes): (&[InputGraph], &[usize]),
    name: &str,
    options: &CompiledOptions,
) -> AnyResult<CompiledEngine> {
    let largest = sizes.iter().copied().max().unwrap_or(1).min(trees.len());
    let batches = &trees[..largest];
    let need = Inference::bench(
        model,
        batches,
        largest,
        Pass::Infer,
        0,
        a.hidden,
        Device::Cuda,
    );
    let check = |n: &DeviceNeed, room| need.fit_device(n, room);
    let engine = CompiledEngine::with_check(model, params, options, &check)?;
    if a.verbose {
        outln!(
            "{}",
            serde_json::json!({
                "setup": "compiled", "schedule": name, "device": engine.device().name(),
                "arch": engine.device().arch(), "setup_s": engine.setup_seconds(),
                "leaf_table_build_ms": (engine.leaf_table_seconds() * 1e6).round() / 1e3,
                "kernel_cache": engine.cache_stats().to_string(),
            })
        )?;
    }
    Ok(engine)
}

fn run_cuda(
    a: &BenchArgs,
    model: &Model,
    params: &Params<f32>,
    trees: &[InputGraph],
    sizes: &[usize],
) -> AnyResult<Vec<serde_json::Value>> {
    let mut last = Vec::new();
    let schedules: Vec<(String, CompiledSchedule)> = if a.ablation {
        cuda_ablation(model, trees)?
    } else {
        vec![(
            "default".to_string(),
            CompiledSchedule {
                recursion: a.recursion.schedule(),
                ..CompiledSchedule::default()
            },
        )]
    };
    for (name, schedule) in schedules {
        let options = CompiledOptions {
            schedule,
            block_threads: a.block_threads,
            blocks_per_sm: a.blocks_per_sm,
            max_blocks: a.max_blocks,
            memory_budget: a.device_memory_budget,
            ..CompiledOptions::default()
        };
        let engine = cuda_engine(a, (model, params), (trees, sizes), &name, &options)?;
        let device = engine.device().name().to_string();
        let engine = std::cell::RefCell::new(engine);
        last = time_batches(
            a,
            trees,
            sizes,
            &device,
            &name,
            |batch| {
                let mut engine = engine.borrow_mut();
                // the level ordering is measured on the first batches
                while engine.measuring_level_order() {
                    engine.infer(batch)?;
                }
                engine.infer(batch)?;
                Ok(())
            },
            |batch| {
                let mut engine = engine.borrow_mut();
                let enqueue_ms = (engine.last_enqueue_seconds() * 1e6).round() / 1e3;
                // the kernel's own time, from events, apart from the
                // timed calls (recording the events costs host time)
                engine.set_time_kernel(true)?;
                let mut kernel = Vec::with_capacity(KERNEL_TIMINGS);
                for _ in 0..KERNEL_TIMINGS {
                    engine.infer(batch)?;
                    kernel.extend(engine.last_kernel_seconds());
                }
                engine.set_time_kernel(false)?;
                kernel.sort_by(f64::total_cmp);
                let applied = engine.schedule();
                let mut extra = serde_json::json!({
                    "infer_enqueue_ms": enqueue_ms,
                    "kernel_ms": kernel.get(kernel.len() / 2).map(|k| (k * 1e6).round() / 1e3),
                    "kernels_per_batch": 1,
                    "persistent_weights": applied.persistent_weights,
                    "node_counters": applied.node_counters,
                });
                if let (Some(map), serde_json::Value::Object(fields)) =
                    (extra.as_object_mut(), recursion_fields(applied.recursion))
                {
                    map.extend(fields);
                }
                Ok(extra)
            },
        )?;
    }
    Ok(last)
}
