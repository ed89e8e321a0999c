//! The other dynamic benchmarks of VPPS §IV-E, declared through the Cavs
//! API and trained by the batched engines like every other model:
//!
//! * `bilstm-tagger` — DyNet's BiLSTM named-entity tagger. A sentence is a
//!   tagger graph (`ramus_graph::sequence::tagger_graph`): a forward LSTM
//!   over the word embeddings, a backward LSTM over the reversed sentence,
//!   and per word an output vertex that concatenates `[h_fwd; h_bwd]`; the
//!   head is an MLP (`tanh`, [`SequenceConfig::mlp`] wide) and a softmax
//!   over tags with a loss at every word (`HeadRows::Labelled`).
//! * `bilstm-char-tagger` — the same, but a rare word (one outside the word
//!   vocabulary, i.e. seen fewer than 5 times in training:
//!   `ramus_graph::tagged`) is read as the concatenated final states of a
//!   forward and a backward character LSTM over its characters (character
//!   embeddings [`SequenceConfig::char_embed`] wide, each character LSTM
//!   `hidden / 2` wide so that the two make a word vector).
//! * `td-rnn` — a time-delay network over a sentence's pyramid
//!   (`ramus_graph::sequence::pyramid`): word vertices are embeddings,
//!   every other vertex `h = tanh(W_l a + W_r b + bias)` of its two
//!   children `a`, `b` (one composition function everywhere); an MLP on the
//!   top vertex predicts the sentence label.
//! * `td-lstm` — the same pyramid with the binary Tree-LSTM composition
//!   (left / right forget gates) and LSTM word cells.
//! * `rvnn` — a recursive neural network over the parse tree with untied
//!   leaf and internal weights: leaf `h = tanh(W_leaf x + b_leaf)`,
//!   internal `h = tanh(W [h_l; h_r] + b)`, a linear softmax classifier at
//!   the **root** (`ramus train --loss-at all` moves it to every labelled
//!   node).
//!
//! # Vertex functions by kind
//!
//! The taggers' vertices all have one or two children whatever their role,
//! so they choose their functions with `FunctionSelector::ByKind`: the
//! table's entry `k` runs at vertices of kind `k`
//! (`ramus_graph::sequence::tagger_kinds`). Every function scatters a
//! `2 · hidden` state and pushes a `2 · hidden` value: a word step's state
//! is `[h; c]`, an output vertex's `[h_fwd; h_bwd]` (what the head reads),
//! a character step's `[h; c]` padded with zeros. Only output vertices
//! carry labels, so only they reach the head.

use std::collections::BTreeMap;

use ramus_core::model::{FunctionSelector, HeadBuilder, HeadRows, Init, ModelBuilder};
use ramus_core::{CoreError, Model, Result};
use ramus_graph::sequence::tagger_kinds;

use crate::blocks::{
    binary_lstm_internal, binary_tanh_internal, classifier_head, linear_bias, lstm_leaf, lstm_step,
    record_settings, tanh_leaf, ModelConfig, ModelOptions,
};

/// Names of the models of this module.
pub const SEQUENCE_MODELS: [&str; 5] = [
    "bilstm-tagger",
    "bilstm-char-tagger",
    "td-rnn",
    "td-lstm",
    "rvnn",
];

/// True for a model of this module.
pub fn is_sequence_model(name: &str) -> bool {
    SEQUENCE_MODELS.contains(&name)
}

/// Sizes of the sequence models beyond [`ModelConfig`] (where `hidden` is
/// the LSTM / composition width and the word-embedding width).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SequenceConfig {
    /// Hidden width of the MLP heads of the taggers and the time-delay
    /// networks (VPPS: 256).
    pub mlp: usize,
    /// Character-embedding width of `bilstm-char-tagger` (VPPS: 64).
    pub char_embed: usize,
    /// Character vocabulary size of `bilstm-char-tagger` (0: unknown, an
    /// error for that model).
    pub chars: usize,
}

impl Default for SequenceConfig {
    fn default() -> Self {
        SequenceConfig {
            mlp: 256,
            char_embed: 64,
            chars: 0,
        }
    }
}

