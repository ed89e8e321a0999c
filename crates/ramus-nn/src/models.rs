//! The model zoo, each declared once through the Cavs API:
//! * `treelstm` — the reference benchmark model: child-sum Tree-LSTM, root
//!   loss, parameters named and shaped exactly as in the PyTorch anchor
//!   (`shared/bench/torch_treelstm.py`);
//! * `treelstm-nary` — Tai et al.'s binary (N-ary, N = 2) constituency
//!   Tree-LSTM with a loss at every labelled node;
//! * `treefc` — TF Fold's Tree-FC benchmark cell `h = tanh(W [h_l; h_r] + b)`;
//! * `treegru` — a child-sum TreeGRU (Cortex's two-stage cell: its
//!   candidate state is a product of the reset-gated child sum);
//! * `mvrnn` — Socher et al.'s (2012) matrix-vector RNN: every word and
//!   phrase is a vector and a matrix, composed through each other
//!   ([`build_mvrnn`] documents the state layout and the word matrices);
//! * `dagrnn` — a DAG-RNN (Cortex's DAG benchmark cell)
//!   `h = tanh(W x + U Σ_p h_p + b)` over a vertex's predecessors `p`;
//! * `lstm-lm` — an LSTM language model over sentences as chains;
//! * `bilstm-tagger`, `bilstm-char-tagger`, `td-rnn`, `td-lstm`, `rvnn` —
//!   the other benchmarks of VPPS §IV-E ([`crate::sequence_models`]);
//! * `alexnet`, `vgg` (`vgg11` ... `vgg19`), `resnet` — CNNs over images as
//!   single-vertex graphs ([`crate::vision`]).

use ramus_core::model::{FunctionSelector, HeadRows, Init, ModelBuilder};
use ramus_core::{Model, Result};

use crate::blocks::{
    binary_lstm_internal, binary_tanh_internal, classifier_head, linear_bias, lstm_cell_out,
    lstm_leaf, lstm_step, record_settings, tanh_leaf,
};
pub use crate::blocks::{ModelConfig, ModelOptions};
use crate::sequence_models::{build_sequence_model, is_sequence_model, SequenceConfig};
use crate::vision::{build_vision_model, is_vision_model, VisionConfig};

/// What kind of data a model reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataKind {
    /// Labelled PTB-bracket trees (SST format).
    Trees,
    /// Plain-text sentences, one per line, as chains.
    Sentences,
    /// Labelled images as single-vertex graphs with pixel features (the
    /// built-in synthetic images, `ramus_graph::images`).
    Images,
    /// Tagged sentences (`word|TAG ...`, WikiNER) as tagger graphs
    /// (`ramus_graph::tagged`); with `chars`, rare words are spelled out
    /// for character LSTMs.
    Tagged { chars: bool },
    /// Labelled PTB-bracket trees read as the time-delay pyramid over their
    /// leaves, labelled with the root label (`ramus_graph::sequence::pyramid_of_tree`).
    SentencePyramid,
}

/// Names accepted by [`build_model`].
pub const MODEL_NAMES: [&str; 19] = [
    "treelstm",
    "treelstm-nary",
    "treefc",
    "treegru",
    "mvrnn",
    "dagrnn",
    "lstm-lm",
    "bilstm-tagger",
    "bilstm-char-tagger",
    "td-rnn",
    "td-lstm",
    "rvnn",
    "alexnet",
    "vgg",
    "vgg11",
    "vgg13",
    "vgg16",
    "vgg19",
    "resnet",
];

/// The data a model reads.
pub fn data_kind(name: &str) -> Option<DataKind> {
    match name {
        "treelstm" | "treelstm-nary" | "treefc" | "treegru" | "mvrnn" | "dagrnn" | "rvnn" => {
            Some(DataKind::Trees)
        }
        "lstm-lm" => Some(DataKind::Sentences),
        "bilstm-tagger" => Some(DataKind::Tagged { chars: false }),
        "bilstm-char-tagger" => Some(DataKind::Tagged { chars: true }),
        "td-rnn" | "td-lstm" => Some(DataKind::SentencePyramid),
        _ if is_vision_model(name) => Some(DataKind::Images),
        _ => None,
    }
}

