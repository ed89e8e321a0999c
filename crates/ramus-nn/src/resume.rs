//! Resumable checkpoints: a plain checkpoint (the parameters under their
//! own names, so `eval` and `infer` read it as any other) with the rest of
//! a run's state beside them, enough to continue the run exactly where it
//! stopped:
//!
//! * metadata `ramus.resume`: a JSON [`RunState`] — epochs done and how far
//!   the next one got (batches, graphs, loss so far), the shuffle stream as
//!   that epoch began (its order is drawn again) and the dropout stream
//!   where it stands, the optimizer's step count, the best dev score and
//!   its epoch, the learning-rate schedule's plateau state, the run's
//!   configuration (flags) and a fingerprint of its data;
//! * tensors `ramus.resume/first/NAME`, `ramus.resume/second/NAME`: the
//!   optimizer's moments of parameter `NAME` (those its rule keeps);
//!   `ramus.resume/best/NAME`: the parameters of the best dev epoch.
//!
//! Floats are stored by their bits, streams by seed and word position, so
//! a resumed run continues bit for bit.

use std::collections::BTreeMap;
use std::path::Path;

use ramus_core::{Model, Params, Tensor};
use ramus_graph::{InputGraph, Vocab};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use ramus_exec::{ExecError, Optimizer, OptimizerConfig, Result};

use crate::checkpoint::{self, Extra};
use crate::schedule::Plateau;
// reserved by the checkpoint format, which skips them when checking names
pub use crate::checkpoint::{is_resume_tensor, TENSOR_PREFIX};
use crate::train::EpochProgress;

/// The metadata key of the run state.
pub const KEY_RESUME: &str = "ramus.resume";
/// The format of [`RunState`] this build reads and writes.
const VERSION: u32 = 1;

/// The best dev score so far and the epoch it came from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Best {
    pub score: f64,
    pub epoch: usize,
}

/// Where a run stands, besides its parameters and optimizer moments.
#[derive(Clone, Debug, PartialEq)]
pub struct RunState {
    /// Epochs finished (dev evaluation and best model included).
    pub epochs_done: usize,
    /// How far epoch `epochs_done + 1` got.
    pub progress: EpochProgress,
    /// The shuffle stream as epoch `epochs_done + 1` began.
    pub shuffle: ChaCha8Rng,
    /// The dropout stream where it stands.
    pub dropout: ChaCha8Rng,
    pub best: Option<Best>,
    /// What the plateau schedule keeps of the dev metric (see
    /// [`crate::schedule`]); the default for the other schedules.
    pub plateau: Plateau,
    /// The run's configuration: each flag's values (`None`: not given).
    pub config: BTreeMap<String, Option<Vec<String>>>,
    /// The ranks (GPUs) the run trains on: a step takes a batch from each.
    pub ranks: usize,
    /// [`fingerprint`] of the run's data.
    pub data: String,
}

/// A stream as text: its seed, stream number and word position.
#[derive(Serialize, Deserialize)]
struct RngRecord {
    seed: String,
    stream: u64,
    word_pos: String,
}

impl RngRecord {
    fn of(rng: &ChaCha8Rng) -> Self {
        RngRecord {
            seed: rng.get_seed().iter().map(|b| format!("{b:02x}")).collect(),
            stream: rng.get_stream(),
            word_pos: rng.get_word_pos().to_string(),
        }
    }

