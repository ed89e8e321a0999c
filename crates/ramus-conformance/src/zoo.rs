//! Every model of the zoo (`ramus_nn::MODEL_NAMES`) at a small size, with
//! small random data of the kind it reads: the cases the conformance suite
//! runs on every engine. Sizes are chosen so that the CPU part of the
//! suite runs in seconds; data come from a fixed seed, so every engine
//! sees the same batches.

use ramus_core::{Model, Params};
use ramus_graph::random::{grid_dag, random_chain, random_path, random_tree};
use ramus_graph::sequence::{pyramid, tagger_graph, WordInput};
use ramus_graph::{images, BatchingPolicy, InputGraph};
use ramus_nn::{
    build_model_with, build_sequence_model, build_vision_model, data_kind, is_sequence_model,
    DataKind, ImageShape, ModelConfig, ModelOptions, SequenceConfig, VisionConfig,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Vocabulary, hidden width and classes of every case (the tagger's
/// classes are its tags, the language model's its vocabulary).
pub const CONFIG: ModelConfig = ModelConfig {
    vocab: 24,
    hidden: 8,
    classes: 4,
};

/// The sequence models' MLP and character sizes.
pub const SEQUENCE: SequenceConfig = SequenceConfig {
    mlp: 8,
    char_embed: 4,
    chars: 12,
};

/// Image side of the CNN cases (3 channels): CIFAR's 32, on which VGG's
/// five pools reach a 1×1 map only after its last convolution. On smaller
/// images VGG's last stages run batch norm over 1×1 maps (4 values per
/// channel at batch 4), where the shift of one batch norm is cancelled by
/// the next: its gradient is zero but for rounding, and a trajectory from
/// it depends on that rounding (f32 and f64 on the CPU differ by 4 % in
/// loss after 3 steps at side 8).
pub const IMAGE_SIDE: usize = 32;

/// The CNN cases' architecture (VGG-11 for `vgg`, a three-stage ResNet).
pub fn vision() -> VisionConfig {
    VisionConfig {
        image: ImageShape {
            channels: 3,
            height: IMAGE_SIDE,
            width: IMAGE_SIDE,
        },
        vgg_depth: 11,
        resnet_blocks: vec![1, 1, 1],
    }
}

/// One model of the zoo with its data.
pub struct Case {
    /// The model's name in `MODEL_NAMES`.
    pub name: &'static str,
    pub model: Model,
    /// `batches × batch_size` graphs of the model's kind of data.
    pub graphs: Vec<InputGraph>,
    /// Graphs per batch.
    pub batch_size: usize,
}

impl Case {
    /// Model `name` (no dropout) with `batches` batches of `batch_size`
    /// graphs drawn from `seed`; an error names a model the zoo lacks.
    pub fn new(
        name: &'static str,
        batches: usize,
        batch_size: usize,
        seed: u64,
    ) -> Result<Self, String> {
        let model = build(name, 0.0)?;
        let graphs = graphs(name, batches * batch_size, seed)?;
        Ok(Case {
            name,
            model,
            graphs,
            batch_size,
        })
    }

    /// The graphs batch by batch.
    pub fn batches(&self) -> Vec<Vec<&InputGraph>> {
        self.graphs
            .chunks(self.batch_size)
            .map(|c| c.iter().collect())
            .collect()
    }

    /// Parameters from `seed` with every element moved by up to ±0.1, so
    /// that no case starts from all-zero biases (whose gradients would
    /// check less).
    pub fn params(&self, seed: u64) -> Params<f32> {
        seeded_params(&self.model, seed)
    }
}

/// `Params::init(model, seed)` with every element moved by up to ±0.1.
pub fn seeded_params(model: &Model, seed: u64) -> Params<f32> {
    let mut params: Params<f32> = Params::init(model, seed);
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    for t in params.values.iter_mut() {
        for x in t.data_mut() {
            *x += rng.random_range(-0.1..0.1);
        }
    }
    params.touch();
    params
}

/// Model `name` of the zoo at the suite's sizes with `dropout`.
pub fn build(name: &str, dropout: f64) -> Result<Model, String> {
    let opts = ModelOptions { dropout };
    let built = if data_kind(name) == Some(DataKind::Images) {
        build_vision_model(name, &CONFIG, &vision(), &opts)
    } else if is_sequence_model(name) {
        build_sequence_model(name, &CONFIG, &SEQUENCE, &opts)
    } else {
        build_model_with(name, &CONFIG, &opts)
    };
    built.map_err(|e| format!("model `{name}`: {e}"))
}

/// `count` graphs of the data model `name` reads, from `seed`: random
/// trees of its arities (with a deep path among them), chains, grid DAGs,
/// tagged sentences (some words spelled out for the character tagger),
/// pyramids, or synthetic images.
pub fn graphs(name: &str, count: usize, seed: u64) -> Result<Vec<InputGraph>, String> {
    let kind = data_kind(name).ok_or_else(|| format!("model `{name}` reads no known data"))?;
    if kind == DataKind::Images {
        let spec = images::ImageSpec {
            channels: 3,
            height: IMAGE_SIDE,
            width: IMAGE_SIDE,
            classes: CONFIG.classes,
            noise: 0.3,
        };
        let set = images::generate(&spec, seed, (count, 0, 0)).map_err(|e| e.to_string())?;
        return Ok(set.train);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..count)
        .map(|i| one_graph(name, kind, i, &mut rng).map_err(|e| format!("{name} graph {i}: {e}")))
        .collect()
}

fn one_graph(
    name: &str,
    kind: DataKind,
    i: usize,
    rng: &mut ChaCha8Rng,
) -> Result<InputGraph, ramus_graph::GraphError> {
    let (v, c) = (CONFIG.vocab as u32, CONFIG.classes as i32);
    let leaves = 1 + rng.random_range(0..9);
    match kind {
        DataKind::Sentences => random_chain(rng, 1 + (i * 7) % 13, v),
        DataKind::SentencePyramid => {
            let tokens: Vec<u32> = (0..leaves).map(|_| rng.random_range(0..v)).collect();
            pyramid(&tokens, rng.random_range(0..c))
        }
        DataKind::Tagged { chars } => {
            let spelled: Vec<Vec<u32>> = (0..leaves)
                .map(|_| {
                    (0..1 + rng.random_range(0..4))
                        .map(|_| rng.random_range(0..SEQUENCE.chars as u32))
                        .collect()
                })
                .collect();
            let words: Vec<WordInput<'_>> = spelled
                .iter()
                .enumerate()
                .map(|(w, s)| match chars && w % 3 == 1 {
                    true => WordInput::Chars(s),
                    false => WordInput::Token(rng.random_range(0..v)),
                })
                .collect();
            let tags: Vec<i32> = (0..leaves).map(|_| rng.random_range(0..c)).collect();
            tagger_graph(&words, &tags)
        }
        _ if name == "dagrnn" => grid_dag(rng, 1 + i % 4, 1 + (i * 3) % 5, v, c),
        _ if name == "treelstm" && i % 4 == 3 => random_path(rng, 12, v, c),
        _ if name == "treelstm" => random_tree(rng, leaves, &[1, 2, 3], v, c),
        _ => random_tree(rng, leaves, &[2], v, c),
    }
}

/// One batch of `graphs` under the training schedule.
pub fn batch<'a>(model: &Model, graphs: &[&'a InputGraph]) -> ramus_exec::Batch<'a> {
    ramus_exec::Batch::new(model, graphs.to_vec(), BatchingPolicy::Cavs)
        .unwrap_or_else(|e| panic!("model `{}`: the batch does not schedule: {e}", model.name))
}

/// A copy of image `graph` (one vertex) whose first pixel is NaN: a batch
/// with it makes a training step that is not finite.
pub fn with_nan_pixel(graph: &InputGraph) -> InputGraph {
    let mut broken = graph.clone();
    let mut pixels = graph.features(0).to_vec();
    if let Some(first) = pixels.first_mut() {
        *first = f32::NAN;
    }
    broken
        .set_features(pixels.len(), pixels)
        .unwrap_or_else(|e| panic!("an image's pixels: {e}"));
    broken
}
