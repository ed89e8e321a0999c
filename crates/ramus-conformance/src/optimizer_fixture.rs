//! Deterministic data for the CUDA device optimizer's tests, shared by its
//! unit tests (`ramus-cuda/src/optimizer/tests.rs`) and its integration
//! tests (`ramus-cuda/tests/optimizer.rs`): a small tree model with two
//! embedding tables between dense parameters, each step's gradients and
//! touched rows, and the host reference's view of them. Only `ramus_core`
//! and `ramus_exec` types appear, so that the unit tests (another build of
//! `ramus-cuda`) can use it too.

use ramus_core::model::{FunctionSelector, HeadRows, Init, ModelBuilder};
use ramus_core::{Grads, Model, Params, Tensor};
use ramus_exec::{OptimizerConfig, OptimizerKind};

pub use crate::fixtures::values;
use crate::fixtures::{binary_cell, softmax_head};

/// Parameters `W, emb (table), b, W_out, tags (table), W_leaf` of a small
/// tree model: the tables split the dense parameters into three runs.
pub fn test_model() -> Model {
    let h = 6;
    let mut m = ModelBuilder::new("optimizer-test", h);
    let w = m.param("W", &[h, 2 * h], Init::Xavier);
    let emb = m.param("emb", &[40, h], Init::Normal { std: 0.5 });
    let b = m.param("b", &[h], Init::Uniform { bound: 0.5 });
    let w_out = m.param("W_out", &[5, h], Init::LinearDefault);
    let tags = m.param("tags", &[30, 4], Init::Normal { std: 0.5 });
    let w_leaf = m.param("W_leaf", &[h, h + 4], Init::Xavier);
    let leaf = m
        .vertex_fn("leaf", |f| {
            let x = f.embed(emb);
            let t = f.embed(tags);
            let xt = f.concat(&[x, t]);
            let w = f.param(w_leaf);
            let z = f.linear(xt, w, None);
            let y = f.tanh(z);
            f.scatter(y);
            f.push(y);
        })
        .expect("leaf function");
    let internal = m
        .vertex_fn("internal", |f| binary_cell(f, w, Some(b), |f, z| f.tanh(z)))
        .expect("internal function");
    m.select(FunctionSelector::LeafInternal { leaf, internal });
    m.head(HeadRows::Roots, h, |hd| softmax_head(hd, w_out))
        .expect("head");
    m.build().expect("the test model builds")
}

/// The row-gradient parameters of [`test_model`].
pub const TABLES: [usize; 2] = [1, 4];
/// How many steps the comparisons with the host take.
pub const STEPS: u64 = 5;

/// Step `step`'s gradients (every element, untouched table rows included:
/// both sides must ignore them) and touched rows per table, unsorted, in
/// the order the device gets them; the tags table also names row 30, past
/// its end, which both sides skip, and step 3 touches no tags row at all.
pub fn step_data(model: &Model, step: u64) -> (Vec<Vec<f32>>, Vec<Vec<u32>>) {
    let grads = model
        .params
        .iter()
        .enumerate()
        .map(|(p, spec)| values(spec.shape.iter().product(), step * 100 + p as u64))
        .collect();
    let pick = |rows: u32, seed: u64, count: usize| -> Vec<u32> {
        let mut out = Vec::new();
        for x in values(4 * count, seed) {
            let r = ((x + 1.0) * 0.5 * rows as f32) as u32 % rows;
            if !out.contains(&r) && out.len() < count {
                out.push(r);
            }
        }
        out
    };
    let emb = pick(40, step * 7 + 1, 9);
    let tags = if step == 3 {
        Vec::new()
    } else {
        let mut t = pick(30, step * 7 + 2, 5);
        t.insert(1, 30);
        t
    };
    (grads, vec![emb, tags])
}

/// The host reference's gradients for step data.
pub fn host_grads(model: &Model, grads: &[Vec<f32>], touched: &[Vec<u32>]) -> Grads<f32> {
    let mut g = Grads::zeros(model);
    for (p, data) in grads.iter().enumerate() {
        g.values[p] = Tensor::from_vec(&model.params[p].shape, data.clone()).expect("shape");
        match TABLES.iter().position(|&t| t == p) {
            None => g.mark_dense(p),
            Some(t) => touched[t].iter().for_each(|&r| g.mark_row(p, r)),
        }
    }
    g.finish_rows();
    g
}

/// Every parameter's values, in declaration order.
pub fn flat(params: &Params<f32>) -> Vec<f32> {
    params
        .values
        .iter()
        .flat_map(|t| t.data().iter().copied())
        .collect()
}

pub fn config(
    kind: OptimizerKind,
    lr: f64,
    weight_decay: f64,
    clip: Option<f64>,
) -> OptimizerConfig {
    OptimizerConfig {
        weight_decay,
        clip_norm: clip,
        ..OptimizerConfig::new(kind, lr)
    }
}
