//! CPU kernels of the elementwise ops (`ramus_core::ops::elementwise`):
//! each applies its scalar function row by row, broadcasting a static row
//! (bias), through [`run_rows`]; each row's loop is compiled for the
//! run-time kernel level ([`ramus_core::simd!`]).

use ramus_core::ops::*;
use ramus_core::real::{sigmoid, Real};
use ramus_core::{CoreError, Result};

use super::ctx::{Kernel, KernelCtx};

/// Runs `f(inputs_row, out_row)` for every output row, broadcasting static
/// operands; splits large outputs over threads (one block of rows each).
fn run_rows<T: Real>(
    ctx: &mut KernelCtx<'_, T>,
    name: &str,
    f: impl Fn(&[&[T]], &mut [T]) + Sync,
) -> Result<()> {
    if ctx.out.is_empty() {
        return Ok(());
    }
    let rows = ctx.out_rows.max(1);
    let width = ctx.out.len() / rows;
    let mut ins: Vec<(&[T], bool)> = Vec::with_capacity(ctx.args.len());
    for a in ctx.args {
        let d = a.floats(name)?;
        let per_row = a.ty.is_rows();
        let need = if per_row { rows * width } else { width };
        if d.len() < need {
            return Err(CoreError::kernel(
                name,
                format!("operand has {} elements, need {need}", d.len()),
            ));
        }
        ins.push((d, per_row));
    }
    // Rows run under `simd!`, with `f` (an `#[inline(always)]` closure)
    // compiled into each level's copy of the loop.
    let span = |r0: usize, out: &mut [T]| {
        ramus_core::simd!(for (i, out_row) in out.chunks_mut(width).enumerate() {
            let r = r0 + i;
            let mut row_ins: [&[T]; 4] = [&[]; 4];
            for (k, (d, per_row)) in ins.iter().enumerate() {
                row_ins[k] = if *per_row {
                    &d[r * width..(r + 1) * width]
                } else {
                    &d[..width]
                };
            }
            f(&row_ins[..ins.len()], out_row);
        })
    };
    let threads = crate::parallel::threads();
    if rows * width >= crate::parallel::min_split_elements() && rows > 1 && threads > 1 {
        let block = rows.div_ceil(threads);
        crate::parallel::for_each_chunk_mut(ctx.out, block * width, |i, c| span(i * block, c));
    } else {
        span(0, ctx.out);
    }
    Ok(())
}

macro_rules! unary_kernel {
    ($ty:ident, $name:literal, |$x:ident| $f:expr) => {
        impl Kernel for $ty {
            fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
                run_rows(
                    ctx,
                    $name,
                    #[inline(always)]
                    |i, o| {
                        for (o, &$x) in o.iter_mut().zip(i[0]) {
                            *o = $f;
                        }
                    },
                )
            }
        }
    };
}

macro_rules! scalar_kernel {
    ($ty:ident, $name:literal, |$x:ident, $a:ident| $f:expr) => {
        impl Kernel for $ty {
            fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
                let $a = T::from_f64(self.0);
                run_rows(
                    ctx,
                    $name,
                    #[inline(always)]
                    |i, o| {
                        for (o, &$x) in o.iter_mut().zip(i[0]) {
                            *o = $f;
                        }
                    },
                )
            }
        }
    };
}

macro_rules! binary_kernel {
    ($ty:ident, $name:literal, |$a:ident, $b:ident| $f:expr) => {
        impl Kernel for $ty {
            fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
                run_rows(
                    ctx,
                    $name,
                    #[inline(always)]
                    |i, o| {
                        for ((o, &$a), &$b) in o.iter_mut().zip(i[0]).zip(i[1]) {
                            *o = $f;
                        }
                    },
                )
            }
        }
    };
}

unary_kernel!(Neg, "neg", |x| -x);
unary_kernel!(Exp, "exp", |x| x.exp_fast());
unary_kernel!(Log, "log", |x| x.ln());
unary_kernel!(Sigmoid, "sigmoid", |x| sigmoid(x));
unary_kernel!(Tanh, "tanh", |x| x.tanh_fast());
unary_kernel!(Relu, "relu", |x| if x > T::ZERO { x } else { T::ZERO });
scalar_kernel!(Scale, "scale", |x, a| a * x);
scalar_kernel!(AddScalar, "add_scalar", |x, a| x + a);
scalar_kernel!(RsubScalar, "rsub_scalar", |x, a| a - x);
binary_kernel!(Add, "add", |a, b| a + b);
binary_kernel!(Sub, "sub", |a, b| a - b);
binary_kernel!(Mul, "mul", |a, b| a * b);
binary_kernel!(Div, "div", |a, b| a / b);
binary_kernel!(SigmoidBackward, "sigmoid_backward", |y, g| g
    * y
    * (T::ONE - y));
binary_kernel!(TanhBackward, "tanh_backward", |y, g| g * (T::ONE - y * y));
binary_kernel!(ReluBackward, "relu_backward", |x, g| if x > T::ZERO {
    g
} else {
    T::ZERO
});
