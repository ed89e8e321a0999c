//! `ramus bench-swap`: training step time past device memory, the thesis'
//! Table 6.2 comparison. For each CNN, the in-memory run (swap path, no
//! budget) gives the step time and the peak device memory; then for each
//! Nm = peak / budget, fresh engines train the same K batches from the same
//! parameters with no swapping (where it fits), naive on-demand swapping and
//! the AutoVM planner, and the losses after K steps must be identical. With
//! `--torch`, the PyTorch script (`bench/torch_swap.py`: the same network
//! with `torch.autograd.graph.save_on_cpu(pin_memory=True)`, capped at the
//! same budgets) runs on the same device right after each network's
//! in-memory run, and its step time at each Nm is printed next to Ramus'
//! (the `torch` and `planner/torch` columns).

use crate::result::AnyResult;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use ramus_core::{Model, Params};
use ramus_cuda::{SwapConfig, SwapMode, SwapStepReport};
use ramus_exec::Batch;
use ramus_exec::{OptimizerConfig, OptimizerKind, TrainEngine};
use ramus_graph::{images, BatchingPolicy, InputGraph};
use ramus_nn::vision::parse_blocks;
use ramus_nn::{build_vision_model, ImageShape, ModelConfig, ModelOptions, VisionConfig};
use ramus_swap::human_bytes;
use serde_json::json;

use crate::device;
use crate::output::{noteln, outln};

#[derive(clap::Args)]
pub struct BenchSwapArgs {
    /// CNNs, comma-separated: vgg11 ... vgg19, resnet, alexnet.
    #[arg(long, default_value = "vgg19,resnet")]
    models: String,
    /// Image shape CxHxW.
    #[arg(long, default_value = "3x224x224")]
    image: ImageShape,
    /// Images per batch.
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// Width knob: channels of the first stage (64: the published widths).
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// ResNet bottleneck blocks per stage (3,4,6,3: ResNet-50's layout).
    #[arg(long, default_value = "3,4,6,3")]
    blocks: String,
    /// Timed training steps per run (the losses after them are compared).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed steps first (the planner's profiled first iteration is one).
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Nm values: peak memory / budget.
    #[arg(long, default_value = "0.5,1,1.5,2,2.5")]
    ratios: String,
    /// Modes per Nm: none (no swapping, only where it fits), naive,
    /// planner, and off (the plain engine).
    #[arg(long, default_value = "none,naive,planner")]
    modes: String,
    /// sgd, adagrad or adam.
    #[arg(long, default_value = "sgd")]
    optimizer: String,
    #[arg(long, default_value_t = 0.01)]
    lr: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also run this PyTorch script (bench/torch_swap.py) on the same
    /// network, batch and budgets, and print its step times alongside.
    #[arg(long)]
    torch: Option<PathBuf>,
    /// Python interpreter for --torch.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Write every run as one JSON object per line here.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// What one run of K steps gave.
struct RunResult {
    /// Mean seconds per timed step.
    step_s: f64,
    losses: Vec<f64>,
    report: Option<SwapStepReport>,
}

fn parse_list<T: std::str::FromStr>(s: &str, what: &str) -> Result<Vec<T>, String> {
    s.split(',')
        .map(|x| {
            x.trim()
                .parse()
                .map_err(|_| format!("{what}: `{x}` is not valid"))
        })
        .collect()
}

fn build(a: &BenchSwapArgs, name: &str) -> AnyResult<Model> {
    let vision = VisionConfig {
        image: a.image,
        vgg_depth: 19,
        resnet_blocks: parse_blocks(&a.blocks)?,
    };
    Ok(build_vision_model(
        name,
        &ModelConfig {
            vocab: 0,
            hidden: a.hidden,
            classes: 10,
        },
        &vision,
        &ModelOptions::default(),
    )?)
}

/// What every run of one `bench-swap` shares: the batches (`warmup`
/// untimed ones first), the optimizer, the Nm values and modes to run, the
/// seed.
struct Bench<'a> {
    data: Vec<Vec<&'a InputGraph>>,
    config: OptimizerConfig,
    ratios: Vec<f64>,
    modes: Vec<SwapMode>,
    warmup: usize,
    seed: u64,
}

