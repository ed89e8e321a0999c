//! Optimizers: SGD, Adagrad and Adam with decoupled weight decay, plus
//! global gradient-norm clipping. Parameters whose gradient only touched
//! some rows (embedding tables) are updated on those rows alone, so a step
//! costs in proportion to the words in the batch, not the vocabulary.
//!
//! Each parameter's step may take the learning rate times a multiplier of
//! its own ([`Optimizer::set_lr_scales`]: 0 freezes it, e.g. pretrained
//! word vectors); the rate itself may change between steps (a schedule,
//! [`OptimizerConfig::set_lr`]).

use ramus_core::graph::Role;
use ramus_core::{Grads, Model, Params, Real, Tensor};

use crate::error::{ExecError, Result, Setting};
use crate::nonfinite::gradients_finite;

/// Which update rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    Sgd,
    Adagrad,
    Adam,
}

impl std::str::FromStr for OptimizerKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "sgd" => Ok(OptimizerKind::Sgd),
            "adagrad" => Ok(OptimizerKind::Adagrad),
            "adam" => Ok(OptimizerKind::Adam),
            _ => Err(format!(
                "unknown optimizer `{s}` (expected sgd, adagrad or adam)"
            )),
        }
    }
}

/// Optimizer settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimizerConfig {
    pub kind: OptimizerKind,
    pub lr: f64,
    /// SGD/Adagrad: L2 penalty added to the gradient; Adam: decoupled decay (AdamW).
    pub weight_decay: f64,
    /// Rescale gradients so their global L2 norm is at most this.
    pub clip_norm: Option<f64>,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
}

impl OptimizerConfig {
    /// The optimizer of an engine that only runs forward passes (evaluation,
    /// inference): plain SGD at rate 0, which keeps no state.
    pub fn forward_only() -> Self {
        Self::new(OptimizerKind::Sgd, 0.0)
    }

    /// Defaults for `kind` at learning rate `lr`.
    pub fn new(kind: OptimizerKind, lr: f64) -> Self {
        let eps = if kind == OptimizerKind::Adagrad {
            1e-10
        } else {
            1e-8
        };
        OptimizerConfig {
            kind,
            lr,
            weight_decay: 0.0,
            clip_norm: None,
            beta1: 0.9,
            beta2: 0.999,
            eps,
        }
    }

    /// Sets the learning rate of the steps from now on (a schedule),
    /// refusing one that is negative or not finite.
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        if !(lr.is_finite() && lr >= 0.0) {
            return Err(ExecError::InvalidSetting {
                setting: Setting::LearningRate,
                value: lr,
                expected: "a finite number >= 0",
            });
        }
        self.lr = lr;
        Ok(())
    }

    /// Refuses settings no one can mean, naming the first: a learning rate
    /// or weight decay that is negative or not finite, a clip norm that is
    /// not a positive finite number, betas outside [0, 1), a negative or
    /// non-finite eps.
    pub fn validate(&self) -> Result<()> {
        let check = |setting, value: f64, ok: bool, expected| {
            if ok {
                Ok(())
            } else {
                Err(ExecError::InvalidSetting {
                    setting,
                    value,
                    expected,
                })
            }
        };
        let non_negative = |v: f64| v.is_finite() && v >= 0.0;
        let unit = |v: f64| v.is_finite() && (0.0..1.0).contains(&v);
        check(
            Setting::LearningRate,
            self.lr,
            non_negative(self.lr),
            "a finite number >= 0",
        )?;
        check(
            Setting::WeightDecay,
            self.weight_decay,
            non_negative(self.weight_decay),
            "a finite number >= 0",
        )?;
        if let Some(clip) = self.clip_norm {
            check(
                Setting::Clip,
                clip,
                clip.is_finite() && clip > 0.0,
                "a finite number > 0",
            )?;
        }
        check(Setting::Beta1, self.beta1, unit(self.beta1), "in [0, 1)")?;
        check(Setting::Beta2, self.beta2, unit(self.beta2), "in [0, 1)")?;
        check(
            Setting::Eps,
            self.eps,
            non_negative(self.eps),
            "a finite number >= 0",
        )
    }
}

