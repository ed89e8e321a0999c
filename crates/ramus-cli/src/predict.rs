//! What `ramus infer` prints besides the scores: each class's probability
//! (the softmax of its score) with its name, best first, `--top-k` of
//! them; the accuracy of labelled inputs on standard error; and the two
//! families scored per vertex through the batched engine — the taggers
//! (a tag per word) and the language model (each sentence's
//! log-likelihood and perplexity).

use std::path::Path;

use ramus_core::HeadRows;
use ramus_exec::{Batch, Mode, TrainEngine};
use ramus_graph::tagged::{parse_tagged_with, Tags};
use ramus_graph::{text, BatchingPolicy, InputGraph, VocabMode, NO_LABEL};
use ramus_nn::DataKind;
use serde_json::{json, Value};

use crate::labels::class_names;
use crate::model_build::Loaded;
use crate::output::{noteln, outln};
use crate::result::AnyResult;

/// The classes a checkpoint's model scores, by name, and how many of them
/// a line lists.
pub struct Classes {
    names: Vec<String>,
    top_k: usize,
}

impl Classes {
    /// The names the checkpoint at `path` records (`class_names`: a
    /// tagger's tags, a CNN's class folders); a tree model's labels are
    /// numbers, which are its classes' names.
    /// `top_k`: how many a line lists (all without).
    pub fn of(loaded: &Loaded, path: &Path, top_k: Option<usize>) -> AnyResult<Classes> {
        let count = crate::labels::model_classes(&loaded.model).unwrap_or(0);
        let names = match class_names(&loaded.info.settings)? {
            Some(names) => names,
            None => (0..count).map(|c| c.to_string()).collect(),
        };
        if names.len() != count {
            return Err(format!(
                "{}: the checkpoint names {} classes but its model scores {count}",
                path.display(),
                names.len()
            )
            .into());
        }
        let top_k = top_k.unwrap_or(count).min(count);
        Ok(Classes { names, top_k })
    }

    /// Every class's name, by label.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The name of class `c`.
    pub fn name(&self, c: usize) -> &str {
        self.names.get(c).map_or("?", String::as_str)
    }

    /// The best class of `scores` and the classes' probabilities, best
    /// first (the first of equals), `top_k` of them:
    /// `[{"class": NAME, "probability": P}, ...]`.
    pub fn ranked(&self, scores: &[f32]) -> (usize, Value) {
        let p = softmax(scores);
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let best = order.first().copied().unwrap_or(0);
        let listed = order
            .iter()
            .take(self.top_k)
            .map(|&c| json!({"class": self.name(c), "probability": p[c]}))
            .collect();
        (best, Value::Array(listed))
    }
}

/// The softmax of `scores`, in f64.
pub fn softmax(scores: &[f32]) -> Vec<f64> {
    let max = scores
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    let e: Vec<f64> = scores.iter().map(|&x| (f64::from(x) - max).exp()).collect();
    let sum: f64 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

/// The log of the softmax of `scores` at `at` (`None` past the end),
/// without forming the probability (which may underflow).
pub fn log_softmax(scores: &[f32], at: usize) -> Option<f64> {
    let max = scores
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    let sum: f64 = scores.iter().map(|&x| (f64::from(x) - max).exp()).sum();
    Some(f64::from(*scores.get(at)?) - max - sum.ln())
}

/// Correct predictions among the labelled ones.
#[derive(Default)]
pub struct Tally {
    right: usize,
    labelled: usize,
}

impl Tally {
    /// Counts `prediction` against `label` (not at all without one).
    pub fn add(&mut self, label: i32, prediction: usize) {
        if label != NO_LABEL {
            self.labelled += 1;
            self.right += usize::from(usize::try_from(label) == Ok(prediction));
        }
    }

    /// `infer: N labelled WHAT, accuracy X%` on standard error, when any was.
    pub fn note(&self, what: &str) {
        if self.labelled > 0 {
            let acc = 100.0 * self.right as f64 / self.labelled as f64;
            noteln!(
                "infer: {} labelled {what}, accuracy {acc:.2}%",
                self.labelled
            );
        }
    }
}

/// How the per-vertex families run: the batched engine of `device`.
pub struct PerVertex<'a> {
    pub loaded: &'a Loaded,
    pub checkpoint: &'a Path,
    pub device: crate::device::Device,
    pub batch_size: usize,
    pub host: crate::limits::HostBudgetArgs,
    /// The input's text and its name for messages.
    pub text: &'a str,
    pub source: &'a str,
    pub top_k: Option<usize>,
}

/// One head row of a graph: its vertex (the graph's own numbering), label
/// and scores.
pub struct HeadRow<'a> {
    pub vertex: usize,
    pub label: i32,
    pub scores: &'a [f32],
}

