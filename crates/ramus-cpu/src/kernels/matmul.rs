//! CPU kernel of [`MatMul`] (`op(A) · op(B)`): the crate's GEMM
//! ([`Real::gemm`]) for large runs, a matrix-vector path for a handful of
//! rows, and the packed weight operand ([`super::packed`]) when the engine
//! supplies one.

use ramus_core::ops::matmul::{dims, PACKED_MAX_M};
use ramus_core::ops::MatMul;
use ramus_core::real::{GemmArgs, Real};
use ramus_core::{CoreError, Result};

use super::ctx::{Kernel, KernelCtx};
use super::packed::gemm_packed;

/// Row counts up to this use the matrix-vector path (no packing of B).
const SMALL_M: usize = 8;

impl Kernel for MatMul {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let (a, b) = (&ctx.args[0], &ctx.args[1]);
        let (ad, bd) = (a.floats("matmul")?, b.floats("matmul")?);
        let (m, k, n) = dims(self, a.ty, a.rows, b.ty, b.rows);
        let a_cols = if a.ty.is_rows() {
            a.ty.width()
        } else {
            a.ty.shape[1]
        };
        let b_cols = if b.ty.is_rows() {
            b.ty.width()
        } else {
            b.ty.shape[1]
        };
        if ctx.out.len() != m * n {
            return Err(CoreError::kernel(
                "matmul",
                format!("output has {} elements, expected {m}x{n}", ctx.out.len()),
            ));
        }
        if k == 0 {
            ctx.out.iter_mut().for_each(|x| *x = T::ZERO);
            return Ok(());
        }
        if let Some(p) = ctx.packed_b {
            if !self.trans_a
                && a.ty.is_rows()
                && !b.ty.is_rows()
                && p.k == k
                && p.n == n
                && m <= PACKED_MAX_M
            {
                gemm_packed(ad, m, p, ctx.out);
                return Ok(());
            }
        }
        if !self.trans_a && m <= SMALL_M && !b.ty.is_rows() {
            small_m(ad, bd, ctx.out, m, k, n, self.trans_b);
            return Ok(());
        }
        let sa = if self.trans_a {
            (1, a_cols as isize)
        } else {
            (a_cols as isize, 1)
        };
        let sb = if self.trans_b {
            (1, b_cols as isize)
        } else {
            (b_cols as isize, 1)
        };
        // Large products split their output rows over the thread pool, each
        // block a single-threaded GEMM on a slice of A.
        let threads = crate::parallel::threads();
        if threads > 1 && m >= 64 && m * k * n >= 1 << 21 {
            let block = m.div_ceil(threads);
            crate::parallel::for_each_chunk_mut(ctx.out, block * n, |i, c| {
                let r0 = i * block;
                let rows = c.len() / n;
                let a_off = r0 * sa.0 as usize;
                T::gemm(GemmArgs {
                    m: rows,
                    k,
                    n,
                    alpha: T::ONE,
                    a: &ad[a_off..],
                    a_strides: sa,
                    b: bd,
                    b_strides: sb,
                    beta: T::ZERO,
                    c,
                    c_row_stride: n as isize,
                });
            });
        } else {
            T::gemm(GemmArgs {
                m,
                k,
                n,
                alpha: T::ONE,
                a: ad,
                a_strides: sa,
                b: bd,
                b_strides: sb,
                beta: T::ZERO,
                c: ctx.out,
                c_row_stride: n as isize,
            });
        }
        Ok(())
    }
}

