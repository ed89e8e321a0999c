//! `ramus infer`: predictions of a trained model for every family, one
//! JSON line per input. Tree models (and `td-rnn` / `td-lstm`) read
//! bracketed trees or, with `--text`, plain sentences
//! ([`crate::raw_text`]); CNNs image files or folders. Both score each
//! input's root through the compiled (Cortex) engine on the CPU or the
//! CUDA device, the batched engine, or the faster of the two measured per
//! batch shape (`auto`; see [`crate::infer_engine`]). The taggers (a tag
//! per word) and the language model (a log-likelihood per sentence) run
//! on the batched engine ([`crate::predict`]).

use std::path::PathBuf;

use ramus_core::{Model, Params};
use ramus_cuda::compiled::CompiledSchedule;
use ramus_exec::Scores;
use ramus_graph::binarize::Side;
use ramus_graph::text::{decode_utf8, read_utf8};
use ramus_graph::{ptb, InputGraph, VocabMode};
use ramus_nn::DataKind;
use serde_json::json;

use crate::device::Device;
use crate::infer_engine::{build_infer_engine, InferKind, InferSetup};
use crate::labels;
use crate::model_build::{load_checkpoint, Loaded};
use crate::output::outln;
use crate::predict::{Classes, PerVertex, Tally};
use crate::result::AnyResult;

#[derive(clap::Args)]
pub struct InferArgs {
    /// Trained model (from `ramus train --save`).
    #[arg(long)]
    checkpoint: PathBuf,
    /// What to predict; `-` or nothing: standard input. Tree models:
    /// bracketed trees, one a line (or sentences with --text); taggers:
    /// one sentence a line, `word|TAG` or plain words; lstm-lm: one
    /// sentence a line; CNNs: image files, or folders of them (or of
    /// class folders of them, labelled), several allowed.
    #[arg(long, num_args = 1..)]
    input: Vec<PathBuf>,
    /// Tree models: read plain sentences, one a line, instead of trees:
    /// split at whitespace and before and after every character that is
    /// no letter or digit, the words made the leaves of a right-branching
    /// binary tree (English phrases mostly branch right; `--binarize left`
    /// nests them to the left), unlabelled.
    #[arg(long)]
    text: bool,
    /// List only the K most probable classes of each prediction (of each
    /// word, for a tagger) [default: all].
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    /// compiled (one generated kernel or level loop per batch), batched, or
    /// auto (the faster of the two for each batch shape, measured on its
    /// first batch; the choice and its timings on standard error)
    /// [default: compiled for the tree models, else batched; the taggers
    /// and lstm-lm run batched only].
    #[arg(long)]
    engine: Option<String>,
    /// Where to run: cpu or cuda.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Inputs per batch.
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

/// The input's text and its name for messages: the one file of `input`,
/// or standard input for none or `-`.
fn input_text(input: &[PathBuf]) -> AnyResult<(String, String)> {
    match input {
        [p] if p.as_os_str() != "-" => Ok((read_utf8(p)?, p.display().to_string())),
        [] | [_] => {
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut std::io::stdin(), &mut bytes)
                .map_err(|e| format!("cannot read standard input: {e}"))?;
            Ok((decode_utf8(bytes, STDIN)?, STDIN.to_string()))
        }
        _ => Err(format!(
            "--input takes several paths for the CNNs only; give one file ({} given)",
            input.len()
        )
        .into()),
    }
}

/// How errors name standard input.
const STDIN: &str = "<stdin>";

/// The inputs of a model scored at its roots (trees, pyramids, images),
/// read with the checkpoint's vocabulary or classes; errors name the file
/// (or `<stdin>`) and line.
fn read_roots(a: &InferArgs, loaded: &Loaded, classes: &Classes) -> AnyResult<Vec<InputGraph>> {
    if let Some(v) = &loaded.vision {
        if a.input.is_empty() || a.input.iter().any(|p| p.as_os_str() == "-") {
            return Err("a CNN reads image files: give --input FILE|DIR ...".into());
        }
        return crate::image_dir::read_inputs(&a.input, classes.names(), v.image);
    }
    let (text, source) = input_text(&a.input)?;
    let vocab = &loaded.info.vocab;
    let trees = if a.text {
        let side = a.structure.binarize.unwrap_or(Side::Right);
        crate::raw_text::parse_text(&text, &source, vocab, side)?
    } else {
        ptb::parse_trees(&text, &source, VocabMode::Frozen(vocab))?
    };
    if loaded.kind == DataKind::SentencePyramid {
        let mut guard = a.host.build_guard(Some((&loaded.model, a.device)));
        return crate::data::pyramids(&trees, &mut guard);
    }
    Ok(trees)
}

