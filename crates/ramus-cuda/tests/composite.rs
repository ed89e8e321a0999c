//! A user-composed activation (`x * sigmoid(1.702 x)`, registered with
//! `OpRegistry::register_composite`) inside a vertex function runs as part
//! of one fused kernel: the model using it launches exactly as many kernels
//! as the same model with a primitive `tanh`. The fusion plans are compared
//! everywhere; launches and results on the device where CUDA is present.
//! The same net, with every registered elementwise op as its activation,
//! checks each op's generated forward and backward code on the device
//! against the CPU engine.

mod common;

use ramus_conformance::fixtures::{binary_cell, softmax_head};
use ramus_core::fusion;
use ramus_core::model::{FunctionSelector, HeadRows, Init, ModelBuilder};
use ramus_core::{Model, OpRegistry, Params};
use ramus_cpu::CpuEngine;
use ramus_cuda::{CudaEngine, CudaEngineOptions};
use ramus_exec::{Batch, Mode};
use ramus_graph::random::random_tree;
use ramus_graph::{BatchingPolicy, InputGraph};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const VOCAB: usize = 30;
const HIDDEN: usize = 16;
const CLASSES: usize = 3;

fn registry() -> OpRegistry {
    let mut reg = OpRegistry::standard();
    reg.register_composite("swish_1702", 1, "x * sigmoid(1.702 x)", |b, x| {
        let s = b.scale(x[0], 1.702);
        let s = b.sigmoid(s);
        b.mul(x[0], s)
    })
    .expect("registers");
    // log, exp and add_scalar
    reg.register_composite("softplus", 1, "log(1 + exp(x))", |b, x| {
        let e = b.exp(x[0]);
        let e = b.add_scalar(e, 1.0);
        b.log(e)
    })
    .expect("registers");
    // div, neg, sub and rsub_scalar; bounded (through tanh) so that deep
    // trees keep exp finite
    reg.register_composite(
        "ratio",
        1,
        "t = tanh(x): (t - 1) / (1 + exp(-t)) - (2 - t)",
        |b, x| {
            let t = b.tanh(x[0]);
            let n = b.neg(t);
            let e = b.exp(n);
            let d = b.add_scalar(e, 1.0);
            let one = b.add_scalar(t, -1.0);
            let q = b.div(one, d);
            let r = b.rsub_scalar(t, 2.0);
            b.sub(q, r)
        },
    )
    .expect("registers");
    reg
}

/// A recursive net `h = act(W [h_l; h_r] + b)` with `act` from the registry.
fn model(activation: &str) -> Model {
    model_with(activation, &[])
}

/// The same with numeric attributes for the activation (e.g. `scale`).
fn model_with(activation: &str, attrs: &[f64]) -> Model {
    let reg = registry();
    let mut m = ModelBuilder::new("act-net", HIDDEN);
    let emb = m.param("emb", &[VOCAB, HIDDEN], Init::Normal { std: 0.3 });
    let w = m.param("W", &[HIDDEN, 2 * HIDDEN], Init::Xavier);
    let b = m.param("b", &[HIDDEN], Init::Normal { std: 0.1 });
    let w_out = m.param("W_out", &[CLASSES, HIDDEN], Init::Xavier);
    let leaf = m
        .vertex_fn("leaf", |f| {
            let x = f.embed(emb);
            f.scatter(x);
            f.push(x);
        })
        .expect("leaf");
    let internal = m
        .vertex_fn("internal", |f| {
            binary_cell(f, w, Some(b), |f, z| reg.call(f, activation, &[z], attrs))
        })
        .expect("internal");
    m.select(FunctionSelector::LeafInternal { leaf, internal });
    m.head(HeadRows::Roots, HIDDEN, |hd| softmax_head(hd, w_out))
        .expect("head");
    m.build().expect("model")
}

/// Kernel launches of every phase's fusion plan, forward and backward.
fn planned_launches(m: &Model) -> Vec<usize> {
    let mut launches = Vec::new();
    for func in &m.functions {
        let keep = fusion::forward_reads(&func.backward);
        for (g, plan, keep) in [
            (&func.forward, &func.forward_plan, keep),
            (&func.backward, &func.backward_plan, Default::default()),
        ] {
            for nodes in [&plan.eager, &plan.per_task, &plan.lazy] {
                let p = fusion::fuse(g, nodes, &|n| keep.contains(&n)).expect("fuses");
                launches.push(p.kernel_launches());
            }
        }
    }
    launches
}

#[test]
fn the_composite_activation_fuses_into_the_surrounding_kernel() {
    let (plain, composite) = (model("tanh"), model("swish_1702"));
    let (a, b) = (planned_launches(&plain), planned_launches(&composite));
    assert_eq!(a, b, "launches per phase: tanh {a:?} vs composite {b:?}");
    // and the composite's three ops really are in the model, in one group
    let internal = &composite.functions[1];
    let plan = fusion::fuse(&internal.forward, &internal.forward_plan.per_task, &|_| {
        false
    })
    .expect("fuses");
    let sizes: Vec<usize> = plan.groups().map(|g| g.nodes.len()).collect();
    assert!(
        sizes.iter().any(|&n| n >= 4),
        "bias add, scale, sigmoid and mul should share one group: {sizes:?}"
    );
}

