//! Building blocks the model zoo's modules share ([`crate::models`],
//! [`crate::sequence_models`], [`crate::vision`]): the sizes and options a
//! model is built with, the recorded settings, LSTM and tanh cells and the
//! classifier head. A leaf module: it uses none of the zoo's.

use ramus_core::model::{HeadBuilder, Init, ModelBuilder, VertexFnBuilder};
use ramus_core::{Model, Result, Sym};

/// Sizes a model is built with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    /// Vocabulary size (ignored by the CNN models).
    pub vocab: usize,
    /// Hidden size; for the CNN models the width of the first stage
    /// (see [`crate::vision`]).
    pub hidden: usize,
    /// Classes of tree and image models (5 for SST); ignored by the language model.
    pub classes: usize,
}

/// Training-only options that do not change a model's parameters.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ModelOptions {
    /// Dropout rate on word embeddings and on the classifier input (0 = off).
    pub dropout: f64,
}

impl ModelOptions {
    /// Refuses a dropout rate outside [0, 1) (1 would drop everything).
    pub fn validate(&self) -> std::result::Result<(), ramus_exec::ExecError> {
        if self.dropout.is_finite() && (0.0..1.0).contains(&self.dropout) {
            return Ok(());
        }
        Err(ramus_exec::ExecError::InvalidSetting {
            setting: ramus_exec::Setting::Dropout,
            value: self.dropout,
            expected: "in [0, 1)",
        })
    }
}

/// Records the model name and sizes in the settings checkpoints keep.
pub(crate) fn record_settings(model: &mut Model, name: &str, cfg: &ModelConfig) {
    model.settings.insert("model".into(), name.into());
    model.settings.insert("vocab".into(), cfg.vocab.to_string());
    model
        .settings
        .insert("hidden".into(), cfg.hidden.to_string());
    model
        .settings
        .insert("classes".into(), cfg.classes.to_string());
}

/// PyTorch's `nn.Linear` bias initialiser for `fan_in` inputs.
pub(crate) fn linear_bias(fan_in: usize) -> Init {
    Init::Uniform {
        bound: 1.0 / (fan_in as f64).sqrt(),
    }
}

/// `i, o, u` gates from a `[3H]` pre-activation: `c = σ(i)·tanh(u) (+ extra)`,
/// `h = σ(o)·tanh(c)`. Returns `(h, c)`.
pub(crate) fn lstm_cell_out(f: &mut VertexFnBuilder, iou: Sym, c_extra: Option<Sym>) -> (Sym, Sym) {
    let parts = f.split(iou, 3);
    let i = f.sigmoid(parts[0]);
    let o = f.sigmoid(parts[1]);
    let u = f.tanh(parts[2]);
    let mut c = f.mul(i, u);
    if let Some(extra) = c_extra {
        c = f.add(c, extra);
    }
    let tc = f.tanh(c);
    let h = f.mul(o, tc);
    (h, c)
}

/// The Tree-LSTM leaf: `iou = W x + b` on the (dropped-out) word vector,
/// `c = σ(i)·tanh(u)`, `h = σ(o)·tanh(c)`; scatters `[h; c]`, pushes `h`.
pub(crate) fn lstm_leaf(
    m: &mut ModelBuilder,
    emb: usize,
    w_iou: usize,
    b: usize,
    dropout: f64,
) -> Result<usize> {
    m.vertex_fn("leaf", |f| {
        let x = f.embed(emb);
        let x = f.dropout(x, dropout);
        let (w, b) = (f.param(w_iou), f.param(b));
        let iou = f.linear(x, w, Some(b));
        let (h, c) = lstm_cell_out(f, iou, None);
        let state = f.concat(&[h, c]);
        f.scatter(state);
        f.push(h);
    })
}