/// Optimizer state for a model's parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Optimizer<T> {
    pub config: OptimizerConfig,
    first: Vec<Tensor<T>>,
    second: Vec<Tensor<T>>,
    steps: u64,
    /// Each parameter's learning-rate multiplier; empty: 1 for every one.
    scales: Vec<f64>,
}

/// The embedding tables of `model`: the parameters a vertex looks rows of
/// up by its token (their gradients come as rows), in declaration order.
pub fn embedding_tables(model: &Model) -> Vec<usize> {
    let mut tables: Vec<usize> = model
        .functions
        .iter()
        .map(|f| &f.backward)
        .chain([&model.head.backward])
        .flat_map(|g| &g.outputs)
        .filter_map(|o| match o.role {
            Role::ParamRowGrad(p) => Some(p),
            _ => None,
        })
        .collect();
    tables.sort_unstable();
    tables.dedup();
    tables
}

/// Refuses per-parameter learning-rate multipliers that are not one per
/// parameter of `params` (`count`), or not finite numbers >= 0; names the
/// first bad one.
pub fn check_lr_scales(scales: &[f64], count: usize) -> Result<()> {
    if !scales.is_empty() && scales.len() != count {
        return Err(ExecError::Config(format!(
            "{} learning-rate multipliers for {count} parameters",
            scales.len()
        )));
    }
    if let Some(p) = scales.iter().position(|s| !(s.is_finite() && *s >= 0.0)) {
        return Err(ExecError::Config(format!(
            "learning-rate multiplier {} of parameter {p}: expected a finite number >= 0",
            scales[p]
        )));
    }
    Ok(())
}

impl<T: Real> Optimizer<T> {
    /// Fresh state for `params`.
    pub fn new(config: OptimizerConfig, params: &Params<T>) -> Self {
        let zeros = |used: bool| -> Vec<Tensor<T>> {
            params
                .values
                .iter()
                .map(|p| {
                    if used {
                        Tensor::zeros(p.shape())
                    } else {
                        Tensor::zeros(&[0])
                    }
                })
                .collect()
        };
        Optimizer {
            first: zeros(config.kind == OptimizerKind::Adam),
            second: zeros(config.kind != OptimizerKind::Sgd),
            config,
            steps: 0,
            scales: Vec::new(),
        }
    }

    /// Each parameter's learning-rate multiplier (empty: 1 for every one).
    pub fn lr_scales(&self) -> &[f64] {
        &self.scales
    }

    /// Makes parameter `p`'s step take the learning rate times
    /// `scales[p]` (0: the parameter stays as it is; empty: 1 for every
    /// one). A setting of the run, not state: [`restore`](Self::restore)
    /// keeps it.
    pub fn set_lr_scales(&mut self, scales: &[f64]) -> Result<()> {
        check_lr_scales(scales, self.first.len())?;
        self.scales = match scales.iter().all(|&s| s == 1.0) {
            true => Vec::new(),
            false => scales.to_vec(),
        };
        Ok(())
    }

    /// Number of steps taken.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Adam's first moments, one per parameter (empty tensors for the
    /// other rules).
    pub fn first_moments(&self) -> &[Tensor<T>] {
        &self.first
    }

    /// Adagrad's sums of squared gradients or Adam's second moments, one
    /// per parameter (empty tensors for SGD).
    pub fn second_moments(&self) -> &[Tensor<T>] {
        &self.second
    }

    /// Replaces the state with `steps` taken and the moments `first` and
    /// `second` (shaped as [`first_moments`](Self::first_moments) and
    /// [`second_moments`](Self::second_moments)): a resumed run, or a
    /// device engine's state brought back to the host.
    pub fn restore(
        &mut self,
        steps: u64,
        first: Vec<Tensor<T>>,
        second: Vec<Tensor<T>>,
    ) -> Result<(), String> {
        for (which, old, new) in [
            ("first", &self.first, &first),
            ("second", &self.second, &second),
        ] {
            if old.len() != new.len() {
                return Err(format!(
                    "{} {which} moments for {} parameters",
                    new.len(),
                    old.len()
                ));
            }
            if let Some(p) = (0..old.len()).find(|&p| old[p].shape() != new[p].shape()) {
                return Err(format!(
                    "{which} moments of parameter {p} have shape {:?}, expected {:?}",
                    new[p].shape(),
                    old[p].shape()
                ));
            }
        }
        self.steps = steps;
        self.first = first;
        self.second = second;
        Ok(())
    }

