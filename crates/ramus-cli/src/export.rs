//! `ramus data export`: the built-in data a model trains on without
//! `--data`, written as the files `--data DIR` reads, so that a model
//! trained on it can be evaluated and used from the command line:
//!
//! * tree models: the synthetic treebank, `DIR/{train,dev,test}.txt`, one
//!   bracketed tree a line (the very lines the built-in data is read
//!   from, so training on `DIR` trains on the same trees);
//! * `lstm-lm`: the treebank's sentences, one a line;
//! * CNNs: the synthetic images (`--image`, `--images` as `train` takes
//!   them) as PNG files in class folders, `DIR/{train,dev,test}/<class>/`,
//!   each value clamped to [-1, 1] and quantized to 8 bits.
//!
//! The taggers and `td-rnn` / `td-lstm` have no built-in data (they read
//! WikiNER and SST). Every file is written atomically, into a folder that
//! must be new or empty.

use std::path::{Path, PathBuf};

use ramus_graph::synthetic;
use ramus_nn::{DataKind, ImageShape};

use crate::data::{data_kind_of, load_image_splits, sentences_of};
use crate::output::outln;
use crate::result::AnyResult;

/// `ramus data ...`.
#[derive(clap::Subcommand)]
pub enum DataCommand {
    /// Write the built-in data of a model (the synthetic treebank, its
    /// sentences, or the synthetic images) as train/dev/test files that
    /// `ramus train --data DIR`, `eval` and `infer` read.
    Export(ExportArgs),
}

#[derive(clap::Args)]
pub struct ExportArgs {
    /// Folder to write (created; if it exists, it must be empty).
    #[arg(long)]
    output: PathBuf,
    /// The model whose built-in data is written: a tree model (the
    /// synthetic treebank), lstm-lm (its sentences) or a CNN (the
    /// synthetic images).
    #[arg(long, default_value = "treelstm-nary")]
    model: String,
    /// CNNs: image shape CxHxW (1 or 3 channels) [default: 3x32x32].
    #[arg(long)]
    image: Option<ImageShape>,
    /// CNNs: number of training images; dev and test get a quarter each
    /// [default: 2000].
    #[arg(long)]
    images: Option<usize>,
}

pub fn run(command: DataCommand) -> AnyResult {
    match command {
        DataCommand::Export(a) => export(&a),
    }
}

fn export(a: &ExportArgs) -> AnyResult {
    let kind = data_kind_of(&a.model)?;
    if kind != DataKind::Images {
        if let Some(flag) = [
            ("--image", a.image.is_some()),
            ("--images", a.images.is_some()),
        ]
        .iter()
        .find_map(|(f, given)| given.then_some(f))
        {
            return Err(format!("{flag} applies to the CNN models, not `{}`", a.model).into());
        }
    }
    prepare(&a.output)?;
    let counts = match kind {
        DataKind::Trees | DataKind::Sentences => {
            let tb = synthetic::default_treebank();
            let mut counts = Vec::new();
            for (name, lines) in [("train", &tb.train), ("dev", &tb.dev), ("test", &tb.test)] {
                let text = match kind {
                    DataKind::Trees => lines.join("\n") + "\n",
                    _ => sentences_of(lines)?,
                };
                write(&a.output.join(format!("{name}.txt")), text.as_bytes())?;
                counts.push(lines.len());
            }
            counts
        }
        DataKind::Images => export_images(a)?,
        DataKind::Tagged { .. } | DataKind::SentencePyramid => {
            return Err(format!(
                "`{}` has no built-in data: it reads {} (see --data of `ramus train`)",
                a.model,
                if kind == DataKind::SentencePyramid {
                    "SST trees"
                } else {
                    "tagged text (WikiNER)"
                }
            )
            .into())
        }
    };
    let what = match kind {
        DataKind::Trees => "trees",
        DataKind::Sentences => "sentences",
        _ => "images",
    };
    outln!(
        "{}: train {} / dev {} / test {} {what} of `{}`'s built-in data",
        a.output.display(),
        counts[0],
        counts[1],
        counts[2],
        a.model
    )?;
    Ok(())
}

/// The built-in images as PNG files in class folders; the counts of train,
/// dev and test.
fn export_images(a: &ExportArgs) -> AnyResult<Vec<usize>> {
    let shape = a.image.unwrap_or_default();
    let train = a.images.unwrap_or(crate::vision::DEFAULT_TRAIN_IMAGES);
    let data = load_image_splits(None, shape, train)?;
    let mut counts = Vec::new();
    for (name, split) in [
        ("train", &data.train),
        ("dev", &data.dev),
        ("test", &data.test),
    ] {
        for class in &data.class_names {
            let dir = a.output.join(name).join(class);
            std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        for (i, g) in split.iter().enumerate() {
            let label = g.root_label().and_then(|l| usize::try_from(l).ok());
            let class = label
                .and_then(|l| data.class_names.get(l))
                .ok_or_else(|| format!("built-in image {i} of {name} has no class"))?;
            let png = crate::image_dir::encode_png(g.features(0), shape)?;
            write(
                &a.output.join(name).join(class).join(format!("{i:05}.png")),
                &png,
            )?;
        }
        counts.push(split.len());
    }
    Ok(counts)
}

/// Creates `dir`, refusing one that holds anything.
fn prepare(dir: &Path) -> AnyResult {
    if let Ok(mut entries) = std::fs::read_dir(dir) {
        if entries.next().is_some() {
            return Err(format!(
                "--output {}: the folder is not empty; give a new or empty one",
                dir.display()
            )
            .into());
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("--output {}: {e}", dir.display()).into())
}

/// Writes `bytes` to `path` atomically, errors naming it.
fn write(path: &Path, bytes: &[u8]) -> AnyResult {
    ramus_exec::atomic::write_atomic(path, bytes)
        .map_err(|e| format!("{}: {e}", path.display()).into())
}
