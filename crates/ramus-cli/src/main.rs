//! The `ramus` command: train, evaluate, benchmark and inspect models.

mod bench;
mod bench_swap;
mod data;
mod device;
mod image_dir;
mod infer;
mod infer_engine;
mod labels;
mod limits;
mod output;
mod plan_memory;
#[cfg(test)]
mod reader_props;
mod run_config;
mod sequence;
mod structure;
mod support;
mod train;
mod vision;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use output::{noteln, outln};
use ramus_core::{HeadRows, Model, Params};
use ramus_exec::memory::Pass;
use ramus_exec::OnNonFinite;
use ramus_graph::BatchingPolicy;
use ramus_nn::checkpoint;
use ramus_nn::{
    build_model_with, build_sequence_model, build_vision_model, data_kind, DataKind, ModelConfig,
    ModelOptions, SequenceConfig, VisionConfig,
};

/// mimalloc instead of the system allocator: the persistent engine lowers
/// and encodes a window of batches on every core at once, tens of thousands
/// of small vectors per batch; with glibc's allocator those threads contend
/// on its arenas and on page faults (timings:
/// `docs/benchmarks.md#allocator-of-the-ramus-binary`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "ramus",
    version,
    about = "Train and serve dynamic neural networks (trees, sequences, DAGs)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a model (with no --data: the built-in synthetic treebank,
    /// synthetic images for the CNN models, WikiNER for the taggers and
    /// SST for td-rnn / td-lstm from $RAMUS_DATA or ../shared/data).
    Train(TrainArgs),
    /// Evaluate a checkpoint on a data file.
    Eval(EvalArgs),
    /// Time inference and training of the reference Tree-LSTM on the first trees of a file.
    Bench(bench::BenchArgs),
    /// Predict with a checkpoint: trees from a file or standard input, one
    /// JSON line of scores per tree.
    Infer(infer::InferArgs),
    /// Plan one training iteration under a device memory budget (swap plan).
    PlanMemory(plan_memory::PlanMemoryArgs),
    /// Time CNN training past device memory: no swapping, naive swapping and
    /// the AutoVM planner at several peak/budget ratios (CUDA).
    BenchSwap(bench_swap::BenchSwapArgs),
    /// Print a model's vertex functions, derivatives and execution plans.
    Inspect {
        #[arg(long, default_value = "treelstm")]
        model: String,
        #[arg(long, default_value_t = 8)]
        hidden: usize,
        /// Print the fusion plans (what the CUDA engine launches per phase) instead.
        #[arg(long)]
        fusion: bool,
        /// Print which built-in model runs on which engine (every model,
        /// `--model` ignored), with the reason where one does not.
        #[arg(long, conflicts_with = "fusion")]
        support: bool,
    },
}

