//! What `ramus bench` and its parts (compiled, persistent, traffic) share:
//! the arguments, the engine under test, timing, and the PyTorch anchor.

use crate::result::AnyResult;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use ramus_core::{Model, Params};
use ramus_cpu::{CpuEngine, CpuTrainer};
use ramus_cuda::CudaTrainer;
use ramus_exec::Batch;
use ramus_exec::{OptimizerConfig, OptimizerKind, TrainEngine};
use ramus_graph::{BatchingPolicy, InputGraph};

use crate::device::{self, Device};
use crate::output::outln;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Input file; batches are its first B inputs. Trees (SST format) for
    /// the tree models and the time-delay networks (read as pyramids over
    /// the leaves), tagged text (`word|TAG ...`, WikiNER) for the taggers,
    /// plain sentences for lstm-lm.
    pub(super) trees: PathBuf,
    #[arg(long, default_value_t = 256)]
    pub(super) hidden: usize,
    #[arg(long, default_value = "1,10,64")]
    pub(super) batch_sizes: String,
    #[arg(long, default_value_t = 20)]
    pub(super) reps: usize,
    /// Batching policy: cavs or agenda.
    #[arg(long, default_value = "cavs")]
    pub(super) policy: String,
    /// Also run this PyTorch anchor script (torch_treelstm.py) on the CPU
    /// right after, and print Ramus/PyTorch speed ratios.
    #[arg(long)]
    pub(super) anchor: Option<PathBuf>,
    /// Time inference only.
    #[arg(long)]
    pub(super) infer_only: bool,
    /// Python interpreter for the anchor.
    #[arg(long, default_value = "python3")]
    pub(super) python: String,
    /// Where to run: cpu or cuda (the anchor then runs on the same device).
    #[arg(long, default_value = "cpu")]
    pub(super) device: Device,
    /// Also report engine set-up: kernels compiled, cache hits, compile
    /// time, device memory.
    #[arg(long)]
    pub(super) verbose: bool,
    /// Cap on the device memory Ramus may use, in bytes (CUDA).
    #[arg(long)]
    pub(super) device_memory_budget: Option<u64>,
    /// batched (Cavs: forward, backward, training), compiled (Cortex:
    /// one generated kernel per batch, inference only, CUDA) or persistent
    /// (VPPS: one generated kernel per training batch, CUDA).
    #[arg(long, default_value = "batched")]
    pub(super) engine: String,
    /// Model to time: treelstm (the anchor's model), treelstm-nary, treefc,
    /// mvrnn (binary trees), treegru, rvnn, dagrnn (with --grid), the
    /// taggers bilstm-tagger and bilstm-char-tagger, the time-delay
    /// networks td-rnn and td-lstm, or lstm-lm.
    #[arg(long, default_value = "treelstm")]
    pub(super) model: String,
    /// With --engine compiled: time the Cortex ablation (fusion only, +
    /// leaf specialization, + model persistence, all with grid barriers
    /// between levels; + per-node completion counters instead of the
    /// barriers; then each of recursive refactoring and unrolling on top, as
    /// in Cortex Fig. 11) instead of the default schedule.
    #[arg(long)]
    pub(super) ablation: bool,
    #[command(flatten)]
    pub(super) recursion: RecursionFlags,
    #[command(flatten)]
    pub(super) sequence: crate::sequence::SequenceArgs,
    #[command(flatten)]
    pub(super) structure: crate::structure::StructureArgs,
    /// With --engine compiled: threads per block of the generated kernel
    /// [default: by the weight registers, 512 or 256].
    #[arg(long)]
    pub(super) block_threads: Option<u32>,
    /// With --engine compiled: resident blocks per multiprocessor at most.
    #[arg(long, default_value_t = 2)]
    pub(super) blocks_per_sm: u32,
    /// With --engine compiled: also time the batched engine on the same
    /// batches and device and print the compiled engine's speed-up.
    #[arg(long)]
    pub(super) compare_batched: bool,
    /// With --engine compiled: blocks in all at most.
    #[arg(long)]
    pub(super) max_blocks: Option<u32>,
    /// With --engine persistent: rows per warp of the register partitions.
    #[arg(long)]
    pub(super) rpw: Option<usize>,
    /// With --engine persistent: resident CTAs per SM, 1 or 2 (default:
    /// the plan's choice, searched with the rpw).
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub(super) ctas_per_sm: Option<u8>,
    /// With --engine persistent: keep the weight gradients in registers
    /// (true) or in device memory (false) (default: the plan's choice).
    #[arg(long)]
    pub(super) grads_in_registers: Option<bool>,
    /// Time synthetic ROWSxCOLS grid DAGs (random words of the tree file's
    /// vocabulary) instead of the trees, e.g. 10x10 for the DAG-RNN.
    #[arg(long)]
    pub(super) grid: Option<String>,
    /// Time perfect binary trees of this height (random words of the tree
    /// file's vocabulary) instead of the trees, e.g. 7 for Cortex's TreeFC.
    #[arg(long, conflicts_with = "grid")]
    pub(super) perfect_tree: Option<u32>,
    /// With --device cuda and --engine batched or persistent: instead of
    /// timing, train once over the first N trees in batches of each size,
    /// each pass the one stretch a profiler records (`ncu --replay-mode
    /// app-range`), to count the bytes the engine loads.
    #[arg(long)]
    pub(super) profile_inputs: Option<usize>,
    #[command(flatten)]
    pub(super) host: crate::limits::HostBudgetArgs,
    /// Also draw the speed-ups the bench prints (--compare-batched,
    /// --engine persistent's over the batched engine, --anchor's) as bars
    /// per batch size to this PNG (written atomically).
    #[arg(long)]
    pub(super) plot: Option<PathBuf>,
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
    pub(super) refactor: bool,
    /// Compiled engine: recursive refactoring off.
    #[arg(long)]
    pub(super) no_refactor: bool,
    /// Compiled engine: recursion unrolled once (a node with its children
    /// of the level below; trees and sequences only) [default: off].
    #[arg(long, conflicts_with = "no_unroll")]
    pub(super) unroll: bool,
    /// Compiled engine: unrolling off.
    #[arg(long)]
    pub(super) no_unroll: bool,
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
pub(super) enum BenchEngine {
    Cpu(Box<CpuTrainer<f32>>),
    Cuda(Box<CudaTrainer>),
}

