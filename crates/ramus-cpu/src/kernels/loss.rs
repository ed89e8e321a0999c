//! CPU kernels of per-row softmax cross-entropy and its gradient.

use ramus_core::ops::{SoftmaxXent, SoftmaxXentBackward};
use ramus_core::real::Real;
use ramus_core::{CoreError, Result};

use super::ctx::{Kernel, KernelCtx};

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
