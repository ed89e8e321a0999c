//! CPU kernel of [`RowMatMul`], the per-row matrix product.

use ramus_core::ops::RowMatMul;
use ramus_core::real::Real;
use ramus_core::{CoreError, Result};

use super::ctx::{Kernel, KernelCtx};

impl Kernel for RowMatMul {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let (a, b) = (&ctx.args[0], &ctx.args[1]);
        let (ad, bd) = (a.floats("row_matmul")?, b.floats("row_matmul")?);
        let (m, k, n) = (self.m, self.k, self.n);
        let rows = ctx.out_rows;
        let a_step = if a.ty.is_rows() { m * k } else { 0 };
        let b_step = if b.ty.is_rows() { k * n } else { 0 };
        let need = |step: usize, size: usize| if step > 0 { rows * step } else { size };
        if ad.len() < need(a_step, m * k) || bd.len() < need(b_step, k * n) {
            return Err(CoreError::kernel(
                "row_matmul",
                format!(
                    "operands hold {} and {} elements, {rows} rows of {m}x{k} · {k}x{n} need more",
                    ad.len(),
                    bd.len()
                ),
            ));
        }
        if ctx.out.len() < rows * m * n {
            return Err(CoreError::kernel(
                "row_matmul",
                format!(
                    "output has {} elements, expected {rows} rows of {}",
                    ctx.out.len(),
                    m * n
                ),
            ));
        }
        for r in 0..rows {
            let am = &ad[r * a_step..r * a_step + m * k];
            let bm = &bd[r * b_step..r * b_step + k * n];
            let out = &mut ctx.out[r * m * n..(r + 1) * m * n];
            if self.trans_b {
                // rows of the stored B are contiguous in t: dot products
                for i in 0..m {
                    for j in 0..n {
                        let bj = &bm[j * k..(j + 1) * k];
                        let mut acc = T::ZERO;
                        for (t, &b) in bj.iter().enumerate() {
                            acc += self.a_at(am, i, t) * b;
                        }
                        out[i * n + j] = acc;
                    }
                }
            } else {
                // rows of B are contiguous in j: scaled row additions
                out.iter_mut().for_each(|x| *x = T::ZERO);
                for i in 0..m {
                    let oi = &mut out[i * n..(i + 1) * n];
                    for t in 0..k {
                        let a = self.a_at(am, i, t);
                        for (o, &b) in oi.iter_mut().zip(&bm[t * n..(t + 1) * n]) {
                            *o += a * b;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
