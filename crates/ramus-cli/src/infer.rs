//! `ramus infer`: predictions of a trained tree model for trees read from
//! a file or standard input, in batches, through the compiled (Cortex)
//! engine on the CPU or the CUDA device, the batched engine, or the faster
//! of the two measured per batch shape (`auto`; see [`crate::infer_engine`]).
//! One JSON line per tree: its index, predicted class and root scores.

use std::io::Read;
use std::path::{Path, PathBuf};

use ramus_core::{Model, Params};
use ramus_cuda::compiled::CompiledSchedule;
use ramus_exec::Scores;
use ramus_graph::text::decode_utf8;
use ramus_graph::{ptb, InputGraph, Vocab, VocabMode};
use ramus_nn::DataKind;

use crate::device::Device;
use crate::infer_engine::{build_infer_engine, InferKind, InferSetup};
use crate::labels;
use crate::model_build::load_checkpoint;
use crate::output::outln;
use crate::result::AnyResult;

#[derive(clap::Args)]
pub struct InferArgs {
    /// Trained model (from `ramus train --save`).
    #[arg(long)]
    checkpoint: PathBuf,
    /// Bracketed trees, one per line; `-` or nothing: standard input.
    #[arg(long)]
    input: Option<PathBuf>,
    /// compiled (one generated kernel or level loop per batch), batched, or
    /// auto (the faster of the two for each batch shape, measured on its
    /// first batch; the choice and its timings on standard error).
    #[arg(long, default_value = "compiled")]
    engine: String,
    /// Where to run: cpu or cuda.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Trees per batch.
    #[arg(long, default_value_t = 10)]
    batch_size: usize,
    /// Split the batches over this many GPUs of this machine (with
    /// `--device cuda`): a replica of the model on each, the output in
    /// input order.
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// Compiled engine schedule: run the leaf cell and the token-only values
    /// per node instead of reading per-token tables (leaf specialization
    /// and hoisting off).
    #[arg(long)]
    no_tables: bool,
    /// Compiled engine on CUDA schedule: read the weights from memory at
    /// every use instead of keeping them in registers (persistence off).
    #[arg(long)]
    no_persistence: bool,
    /// Compiled engine on CUDA schedule: a grid-wide barrier between levels
    /// instead of per-node completion counters (by default counters order
    /// the levels of cells up to 256 units wide).
    #[arg(long)]
    grid_barriers: bool,
    #[command(flatten)]
    recursion: crate::bench::RecursionFlags,
    #[command(flatten)]
    host: crate::limits::HostBudgetArgs,
    #[command(flatten)]
    structure: crate::structure::StructureArgs,
    #[command(flatten)]
    checkpoint_flags: crate::model_build::CheckpointFlags,
}

/// The trees of `input` (a file; `-` or `None`: standard input), read with
/// the checkpoint's vocabulary; errors name the file (or `<stdin>`), line
/// and column.
fn read_input(input: Option<&Path>, vocab: &Vocab) -> AnyResult<Vec<InputGraph>> {
    match input {
        Some(p) if p.as_os_str() != "-" => Ok(ptb::read_trees(p, VocabMode::Frozen(vocab))?),
        _ => {
            let mut bytes = Vec::new();
            std::io::stdin()
                .read_to_end(&mut bytes)
                .map_err(|e| format!("cannot read standard input: {e}"))?;
            let text = decode_utf8(bytes, STDIN)?;
            Ok(ptb::parse_trees(&text, STDIN, VocabMode::Frozen(vocab))?)
        }
    }
}

/// How errors name standard input.
const STDIN: &str = "<stdin>";

