//! Helpers shared by the integration tests: the skip check for machines
//! without CUDA, deterministic values and the steady-state allocation loop.
//! Each test crate uses a subset, hence the `dead_code` allowance.
#![allow(dead_code)]

use std::sync::Arc;

use ramus_core::{Grads, Model, Params};
use ramus_cuda::{CudaDevice, CudaEngine};
use ramus_exec::{Batch, Mode};
use ramus_graph::{BatchingPolicy, InputGraph};

/// Device 0, or `None` (after printing why) when CUDA is not usable here.
pub fn device() -> Option<Arc<CudaDevice>> {
    if !cuda_ready("skipping") {
        return None;
    }
    match CudaDevice::open(0) {
        Ok(device) => Some(device),
        Err(e) => panic!("CUDA is available but device 0 does not open: {e}"),
    }
}

// as with `dead_code`: each test crate uses a subset
#[allow(unused_imports)]
pub use ramus_conformance::{fixtures::values, gpu::cuda_ready, optimizer_fixture};

/// Three rounds of training batches of `data` in chunks of `chunk`; after
/// the first round no batch may make a device allocation. Round 0 prints
/// the launches per batch (`what` names the items, "graphs" or "images").
pub fn assert_steady_state(
    cuda: &mut CudaEngine,
    model: &Model,
    params: &Params<f32>,
    data: &[InputGraph],
    chunk: usize,
    what: &str,
) {
    let mut grads = Grads::zeros(model);
    let mut allocations = None;
    for round in 0..3 {
        for chunk in data.chunks(chunk) {
            let batch =
                Batch::new(model, chunk.iter().collect(), BatchingPolicy::Cavs).expect("schedule");
            let launches = cuda.launches();
            CudaEngine::forward(cuda, model, params, &batch, Mode::Train).expect("forward");
            grads.clear();
            CudaEngine::backward(cuda, model, params, &batch, &mut grads).expect("backward");
            if round == 0 {
                println!(
                    "{} {what}: {} launches per training batch",
                    chunk.len(),
                    cuda.launches() - launches
                );
            }
        }
        let now = cuda.pool_stats().driver_allocations;
        match allocations {
            None => allocations = Some(now),
            Some(before) => assert_eq!(now, before, "round {round} allocated device memory"),
        }
    }
}

/// Up to `n` SST dev trees (from `$RAMUS_DATA/sst/dev.txt`, else the
/// shared data beside the checkout), tokens folded into `vocab`; empty,
/// with a notice, when the data is absent.
pub fn sst_dev_trees(n: usize, vocab: u32) -> Vec<InputGraph> {
    use ramus_graph::{ptb, Vocab, VocabMode};
    let root = match std::env::var_os("RAMUS_DATA") {
        Some(d) => std::path::PathBuf::from(d),
        None => std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data"),
    };
    let path = root.join("sst/dev.txt");
    let Ok(text) = std::fs::read_to_string(&path) else {
        eprintln!("skipping the SST trees: {} not found", path.display());
        return Vec::new();
    };
    let mut words = Vocab::new();
    let Ok(mut trees) = ptb::parse_trees(&text, "dev.txt", VocabMode::Grow(&mut words)) else {
        eprintln!("skipping the SST trees: {} does not parse", path.display());
        return Vec::new();
    };
    trees.truncate(n);
    for t in &mut trees {
        for tok in &mut t.tokens {
            *tok %= vocab;
        }
    }
    trees
}

/// A one-block ResNet of width 4 over 3 classes of 16×16 images, and
/// `images` training images for it (seed 2).
pub fn tiny_resnet(images: usize) -> (Model, Vec<InputGraph>) {
    use ramus_graph::images::{generate, ImageSpec};
    use ramus_nn::{build_vision_model, ImageShape, ModelConfig, ModelOptions, VisionConfig};
    let spec = ImageSpec {
        channels: 3,
        height: 16,
        width: 16,
        classes: 3,
        noise: 0.5,
    };
    let data = generate(&spec, 2, (images, 0, 0)).expect("images").train;
    let cfg = ModelConfig {
        vocab: 0,
        hidden: 4,
        classes: 3,
    };
    let vision = VisionConfig {
        image: ImageShape {
            channels: 3,
            height: 16,
            width: 16,
        },
        vgg_depth: 11,
        resnet_blocks: vec![1],
    };
    let model =
        build_vision_model("resnet", &cfg, &vision, &ModelOptions { dropout: 0.0 }).expect("model");
    (model, data)
}