/// `out[r] = a[r] · op(B)` for a handful of rows, reading B once per row
/// block: dot products along B's rows when transposed (B is `[n, k]`),
/// otherwise scaled-row accumulation (B is `[k, n]`). Splits columns over
/// threads when B is large.
fn small_m<T: Real>(a: &[T], b: &[T], out: &mut [T], m: usize, k: usize, n: usize, trans_b: bool) {
    // Columns are split into one contiguous block per thread when B is big
    // enough for the split to beat the cost of waking a second thread.
    let threads = if m * k * n >= 1 << 21 {
        crate::parallel::threads().clamp(1, 8)
    } else {
        1
    };
    let block = n.div_ceil(threads);
    // out is row-major [m, n]; each thread fills columns [j0, j1) of every row.
    let fill = |j0: usize, j1: usize, cols: &mut [T]| {
        // cols is [m, j1 - j0] row-major
        let w = j1 - j0;
        // the loops compiled for the run-time kernel level (AVX2 or plain)
        ramus_core::simd!({
            if trans_b {
                // B's rows are the outer loop, so each is read from memory once
                // and meets every row of A (which stays in L1), four at a time
                for j in j0..j1 {
                    let bj = &b[j * k..(j + 1) * k];
                    let mut r = 0;
                    while r + 4 <= m {
                        let rows = [
                            &a[r * k..(r + 1) * k],
                            &a[(r + 1) * k..(r + 2) * k],
                            &a[(r + 2) * k..(r + 3) * k],
                            &a[(r + 3) * k..(r + 4) * k],
                        ];
                        for (q, v) in dot4(rows, bj).into_iter().enumerate() {
                            cols[(r + q) * w + j - j0] = v;
                        }
                        r += 4;
                    }
                    for r in r..m {
                        cols[r * w + j - j0] = dot(&a[r * k..(r + 1) * k], bj);
                    }
                }
            } else {
                cols.iter_mut().for_each(|x| *x = T::ZERO);
                // each row of B is read once and added into every output row
                for p in 0..k {
                    let brow = &b[p * n + j0..p * n + j1];
                    for r in 0..m {
                        let av = a[r * k + p];
                        for (o, &bv) in cols[r * w..(r + 1) * w].iter_mut().zip(brow) {
                            *o += av * bv;
                        }
                    }
                }
            }
        })
    };
    if threads == 1 {
        fill(0, n, out);
        return;
    }
    let mut parts: Vec<Vec<T>> = (0..threads)
        .map(|t| vec![T::ZERO; m * (n.min((t + 1) * block) - (t * block).min(n))])
        .collect();
    crate::parallel::for_each_chunk_mut(&mut parts, 1, |t, cols| {
        let cols = &mut cols[0];
        let (j0, j1) = ((t * block).min(n), n.min((t + 1) * block));
        if j1 > j0 {
            fill(j0, j1, cols);
        }
    });
    for (t, cols) in parts.iter().enumerate() {
        let (j0, j1) = ((t * block).min(n), n.min((t + 1) * block));
        let w = j1 - j0;
        for r in 0..m {
            out[r * n + j0..r * n + j1].copy_from_slice(&cols[r * w..(r + 1) * w]);
        }
    }
}

/// Four dot products against one shared vector `y` (y is loaded once for
/// all four rows; fixed-size chunks keep the loop free of bounds checks, so
/// it vectorizes).
#[inline(always)]
fn dot4<T: Real>(x: [&[T]; 4], y: &[T]) -> [T; 4] {
    let mut acc = [[T::ZERO; 8]; 4];
    let (yc, _) = y.as_chunks::<8>();
    let n8 = yc.len() * 8;
    let (x0, _) = x[0][..n8].as_chunks::<8>();
    let (x1, _) = x[1][..n8].as_chunks::<8>();
    let (x2, _) = x[2][..n8].as_chunks::<8>();
    let (x3, _) = x[3][..n8].as_chunks::<8>();
    for i in 0..yc
        .len()
        .min(x0.len())
        .min(x1.len())
        .min(x2.len())
        .min(x3.len())
    {
        let ys = &yc[i];
        let (a, b, c, d) = (&x0[i], &x1[i], &x2[i], &x3[i]);
        for l in 0..8 {
            acc[0][l] += a[l] * ys[l];
            acc[1][l] += b[l] * ys[l];
            acc[2][l] += c[l] * ys[l];
            acc[3][l] += d[l] * ys[l];
        }
    }
    let mut out = [T::ZERO; 4];
    for q in 0..4 {
        let a = &acc[q];
        out[q] = (a[0] + a[4]) + (a[1] + a[5]) + ((a[2] + a[6]) + (a[3] + a[7]));
        for i in n8..y.len() {
            out[q] += x[q][i] * y[i];
        }
    }
    out
}

/// Dot product with eight independent accumulators (vectorizes).
#[inline(always)]
pub(crate) fn dot<T: Real>(x: &[T], y: &[T]) -> T {
    let mut acc = [T::ZERO; 8];
    let (xc, xr) = x.as_chunks::<8>();
    let (yc, yr) = y.as_chunks::<8>();
    for (xs, ys) in xc.iter().zip(yc) {
        for l in 0..8 {
            acc[l] += xs[l] * ys[l];
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (&a, &b) in xr.iter().zip(yr) {
        s += a * b;
    }
    s
}