/// Flags given to a family they do not apply to, named.
fn check_flags(a: &InferArgs, loaded: &Loaded) -> AnyResult {
    let kind = loaded.kind;
    let model = &loaded.info.model;
    if a.text && !matches!(kind, DataKind::Trees | DataKind::SentencePyramid) {
        return Err(format!(
            "--text makes trees of sentences for the tree models; `{model}` reads its input as it is"
        )
        .into());
    }
    if a.structure.binarize.is_some()
        && matches!(kind, DataKind::Tagged { .. } | DataKind::Sentences)
    {
        return Err(format!("--binarize rewrites trees; `{model}` reads sentences").into());
    }
    if a.top_k == Some(0) {
        return Err("--top-k must be at least 1".into());
    }
    if let (DataKind::Tagged { .. } | DataKind::Sentences, Some(e)) = (kind, &a.engine) {
        if e != "batched" {
            return Err(format!(
                "--engine {e}: `{model}` is scored at every word, on the batched engine only"
            )
            .into());
        }
    }
    if a.gpus != 1 && matches!(kind, DataKind::Tagged { .. } | DataKind::Sentences) {
        return Err(format!("--gpus {}: `{model}` runs on one device", a.gpus).into());
    }
    Ok(())
}

pub fn run(a: InferArgs) -> AnyResult {
    if a.batch_size == 0 {
        return Err("--batch-size must be at least 1".into());
    }
    let loaded = load_checkpoint(&a.checkpoint, a.checkpoint_flags)?;
    check_flags(&a, &loaded)?;
    if let DataKind::Tagged { .. } | DataKind::Sentences = loaded.kind {
        let (text, source) = input_text(&a.input)?;
        let p = PerVertex {
            loaded: &loaded,
            checkpoint: &a.checkpoint,
            device: a.device,
            batch_size: a.batch_size,
            host: a.host,
            text: &text,
            source: &source,
            top_k: a.top_k,
        };
        return match loaded.kind {
            DataKind::Tagged { chars } => crate::predict::tagger(&p, chars),
            _ => crate::predict::language_model(&p),
        };
    }
    let default = if loaded.kind == DataKind::Trees {
        "compiled"
    } else {
        "batched"
    };
    let kind: InferKind = a.engine.as_deref().unwrap_or(default).parse()?;
    let classes = Classes::of(&loaded, &a.checkpoint, a.top_k)?;
    let mut graphs = read_roots(&a, &loaded, &classes).map_err(|e| {
        let reads = match loaded.kind {
            DataKind::Images => "image files",
            _ if a.text => "sentences (--text)",
            _ => "bracketed trees (sentences with --text)",
        };
        let (path, model) = (a.checkpoint.display(), &loaded.info.model);
        format!("{e} ({path} holds `{model}`, which reads {reads})")
    })?;
    let (model, params) = (&loaded.model, &loaded.params);
    a.structure.fit(model, loaded.kind, &mut graphs)?;
    labels::check_checkpoint(&graphs, model, &a.checkpoint)?;
    let setup = InferSetup {
        device: a.device,
        schedule: CompiledSchedule {
            leaf_table: !a.no_tables,
            persistent_weights: !a.no_persistence,
            node_counters: a.grid_barriers.then_some(false),
            recursion: a.recursion.schedule(),
        },
        graphs: &graphs,
        batch_size: a.batch_size,
        vocab: loaded.info.vocab.len(),
        host: a.host,
        gpu: 0,
    };
    let batches: Vec<&[InputGraph]> = graphs.chunks(a.batch_size).collect();
    let scored = score_on_gpus(kind, (model, params), &setup, &batches, a.gpus)?;
    print_roots(loaded.kind, &classes, &batches, scored)
}

/// One line per input of a root classifier: its index (and file, for an
/// image), predicted label and class, scores in label order and
/// probabilities best first; the accuracy of labelled inputs on standard
/// error.
fn print_roots(
    kind: DataKind,
    classes: &Classes,
    batches: &[&[InputGraph]],
    scored: Vec<Scores<f32>>,
) -> AnyResult {
    let (one, many) = crate::predict::unit(kind);
    let mut tally = Tally::default();
    let mut index = 0usize;
    for (
        chunk,
        Scores {
            values,
            classes: width,
        },
    ) in batches.iter().zip(scored)
    {
        if values.len() != chunk.len() * width {
            return Err(format!(
                "{} scores for {} {many} of {width} classes: every input must have one root",
                values.len(),
                chunk.len()
            )
            .into());
        }
        for (graph, row) in chunk.iter().zip(values.chunks(width.max(1))) {
            let (prediction, probabilities) = classes.ranked(row);
            tally.add(
                graph.root_label().unwrap_or(ramus_graph::NO_LABEL),
                prediction,
            );
            let mut line = json!({one: index, "prediction": prediction,
                "class": classes.name(prediction), "scores": row, "probabilities": probabilities});
            if let (DataKind::Images, Some(o)) = (kind, graph.origin()) {
                line["file"] = json!(o.file.as_ref());
            }
            outln!("{line}")?;
            index += 1;
        }
    }
    tally.note(many);
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
