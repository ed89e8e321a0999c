//! Loading data for the CLI: tree or sentence splits from a directory, or
//! the built-in synthetic treebank when no directory is given; for the CNN
//! models, the built-in synthetic images or a directory of image files
//! ([`crate::image_dir`]); for the taggers, tagged text (WikiNER) and for
//! the time-delay networks, SST trees read as pyramids — both from the
//! shared data folder when no `--data` is given ([`default_data`]).

use crate::result::AnyResult;
use std::path::{Path, PathBuf};

use ramus_graph::images::{self, ImageSpec};
use ramus_graph::sequence::pyramid_of_tree;
use ramus_graph::tagged::{
    read_tagged, split_tagged, TaggedSentence, TaggedSplits, TaggedVocab, RARE_BELOW, SPLIT_PERIOD,
};
use ramus_graph::{ptb, synthetic, text, InputGraph, Vocab, VocabMode};
use ramus_nn::{DataKind, ImageShape};

use crate::image_dir;
// defined in a leaf module: `labels` and `limits` read it, and `data` them
use crate::limits::BuildGuard;
pub use crate::splits::Splits;
use crate::vision::DEFAULT_TRAIN_IMAGES;

/// `$RAMUS_DATA/<sub>`, else `../shared/data/<sub>` (beside the checkout,
/// seen from the working directory): where the taggers and the time-delay
/// networks find WikiNER and SST when no `--data` is given.
pub fn default_data(sub: &str) -> AnyResult<PathBuf> {
    let (root, how) = match std::env::var_os("RAMUS_DATA") {
        Some(d) => (PathBuf::from(d), "$RAMUS_DATA"),
        None => (PathBuf::from("../shared/data"), "the default"),
    };
    let path = root.join(sub);
    if path.exists() {
        Ok(path)
    } else {
        Err(format!(
            "no --data given and {} ({how}) does not exist; pass --data or set RAMUS_DATA",
            path.display()
        )
        .into())
    }
}

/// The data model `name` reads, or an error listing the known models.
pub fn data_kind_of(name: &str) -> AnyResult<DataKind> {
    ramus_nn::data_kind(name).ok_or_else(|| {
        format!(
            "unknown model `{name}` (known: {})",
            ramus_nn::MODEL_NAMES.join(", ")
        )
        .into()
    })
}

/// Whose words the vocabulary of text and trees holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitWords {
    /// The training split's: dev and test words it lacks are unknown.
    Train,
    /// Every split's (pretrained vectors may know dev and test words the
    /// training split lacks: [`crate::embeddings::read`] keeps those).
    All,
}

impl SplitWords {
    /// How dev and test are read into `vocab`.
    fn mode<'v>(self, vocab: &'v mut Vocab) -> VocabMode<'v> {
        match self {
            SplitWords::Train => VocabMode::Frozen(vocab),
            SplitWords::All => VocabMode::Grow(vocab),
        }
    }
}

/// Reads `dir/{train,dev,test}.txt` (`valid.txt` also accepted for dev) or,
/// without a directory, generates the built-in treebank (images: the
/// built-in synthetic images of the default shape and size). Pyramids are
/// admitted by `guard` before they are built. The vocabulary is the
/// training split's words, with `words` [`SplitWords::All`] the dev and
/// test splits' too (trees and sentences), after them.
pub fn load_splits(
    dir: Option<&Path>,
    kind: DataKind,
    guard: &mut BuildGuard<'_>,
    words: SplitWords,
) -> AnyResult<Splits> {
    match kind {
        DataKind::Images => {
            return load_image_splits(dir, ImageShape::default(), DEFAULT_TRAIN_IMAGES)
        }
        DataKind::Tagged { chars } => return load_tagged_splits(dir, chars),
        DataKind::SentencePyramid => {
            let dir = match dir {
                Some(d) => d.to_path_buf(),
                None => default_data("sst")?,
            };
            let mut s = load_splits(Some(&dir), DataKind::Trees, guard, words)?;
            for part in [&mut s.train, &mut s.dev, &mut s.test] {
                *part = pyramids(part, guard)?;
            }
            s.source = format!("{} (time-delay pyramids over the leaves)", s.source);
            return Ok(s);
        }
        DataKind::Trees | DataKind::Sentences => {}
    }
    let mut vocab = Vocab::new();
    let (source, train, dev, test) = match dir {
        None => {
            let tb = synthetic::default_treebank();
            let parse =
                |lines: &[String], name: &str, mode: VocabMode<'_>| -> AnyResult<Vec<InputGraph>> {
                    Ok(match kind {
                        DataKind::Trees => ptb::parse_trees(&lines.join("\n"), name, mode)?,
                        _ => text::parse_sentences(&sentences_of(lines)?, name, mode)?,
                    })
                };
            let train = parse(&tb.train, "<built-in train>", VocabMode::Grow(&mut vocab))?;
            let dev = parse(&tb.dev, "<built-in dev>", words.mode(&mut vocab))?;
            let test = parse(&tb.test, "<built-in test>", words.mode(&mut vocab))?;
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
            let train = read_graphs(&tr, kind, VocabMode::Grow(&mut vocab), guard)?;
            let dev = read_graphs(&dv, kind, words.mode(&mut vocab), guard)?;
            let test = read_graphs(&te, kind, words.mode(&mut vocab), guard)?;
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
    // from every split, so that no dev or test label is out of range
    let classes = match kind {
        DataKind::Sentences | DataKind::Images => 0,
        _ => crate::labels::count(&[&train, &dev, &test]),
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
        tagged: None,
    })
}

