//! The `ramus` command: train, evaluate, benchmark and inspect models.

mod bench;
mod bench_swap;
mod data;
mod device;
mod image_dir;
mod infer;
mod plan_memory;
mod sequence;
mod vision;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

use ramus_core::{HeadRows, Model, Params};
use ramus_graph::BatchingPolicy;
use ramus_nn::checkpoint;
use ramus_nn::nonfinite::first_nonfinite;
use ramus_nn::{
    build_model_with, build_sequence_model, build_vision_model, data_kind, DataKind, EvalResult,
    ModelConfig, ModelOptions, OnNonFinite, OptimizerConfig, OptimizerKind, SequenceConfig,
    Trainer, VisionConfig,
};

/// mimalloc instead of the system allocator: the persistent engine lowers
/// and encodes a window of batches on every core at once, tens of thousands
/// of small vectors per batch; with glibc's allocator those threads contend
/// on its arenas and on page faults (one batch of 128 N-ary trees: 12.5 ms
/// to lower and encode on one core with glibc, 8.2 ms with mimalloc).
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
    #[command(flatten)]
    vision: vision::VisionArgs,
    #[command(flatten)]
    sequence: sequence::SequenceArgs,
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
    /// Write a safetensors checkpoint here after training.
    #[arg(long)]
    save: Option<PathBuf>,
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
    engine: device::TrainEngine,
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
        Command::Train(a) => train(a),
        Command::Eval(a) => eval(a),
        Command::Bench(a) => bench::run(a),
        Command::Infer(a) => infer::run(a),
        Command::PlanMemory(a) => plan_memory::run(a),
        Command::BenchSwap(a) => bench_swap::run_bench(a),
        Command::Inspect {
            model,
            hidden,
            fusion,
        } => inspect(&model, hidden, fusion),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

type AnyResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

