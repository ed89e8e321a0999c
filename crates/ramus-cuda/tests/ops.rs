//! Every non-elementwise op, forward and backward, on the device against
//! the CPU engine: each case is a one-function model whose vertex function
//! applies the op to a pulled input and the children's states, on random
//! trees, compared on the loss, every parameter gradient and the pulled
//! inputs' effect (relative 1e-4, absolute 1e-6). Elementwise ops are
//! covered as activations in `composite.rs`. Skips without a CUDA driver.

mod common;

use ramus_conformance::fixtures::softmax_head;
use ramus_core::model::{HeadRows, Init, ModelBuilder, VertexFnBuilder};
use ramus_core::ops::RowMatMul;
use ramus_core::{Grads, Model, Params, Sym};
use ramus_cpu::CpuEngine;
use ramus_cuda::{CudaEngine, CudaEngineOptions};
use ramus_exec::{Batch, Mode};
use ramus_graph::random::random_tree;
use ramus_graph::{BatchingPolicy, InputGraph};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const S: usize = 6;
const VOCAB: usize = 11;
const CLASSES: usize = 3;
const SMALL_TABLE: usize = 4;

/// `h = tanh(body(x, children, W, table))` over trees, `x` a pulled input of
/// width `S`, `children` the gathered child states (edge rows), `W` an
/// `S x S` parameter, `table` a `VOCAB x S` embedding table and `small` a
/// `SMALL_TABLE x S` table (fewer rows than tokens: `embedding_unk`).
fn op_model(
    name: &str,
    body: impl Fn(&mut VertexFnBuilder, Sym, Sym, Sym, Sym, Sym) -> Sym,
) -> Model {
    let mut m = ModelBuilder::new(name, S);
    let w = m.param("W", &[S, S], Init::Normal { std: 0.4 });
    let table = m.param("table", &[VOCAB, S], Init::Normal { std: 0.4 });
    let small = m.param("small", &[SMALL_TABLE, S], Init::Normal { std: 0.4 });
    let w_out = m.param("W_out", &[CLASSES, S], Init::Normal { std: 0.4 });
    m.vertex_fn("cell", |f| {
        let x = f.pull(S);
        let kids = f.gather_all();
        let (wp, tp, sp) = (f.param(w), f.param(table), f.param(small));
        let y = body(f, x, kids, wp, tp, sp);
        let h = f.tanh(y);
        f.scatter(h);
        f.push(h);
    })
    .expect("cell");
    m.head(HeadRows::Labelled, S, |hd| softmax_head(hd, w_out))
        .expect("head");
    m.build().expect("model")
}

fn cases() -> Vec<Model> {
    vec![
        // slice as a step (read by sum_rows), pad, sum_rows broadcast back
        op_model("slice-pad-sum_rows", |f, x, kids, _, _, _| {
            let s = f.slice(x, 1, 3);
            let p = f.pad(s, 2, S);
            let r = f.sum_rows(x);
            let e = f.sum_children(kids);
            let y = f.add(p, e);
            f.add(y, r)
        }),
        // child sum (backward: expand_children), mean_rows and its
        // broadcast gradient, A·Bᵀ
        op_model("sum_children-mean_rows", |f, x, kids, w, _, _| {
            let e = f.sum_children(kids);
            let m = f.mean_rows(x);
            let z = f.linear(e, w, None);
            let y = f.add(z, m);
            f.add(y, x)
        }),
        // a concat step (inputs from outside any group), A·B, reshape of a
        // static value and a static·static product
        op_model("concat-reshape-matmul", |f, x, kids, w, _, _| {
            let e = f.sum_children(kids);
            let c = f.concat(&[x, e]);
            let left = f.slice(c, 0, S);
            let right = f.slice(c, S, S);
            let a = f.matmul(left, w, false, false);
            let a = f.add(a, right);
            // rows are reduced only off the gather-scatter path (eager)
            let r = f.sum_rows(x);
            let r = f.reshape(r, &[1, S]);
            let r = f.matmul(r, w, false, true);
            let r = f.reshape(r, &[S]);
            f.add(a, r)
        }),
        // embedding rows (sparse gradient), expand_children explicitly
        op_model("embedding-expand", |f, x, kids, _, table, _| {
            let tokens = f.token();
            let emb = f.embedding(table, tokens);
            let e = f.sum_children(kids);
            let back = f.expand_children(e);
            let s = f.sum_children(back);
            let y = f.add(emb, x);
            f.add(y, s)
        }),
        // per-row matrix products: rows · rows ([2,3]·[3,3]), a static
        // matrix (transposed) times rows, rows times a static (transposed)
        op_model("row_matmul", |f, x, kids, w, _, _| {
            let e = f.sum_children(kids);
            let head = f.slice(x, 0, 3);
            let b = f.concat(&[e, head]);
            let y = f.row_matmul(x, b, RowMatMul::new(2, 3, 3));
            let left = f.row_matmul(
                w,
                e,
                RowMatMul {
                    trans_a: true,
                    ..RowMatMul::new(S, S, 1)
                },
            );
            let right = f.row_matmul(
                x,
                w,
                RowMatMul {
                    trans_b: true,
                    ..RowMatMul::new(1, S, S)
                },
            );
            let y = f.add(y, left);
            f.add(y, right)
        }),
        // a table with fewer rows than tokens: the rest read (and train) row 0
        op_model("embedding_unk", |f, x, kids, _, _, small| {
            let tokens = f.token();
            let emb = f.embedding_unk(small, tokens);
            let e = f.sum_children(kids);
            let y = f.mul(emb, x);
            f.add(y, e)
        }),
    ]
}

