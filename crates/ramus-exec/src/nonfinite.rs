//! Numerical faults in training: a batch whose loss or a gradient is not
//! finite (NaN or infinite) is never applied. Every engine checks before it
//! updates: the CPU engine scans the gradients on the host (or reads the
//! clipping norm, which is finite exactly when every gradient is), device
//! engines fold the check into their optimizer kernels. The trainer then
//! stops with an error naming the batch ([`OnNonFinite::Stop`], the
//! default) or counts the batch as skipped ([`OnNonFinite::SkipBatch`]).

use std::fmt;

use ramus_core::{Grads, Model, Params, Real};

/// What training does with a batch whose loss or a gradient is not finite.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OnNonFinite {
    /// Stop with an error naming the epoch, the batch and the first
    /// parameter that went non-finite.
    #[default]
    Stop,
    /// Leave the parameters and the optimizer state as they were before
    /// the batch and go on with the next one (stopping all the same once a
    /// parameter's value is not finite: no later batch could be applied).
    SkipBatch,
}

impl std::str::FromStr for OnNonFinite {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "stop" => Ok(OnNonFinite::Stop),
            "skip-batch" => Ok(OnNonFinite::SkipBatch),
            other => Err(format!(
                "unknown policy `{other}` (expected stop or skip-batch)"
            )),
        }
    }
}

/// Which of a parameter's tensors holds a non-finite element.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorPart {
    Gradient,
    Value,
}

/// The first parameter (in model order) whose gradient or value is not finite.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NonFiniteParam {
    /// Its index in the model's parameters.
    pub index: usize,
    pub name: String,
    pub part: TensorPart,
}

impl fmt::Display for NonFiniteParam {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let part = match self.part {
            TensorPart::Gradient => "gradient",
            TensorPart::Value => "value",
        };
        write!(f, "`{}` ({part})", self.name)
    }
}

/// A training step that was not applied (or, on an engine that cannot hold
/// an update back, see [`crate::TrainEngine::skips_nonfinite`], that made the
/// parameters non-finite).
#[derive(Clone, Debug, PartialEq)]
pub struct NonFiniteStep {
    /// The batch's loss (finite when only a gradient was not).
    pub loss: f64,
    /// The first parameter that went non-finite, when the engine could tell.
    pub param: Option<NonFiniteParam>,
}

impl NonFiniteStep {
    /// True when a parameter's value (not only a gradient) is not finite:
    /// skipping the batch leaves it so, and every later batch fails too.
    pub fn values_nonfinite(&self) -> bool {
        self.param
            .as_ref()
            .is_some_and(|p| p.part == TensorPart::Value)
    }
}

/// Where the step was in an epoch, for the error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchPlace {
    /// 1-based index of the batch in its epoch.
    pub batch: usize,
    /// Batches in the epoch.
    pub batches: usize,
    /// `file:line` of the batch's first graph (see [`ramus_graph::InputGraph::describe`]).
    pub first_graph: String,
}

/// A non-finite training step, with its place once the trainer knows it.
#[derive(Clone, Debug, PartialEq)]
pub struct NonFiniteFault {
    pub step: NonFiniteStep,
    pub place: Option<BatchPlace>,
}

impl fmt::Display for NonFiniteFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "non-finite training step")?;
        if let Some(p) = &self.place {
            write!(
                f,
                " at batch {} of {} (first graph {})",
                p.batch, p.batches, p.first_graph
            )?;
        }
        write!(f, ": loss {}", self.step.loss)?;
        match &self.step.param {
            Some(p) => write!(f, ", first non-finite parameter {p}")?,
            None => write!(f, ", every gradient and parameter finite")?,
        }
        if self.step.values_nonfinite() {
            write!(
                f,
                "; an earlier update made the parameters non-finite, which skipping batches \
                 cannot undo: lower --lr or set --clip"
            )
        } else {
            write!(
                f,
                "; lower --lr, set --clip, or pass --on-nonfinite skip-batch to skip such batches"
            )
        }
    }
}