/// Builds model `name` (no dropout).
pub fn build_model(name: &str, cfg: &ModelConfig) -> Result<Model> {
    build_model_with(name, cfg, &ModelOptions::default())
}

/// Builds model `name` with training options (CNN models with the default
/// [`VisionConfig`]: 3×32×32 images, VGG-11, ResNet blocks `[1, 1, 1]`; see
/// [`build_vision_model`] for others; sequence models with the default
/// [`SequenceConfig`], which `bilstm-char-tagger` cannot use: it needs its
/// character vocabulary size, see [`build_sequence_model`]).
pub fn build_model_with(name: &str, cfg: &ModelConfig, opts: &ModelOptions) -> Result<Model> {
    if is_vision_model(name) {
        return build_vision_model(name, cfg, &VisionConfig::default(), opts);
    }
    if is_sequence_model(name) {
        return build_sequence_model(name, cfg, &SequenceConfig::default(), opts);
    }
    let p = opts.dropout;
    let mut model = match name {
        "treelstm" => reference_treelstm(cfg, p),
        "treelstm-nary" => nary_treelstm(cfg, p),
        "treefc" => tree_fc(cfg, p),
        "dagrnn" => dag_rnn(cfg, p),
        "treegru" => tree_gru(cfg, p),
        "mvrnn" => mv_rnn(cfg, MVRNN_MATRIX_WORDS, p),
        "lstm-lm" => lstm_lm(cfg, p),
        _ => {
            return Err(ramus_core::CoreError::Unknown {
                kind: "model",
                name: name.to_string(),
                hint: format!(" (known: {})", MODEL_NAMES.join(", ")),
            })
        }
    }?;
    record_settings(&mut model, name, cfg);
    Ok(model)
}

/// The reference child-sum Tree-LSTM (see the module docs). State = `[h; c]`.
fn reference_treelstm(cfg: &ModelConfig, dropout: f64) -> Result<Model> {
    let (v, hd, k) = (cfg.vocab, cfg.hidden, cfg.classes);
    let mut m = ModelBuilder::new("treelstm", 2 * hd);
    let emb = m.param("emb", &[v, hd], Init::Normal { std: 1.0 });
    let w_iou = m.param("W_iou", &[3 * hd, hd], Init::LinearDefault);
    let u_iou = m.param("U_iou", &[3 * hd, hd], Init::LinearDefault);
    let b_iou = m.param("b_iou", &[3 * hd], Init::Zeros);
    let u_f = m.param("U_f", &[hd, hd], Init::LinearDefault);
    let b_f = m.param("b_f", &[hd], Init::Zeros);
    let w_out = m.param("W_out", &[k, hd], Init::LinearDefault);
    let b_out = m.param("b_out", &[k], linear_bias(hd));
    let leaf = lstm_leaf(&mut m, emb, w_iou, b_iou, dropout)?;
    let internal = m.vertex_fn("internal", |f| {
        let kids = f.gather_all();
        let h_k = f.slice(kids, 0, hd);
        let c_k = f.slice(kids, hd, hd);
        let h_sum = f.sum_children(h_k);
        let (u, b) = (f.param(u_iou), f.param(b_iou));
        let iou = f.linear(h_sum, u, Some(b));
        let (uf, bf) = (f.param(u_f), f.param(b_f));
        let f_pre = f.linear(h_k, uf, Some(bf));
        let f_k = f.sigmoid(f_pre);
        let fc = f.mul(f_k, c_k);
        let fc_sum = f.sum_children(fc);
        let (h, c) = lstm_cell_out(f, iou, Some(fc_sum));
        let state = f.concat(&[h, c]);
        f.scatter(state);
        f.push(h);
    })?;
    m.select(FunctionSelector::LeafInternal { leaf, internal });
    m.head(HeadRows::Roots, hd, |h| {
        classifier_head(h, w_out, b_out, dropout)
    })?;
    m.build()
}