/// Words seen fewer times than this in training are `<unk>` for the plain
/// tagger (so that `<unk>` is trained).
pub const PLAIN_TAGGER_MIN_COUNT: usize = 2;

/// Tagged text: `dir/{train,dev,test}.txt` when `dir` holds a `train.txt`;
/// else one file (`dir` itself, `dir/dev.txt` — the WikiNER file — or,
/// without `dir`, the shared WikiNER) split by position (every tenth
/// sentence to test, the one before it to dev: [`split_tagged`]). With
/// `chars` the word vocabulary keeps the words seen at least
/// [`RARE_BELOW`] times and rarer ones are spelled out; without, it keeps
/// those seen [`PLAIN_TAGGER_MIN_COUNT`] times.
pub fn load_tagged_splits(dir: Option<&Path>, chars: bool) -> AnyResult<Splits> {
    let path = match dir {
        Some(d) => d.to_path_buf(),
        None => default_data("wikiner/dev.txt")?,
    };
    let (source, files, splits) = if path.join("train.txt").is_file() {
        let read = |n: &str| -> AnyResult<(PathBuf, Vec<TaggedSentence>)> {
            let p = path.join(n);
            let s = read_tagged(&p)?;
            Ok((p, s))
        };
        let (tr, train) = read("train.txt")?;
        let (dv, dev) = read("dev.txt")?;
        let (te, test) = read("test.txt")?;
        (
            path.display().to_string(),
            [tr, dv, te].map(|p| p.display().to_string()),
            TaggedSplits { train, dev, test },
        )
    } else {
        let file = if path.is_dir() {
            path.join("dev.txt")
        } else {
            path.clone()
        };
        if !file.is_file() {
            return Err(format!(
                "{}: no train.txt, and no tagged file to split",
                path.display()
            )
            .into());
        }
        let name = file.display().to_string();
        (
            format!(
                "{name} (split by position: sentence i to test when i % {SPLIT_PERIOD} = {}, to dev when {})",
                SPLIT_PERIOD - 1,
                SPLIT_PERIOD - 2
            ),
            [name.clone(), name.clone(), name],
            split_tagged(read_tagged(&file)?),
        )
    };
    if splits.train.is_empty() || splits.dev.is_empty() || splits.test.is_empty() {
        return Err(format!(
            "{source}: a split is empty (train {}, dev {}, test {})",
            splits.train.len(),
            splits.dev.len(),
            splits.test.len()
        )
        .into());
    }
    let min_count = if chars {
        RARE_BELOW
    } else {
        PLAIN_TAGGER_MIN_COUNT
    };
    let tv = TaggedVocab::build(&splits.train, min_count);
    Ok(Splits {
        source,
        train: tv.graphs(&splits.train, &files[0], chars)?,
        dev: tv.graphs(&splits.dev, &files[1], chars)?,
        test: tv.graphs(&splits.test, &files[2], chars)?,
        vocab: tv.words.clone(),
        classes: tv.tags.len(),
        class_names: tv.tags.clone(),
        image: None,
        tagged: Some(tv),
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
            tagged: None,
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
        tagged: None,
    })
}

/// Reads one file with a fixed vocabulary (trees, sentences or pyramids,
/// admitted by `guard`; tagged text with [`read_tagged_frozen`]).
pub fn read_frozen(
    path: &Path,
    kind: DataKind,
    vocab: &Vocab,
    guard: &mut BuildGuard<'_>,
) -> AnyResult<Vec<InputGraph>> {
    read_graphs(path, kind, VocabMode::Frozen(vocab), guard)
}

/// Reads one tagged-text file as tagger graphs with fixed vocabularies.
pub fn read_tagged_frozen(
    path: &Path,
    vocab: &TaggedVocab,
    chars: bool,
) -> AnyResult<Vec<InputGraph>> {
    let sentences = read_tagged(path)?;
    Ok(vocab.graphs(&sentences, &path.display().to_string(), chars)?)
}

/// Reads one file of trees, sentences or pyramids (admitted by `guard`;
/// not images: see [`read_image_split`]; not tagged text: see
/// [`read_tagged_frozen`]).
pub(crate) fn read_graphs(
    path: &Path,
    kind: DataKind,
    mode: VocabMode<'_>,
    guard: &mut BuildGuard<'_>,
) -> AnyResult<Vec<InputGraph>> {
    Ok(match kind {
        DataKind::Trees => ptb::read_trees(path, mode)?,
        DataKind::SentencePyramid => pyramids(&ptb::read_trees(path, mode)?, guard)?,
        DataKind::Sentences => text::read_sentences(path, mode)?,
        DataKind::Images | DataKind::Tagged { .. } => {
            return Err(format!(
                "{}: images and tagged text are read with their class names (read_image_split, read_tagged_frozen)",
                path.display()
            )
            .into())
        }
    })
}

/// The time-delay pyramids over `trees`' leaves, each admitted by `guard`
/// before it is built (a pyramid grows with the square of its sentence).
pub(crate) fn pyramids(
    trees: &[InputGraph],
    guard: &mut BuildGuard<'_>,
) -> AnyResult<Vec<InputGraph>> {
    let mut out = Vec::with_capacity(trees.len());
    for (i, tree) in trees.iter().enumerate() {
        guard.admit_pyramid(tree, i)?;
        out.push(pyramid_of_tree(tree)?);
    }
    Ok(out)
}

/// The leaf words of bracketed trees, one sentence per line.
pub(crate) fn sentences_of(lines: &[String]) -> AnyResult<String> {
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