/// Trains every batch of `b` from `params` with a fresh engine in `mode`
/// under `budget`.
fn run(
    b: &Bench,
    model: &Model,
    params: &Params<f32>,
    mode: SwapMode,
    budget: Option<u64>,
) -> AnyResult<RunResult> {
    let (data, warmup) = (&b.data, b.warmup);
    let swap = SwapConfig::with_mode(mode);
    let mut engine = device::swap_trainer(model, (params.clone(), b.config), budget, swap)?;
    engine.set_seed(b.seed);
    let mut losses = Vec::with_capacity(data.len());
    let mut started = None;
    for (i, graphs) in data.iter().enumerate() {
        if i == warmup {
            engine.engine().device().synchronize()?;
            started = Some(Instant::now());
        }
        let batch = Batch::new(model, graphs.clone(), BatchingPolicy::Cavs)?;
        // each step's outcome comes back with the next one's loss
        let earlier = engine
            .submit(std::slice::from_ref(&batch))
            .map_err(|e| format!("step {}: {e}", i + 1))?;
        for outcome in earlier {
            losses.push(
                outcome.map_err(|s| format!("step {i}: {}", ramus_exec::ExecError::from(s)))?,
            );
        }
    }
    for outcome in engine.finish()? {
        let step = losses.len() + 1;
        losses
            .push(outcome.map_err(|s| format!("step {step}: {}", ramus_exec::ExecError::from(s)))?);
    }
    engine.engine().device().synchronize()?;
    let timed = data.len().saturating_sub(warmup).max(1);
    let step_s = started.map_or(0.0, |t| t.elapsed().as_secs_f64() / timed as f64);
    Ok(RunResult {
        step_s,
        losses,
        report: engine.last_report().cloned(),
    })
}

fn ms(s: f64) -> String {
    format!("{:.1}", s * 1e3)
}

pub fn run_bench(a: BenchSwapArgs) -> AnyResult {
    if a.batch_size == 0 || a.steps == 0 {
        return Err("--batch-size and --steps must be at least 1".into());
    }
    let ratios: Vec<f64> = parse_list(&a.ratios, "--ratios")?;
    if ratios.iter().any(|r| !(r.is_finite() && *r > 0.0)) {
        return Err("--ratios must be positive numbers".into());
    }
    let modes: Vec<SwapMode> = parse_list(&a.modes, "--modes")?;
    let kind: OptimizerKind = a.optimizer.parse()?;
    let config = OptimizerConfig::new(kind, a.lr);
    config.validate()?;
    if let Some(p) = &a.json {
        ramus_exec::atomic::check_writable(p, "--json")?;
    }
    // every line so far, rewritten whole after each one: a kill leaves the
    // lines written before it, none torn
    let mut lines = String::new();
    let mut emit = |v: serde_json::Value| -> AnyResult {
        if let Some(p) = &a.json {
            lines.push_str(&format!("{v}\n"));
            ramus_exec::atomic::write_atomic(p, lines.as_bytes())
                .map_err(|e| format!("--json {}: {e}", p.display()))?;
        }
        Ok(())
    };
    let spec = images::ImageSpec {
        channels: a.image.channels,
        height: a.image.height,
        width: a.image.width,
        classes: 10,
        noise: 0.5,
    };
    let total = a.warmup + a.steps;
    let set = images::generate(&spec, a.seed, (total * a.batch_size, 0, 0))?;
    let bench = Bench {
        data: set
            .train
            .chunks(a.batch_size)
            .map(|c| c.iter().collect())
            .collect(),
        config,
        ratios,
        modes,
        warmup: a.warmup,
        seed: a.seed,
    };
    let models: Vec<String> = parse_list(&a.models, "--models")?;
    outln!(
        "bench-swap: batch {} of {} images, width {}, {} warm-up + {} timed steps, {} lr {}",
        a.batch_size,
        a.image,
        a.hidden,
        a.warmup,
        a.steps,
        a.optimizer,
        a.lr
    )?;
    for name in &models {
        bench_model(&a, &bench, name, &mut emit)?;
    }
    Ok(())
}

