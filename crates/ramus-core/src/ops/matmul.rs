//! Matrix multiplication with transpose flags: `op(A) · op(B)`.
//!
//! Supported operand combinations:
//! * rows `[R, k]` · static `[k, n]` (or `[n, k]` with `trans_b`) → rows `[R, n]`
//!   (a linear layer applied to every vertex of a task);
//! * rows`ᵀ` · rows (`trans_a`, same space) → static `[wa, wb]`, contracting over
//!   rows (the weight-gradient GEMM that lazy batching runs once per batch);
//! * static · static → static.

use crate::error::{CoreError, Result};
use crate::graph::ValueType;
use crate::op::{want_arity, want_float, Cost, GradCtx, Kernel, KernelCtx, OpDef, PackedOperand};
use crate::real::Real;

/// `op(A) · op(B)`, see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatMul {
    pub trans_a: bool,
    pub trans_b: bool,
}

/// Dimensions `(m, k, n)` of the product for concrete row counts.
fn dims(
    op: &MatMul,
    a: &ValueType,
    a_rows: usize,
    b: &ValueType,
    b_rows: usize,
) -> (usize, usize, usize) {
    let (ar, ac) = if a.is_rows() {
        (a_rows, a.width())
    } else {
        (a.shape[0], a.shape[1])
    };
    let (br, bc) = if b.is_rows() {
        (b_rows, b.width())
    } else {
        (b.shape[0], b.shape[1])
    };
    let (m, k) = if op.trans_a { (ac, ar) } else { (ar, ac) };
    let n = if op.trans_b { br } else { bc };
    (m, k, n)
}

