//! Softmax cross-entropy: per-row loss against index labels, and its
//! gradient with respect to the scores.

use crate::error::{CoreError, Result};
use crate::graph::{DType, ValueType};
use crate::op::{want_arity, want_float, GradCtx, Kernel, KernelCtx, OpDef};
use crate::real::Real;

fn check_labels(inputs: &[&ValueType]) -> std::result::Result<(), String> {
    let (logits, labels) = (inputs[0], inputs[1]);
    want_float(logits, "scores")?;
    if !logits.is_rows() {
        return Err(format!("scores must be row values, got {logits}"));
    }
    if labels.dtype != DType::Index || labels.space != logits.space {
        return Err(format!(
            "labels must be index rows in the scores' space, got {labels}"
        ));
    }
    Ok(())
}

/// Writes the softmax of `x` into `p`, returning `log(sum(exp(x - max)))` and `max`.
fn softmax_row<T: Real>(x: &[T], p: &mut [T]) -> (T, T) {
    let max = x.iter().copied().fold(x[0], T::max);
    let mut sum = T::ZERO;
    for (p, &v) in p.iter_mut().zip(x) {
        *p = (v - max).exp();
        sum += *p;
    }
    let inv = T::ONE / sum;
    p.iter_mut().for_each(|v| *v *= inv);
    (sum.ln(), max)
}

fn label_of(op: &str, labels: &[u32], r: usize, classes: usize) -> Result<usize> {
    let l = labels[r] as usize;
    if l >= classes {
        return Err(CoreError::kernel(
            op,
            format!("label {l} of row {r} out of range for {classes} classes"),
        ));
    }
    Ok(l)
}

/// `-log softmax(scores)[label]` per row (a `[1]`-wide row value).
#[derive(Clone, Copy, Debug)]
pub struct SoftmaxXent;

impl OpDef for SoftmaxXent {
    fn name(&self) -> &'static str {
        "softmax_xent"
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 2)?;
        check_labels(inputs)?;
        Ok(ValueType::rows(inputs[0].space, 1))
    }
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let (x, l, gr) = (g.input(0), g.input(1), g.grad());
        let d = g.b.apply(SoftmaxXentBackward, &[x, l, gr]);
        g.set(0, d);
    }
}

impl Kernel for SoftmaxXent {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let c = ctx.args[0].ty.width();
        let x = ctx.args[0].floats("softmax_xent")?;
        let labels = ctx.args[1].indices("softmax_xent")?;
        let mut p = vec![T::ZERO; c];
        for r in 0..ctx.out_rows {
            let row = &x[r * c..(r + 1) * c];
            let l = label_of("softmax_xent", labels, r, c)?;
            let (lse, max) = softmax_row(row, &mut p);
            ctx.out[r] = lse + max - row[l];
        }
        Ok(())
    }
}

/// `(softmax(scores) - onehot(label)) * g` per row: the gradient of
/// [`SoftmaxXent`]. Used only inside backward graphs; it has no gradient of
/// its own (second derivatives of the loss are not supported).
#[derive(Clone, Copy, Debug)]
pub struct SoftmaxXentBackward;

impl OpDef for SoftmaxXentBackward {
    fn name(&self) -> &'static str {
        "softmax_xent_backward"
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 3)?;
        check_labels(inputs)?;
        let g = inputs[2];
        if g.space != inputs[0].space || g.width() != 1 {
            return Err(format!("upstream gradient must be [1]-wide rows, got {g}"));
        }
        Ok(inputs[0].clone())
    }
    fn gradient(&self, g: &mut GradCtx<'_>) {
        g.b.fail(
            "softmax_xent_backward",
            "second derivatives of the loss are not supported",
        );
    }
}

impl Kernel for SoftmaxXentBackward {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let c = ctx.args[0].ty.width();
        let x = ctx.args[0].floats("softmax_xent_backward")?;
        let labels = ctx.args[1].indices("softmax_xent_backward")?;
        let up = ctx.args[2].floats("softmax_xent_backward")?;
        for r in 0..ctx.out_rows {
            let l = label_of("softmax_xent_backward", labels, r, c)?;
            let out = &mut ctx.out[r * c..(r + 1) * c];
            softmax_row(&x[r * c..(r + 1) * c], out);
            out[l] -= T::ONE;
            let g = up[r];
            out.iter_mut().for_each(|v| *v *= g);
        }
        Ok(())
    }
}