#[derive(clap::Args)]
struct TrainArgs {
    /// Directory with train.txt, dev.txt (or valid.txt) and test.txt; for
    /// the CNNs, train/, dev/ (or valid/) and test/ folders of class folders
    /// of PNG or JPEG images; for the taggers also one tagged file (or a
    /// directory with only dev.txt), split 80/10/10 by position.
    #[arg(long)]
    data: Option<PathBuf>,
    /// One of: treelstm (the reference child-sum model, root loss),
    /// treelstm-nary (binary Tree-LSTM, loss at every node), treefc, treegru
    /// (child-sum TreeGRU), mvrnn (matrix-vector RNN, binary trees), dagrnn
    /// (DAG-RNN over children), lstm-lm;
    /// VPPS benchmarks: bilstm-tagger, bilstm-char-tagger (on tagged text),
    /// td-rnn, td-lstm (time-delay pyramids over SST sentences), rvnn (SST
    /// trees, root loss); CNNs on images: alexnet, vgg (vgg11, vgg13,
    /// vgg16, vgg19), resnet.
    #[arg(long, default_value = "treelstm-nary")]
    model: String,
    /// Hidden size; for the CNNs the first stage's width (64 in the papers)
    /// [default: 64, CNNs 16].
    #[arg(long)]
    hidden: Option<usize>,
    /// Number of classes of a tree or td-rnn / td-lstm model [default: one
    /// more than the largest label of train, dev and test].
    #[arg(long)]
    classes: Option<usize>,
    #[command(flatten)]
    host: limits::HostBudgetArgs,
    #[command(flatten)]
    vision: vision::VisionArgs,
    #[command(flatten)]
    sequence: sequence::SequenceArgs,
    #[command(flatten)]
    structure: structure::StructureArgs,
    #[arg(long, default_value_t = 5)]
    epochs: usize,
    #[arg(long, default_value_t = 25)]
    batch_size: usize,
    /// sgd, adagrad or adam [default: adagrad; adam for the CNNs].
    #[arg(long)]
    optimizer: Option<String>,
    /// Learning rate [default: 0.05; 0.001 for the CNNs].
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    clip: Option<f64>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Batching policy: cavs or agenda.
    #[arg(long, default_value = "cavs")]
    policy: String,
    /// Dropout rate on word embeddings and the classifier input.
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// Where the loss is taken: `root` or `all` labelled nodes (default: the model's own choice).
    #[arg(long)]
    loss_at: Option<String>,
    /// Write a safetensors checkpoint here after training (checked before
    /// training starts; written atomically).
    #[arg(long)]
    save: Option<PathBuf>,
    /// Continue the run whose resumable checkpoint this is (a `last`
    /// checkpoint): parameters, optimizer state, position in the epoch,
    /// random streams and best dev epoch. Flags not given take the run's
    /// values; flags that change what it computes must not differ.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Save a resumable checkpoint every N batches, besides the one at the
    /// end of each epoch (needs --checkpoint-dir or --save).
    #[arg(long)]
    checkpoint_every: Option<usize>,
    /// Where the resumable checkpoints go: DIR/last.safetensors (the run
    /// so far) and DIR/best.safetensors (the best dev epoch) [default:
    /// beside --save, NAME.last.EXT and NAME.best.EXT; without --save,
    /// none].
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// A batch whose loss or a gradient is not finite: `stop` training with
    /// an error naming it, or `skip-batch` (leave the parameters and the
    /// optimizer state as before it, count it in the epoch's log line).
    #[arg(long, default_value = "stop")]
    on_nonfinite: OnNonFinite,
    /// No progress bars (log lines only).
    #[arg(long)]
    quiet: bool,
    /// Where to run: cpu or cuda.
    #[arg(long, default_value = "cpu")]
    device: device::Device,
    /// Cap on the device memory Ramus may use, in bytes (CUDA).
    #[arg(long)]
    device_memory_budget: Option<u64>,
    /// Training engine on CUDA: batched (Cavs), persistent (VPPS: one
    /// generated kernel per batch with the weights in registers; fails if
    /// the model cannot run on it) or auto (persistent where the weights
    /// fit on chip and the model's ops are supported, else batched, saying
    /// why).
    #[arg(long, default_value = "batched")]
    engine: device::TrainEngineChoice,
    /// How a CNN trains on CUDA under the budget: planner (AutoVM: planned
    /// offloads and prefetches on copy streams), naive (on-demand LRU
    /// swapping), none (no swapping: exceeding the budget is an error
    /// naming the op and tensor), auto (planner if the iteration does not
    /// fit, else none) or off (the plain engine) [default: auto with a
    /// budget, else off].
    #[arg(long)]
    swap: Option<ramus_cuda::SwapMode>,
}

#[derive(clap::Args)]
struct EvalArgs {
    /// A file of trees (or sentences, for a language model; tagged text
    /// for a tagger), or a folder of class folders of images for a CNN.
    #[arg(long)]
    data: PathBuf,
    #[arg(long)]
    checkpoint: PathBuf,
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Where to run: cpu or cuda.
    #[arg(long, default_value = "cpu")]
    device: device::Device,
    #[command(flatten)]
    host: limits::HostBudgetArgs,
    #[command(flatten)]
    structure: structure::StructureArgs,
    #[command(flatten)]
    checkpoint_flags: CheckpointFlags,
}

/// What `eval` and `infer` accept in a checkpoint beyond a clean one.
#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub(crate) struct CheckpointFlags {
    /// Load a checkpoint even if a tensor holds NaN or infinite values.
    #[arg(long)]
    allow_nonfinite_checkpoint: bool,
    /// Load a checkpoint even if it has tensors the model does not use
    /// (they are ignored).
    #[arg(long)]
    allow_unused_tensors: bool,
}

