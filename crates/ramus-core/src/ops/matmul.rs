//! Matrix multiplication with transpose flags: `op(A) · op(B)`.
//!
//! Supported operand combinations:
//! * rows `[R, k]` · static `[k, n]` (or `[n, k]` with `trans_b`) → rows `[R, n]`
//!   (a linear layer applied to every vertex of a task);
//! * rows`ᵀ` · rows (`trans_a`, same space) → static `[wa, wb]`, contracting over
//!   rows (the weight-gradient GEMM that lazy batching runs once per batch);
//! * static · static → static.

use rayon::prelude::*;

use crate::error::{CoreError, Result};
use crate::graph::ValueType;
use crate::op::{want_arity, want_float, Cost, GradCtx, Kernel, KernelCtx, OpDef};
use crate::real::Real;

/// `op(A) · op(B)`, see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatMul {
    pub trans_a: bool,
    pub trans_b: bool,
}

/// Dimensions `(m, k, n)` of the product for concrete row counts.
fn dims(op: &MatMul, a: &ValueType, a_rows: usize, b: &ValueType, b_rows: usize) -> (usize, usize, usize) {
    let (ar, ac) = if a.is_rows() { (a_rows, a.width()) } else { (a.shape[0], a.shape[1]) };
    let (br, bc) = if b.is_rows() { (b_rows, b.width()) } else { (b.shape[0], b.shape[1]) };
    let (m, k) = if op.trans_a { (ac, ar) } else { (ar, ac) };
    let n = if op.trans_b { br } else { bc };
    (m, k, n)
}

impl OpDef for MatMul {
    fn name(&self) -> &'static str {
        "matmul"
    }
    fn attrs(&self) -> String {
        format!("{}{}", if self.trans_a { "Aᵀ" } else { "A" }, if self.trans_b { "Bᵀ" } else { "B" })
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 2)?;
        let (a, b) = (inputs[0], inputs[1]);
        want_float(a, "A")?;
        want_float(b, "B")?;
        for (t, name) in [(a, "A"), (b, "B")] {
            if !t.is_rows() && t.shape.len() != 2 {
                return Err(format!("static {name} must be a matrix, got shape {:?}", t.shape));
            }
        }
        match (a.is_rows(), b.is_rows()) {
            (true, false) => {
                if self.trans_a {
                    return Err("rows operand A cannot be transposed against a static B".into());
                }
                let (k, n) = if self.trans_b { (b.shape[1], b.shape[0]) } else { (b.shape[0], b.shape[1]) };
                if k != a.width() {
                    return Err(format!("inner dimensions differ: A has width {}, op(B) is {k}x{n}", a.width()));
                }
                Ok(ValueType::rows(a.space, n))
            }
            (true, true) => {
                if !self.trans_a || self.trans_b || a.space != b.space {
                    return Err("two row operands multiply only as Aᵀ·B over the same space".into());
                }
                Ok(ValueType::fixed(&[a.width(), b.width()]))
            }
            (false, false) => {
                let (m, k) = if self.trans_a { (a.shape[1], a.shape[0]) } else { (a.shape[0], a.shape[1]) };
                let (k2, n) = if self.trans_b { (b.shape[1], b.shape[0]) } else { (b.shape[0], b.shape[1]) };
                if k != k2 {
                    return Err(format!("inner dimensions differ: {k} vs {k2}"));
                }
                Ok(ValueType::fixed(&[m, n]))
            }
            (false, true) => Err("a static A times row operand B is not supported".into()),
        }
    }
    fn gradient(&self, g: &mut GradCtx<'_>) {
        let (a, b, dc) = (g.input(0), g.input(1), g.grad());
        let (da, db) = match (self.trans_a, self.trans_b) {
            (false, false) => (g.b.matmul(dc, b, false, true), g.b.matmul(a, dc, true, false)),
            (false, true) => (g.b.matmul(dc, b, false, false), g.b.matmul(dc, a, true, false)),
            (true, false) => (g.b.matmul(b, dc, false, true), g.b.matmul(a, dc, false, false)),
            (true, true) => (g.b.matmul(b, dc, true, true), g.b.matmul(dc, a, true, true)),
        };
        g.set(0, da);
        g.set(1, db);
    }
    fn cost(&self, inputs: &[&ValueType], out: &ValueType, rows: usize) -> Cost {
        let (m, k, n) = dims(self, inputs[0], rows, inputs[1], rows);
        let out_elems = if out.is_rows() { rows * out.width() } else { out.width() };
        Cost { flops: 2.0 * (m * k * n) as f64, bytes: 4.0 * (m * k + k * n + out_elems) as f64 }
    }
}

