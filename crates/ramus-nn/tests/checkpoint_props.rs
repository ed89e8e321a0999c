//! Property test of checkpoint loading over randomly mutated real
//! checkpoints: a small Tree-LSTM saved with the built-in treebank's
//! vocabulary, mutated anywhere, in its header JSON (the length field kept
//! true), in a metadata value (`ramus.settings`, `ramus.vocab`, re-encoded
//! into a valid header) or in its tensor data. Reading the metadata and
//! loading the parameters never panics or allocates from a size field, and
//! every error names the file and what in it is wrong: the header bytes,
//! the metadata key or the tensor.

use std::path::PathBuf;
use std::sync::OnceLock;

use proptest::prelude::*;
use ramus_core::Params;
use ramus_graph::testing::{apply, config, mutations, Mutation};
use ramus_graph::{ptb, synthetic, Vocab, VocabMode};
use ramus_nn::{build_model, checkpoint, ModelConfig};

/// The checkpoint's bytes and the model it holds.
fn original() -> &'static (Vec<u8>, ramus_core::Model) {
    static ORIGINAL: OnceLock<(Vec<u8>, ramus_core::Model)> = OnceLock::new();
    ORIGINAL.get_or_init(|| {
        let tb = synthetic::default_treebank();
        let mut vocab = Vocab::new();
        ptb::parse_trees(
            &tb.train[..200].join("\n"),
            "train",
            VocabMode::Grow(&mut vocab),
        )
        .unwrap();
        let cfg = ModelConfig {
            vocab: vocab.len(),
            hidden: 4,
            classes: 5,
        };
        let model = build_model("treelstm", &cfg).unwrap();
        let path = case_file("original");
        checkpoint::save(&path, &model, &Params::init(&model, 3), &vocab).unwrap();
        (std::fs::read(&path).unwrap(), model)
    })
}

fn case_file(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ramus-ckpt-props-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{name}.safetensors"))
}

/// `bytes` split into (header JSON, tensor data), trusting its length field.
fn split(bytes: &[u8]) -> (&[u8], &[u8]) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (&bytes[8..8 + n], &bytes[8 + n..])
}

/// A safetensors file of `header` and `data`, its length field true.
fn join(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

/// Where the mutations go.
#[derive(Clone, Copy, Debug)]
enum Target {
    File,
    HeaderJson,
    Metadata(&'static str),
    TensorData,
}

fn target() -> impl Strategy<Value = Target> {
    prop_oneof![
        Just(Target::File),
        Just(Target::HeaderJson),
        Just(Target::Metadata("ramus.settings")),
        Just(Target::Metadata("ramus.vocab")),
        Just(Target::Metadata("ramus.model")),
        Just(Target::TensorData),
    ]
}

/// The original checkpoint with `muts` applied to `target`.
fn mutate(target: Target, muts: &[Mutation]) -> Vec<u8> {
    let bytes = &original().0;
    let (header, data) = split(bytes);
    match target {
        Target::File => apply(bytes, muts),
        Target::HeaderJson => join(&apply(header, muts), data),
        Target::TensorData => join(header, &apply(data, muts)),
        Target::Metadata(key) => {
            let mut h: serde_json::Value = serde_json::from_slice(header).unwrap();
            let meta = &mut h["__metadata__"][key];
            let value = apply(meta.as_str().unwrap().as_bytes(), muts);
            *meta = String::from_utf8_lossy(&value).into();
            join(&serde_json::to_vec(&h).unwrap(), data)
        }
    }
}

/// Fails unless `message` names `path` and a place in the file.
fn check_error(message: &str, path: &str) -> Result<(), TestCaseError> {
    prop_assert!(message.contains(path), "{} does not name {}", message, path);
    let places = ["byte", "header", "metadata", "tensor `"];
    prop_assert!(
        places.iter().any(|p| message.contains(p)),
        "{} names no byte, header, metadata key or tensor",
        message
    );
    Ok(())
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn mutated_checkpoints_load_or_fail_located(target in target(), muts in mutations()) {
        let bytes = mutate(target, &muts);
        let path = case_file("case");
        std::fs::write(&path, &bytes).unwrap();
        let name = path.display().to_string();
        match checkpoint::read_info(&path) {
            Err(e) => check_error(&e.to_string(), &name)?,
            Ok((info, data)) => {
                prop_assert_eq!(info.vocab.word(0), Some(ramus_graph::vocab::UNK));
                match checkpoint::load_params(&path, &data, &original().1) {
                    Err(e) => check_error(&e.to_string(), &name)?,
                    Ok(p) => prop_assert_eq!(p.values.len(), original().1.params.len()),
                }
            }
        }
    }
}

#[test]
fn the_original_checkpoint_loads() {
    let (bytes, model) = original();
    let path = case_file("whole");
    std::fs::write(&path, bytes).unwrap();
    let (_, data) = checkpoint::read_info(&path).unwrap();
    assert_eq!(
        checkpoint::load_params(&path, &data, model).unwrap(),
        Params::init(model, 3)
    );
}
