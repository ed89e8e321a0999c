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
    /// Runs an op's CPU kernel for this element type.
    fn run_kernel(kernel: &dyn crate::op::CpuKernel, ctx: &mut crate::op::KernelCtx<'_, Self>) -> crate::error::Result<()>;
    /// `c = alpha * a * b + beta * c` on strided matrices (row stride, column stride).
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        m: usize,
        k: usize,
        n: usize,
        alpha: Self,
        a: &[Self],
        a_strides: (isize, isize),
        b: &[Self],
        b_strides: (isize, isize),
        beta: Self,
        c: &mut [Self],
        c_row_stride: isize,
    );
}

macro_rules! impl_real {
    ($t:ty, $name:literal, $gemm:path, $run:ident) => {
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
            fn run_kernel(
                kernel: &dyn crate::op::CpuKernel,
                ctx: &mut crate::op::KernelCtx<'_, Self>,
            ) -> crate::error::Result<()> {
                kernel.$run(ctx)
            }
            fn gemm(
                m: usize,
                k: usize,
                n: usize,
                alpha: Self,
                a: &[Self],
                (rsa, csa): (isize, isize),
                b: &[Self],
                (rsb, csb): (isize, isize),
                beta: Self,
                c: &mut [Self],
                rsc: isize,
            ) {
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
                assert!(a.len() > last(m, k, rsa, csa) || k == 0, "gemm: A too short");
                assert!(b.len() > last(k, n, rsb, csb) || k == 0, "gemm: B too short");
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

impl_real!(f32, "f32", matrixmultiply::sgemm, run_f32);
impl_real!(f64, "f64", matrixmultiply::dgemm, run_f64);

/// Numerically stable logistic function.
#[inline(always)]
pub fn sigmoid<T: Real>(x: T) -> T {
    if x >= T::ZERO {
        T::ONE / (T::ONE + (-x).exp())
    } else {
        let e = x.exp();
        e / (T::ONE + e)
    }
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
        f64::gemm(m, k, n, 1.0, &a, (k as isize, 1), &b_t, (1, k as isize), 1.0, &mut c, n as isize);
        for i in 0..m {
            for j in 0..n {
                let want: f64 = 1.0 + (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum::<f64>();
                assert!((c[i * n + j] - want).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn sigmoid_is_stable() {
        assert_eq!(sigmoid(-1000.0f32), 0.0);
        assert_eq!(sigmoid(1000.0f32), 1.0);
        assert!((sigmoid(0.3f64) - 1.0 / (1.0 + (-0.3f64).exp())).abs() < 1e-15);
    }
}
