//! CPU kernels of the structural ops (`ramus_core::ops::structure`):
//! concatenation, slices, padding, child sums and expansion over edges, row
//! sums and broadcasts, reshapes and embedding lookups.

use ramus_core::ops::*;
use ramus_core::real::Real;
use ramus_core::{CoreError, OpDef, Result};

use super::ctx::{Kernel, KernelCtx};

fn row_chunks<T>(data: &[T], width: usize, rows: usize) -> impl Iterator<Item = &[T]> {
    data[..rows * width].chunks(width.max(1)).take(rows)
}

impl Kernel for Concat {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let rows = ctx.out_rows;
        let width = ctx.out.len() / rows.max(1);
        let mut start = 0;
        for a in ctx.args {
            let w = a.ty.width();
            for (r, src) in row_chunks(a.floats("concat")?, w, rows).enumerate() {
                ctx.out[r * width + start..r * width + start + w].copy_from_slice(src);
            }
            start += w;
        }
        Ok(())
    }
}

impl Kernel for Slice {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let a = &ctx.args[0];
        let w = a.ty.width();
        for (r, src) in row_chunks(a.floats("slice")?, w, ctx.out_rows).enumerate() {
            ctx.out[r * self.len..(r + 1) * self.len]
                .copy_from_slice(&src[self.start..self.start + self.len]);
        }
        Ok(())
    }
}

impl Kernel for Pad {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let a = &ctx.args[0];
        let w = a.ty.width();
        ctx.out.iter_mut().for_each(|x| *x = T::ZERO);
        for (r, src) in row_chunks(a.floats("pad")?, w, ctx.out_rows).enumerate() {
            let o = r * self.total + self.start;
            ctx.out[o..o + w].copy_from_slice(src);
        }
        Ok(())
    }
}

impl Kernel for SumChildren {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let a = &ctx.args[0];
        let w = a.ty.width();
        let d = a.floats("sum_children")?;
        ctx.out.iter_mut().for_each(|x| *x = T::ZERO);
        if ctx.edge_parent.len() != a.rows {
            return Err(CoreError::kernel(
                "sum_children",
                "edge topology does not match the operand's rows",
            ));
        }
        for (e, &p) in ctx.edge_parent.iter().enumerate() {
            let p = p as usize;
            if p >= ctx.out_rows {
                return Err(CoreError::kernel(
                    "sum_children",
                    format!("edge {e} has parent row {p} out of range"),
                ));
            }
            for (o, &x) in ctx.out[p * w..(p + 1) * w]
                .iter_mut()
                .zip(&d[e * w..(e + 1) * w])
            {
                *o += x;
            }
        }
        Ok(())
    }
}

impl Kernel for ExpandChildren {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let a = &ctx.args[0];
        let w = a.ty.width();
        let d = a.floats("expand_children")?;
        for (e, &p) in ctx.edge_parent.iter().enumerate() {
            let p = p as usize;
            if p >= a.rows {
                return Err(CoreError::kernel(
                    "expand_children",
                    format!("edge {e} has parent row {p} out of range"),
                ));
            }
            ctx.out[e * w..(e + 1) * w].copy_from_slice(&d[p * w..(p + 1) * w]);
        }
        Ok(())
    }
}

impl Kernel for SumRows {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let a = &ctx.args[0];
        let w = a.ty.width();
        ctx.out.iter_mut().for_each(|x| *x = T::ZERO);
        let data = a.floats(self.name())?;
        let out = &mut *ctx.out;
        ramus_core::simd!(for src in row_chunks(data, w, a.rows) {
            for (o, &x) in out.iter_mut().zip(src) {
                *o += x;
            }
        });
        if self.mean && a.rows > 0 {
            let inv = T::ONE / T::from_f64(a.rows as f64);
            ctx.out.iter_mut().for_each(|x| *x *= inv);
        }
        Ok(())
    }
}

impl Kernel for BroadcastRows {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let s = ctx.args[0].floats(self.name())?;
        let rows = ctx.args[1].rows;
        let scale = if self.mean && rows > 0 {
            T::ONE / T::from_f64(rows as f64)
        } else {
            T::ONE
        };
        for o in ctx.out.chunks_mut(s.len().max(1)) {
            for (o, &x) in o.iter_mut().zip(s) {
                *o = x * scale;
            }
        }
        Ok(())
    }
}

impl Kernel for Reshape {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        ctx.out
            .copy_from_slice(&ctx.args[0].floats("reshape")?[..ctx.out.len()]);
        Ok(())
    }
}

impl Kernel for Embedding {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let table = ctx.args[0].floats("embedding")?;
        let (vocab, h) = (ctx.args[0].ty.shape[0], ctx.args[0].ty.shape[1]);
        let idx = ctx.args[1].indices("embedding")?;
        for (r, &i) in idx.iter().take(ctx.out_rows).enumerate() {
            let i = i as usize;
            if i >= vocab {
                return Err(CoreError::kernel(
                    "embedding",
                    format!("token id {i} out of range for a table of {vocab} rows"),
                ));
            }
            ctx.out[r * h..(r + 1) * h].copy_from_slice(&table[i * h..(i + 1) * h]);
        }
        Ok(())
    }
}

impl Kernel for EmbeddingUnk {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let table = ctx.args[0].floats("embedding_unk")?;
        let (rows, h) = (ctx.args[0].ty.shape[0], ctx.args[0].ty.shape[1]);
        if rows == 0 {
            return Err(CoreError::kernel("embedding_unk", "the table has no rows"));
        }
        let idx = ctx.args[1].indices("embedding_unk")?;
        for (r, &t) in idx.iter().take(ctx.out_rows).enumerate() {
            let i = unk_row(t, rows);
            ctx.out[r * h..(r + 1) * h].copy_from_slice(&table[i * h..(i + 1) * h]);
        }
        Ok(())
    }
}

impl Kernel for EmbeddingUnkBackward {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let gr = ctx.args[0].floats("embedding_unk_backward")?;
        let h = ctx.args[0].ty.width();
        let idx = ctx.args[1].indices("embedding_unk_backward")?;
        let rows = ctx.args[0].rows;
        if ctx.out.len() != self.rows * h || gr.len() < rows * h || idx.len() < rows {
            return Err(CoreError::kernel(
                "embedding_unk_backward",
                format!(
                    "{rows} gradient rows of {h} into a {}x{h} table: operand sizes differ",
                    self.rows
                ),
            ));
        }
        ctx.out.iter_mut().for_each(|x| *x = T::ZERO);
        for (r, &t) in idx.iter().take(rows).enumerate() {
            let i = unk_row(t, self.rows);
            for (o, &x) in ctx.out[i * h..(i + 1) * h]
                .iter_mut()
                .zip(&gr[r * h..(r + 1) * h])
            {
                *o += x;
            }
        }
        Ok(())
    }
}