fn batch_graphs() -> Vec<InputGraph> {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    (0..9)
        .map(|i| {
            random_tree(&mut rng, 2 + i * 3, &[2], VOCAB as u32, CLASSES as i32).expect("tree")
        })
        .collect()
}

/// Launches of one training batch (forward + backward), and the loss.
fn launches_of(m: &Model, cuda: &mut CudaEngine) -> (u64, f64) {
    let params: Params<f32> = Params::init(m, 2);
    let graphs = batch_graphs();
    let batch = Batch::new(m, graphs.iter().collect(), BatchingPolicy::Cavs).expect("schedule");
    let mut grads = ramus_core::Grads::zeros(m);
    let before = cuda.launches();
    let out = CudaEngine::forward(cuda, m, &params, &batch, Mode::Train).expect("forward");
    CudaEngine::backward(cuda, m, &params, &batch, &mut grads).expect("backward");
    let launches = cuda.launches() - before;
    let want = CpuEngine::<f32>::new()
        .forward(m, &params, &batch, Mode::Train)
        .expect("cpu forward")
        .loss
        .unwrap_or(f64::NAN);
    let got = out.loss.unwrap_or(f64::NAN);
    assert!(
        (want - got).abs() <= 1e-4 * want.abs().max(1.0),
        "loss CPU {want} vs CUDA {got}"
    );
    (launches, got)
}

#[test]
fn the_composite_activation_launches_no_extra_kernel_on_the_device() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let opts = CudaEngineOptions {
        cache_dir: Some(
            std::env::temp_dir().join(format!("ramus-composite-{}", std::process::id())),
        ),
        ..CudaEngineOptions::default()
    };
    let (plain, composite) = (model("tanh"), model("swish_1702"));
    let (a, _) = launches_of(&plain, &mut CudaEngine::new(&plain, &opts).expect("engine"));
    let (b, _) = launches_of(
        &composite,
        &mut CudaEngine::new(&composite, &opts).expect("engine"),
    );
    println!("launches per training batch: tanh {a}, composite {b}");
    assert_eq!(a, b, "the composite activation changed the launch count");
}

#[test]
fn every_elementwise_op_matches_the_cpu_engine_on_the_device() {
    if !common::cuda_ready("skipping") {
        return;
    }
    let opts = CudaEngineOptions {
        cache_dir: Some(std::env::temp_dir().join(format!("ramus-ops-{}", std::process::id()))),
        ..CudaEngineOptions::default()
    };
    let graphs = batch_graphs();
    let activations: [(&str, &[f64]); 10] = [
        ("tanh", &[]),
        ("sigmoid", &[]),
        ("relu", &[]),
        ("neg", &[]),
        ("scale", &[0.7]),
        ("add_scalar", &[0.3]),
        ("rsub_scalar", &[0.2]),
        ("softplus", &[]),
        ("ratio", &[]),
        ("swish_1702", &[]),
    ];
    for (name, attrs) in activations {
        let m = model_with(name, attrs);
        let params: Params<f32> = Params::init(&m, 4);
        let batch =
            Batch::new(&m, graphs.iter().collect(), BatchingPolicy::Cavs).expect("schedule");
        let mut cpu = CpuEngine::<f32>::new();
        let mut cuda = CudaEngine::new(&m, &opts).expect("engine");
        let want = cpu
            .forward(&m, &params, &batch, Mode::Train)
            .expect("cpu forward");
        let got =
            CudaEngine::forward(&mut cuda, &m, &params, &batch, Mode::Train).expect("cuda forward");
        let (l0, l1) = (want.loss.unwrap_or(f64::NAN), got.loss.unwrap_or(f64::NAN));
        assert!(
            (l0 - l1).abs() <= 1e-4 * l0.abs().max(1.0),
            "{name}: loss CPU {l0} vs CUDA {l1}"
        );
        let (mut g0, mut g1) = (ramus_core::Grads::zeros(&m), ramus_core::Grads::zeros(&m));
        cpu.backward(&m, &params, &batch, &mut g0)
            .expect("cpu backward");
        CudaEngine::backward(&mut cuda, &m, &params, &batch, &mut g1).expect("cuda backward");
        for (p, spec) in m.params.iter().enumerate() {
            let (a, b) = (g0.values[p].data(), g1.values[p].data());
            let scale = a.iter().fold(0f32, |s, x| s.max(x.abs())).max(1e-3);
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-4 * scale + 1e-6,
                    "{name}: d{}[{i}] CPU {x} vs CUDA {y}",
                    spec.name
                );
            }
        }
    }
}