impl SequenceConfig {
    /// Reads the settings [`build_sequence_model`] records (`mlp`,
    /// `char_embed`, `chars`); missing ones keep their defaults.
    pub fn from_settings(settings: &BTreeMap<String, String>) -> std::result::Result<Self, String> {
        let mut c = SequenceConfig::default();
        for (key, slot) in [
            ("mlp", &mut c.mlp),
            ("char_embed", &mut c.char_embed),
            ("chars", &mut c.chars),
        ] {
            if let Some(s) = settings.get(key) {
                *slot = s
                    .parse()
                    .map_err(|_| format!("setting `{key}` = `{s}` is not a number"))?;
            }
        }
        Ok(c)
    }
}

/// Builds sequence model `name` and records its sizes in the settings.
pub fn build_sequence_model(
    name: &str,
    cfg: &ModelConfig,
    seq: &SequenceConfig,
    opts: &ModelOptions,
) -> Result<Model> {
    let err = |message: String| CoreError::Model {
        model: name.to_string(),
        message,
    };
    if cfg.hidden == 0 || cfg.vocab == 0 || cfg.classes == 0 {
        return Err(err(format!(
            "hidden ({}), vocabulary ({}) and classes ({}) must all be at least 1",
            cfg.hidden, cfg.vocab, cfg.classes
        )));
    }
    let uses_mlp = matches!(
        name,
        "bilstm-tagger" | "bilstm-char-tagger" | "td-rnn" | "td-lstm"
    );
    if uses_mlp && seq.mlp == 0 {
        return Err(err("the MLP width must be at least 1".into()));
    }
    let p = opts.dropout;
    let mut model = match name {
        "bilstm-tagger" => bilstm_tagger(cfg, seq, p, false),
        "bilstm-char-tagger" => {
            if !cfg.hidden.is_multiple_of(2) {
                return Err(err(format!(
                    "the hidden size must be even (each character LSTM is hidden / 2 wide), got {}",
                    cfg.hidden
                )));
            }
            if seq.chars == 0 || seq.char_embed == 0 {
                return Err(err(format!(
                    "needs a character vocabulary and character embeddings (chars {}, char_embed {})",
                    seq.chars, seq.char_embed
                )));
            }
            bilstm_tagger(cfg, seq, p, true)
        }
        "td-rnn" => td_rnn(cfg, seq, p),
        "td-lstm" => td_lstm(cfg, seq, p),
        "rvnn" => rvnn(cfg, p),
        _ => {
            return Err(CoreError::Unknown {
                kind: "sequence model",
                name: name.to_string(),
                hint: format!(" (known: {})", SEQUENCE_MODELS.join(", ")),
            })
        }
    }?;
    record_settings(&mut model, name, cfg);
    if uses_mlp {
        model.settings.insert("mlp".into(), seq.mlp.to_string());
    }
    if name == "bilstm-char-tagger" {
        model
            .settings
            .insert("char_embed".into(), seq.char_embed.to_string());
        model.settings.insert("chars".into(), seq.chars.to_string());
    }
    Ok(model)
}

/// MLP head: `logits = W_out tanh(W_mlp x + b_mlp) + b_out` with dropout
/// on `x`, mean softmax cross-entropy.
fn mlp_head(h: &mut HeadBuilder, params: [usize; 4], dropout: f64) {
    let [w_mlp, b_mlp, w_out, b_out] = params;
    let x = h.input();
    let x = h.dropout(x, dropout);
    let (w, b) = (h.param(w_mlp), h.param(b_mlp));
    let z = h.linear(x, w, Some(b));
    let hidden = h.tanh(z);
    let (w, b) = (h.param(w_out), h.param(b_out));
    let logits = h.linear(hidden, w, Some(b));
    let labels = h.labels();
    let per_row = h.softmax_xent(logits, labels);
    let loss = h.mean_rows(per_row);
    h.loss(loss);
    h.logits(logits);
}

/// Declares the MLP head's parameters for inputs of width `input`.
fn mlp_params(m: &mut ModelBuilder, input: usize, mlp: usize, classes: usize) -> [usize; 4] {
    [
        m.param("W_mlp", &[mlp, input], Init::Xavier),
        m.param("b_mlp", &[mlp], Init::Zeros),
        m.param("W_out", &[classes, mlp], Init::LinearDefault),
        m.param("b_out", &[classes], linear_bias(mlp)),
    ]
}

/// Declares one direction's LSTM weights `prefix.W_x`, `prefix.W_h`,
/// `prefix.b` for inputs of width `input` and `hd` hidden units.
fn lstm_params(m: &mut ModelBuilder, prefix: &str, input: usize, hd: usize) -> [usize; 3] {
    [
        m.param(
            &format!("{prefix}.W_x"),
            &[4 * hd, input],
            Init::LinearDefault,
        ),
        m.param(&format!("{prefix}.W_h"), &[4 * hd, hd], Init::LinearDefault),
        m.param(&format!("{prefix}.b"), &[4 * hd], Init::Zeros),
    ]
}

