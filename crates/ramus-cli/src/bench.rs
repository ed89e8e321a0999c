//! `ramus bench`: inference latency and training throughput of the
//! reference Tree-LSTM on the first trees of a file (the batches the
//! PyTorch anchor uses), optionally with the anchor run in the same process
//! tree for side-by-side ratios.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use ramus_core::{Grads, Params};
use ramus_cpu::{Batch, CpuEngine, Mode};
use ramus_graph::{ptb, BatchingPolicy, InputGraph, Vocab, VocabMode};
use ramus_nn::{build_model, ModelConfig, Optimizer, OptimizerConfig, OptimizerKind};

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Tree file (SST format); batches are its first B trees.
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
}

type AnyResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// Median of `reps` timed calls after 3 warm-up calls, in seconds.
fn median_time(reps: usize, mut f: impl FnMut() -> AnyResult) -> AnyResult<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut samples = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f()?;
        samples.push(t.elapsed().as_secs_f64());
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples[samples.len() / 2])
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
    let mut vocab = Vocab::new();
    let trees = ptb::read_trees(&a.trees, VocabMode::Grow(&mut vocab))?;
    let model = build_model(
        "treelstm",
        &ModelConfig {
            vocab: vocab.len(),
            hidden: a.hidden,
            classes: 5,
        },
    )?;
    let mut params = Params::<f32>::init(&model, 0);
    let mut opt = Optimizer::new(OptimizerConfig::new(OptimizerKind::Sgd, 0.05), &params);
    let mut grads = Grads::zeros(&model);
    let mut engine = CpuEngine::<f32>::new();
    // inference uses leaf specialisation: per-token leaf cells computed once
    // for the fixed parameters (Cortex's hoisting), timed separately
    engine.use_token_tables(Some(vocab.len()));
    let t = Instant::now();
    engine.prepare_token_tables(&model, &params)?;
    let table_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut results = Vec::new();
    for &bs in &sizes {
        if bs > trees.len() {
            return Err(format!(
                "batch size {bs} exceeds the {} trees in {}",
                trees.len(),
                a.trees.display()
            )
            .into());
        }
        let batch: Vec<&InputGraph> = trees[..bs].iter().collect();
        let nodes: usize = batch.iter().map(|g| g.len()).sum();
        let infer = median_time(a.reps, || {
            let b = Batch::new(&model, batch.clone(), policy)?;
            engine.forward(&model, &params, &b, Mode::Infer)?;
            Ok(())
        })?;
        let train = if a.infer_only {
            f64::NAN
        } else {
            median_time(a.reps, || {
                let b = Batch::new(&model, batch.clone(), policy)?;
                engine.forward(&model, &params, &b, Mode::Train)?;
                grads.clear();
                engine.backward(&model, &params, &b, &mut grads)?;
                opt.step(&mut params, &grads);
                Ok(())
            })?
        };
        let line = serde_json::json!({
            "system": "ramus", "engine": "cpu-batched", "device": "cpu", "policy": a.policy,
            "threads": rayon::current_num_threads(), "hidden": a.hidden, "batch": bs, "nodes": nodes,
            "infer_ms": (infer * 1e6).round() / 1e3, "train_sent_per_s": ((bs as f64 / train) * 10.0).round() / 10.0,
            "leaf_table_build_ms": (table_ms * 10.0).round() / 10.0,
        });
        println!("{line}");
        results.push(line);
    }
    if let Some(anchor) = a.anchor {
        let out = Command::new(&a.python)
            .arg(&anchor)
            .arg(&a.trees)
            .args([
                "--device",
                "cpu",
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
            println!("{line}");
            let Ok(t) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if let Some(r) = results.iter().find(|r| r["batch"] == t["batch"]) {
                let ratio = |k: &str, inverse: bool| -> Option<f64> {
                    let (x, y) = (r[k].as_f64()?, t[k].as_f64()?);
                    Some(((if inverse { y / x } else { x / y }) * 100.0).round() / 100.0)
                };
                println!(
                    "{}",
                    serde_json::json!({
                        "ratio": "ramus_vs_pytorch_levelbatch", "batch": t["batch"], "hidden": a.hidden,
                        "infer_speedup": ratio("infer_ms", true), "train_speedup": ratio("train_sent_per_s", false),
                    })
                );
            }
        }
    }
    Ok(())
}
