//! `ramus bench`: inference latency and training throughput of a model
//! (by default the reference Tree-LSTM) on the first inputs of a file —
//! for the tree models the batches the PyTorch anchor uses — optionally
//! with the anchor run in the same process tree for side-by-side ratios.

use crate::result::AnyResult;
use ramus_core::{Model, Params};
use ramus_exec::memory::Pass;
use ramus_exec::{Batch, Mode};
use ramus_graph::{random, BatchingPolicy, InputGraph, Vocab, VocabMode};
use ramus_nn::{build_model, build_sequence_model, DataKind, ModelConfig, ModelOptions};

use crate::limits::{self, BuildGuard};
use crate::output::outln;
use crate::{data, labels};

mod common;
mod compiled;
mod persistent;
mod traffic;

use common::{bench_engine, bench_optimizer, median_time, run_anchor, train_time, BenchEngine};
pub use common::{BenchArgs, RecursionFlags};

/// What a bench times: its inputs (the first ones of the file, or the
/// synthetic graphs `--grid` / `--perfect-tree` ask for), the model built
/// for them and the size of their word vocabulary.
struct BenchInputs {
    graphs: Vec<InputGraph>,
    model: Model,
    vocab: usize,
}

/// Reads `a.trees` as the data of `a.model` (see [`data::data_kind_of`]) and
/// builds the model for it: the vocabulary grows from the file, a tagger's
/// classes are the file's tags (its rare words spelled out for the
/// character tagger, as `ramus train` does; the inputs are the training
/// split of the file), the other models have five classes. `count`:
/// synthetic graphs to make for `--grid` / `--perfect-tree`.
fn read_inputs(a: &BenchArgs, count: usize) -> AnyResult<BenchInputs> {
    let kind = data::data_kind_of(&a.model)?;
    if kind != DataKind::Trees && (a.grid.is_some() || a.perfect_tree.is_some()) {
        return Err(format!(
            "--grid and --perfect-tree make trees and DAGs; `{}` does not read them",
            a.model
        )
        .into());
    }
    let build = |vocab, classes, chars| -> AnyResult<Model> {
        let cfg = ModelConfig {
            vocab,
            hidden: a.hidden,
            classes,
        };
        Ok(match a.sequence.config(&a.model, chars)? {
            Some(seq) => build_sequence_model(&a.model, &cfg, &seq, &ModelOptions::default())?,
            None => build_model(&a.model, &cfg)?,
        })
    };
    let (mut graphs, vocab, classes, chars) = match kind {
        DataKind::Images => {
            return Err(format!(
                "`{}` is a CNN: time it with `ramus bench-swap`, not `ramus bench`",
                a.model
            )
            .into())
        }
        DataKind::Tagged { chars } => {
            let splits = data::load_tagged_splits(Some(&a.trees), chars)?;
            let chars = splits.chars();
            (splits.train, splits.vocab, splits.classes, chars)
        }
        DataKind::Trees | DataKind::Sentences | DataKind::SentencePyramid => {
            let mut vocab = Vocab::new();
            // the activations of a pyramid, a grid or a perfect tree do not
            // depend on the vocabulary: a model of one word costs them
            // before they are built
            let reader = match kind {
                DataKind::Sentences => None,
                _ => Some(build(1, 5, 0)?),
            };
            let mut guard = a.host.build_guard(reader.as_ref().map(|m| (m, a.device)));
            let mode = VocabMode::Grow(&mut vocab);
            let mut graphs = data::read_graphs(&a.trees, kind, mode, &mut guard)?;
            if let Some(made) = synthetic(a, count, vocab.len(), &mut guard)? {
                graphs = made;
            }
            let classes = if kind == DataKind::Sentences { 0 } else { 5 };
            (graphs, vocab, classes, 0)
        }
    };
    let model = build(vocab.len(), classes, chars)?;
    a.structure.fit(&model, kind, &mut graphs)?;
    Ok(BenchInputs {
        graphs,
        model,
        vocab: vocab.len(),
    })
}

