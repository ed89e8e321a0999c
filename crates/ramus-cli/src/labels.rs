//! Class labels against the class count, checked before any work. A tree
//! or pyramid model's class count is `--classes` when declared, else one
//! more than the largest label of every split (train, dev and test, so
//! that a dev label is never found out of range after training); a label
//! outside it anywhere is an error naming its file and line. `eval`,
//! `infer` and `bench` check their inputs against the model's own count.
//!
//! The other models cannot go wrong this way and take no `--classes`:
//! the taggers' classes are the training tags (the reader refuses a tag
//! it does not know, naming the token), the CNNs' the class folders of
//! `train/` (an unknown folder is refused), and the language model's
//! labels are token ids, below the vocabulary it predicts by construction.

use ramus_core::Model;
use ramus_graph::{InputGraph, NO_LABEL};
use ramus_nn::DataKind;

use crate::data::Splits;

/// The largest label of `sets` and where it is (`None` without labels).
pub fn largest(sets: &[&[InputGraph]]) -> Option<(i32, String)> {
    let mut best: Option<(i32, usize, &InputGraph)> = None;
    for set in sets {
        for (i, g) in set.iter().enumerate() {
            if let Some(&l) = g.labels.iter().max() {
                if l != NO_LABEL && best.is_none_or(|(b, _, _)| l > b) {
                    best = Some((l, i, g));
                }
            }
        }
    }
    best.map(|(l, i, g)| (l, g.describe(i)))
}

/// The class count of labelled splits: one more than their largest label,
/// at least 2 (a classifier tells classes apart).
pub fn count(sets: &[&[InputGraph]]) -> usize {
    largest(sets).map_or(0, |(l, _)| l.max(1) as usize) + 1
}

/// The first label of `graphs` outside `0..classes`, as an error naming
/// the input (`whose` says whose count it is).
pub fn check(graphs: &[InputGraph], classes: usize, whose: &str) -> Result<(), String> {
    for (i, g) in graphs.iter().enumerate() {
        let bad = g
            .labels
            .iter()
            .find(|&&l| l != NO_LABEL && usize::try_from(l).map_or(true, |l| l >= classes));
        if let Some(l) = bad {
            return Err(format!(
                "{}: label {l} is outside the {classes} classes {whose} (labels 0 to {})",
                g.describe(i),
                classes.saturating_sub(1)
            ));
        }
    }
    Ok(())
}

/// The number of classes `model` scores (the width of its logits).
pub fn model_classes(model: &Model) -> Option<usize> {
    let head = &model.head;
    head.logits.map(|l| head.forward.nodes[l].ty.width())
}

/// [`check`] against `model`'s classes, if it scores any.
pub fn check_model(graphs: &[InputGraph], model: &Model, whose: &str) -> Result<(), String> {
    match model_classes(model) {
        Some(classes) => check(graphs, classes, whose),
        None => Ok(()),
    }
}

/// [`check_model`] for a model read from the checkpoint at `path`.
pub fn check_checkpoint(
    graphs: &[InputGraph],
    model: &Model,
    path: &std::path::Path,
) -> Result<(), String> {
    check_model(
        graphs,
        model,
        &format!("of the checkpoint {}", path.display()),
    )
}

/// The class names a checkpoint's settings record (`class_names`, JSON),
/// or `None` where it records none (tree models, whose labels are
/// numbers).
pub(crate) fn class_names(
    settings: &std::collections::BTreeMap<String, String>,
) -> Result<Option<Vec<String>>, String> {
    settings
        .get("class_names")
        .map(|json| {
            serde_json::from_str(json).map_err(|e| format!("checkpoint setting `class_names`: {e}"))
        })
        .transpose()
}

/// `ramus train`'s class count: `--classes` when given, every label of
/// every split checked against it; else the count [`count`] took from all
/// splits. Refused for the models whose classes come from elsewhere.
pub fn settle(data: &mut Splits, kind: DataKind, declared: Option<usize>) -> Result<(), String> {
    let Some(n) = declared else {
        return Ok(());
    };
    if !matches!(kind, DataKind::Trees | DataKind::SentencePyramid) {
        return Err(
            "--classes applies to the tree models and td-rnn / td-lstm; the taggers' classes \
             are their training tags, the CNNs' their class folders, the language model's its \
             vocabulary"
                .into(),
        );
    }
    if n == 0 {
        return Err("--classes must be at least 1".into());
    }
    let whose = format!("declared by --classes {n}");
    for split in [&data.train, &data.dev, &data.test] {
        check(split, n, &whose)?;
    }
    data.classes = n;
    Ok(())
}

/// Where the class count came from, for a message about its size:
/// `--classes N`, or the largest label and its place.
pub fn source(data: &Splits, kind: DataKind, declared: Option<usize>) -> Option<String> {
    if !matches!(kind, DataKind::Trees | DataKind::SentencePyramid) {
        return None;
    }
    if let Some(n) = declared {
        return Some(format!("--classes {n}"));
    }
    largest(&[&data.train, &data.dev, &data.test])
        .map(|(l, at)| format!("label {l} at {at} (declare the count with --classes)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ramus_graph::Origin;

    fn labelled(labels: &[i32], line: usize) -> InputGraph {
        let tokens = vec![1; labels.len()];
        InputGraph::chain(&tokens, labels)
            .unwrap()
            .with_origin(Origin {
                file: "f.txt".into(),
                line,
            })
    }

    #[test]
    fn counts_and_checks_name_the_line() {
        let train = [labelled(&[0, 1], 1)];
        let dev = [labelled(&[NO_LABEL, 4], 2)];
        assert_eq!(count(&[&train, &dev]), 5);
        assert_eq!(largest(&[&train, &dev]), Some((4, "f.txt:2".into())));
        assert_eq!(count(&[&[labelled(&[0], 1)]]), 2);
        let e = check(&dev, 3, "of the model").unwrap_err();
        assert_eq!(
            e,
            "f.txt:2: label 4 is outside the 3 classes of the model (labels 0 to 2)"
        );
        assert!(check(&dev, 5, "").is_ok());
        let negative = [labelled(&[-7], 9)];
        assert!(check(&negative, 5, "").unwrap_err().starts_with("f.txt:9:"));
    }
}