/// Binary constituency Tree-LSTM (Tai et al. 2015, N-ary with N = 2) with
/// a loss at every labelled node. State = `[h; c]`.
fn nary_treelstm(cfg: &ModelConfig, dropout: f64) -> Result<Model> {
    let (v, hd, k) = (cfg.vocab, cfg.hidden, cfg.classes);
    let mut m = ModelBuilder::new("treelstm-nary", 2 * hd);
    let emb = m.param("emb", &[v, hd], Init::Normal { std: 0.1 });
    let w_iou = m.param("W_iou", &[3 * hd, hd], Init::LinearDefault);
    let b_leaf = m.param("b_leaf", &[3 * hd], Init::Zeros);
    let u_iou = m.param("U_iou", &[3 * hd, 2 * hd], Init::LinearDefault);
    let b_iou = m.param("b_iou", &[3 * hd], Init::Zeros);
    let u_f = m.param("U_f", &[2 * hd, 2 * hd], Init::LinearDefault);
    let b_f = m.param("b_f", &[2 * hd], Init::Zeros);
    let w_out = m.param("W_out", &[k, hd], Init::LinearDefault);
    let b_out = m.param("b_out", &[k], linear_bias(hd));
    let leaf = lstm_leaf(&mut m, emb, w_iou, b_leaf, dropout)?;
    let internal = binary_lstm_internal(&mut m, hd, [u_iou, b_iou, u_f, b_f])?;
    m.select(FunctionSelector::LeafInternal { leaf, internal });
    m.head(HeadRows::Labelled, hd, |h| {
        classifier_head(h, w_out, b_out, dropout)
    })?;
    m.build()
}

/// Tree-FC: leaves are word vectors, internal nodes `tanh(W [h_l; h_r] + b)`.
fn tree_fc(cfg: &ModelConfig, dropout: f64) -> Result<Model> {
    let (v, hd, k) = (cfg.vocab, cfg.hidden, cfg.classes);
    let mut m = ModelBuilder::new("treefc", hd);
    let emb = m.param("emb", &[v, hd], Init::Normal { std: 0.1 });
    let w = m.param("W", &[hd, 2 * hd], Init::Xavier);
    let b = m.param("b", &[hd], Init::Zeros);
    let w_out = m.param("W_out", &[k, hd], Init::LinearDefault);
    let b_out = m.param("b_out", &[k], linear_bias(hd));
    let leaf = m.vertex_fn("leaf", |f| {
        let x = f.embed(emb);
        let x = f.dropout(x, dropout);
        let h = f.tanh(x);
        f.scatter(h);
        f.push(h);
    })?;
    let internal = binary_tanh_internal(&mut m, w, b)?;
    m.select(FunctionSelector::LeafInternal { leaf, internal });
    m.head(HeadRows::Roots, hd, |h| {
        classifier_head(h, w_out, b_out, dropout)
    })?;
    m.build()
}

/// Child-sum TreeGRU: a leaf is `h = tanh(W x + b)` on its (dropped-out)
/// word vector; an internal vertex with children `h_k` computes
/// `h̃ = Σ_k h_k`, `z = σ(U_z h̃ + b_z)`, `r_k = σ(U_r h_k + b_r)`,
/// `ĥ = tanh(U_h Σ_k (r_k ⊙ h_k) + b_h)` and `h = z ⊙ h̃ + (1 − z) ⊙ ĥ`.
/// Root loss.
fn tree_gru(cfg: &ModelConfig, dropout: f64) -> Result<Model> {
    let (v, hd, k) = (cfg.vocab, cfg.hidden, cfg.classes);
    let mut m = ModelBuilder::new("treegru", hd);
    let emb = m.param("emb", &[v, hd], Init::Normal { std: 0.1 });
    let w = m.param("W", &[hd, hd], Init::Xavier);
    let b = m.param("b", &[hd], Init::Zeros);
    let u_z = m.param("U_z", &[hd, hd], Init::Xavier);
    let b_z = m.param("b_z", &[hd], Init::Zeros);
    let u_r = m.param("U_r", &[hd, hd], Init::Xavier);
    let b_r = m.param("b_r", &[hd], Init::Zeros);
    let u_h = m.param("U_h", &[hd, hd], Init::Xavier);
    let b_h = m.param("b_h", &[hd], Init::Zeros);
    let w_out = m.param("W_out", &[k, hd], Init::LinearDefault);
    let b_out = m.param("b_out", &[k], linear_bias(hd));
    let leaf = tanh_leaf(&mut m, emb, w, b, dropout)?;
    let internal = m.vertex_fn("internal", |f| {
        let kids = f.gather_all();
        let h_sum = f.sum_children(kids);
        let (uz, bz) = (f.param(u_z), f.param(b_z));
        let z_pre = f.linear(h_sum, uz, Some(bz));
        let z = f.sigmoid(z_pre);
        let (ur, br) = (f.param(u_r), f.param(b_r));
        let r_pre = f.linear(kids, ur, Some(br));
        let r = f.sigmoid(r_pre);
        let gated = f.mul(r, kids);
        let gated_sum = f.sum_children(gated);
        let (uh, bh) = (f.param(u_h), f.param(b_h));
        let cand_pre = f.linear(gated_sum, uh, Some(bh));
        let cand = f.tanh(cand_pre);
        let keep = f.mul(z, h_sum);
        let one_minus_z = f.rsub_scalar(z, 1.0);
        let update = f.mul(one_minus_z, cand);
        let h = f.add(keep, update);
        f.scatter(h);
        f.push(h);
    })?;
    m.select(FunctionSelector::LeafInternal { leaf, internal });
    m.head(HeadRows::Roots, hd, |h| {
        classifier_head(h, w_out, b_out, dropout)
    })?;
    m.build()
}

