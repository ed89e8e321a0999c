//! `ramus train --embeddings FILE`: the word embedding table (`emb`)
//! initialised from pretrained vectors (GloVe or word2vec text, or a
//! `.safetensors` file), read as a stream with a progress bar, keeping
//! only the vocabulary's words; words the file lacks keep their random
//! initialisation. For trees and sentences the vocabulary is the training
//! words plus the dev and test words the file has (as Tai et al. build
//! it): a word seen only outside training is known if it has a vector.

use std::collections::HashSet;
use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use ramus_core::{Model, Params};
use ramus_graph::safetensors_vectors;
use ramus_graph::vectors::{self, WordVectors};
use ramus_graph::Vocab;

use crate::data::SplitWords;
use crate::output::logln;
use crate::result::AnyResult;
use crate::splits::Splits;

/// The table the vectors initialise.
const TABLE: &str = "emb";

/// The error of `--embeddings path`.
fn flag(path: &Path, e: &dyn std::fmt::Display) -> String {
    format!("--embeddings {}: {e}", path.display())
}

/// Reads the vectors of `data`'s words in `path`. With `words`
/// [`SplitWords::All`] (the vocabulary holds every split's words), the
/// dev and test words the file lacks are then made unknown: the
/// vocabulary keeps the training words and the others the file has, and
/// the dev and test graphs' tokens follow their new ids.
pub(crate) fn read(
    path: &Path,
    data: &mut Splits,
    words: SplitWords,
    quiet: bool,
) -> AnyResult<WordVectors> {
    let size = std::fs::metadata(path).map_err(|e| flag(path, &e))?.len();
    let bar = match quiet {
        true => ProgressBar::hidden(),
        false => ProgressBar::new(size),
    };
    bar.set_style(
        ProgressStyle::with_template("embeddings [{bar:30}] {bytes}/{total_bytes} {eta}")
            .map_err(|e| e.to_string())?
            .progress_chars("=> "),
    );
    let progress = |bytes| bar.set_position(bytes);
    let read = match path.extension().and_then(|e| e.to_str()) {
        Some("safetensors") => safetensors_vectors::read(path, &data.vocab, progress),
        _ => vectors::read_text(path, &data.vocab, progress),
    };
    bar.finish_and_clear();
    let mut read = read?;
    let before = data.vocab.len();
    if words == SplitWords::All {
        keep_known(data, &mut read)?;
    }
    logln!(
        "embeddings: {} of {} words from {} ({:.1}%), {} dimensions{}",
        read.found.len(),
        data.vocab.len(),
        path.display(),
        100.0 * read.found.len() as f64 / data.vocab.len().max(1) as f64,
        read.dim,
        match before - data.vocab.len() {
            0 => String::new(),
            n => format!("; {n} dev/test words without a vector are unknown"),
        }
    );
    Ok(read)
}

/// Drops the words past the training split's (its tokens are the ids
/// below `1 + max`) that `vectors` lacks, renumbering the rest after the
/// training words, in the vocabulary, the dev and test graphs and
/// `vectors`.
fn keep_known(data: &mut Splits, vectors: &mut WordVectors) -> AnyResult {
    let tokens = data.train.iter().flat_map(|g| g.tokens.iter().copied());
    let train = tokens.max().map_or(1, |m| m as usize + 1);
    let all = data.vocab.len();
    if all <= train {
        return Ok(());
    }
    let found: HashSet<u32> = vectors.found.iter().map(|(id, _)| *id).collect();
    let mut kept: Vec<String> = data.vocab.words()[..train].to_vec();
    let mut new_id: Vec<u32> = (0..train as u32).collect();
    for id in train..all {
        new_id.push(match found.contains(&(id as u32)) {
            true => {
                kept.push(data.vocab.words()[id].clone());
                kept.len() as u32 - 1
            }
            false => 0, // unknown
        });
    }
    data.vocab = Vocab::from_words(kept)?;
    for g in data.dev.iter_mut().chain(data.test.iter_mut()) {
        g.tokens.iter_mut().for_each(|t| *t = new_id[*t as usize]);
    }
    vectors
        .found
        .iter_mut()
        .for_each(|(id, _)| *id = new_id[*id as usize]);
    Ok(())
}

/// Copies `vectors` (read from `path`) into `model`'s embedding table in
/// `params`; errors name `--embeddings` and the file.
pub(crate) fn apply(
    path: &Path,
    vectors: &WordVectors,
    model: &Model,
    params: &mut Params<f32>,
) -> AnyResult {
    let table = model.param_id(TABLE).map_err(|_| {
        flag(
            path,
            &format!(
                "model `{}` has no word embedding table `{TABLE}`",
                model.name
            ),
        )
    })?;
    let shape = params.values[table].shape().to_vec();
    let width = shape.get(1).copied().unwrap_or(0);
    if vectors.dim != width {
        return Err(flag(
            path,
            &format!(
                "its vectors have {} values, the model's table `{TABLE}` {width} (set --hidden {})",
                vectors.dim, vectors.dim
            ),
        )
        .into());
    }
    let data = params.values[table].data_mut();
    for (id, vector) in &vectors.found {
        let row = *id as usize * width;
        data[row..row + width].copy_from_slice(vector);
    }
    params.touch();
    Ok(())
}
