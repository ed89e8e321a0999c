//! Loading data for the CLI: tree or sentence splits from a directory, or
//! the built-in synthetic treebank when no directory is given; for the CNN
//! models, the built-in synthetic images or a directory of image files
//! ([`crate::image_dir`]).

use std::path::Path;

use ramus_graph::images::{self, ImageSpec};
use ramus_graph::{ptb, synthetic, text, InputGraph, Vocab, VocabMode};
use ramus_nn::{DataKind, ImageShape};

use crate::image_dir;
use crate::vision::DEFAULT_TRAIN_IMAGES;

/// Train / dev / test graphs with the vocabulary built from train.
pub struct Splits {
    pub source: String,
    pub train: Vec<InputGraph>,
    pub dev: Vec<InputGraph>,
    pub test: Vec<InputGraph>,
    pub vocab: Vocab,
    pub classes: usize,
    /// The name of each class (images), by label.
    pub class_names: Vec<String>,
    /// The image shape (images only).
    pub image: Option<ImageShape>,
}

impl Splits {
    /// What the data holds besides its sizes, for the training log.
    pub fn describe(&self) -> String {
        match self.image {
            Some(shape) => format!("{shape} images, {} classes", self.classes),
            None => format!("vocabulary {}", self.vocab.len()),
        }
    }
}

type AnyResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Reads `dir/{train,dev,test}.txt` (`valid.txt` also accepted for dev) or,
/// without a directory, generates the built-in treebank (images: the
/// built-in synthetic images of the default shape and size).
pub fn load_splits(dir: Option<&Path>, kind: DataKind) -> AnyResult<Splits> {
    if kind == DataKind::Images {
        return load_image_splits(dir, ImageShape::default(), DEFAULT_TRAIN_IMAGES);
    }
    let mut vocab = Vocab::new();
    let (source, train, dev, test) = match dir {
        None => {
            let tb = synthetic::default_treebank();
            let parse =
                |lines: &[String], name: &str, mode: VocabMode<'_>| -> AnyResult<Vec<InputGraph>> {
                    Ok(match kind {
                        DataKind::Trees => ptb::parse_trees(&lines.join("\n"), name, mode)?,
                        DataKind::Sentences | DataKind::Images => {
                            text::parse_sentences(&sentences_of(lines)?, name, mode)?
                        }
                    })
                };
            let train = parse(&tb.train, "<built-in train>", VocabMode::Grow(&mut vocab))?;
            let dev = parse(&tb.dev, "<built-in dev>", VocabMode::Frozen(&vocab))?;
            let test = parse(&tb.test, "<built-in test>", VocabMode::Frozen(&vocab))?;
            (
                "built-in synthetic treebank (seed 7)".to_string(),
                train,
                dev,
                test,
            )
        }
        Some(dir) => {
            let file = |names: &[&str]| -> AnyResult<std::path::PathBuf> {
                names
                    .iter()
                    .map(|n| dir.join(n))
                    .find(|p| p.exists())
                    .ok_or_else(|| {
                        format!("{}: no {} found", dir.display(), names.join(" or ")).into()
                    })
            };
            let (tr, dv, te) = (
                file(&["train.txt"])?,
                file(&["dev.txt", "valid.txt"])?,
                file(&["test.txt"])?,
            );
            let train = read_graphs(&tr, kind, VocabMode::Grow(&mut vocab))?;
            let dev = read_graphs(&dv, kind, VocabMode::Frozen(&vocab))?;
            let test = read_graphs(&te, kind, VocabMode::Frozen(&vocab))?;
            (dir.display().to_string(), train, dev, test)
        }
    };
    if train.is_empty() || dev.is_empty() || test.is_empty() {
        return Err(format!(
            "{source}: a split is empty (train {}, dev {}, test {})",
            train.len(),
            dev.len(),
            test.len()
        )
        .into());
    }
    let classes = match kind {
        DataKind::Sentences | DataKind::Images => 0,
        DataKind::Trees => {
            train
                .iter()
                .flat_map(|g| g.labels.iter())
                .copied()
                .max()
                .unwrap_or(0)
                .max(1) as usize
                + 1
        }
    };
    Ok(Splits {
        source,
        train,
        dev,
        test,
        vocab,
        classes,
        class_names: Vec::new(),
        image: None,
    })
}

/// The built-in synthetic images of `shape` (`train` training images, a
/// quarter as many for dev and for test), or a directory of labelled image
/// files resized to `shape` (see [`crate::image_dir`]; `train` is ignored).
pub fn load_image_splits(dir: Option<&Path>, shape: ImageShape, train: usize) -> AnyResult<Splits> {
    if let Some(dir) = dir {
        let [tr, dv, te] = image_dir::split_dirs(dir)?;
        let class_names = image_dir::class_names(&tr)?;
        return Ok(Splits {
            source: dir.display().to_string(),
            train: image_dir::read_split(&tr, &class_names, shape)?,
            dev: image_dir::read_split(&dv, &class_names, shape)?,
            test: image_dir::read_split(&te, &class_names, shape)?,
            vocab: Vocab::new(),
            classes: class_names.len(),
            class_names,
            image: Some(shape),
        });
    }
    let spec = ImageSpec {
        channels: shape.channels,
        height: shape.height,
        width: shape.width,
        ..ImageSpec::default()
    };
    let (dev, test) = (train / 4, train / 4);
    if dev == 0 {
        return Err(format!(
            "--images must be at least 4 (a quarter for dev and test), got {train}"
        )
        .into());
    }
    let set = images::generate(&spec, images::DEFAULT_SEED, (train, dev, test))?;
    Ok(Splits {
        source: format!("built-in synthetic images (seed {})", images::DEFAULT_SEED),
        train: set.train,
        dev: set.dev,
        test: set.test,
        vocab: Vocab::new(),
        classes: spec.classes,
        class_names: images::CLASS_NAMES[..spec.classes]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        image: Some(shape),
    })
}

/// Reads one file with a fixed vocabulary.
pub fn read_frozen(path: &Path, kind: DataKind, vocab: &Vocab) -> AnyResult<Vec<InputGraph>> {
    read_graphs(path, kind, VocabMode::Frozen(vocab))
}

/// Reads one file of trees or sentences (not images: see [`read_image_split`]).
fn read_graphs(path: &Path, kind: DataKind, mode: VocabMode<'_>) -> AnyResult<Vec<InputGraph>> {
    Ok(match kind {
        DataKind::Trees => ptb::read_trees(path, mode)?,
        DataKind::Sentences => text::read_sentences(path, mode)?,
        DataKind::Images => {
            return Err(format!(
                "{}: images are read with their class names and shape (read_image_split)",
                path.display()
            )
            .into())
        }
    })
}

/// The leaf words of bracketed trees, one sentence per line.
fn sentences_of(lines: &[String]) -> AnyResult<String> {
    let mut vocab = Vocab::new();
    let trees = ptb::parse_trees(&lines.join("\n"), "<built-in>", VocabMode::Grow(&mut vocab))?;
    let mut out = String::new();
    for t in &trees {
        let words: Vec<&str> = (0..t.len())
            .filter(|&v| t.children(v).is_empty())
            .filter_map(|v| vocab.word(t.tokens[v]))
            .collect();
        out += &words.join(" ");
        out.push('\n');
    }
    Ok(out)
}

/// Reads a folder of class sub-folders (`classes` from the checkpoint)
/// with images resized to `shape`.
pub fn read_image_split(
    path: &Path,
    classes: &[String],
    shape: ImageShape,
) -> AnyResult<Vec<InputGraph>> {
    image_dir::read_split(path, classes, shape)
}