/// True when every element is finite. Branch-free over lanes of eight, so
/// it vectorizes: `x * 0` is 0 for a finite `x` and NaN otherwise.
pub fn all_finite<T: Real>(xs: &[T]) -> bool {
    ramus_core::simd!(all_finite_body(xs))
}

/// [`all_finite`]'s loop, inlined into each kernel level's copy.
#[inline(always)]
fn all_finite_body<T: Real>(xs: &[T]) -> bool {
    let mut acc = [T::ZERO; 8];
    let mut chunks = xs.chunks_exact(8);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x * T::ZERO;
        }
    }
    let rest = chunks
        .remainder()
        .iter()
        .fold(T::ZERO, |a, &x| a + x * T::ZERO);
    acc.iter().fold(rest, |a, &x| a + x) == T::ZERO
}

/// The elements of parameter `p`'s gradient the last backward pass wrote:
/// all of a dense one, the touched rows of a row gradient.
fn gradient_finite<T: Real>(grads: &Grads<T>, p: usize) -> bool {
    let data = grads.values[p].data();
    match &grads.touched_rows[p] {
        None => all_finite(data),
        Some(rows) => {
            let w = grads.row_width(p);
            rows.iter().all(|&r| {
                let at = r as usize * w;
                data.get(at..at + w).is_none_or(all_finite)
            })
        }
    }
}

/// True when every gradient the last backward pass wrote is finite
/// (buffers have none).
pub fn gradients_finite<T: Real>(grads: &Grads<T>) -> bool {
    (0..grads.values.len()).all(|p| grads.is_buffer(p) || gradient_finite(grads, p))
}

/// The first parameter, in model order, whose value is not finite (the
/// cause: every gradient it reaches follows), else the first whose
/// gradient (`grads`, if given) is not.
pub fn first_nonfinite<T: Real>(
    model: &Model,
    params: &Params<T>,
    grads: Option<&Grads<T>>,
) -> Option<NonFiniteParam> {
    let named = |p: usize, part| NonFiniteParam {
        index: p,
        name: model.params[p].name.clone(),
        part,
    };
    let values = (0..model.params.len().min(params.values.len()))
        .find(|&p| !all_finite(params.values[p].data()))
        .map(|p| named(p, TensorPart::Value));
    values.or_else(|| {
        let g = grads?;
        (0..model.params.len().min(g.values.len()))
            .find(|&p| !g.is_buffer(p) && !gradient_finite(g, p))
            .map(|p| named(p, TensorPart::Gradient))
    })
}

/// The first parameter whose value is not finite, over host copies of a
/// device's parameters (`values[p]`, named `names[p]`, in model order).
pub fn first_nonfinite_value(names: &[String], values: &[Vec<f32>]) -> Option<NonFiniteParam> {
    let p = values.iter().position(|v| !all_finite(v))?;
    Some(NonFiniteParam {
        index: p,
        name: names.get(p).cloned().unwrap_or_default(),
        part: TensorPart::Value,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_finite_finds_a_bad_element_in_any_lane_and_the_tail() {
        for len in [0usize, 1, 7, 8, 9, 33] {
            let clean = vec![1.5f32; len];
            assert!(all_finite(&clean));
            for at in 0..len {
                for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                    let mut v = clean.clone();
                    v[at] = bad;
                    assert!(!all_finite(&v), "len {len}, {bad} at {at}");
                }
            }
        }
        // large finite values do not overflow the check
        assert!(all_finite(&[f32::MAX; 16]));
    }

    #[test]
    fn policies_parse_and_unknown_ones_name_the_choices() {
        assert_eq!("stop".parse(), Ok(OnNonFinite::Stop));
        assert_eq!("skip-batch".parse(), Ok(OnNonFinite::SkipBatch));
        let e = "skip".parse::<OnNonFinite>().unwrap_err();
        assert!(e.contains("stop or skip-batch"), "{e}");
    }
}