/// Words with a matrix of their own in `mvrnn` ([`build_mvrnn`]): token ids
/// below this (or the whole vocabulary, if smaller) get one; the rest share
/// the unknown word's (id 0). A matrix is `hidden²` floats, so a matrix
/// per word of SST's ≈ 21 700 words would take 1.4 GB at hidden 128
/// (three times that with Adam's moments); a thousand take 65 MB. Readers
/// number words in first-seen order, so the words with a matrix are the
/// ones met first in the training data — mostly the frequent ones.
pub const MVRNN_MATRIX_WORDS: usize = 1000;

/// Builds `mvrnn` with word matrices for the first `matrix_words` token ids
/// (see [`MVRNN_MATRIX_WORDS`]).
///
/// MV-RNN (Socher et al. 2012): a word is a vector `a ∈ R^n` (an embedding
/// row) and a matrix `A ∈ R^{n×n}` (a row of `word_matrices`, tokens at or
/// beyond `matrix_words` reading the unknown word's, row 0; each starts as
/// the identity plus noise). A parent of children `(a, A)` and `(b, B)` is
/// `p = tanh(W [B a; A b] + b_W)` and `P = W_M [A; B]`; `W_M` is held
/// transposed (`W_Mᵀ`, `[2n, n]`, starting at `[I; I]·½` plus noise so a
/// phrase matrix starts as the mean of its children's). The vertex state
/// is one row `[p; vec(P)]` of `n + n²` columns (`P` row-major); the head
/// classifies each root's `p` (a leaf pushes its word vector).
pub fn build_mvrnn(cfg: &ModelConfig, matrix_words: usize, opts: &ModelOptions) -> Result<Model> {
    let mut model = mv_rnn(cfg, matrix_words, opts.dropout)?;
    record_settings(&mut model, "mvrnn", cfg);
    Ok(model)
}

fn mv_rnn(cfg: &ModelConfig, matrix_words: usize, dropout: f64) -> Result<Model> {
    use ramus_core::ops::RowMatMul;
    let (v, n, k) = (cfg.vocab, cfg.hidden, cfg.classes);
    let words = matrix_words.min(v).max(1);
    let mut m = ModelBuilder::new("mvrnn", n + n * n);
    m.setting("matrix_words", words);
    let emb = m.param("emb", &[v, n], Init::Normal { std: 0.1 });
    let mats = m.param(
        "word_matrices",
        &[words, n * n],
        Init::Identity {
            n,
            scale: 1.0,
            std: 0.01,
        },
    );
    let w = m.param("W", &[n, 2 * n], Init::Xavier);
    let b = m.param("b", &[n], Init::Zeros);
    let w_m = m.param(
        "W_M_t",
        &[2 * n, n],
        Init::Identity {
            n,
            scale: 0.5,
            std: 0.01,
        },
    );
    let w_out = m.param("W_out", &[k, n], Init::LinearDefault);
    let b_out = m.param("b_out", &[k], linear_bias(n));
    let leaf = m.vertex_fn("leaf", |f| {
        let x = f.embed(emb);
        let x = f.dropout(x, dropout);
        let a = f.embed_unk(mats);
        let state = f.concat(&[x, a]);
        f.scatter(state);
        f.push(x);
    })?;
    let internal = m.vertex_fn("internal", |f| {
        let (l, r) = (f.gather(0), f.gather(1));
        let (a, a_mat) = (f.slice(l, 0, n), f.slice(l, n, n * n));
        let (b_vec, b_mat) = (f.slice(r, 0, n), f.slice(r, n, n * n));
        let matvec = RowMatMul::new(n, n, 1);
        let ba = f.row_matmul(b_mat, a, matvec);
        let ab = f.row_matmul(a_mat, b_vec, matvec);
        let x = f.concat(&[ba, ab]);
        let (wp, bp) = (f.param(w), f.param(b));
        let z = f.linear(x, wp, Some(bp));
        let p = f.tanh(z);
        let stacked = f.concat(&[a_mat, b_mat]);
        let wm = f.param(w_m);
        let p_mat = f.row_matmul(
            wm,
            stacked,
            RowMatMul {
                trans_a: true,
                ..RowMatMul::new(n, 2 * n, n)
            },
        );
        let state = f.concat(&[p, p_mat]);
        f.scatter(state);
        f.push(p);
    })?;
    m.select(FunctionSelector::LeafInternal { leaf, internal });
    m.head(HeadRows::Roots, n, |h| {
        classifier_head(h, w_out, b_out, dropout)
    })?;
    m.build()
}

