//! `ramus train --embeddings FILE`: the word embedding table (`emb`)
//! initialised from pretrained vectors (GloVe or word2vec text), read as a
//! stream with a progress bar, keeping only the vocabulary's words; words
//! the file lacks keep their random initialisation.

use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use ramus_core::{Model, Params};
use ramus_graph::{vectors, Vocab};

use crate::output::logln;
use crate::result::AnyResult;

/// The table the vectors initialise.
const TABLE: &str = "emb";

/// Copies the vectors of `vocab`'s words in `path` into `model`'s
/// embedding table in `params`; errors name `--embeddings` and the file.
pub(crate) fn load(
    path: &Path,
    model: &Model,
    vocab: &Vocab,
    params: &mut Params<f32>,
    quiet: bool,
) -> AnyResult {
    let flag = |e: &dyn std::fmt::Display| format!("--embeddings {}: {e}", path.display());
    let table = model.param_id(TABLE).map_err(|_| {
        flag(&format!(
            "model `{}` has no word embedding table `{TABLE}`",
            model.name
        ))
    })?;
    let size = std::fs::metadata(path).map_err(|e| flag(&e))?.len();
    let bar = match quiet {
        true => ProgressBar::hidden(),
        false => ProgressBar::new(size),
    };
    bar.set_style(
        ProgressStyle::with_template("embeddings [{bar:30}] {bytes}/{total_bytes} {eta}")
            .map_err(|e| e.to_string())?
            .progress_chars("=> "),
    );
    let read = vectors::read_text(path, vocab, |bytes| bar.set_position(bytes));
    bar.finish_and_clear();
    let read = read?;
    let shape = params.values[table].shape().to_vec();
    let width = shape.get(1).copied().unwrap_or(0);
    if read.dim != width {
        return Err(flag(&format!(
            "its vectors have {} values, the model's table `{TABLE}` {width} (set --hidden {})",
            read.dim, read.dim
        ))
        .into());
    }
    let data = params.values[table].data_mut();
    for (id, vector) in &read.found {
        let row = *id as usize * width;
        data[row..row + width].copy_from_slice(vector);
    }
    params.touch();
    logln!(
        "embeddings: {} of {} words from {} ({:.1}%), {} dimensions",
        read.found.len(),
        vocab.len(),
        path.display(),
        100.0 * read.found.len() as f64 / vocab.len().max(1) as f64,
        read.dim
    );
    Ok(())
}