    /// Applies one update from `grads`. Returns the gradient norm before
    /// clipping when clipping is configured.
    pub fn step(&mut self, params: &mut Params<T>, grads: &Grads<T>) -> Option<f64> {
        // the global norm is only needed (and only computed) when clipping
        let norm = self.config.clip_norm.map(|_| grads.norm());
        self.apply(params, grads, norm);
        norm
    }

    /// [`Optimizer::step`] only if every gradient is finite; otherwise
    /// neither `params` nor the optimizer state (moments, step count)
    /// change. Returns whether the update was applied. With clipping the
    /// check is the norm the clipping computes anyway (finite exactly when
    /// every gradient is: a sum of squares of `f32` values cannot overflow
    /// an `f64`); without it, one scan of the gradients.
    pub fn step_if_finite(&mut self, params: &mut Params<T>, grads: &Grads<T>) -> bool {
        let norm = self.config.clip_norm.map(|_| grads.norm());
        let finite = match norm {
            Some(norm) => norm.is_finite(),
            None => gradients_finite(grads),
        };
        if finite {
            self.apply(params, grads, norm);
        }
        finite
    }

    /// The update itself, with the gradient norm when clipping.
    fn apply(&mut self, params: &mut Params<T>, grads: &Grads<T>, norm: Option<f64>) {
        let c = self.config;
        let clip = match (c.clip_norm, norm) {
            (Some(max), Some(norm)) if norm > max && norm > 0.0 => max / norm,
            _ => 1.0,
        };
        self.steps += 1;
        params.touch();
        let t = self.steps as f64;
        let (bc1, bc2) = (1.0 - c.beta1.powf(t), 1.0 - c.beta2.powf(t));
        let lr = T::from_f64(c.lr);
        let (clip, wd) = (T::from_f64(clip), T::from_f64(c.weight_decay));
        let (b1, b2, eps) = (
            T::from_f64(c.beta1),
            T::from_f64(c.beta2),
            T::from_f64(c.eps),
        );
        let (inv_bc1, inv_bc2) = (T::from_f64(1.0 / bc1), T::from_f64(1.0 / bc2));
        for p in 0..params.values.len() {
            // buffers (running statistics) are not trained: no step, no decay
            if grads.is_buffer(p) {
                continue;
            }
            let width = grads.row_width(p);
            let ranges: Vec<(usize, usize)> = match &grads.touched_rows[p] {
                None => vec![(0, params.values[p].len())],
                Some(rows) => rows
                    .iter()
                    .map(|&r| (r as usize * width, (r as usize + 1) * width))
                    .collect(),
            };
            // the parameter's own rate: the same f32 product the device takes
            let lr = match self.scales.get(p) {
                Some(&scale) => lr * T::from_f64(scale),
                None => lr,
            };
            let (pv, gv) = (params.values[p].data_mut(), grads.values[p].data());
            // the update loops compiled for the run-time kernel level
            ramus_core::simd!(for (a, b) in ranges {
                match c.kind {
                    OptimizerKind::Sgd => {
                        for (w, &g) in pv[a..b].iter_mut().zip(&gv[a..b]) {
                            let g = g * clip + wd * *w;
                            *w -= lr * g;
                        }
                    }
                    OptimizerKind::Adagrad => {
                        let acc = self.second[p].data_mut();
                        for ((w, &g), s) in pv[a..b].iter_mut().zip(&gv[a..b]).zip(&mut acc[a..b]) {
                            let g = g * clip + wd * *w;
                            *s += g * g;
                            *w -= lr * g / (s.sqrt() + eps);
                        }
                    }
                    OptimizerKind::Adam => {
                        let (m, v) = (self.first[p].data_mut(), self.second[p].data_mut());
                        for (((w, &g), m), v) in pv[a..b]
                            .iter_mut()
                            .zip(&gv[a..b])
                            .zip(&mut m[a..b])
                            .zip(&mut v[a..b])
                        {
                            let g = g * clip;
                            *m = b1 * *m + (T::ONE - b1) * g;
                            *v = b2 * *v + (T::ONE - b2) * g * g;
                            *w -= lr * wd * *w;
                            *w -= lr * (*m * inv_bc1) / ((*v * inv_bc2).sqrt() + eps);
                        }
                    }
                }
            });
        }
    }
}
