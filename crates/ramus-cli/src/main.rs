//! The `ramus` command: train, evaluate, benchmark and inspect models.

mod args;
mod bench;
mod bench_swap;
mod data;
mod device;
mod device_name;
mod distributed;
mod embeddings;
mod export;
mod image_dir;
mod infer;
mod infer_engine;
mod labels;
mod limits;
mod lr;
mod metrics;
mod model_build;
mod output;
mod plan_memory;
mod plot;
mod predict;
mod raw_text;
#[cfg(test)]
mod reader_props;
mod result;
mod run_config;
mod sequence;
mod splits;
mod structure;
mod support;
mod train;
mod vision;

use std::process::ExitCode;

use clap::Parser;

use args::{Cli, Command, EvalArgs};
use model_build::{build, load_checkpoint, Loaded};
use output::{noteln, outln};
use ramus_core::Model;
use ramus_exec::memory::Pass;
use ramus_graph::BatchingPolicy;
use ramus_nn::{data_kind, DataKind, ModelConfig, ModelOptions};
use result::AnyResult;

/// mimalloc instead of the system allocator: the persistent engine lowers
/// and encodes a window of batches on every core at once, tens of thousands
/// of small vectors per batch; with glibc's allocator those threads contend
/// on its arenas and on page faults (timings:
/// `docs/benchmarks.md#allocator-of-the-ramus-binary`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // an unknown RAMUS_CPU_ISA is refused here rather than ignored by the kernels
    if let Err(e) = ramus_core::isa::Isa::from_env() {
        noteln!("error: {e}");
        return ExitCode::FAILURE;
    }
    let result = match cli.command {
        Command::Train(a) => train::run(*a),
        Command::Eval(a) => eval(a),
        Command::Bench(a) => bench::run(a),
        Command::Infer(a) => infer::run(a),
        Command::Data { command } => export::run(command),
        Command::PlanMemory(a) => plan_memory::run(a),
        Command::Plot(a) => plot::run(a),
        Command::BenchSwap(a) => bench_swap::run_bench(a),
        Command::Inspect {
            model,
            hidden,
            fusion,
            support,
        } => {
            if support {
                inspect_support(hidden)
            } else {
                inspect(&model, hidden, fusion)
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // the reader of standard output stopped reading (`| head`): done
        Err(e) if e.is::<output::OutputClosed>() => ExitCode::SUCCESS,
        Err(e) => {
            noteln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn eval(a: EvalArgs) -> AnyResult {
    let Loaded {
        info,
        model,
        params,
        kind,
        vision: vision_cfg,
    } = load_checkpoint(&a.checkpoint, a.checkpoint_flags)?;
    let mut graphs = match &vision_cfg {
        Some(v) => {
            let names = labels::class_names(&info.settings)
                .map_err(|e| format!("{}: {e}", a.checkpoint.display()))?
                .ok_or_else(|| {
                    format!(
                        "{}: checkpoint settings lack `class_names`",
                        a.checkpoint.display()
                    )
                })?;
            data::read_image_split(&a.data, &names, v.image)?
        }
        None => match kind {
            DataKind::Tagged { chars } => {
                let vocab = sequence::tagged_vocab(&info.vocab, &info.settings)
                    .map_err(|e| format!("{}: {e}", a.checkpoint.display()))?;
                data::read_tagged_frozen(&a.data, &vocab, chars)?
            }
            _ => {
                let mut guard = a.host.build_guard(Some((&model, a.device)));
                data::read_frozen(&a.data, kind, &info.vocab, &mut guard)?
            }
        },
    };
    a.structure.fit(&model, kind, &mut graphs)?;
    labels::check_checkpoint(&graphs, &model, &a.checkpoint)?;
    let need = limits::Inference::loaded(
        &model,
        &graphs,
        a.batch_size,
        Pass::Evaluate,
        None,
        a.device,
    );
    need.check_host(a.host)?;
    let mut engine = device::evaluator(a.device, &model, params, None)?;
    need.check_device(engine.as_ref(), None)?;
    let r = ramus_nn::evaluate(engine.as_mut(), BatchingPolicy::Cavs, &graphs, a.batch_size)?;
    if a.json {
        outln!(
            "{}",
            serde_json::json!({
                "model": info.model, "data": a.data.display().to_string(), "graphs": r.graphs,
                "loss": r.loss, "root_accuracy": r.root_accuracy, "node_accuracy": r.node_accuracy,
            })
        )?;
    } else if let DataKind::Tagged { .. } = kind {
        outln!(
            "{}: {} sentences | loss {:.4} | tag acc {:.2}%",
            a.data.display(),
            r.graphs,
            r.loss,
            100.0 * r.node_accuracy
        )?;
    } else if kind == DataKind::Images {
        outln!(
            "{}: {} images | loss {:.4} | acc {:.2}%",
            a.data.display(),
            r.graphs,
            r.loss,
            100.0 * r.root_accuracy
        )?;
    } else {
        outln!(
            "{}: {} graphs | loss {:.4} | root acc {:.2}% | all-node acc {:.2}%",
            a.data.display(),
            r.graphs,
            r.loss,
            100.0 * r.root_accuracy,
            100.0 * r.node_accuracy
        )?;
    }
    Ok(())
}

/// Built-in model `model` as `ramus inspect` shows it (hidden width
/// `hidden`, a vocabulary of 100).
fn inspect_model(model: &str, hidden: usize) -> AnyResult<Model> {
    let kind = data_kind(model).ok_or_else(|| format!("unknown model `{model}`"))?;
    let classes = match kind {
        DataKind::Trees | DataKind::Tagged { .. } | DataKind::SentencePyramid => 5,
        DataKind::Images => 10,
        DataKind::Sentences => 0,
    };
    let seq = sequence::SequenceArgs::default().config(model, 40)?;
    let cfg = ModelConfig {
        vocab: 100,
        hidden,
        classes,
    };
    Ok(build(
        model,
        &cfg,
        None,
        seq.as_ref(),
        &ModelOptions::default(),
    )?)
}

fn inspect(model: &str, hidden: usize, fusion: bool) -> AnyResult {
    let m = inspect_model(model, hidden)?;
    if fusion {
        crate::output::write(format_args!("{}", ramus_cuda::fusion_listing(&m)?))?;
    } else {
        crate::output::write(format_args!("{}", m.listing()))?;
    }
    Ok(())
}

/// `ramus inspect --support`: the engine support table of every built-in model.
fn inspect_support(hidden: usize) -> AnyResult {
    let models = ramus_nn::MODEL_NAMES
        .iter()
        .map(|&name| Ok((name, inspect_model(name, hidden)?)))
        .collect::<AnyResult<Vec<_>>>()?;
    crate::output::write(format_args!("{}", support::table(&models)))?;
    Ok(())
}