/// DAG-RNN: one function for every vertex, `h = tanh(W x + U Σ_p h_p + b)`
/// with `x` the vertex's (dropped-out) word vector and `p` its predecessors
/// (children; none for a source vertex). Root loss.
fn dag_rnn(cfg: &ModelConfig, dropout: f64) -> Result<Model> {
    let (v, hd, k) = (cfg.vocab, cfg.hidden, cfg.classes);
    let mut m = ModelBuilder::new("dagrnn", hd);
    let emb = m.param("emb", &[v, hd], Init::Normal { std: 0.1 });
    let w = m.param("W", &[hd, hd], Init::Xavier);
    let u = m.param("U", &[hd, hd], Init::Xavier);
    let b = m.param("b", &[hd], Init::Zeros);
    let w_out = m.param("W_out", &[k, hd], Init::LinearDefault);
    let b_out = m.param("b_out", &[k], linear_bias(hd));
    let cell = m.vertex_fn("cell", |f| {
        let x = f.embed(emb);
        let x = f.dropout(x, dropout);
        let preds = f.gather_all();
        let h_sum = f.sum_children(preds);
        let (wp, up, bp) = (f.param(w), f.param(u), f.param(b));
        let zx = f.linear(x, wp, Some(bp));
        let zh = f.linear(h_sum, up, None);
        let z = f.add(zx, zh);
        let h = f.tanh(z);
        f.scatter(h);
        f.push(h);
    })?;
    m.select(FunctionSelector::Single(cell));
    m.head(HeadRows::Roots, hd, |h| {
        classifier_head(h, w_out, b_out, dropout)
    })?;
    m.build()
}

/// LSTM language model: each chain vertex reads its token and its
/// predecessor's state and predicts the next token (the vertex label).
fn lstm_lm(cfg: &ModelConfig, dropout: f64) -> Result<Model> {
    let (v, hd) = (cfg.vocab, cfg.hidden);
    let mut m = ModelBuilder::new("lstm-lm", 2 * hd);
    let emb = m.param("emb", &[v, hd], Init::Uniform { bound: 0.1 });
    let w_x = m.param("W_x", &[4 * hd, hd], Init::LinearDefault);
    let w_h = m.param("W_h", &[4 * hd, hd], Init::LinearDefault);
    let b = m.param("b", &[4 * hd], Init::Zeros);
    let w_out = m.param("W_out", &[v, hd], Init::LinearDefault);
    let b_out = m.param("b_out", &[v], linear_bias(hd));
    m.vertex_fn("step", |f| {
        let x = f.embed(emb);
        let x = f.dropout(x, dropout);
        let prev = f.gather(0);
        let (h, c) = lstm_step(f, x, prev, hd, [w_x, w_h, b]);
        let state = f.concat(&[h, c]);
        f.scatter(state);
        f.push(h);
    })?;
    m.head(HeadRows::Labelled, hd, |h| {
        classifier_head(h, w_out, b_out, dropout)
    })?;
    m.build()
}
