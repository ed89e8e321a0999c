//! The command line of `ramus`: its subcommands and the arguments of
//! `train` and `eval` (the other subcommands' live beside their code).

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use ramus_exec::OnNonFinite;

use crate::model_build::CheckpointFlags;
use crate::result::AnyResult;
use crate::{
    bench, bench_swap, device, export, infer, limits, plan_memory, plot, sequence, structure,
    vision,
};

#[derive(Parser)]
#[command(
    name = "ramus",
    version,
    about = "Train and serve dynamic neural networks (trees, sequences, DAGs)"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Train a model (with no --data: the built-in synthetic treebank,
    /// synthetic images for the CNN models, WikiNER for the taggers and
    /// SST for td-rnn / td-lstm from $RAMUS_DATA or ../shared/data).
    Train(Box<TrainArgs>),
    /// Evaluate a checkpoint on a data file.
    Eval(EvalArgs),
    /// Time inference and training of the reference Tree-LSTM on the first trees of a file.
    Bench(bench::BenchArgs),
    /// Predict with a checkpoint, one JSON line per input: the classes and
    /// their probabilities of trees or sentences (tree models), of each
    /// word (taggers) or of images (CNNs); the log-likelihood and
    /// perplexity of each sentence (lstm-lm).
    Infer(infer::InferArgs),
    /// Built-in data: `ramus data export --output DIR` writes it as files.
    Data {
        #[command(subcommand)]
        command: export::DataCommand,
    },
    /// Draw the loss and accuracy curves of runs (`train --log-dir`
    /// directories) to a PNG, one colour per run.
    Plot(plot::PlotArgs),
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
pub(crate) struct TrainArgs {
    /// Directory with train.txt, dev.txt (or valid.txt) and test.txt; for
    /// the CNNs, train/, dev/ (or valid/) and test/ folders of class folders
    /// of PNG or JPEG images; for the taggers also one tagged file (or a
    /// directory with only dev.txt), split 80/10/10 by position.
    #[arg(long)]
    pub(crate) data: Option<PathBuf>,
    /// One of: treelstm (the reference child-sum model, root loss),
    /// treelstm-nary (binary Tree-LSTM, loss at every node), treefc, treegru
    /// (child-sum TreeGRU), mvrnn (matrix-vector RNN, binary trees), dagrnn
    /// (DAG-RNN over children), lstm-lm;
    /// VPPS benchmarks: bilstm-tagger, bilstm-char-tagger (on tagged text),
    /// td-rnn, td-lstm (time-delay pyramids over SST sentences), rvnn (SST
    /// trees, root loss); CNNs on images: alexnet, vgg (vgg11, vgg13,
    /// vgg16, vgg19), resnet.
    #[arg(long, default_value = "treelstm-nary")]
    pub(crate) model: String,
    /// Hidden size; for the CNNs the first stage's width (64 in the papers)
    /// [default: 64, CNNs 16].
    #[arg(long)]
    pub(crate) hidden: Option<usize>,
    /// Number of classes of a tree or td-rnn / td-lstm model [default: one
    /// more than the largest label of train, dev and test].
    #[arg(long)]
    pub(crate) classes: Option<usize>,
    #[command(flatten)]
    pub(crate) host: limits::HostBudgetArgs,
    #[command(flatten)]
    pub(crate) vision: vision::VisionArgs,
    #[command(flatten)]
    pub(crate) sequence: sequence::SequenceArgs,
    #[command(flatten)]
    pub(crate) structure: structure::StructureArgs,
    #[arg(long, default_value_t = 5)]
    pub(crate) epochs: usize,
    /// Stop early once this many epochs have passed without a better dev
    /// accuracy (the test and the saved model then use the best epoch's
    /// parameters, as always).
    #[arg(long)]
    pub(crate) patience: Option<usize>,
    /// Graphs a batch (on several GPUs: a batch per GPU, so a step sees
    /// `--gpus` times as many).
    #[arg(long, default_value_t = 25)]
    pub(crate) batch_size: usize,
    /// Batches per optimizer step (gradient accumulation): a step sums the
    /// gradients of K consecutive batches, as one batch of them all would
    /// (K × --batch-size graphs, times --gpus), in the memory of one.
    #[arg(long, default_value_t = 1)]
    pub(crate) accumulate: usize,
    /// Train data-parallel on this many GPUs of this machine (with
    /// `--device cuda`): one worker process per GPU, each with its share of
    /// every step. Under torchrun, srun or mpirun leave it out: each process
    /// reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
    #[arg(long, default_value_t = 1)]
    pub(crate) gpus: usize,
    /// Train on this many machines of `--gpus` GPUs each: run the same
    /// command on every machine, each with its `--node-rank` and the same
    /// `--master`.
    #[arg(long, default_value_t = 1)]
    pub(crate) nodes: usize,
    /// This machine's place among `--nodes` (0 on the machine `--master`
    /// names).
    #[arg(long, default_value_t = 0)]
    pub(crate) node_rank: usize,
    /// ADDRESS:PORT of node 0, where the workers meet (with `--nodes` > 1;
    /// the port must be free there and open to the other machines).
    #[arg(long)]
    pub(crate) master: Option<String>,
    /// On several GPUs: seconds a worker waits for the others at a step
    /// before it gives up with an error (a worker that died or hangs), and
    /// the rendezvous's wait for every worker to start.
    #[arg(long, default_value_t = 600.0)]
    pub(crate) dist_timeout: f64,
    /// On several GPUs: batch normalisation's training statistics over
    /// every GPU's images (synchronized batch norm), not each GPU's own.
    #[arg(long)]
    pub(crate) sync_bn: bool,
    /// On several GPUs: MiB of gradients summed over the GPUs together,
    /// each bucket as soon as the backward pass has finished it (smaller:
    /// the sums start sooner, in more calls).
    #[arg(long, default_value_t = 25.0)]
    pub(crate) bucket_mb: f64,
    /// sgd, adagrad or adam [default: adagrad; adam for the CNNs].
    #[arg(long)]
    pub(crate) optimizer: Option<String>,
    /// Learning rate [default: 0.05; 0.001 for the CNNs].
    #[arg(long)]
    pub(crate) lr: Option<f64>,
    #[command(flatten)]
    pub(crate) rates: crate::lr::LrArgs,
    #[arg(long, default_value_t = 0.0)]
    pub(crate) weight_decay: f64,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    pub(crate) clip: Option<f64>,
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Batching policy: cavs or agenda.
    #[arg(long, default_value = "cavs")]
    pub(crate) policy: String,
    /// Initialise the word embedding table from pretrained vectors: a
    /// GloVe or word2vec text file (one word a line, then its values) or a
    /// .safetensors file (an F32 tensor `embeddings` [words, dim], the
    /// words in the metadata `words`, one a line), with as many values as
    /// --hidden. Trees and sentences: dev and test words the file has join
    /// the vocabulary. Words it lacks keep their random start.
    #[arg(long)]
    pub(crate) embeddings: Option<PathBuf>,
    /// Dropout rate on word embeddings and the classifier input.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) dropout: f64,
    /// Where the loss is taken: `root` or `all` labelled nodes (default: the model's own choice).
    #[arg(long)]
    pub(crate) loss_at: Option<String>,
    /// Write a safetensors checkpoint here after training (checked before
    /// training starts; written atomically).
    #[arg(long)]
    pub(crate) save: Option<PathBuf>,
    /// Continue the run whose resumable checkpoint this is (a `last`
    /// checkpoint): parameters, optimizer state, position in the epoch,
    /// random streams and best dev epoch. Flags not given take the run's
    /// values; flags that change what it computes must not differ.
    #[arg(long)]
    pub(crate) resume: Option<PathBuf>,
    /// Save a resumable checkpoint every N batches, besides the one at the
    /// end of each epoch (needs --checkpoint-dir or --save).
    #[arg(long)]
    pub(crate) checkpoint_every: Option<usize>,
    /// Where the resumable checkpoints go: DIR/last.safetensors (the run
    /// so far) and DIR/best.safetensors (the best dev epoch) [default:
    /// beside --save, NAME.last.EXT and NAME.best.EXT; without --save,
    /// none].
    #[arg(long)]
    pub(crate) checkpoint_dir: Option<PathBuf>,
    /// A batch whose loss or a gradient is not finite: `stop` training with
    /// an error naming it, or `skip-batch` (leave the parameters and the
    /// optimizer state as before it, count it in the epoch's log line).
    #[arg(long, default_value = "stop")]
    pub(crate) on_nonfinite: OnNonFinite,
    /// No progress bars (log lines only).
    #[arg(long)]
    pub(crate) quiet: bool,
    /// Write the run's configuration (DIR/config.json) and its metrics, one
    /// JSON object a line (DIR/metrics.jsonl: every epoch, the test
    /// evaluation, and every --log-every batches); a resumed run appends.
    #[arg(long)]
    pub(crate) log_dir: Option<PathBuf>,
    /// With --log-dir: also log the loss every N batches.
    #[arg(long)]
    pub(crate) log_every: Option<usize>,
    /// Where to run: cpu or cuda.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: device::Device,
    /// Cap on the device memory Ramus may use, in bytes (CUDA).
    #[arg(long)]
    pub(crate) device_memory_budget: Option<u64>,
    /// Training engine on CUDA: batched (Cavs), persistent (VPPS: one
    /// generated kernel per batch with the weights in registers; fails if
    /// the model cannot run on it) or auto (persistent where the weights
    /// fit on chip and the model's ops are supported, else batched, saying
    /// why).
    #[arg(long, default_value = "batched")]
    pub(crate) engine: device::TrainEngineChoice,
    /// How a CNN trains on CUDA under the budget: planner (AutoVM: planned
    /// offloads and prefetches on copy streams), naive (on-demand LRU
    /// swapping), none (no swapping: exceeding the budget is an error
    /// naming the op and tensor), auto (planner if the iteration does not
    /// fit, else none) or off (the plain engine) [default: auto with a
    /// budget, else off].
    #[arg(long)]
    pub(crate) swap: Option<ramus_cuda::SwapMode>,
}

#[derive(clap::Args)]
pub(crate) struct EvalArgs {
    /// A file of trees (or sentences, for a language model; tagged text
    /// for a tagger), or a folder of class folders of images for a CNN.
    #[arg(long)]
    pub(crate) data: PathBuf,
    #[arg(long)]
    pub(crate) checkpoint: PathBuf,
    #[arg(long, default_value_t = 64)]
    pub(crate) batch_size: usize,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub(crate) json: bool,
    /// Where to run: cpu or cuda.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: device::Device,
    #[command(flatten)]
    pub(crate) host: limits::HostBudgetArgs,
    #[command(flatten)]
    pub(crate) structure: structure::StructureArgs,
    #[command(flatten)]
    pub(crate) checkpoint_flags: CheckpointFlags,
}

impl TrainArgs {
    /// The counts no one can mean refused, naming the flag, and
    /// `--log-dir` made, before any work.
    pub(crate) fn check_counts(&self) -> AnyResult {
        if self.checkpoint_every == Some(0) {
            return Err("--checkpoint-every must be at least 1".into());
        }
        match (self.accumulate, self.checkpoint_every) {
            (0, _) => return Err("--accumulate must be at least 1 batch a step".into()),
            (k, Some(n)) if !n.is_multiple_of(k) => {
                return Err(format!(
                    "--checkpoint-every {n} falls inside a step of --accumulate {k} batches: \
                     give a multiple of {k}"
                )
                .into())
            }
            _ => {}
        }
        if self.patience == Some(0) {
            return Err("--patience must be at least 1 epoch".into());
        }
        match (&self.log_dir, self.log_every) {
            (_, Some(0)) => return Err("--log-every must be at least 1".into()),
            (None, Some(_)) => {
                return Err("--log-every logs into --log-dir: give --log-dir DIR".into())
            }
            // a directory that cannot be made fails before any work
            (Some(dir), _) => std::fs::create_dir_all(dir)
                .map_err(|e| format!("--log-dir {}: {e}", dir.display()))?,
            (None, None) => {}
        }
        Ok(())
    }
}