impl CheckpointFlags {
    fn options(self) -> checkpoint::LoadOptions {
        checkpoint::LoadOptions {
            allow_nonfinite: self.allow_nonfinite_checkpoint,
            allow_unused: self.allow_unused_tensors,
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(a) => train::run(a),
        Command::Eval(a) => eval(a),
        Command::Bench(a) => bench::run(a),
        Command::Infer(a) => infer::run(a),
        Command::PlanMemory(a) => plan_memory::run(a),
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

type AnyResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// Builds `name`: a CNN for `vision`, a sequence model for `seq`, else a
/// zoo model.
fn build(
    name: &str,
    cfg: &ModelConfig,
    vision: Option<&VisionConfig>,
    seq: Option<&SequenceConfig>,
    opts: &ModelOptions,
) -> ramus_core::Result<Model> {
    match (vision, seq) {
        (Some(v), _) => build_vision_model(name, cfg, v, opts),
        (None, Some(s)) => build_sequence_model(name, cfg, s, opts),
        (None, None) => build_model_with(name, cfg, opts),
    }
}

/// The head rows `--loss-at` names: `root` or `all` (labelled) vertices.
fn loss_rows(at: &str) -> Result<HeadRows, String> {
    match at {
        "root" => Ok(HeadRows::Roots),
        "all" => Ok(HeadRows::Labelled),
        other => Err(format!("must be root or all, got `{other}`")),
    }
}

/// A model and its trained parameters, read from a checkpoint.
pub(crate) struct Loaded {
    pub info: checkpoint::CheckpointInfo,
    pub model: ramus_core::Model,
    pub params: Params<f32>,
    pub kind: DataKind,
    pub vision: Option<ramus_nn::VisionConfig>,
}

/// Reads a checkpoint: its settings rebuild the model, then the parameters
/// load (non-finite values and unused tensors refused unless `flags` allow
/// them). Every error names the file.
pub(crate) fn load_checkpoint(path: &std::path::Path, flags: CheckpointFlags) -> AnyResult<Loaded> {
    let (info, bytes) = checkpoint::read_info(path)?;
    let (model, kind, vision_cfg) =
        model_of(&info).map_err(|e| format!("{}: {e}", path.display()))?;
    let (params, defaulted) = checkpoint::load_params_with(path, &bytes, &model, flags.options())?;
    if let Some(first) = defaulted.first() {
        noteln!(
            "note: {} predates running statistics: {} buffers (`{first}`, ...) start from \
             their initial values (mean 0, variance 1), which evaluation normalises with",
            path.display(),
            defaulted.len()
        );
    }
    Ok(Loaded {
        info,
        model,
        params,
        kind,
        vision: vision_cfg,
    })
}

/// The model a checkpoint's metadata describes (its name and settings).
fn model_of(
    info: &checkpoint::CheckpointInfo,
) -> AnyResult<(Model, DataKind, Option<ramus_nn::VisionConfig>)> {
    let setting = |k: &str| -> AnyResult<usize> {
        let v = info
            .settings
            .get(k)
            .ok_or_else(|| format!("checkpoint settings lack `{k}`"))?;
        Ok(v.parse()
            .map_err(|_| format!("checkpoint setting `{k}` = `{v}` is not a number"))?)
    };
    let cfg = ModelConfig {
        vocab: setting("vocab")?,
        hidden: setting("hidden")?,
        classes: setting("classes")?,
    };
    if cfg.vocab != info.vocab.len() {
        return Err(format!(
            "checkpoint vocabulary has {} words but the model was built for {}",
            info.vocab.len(),
            cfg.vocab
        )
        .into());
    }
    let kind = data_kind(&info.model)
        .ok_or_else(|| format!("checkpoint names an unknown model `{}`", info.model))?;
    let vision_cfg = match kind {
        DataKind::Images => Some(
            ramus_nn::VisionConfig::from_settings(&info.settings)
                .map_err(|e| format!("checkpoint settings: {e}"))?,
        ),
        _ => None,
    };
    let seq_cfg = sequence::from_settings(&info.model, &info.settings)?;
    let mut model = build(
        &info.model,
        &cfg,
        vision_cfg.as_ref(),
        seq_cfg.as_ref(),
        &ModelOptions::default(),
    )?;
    if let Some(at) = info.settings.get("loss_at") {
        model.head.rows =
            loss_rows(at).map_err(|e| format!("checkpoint setting `loss_at`: {e}"))?;
    }
    Ok((model, kind, vision_cfg))
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
            let names = info.settings.get("class_names").ok_or_else(|| {
                format!(
                    "{}: checkpoint settings lack `class_names`",
                    a.checkpoint.display()
                )
            })?;
            let names: Vec<String> = serde_json::from_str(names).map_err(|e| {
                format!(
                    "{}: checkpoint setting `class_names`: {e}",
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