impl BenchEngine {
    pub(super) fn engine(&mut self) -> &mut dyn TrainEngine<f32> {
        match self {
            BenchEngine::Cpu(e) => e.as_mut(),
            BenchEngine::Cuda(e) => e.as_mut(),
        }
    }
    /// Kernel launches so far (CUDA only).
    pub(super) fn launches(&self) -> Option<u64> {
        match self {
            BenchEngine::Cpu(_) => None,
            BenchEngine::Cuda(e) => Some(e.engine().launches()),
        }
    }
}

/// The optimizer the batched engine trains with in a benchmark.
pub(super) fn bench_optimizer() -> OptimizerConfig {
    OptimizerConfig::new(OptimizerKind::Sgd, 0.05)
}

/// Builds the engine, training `params` with `config`; the CPU one gets
/// per-token leaf tables (Cortex's leaf specialisation and hoisting for
/// fixed parameters), whose build time is returned.
pub(super) fn bench_engine(
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
pub(super) fn median_time(reps: usize, f: impl FnMut() -> AnyResult) -> AnyResult<f64> {
    let times = samples(reps, f)?;
    Ok(times[times.len() / 2])
}

/// Median seconds of a training step of `engine` on `batch` (`reps`
/// timed), submitted as the trainer does: a device engine's step reports
/// its outcome with the next one's loss.
pub(super) fn train_time(
    engine: &mut dyn TrainEngine<f32>,
    model: &Model,
    batch: &[&InputGraph],
    policy: BatchingPolicy,
    reps: usize,
) -> AnyResult<f64> {
    let time = median_time(reps, || {
        let b = Batch::new(model, batch.to_vec(), policy)?;
        for earlier in engine.submit(std::slice::from_ref(&b))? {
            earlier.map_err(ramus_exec::ExecError::from)?;
        }
        Ok(())
    })?;
    for outcome in engine.finish()? {
        outcome.map_err(ramus_exec::ExecError::from)?;
    }
    Ok(time)
}

/// Runs the PyTorch anchor on the same trees and device and prints its
/// lines and the Ramus / PyTorch ratios of `results` (matched by batch),
/// which it returns.
pub(crate) fn run_anchor(
    a: &BenchArgs,
    anchor: &std::path::Path,
    results: &[serde_json::Value],
) -> AnyResult<Vec<serde_json::Value>> {
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
    let mut ratios = Vec::new();
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
            let line = serde_json::json!({
                "ratio": "ramus_vs_pytorch_levelbatch", "batch": t["batch"], "hidden": a.hidden,
                "infer_speedup": ratio("infer_ms", true), "train_speedup": ratio("train_sent_per_s", false),
            });
            outln!("{line}")?;
            ratios.push(line);
        }
    }
    Ok(ratios)
}
