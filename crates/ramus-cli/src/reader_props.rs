//! Property tests of the CLI's own readers over randomly mutated real
//! inputs ([`ramus_graph::testing`]): a folder of class folders of PNG and
//! JPEG images ([`crate::image_dir`]), and checkpoints loaded as `eval` and
//! `infer` load them ([`crate::model_build::load_checkpoint`]: the model is rebuilt
//! from the mutated settings). No panic, no abort, and every error names
//! the file.

use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;
use proptest::sample::Index;
use ramus_core::Params;
use ramus_graph::testing::{apply, config, mutations};
use ramus_graph::{ptb, synthetic, Vocab, VocabMode};
use ramus_nn::checkpoint;
use ramus_nn::{ImageShape, ModelConfig, ModelOptions, SequenceConfig, VisionConfig};

use crate::image_dir;

/// A fresh folder for one test's cases (tests run on parallel threads).
fn case_dir(test: &str) -> PathBuf {
    let dir = std::env::temp_dir()
        .join(format!("ramus-cli-props-{}", std::process::id()))
        .join(test);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A 12×10 picture encoded as PNG and as JPEG.
fn images() -> &'static [(&'static str, Vec<u8>)] {
    static IMAGES: OnceLock<Vec<(&str, Vec<u8>)>> = OnceLock::new();
    IMAGES.get_or_init(|| {
        let img = image::RgbImage::from_fn(12, 10, |x, y| {
            let v = if (x + y) % 4 < 2 { 220 } else { 30 };
            image::Rgb([v, (x * 20) as u8, 255 - v])
        });
        [
            ("png", image::ImageFormat::Png),
            ("jpg", image::ImageFormat::Jpeg),
        ]
        .into_iter()
        .map(|(ext, format)| {
            let mut bytes = Cursor::new(Vec::new());
            img.write_to(&mut bytes, format).unwrap();
            (ext, bytes.into_inner())
        })
        .collect()
    })
}

/// Checkpoints of three kinds of model: a Tree-LSTM (the built-in
/// treebank's vocabulary), a character tagger (tags and characters in its
/// settings) and a small ResNet (image settings, class names and batch
/// normalisation buffers).
fn checkpoints() -> &'static [Vec<u8>] {
    static CHECKPOINTS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    CHECKPOINTS.get_or_init(|| {
        let mut vocab = Vocab::new();
        let tb = synthetic::default_treebank();
        ptb::parse_trees(
            &tb.train[..100].join("\n"),
            "t",
            VocabMode::Grow(&mut vocab),
        )
        .unwrap();
        let cfg = |vocab: usize, classes| ModelConfig {
            vocab,
            hidden: 4,
            classes,
        };
        let opts = ModelOptions::default();
        let tree =
            crate::model_build::build("treelstm", &cfg(vocab.len(), 5), None, None, &opts).unwrap();
        let seq = SequenceConfig {
            chars: 4,
            mlp: 4,
            char_embed: 3,
        };
        let mut tagger = crate::model_build::build(
            "bilstm-char-tagger",
            &cfg(vocab.len(), 2),
            None,
            Some(&seq),
            &opts,
        )
        .unwrap();
        let chars = Vocab::from_json(r#"["<unk>", "a", "b", "c"]"#, "chars").unwrap();
        tagger
            .settings
            .insert(crate::sequence::CHAR_VOCAB_SETTING.into(), chars.to_json());
        tagger
            .settings
            .insert("class_names".into(), r#"["O","X"]"#.into());
        let vision = VisionConfig {
            image: ImageShape {
                channels: 3,
                height: 8,
                width: 8,
            },
            resnet_blocks: vec![1],
            ..VisionConfig::default()
        };
        let mut cnn =
            crate::model_build::build("resnet", &cfg(1, 2), Some(&vision), None, &opts).unwrap();
        cnn.settings
            .insert("class_names".into(), r#"["a","b"]"#.into());
        let dir = case_dir("originals");
        [(tree, &vocab), (tagger, &vocab), (cnn, &Vocab::new())]
            .iter()
            .enumerate()
            .map(|(i, (model, vocab))| {
                let path = dir.join(format!("{i}.safetensors"));
                checkpoint::save(&path, model, &Params::init(model, 1), vocab).unwrap();
                std::fs::read(&path).unwrap()
            })
            .collect()
    })
}

/// `bytes` with the value of metadata `key` in its header mutated by
/// `muts` (the header re-encoded, its length field true).
fn mutate_metadata(bytes: &[u8], key: &str, muts: &[ramus_graph::testing::Mutation]) -> Vec<u8> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let value = &mut header["__metadata__"][key];
    let mutated = apply(value.as_str().unwrap().as_bytes(), muts);
    *value = String::from_utf8_lossy(&mutated).into();
    let header = serde_json::to_vec(&header).unwrap();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&bytes[8 + n..]);
    out
}