/// The BiLSTM taggers (see the module docs); `chars` adds the character
/// LSTMs and the word steps that read them.
fn bilstm_tagger(
    cfg: &ModelConfig,
    seq: &SequenceConfig,
    dropout: f64,
    chars: bool,
) -> Result<Model> {
    let (v, hd, k) = (cfg.vocab, cfg.hidden, cfg.classes);
    let name = if chars {
        "bilstm-char-tagger"
    } else {
        "bilstm-tagger"
    };
    let state = 2 * hd;
    let mut m = ModelBuilder::new(name, state);
    let emb = m.param("emb", &[v, hd], Init::Uniform { bound: 0.1 });
    let fwd = lstm_params(&mut m, "fwd", hd, hd);
    let bwd = lstm_params(&mut m, "bwd", hd, hd);
    let head = mlp_params(&mut m, state, seq.mlp, k);
    let mut table = vec![0usize; tagger_kinds::COUNT];
    // word steps on embeddings: child 0 is the previous step
    for (kind, fn_name, w) in [
        (tagger_kinds::FORWARD, "forward", fwd),
        (tagger_kinds::BACKWARD, "backward", bwd),
    ] {
        table[usize::from(kind)] = m.vertex_fn(fn_name, |f| {
            let x = f.embed(emb);
            let x = f.dropout(x, dropout);
            let prev = f.gather(0);
            let (h, c) = lstm_step(f, x, prev, hd, w);
            let s = f.concat(&[h, c]);
            f.scatter(s);
            f.push(s);
        })?;
    }
    table[usize::from(tagger_kinds::OUTPUT)] = m.vertex_fn("output", |f| {
        let (l, r) = (f.gather(0), f.gather(1));
        let (h_f, h_b) = (f.slice(l, 0, hd), f.slice(r, 0, hd));
        let both = f.concat(&[h_f, h_b]);
        f.scatter(both);
        f.push(both);
    })?;
    if chars {
        let hc = hd / 2;
        let char_emb = m.param(
            "char_emb",
            &[seq.chars, seq.char_embed],
            Init::Uniform { bound: 0.1 },
        );
        let cf = lstm_params(&mut m, "char_fwd", seq.char_embed, hc);
        let cb = lstm_params(&mut m, "char_bwd", seq.char_embed, hc);
        for (kind, fn_name, w) in [
            (tagger_kinds::CHAR_FORWARD, "char_forward", cf),
            (tagger_kinds::CHAR_BACKWARD, "char_backward", cb),
        ] {
            table[usize::from(kind)] = m.vertex_fn(fn_name, |f| {
                let x = f.embed(char_emb);
                let prev = f.gather(0);
                let (h, c) = lstm_step(f, x, prev, hc, w);
                let s = f.concat(&[h, c]);
                let s = f.pad(s, 0, state);
                f.scatter(s);
                f.push(s);
            })?;
        }
        // word steps of spelled words: children [char fwd last, char bwd last, previous step]
        for (kind, fn_name, w) in [
            (tagger_kinds::FORWARD_FROM_CHARS, "forward_from_chars", fwd),
            (
                tagger_kinds::BACKWARD_FROM_CHARS,
                "backward_from_chars",
                bwd,
            ),
        ] {
            table[usize::from(kind)] = m.vertex_fn(fn_name, |f| {
                let (a, b) = (f.gather(0), f.gather(1));
                let (h_a, h_b) = (f.slice(a, 0, hc), f.slice(b, 0, hc));
                let x = f.concat(&[h_a, h_b]);
                let x = f.dropout(x, dropout);
                // the first word in its direction has no previous step
                let prev = f.gather_optional(2);
                let (h, c) = lstm_step(f, x, prev, hd, w);
                let s = f.concat(&[h, c]);
                f.scatter(s);
                f.push(s);
            })?;
        }
    } else {
        table.truncate(usize::from(tagger_kinds::OUTPUT) + 1);
    }
    m.select(FunctionSelector::ByKind(table));
    m.head(HeadRows::Labelled, state, |h| mlp_head(h, head, dropout))?;
    m.build()
}