/// Prints and emits model `name`'s in-memory run `base`; its peak bytes.
fn report_in_memory(
    name: &str,
    base: &RunResult,
    emit: &mut dyn FnMut(serde_json::Value) -> AnyResult,
) -> AnyResult<u64> {
    let report = base.report.clone().ok_or("no swap report")?;
    let peak = report.pool_peak_bytes;
    outln!(
        "\n{name}: in memory (budget lifted) {} ms/step, peak {} ({} ops, {} tensors, \
         fixed overhead {})",
        ms(base.step_s),
        human_bytes(peak),
        report.ops,
        report.tensors,
        human_bytes(report.overhead_bytes)
    )?;
    emit(
        json!({"model": name, "mode": "in-memory", "budget": null, "nm": null,
        "step_s": base.step_s, "peak_bytes": peak, "losses": base.losses,
        "report": report.to_json()}),
    )?;
    Ok(peak)
}

/// The swap table's header: Nm, budget, each mode's and PyTorch's step
/// time, the ratios.
fn table_header(modes: &[SwapMode], torch: bool) -> String {
    let mut header = format!("{:>5} {:>10} {:>9}", "Nm", "budget", "in-mem");
    for m in modes {
        header.push_str(&format!(" {:>9}", m.name()));
    }
    if torch {
        header.push_str(&format!(" {:>9}", "torch"));
    }
    header.push_str("  planner/in-mem  naive/planner  moved/step  losses");
    if torch {
        header.push_str("  planner/torch");
    }
    header
}

/// Model `name`: its in-memory run, then a table row for each Nm with
/// every mode's step time (and PyTorch's, with `--torch`); each run is
/// also a JSON line for `emit`.
fn bench_model(
    a: &BenchSwapArgs,
    bench: &Bench,
    name: &str,
    emit: &mut dyn FnMut(serde_json::Value) -> AnyResult,
) -> AnyResult {
    let (ratios, modes) = (&bench.ratios, &bench.modes);
    let total = bench.data.len();
    let model = build(a, name)?;
    let params = Params::<f32>::init(&model, a.seed);
    let base = run(bench, &model, &params, SwapMode::Resident, None)
        .map_err(|e| format!("{name}, in memory: {e}"))?;
    let peak = report_in_memory(name, &base, emit)?;
    let budgets: Vec<u64> = ratios.iter().map(|nm| (peak as f64 / nm) as u64).collect();
    let torch = match &a.torch {
        Some(script) => Some(run_torch(a, script, name, &budgets, ratios, emit)?),
        None => None,
    };
    outln!("{}  (ms per step)", table_header(modes, torch.is_some()))?;
    for (&nm, &budget) in ratios.iter().zip(&budgets) {
        let mut row = format!(
            "{nm:>5.2} {:>10} {:>9}",
            human_bytes(budget),
            ms(base.step_s)
        );
        let mut times = HashMap::new();
        let mut identical = true;
        let mut moved = String::from("-");
        let mut finals = Vec::new();
        for &mode in modes {
            match run(bench, &model, &params, mode, Some(budget)) {
                Ok(r) => {
                    row.push_str(&format!(" {:>9}", ms(r.step_s)));
                    identical &= r.losses == base.losses;
                    finals.push(format!(
                        "{}={:.6}",
                        mode.name(),
                        r.losses.last().copied().unwrap_or(f64::NAN)
                    ));
                    if let (SwapMode::Planner, Some(rep)) = (mode, &r.report) {
                        moved = human_bytes(rep.exec.bytes_to_host + rep.exec.bytes_to_device);
                    }
                    times.insert(mode, r.step_s);
                    emit(json!({"model": name, "mode": mode.name(), "budget": budget,
                        "nm": nm, "step_s": r.step_s, "losses": r.losses,
                        "identical": r.losses == base.losses,
                        "report": r.report.as_ref().map(|x| x.to_json())}))?;
                }
                Err(e) => {
                    row.push_str(&format!(" {:>9}", "-"));
                    emit(json!({"model": name, "mode": mode.name(), "budget": budget,
                        "nm": nm, "error": e.to_string()}))?;
                    if mode != SwapMode::Resident || nm <= 1.0 {
                        noteln!("  {name} Nm {nm} {}: {e}", mode.name());
                    }
                }
            }
        }
        let torch_s = torch.as_ref().and_then(|t| t.get(&budget).copied());
        if torch.is_some() {
            row.push_str(&format!(" {:>9}", torch_s.map_or("-".to_string(), ms)));
        }
        let ratio = |x: Option<&f64>, y: Option<&f64>| match (x, y) {
            (Some(x), Some(y)) if *y > 0.0 => format!("{:.2}", x / y),
            _ => "-".into(),
        };
        row.push_str(&format!(
            "  {:>14}  {:>13}  {:>10}  {:>9}",
            ratio(times.get(&SwapMode::Planner), Some(&base.step_s)),
            ratio(times.get(&SwapMode::Naive), times.get(&SwapMode::Planner)),
            moved,
            if identical { "identical" } else { "DIFFER" }
        ));
        if torch.is_some() {
            row.push_str(&format!(
                "  {:>13}",
                ratio(times.get(&SwapMode::Planner), torch_s.as_ref())
            ));
        }
        outln!("{row}")?;
        outln!(
            "        losses after {} steps: in-mem={:.6} {}",
            total,
            base.losses.last().copied().unwrap_or(f64::NAN),
            finals.join(" ")
        )?;
    }
    Ok(())
}

