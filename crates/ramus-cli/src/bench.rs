//! `ramus bench`: inference latency and training throughput of a model
//! (by default the reference Tree-LSTM) on the first inputs of a file —
//! for the tree models the batches the PyTorch anchor uses — optionally
//! with the anchor run in the same process tree for side-by-side ratios.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use ramus_core::{Model, Params};
use ramus_cpu::{CpuEngine, CpuTrainer};
use ramus_cuda::CudaTrainer;
use ramus_exec::memory::Pass;
use ramus_exec::{Batch, Mode};
use ramus_exec::{OptimizerConfig, OptimizerKind, TrainEngine};
use ramus_graph::{random, BatchingPolicy, InputGraph, Vocab, VocabMode};
use ramus_nn::{build_model, build_sequence_model, DataKind, ModelConfig, ModelOptions};

use crate::device::{self, Device};
use crate::limits::{self, BuildGuard};
use crate::output::outln;
use crate::{data, labels};

mod compiled;
mod persistent;
mod traffic;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Input file; batches are its first B inputs. Trees (SST format) for
    /// the tree models and the time-delay networks (read as pyramids over
    /// the leaves), tagged text (`word|TAG ...`, WikiNER) for the taggers,
    /// plain sentences for lstm-lm.
    trees: PathBuf,
    #[arg(long, default_value_t = 256)]
    hidden: usize,
    #[arg(long, default_value = "1,10,64")]
    batch_sizes: String,
    #[arg(long, default_value_t = 20)]
    reps: usize,
    /// Batching policy: cavs or agenda.
    #[arg(long, default_value = "cavs")]
    policy: String,
    /// Also run this PyTorch anchor script (torch_treelstm.py) on the CPU
    /// right after, and print Ramus/PyTorch speed ratios.
    #[arg(long)]
    anchor: Option<PathBuf>,
    /// Time inference only.
    #[arg(long)]
    infer_only: bool,
    /// Python interpreter for the anchor.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Where to run: cpu or cuda (the anchor then runs on the same device).
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Also report engine set-up: kernels compiled, cache hits, compile
    /// time, device memory.
    #[arg(long)]
    verbose: bool,
    /// Cap on the device memory Ramus may use, in bytes (CUDA).
    #[arg(long)]
    device_memory_budget: Option<u64>,
    /// batched (Cavs: forward, backward, training), compiled (Cortex:
    /// one generated kernel per batch, inference only, CUDA) or persistent
    /// (VPPS: one generated kernel per training batch, CUDA).
    #[arg(long, default_value = "batched")]
    engine: String,
    /// Model to time: treelstm (the anchor's model), treelstm-nary, treefc,
    /// mvrnn (binary trees), treegru, rvnn, dagrnn (with --grid), the
    /// taggers bilstm-tagger and bilstm-char-tagger, the time-delay
    /// networks td-rnn and td-lstm, or lstm-lm.
    #[arg(long, default_value = "treelstm")]
    model: String,
    /// With --engine compiled: time the Cortex ablation (fusion only, +
    /// leaf specialization, + model persistence, all with grid barriers
    /// between levels; + per-node completion counters instead of the
    /// barriers; then each of recursive refactoring and unrolling on top, as
    /// in Cortex Fig. 11) instead of the default schedule.
    #[arg(long)]
    ablation: bool,
    #[command(flatten)]
    recursion: RecursionFlags,
    #[command(flatten)]
    sequence: crate::sequence::SequenceArgs,
    #[command(flatten)]
    structure: crate::structure::StructureArgs,
    /// With --engine compiled: threads per block of the generated kernel
    /// [default: by the weight registers, 512 or 256].
    #[arg(long)]
    block_threads: Option<u32>,
    /// With --engine compiled: resident blocks per multiprocessor at most.
    #[arg(long, default_value_t = 2)]
    blocks_per_sm: u32,
    /// With --engine compiled: also time the batched engine on the same
    /// batches and device and print the compiled engine's speed-up.
    #[arg(long)]
    compare_batched: bool,
    /// With --engine compiled: blocks in all at most.
    #[arg(long)]
    max_blocks: Option<u32>,
    /// With --engine persistent: rows per warp of the register partitions.
    #[arg(long)]
    rpw: Option<usize>,
    /// With --engine persistent: resident CTAs per SM, 1 or 2 (default:
    /// the plan's choice, searched with the rpw).
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=2))]
    ctas_per_sm: Option<u8>,
    /// With --engine persistent: keep the weight gradients in registers
    /// (true) or in device memory (false) (default: the plan's choice).
    #[arg(long)]
    grads_in_registers: Option<bool>,
    /// Time synthetic ROWSxCOLS grid DAGs (random words of the tree file's
    /// vocabulary) instead of the trees, e.g. 10x10 for the DAG-RNN.
    #[arg(long)]
    grid: Option<String>,
    /// Time perfect binary trees of this height (random words of the tree
    /// file's vocabulary) instead of the trees, e.g. 7 for Cortex's TreeFC.
    #[arg(long, conflicts_with = "grid")]
    perfect_tree: Option<u32>,
    /// With --device cuda and --engine batched or persistent: instead of
    /// timing, train once over the first N trees in batches of each size,
    /// each pass the one stretch a profiler records (`ncu --replay-mode
    /// app-range`), to count the bytes the engine loads.
    #[arg(long)]
    profile_inputs: Option<usize>,
    #[command(flatten)]
    host: crate::limits::HostBudgetArgs,
}