/// The binary (N-ary, N = 2) Tree-LSTM composition of Tai et al. over
/// states `[h; c]` of width `2 hd`: `iou = U_iou [h_l; h_r] + b_iou`, one
/// forget gate per child from `U_f [h_l; h_r] + b_f`, `c = σ(i)·tanh(u) +
/// f_l·c_l + f_r·c_r`, `h = σ(o)·tanh(c)`; scatters `[h; c]`, pushes `h`.
/// `params` are `[U_iou (3hd × 2hd), b_iou, U_f (2hd × 2hd), b_f]`.
pub(crate) fn binary_lstm_internal(
    m: &mut ModelBuilder,
    hd: usize,
    params: [usize; 4],
) -> Result<usize> {
    let [u_iou, b_iou, u_f, b_f] = params;
    m.vertex_fn("internal", |f| {
        let (l, r) = (f.gather(0), f.gather(1));
        let (h_l, c_l) = (f.slice(l, 0, hd), f.slice(l, hd, hd));
        let (h_r, c_r) = (f.slice(r, 0, hd), f.slice(r, hd, hd));
        let hlr = f.concat(&[h_l, h_r]);
        let (u, b) = (f.param(u_iou), f.param(b_iou));
        let iou = f.linear(hlr, u, Some(b));
        let (uf, bf) = (f.param(u_f), f.param(b_f));
        let f_pre = f.linear(hlr, uf, Some(bf));
        let gates = f.sigmoid(f_pre);
        let (f_l, f_r) = (f.slice(gates, 0, hd), f.slice(gates, hd, hd));
        let fl_c = f.mul(f_l, c_l);
        let fr_c = f.mul(f_r, c_r);
        let extra = f.add(fl_c, fr_c);
        let (h, c) = lstm_cell_out(f, iou, Some(extra));
        let state = f.concat(&[h, c]);
        f.scatter(state);
        f.push(h);
    })
}

/// One step of a chain LSTM: gates `W_x x + W_h h_prev + b` split into
/// `i, f, o, u`, `c = σ(f)·c_prev + σ(i)·tanh(u)`, `h = σ(o)·tanh(c)`,
/// where `prev` is the predecessor's state row holding `[h_prev; c_prev]`
/// in its first `2 hd` columns (zeros without a predecessor). `params` are
/// `[W_x (4hd × in), W_h (4hd × hd), b (4hd)]`. Returns `(h, c)`.
pub(crate) fn lstm_step(
    f: &mut VertexFnBuilder,
    x: Sym,
    prev: Sym,
    hd: usize,
    params: [usize; 3],
) -> (Sym, Sym) {
    let [w_x, w_h, b] = params;
    let (h_prev, c_prev) = (f.slice(prev, 0, hd), f.slice(prev, hd, hd));
    let (wx, wh, bb) = (f.param(w_x), f.param(w_h), f.param(b));
    let zx = f.linear(x, wx, Some(bb));
    let zh = f.linear(h_prev, wh, None);
    let z = f.add(zx, zh);
    let g = f.split(z, 4);
    let i = f.sigmoid(g[0]);
    let fg = f.sigmoid(g[1]);
    let o = f.sigmoid(g[2]);
    let u = f.tanh(g[3]);
    let keep = f.mul(fg, c_prev);
    let write = f.mul(i, u);
    let c = f.add(keep, write);
    let tc = f.tanh(c);
    let h = f.mul(o, tc);
    (h, c)
}

/// A leaf `h = tanh(W x + b)` on its (dropped-out) word vector; scatters
/// and pushes `h`.
pub(crate) fn tanh_leaf(
    m: &mut ModelBuilder,
    emb: usize,
    w: usize,
    b: usize,
    dropout: f64,
) -> Result<usize> {
    m.vertex_fn("leaf", |f| {
        let x = f.embed(emb);
        let x = f.dropout(x, dropout);
        let (wp, bp) = (f.param(w), f.param(b));
        let pre = f.linear(x, wp, Some(bp));
        let h = f.tanh(pre);
        f.scatter(h);
        f.push(h);
    })
}

/// A binary internal vertex `h = tanh(W [h_l; h_r] + b)`; scatters and
/// pushes `h`.
pub(crate) fn binary_tanh_internal(m: &mut ModelBuilder, w: usize, b: usize) -> Result<usize> {
    m.vertex_fn("internal", |f| {
        let (l, r) = (f.gather(0), f.gather(1));
        let lr = f.concat(&[l, r]);
        let (wp, bp) = (f.param(w), f.param(b));
        let z = f.linear(lr, wp, Some(bp));
        let h = f.tanh(z);
        f.scatter(h);
        f.push(h);
    })
}

/// Linear classifier head with mean softmax cross-entropy (and dropout on its input).
pub(crate) fn classifier_head(h: &mut HeadBuilder, w_out: usize, b_out: usize, dropout: f64) {
    let x = h.input();
    let x = h.dropout(x, dropout);
    let (w, b) = (h.param(w_out), h.param(b_out));
    let logits = h.linear(x, w, Some(b));
    let labels = h.labels();
    let per_row = h.softmax_xent(logits, labels);
    let loss = h.mean_rows(per_row);
    h.loss(loss);
    h.logits(logits);
}