/// Checks the inputs' labels against the model's classes and that the
/// host can hold the model and the largest batch (bench's batches are the
/// first inputs, the largest `sizes` asks for); the check of the device
/// is left to the engine's set-up.
fn bench_need<'a>(
    a: &BenchArgs,
    model: &'a Model,
    inputs: &'a [InputGraph],
    sizes: &[usize],
    vocab: usize,
) -> AnyResult<limits::Inference<'a>> {
    labels::check_model(inputs, model, "that `ramus bench` builds the model with")?;
    let largest = sizes.iter().copied().max().unwrap_or(1).min(inputs.len());
    let pass = if a.infer_only || a.engine == "compiled" {
        Pass::Infer
    } else {
        Pass::Train
    };
    let graphs = &inputs[..largest];
    let need = limits::Inference::bench(model, graphs, largest, pass, vocab, a.hidden, a.device);
    need.check_host(a.host)?;
    Ok(need)
}

/// `count` random `ROWSxCOLS` grid DAGs (`--grid`) or perfect trees
/// (`--perfect-tree`) over a vocabulary of `vocab` words, admitted by
/// `guard` before they are built (a grid grows with the product of its
/// sides, a perfect tree with the power of its height); `None` without
/// either flag.
fn synthetic(
    a: &BenchArgs,
    count: usize,
    vocab: usize,
    guard: &mut BuildGuard<'_>,
) -> AnyResult<Option<Vec<InputGraph>>> {
    let change = "lower it or the largest of --batch-sizes";
    let mut rng = ramus_nn::train::rng(0);
    if let Some(grid) = &a.grid {
        let bad = || format!("--grid `{grid}`: expected ROWSxCOLS, e.g. 10x10");
        let (r, c) = grid.split_once('x').ok_or_else(bad)?;
        let (r, c): (usize, usize) = (r.parse().map_err(|_| bad())?, c.parse().map_err(|_| bad())?);
        if r == 0 || c == 0 {
            return Err(bad().into());
        }
        let shape = random::grid_dag_shape(r, c);
        guard.admit(&format!("--grid {grid}"), &shape, count as u64, change)?;
        let made = (0..count).map(|_| random::grid_dag(&mut rng, r, c, vocab as u32, 5));
        return Ok(Some(made.collect::<Result<_, _>>()?));
    }
    let Some(height) = a.perfect_tree else {
        return Ok(None);
    };
    let shape = random::perfect_tree_shape(height);
    let what = format!("--perfect-tree {height}");
    guard.admit(&what, &shape, count as u64, change)?;
    let made = (0..count).map(|_| random::perfect_tree(&mut rng, height, vocab as u32, 5));
    Ok(Some(made.collect::<Result<_, _>>()?))
}

/// The batch sizes of `--batch-sizes` (comma-separated, each at least 1).
fn batch_sizes(list: &str) -> AnyResult<Vec<usize>> {
    let sizes: Vec<usize> = list
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<usize>()
                .map_err(|_| format!("bad batch size `{s}` in --batch-sizes"))
        })
        .collect::<Result<_, _>>()?;
    if sizes.contains(&0) {
        return Err("batch sizes must be at least 1".into());
    }
    Ok(sizes)
}

pub fn run(a: BenchArgs) -> AnyResult {
    let Some(path) = a.plot.clone() else {
        return measure(&a).map(|_| ());
    };
    check_plot(&a, &path)?;
    let lines = measure(&a)?;
    let device = match a.device {
        crate::device::Device::Cpu => "cpu",
        crate::device::Device::Cuda => "cuda",
    };
    let title = format!(
        "ramus bench: {} engine, {}, hidden {}, {device}",
        a.engine, a.model, a.hidden
    );
    crate::plot::bench_chart::write(&path, &lines, &title)
}

/// Checks, before any timing, that `--plot` has speed-ups to draw and can
/// write `path`.
fn check_plot(a: &BenchArgs, path: &std::path::Path) -> AnyResult {
    if a.profile_inputs.is_some() {
        return Err("--plot draws timings; --profile-inputs times nothing".into());
    }
    let compares = match a.engine.as_str() {
        "persistent" => true,
        "compiled" => a.compare_batched || a.anchor.is_some(),
        _ => a.anchor.is_some(),
    };
    if !compares {
        return Err(format!(
            "--plot draws speed-ups and `--engine {}` compares with nothing: add --anchor{}",
            a.engine,
            if a.engine == "compiled" {
                " or --compare-batched"
            } else {
                ""
            }
        )
        .into());
    }
    Ok(ramus_exec::atomic::check_writable(path, "--plot")?)
}