/// TD-RNN over a pyramid: word vertices are their (dropped-out)
/// embeddings, every other vertex `tanh(W_l a + W_r b + bias)`; MLP head
/// on the top vertex.
fn td_rnn(cfg: &ModelConfig, seq: &SequenceConfig, dropout: f64) -> Result<Model> {
    let (v, hd, k) = (cfg.vocab, cfg.hidden, cfg.classes);
    let mut m = ModelBuilder::new("td-rnn", hd);
    let emb = m.param("emb", &[v, hd], Init::Normal { std: 0.1 });
    let w_l = m.param("W_l", &[hd, hd], Init::Xavier);
    let w_r = m.param("W_r", &[hd, hd], Init::Xavier);
    let b = m.param("b", &[hd], Init::Zeros);
    let head = mlp_params(&mut m, hd, seq.mlp, k);
    let leaf = m.vertex_fn("word", |f| {
        let x = f.embed(emb);
        let x = f.dropout(x, dropout);
        f.scatter(x);
        f.push(x);
    })?;
    let internal = m.vertex_fn("compose", |f| {
        let (a, c) = (f.gather(0), f.gather(1));
        let (wl, wr, bb) = (f.param(w_l), f.param(w_r), f.param(b));
        let za = f.linear(a, wl, Some(bb));
        let zc = f.linear(c, wr, None);
        let z = f.add(za, zc);
        let h = f.tanh(z);
        f.scatter(h);
        f.push(h);
    })?;
    m.select(FunctionSelector::LeafInternal { leaf, internal });
    m.head(HeadRows::Roots, hd, |h| mlp_head(h, head, dropout))?;
    m.build()
}

/// TD-LSTM over a pyramid: LSTM word cells and the binary Tree-LSTM
/// composition (states `[h; c]`); MLP head on the top vertex's `h`.
fn td_lstm(cfg: &ModelConfig, seq: &SequenceConfig, dropout: f64) -> Result<Model> {
    let (v, hd, k) = (cfg.vocab, cfg.hidden, cfg.classes);
    let mut m = ModelBuilder::new("td-lstm", 2 * hd);
    let emb = m.param("emb", &[v, hd], Init::Normal { std: 0.1 });
    let w_iou = m.param("W_iou", &[3 * hd, hd], Init::LinearDefault);
    let b_leaf = m.param("b_leaf", &[3 * hd], Init::Zeros);
    let u_iou = m.param("U_iou", &[3 * hd, 2 * hd], Init::LinearDefault);
    let b_iou = m.param("b_iou", &[3 * hd], Init::Zeros);
    let u_f = m.param("U_f", &[2 * hd, 2 * hd], Init::LinearDefault);
    let b_f = m.param("b_f", &[2 * hd], Init::Zeros);
    let head = mlp_params(&mut m, hd, seq.mlp, k);
    let leaf = lstm_leaf(&mut m, emb, w_iou, b_leaf, dropout)?;
    let internal = binary_lstm_internal(&mut m, hd, [u_iou, b_iou, u_f, b_f])?;
    m.select(FunctionSelector::LeafInternal { leaf, internal });
    m.head(HeadRows::Roots, hd, |h| mlp_head(h, head, dropout))?;
    m.build()
}

/// RvNN with untied leaf and internal weights (see the module docs); a
/// linear softmax classifier at the root.
fn rvnn(cfg: &ModelConfig, dropout: f64) -> Result<Model> {
    let (v, hd, k) = (cfg.vocab, cfg.hidden, cfg.classes);
    let mut m = ModelBuilder::new("rvnn", hd);
    let emb = m.param("emb", &[v, hd], Init::Normal { std: 0.1 });
    let w_leaf = m.param("W_leaf", &[hd, hd], Init::Xavier);
    let b_leaf = m.param("b_leaf", &[hd], Init::Zeros);
    let w = m.param("W", &[hd, 2 * hd], Init::Xavier);
    let b = m.param("b", &[hd], Init::Zeros);
    let w_out = m.param("W_out", &[k, hd], Init::LinearDefault);
    let b_out = m.param("b_out", &[k], linear_bias(hd));
    let leaf = tanh_leaf(&mut m, emb, w_leaf, b_leaf, dropout)?;
    let internal = binary_tanh_internal(&mut m, w, b)?;
    m.select(FunctionSelector::LeafInternal { leaf, internal });
    m.head(HeadRows::Roots, hd, |h| {
        classifier_head(h, w_out, b_out, dropout)
    })?;
    m.build()
}