/// The compiled engines' recursion primitives on the command line: each
/// forced on or off, or (neither flag) the best known default for the
/// model and device.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct RecursionFlags {
    /// Compiled engine: recursive refactoring on (children compute the
    /// values their parent derives from their state alone; an error for a
    /// model with none) [default: on for child-sum trees on the CPU].
    #[arg(long, conflicts_with = "no_refactor")]
    refactor: bool,
    /// Compiled engine: recursive refactoring off.
    #[arg(long)]
    no_refactor: bool,
    /// Compiled engine: recursion unrolled once (a node with its children
    /// of the level below; trees and sequences only) [default: off].
    #[arg(long, conflicts_with = "no_unroll")]
    unroll: bool,
    /// Compiled engine: unrolling off.
    #[arg(long)]
    no_unroll: bool,
}

impl RecursionFlags {
    fn choice(on: bool, off: bool) -> Option<bool> {
        match (on, off) {
            (true, _) => Some(true),
            (_, true) => Some(false),
            _ => None,
        }
    }

    /// The schedule the flags ask for (`None`: the default).
    pub fn schedule(&self) -> ramus_core::recursion::RecursionSchedule {
        ramus_core::recursion::RecursionSchedule {
            refactor: Self::choice(self.refactor, self.no_refactor),
            unroll: Self::choice(self.unroll, self.no_unroll),
        }
    }
}

/// The engine under test, with what only one kind reports.
enum BenchEngine {
    Cpu(Box<CpuTrainer<f32>>),
    Cuda(Box<CudaTrainer>),
}

impl BenchEngine {
    fn engine(&mut self) -> &mut dyn TrainEngine<f32> {
        match self {
            BenchEngine::Cpu(e) => e.as_mut(),
            BenchEngine::Cuda(e) => e.as_mut(),
        }
    }
    /// Kernel launches so far (CUDA only).
    fn launches(&self) -> Option<u64> {
        match self {
            BenchEngine::Cpu(_) => None,
            BenchEngine::Cuda(e) => Some(e.engine().launches()),
        }
    }
}

/// The optimizer the batched engine trains with in a benchmark.
fn bench_optimizer() -> OptimizerConfig {
    OptimizerConfig::new(OptimizerKind::Sgd, 0.05)
}

/// Builds the engine, training `params` with `config`; the CPU one gets
/// per-token leaf tables (Cortex's leaf specialisation and hoisting for
/// fixed parameters), whose build time is returned.
fn bench_engine(
    a: &BenchArgs,
    model: &Model,
    (params, config): (Params<f32>, OptimizerConfig),
    vocab: usize,
) -> AnyResult<(BenchEngine, Option<f64>)> {
    Ok(match a.device {
        Device::Cpu if a.device_memory_budget.is_some() => {
            return Err("--device-memory-budget applies to --device cuda".into())
        }
        Device::Cpu => {
            let mut engine = CpuEngine::<f32>::new();
            engine.use_token_tables(Some(vocab));
            let t = Instant::now();
            engine.prepare_token_tables(model, &params)?;
            let table_ms = t.elapsed().as_secs_f64() * 1e3;
            let trainer = CpuTrainer::with_engine(engine, model.clone(), params, config);
            (BenchEngine::Cpu(Box::new(trainer)), Some(table_ms))
        }
        Device::Cuda => {
            let engine = device::cuda_engine(model, a.device_memory_budget)?;
            if a.verbose {
                outln!(
                    "{}",
                    serde_json::json!({
                        "setup": "cuda", "device": engine.device().name(), "arch": engine.device().arch(),
                        "setup_s": engine.setup_seconds(), "fused_kernels": engine.fused_kernels(),
                        "kernel_cache": engine.cache_stats().to_string(),
                    })
                )?;
            }
            let trainer = CudaTrainer::new(engine, model.clone(), params, config)?;
            (BenchEngine::Cuda(Box::new(trainer)), None)
        }
    })
}