/// Row counts up to this use the matrix-vector path (no packing of B).
const SMALL_M: usize = 4;

impl Kernel for MatMul {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let (a, b) = (&ctx.args[0], &ctx.args[1]);
        let (ad, bd) = (a.floats("matmul")?, b.floats("matmul")?);
        let (m, k, n) = dims(self, a.ty, a.rows, b.ty, b.rows);
        let a_cols = if a.ty.is_rows() { a.ty.width() } else { a.ty.shape[1] };
        let b_cols = if b.ty.is_rows() { b.ty.width() } else { b.ty.shape[1] };
        if ctx.out.len() != m * n {
            return Err(CoreError::kernel("matmul", format!("output has {} elements, expected {m}x{n}", ctx.out.len())));
        }
        if k == 0 {
            ctx.out.iter_mut().for_each(|x| *x = T::ZERO);
            return Ok(());
        }
        if !self.trans_a && m <= SMALL_M && !b.ty.is_rows() {
            small_m(ad, bd, ctx.out, m, k, n, self.trans_b);
            return Ok(());
        }
        let sa = if self.trans_a { (1, a_cols as isize) } else { (a_cols as isize, 1) };
        let sb = if self.trans_b { (1, b_cols as isize) } else { (b_cols as isize, 1) };
        T::gemm(m, k, n, T::ONE, ad, sa, bd, sb, T::ZERO, ctx.out, n as isize);
        Ok(())
    }
}

/// `out[r] = a[r] · op(B)` for a handful of rows, reading B once per row
/// block: dot products along B's rows when transposed (B is `[n, k]`),
/// otherwise scaled-row accumulation (B is `[k, n]`). Splits columns over
/// threads when B is large.
fn small_m<T: Real>(a: &[T], b: &[T], out: &mut [T], m: usize, k: usize, n: usize, trans_b: bool) {
    let parallel = k * n >= 1 << 16;
    if trans_b {
        // out[r][j] = dot(a[r], b[j])
        let col = |j: usize, r: usize| dot(&a[r * k..(r + 1) * k], &b[j * k..(j + 1) * k]);
        if parallel {
            let mut tmp = vec![T::ZERO; m * n];
            tmp.par_chunks_mut(m).enumerate().for_each(|(j, o)| {
                for (r, o) in o.iter_mut().enumerate() {
                    *o = col(j, r);
                }
            });
            for r in 0..m {
                for j in 0..n {
                    out[r * n + j] = tmp[j * m + r];
                }
            }
        } else {
            for r in 0..m {
                for j in 0..n {
                    out[r * n + j] = col(j, r);
                }
            }
        }
    } else {
        for r in 0..m {
            let row = &mut out[r * n..(r + 1) * n];
            row.iter_mut().for_each(|x| *x = T::ZERO);
            let ar = &a[r * k..(r + 1) * k];
            if parallel {
                const CHUNK: usize = 256;
                row.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
                    let j0 = c * CHUNK;
                    for (p, &av) in ar.iter().enumerate() {
                        let brow = &b[p * n + j0..p * n + j0 + o.len()];
                        for (o, &bv) in o.iter_mut().zip(brow) {
                            *o += av * bv;
                        }
                    }
                });
            } else {
                for (p, &av) in ar.iter().enumerate() {
                    for (o, &bv) in row.iter_mut().zip(&b[p * n..(p + 1) * n]) {
                        *o += av * bv;
                    }
                }
            }
        }
    }
}

/// Dot product with eight independent accumulators (vectorizes).
#[inline]
pub(crate) fn dot<T: Real>(x: &[T], y: &[T]) -> T {
    let mut acc = [T::ZERO; 8];
    let (xc, yc) = (x.chunks_exact(8), y.chunks_exact(8));
    let (xr, yr) = (xc.remainder(), yc.remainder());
    for (xs, ys) in xc.zip(yc) {
        for i in 0..8 {
            acc[i] += xs[i] * ys[i];
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (&a, &b) in xr.iter().zip(yr) {
        s += a * b;
    }
    s
}