/// Runs the bench `a` asks for; returns the lines it printed.
fn measure(a: &BenchArgs) -> AnyResult<Vec<serde_json::Value>> {
    let policy: BatchingPolicy = a.policy.parse()?;
    let sizes = batch_sizes(&a.batch_sizes)?;
    if a.anchor.is_some() && a.model != "treelstm" {
        return Err(format!("--anchor times the reference treelstm, not `{}`", a.model).into());
    }
    let BenchInputs {
        graphs: inputs,
        model,
        vocab,
    } = read_inputs(a, sizes.iter().copied().max().unwrap_or(1))?;
    if let Some(big) = sizes.iter().find(|&&bs| bs > inputs.len()) {
        return Err(format!(
            "batch size {big} exceeds the {} inputs in {}",
            inputs.len(),
            a.trees.display()
        )
        .into());
    }
    let need = bench_need(a, &model, &inputs, &sizes, vocab)?;
    let params = Params::<f32>::init(&model, 0);
    if let Some(profiled) = a.profile_inputs {
        traffic::run(a, profiled, &model, &params, &inputs, &sizes)?;
        return Ok(Vec::new());
    }
    match a.engine.as_str() {
        "batched" => {}
        "compiled" => return compiled::run(a, &model, &params, &inputs, &sizes),
        "persistent" => return persistent::run(a, &model, &params, &inputs, &sizes),
        other => {
            return Err(format!(
                "unknown engine `{other}` (expected batched, compiled or persistent)"
            )
            .into())
        }
    }
    let (mut engine, table_ms) = bench_engine(a, &model, (params, bench_optimizer()), vocab)?;
    if let BenchEngine::Cuda(e) = &engine {
        need.check_device(e.as_ref(), a.device_memory_budget)?;
    }
    let device_name = match &engine {
        BenchEngine::Cpu(_) => "cpu".to_string(),
        BenchEngine::Cuda(e) => e.engine().device().name().to_string(),
    };
    let mut results = Vec::new();
    for &bs in &sizes {
        let batch: Vec<&InputGraph> = inputs[..bs].iter().collect();
        let nodes: usize = batch.iter().map(|g| g.len()).sum();
        let before = engine.launches();
        let infer = median_time(a.reps, || {
            let b = Batch::new(&model, batch.clone(), policy)?;
            engine.engine().forward(&b, Mode::Infer)?;
            Ok(())
        })?;
        let enqueue_ms = match &engine {
            BenchEngine::Cuda(e) => Some((e.engine().last_enqueue_seconds() * 1e6).round() / 1e3),
            BenchEngine::Cpu(_) => None,
        };
        let calls = (a.reps.max(1) + 3) as u64;
        let infer_kernels = engine.launches().zip(before).map(|(x, y)| (x - y) / calls);
        let before = engine.launches();
        let train = if a.infer_only {
            f64::NAN
        } else {
            train_time(engine.engine(), &model, &batch, policy, a.reps)?
        };
        let train_kernels = engine.launches().zip(before).map(|(x, y)| (x - y) / calls);
        let line = serde_json::json!({
            "system": "ramus", "model": a.model, "engine": engine.engine().name(), "device": device_name, "policy": a.policy,
            "threads": rayon::current_num_threads(), "hidden": a.hidden, "batch": bs, "nodes": nodes,
            "infer_ms": (infer * 1e6).round() / 1e3, "train_sent_per_s": ((bs as f64 / train) * 10.0).round() / 10.0,
            "leaf_table_build_ms": table_ms.map(|t| (t * 10.0).round() / 10.0),
            "kernels_per_batch": infer_kernels, "kernels_per_train_batch": train_kernels,
            "infer_enqueue_ms": enqueue_ms,
        });
        outln!("{line}")?;
        results.push(line);
    }
    if a.verbose {
        if let BenchEngine::Cuda(e) = &engine {
            outln!(
                "{}",
                serde_json::json!({"kernel_cache": e.engine().cache_stats().to_string(), "pool": e.engine().pool_stats().to_string()})
            )?;
        }
    }
    if let Some(anchor) = &a.anchor {
        let ratios = run_anchor(a, anchor, &results)?;
        results.extend(ratios);
    }
    Ok(results)
}