pub fn run(a: InferArgs) -> AnyResult {
    if a.batch_size == 0 {
        return Err("--batch-size must be at least 1".into());
    }
    let kind: InferKind = a.engine.parse()?;
    let loaded = load_checkpoint(&a.checkpoint, a.checkpoint_flags)?;
    if loaded.kind != DataKind::Trees {
        return Err(format!(
            "`ramus infer` reads trees; the checkpoint holds a {} model",
            loaded.info.model
        )
        .into());
    }
    let mut trees = read_input(a.input.as_deref(), &loaded.info.vocab)?;
    let (model, params) = (&loaded.model, &loaded.params);
    a.structure.fit(model, loaded.kind, &mut trees)?;
    labels::check_checkpoint(&trees, model, &a.checkpoint)?;
    let setup = InferSetup {
        device: a.device,
        schedule: CompiledSchedule {
            leaf_table: !a.no_tables,
            persistent_weights: !a.no_persistence,
            node_counters: a.grid_barriers.then_some(false),
            recursion: a.recursion.schedule(),
        },
        graphs: &trees,
        batch_size: a.batch_size,
        vocab: loaded.info.vocab.len(),
        host: a.host,
        gpu: 0,
    };
    let batches: Vec<&[InputGraph]> = trees.chunks(a.batch_size).collect();
    let scored = score_on_gpus(kind, (model, params), &setup, &batches, a.gpus)?;
    let mut index = 0usize;
    for (chunk, Scores { values, classes }) in batches.iter().zip(scored) {
        if values.len() != chunk.len() * classes {
            return Err(format!(
                "{} scores for {} trees of {classes} classes: every tree must have one root",
                values.len(),
                chunk.len()
            )
            .into());
        }
        for row in values.chunks(classes.max(1)) {
            let prediction = row
                .iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |best, (c, &x)| {
                    if x > best.1 {
                        (c, x)
                    } else {
                        best
                    }
                })
                .0;
            outln!(
                "{}",
                serde_json::json!({"tree": index, "prediction": prediction, "scores": row})
            )?;
            index += 1;
        }
    }
    Ok(())
}

/// The scores of every batch, in order: on one engine, or with `gpus` > 1
/// on a replica per GPU, GPU `r` taking batches `r`, `r + gpus`, ...
fn score_on_gpus(
    kind: InferKind,
    (model, params): (&Model, &Params<f32>),
    setup: &InferSetup<'_>,
    batches: &[&[InputGraph]],
    gpus: usize,
) -> AnyResult<Vec<Scores<f32>>> {
    if gpus == 0 {
        return Err("--gpus must be at least 1".into());
    }
    if gpus > 1 && setup.device != Device::Cuda {
        return Err(format!("--gpus {gpus} runs on GPUs: add --device cuda").into());
    }
    if gpus > 1 {
        ramus_cuda::CudaDevice::probe(gpus - 1)
            .map_err(|e| format!("--gpus {gpus}: GPU {} is not there ({e})", gpus - 1))?;
    }
    let replica = |gpu: usize| -> Result<Vec<Scores<f32>>, String> {
        let setup = InferSetup { gpu, ..*setup };
        let mut engine = build_infer_engine(kind, model, params, &setup)?;
        batches
            .iter()
            .skip(gpu)
            .step_by(gpus)
            .map(|chunk| {
                let refs: Vec<&InputGraph> = chunk.iter().collect();
                engine.infer(&refs).map_err(|e| format!("GPU {gpu}: {e}"))
            })
            .collect()
    };
    if gpus == 1 {
        return Ok(replica(0)?);
    }
    let parts = std::thread::scope(|s| {
        let handles: Vec<_> = (0..gpus).map(|gpu| s.spawn(move || replica(gpu))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a replica's thread panicked".into()))
            })
            .collect::<Result<Vec<_>, String>>()
    })?;
    // batch i is replica i % gpus's (i / gpus)-th
    let mut parts: Vec<_> = parts.into_iter().map(Vec::into_iter).collect();
    let mut scores = Vec::with_capacity(batches.len());
    for i in 0..batches.len() {
        let next = parts[i % gpus].next();
        scores.push(next.ok_or("a replica returned fewer batches than it took")?);
    }
    Ok(scores)
}