/// Runs the PyTorch script for `model` at `budgets` (Nm `ratios`), prints
/// its lines and returns its step time (seconds) at each budget it ran.
fn run_torch(
    a: &BenchSwapArgs,
    script: &std::path::Path,
    model: &str,
    budgets: &[u64],
    ratios: &[f64],
    emit: &mut dyn FnMut(serde_json::Value) -> AnyResult,
) -> AnyResult<HashMap<u64, f64>> {
    let list = |v: Vec<String>| v.join(",");
    let out = Command::new(&a.python)
        .arg(script)
        .args(["--model", model])
        .args(["--image", &a.image.to_string()])
        .args(["--batch-size", &a.batch_size.to_string()])
        .args(["--hidden", &a.hidden.to_string()])
        .args(["--blocks", &a.blocks])
        .args(["--steps", &a.steps.to_string()])
        .args(["--warmup", &a.warmup.to_string()])
        .args(["--optimizer", &a.optimizer])
        .args(["--lr", &a.lr.to_string()])
        .args([
            "--budgets",
            &list(budgets.iter().map(u64::to_string).collect()),
        ])
        .args([
            "--ratios",
            &list(ratios.iter().map(f64::to_string).collect()),
        ])
        .output()
        .map_err(|e| format!("cannot run {} {}: {e}", a.python, script.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    outln!("\nPyTorch ({model}, {}):", script.display())?;
    let mut times = HashMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            outln!("  {line}")?;
            continue;
        };
        let budget = v["budget"].as_u64().map_or("none".to_string(), human_bytes);
        let nm = v["nm"]
            .as_f64()
            .map_or(String::new(), |nm| format!(" (Nm {nm})"));
        let mode = v["mode"].as_str().unwrap_or("?");
        match v["step_s"].as_f64() {
            Some(s) => {
                outln!("  {mode:<12} budget {budget:>10}{nm}: {:>9} ms/step", ms(s))?;
                if let (Some(b), "save_on_cpu") = (v["budget"].as_u64(), mode) {
                    times.insert(b, s);
                }
            }
            None => outln!(
                "  {mode:<12} budget {budget:>10}{nm}: {}",
                v["error"].as_str().unwrap_or("failed")
            )?,
        }
        emit(v)?;
    }
    Ok(times)
}