#[test]
fn pulling_without_features_or_values_is_an_error() {
    let m = &cases()[1];
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let g = random_tree(&mut rng, 4, &[2], VOCAB as u32, CLASSES as i32).expect("tree");
    let batch = Batch::new(m, vec![&g], BatchingPolicy::Cavs).expect("schedule");
    let params: Params<f32> = Params::init(m, 1);
    let err = CpuEngine::<f32>::new()
        .forward(m, &params, &batch, Mode::Train)
        .expect_err("nothing to pull");
    assert!(err.to_string().contains("carry no features"), "{err}");
    let mut h = g.clone();
    h.set_features(2, vec![0.5; 2 * h.len()]).expect("features");
    let err = Batch::new(m, vec![&g, &h], BatchingPolicy::Cavs)
        .err()
        .expect("mixed widths");
    assert!(err.to_string().contains("features per vertex"), "{err}");
    let batch = Batch::new(m, vec![&h], BatchingPolicy::Cavs).expect("schedule");
    let err = CpuEngine::<f32>::new()
        .forward(m, &params, &batch, Mode::Train)
        .expect_err("wrong width");
    assert!(err.to_string().contains("carry 2 features"), "{err}");
}

#[test]
fn every_structure_op_matches_the_cpu_engine_on_the_device() {
    // the cases run on the CPU everywhere; the comparison needs a device
    let device = common::cuda_ready("skipping the device half");
    let opts = CudaEngineOptions {
        cache_dir: Some(std::env::temp_dir().join(format!("ramus-ops-{}", std::process::id()))),
        ..CudaEngineOptions::default()
    };
    let mut rng = ChaCha8Rng::seed_from_u64(31);
    let graphs: Vec<InputGraph> = (0..7)
        .map(|i| {
            random_tree(
                &mut rng,
                1 + i * 2,
                &[1, 2, 3],
                VOCAB as u32,
                CLASSES as i32,
            )
            .expect("tree")
        })
        .collect();
    // the pulled inputs are the graphs' own features; the CPU engine also
    // gets them as explicit pull values (by vertex number), which must agree
    let graphs: Vec<InputGraph> = graphs
        .into_iter()
        .map(|mut g| {
            let data = (0..g.len() * S)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            g.set_features(S, data).expect("features");
            g
        })
        .collect();
    for m in cases() {
        let batch =
            Batch::new(&m, graphs.iter().collect(), BatchingPolicy::Cavs).expect("schedule");
        let params: Params<f32> = Params::init(&m, 8);
        let mut cpu = CpuEngine::<f32>::new();
        let want = cpu
            .forward(&m, &params, &batch, Mode::Train)
            .expect("cpu forward");
        let mut explicit = CpuEngine::<f32>::new();
        explicit.set_pull_values(Some(batch.schedule.features.clone()));
        let same = explicit
            .forward(&m, &params, &batch, Mode::Train)
            .expect("cpu forward with pull values");
        assert_eq!(same.loss, want.loss, "{}: features vs pull values", m.name);
        let mut g0 = Grads::zeros(&m);
        cpu.backward(&m, &params, &batch, &mut g0)
            .expect("cpu backward");
        if !device {
            continue;
        }
        let mut cuda = CudaEngine::new(&m, &opts).expect("engine");
        let got =
            CudaEngine::forward(&mut cuda, &m, &params, &batch, Mode::Train).expect("cuda forward");
        let name = &m.name;
        let (l0, l1) = (want.loss.unwrap_or(f64::NAN), got.loss.unwrap_or(f64::NAN));
        assert!(
            (l0 - l1).abs() <= 1e-4 * l0.abs().max(1e-3),
            "{name}: loss CPU {l0} vs CUDA {l1}"
        );
        for (i, (x, y)) in want.logits.iter().zip(&got.logits).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4 * x.abs() + 1e-5,
                "{name}: score {i} CPU {x} vs CUDA {y}"
            );
        }
        let mut g1 = Grads::zeros(&m);
        CudaEngine::backward(&mut cuda, &m, &params, &batch, &mut g1).expect("cuda backward");
        assert!(g0.norm() > 0.0, "{name}: the gradient vanished");
        for (p, spec) in m.params.iter().enumerate() {
            let (a, b) = (g0.values[p].data(), g1.values[p].data());
            let scale = a.iter().fold(0f32, |s, x| s.max(x.abs()));
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
