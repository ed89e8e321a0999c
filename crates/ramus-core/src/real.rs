//! The floating-point element types kernels run on (`f32` for speed, `f64`
//! for gradient checks) and the GEMM entry point shared by every CPU kernel.

use std::fmt::Debug;
use std::iter::Sum;
use std::ops::{Add, AddAssign, Div, Mul, MulAssign, Neg, Sub, SubAssign};

/// A floating-point element type. Implemented for `f32` and `f64`.
pub trait Real:
    Copy
    + Send
    + Sync
    + Default
    + Debug
    + PartialOrd
    + Sum
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    /// Name used in messages and checkpoints ("f32", "f64").
    const NAME: &'static str;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn tanh(self) -> Self;
    fn sqrt(self) -> Self;
    fn max(self, other: Self) -> Self;
    /// The slice as `f32`, when `Self` is `f32` (lets kernels take a
    /// hand-vectorized path for the speed type).
    fn as_f32(s: &[Self]) -> Option<&[f32]>;
    /// Mutable form of [`Real::as_f32`].
    fn as_f32_mut(s: &mut [Self]) -> Option<&mut [f32]>;
    /// `exp`, branch-free so loops over slices vectorize (f32: a degree-6
    /// polynomial after range reduction, within 2 ulp; f64: libm).
    fn exp_fast(self) -> Self;
    /// `tanh` built on [`Real::exp_fast`] (f32 absolute error below 1e-7).
    fn tanh_fast(self) -> Self;
    /// `c = alpha * a * b + beta * c` on strided matrices (row stride, column stride).
    fn gemm(args: GemmArgs<'_, Self>);
}

/// The operands of one [`Real::gemm`]: `c = alpha * a * b + beta * c`,
/// `a` is `m × k`, `b` is `k × n`, `c` is `m × n`; each input with its
/// (row, column) strides, `c` with its row stride (columns contiguous).
pub struct GemmArgs<'a, T> {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub alpha: T,
    pub a: &'a [T],
    pub a_strides: (isize, isize),
    pub b: &'a [T],
    pub b_strides: (isize, isize),
    pub beta: T,
    pub c: &'a mut [T],
    pub c_row_stride: isize,
}

macro_rules! impl_real {
    ($t:ty, $name:literal, $gemm:path, $exp:path, $tanh:path, |$s:ident| $f32:expr, |$m:ident| $f32m:expr) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NAME: &'static str = $name;
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            #[inline(always)]
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            #[inline(always)]
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
            #[inline(always)]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline(always)]
            fn max(self, other: Self) -> Self {
                <$t>::max(self, other)
            }
            #[inline(always)]
            fn as_f32($s: &[Self]) -> Option<&[f32]> {
                $f32
            }
            #[inline(always)]
            fn as_f32_mut($m: &mut [Self]) -> Option<&mut [f32]> {
                $f32m
            }
            #[inline(always)]
            fn exp_fast(self) -> Self {
                $exp(self)
            }
            #[inline(always)]
            fn tanh_fast(self) -> Self {
                $tanh(self)
            }
            fn gemm(args: GemmArgs<'_, Self>) {
                let GemmArgs {
                    m,
                    k,
                    n,
                    alpha,
                    a,
                    a_strides: (rsa, csa),
                    b,
                    b_strides: (rsb, csb),
                    beta,
                    c,
                    c_row_stride: rsc,
                } = args;
                if m == 0 || n == 0 {
                    return;
                }
                let last = |rows: usize, cols: usize, rs: isize, cs: isize| {
                    if rows == 0 || cols == 0 {
                        0
                    } else {
                        ((rows - 1) as isize * rs + (cols - 1) as isize * cs) as usize
                    }
                };
                assert!(
                    a.len() > last(m, k, rsa, csa) || k == 0,
                    "gemm: A too short"
                );
                assert!(
                    b.len() > last(k, n, rsb, csb) || k == 0,
                    "gemm: B too short"
                );
                assert!(c.len() > last(m, n, rsc, 1), "gemm: C too short");
                // SAFETY: the asserts above check that every element addressed
                // through the given dimensions and strides lies inside the
                // slices; `c` is borrowed mutably so it aliases neither input.
                unsafe {
                    $gemm(
                        m,
                        k,
                        n,
                        alpha,
                        a.as_ptr(),
                        rsa,
                        csa,
                        b.as_ptr(),
                        rsb,
                        csb,
                        beta,
                        c.as_mut_ptr(),
                        rsc,
                        1,
                    )
                }
            }
        }
    };
}