    fn rng(&self) -> std::result::Result<ChaCha8Rng, String> {
        let bad = || format!("bad stream seed `{}`", self.seed);
        if self.seed.len() != 64 || !self.seed.is_ascii() {
            return Err(bad());
        }
        let mut seed = [0u8; 32];
        for (i, b) in seed.iter_mut().enumerate() {
            *b = u8::from_str_radix(&self.seed[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        let pos: u128 = self
            .word_pos
            .parse()
            .map_err(|_| format!("bad stream position `{}`", self.word_pos))?;
        let mut rng = ChaCha8Rng::from_seed(seed);
        rng.set_stream(self.stream);
        rng.set_word_pos(pos);
        Ok(rng)
    }
}

impl RunState {
    /// Continues on `ranks` ranks a run saved on another number of them
    /// (each rank takes `batch_size` graphs a step, of an epoch of `len`):
    /// the graphs of the epoch's order trained so far are skipped and the
    /// rest is cut into batches of the new size (the epoch's batches and
    /// graphs count from there; its loss keeps its sum). Returns the graphs
    /// skipped when the number changed.
    pub fn rebase(&mut self, ranks: usize, batch_size: usize, len: usize) -> Option<usize> {
        if ranks == self.ranks {
            return None;
        }
        let p = &mut self.progress;
        p.skip = (p.skip + p.batches * self.ranks * batch_size).min(len);
        p.batches = 0;
        p.graphs = 0;
        self.ranks = ranks;
        Some(p.skip)
    }
}

/// [`Plateau`] as stored (floats by their bits).
#[derive(Serialize, Deserialize, Default)]
struct PlateauRecord {
    best_bits: Option<u64>,
    stale_epochs: usize,
    decays: u32,
}

/// [`RunState`] as stored (floats by their bits).
#[derive(Serialize, Deserialize)]
struct Record {
    version: u32,
    epochs_done: usize,
    batches: usize,
    graphs: usize,
    applied: usize,
    loss_sum_bits: u64,
    skipped: usize,
    shuffle: RngRecord,
    dropout: RngRecord,
    optimizer_steps: u64,
    best_score_bits: Option<u64>,
    best_epoch: Option<usize>,
    /// Absent in checkpoints of runs before schedules: a fresh state.
    #[serde(default)]
    plateau: PlateauRecord,
    config: BTreeMap<String, Option<Vec<String>>>,
    data: String,
    /// Absent in checkpoints of runs before data parallelism: one rank.
    #[serde(default = "one")]
    ranks: usize,
    /// Absent in those checkpoints: nothing skipped.
    #[serde(default)]
    skip: usize,
}

fn one() -> usize {
    1
}

/// The tensor name of `kind` (`first`, `second`, `best`) for parameter `name`.
fn extra_name(kind: &str, name: &str) -> String {
    format!("{TENSOR_PREFIX}{kind}/{name}")
}

/// Writes a resumable checkpoint (atomically, see [`ramus_exec::atomic`]):
/// `params` under their own names, `state`, `optimizer`'s moments and step
/// count, and `best` (the best dev epoch's parameters, if any).
pub fn save(
    path: &Path,
    model: &Model,
    params: &Params<f32>,
    vocab: &Vocab,
    run: (&RunState, &Optimizer<f32>, Option<&Params<f32>>),
) -> Result<()> {
    let (state, optimizer, best) = run;
    let mut extra = Extra::default();
    for (p, spec) in model.params.iter().enumerate() {
        for (kind, moments) in [
            ("first", optimizer.first_moments()),
            ("second", optimizer.second_moments()),
        ] {
            if let Some(t) = moments.get(p).filter(|t| !t.is_empty()) {
                extra.tensors.push((extra_name(kind, &spec.name), t));
            }
        }
        if let Some(best) = best {
            extra
                .tensors
                .push((extra_name("best", &spec.name), &best.values[p]));
        }
    }
    let record = Record {
        version: VERSION,
        epochs_done: state.epochs_done,
        batches: state.progress.batches,
        graphs: state.progress.graphs,
        applied: state.progress.applied,
        loss_sum_bits: state.progress.loss_sum.to_bits(),
        skipped: state.progress.skipped,
        shuffle: RngRecord::of(&state.shuffle),
        dropout: RngRecord::of(&state.dropout),
        optimizer_steps: optimizer.steps(),
        best_score_bits: state.best.map(|b| b.score.to_bits()),
        best_epoch: state.best.map(|b| b.epoch),
        plateau: PlateauRecord {
            best_bits: state.plateau.best.map(f64::to_bits),
            stale_epochs: state.plateau.stale_epochs,
            decays: state.plateau.decays,
        },
        config: state.config.clone(),
        data: state.data.clone(),
        ranks: state.ranks,
        skip: state.progress.skip,
    };
    let json = serde_json::to_string(&record).map_err(|e| ExecError::Checkpoint(e.to_string()))?;
    extra.metadata.insert(KEY_RESUME.into(), json);
    checkpoint::save_with(path, model, params, vocab, &extra)
}

/// The run state of the checkpoint bytes `data` read from `path` (see
/// [`checkpoint::read_info`]), with the optimizer's step count; an error
/// naming the file if it is no resumable checkpoint.
pub fn read_state(path: &Path, data: &[u8]) -> Result<(RunState, u64)> {
    let bad = |m: String| ExecError::Checkpoint(format!("{}: {m}", path.display()));
    let (_, header) = safetensors::SafeTensors::read_metadata(data)
        .map_err(|e| bad(format!("not a safetensors file ({e})")))?;
    let json = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get(KEY_RESUME))
        .ok_or_else(|| {
            bad(
                "not a resumable checkpoint (no run state: written by --save, not by a checkpoint \
                 during training)"
                    .into(),
            )
        })?;
    let r: Record = serde_json::from_str(json).map_err(|e| bad(format!("bad run state: {e}")))?;
    if r.version != VERSION {
        return Err(bad(format!(
            "run state version {} (this build reads {VERSION})",
            r.version
        )));
    }
    let best = match (r.best_score_bits, r.best_epoch) {
        (Some(bits), Some(epoch)) => Some(Best {
            score: f64::from_bits(bits),
            epoch,
        }),
        _ => None,
    };
    let state = RunState {
        epochs_done: r.epochs_done,
        progress: EpochProgress {
            batches: r.batches,
            graphs: r.graphs,
            applied: r.applied,
            loss_sum: f64::from_bits(r.loss_sum_bits),
            skipped: r.skipped,
            skip: r.skip,
        },
        shuffle: r.shuffle.rng().map_err(|e| bad(format!("shuffle {e}")))?,
        dropout: r.dropout.rng().map_err(|e| bad(format!("dropout {e}")))?,
        best,
        plateau: Plateau {
            best: r.plateau.best_bits.map(f64::from_bits),
            stale_epochs: r.plateau.stale_epochs,
            decays: r.plateau.decays,
        },
        config: r.config,
        data: r.data,
        ranks: r.ranks.max(1),
    };
    Ok((state, r.optimizer_steps))
}

/// What a resumable checkpoint restores besides its [`RunState`].
pub struct Resumed {
    pub params: Params<f32>,
    /// The optimizer with its moments and step count.
    pub optimizer: Optimizer<f32>,
    /// The best dev epoch's parameters (when [`RunState::best`] is set).
    pub best: Option<Params<f32>>,
}

/// Loads the parameters, the optimizer (with `config`) and the best
/// parameters of `model` from the resumable checkpoint bytes `data`.
pub fn load(
    path: &Path,
    data: &[u8],
    model: &Model,
    config: OptimizerConfig,
    state: &RunState,
    steps: u64,
) -> Result<Resumed> {
    let bad = |m: String| ExecError::Checkpoint(format!("{}: {m}", path.display()));
    let params = checkpoint::load_params(path, data, model)?;
    let st = safetensors::SafeTensors::deserialize(data).map_err(|e| bad(e.to_string()))?;
    let mut optimizer = Optimizer::new(config, &params);
    let read = |kind: &str, p: usize, shape: &[usize]| -> Result<Tensor<f32>> {
        let name = extra_name(kind, &model.params[p].name);
        let t = st
            .tensor(&name)
            .map_err(|_| bad(format!("missing tensor `{name}`")))?;
        if t.shape() != shape || t.dtype() != safetensors::tensor::Dtype::F32 {
            return Err(bad(format!(
                "tensor `{name}` is {:?} {:?}, expected F32 {shape:?}",
                t.dtype(),
                t.shape()
            )));
        }
        let v = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok(Tensor::from_vec(shape, v)?)
    };
    let moments = |kind: &str, fresh: &[Tensor<f32>]| -> Result<Vec<Tensor<f32>>> {
        (0..fresh.len())
            .map(|p| match fresh[p].is_empty() {
                true => Ok(fresh[p].clone()),
                false => read(kind, p, fresh[p].shape()),
            })
            .collect()
    };
    let first = moments("first", optimizer.first_moments())?;
    let second = moments("second", optimizer.second_moments())?;
    optimizer
        .restore(steps, first, second)
        .map_err(|e| bad(format!("optimizer state: {e}")))?;
    let best = match state.best {
        None => None,
        Some(_) => {
            let values = (0..model.params.len())
                .map(|p| read("best", p, &model.params[p].shape))
                .collect::<Result<Vec<_>>>()?;
            Some(Params::from_tensors(model, values)?)
        }
    };
    Ok(Resumed {
        params,
        optimizer,
        best,
    })
}

/// A cheap fingerprint of a run's data: every graph of every split (shape,
/// tokens, labels, kinds, features) and the vocabulary, hashed (FNV-1a
/// over 32-bit words). A resumed run refuses data that differs.
pub fn fingerprint(splits: &[&[InputGraph]], vocab: &Vocab) -> String {
    let mut h = Fnv::default();
    h.text(&vocab.to_json());
    for split in splits {
        h.word(split.len() as u32);
        for g in *split {
            h.word(g.len() as u32);
            h.word(g.feature_width() as u32);
            for v in 0..g.len() {
                let children = g.children(v);
                h.word(children.len() as u32);
                children.iter().for_each(|&c| h.word(c));
                h.word(g.tokens[v]);
                h.word(g.labels[v] as u32);
                h.word(u32::from(g.kind(v)));
                g.features(v).iter().for_each(|x| h.word(x.to_bits()));
            }
        }
    }
    format!("{:016x}", h.0)
}

/// FNV-1a, a word at a time.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn word(&mut self, w: u32) {
        self.0 = (self.0 ^ u64::from(w)).wrapping_mul(0x0000_0100_0000_01b3);
    }

    fn text(&mut self, s: &str) {
        self.word(s.len() as u32);
        s.bytes().for_each(|b| self.word(u32::from(b)));
    }
}
