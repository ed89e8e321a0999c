//! Training and inference on an NVIDIA GPU.
//!
//! Trains the zoo's binary Tree-LSTM (`treelstm-nary`, a loss at every
//! labelled node) on the built-in synthetic treebank with the CUDA batched engine ([`CudaEngine`] under a
//! [`CudaTrainer`], driven by the same [`Trainer`] as on the CPU), then
//! scores the dev trees with the CUDA compiled inference engine
//! ([`CompiledEngine`]: the model's cells lowered and generated as one
//! persistent kernel) and checks its predictions against the CPU compiled
//! engine's.
//!
//! `ramus-cuda` loads the CUDA driver, NVRTC and cuBLAS when the program
//! runs, so this builds anywhere; on a machine without a GPU or without the
//! libraries the program says so in one line and exits successfully.
//!
//! Run it from the repository root:
//!
//! ```text
//! cargo run --release --example cuda
//! ```

use std::error::Error;
use std::process::ExitCode;
use std::time::Instant;

use ramus_core::Params;
use ramus_cpu::compiled::CpuCompiledEngine;
use ramus_cuda::compiled::{CompiledEngine, CompiledOptions};
use ramus_cuda::{CudaDevice, CudaEngine, CudaEngineOptions, CudaTrainer};
use ramus_exec::{InferEngine, OptimizerConfig, OptimizerKind};
use ramus_graph::{ptb, synthetic, InputGraph, Vocab, VocabMode};
use ramus_nn::{build_model, ModelConfig, Trainer};

const EPOCHS: usize = 3;
const BATCH: usize = 25;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn Error>> {
    // What is missing (driver, NVRTC, cuBLAS, a device) as an error, never a panic.
    if let Err(e) = CudaDevice::available() {
        let why = e.to_string().replace('\n', " ");
        println!("CUDA is not usable here ({why}); nothing to run");
        return Ok(());
    }

    let (train, dev, vocab) = treebank()?;
    let cfg = ModelConfig {
        vocab: vocab.len(),
        hidden: 64,
        classes: 5,
    };
    let model = build_model("treelstm-nary", &cfg)?;
    let params = Params::<f32>::init(&model, 1);
    let optimizer = OptimizerConfig::new(OptimizerKind::Adagrad, 0.05);

    // The batched engine on GPU 0 (`CudaEngineOptions::device` picks
    // another), holding the parameters and the optimizer on the device.
    let engine = CudaEngine::new(&model, &CudaEngineOptions::default())?;
    let engine = CudaTrainer::new(engine, model.clone(), params, optimizer)?;
    let mut trainer = Trainer::with_engine(Box::new(engine));
    let mut rng = ramus_nn::train::rng(1);
    for epoch in 1..=EPOCHS {
        let started = Instant::now();
        let loss = trainer.train_epoch(&train, BATCH, &mut rng, |_, _, _| {})?;
        let dev_result = trainer.evaluate(&dev, 100)?;
        println!(
            "epoch {epoch}: train loss {loss:.4}, dev root accuracy {:.3} ({:.2} s)",
            dev_result.root_accuracy,
            started.elapsed().as_secs_f64()
        );
    }

    // Inference: the trained parameters, read back from the device, in the
    // CUDA compiled engine and, for comparison, the CPU one.
    let params = trainer.state()?.params;
    let refs: Vec<&InputGraph> = dev.iter().collect();
    // As `InferEngine`s (the trait every inference engine implements), the
    // engines score each tree's root.
    let compiled = CompiledEngine::new(&model, &params, &CompiledOptions::default())?;
    let mut gpu: Box<dyn InferEngine<f32>> = Box::new(compiled);
    let started = Instant::now();
    let on_gpu = gpu.infer(&refs)?.predictions();
    let gpu_seconds = started.elapsed().as_secs_f64();
    let mut cpu: Box<dyn InferEngine<f32>> =
        Box::new(CpuCompiledEngine::new(&model, &params, true)?);
    let on_cpu = cpu.infer(&refs)?.predictions();
    let same = on_gpu.iter().zip(&on_cpu).filter(|(a, b)| a == b).count();
    println!(
        "{}: {} dev trees in {:.1} ms; {same} of {} predictions as on the CPU",
        gpu.name(),
        refs.len(),
        gpu_seconds * 1e3,
        on_cpu.len()
    );
    Ok(())
}

/// The training and dev trees, and the vocabulary they were read with.
type Splits = (Vec<InputGraph>, Vec<InputGraph>, Vocab);

/// The built-in synthetic treebank's training and dev splits, parsed with
/// one vocabulary: the training words (dev words it lacks read as `<unk>`).
fn treebank() -> Result<Splits, Box<dyn Error>> {
    let tb = synthetic::default_treebank();
    let mut vocab = Vocab::new();
    let train = ptb::parse_trees(&tb.train.join("\n"), "train", VocabMode::Grow(&mut vocab))?;
    let dev = ptb::parse_trees(&tb.dev.join("\n"), "dev", VocabMode::Frozen(&vocab))?;
    Ok((train, dev, vocab))
}