impl_real!(
    f32,
    "f32",
    matrixmultiply::sgemm,
    exp_f32,
    tanh_f32,
    |s| Some(s),
    |s| Some(s)
);
impl_real!(
    f64,
    "f64",
    matrixmultiply::dgemm,
    f64::exp,
    f64::tanh,
    |_s| None,
    |_s| None
);

/// Logistic function `1 / (1 + exp(-x))`; branch-free, saturates cleanly.
#[inline(always)]
pub fn sigmoid<T: Real>(x: T) -> T {
    T::ONE / (T::ONE + (-x).exp_fast())
}

/// Branch-free `exp` for f32: `2^n · p(r)` with `x = n ln2 + r`, `|r| <= ln2/2`.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.0);
    let n = (x * LOG2E).round();
    let r = x - n * LN2_HI - n * LN2_LO;
    // Cephes expf minimax coefficients
    let p = 1.987_569_1e-4f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    // scale by 2^n through the exponent bits (n in [-126, 128) after clamping)
    let bits = ((n as i32 + 127) as u32) << 23;
    y * f32::from_bits(bits)
}

/// `tanh` for f32 through `exp`: `sign(x) (1 - e) / (1 + e)` with `e = exp(-2|x|)`.
#[inline(always)]
fn tanh_f32(x: f32) -> f32 {
    let e = exp_f32(-2.0 * x.abs());
    let t = (1.0 - e) / (1.0 + e);
    t.copysign(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemm_matches_loop_with_transposes() {
        let (m, k, n) = (3, 4, 5);
        let a: Vec<f64> = (0..m * k).map(|i| i as f64 * 0.5 - 2.0).collect();
        let b: Vec<f64> = (0..k * n).map(|i| (i as f64).sin()).collect();
        // b stored transposed: b_t[j*k + p] = b[p*n + j]
        let mut b_t = vec![0.0; k * n];
        for p in 0..k {
            for j in 0..n {
                b_t[j * k + p] = b[p * n + j];
            }
        }
        let mut c = vec![1.0; m * n];
        f64::gemm(GemmArgs {
            m,
            k,
            n,
            alpha: 1.0,
            a: &a,
            a_strides: (k as isize, 1),
            b: &b_t,
            b_strides: (1, k as isize),
            beta: 1.0,
            c: &mut c,
            c_row_stride: n as isize,
        });
        for i in 0..m {
            for j in 0..n {
                let want: f64 = 1.0 + (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum::<f64>();
                assert!((c[i * n + j] - want).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn fast_exp_and_tanh_are_accurate() {
        let mut x = -90.0f32;
        while x < 90.0 {
            let (e, want) = (exp_f32(x), (x as f64).exp());
            if want > 1e-37 && x <= 88.0 {
                assert!(
                    ((e as f64 - want) / want).abs() < 3e-7,
                    "exp({x}) = {e} vs {want}"
                );
            }
            let (t, want) = (tanh_f32(x), (x as f64).tanh());
            assert!((t as f64 - want).abs() < 2e-7, "tanh({x}) = {t} vs {want}");
            x += 0.0137;
        }
        assert_eq!(exp_f32(-1000.0), exp_f32(-87.3));
        assert!(exp_f32(1000.0).is_finite());
    }

    #[test]
    fn sigmoid_is_stable() {
        assert!(sigmoid(-1000.0f32) < 1e-37);
        assert_eq!(sigmoid(1000.0f32), 1.0);
        assert!((sigmoid(0.3f64) - 1.0 / (1.0 + (-0.3f64).exp())).abs() < 1e-15);
    }
}