impl OpDef for MatMul {
    fn name(&self) -> &'static str {
        "matmul"
    }
    fn attrs(&self) -> String {
        format!(
            "{}{}",
            if self.trans_a { "Aᵀ" } else { "A" },
            if self.trans_b { "Bᵀ" } else { "B" }
        )
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 2)?;
        let (a, b) = (inputs[0], inputs[1]);
        want_float(a, "A")?;
        want_float(b, "B")?;
        for (t, name) in [(a, "A"), (b, "B")] {
            if !t.is_rows() && t.shape.len() != 2 {
                return Err(format!(
                    "static {name} must be a matrix, got shape {:?}",
                    t.shape
                ));
            }
        }
        match (a.is_rows(), b.is_rows()) {
            (true, false) => {
                if self.trans_a {
                    return Err("rows operand A cannot be transposed against a static B".into());
                }
                let (k, n) = if self.trans_b {
                    (b.shape[1], b.shape[0])
                } else {
                    (b.shape[0], b.shape[1])
                };
                if k != a.width() {
                    return Err(format!(
                        "inner dimensions differ: A has width {}, op(B) is {k}x{n}",
                        a.width()
                    ));
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
                let (m, k) = if self.trans_a {
                    (a.shape[1], a.shape[0])
                } else {
                    (a.shape[0], a.shape[1])
                };
                let (k2, n) = if self.trans_b {
                    (b.shape[1], b.shape[0])
                } else {
                    (b.shape[0], b.shape[1])
                };
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
            (false, false) => (
                g.b.matmul(dc, b, false, true),
                g.b.matmul(a, dc, true, false),
            ),
            (false, true) => (
                g.b.matmul(dc, b, false, false),
                g.b.matmul(dc, a, true, false),
            ),
            (true, false) => (
                g.b.matmul(b, dc, false, true),
                g.b.matmul(a, dc, false, false),
            ),
            (true, true) => (g.b.matmul(b, dc, true, true), g.b.matmul(dc, a, true, true)),
        };
        g.set(0, da);
        g.set(1, db);
    }
    fn packed_operand(&self) -> Option<PackedOperand> {
        (!self.trans_a).then_some(PackedOperand {
            trans_b: self.trans_b,
            rows_limit: PACKED_MAX_M,
        })
    }
    fn cost(&self, inputs: &[&ValueType], out: &ValueType, rows: usize) -> Cost {
        let (m, k, n) = dims(self, inputs[0], rows, inputs[1], rows);
        let out_elems = if out.is_rows() {
            rows * out.width()
        } else {
            out.width()
        };
        Cost {
            flops: 2.0 * (m * k * n) as f64,
            bytes: 4.0 * (m * k + k * n + out_elems) as f64,
        }
    }
}

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
                T::gemm(
                    rows,
                    k,
                    n,
                    T::ONE,
                    &ad[a_off..],
                    sa,
                    bd,
                    sb,
                    T::ZERO,
                    c,
                    n as isize,
                );
            });
        } else {
            T::gemm(
                m,
                k,
                n,
                T::ONE,
                ad,
                sa,
                bd,
                sb,
                T::ZERO,
                ctx.out,
                n as isize,
            );
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
#[inline]
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
#[inline]
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

/// Runs with at most this many rows use a packed weight operand when the
/// engine supplies one; larger runs amortize GEMM packing themselves.
pub const PACKED_MAX_M: usize = 128;

/// Columns per panel of a [`PackedB`].
const NR: usize = 16;
/// Rows of A per register block.
const MR: usize = 4;

/// `op(B)` (`k x n`) packed once into panels of [`NR`] columns stored
/// k-major, so the microkernel streams each panel contiguously. Weights are
/// packed once per batch and reused by every task's product.
#[derive(Clone, Debug, Default)]
pub struct PackedB<T> {
    pub k: usize,
    pub n: usize,
    data: Vec<T>,
}

impl<T: Real> PackedB<T> {
    /// Packs `op(B)` where `B` is row-major with `b_cols` columns.
    pub fn pack(b: &[T], b_cols: usize, k: usize, n: usize, trans_b: bool) -> Self {
        let panels = n.div_ceil(NR);
        let mut data = vec![T::ZERO; panels * k * NR];
        for p in 0..panels {
            let panel = &mut data[p * k * NR..(p + 1) * k * NR];
            for jj in 0..NR.min(n - p * NR) {
                let j = p * NR + jj;
                for kk in 0..k {
                    // op(B)[kk][j]
                    panel[kk * NR + jj] = if trans_b {
                        b[j * b_cols + kk]
                    } else {
                        b[kk * b_cols + j]
                    };
                }
            }
        }
        PackedB { k, n, data }
    }
}

/// `out = a · op(B)` for row-major `a` (`m x k`) against a packed `op(B)`:
/// register blocks of up to [`MR`] rows x [`NR`] columns.
pub fn gemm_packed<T: Real>(a: &[T], m: usize, packed: &PackedB<T>, out: &mut [T]) {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    if let (Some(a), Some(b), Some(out)) =
        (T::as_f32(a), T::as_f32(&packed.data), T::as_f32_mut(out))
    {
        fma::gemm_packed_f32(a, m, packed.k, packed.n, b, out);
        return;
    }
    let mut r = 0;
    while r < m {
        match m - r {
            1 => block::<T, 1>(a, r, packed, out),
            2 => block::<T, 2>(a, r, packed, out),
            3 => block::<T, 3>(a, r, packed, out),
            _ => block::<T, MR>(a, r, packed, out),
        }
        r += MR.min(m - r);
    }
}

/// Rows `r..r + R` of the product, panel by panel.
#[inline(always)]
fn block<T: Real, const R: usize>(a: &[T], r: usize, packed: &PackedB<T>, out: &mut [T]) {
    let (k, n) = (packed.k, packed.n);
    let rows: [&[T]; R] = std::array::from_fn(|q| &a[(r + q) * k..(r + q + 1) * k]);
    for (p, panel) in packed.data.chunks_exact(k * NR).enumerate() {
        let j0 = p * NR;
        let w = NR.min(n - j0);
        let mut acc = [[T::ZERO; NR]; R];
        let (bk, _) = panel.as_chunks::<NR>();
        for (kk, b) in bk.iter().enumerate() {
            for q in 0..R {
                let x = rows[q][kk];
                for l in 0..NR {
                    acc[q][l] += x * b[l];
                }
            }
        }
        for (q, acc) in acc.iter().enumerate() {
            out[(r + q) * n + j0..(r + q) * n + j0 + w].copy_from_slice(&acc[..w]);
        }
    }
}

/// The f32 packed kernel with explicit AVX2 fused multiply-adds: up to six
/// rows x 16 columns of accumulators live in twelve ymm registers.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod fma {
    use std::arch::x86_64::*;

    use super::NR;

    pub(super) fn gemm_packed_f32(
        a: &[f32],
        m: usize,
        k: usize,
        n: usize,
        packed: &[f32],
        out: &mut [f32],
    ) {
        // Big products split their panels (column blocks) over two threads,
        // each computing its columns into a buffer of its own.
        let panels = n.div_ceil(NR);
        let worth = if crate::parallel::min_split_elements() < 1 << 17 {
            1 << 19
        } else {
            1 << 22
        };
        if m * k * n >= worth && panels >= 2 && crate::parallel::threads() > 1 {
            let half = panels / 2;
            let (c0, c1) = (half * NR, n - half * NR);
            let (p0, p1) = packed.split_at(half * k * NR);
            let (mut o0, mut o1) = (vec![0f32; m * c0], vec![0f32; m * c1]);
            crate::parallel::join(
                || gemm_packed_f32(a, m, k, c0, p0, &mut o0),
                || gemm_packed_f32(a, m, k, c1, p1, &mut o1),
            );
            for r in 0..m {
                out[r * n..r * n + c0].copy_from_slice(&o0[r * c0..(r + 1) * c0]);
                out[r * n + c0..(r + 1) * n].copy_from_slice(&o1[r * c1..(r + 1) * c1]);
            }
            return;
        }
        let mut r = 0;
        while r < m {
            let rows = 6.min(m - r);
            match rows {
                1 => block::<1>(a, r, k, n, packed, out),
                2 => block::<2>(a, r, k, n, packed, out),
                3 => block::<3>(a, r, k, n, packed, out),
                4 => block::<4>(a, r, k, n, packed, out),
                5 => block::<5>(a, r, k, n, packed, out),
                _ => block::<6>(a, r, k, n, packed, out),
            }
            r += rows;
        }
    }

    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // kk also drives the pointer arithmetic
    fn block<const R: usize>(
        a: &[f32],
        r: usize,
        k: usize,
        n: usize,
        packed: &[f32],
        out: &mut [f32],
    ) {
        let rows: [&[f32]; R] = std::array::from_fn(|q| &a[(r + q) * k..(r + q + 1) * k]);
        for (p, panel) in packed.chunks_exact(k * NR).enumerate() {
            let j0 = p * NR;
            let w = NR.min(n - j0);
            let mut tile = [[0f32; NR]; R];
            // SAFETY: this module is compiled only when AVX2 and FMA are
            // enabled for the target. Every load reads 8 floats at offsets
            // kk*16 and kk*16+8 of `panel`, which holds k*16 floats (kk < k);
            // stores write 8 floats into `tile` rows of 16.
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); 2]; R];
                let bp = panel.as_ptr();
                for kk in 0..k {
                    let b0 = _mm256_loadu_ps(bp.add(kk * NR));
                    let b1 = _mm256_loadu_ps(bp.add(kk * NR + 8));
                    for q in 0..R {
                        let x = _mm256_set1_ps(rows[q][kk]);
                        acc[q][0] = _mm256_fmadd_ps(x, b0, acc[q][0]);
                        acc[q][1] = _mm256_fmadd_ps(x, b1, acc[q][1]);
                    }
                }
                for q in 0..R {
                    _mm256_storeu_ps(tile[q].as_mut_ptr(), acc[q][0]);
                    _mm256_storeu_ps(tile[q].as_mut_ptr().add(8), acc[q][1]);
                }
            }
            for (q, t) in tile.iter().enumerate() {
                out[(r + q) * n + j0..(r + q) * n + j0 + w].copy_from_slice(&t[..w]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_f32_kernel_matches_f64_reference() {
        for &(m, k, n) in &[(1, 3, 5), (5, 17, 33), (6, 256, 48), (13, 9, 20)] {
            let a: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
            let b: Vec<f64> = (0..k * n).map(|i| (i as f64 * 0.11).cos()).collect();
            let (pk64, pk32) = (
                PackedB::pack(&b, k, k, n, true),
                PackedB::pack(
                    &b.iter().map(|&x| x as f32).collect::<Vec<_>>(),
                    k,
                    k,
                    n,
                    true,
                ),
            );
            let (mut o64, mut o32) = (vec![0f64; m * n], vec![f32::NAN; m * n]);
            gemm_packed(&a, m, &pk64, &mut o64);
            gemm_packed(
                &a.iter().map(|&x| x as f32).collect::<Vec<_>>(),
                m,
                &pk32,
                &mut o32,
            );
            for (x, y) in o64.iter().zip(&o32) {
                assert!(
                    (x - *y as f64).abs() < 1e-4 * (1.0 + x.abs()),
                    "m={m} k={k} n={n}: {x} vs {y}"
                );
            }
        }
    }

    #[test]
    fn packed_gemm_matches_loops() {
        for &(m, k, n, trans_b) in &[
            (1, 5, 3, true),
            (3, 17, 33, false),
            (4, 8, 16, true),
            (7, 256, 40, true),
            (10, 9, 50, false),
        ] {
            let a: Vec<f64> = (0..m * k).map(|i| (i as f64 * 0.37).sin()).collect();
            let b: Vec<f64> = (0..k * n).map(|i| (i as f64 * 0.11).cos()).collect();
            // B stored as [n, k] when transposed, [k, n] otherwise
            let b_cols = if trans_b { k } else { n };
            let opb = |p: usize, j: usize| if trans_b { b[j * k + p] } else { b[p * n + j] };
            let packed = PackedB::pack(&b, b_cols, k, n, trans_b);
            let mut out = vec![f64::NAN; m * n];
            gemm_packed(&a, m, &packed, &mut out);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k).map(|p| a[i * k + p] * opb(p, j)).sum();
                    assert!(
                        (out[i * n + j] - want).abs() < 1e-12,
                        "m={m} k={k} n={n} ({i},{j})"
                    );
                }
            }
        }
    }
}