pub(crate) type AnyResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// Sorted times (seconds) of `reps` calls after 3 warm-up calls.
pub(crate) fn samples(reps: usize, mut f: impl FnMut() -> AnyResult) -> AnyResult<Vec<f64>> {
    for _ in 0..3 {
        f()?;
    }
    let mut out = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f()?;
        out.push(t.elapsed().as_secs_f64());
    }
    out.sort_by(f64::total_cmp);
    Ok(out)
}

/// Median of `reps` timed calls after 3 warm-up calls, in seconds.
fn median_time(reps: usize, f: impl FnMut() -> AnyResult) -> AnyResult<f64> {
    let times = samples(reps, f)?;
    Ok(times[times.len() / 2])
}

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

pub fn run(a: BenchArgs) -> AnyResult {
    let policy: BatchingPolicy = a.policy.parse()?;
    let sizes: Vec<usize> = a
        .batch_sizes
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
    if a.anchor.is_some() && a.model != "treelstm" {
        return Err(format!("--anchor times the reference treelstm, not `{}`", a.model).into());
    }
    let BenchInputs {
        graphs: inputs,
        model,
        vocab,
    } = read_inputs(&a, sizes.iter().copied().max().unwrap_or(1))?;
    if let Some(big) = sizes.iter().find(|&&bs| bs > inputs.len()) {
        return Err(format!(
            "batch size {big} exceeds the {} inputs in {}",
            inputs.len(),
            a.trees.display()
        )
        .into());
    }
    let need = bench_need(&a, &model, &inputs, &sizes, vocab)?;
    let params = Params::<f32>::init(&model, 0);
    if let Some(profiled) = a.profile_inputs {
        return traffic::run(&a, profiled, &model, &params, &inputs, &sizes);
    }
    match a.engine.as_str() {
        "batched" => {}
        "compiled" => return compiled::run(&a, &model, &params, &inputs, &sizes),
        "persistent" => return persistent::run(&a, &model, &params, &inputs, &sizes),
        other => {
            return Err(format!(
                "unknown engine `{other}` (expected batched, compiled or persistent)"
            )
            .into())
        }
    }
    let (mut engine, table_ms) = bench_engine(&a, &model, (params, bench_optimizer()), vocab)?;
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
            // submitted as the trainer does: a device engine's step
            // reports its outcome with the next one's loss
            let time = median_time(a.reps, || {
                let b = Batch::new(&model, batch.clone(), policy)?;
                for earlier in engine.engine().submit(std::slice::from_ref(&b))? {
                    earlier.map_err(ramus_exec::ExecError::from)?;
                }
                Ok(())
            })?;
            for outcome in engine.engine().finish()? {
                outcome.map_err(ramus_exec::ExecError::from)?;
            }
            time
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
        run_anchor(&a, anchor, &results)?;
    }
    Ok(())
}

/// Runs the PyTorch anchor on the same trees and device and prints its
/// lines and the Ramus / PyTorch ratios of `results` (matched by batch).
pub(crate) fn run_anchor(
    a: &BenchArgs,
    anchor: &std::path::Path,
    results: &[serde_json::Value],
) -> AnyResult {
    let out = Command::new(&a.python)
        .arg(anchor)
        .arg(&a.trees)
        .args([
            "--device",
            match a.device {
                Device::Cpu => "cpu",
                Device::Cuda => "cuda",
            },
            "--hidden",
            &a.hidden.to_string(),
            "--batch-sizes",
            &a.batch_sizes,
        ])
        .args(["--reps", &a.reps.to_string(), "--skip-eager"])
        .output()
        .map_err(|e| format!("cannot run {} {}: {e}", a.python, anchor.display()))?;
    if !out.status.success() {
        return Err(format!("anchor failed: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        outln!("{line}")?;
        let Ok(t) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if let Some(r) = results.iter().find(|r| r["batch"] == t["batch"]) {
            let ratio = |k: &str, inverse: bool| -> Option<f64> {
                let (x, y) = (r[k].as_f64()?, t[k].as_f64()?);
                Some(((if inverse { y / x } else { x / y }) * 100.0).round() / 100.0)
            };
            outln!(
                "{}",
                serde_json::json!({
                    "ratio": "ramus_vs_pytorch_levelbatch", "batch": t["batch"], "hidden": a.hidden,
                    "infer_speedup": ratio("infer_ms", true), "train_speedup": ratio("train_sent_per_s", false),
                })
            )?;
        }
    }
    Ok(())
}