fn train(mut a: TrainArgs) -> AnyResult {
    let kind = data::data_kind_of(&a.model)?;
    let policy: BatchingPolicy = a.policy.parse()?;
    let vision_cfg = a.vision.config(&a.model, kind)?;
    let (optimizer, lr) = vision::optimizer_defaults(kind, a.optimizer.as_deref(), a.lr);
    let opt: OptimizerKind = optimizer.parse()?;
    let hidden = a.hidden.unwrap_or(match kind {
        DataKind::Images => vision::DEFAULT_CNN_WIDTH,
        _ => vision::DEFAULT_HIDDEN,
    });
    if a.batch_size == 0 || hidden == 0 {
        return Err("--batch-size and --hidden must be at least 1".into());
    }
    let mut oc = OptimizerConfig::new(opt, lr);
    oc.weight_decay = a.weight_decay;
    oc.clip_norm = a.clip;
    oc.validate()?;
    let opts = ModelOptions { dropout: a.dropout };
    opts.validate()?;
    a.engine = device::engine_for_nonfinite(a.engine, a.on_nonfinite)?;
    let data = match &vision_cfg {
        Some(v) => data::load_image_splits(
            a.data.as_deref(),
            v.image,
            a.vision.images.unwrap_or(vision::DEFAULT_TRAIN_IMAGES),
        )?,
        None => data::load_splits(a.data.as_deref(), kind)?,
    };
    println!(
        "data: {} ({} train / {} dev / {} test, {})",
        data.source,
        data.train.len(),
        data.dev.len(),
        data.test.len(),
        data.describe()
    );
    let cfg = ModelConfig {
        vocab: data.vocab.len(),
        hidden,
        classes: data.classes,
    };
    let seq_cfg = a.sequence.config(&a.model, data.chars())?;
    let mut model = build(&a.model, &cfg, vision_cfg.as_ref(), seq_cfg.as_ref(), &opts)?;
    if !data.class_names.is_empty() {
        model.settings.insert(
            "class_names".into(),
            serde_json::to_string(&data.class_names)?,
        );
    }
    if let (DataKind::Tagged { chars: true }, Some(t)) = (kind, &data.tagged) {
        model
            .settings
            .insert(sequence::CHAR_VOCAB_SETTING.into(), t.chars.to_json());
    }
    if let Some(at) = a.loss_at.as_deref() {
        model.head.rows = loss_rows(at).map_err(|e| format!("--loss-at {e}"))?;
        // recorded so that `ramus eval` reports the loss the model trained on
        model.settings.insert("loss_at".into(), at.into());
    }
    let params = Params::<f32>::init(&model, a.seed);
    let swap = device::swap_mode(a.device, &a.model, a.device_memory_budget, a.swap)?;
    let engine =
        match device::training_engine(a.engine, a.device, &model, &params, oc, a.batch_size)? {
            Some(persistent) => persistent,
            None => device::engine_with_swap(a.device, &model, a.device_memory_budget, swap)?,
        };
    let mut trainer = Trainer::new(model, params, oc);
    trainer.engine = engine;
    trainer.policy = policy;
    trainer.on_nonfinite = a.on_nonfinite;
    trainer.check_nonfinite_policy()?;
    trainer.engine.set_seed(a.seed);
    let mut rng = ramus_nn::train::rng(a.seed);
    println!(
        "model: {} hidden {} | optimizer {} lr {} | batch {} | engine {} ({} host threads){}",
        a.model,
        hidden,
        optimizer,
        lr,
        a.batch_size,
        trainer.engine.name(),
        rayon::current_num_threads(),
        match swap {
            ramus_cuda::SwapMode::Off => String::new(),
            mode => format!(" | swap {mode}"),
        }
    );
    let started = Instant::now();
    let mut best: Option<(f64, usize, Params<f32>)> = None;
    let style =
        ProgressStyle::with_template("epoch {prefix} [{bar:30}] {pos}/{len} {per_sec} loss {msg}")
            .map_err(|e| e.to_string())?
            .progress_chars("=> ");
    for epoch in 1..=a.epochs {
        let bar = if a.quiet {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(data.train.len() as u64)
        };
        bar.set_style(style.clone());
        bar.set_prefix(epoch.to_string());
        let t0 = Instant::now();
        let loss = trainer
            .train_epoch(&data.train, a.batch_size, &mut rng, |_, seen, loss| {
                bar.set_position(seen as u64);
                bar.set_message(format!("{loss:.4}"));
            })
            .map_err(|e| format!("epoch {epoch}: {e}"))?;
        bar.finish_and_clear();
        let secs = t0.elapsed().as_secs_f64();
        if let Some(report) = trainer.engine.memory_report() {
            println!("  {report}");
        }
        let dev = trainer.evaluate(&data.dev, 64)?;
        println!(
            "epoch {epoch}: train loss {loss:.4} | dev loss {:.4} {} | {:.0} {}/s{}",
            dev.loss,
            vision::accuracy(kind, &dev),
            data.train.len() as f64 / secs,
            vision::unit(kind).0,
            match a.on_nonfinite {
                OnNonFinite::SkipBatch =>
                    format!(" | {} non-finite batches skipped", trainer.skipped),
                OnNonFinite::Stop => String::new(),
            }
        );
        // keep the parameters of the epoch with the best dev accuracy, if finite
        let acc = selection_accuracy(kind, &dev);
        if let Some(why) = nonfinite_model(&trainer, dev.loss) {
            println!("  epoch {epoch}'s model is not kept: {why}");
        } else if best.as_ref().is_none_or(|(best, _, _)| acc > *best) {
            best = Some((acc, epoch, trainer.params.clone()));
        }
    }
    if let Some((acc, epoch, params)) = best {
        if epoch != a.epochs {
            println!(
                "using the parameters of epoch {epoch} (best dev {}acc {:.2}%)",
                match kind {
                    DataKind::Images => "",
                    DataKind::Tagged { .. } => "tag ",
                    _ => "root ",
                },
                100.0 * acc
            );
        }
        trainer.params = params;
    }
    let test = trainer.evaluate(&data.test, 64)?;
    println!(
        "test: loss {:.4} {} ({} {}) | trained in {:.1} s",
        test.loss,
        vision::accuracy(kind, &test),
        test.graphs,
        vision::unit(kind).1,
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = a.save {
        if let Some(why) = nonfinite_model(&trainer, test.loss) {
            return Err(format!(
                "not saving {}: the model is not finite ({why})",
                path.display()
            )
            .into());
        }
        checkpoint::save(&path, &trainer.model, &trainer.params, &data.vocab)?;
        println!("saved {}", path.display());
    }
    Ok(())
}

/// Why the trainer's model must not be kept or saved: a parameter that is
/// not finite, or a non-finite loss on held-out data; `None` if finite.
fn nonfinite_model(trainer: &Trainer<f32>, loss: f64) -> Option<String> {
    match first_nonfinite(&trainer.model, &trainer.params, None) {
        Some(p) => Some(format!("parameter {p} is not finite")),
        None if !loss.is_finite() => Some(format!("its loss on held-out data is {loss}")),
        None => None,
    }
}

/// The dev accuracy that picks the best epoch: per-token tag accuracy for
/// the taggers, root (sentence / image) accuracy for the rest.
fn selection_accuracy(kind: DataKind, r: &EvalResult) -> f64 {
    match kind {
        DataKind::Tagged { .. } => r.node_accuracy,
        _ => r.root_accuracy,
    }
}

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
/// load (non-finite values and unused tensors refused unless `flags` allow them).
pub(crate) fn load_checkpoint(path: &std::path::Path, flags: CheckpointFlags) -> AnyResult<Loaded> {
    let (info, bytes) = checkpoint::read_info(path)?;
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
    let kind = data_kind(&info.model).ok_or("checkpoint names an unknown model")?;
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
    let (params, defaulted) = checkpoint::load_params_with(path, &bytes, &model, flags.options())?;
    if let Some(first) = defaulted.first() {
        eprintln!(
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

fn eval(a: EvalArgs) -> AnyResult {
    let Loaded {
        info,
        model,
        params,
        kind,
        vision: vision_cfg,
    } = load_checkpoint(&a.checkpoint, a.checkpoint_flags)?;
    let graphs = match &vision_cfg {
        Some(v) => {
            let names = info
                .settings
                .get("class_names")
                .ok_or("checkpoint settings lack `class_names`")?;
            let names: Vec<String> = serde_json::from_str(names)
                .map_err(|e| format!("checkpoint setting `class_names`: {e}"))?;
            data::read_image_split(&a.data, &names, v.image)?
        }
        None => match kind {
            DataKind::Tagged { chars } => {
                let vocab = sequence::tagged_vocab(&info.vocab, &info.settings)?;
                data::read_tagged_frozen(&a.data, &vocab, chars)?
            }
            _ => data::read_frozen(&a.data, kind, &info.vocab)?,
        },
    };
    let mut engine = device::engine(a.device, &model, None)?;
    let r = ramus_nn::evaluate(
        &model,
        &params,
        engine.as_mut(),
        BatchingPolicy::Cavs,
        &graphs,
        a.batch_size,
    )?;
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "model": info.model, "data": a.data.display().to_string(), "graphs": r.graphs,
                "loss": r.loss, "root_accuracy": r.root_accuracy, "node_accuracy": r.node_accuracy,
            })
        );
    } else if let DataKind::Tagged { .. } = kind {
        println!(
            "{}: {} sentences | loss {:.4} | tag acc {:.2}%",
            a.data.display(),
            r.graphs,
            r.loss,
            100.0 * r.node_accuracy
        );
    } else if kind == DataKind::Images {
        println!(
            "{}: {} images | loss {:.4} | acc {:.2}%",
            a.data.display(),
            r.graphs,
            r.loss,
            100.0 * r.root_accuracy
        );
    } else {
        println!(
            "{}: {} graphs | loss {:.4} | root acc {:.2}% | all-node acc {:.2}%",
            a.data.display(),
            r.graphs,
            r.loss,
            100.0 * r.root_accuracy,
            100.0 * r.node_accuracy
        );
    }
    Ok(())
}

fn inspect(model: &str, hidden: usize, fusion: bool) -> AnyResult {
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
    let m = build(model, &cfg, None, seq.as_ref(), &ModelOptions::default())?;
    if fusion {
        print!("{}", ramus_cuda::fusion_listing(&m)?);
    } else {
        print!("{}", m.listing());
    }
    Ok(())
}
