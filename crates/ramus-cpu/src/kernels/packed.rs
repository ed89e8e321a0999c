//! A static matrix operand (weights) packed once per pass into column
//! panels ([`PackedB`]) and the register-blocked product against it
//! ([`gemm_packed`]), with explicit FMA kernels for f32 on x86-64 chosen
//! at run time ([`ramus_core::isa`]).

use ramus_core::isa::{isa, Isa};
use ramus_core::real::Real;

/// Columns per panel of a [`PackedB`].
const NR: usize = 16;
/// Rows of A per register block.
const MR: usize = 4;

/// `op(B)` (`k x n`) packed once into panels of `NR` (16) columns stored
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
/// register blocks of up to `MR` (4) rows x `NR` (16) columns.
pub fn gemm_packed<T: Real>(a: &[T], m: usize, packed: &PackedB<T>, out: &mut [T]) {
    gemm_packed_with(isa(), a, m, packed, out)
}

/// [`gemm_packed`] with the kernels of `isa` (which the processor must
/// have: [`isa()`] or a level capped by it).
fn gemm_packed_with<T: Real>(isa: Isa, a: &[T], m: usize, packed: &PackedB<T>, out: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    if let (Some(a), Some(b), Some(out)) =
        (T::as_f32(a), T::as_f32(&packed.data), T::as_f32_mut(out))
    {
        if fma::gemm_packed_f32_with(isa, a, m, packed.k, packed.n, b, out) {
            return;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
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

/// The f32 packed kernels with explicit fused multiply-adds: AVX-512 or
/// AVX2/FMA, as [`Isa`] says (decided from the processor's features).
/// Products big enough to be worth a second thread split their panels
/// (column blocks) over two threads, each writing its own columns of the
/// output.
#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    use super::{Isa, NR};

    /// The output matrix as a raw pointer with its row stride, so the two
    /// halves of a split product can write disjoint column ranges of the
    /// same rows.
    #[derive(Clone, Copy)]
    struct OutPtr {
        ptr: *mut f32,
        row_stride: usize,
    }
    // SAFETY: an `OutPtr` is only shared between the two halves of one
    // split product, which write disjoint column ranges, and the borrow of
    // the output slice it came from outlives both (`join` returns first).
    unsafe impl Send for OutPtr {}
    // SAFETY: as above; nothing reads through the pointer concurrently.
    unsafe impl Sync for OutPtr {}

    /// `out = a · op(B)` with the kernels of `isa`; false (nothing
    /// written) for `Isa::Portable` or when the operands are too short for
    /// the shapes. `isa` must be one the processor has (see [`Isa`]).
    pub(super) fn gemm_packed_f32_with(
        isa: Isa,
        a: &[f32],
        m: usize,
        k: usize,
        n: usize,
        packed: &[f32],
        out: &mut [f32],
    ) -> bool {
        let panels = n.div_ceil(NR);
        if isa == Isa::Portable
            || a.len() < m * k
            || out.len() < m * n
            || packed.len() < panels * k * NR
        {
            return false;
        }
        let dst = OutPtr {
            ptr: out.as_mut_ptr(),
            row_stride: n,
        };
        let worth = if crate::parallel::min_split_elements() < 1 << 17 {
            1 << 19
        } else {
            1 << 22
        };
        if m * k * n >= worth && panels >= 2 && crate::parallel::threads() > 1 {
            let half = panels / 2;
            let (p0, p1) = packed.split_at(half * k * NR);
            crate::parallel::join(
                // SAFETY: the halves write columns [0, half*NR) and
                // [half*NR, n) of rows 0..m: disjoint, and inside `out`
                // (checked above).
                || unsafe { columns(isa, a, m, k, 0..half * NR, p0, dst) },
                // SAFETY: as above.
                || unsafe { columns(isa, a, m, k, half * NR..n, p1, dst) },
            );
        } else {
            // SAFETY: all columns of rows 0..m, inside `out` (checked above).
            unsafe { columns(isa, a, m, k, 0..n, packed, dst) }
        }
        true
    }

    /// Columns `cols` (`c0..c1` below) of `a · op(B)` from their packed panels.
    ///
    /// # Safety
    /// `a` holds `m * k` floats, `panels` holds the `(c1 - c0) / NR`
    /// (rounded up) panels of `k * NR` floats, and `out` addresses `m` rows
    /// of `row_stride >= c1` floats that nothing else touches in `c0..c1`.
    unsafe fn columns(
        isa: Isa,
        a: &[f32],
        m: usize,
        k: usize,
        cols: std::ops::Range<usize>,
        panels: &[f32],
        out: OutPtr,
    ) {
        let (c0, c1) = (cols.start, cols.end);
        match isa {
            // SAFETY: `Isa::Avx512` is only decided (or allowed by
            // `set_isa`) when `is_x86_feature_detected!` found AVX-512F;
            // the rest is the caller's contract.
            Isa::Avx512 => unsafe { avx512::columns(a, m, k, c0, c1, panels, out) },
            // SAFETY: `Isa::Avx2` likewise means AVX2 and FMA were
            // detected; the rest is the caller's contract.
            Isa::Avx2 => unsafe { avx2_columns(a, m, k, c0, c1, panels, out) },
            // `gemm_packed_f32_with` refuses the portable level first.
            Isa::Portable => {}
        }
    }

    /// AVX2: blocks of up to six rows x one 16-column panel, twelve ymm
    /// accumulators.
    ///
    /// # Safety
    /// The processor has AVX2 and FMA; otherwise as [`columns`].
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2_columns(
        a: &[f32],
        m: usize,
        k: usize,
        c0: usize,
        c1: usize,
        panels: &[f32],
        out: OutPtr,
    ) {
        let mut r = 0;
        while r < m {
            let rows = 6.min(m - r);
            // SAFETY: the caller's contract; rows r..r+rows lie below m.
            unsafe {
                match rows {
                    1 => avx2_block::<1>(a, r, k, c0, c1, panels, out),
                    2 => avx2_block::<2>(a, r, k, c0, c1, panels, out),
                    3 => avx2_block::<3>(a, r, k, c0, c1, panels, out),
                    4 => avx2_block::<4>(a, r, k, c0, c1, panels, out),
                    5 => avx2_block::<5>(a, r, k, c0, c1, panels, out),
                    _ => avx2_block::<6>(a, r, k, c0, c1, panels, out),
                }
            }
            r += rows;
        }
    }

    /// # Safety
    /// As [`avx2_columns`], for rows `r..r + R`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn avx2_block<const R: usize>(
        a: &[f32],
        r: usize,
        k: usize,
        c0: usize,
        c1: usize,
        panels: &[f32],
        out: OutPtr,
    ) {
        let ap = a.as_ptr();
        for (p, panel) in panels.chunks_exact(k * NR).enumerate() {
            let j0 = c0 + p * NR;
            let w = NR.min(c1 - j0);
            let mut tile = [[0f32; NR]; R];
            // SAFETY: the caller checked AVX2 and FMA (`Isa::Avx2` or
            // wider). Loads read 8 floats at kk*16 and
            // kk*16+8 of a panel of k*16 floats (kk < k) and single floats
            // of rows r..r+R of `a` (m*k floats, r+R <= m); stores write
            // 8 floats into `tile` rows of 16, then `w` floats of row r+q
            // at column j0 < c1 <= row_stride of `out` (caller's contract).
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); 2]; R];
                let bp = panel.as_ptr();
                for kk in 0..k {
                    let b0 = _mm256_loadu_ps(bp.add(kk * NR));
                    let b1 = _mm256_loadu_ps(bp.add(kk * NR + 8));
                    for (q, acc) in acc.iter_mut().enumerate() {
                        let x = _mm256_set1_ps(*ap.add((r + q) * k + kk));
                        acc[0] = _mm256_fmadd_ps(x, b0, acc[0]);
                        acc[1] = _mm256_fmadd_ps(x, b1, acc[1]);
                    }
                }
                for (t, acc) in tile.iter_mut().zip(&acc) {
                    _mm256_storeu_ps(t.as_mut_ptr(), acc[0]);
                    _mm256_storeu_ps(t.as_mut_ptr().add(8), acc[1]);
                }
                for (q, t) in tile.iter().enumerate() {
                    std::ptr::copy_nonoverlapping(
                        t.as_ptr(),
                        out.ptr.add((r + q) * out.row_stride + j0),
                        w,
                    );
                }
            }
        }
    }

    /// AVX-512: two 16-column panels at a time (kept in L1 while every row
    /// block of `a` streams past them), blocks of up to twelve rows, 24 zmm
    /// accumulators; masked stores write partial panels straight into the
    /// output.
    mod avx512 {
        use std::arch::x86_64::*;

        use super::{OutPtr, NR};

        const MAX_ROWS: usize = 12;

        /// # Safety
        /// The processor has AVX-512F; otherwise as [`super::columns`].
        #[target_feature(enable = "avx512f")]
        pub(super) unsafe fn columns(
            a: &[f32],
            m: usize,
            k: usize,
            c0: usize,
            c1: usize,
            panels: &[f32],
            out: OutPtr,
        ) {
            let count = (c1 - c0).div_ceil(NR);
            let mut p = 0;
            while p < count {
                let pair = p + 1 < count;
                let j0 = c0 + p * NR;
                let mask0 = column_mask(c1 - j0);
                let mask1 = if pair { column_mask(c1 - j0 - NR) } else { 0 };
                let b0 = panels[p * k * NR..].as_ptr();
                let mut r = 0;
                while r < m {
                    let rows = MAX_ROWS.min(m - r);
                    let at = Tile {
                        r,
                        j0,
                        mask0,
                        mask1,
                    };
                    // SAFETY: the caller's contract: panel p (and p+1 when
                    // `pair`) hold k*NR floats each, rows r..r+rows < m.
                    unsafe {
                        macro_rules! run {
                            ($($n:literal)*) => {
                                match (rows, pair) {
                                    $(($n, true) => block::<$n, true>(a, k, b0, out, at),
                                      ($n, false) => block::<$n, false>(a, k, b0, out, at),)*
                                    _ => block::<MAX_ROWS, false>(a, k, b0, out, at),
                                }
                            };
                        }
                        run!(1 2 3 4 5 6 7 8 9 10 11 12);
                    }
                    r += rows;
                }
                p += if pair { 2 } else { 1 };
            }
        }

        /// Where a register block lands: first row, first column, and the
        /// store masks of its (one or two) panels.
        #[derive(Clone, Copy)]
        struct Tile {
            r: usize,
            j0: usize,
            mask0: u16,
            mask1: u16,
        }

        fn column_mask(cols_left: usize) -> u16 {
            if cols_left >= NR {
                u16::MAX
            } else {
                (1u16 << cols_left) - 1
            }
        }

        /// Rows `at.r..at.r + R` against one panel (or two adjacent ones
        /// when `PAIR`) starting at `b0`.
        ///
        /// # Safety
        /// AVX-512F; `b0` points at `k * NR` floats (twice that when
        /// `PAIR`); `a` holds rows `at.r..at.r + R` of `k` floats; `out`
        /// has the masked columns of those rows to itself.
        #[target_feature(enable = "avx512f")]
        #[inline]
        unsafe fn block<const R: usize, const PAIR: bool>(
            a: &[f32],
            k: usize,
            b0: *const f32,
            out: OutPtr,
            at: Tile,
        ) {
            // SAFETY: the function's contract bounds every load and store.
            unsafe {
                let ap = a.as_ptr().add(at.r * k);
                let b1 = b0.add(k * NR);
                let mut acc0 = [_mm512_setzero_ps(); R];
                let mut acc1 = [_mm512_setzero_ps(); R];
                for kk in 0..k {
                    let w0 = _mm512_loadu_ps(b0.add(kk * NR));
                    let w1 = if PAIR {
                        _mm512_loadu_ps(b1.add(kk * NR))
                    } else {
                        _mm512_setzero_ps()
                    };
                    for q in 0..R {
                        let x = _mm512_set1_ps(*ap.add(q * k + kk));
                        acc0[q] = _mm512_fmadd_ps(x, w0, acc0[q]);
                        if PAIR {
                            acc1[q] = _mm512_fmadd_ps(x, w1, acc1[q]);
                        }
                    }
                }
                for q in 0..R {
                    let row = out.ptr.add((at.r + q) * out.row_stride + at.j0);
                    _mm512_mask_storeu_ps(row, at.mask0, acc0[q]);
                    if PAIR {
                        _mm512_mask_storeu_ps(row.add(NR), at.mask1, acc1[q]);
                    }
                }
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

    /// The levels this processor can run, narrowest first.
    fn levels() -> Vec<Isa> {
        let best = Isa::detected();
        [Isa::Portable, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|&i| i <= best)
            .collect()
    }

    /// Every kernel level (portable, AVX2/FMA and, where the processor has
    /// it, AVX-512) against an f64 loop and against each other, over shapes
    /// that hit partial panels, odd panel counts, every row-block size and
    /// the two-thread split.
    ///
    /// Each level sums `a[i][p]·b[p][j]` over `p` in the same order from 0;
    /// the portable one rounds each product and each sum, the FMA ones only
    /// each fused step, so either is within `γ_k·Σ|a·b|` of the exact sum
    /// (`γ_k = k·u/(1 - k·u)`, `u = 2^-24`; Higham, Accuracy and Stability
    /// of Numerical Algorithms, §3.1) and the two within twice that. The
    /// AVX2 and AVX-512 kernels do the same fused steps: equal bit for bit.
    #[test]
    fn every_kernel_level_matches_f64_loops_and_the_others() {
        let shapes = [
            (1, 1, 1),
            (3, 7, 15),
            (12, 5, 16),
            (13, 9, 17),
            (25, 33, 48),
            (24, 16, 80),
            (11, 256, 50),
            (128, 256, 768),
        ];
        for &(m, k, n) in &shapes {
            let a: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
            let packed = PackedB::pack(&b, n, k, n, false);
            let outs: Vec<(Isa, Vec<f32>)> = levels()
                .into_iter()
                .map(|isa| {
                    let mut out = vec![f32::NAN; m * n];
                    crate::parallel::join(
                        || gemm_packed_with(isa, &a, m, &packed, &mut out),
                        || (),
                    );
                    (isa, out)
                })
                .collect();
            let u = f64::from(f32::EPSILON) / 2.0;
            let gamma = k as f64 * u / (1.0 - k as f64 * u);
            for i in 0..m {
                for j in 0..n {
                    let terms = (0..k).map(|p| a[i * k + p] as f64 * b[p * n + j] as f64);
                    let want: f64 = terms.clone().sum();
                    let abs: f64 = terms.map(f64::abs).sum();
                    let portable = outs[0].1[i * n + j] as f64;
                    for (isa, out) in &outs {
                        let got = out[i * n + j] as f64;
                        assert!(
                            (got - want).abs() <= gamma * abs,
                            "{isa:?} m={m} k={k} n={n} ({i},{j}): {got} vs {want}"
                        );
                        assert!(
                            (got - portable).abs() <= 2.0 * gamma * abs,
                            "{isa:?} vs portable m={m} k={k} n={n} ({i},{j}): {got} vs {portable}"
                        );
                    }
                }
            }
            if let [_, (_, avx2), (_, avx512)] = &outs[..] {
                assert!(
                    avx2.iter()
                        .zip(avx512)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "AVX2 and AVX-512 differ for m={m} k={k} n={n}"
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
