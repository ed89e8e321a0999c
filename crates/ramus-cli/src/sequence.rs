//! The CLI side of the sequence benchmarks (`bilstm-tagger`,
//! `bilstm-char-tagger`, `td-rnn`, `td-lstm`, `rvnn`): their options, their
//! sizes from the data or a checkpoint's settings, and the character
//! vocabulary a character tagger's checkpoint keeps.

use std::collections::BTreeMap;

use ramus_graph::tagged::TaggedVocab;
use ramus_graph::Vocab;
use ramus_nn::{is_sequence_model, SequenceConfig};

/// Checkpoint setting holding a character tagger's character vocabulary
/// (JSON, as `Vocab::to_json` writes it).
pub const CHAR_VOCAB_SETTING: &str = "char_vocab";

/// Options of the sequence models (refused for the others).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SequenceArgs {
    /// MLP width of the taggers' and time-delay networks' heads [default: 256].
    #[arg(long)]
    pub mlp: Option<usize>,
    /// Character-embedding width of bilstm-char-tagger [default: 64].
    #[arg(long)]
    pub char_embed: Option<usize>,
}

impl SequenceArgs {
    /// The sizes for `model` with `chars` characters in its data, or
    /// `None` for a model that is no sequence model (then neither option
    /// may be given).
    pub fn config(&self, model: &str, chars: usize) -> Result<Option<SequenceConfig>, String> {
        if !is_sequence_model(model) {
            for (flag, given) in [
                ("--mlp", self.mlp.is_some()),
                ("--char-embed", self.char_embed.is_some()),
            ] {
                if given {
                    return Err(format!(
                        "{flag} applies to the sequence models ({}), not `{model}`",
                        ramus_nn::SEQUENCE_MODELS.join(", ")
                    ));
                }
            }
            return Ok(None);
        }
        let mut c = SequenceConfig {
            chars,
            ..SequenceConfig::default()
        };
        if let Some(m) = self.mlp {
            c.mlp = m;
        }
        if let Some(e) = self.char_embed {
            c.char_embed = e;
        }
        Ok(Some(c))
    }
}

/// The sizes a checkpoint of `model` was built with, or `None` for a model
/// that is no sequence model.
pub fn from_settings(
    model: &str,
    settings: &BTreeMap<String, String>,
) -> Result<Option<SequenceConfig>, String> {
    if !is_sequence_model(model) {
        return Ok(None);
    }
    SequenceConfig::from_settings(settings)
        .map(Some)
        .map_err(|e| format!("checkpoint settings: {e}"))
}

/// A tagger checkpoint's vocabularies: the words it was saved with, its
/// tags (`class_names`) and, for the character tagger, its characters.
pub fn tagged_vocab(
    words: &Vocab,
    settings: &BTreeMap<String, String>,
) -> Result<TaggedVocab, Box<dyn std::error::Error>> {
    let tags = crate::labels::class_names(settings)?
        .ok_or("checkpoint settings lack `class_names` (the tags)")?;
    let chars = match settings.get(CHAR_VOCAB_SETTING) {
        Some(json) => Vocab::from_json(json, &format!("setting `{CHAR_VOCAB_SETTING}`"))?,
        None => Vocab::new(),
    };
    Ok(TaggedVocab::from_parts(words.clone(), tags, chars)?)
}