/// Fails unless `e` names `path`.
fn check_names(e: &dyn std::error::Error, path: &Path) -> Result<(), TestCaseError> {
    let message = e.to_string();
    prop_assert!(
        message.contains(&path.display().to_string()),
        "{} does not name {}",
        message,
        path.display()
    );
    Ok(())
}

proptest! {
    #![proptest_config(config(128))]

    #[test]
    fn mutated_images_read_or_fail_naming_the_file(
        which in any::<Index>(),
        muts in mutations(),
        grey in any::<bool>(),
    ) {
        let (ext, bytes) = which.get(images());
        let split = case_dir("images");
        std::fs::remove_dir_all(&split).unwrap();
        for class in ["a", "b"] {
            std::fs::create_dir_all(split.join(class)).unwrap();
        }
        let bad = split.join("a").join(format!("x.{ext}"));
        std::fs::write(&bad, apply(bytes, &muts)).unwrap();
        std::fs::write(split.join("b").join(format!("y.{ext}")), bytes).unwrap();
        let shape = ImageShape { channels: if grey { 1 } else { 3 }, height: 8, width: 8 };
        let classes = ["a".to_string(), "b".to_string()];
        match image_dir::read_split(&split, &classes, shape) {
            Ok(graphs) => prop_assert_eq!(graphs.len(), 2),
            Err(e) => check_names(e.as_ref(), &bad)?,
        }
    }

    #[test]
    fn mutated_checkpoint_settings_load_or_fail_naming_the_file(
        which in any::<Index>(),
        key in proptest::sample::select(&["ramus.settings", "ramus.vocab", "ramus.model"][..]),
        muts in mutations(),
    ) {
        let original: &Vec<u8> = which.get(checkpoints());
        let bytes = mutate_metadata(original, key, &muts);
        let path = case_dir("checkpoints").join("case.safetensors");
        std::fs::write(&path, bytes).unwrap();
        match crate::model_build::load_checkpoint(&path, crate::model_build::CheckpointFlags::default()) {
            Ok(loaded) => {
                // what `eval` reads for a tagger: it must not panic (eval
                // names the file around its error)
                if let ramus_nn::DataKind::Tagged { .. } = loaded.kind {
                    let _ = crate::sequence::tagged_vocab(&loaded.info.vocab, &loaded.info.settings);
                }
            }
            Err(e) => check_names(e.as_ref(), &path)?,
        }
    }
}

#[test]
fn unmutated_inputs_load() {
    let split = case_dir("plain-images");
    for (class, (ext, bytes)) in ["a", "b"].iter().zip(images()) {
        std::fs::create_dir_all(split.join(class)).unwrap();
        std::fs::write(split.join(class).join(format!("0.{ext}")), bytes).unwrap();
    }
    let shape = ImageShape {
        channels: 3,
        height: 8,
        width: 8,
    };
    let classes = ["a".to_string(), "b".to_string()];
    assert_eq!(
        image_dir::read_split(&split, &classes, shape)
            .unwrap()
            .len(),
        2
    );
    for (i, bytes) in checkpoints().iter().enumerate() {
        let path = case_dir("plain-checkpoints").join(format!("{i}.safetensors"));
        std::fs::write(&path, bytes).unwrap();
        crate::model_build::load_checkpoint(&path, crate::model_build::CheckpointFlags::default())
            .unwrap();
    }
}