/// Runs `graphs`, `batch_size` at a time, through `engine` with the head
/// on `rows`, handing `each` every graph's index and head rows in its own
/// vertex order.
fn per_graph_rows(
    engine: &mut dyn TrainEngine<f32>,
    graphs: &[InputGraph],
    batch_size: usize,
    rows: HeadRows,
    mut each: impl FnMut(usize, &[HeadRow<'_>]) -> AnyResult,
) -> AnyResult {
    for (b, chunk) in graphs.chunks(batch_size).enumerate() {
        let batch = Batch::new(engine.model(), chunk.iter().collect(), BatchingPolicy::Cavs)?;
        let out = engine.forward_rows(&batch, Mode::Infer, rows)?;
        let s = &batch.schedule;
        let mut local = vec![0usize; s.num_vertices()];
        for (g, graph) in chunk.iter().enumerate() {
            let offset = s.graph_offsets[g] as usize;
            for v in 0..graph.len() {
                local[s.number[offset + v] as usize] = v;
            }
        }
        let width = out.classes.max(1);
        let mut per: Vec<Vec<HeadRow<'_>>> = (0..chunk.len()).map(|_| Vec::new()).collect();
        for (scores, &v) in out.logits.chunks(width).zip(&out.head_vertices) {
            let v = v as usize;
            per[s.graph[v] as usize].push(HeadRow {
                vertex: local[v],
                label: s.labels[v],
                scores,
            });
        }
        for (g, rows) in per.iter_mut().enumerate() {
            rows.sort_by_key(|r| r.vertex);
            each(b * batch_size + g, rows)?;
        }
    }
    Ok(())
}

/// The batched engine for `p`'s model, after checking that scoring
/// `graphs` fits.
fn engine_for(p: &PerVertex<'_>, graphs: &[InputGraph]) -> AnyResult<Box<dyn TrainEngine<f32>>> {
    let model = &p.loaded.model;
    let need = crate::limits::Inference::loaded(
        model,
        graphs,
        p.batch_size,
        ramus_exec::memory::Pass::Infer,
        None,
        p.device,
    );
    need.check_host(p.host)?;
    let engine = crate::device::evaluator(p.device, model, p.loaded.params.clone(), None)?;
    need.check_device(engine.as_ref(), None)?;
    Ok(engine)
}

/// A tagger's predictions: one line per sentence with each word's tag
/// and the tags' probabilities; tags in the input are optional.
pub fn tagger(p: &PerVertex<'_>, chars: bool) -> AnyResult {
    let info = &p.loaded.info;
    let vocab = crate::sequence::tagged_vocab(&info.vocab, &info.settings)
        .map_err(|e| format!("{}: {e}", p.checkpoint.display()))?;
    let sentences = parse_tagged_with(p.text, p.source, Tags::Optional)?;
    let graphs = vocab.graphs(&sentences, p.source, chars)?;
    let classes = Classes::of(p.loaded, p.checkpoint, p.top_k)?;
    let mut engine = engine_for(p, &graphs)?;
    let mut tally = Tally::default();
    per_graph_rows(
        engine.as_mut(),
        &graphs,
        p.batch_size,
        HeadRows::Roots,
        |i, rows| {
            let words = &sentences[i].words;
            if rows.len() != words.len() {
                return Err(format!(
                    "{}: {} tag scores for {} words",
                    graphs[i].describe(i),
                    rows.len(),
                    words.len()
                )
                .into());
            }
            let mut tags = Vec::with_capacity(rows.len());
            let mut tokens = Vec::with_capacity(rows.len());
            for (word, row) in words.iter().zip(rows) {
                let (best, probabilities) = classes.ranked(row.scores);
                tally.add(row.label, best);
                tags.push(classes.name(best));
                tokens.push(json!({"word": word, "class": classes.name(best), "probabilities": probabilities}));
            }
            outln!(
                "{}",
                json!({"sentence": i, "classes": tags, "tokens": tokens})
            )
        },
    )?;
    tally.note("words");
    Ok(())
}

/// The language model's predictions: one line per sentence with the
/// log-likelihood (natural log) of its words and `<eos>` given the words
/// before, their count and the perplexity; the totals on standard error.
pub fn language_model(p: &PerVertex<'_>) -> AnyResult {
    if p.top_k.is_some() {
        return Err(format!(
            "--top-k lists classes of a classifier; `{}` scores sentences (log-likelihood and perplexity)",
            p.loaded.info.model
        )
        .into());
    }
    let vocab = VocabMode::Frozen(&p.loaded.info.vocab);
    let graphs = text::parse_sentences(p.text, p.source, vocab)?;
    let mut engine = engine_for(p, &graphs)?;
    let (mut total, mut tokens) = (0.0f64, 0usize);
    per_graph_rows(
        engine.as_mut(),
        &graphs,
        p.batch_size,
        HeadRows::Labelled,
        |i, rows| {
            let mut ll = 0.0;
            for row in rows {
                let target = usize::try_from(row.label).map_err(|_| "an unlabelled target")?;
                ll += log_softmax(row.scores, target).ok_or("a target outside the vocabulary")?;
            }
            let n = rows.len();
            (total, tokens) = (total + ll, tokens + n);
            let perplexity = (-ll / n.max(1) as f64).exp();
            outln!(
                "{}",
                json!({"sentence": i, "tokens": n, "log_likelihood": ll, "perplexity": perplexity})
            )
        },
    )?;
    noteln!(
        "infer: {} sentences, {tokens} tokens, log-likelihood {total:.4}, perplexity {:.4}",
        graphs.len(),
        (-total / tokens.max(1) as f64).exp()
    );
    Ok(())
}

/// What one line of a root classifier's output calls its input.
pub fn unit(kind: DataKind) -> (&'static str, &'static str) {
    match kind {
        DataKind::Images => ("image", "images"),
        _ => ("tree", "trees"),
    }
}
