//! The data a training run reads ([`Splits`], loaded by the `data` module).

use ramus_graph::tagged::TaggedVocab;
use ramus_graph::{InputGraph, Vocab};
use ramus_nn::ImageShape;

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
    /// The taggers' vocabularies (tagged text only).
    pub tagged: Option<TaggedVocab>,
}

impl Splits {
    /// What the data holds besides its sizes, for the training log.
    pub fn describe(&self) -> String {
        match (&self.image, &self.tagged) {
            (Some(shape), _) => format!("{shape} images, {} classes", self.classes),
            (None, Some(t)) => format!(
                "vocabulary {}, {} tags, {} characters",
                self.vocab.len(),
                t.tags.len(),
                t.chars.len()
            ),
            (None, None) => format!("vocabulary {}", self.vocab.len()),
        }
    }

    /// Size of the character vocabulary (0 without one).
    pub fn chars(&self) -> usize {
        self.tagged.as_ref().map_or(0, |t| t.chars.len())
    }
}
