//! CPU kernels of the image ops (`ramus_core::ops::cnn`): convolution
//! through im2col and the crate's GEMM, pooling, per-channel reductions and
//! batch normalisation (statistics in f64), rows split over threads; and
//! [`update_running_stats`], the engine's update of batch normalisation's
//! running statistics.

use ramus_core::ops::cnn::check_cs;
use ramus_core::ops::*;
use ramus_core::real::{GemmArgs, Real};
use ramus_core::{CoreError, OpDef, Result};

use super::ctx::{Kernel, KernelCtx, NormSum};

/// The float data of argument `i`, checked to hold at least `len` elements.
fn floats<'a, T>(ctx: &KernelCtx<'a, T>, op: &str, i: usize, len: usize) -> Result<&'a [T]> {
    let a = ctx
        .args
        .get(i)
        .ok_or_else(|| CoreError::kernel(op, format!("missing argument {i}")))?;
    let d = a.floats(op)?;
    if d.len() < len {
        return Err(CoreError::kernel(
            op,
            format!("argument {i} holds {} elements, expected {len}", d.len()),
        ));
    }
    Ok(&d[..len])
}

/// Rows of argument `i` (checked against `want` when given).
fn rows_of<T>(ctx: &KernelCtx<'_, T>, op: &str, i: usize, want: Option<usize>) -> Result<usize> {
    let r = ctx
        .args
        .get(i)
        .ok_or_else(|| CoreError::kernel(op, format!("missing argument {i}")))?
        .rows;
    match want {
        Some(w) if w != r => Err(CoreError::kernel(
            op,
            format!("argument {i} has {r} rows, expected {w}"),
        )),
        _ => Ok(r),
    }
}

/// Kernels re-check their attributes (ops built directly skip `infer`).
fn valid(op: &str, r: std::result::Result<(), String>) -> Result<()> {
    r.map_err(|m| CoreError::kernel(op, m))
}

fn check_out<T>(ctx: &KernelCtx<'_, T>, op: &str, len: usize) -> Result<()> {
    if ctx.out.len() != len {
        return Err(CoreError::kernel(
            op,
            format!("output holds {} elements, expected {len}", ctx.out.len()),
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------- threads

/// Runs `f(scratch, row, out_row)` for each of the `rows` rows of `out`
/// (each `row_len` long), split over threads in contiguous row blocks when
/// `work_per_row * rows` is large enough to pay for it. Each block makes
/// its own `scratch()` once and reuses it for its rows. Rows run under
/// [`ramus_core::simd!`]: mark `f` `#[inline(always)]` so its loops are
/// compiled for the run-time kernel level.
fn split_rows<T: Real, S>(
    out: &mut [T],
    row_len: usize,
    rows: usize,
    work_per_row: usize,
    scratch: impl Fn() -> S + Sync,
    f: impl Fn(&mut S, usize, &mut [T]) + Sync,
) {
    let out = &mut out[..rows * row_len];
    if rows == 0 || row_len == 0 {
        return;
    }
    let run_block = |r0: usize, chunk: &mut [T]| {
        let mut sc = scratch();
        // `f` (an `#[inline(always)]` closure) compiled into each level's copy
        ramus_core::simd!(for (i, o) in chunk.chunks_mut(row_len).enumerate() {
            f(&mut sc, r0 + i, o);
        })
    };
    let threads = crate::parallel::threads();
    if threads > 1 && rows > 1 && rows.saturating_mul(work_per_row) >= 1 << 16 {
        let block = rows.div_ceil(threads);
        crate::parallel::for_each_chunk_mut(out, block * row_len, |i, c| run_block(i * block, c));
    } else {
        run_block(0, out);
    }
}

// ---------------------------------------------------------------- im2col

/// Kernel helpers on a convolution's geometry.
trait ConvScratch {
    fn cols_buffer<T: Real>(&self) -> Vec<T>;
    fn lowered<'a, T: Real>(&self, x: &'a [T], cols: &'a mut [T]) -> &'a [T];
}

impl ConvScratch for Conv2dGeom {
    /// Scratch for one image's im2col matrix (empty when im2col is the identity).
    fn cols_buffer<T: Real>(&self) -> Vec<T> {
        if self.pointwise() {
            Vec::new()
        } else {
            vec![T::ZERO; self.patch_len() * self.out_h() * self.out_w()]
        }
    }
    /// One image `x` as the `[C*kh*kw, Ho*Wo]` GEMM operand: `x` itself when
    /// im2col is the identity, otherwise lowered into `cols` (a [`Self::cols_buffer`]).
    #[inline(always)]
    fn lowered<'a, T: Real>(&self, x: &'a [T], cols: &'a mut [T]) -> &'a [T] {
        if self.pointwise() {
            x
        } else {
            im2col(self, x, cols);
            cols
        }
    }
}

/// Lowers one image `x` (`[C, H, W]`) to `cols` (`[C*kh*kw, Ho*Wo]`):
/// row `(c*kh + i)*kw + j` holds input pixel `(c, oy*s + i - p, ox*s + j - p)`
/// for every output position, 0 outside the image.
#[inline(always)]
fn im2col<T: Real>(g: &Conv2dGeom, x: &[T], cols: &mut [T]) {
    let (ho, wo) = (g.out_h(), g.out_w());
    let (h, w, s, p) = (g.height, g.width, g.stride, g.padding);
    let np = ho * wo;
    for c in 0..g.in_channels {
        let img = &x[c * h * w..(c + 1) * h * w];
        for ki in 0..g.kernel_h {
            for kj in 0..g.kernel_w {
                let r = (c * g.kernel_h + ki) * g.kernel_w + kj;
                let row = &mut cols[r * np..(r + 1) * np];
                for oy in 0..ho {
                    let dst = &mut row[oy * wo..(oy + 1) * wo];
                    let iy = oy * s + ki;
                    if iy < p || iy - p >= h {
                        dst.iter_mut().for_each(|v| *v = T::ZERO);
                        continue;
                    }
                    let src = &img[(iy - p) * w..(iy - p + 1) * w];
                    for (ox, d) in dst.iter_mut().enumerate() {
                        let ix = ox * s + kj;
                        *d = if ix < p || ix - p >= w {
                            T::ZERO
                        } else {
                            src[ix - p]
                        };
                    }
                }
            }
        }
    }
}

/// The adjoint of [`im2col`]: adds every column entry back into its pixel
/// of `x` (`x` is overwritten).
#[inline(always)]
fn col2im<T: Real>(g: &Conv2dGeom, cols: &[T], x: &mut [T]) {
    let (ho, wo) = (g.out_h(), g.out_w());
    let (h, w, s, p) = (g.height, g.width, g.stride, g.padding);
    let np = ho * wo;
    x.iter_mut().for_each(|v| *v = T::ZERO);
    for c in 0..g.in_channels {
        let img = &mut x[c * h * w..(c + 1) * h * w];
        for ki in 0..g.kernel_h {
            for kj in 0..g.kernel_w {
                let r = (c * g.kernel_h + ki) * g.kernel_w + kj;
                let row = &cols[r * np..(r + 1) * np];
                for oy in 0..ho {
                    let iy = oy * s + ki;
                    if iy < p || iy - p >= h {
                        continue;
                    }
                    let dst = &mut img[(iy - p) * w..(iy - p + 1) * w];
                    for (ox, &v) in row[oy * wo..(oy + 1) * wo].iter().enumerate() {
                        let ix = ox * s + kj;
                        if ix >= p && ix - p < w {
                            dst[ix - p] += v;
                        }
                    }
                }
            }
        }
    }
}

impl Kernel for Conv2d {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "conv2d";
        valid(OP, self.0.validate())?;
        let g = self.0;
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        let (np, k, o) = (g.out_h() * g.out_w(), g.patch_len(), g.out_channels);
        let x = floats(ctx, OP, 0, rows * g.in_len())?;
        let w = floats(ctx, OP, 1, o * k)?;
        let bias = if ctx.args.len() > 2 {
            Some(floats(ctx, OP, 2, o)?)
        } else {
            None
        };
        check_out(ctx, OP, rows * g.out_len())?;
        let in_len = g.in_len();
        split_rows(
            ctx.out,
            g.out_len(),
            rows,
            g.macs(),
            || g.cols_buffer(),
            #[inline(always)]
            |cols, r, out| {
                let b = g.lowered(&x[r * in_len..(r + 1) * in_len], cols);
                // out [O, P] = W [O, K] · cols [K, P]
                T::gemm(GemmArgs {
                    m: o,
                    k,
                    n: np,
                    alpha: T::ONE,
                    a: w,
                    a_strides: (k as isize, 1),
                    b,
                    b_strides: (np as isize, 1),
                    beta: T::ZERO,
                    c: out,
                    c_row_stride: np as isize,
                });
                if let Some(bias) = bias {
                    for (c, &bv) in out.chunks_mut(np).zip(bias) {
                        c.iter_mut().for_each(|v| *v += bv);
                    }
                }
            },
        );
        Ok(())
    }
}

impl Kernel for Conv2dBackwardInput {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "conv2d_backward_input";
        valid(OP, self.0.validate())?;
        let g = self.0;
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        let (np, k, o) = (g.out_h() * g.out_w(), g.patch_len(), g.out_channels);
        let dy = floats(ctx, OP, 0, rows * g.out_len())?;
        let w = floats(ctx, OP, 1, o * k)?;
        check_out(ctx, OP, rows * g.in_len())?;
        let in_len = g.in_len();
        split_rows(
            ctx.out,
            in_len,
            rows,
            g.macs(),
            || g.cols_buffer(),
            #[inline(always)]
            |cols, r, dx| {
                let dyr = &dy[r * o * np..(r + 1) * o * np];
                // cols [K, P] = Wᵀ [K, O] · dY [O, P]
                let dst: &mut [T] = if g.pointwise() { dx } else { cols };
                T::gemm(GemmArgs {
                    m: k,
                    k: o,
                    n: np,
                    alpha: T::ONE,
                    a: w,
                    a_strides: (1, k as isize),
                    b: dyr,
                    b_strides: (np as isize, 1),
                    beta: T::ZERO,
                    c: dst,
                    c_row_stride: np as isize,
                });
                if !g.pointwise() {
                    col2im(&g, cols, dx);
                }
            },
        );
        Ok(())
    }
}

/// Row blocks whose partial weight gradients are summed (a fixed number,
/// so the summation order does not depend on the thread count).
const WEIGHT_GRAD_PARTS: usize = 8;

impl Kernel for Conv2dBackwardWeight {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "conv2d_backward_weight";
        valid(OP, self.0.validate())?;
        let g = self.0;
        let rows = rows_of(ctx, OP, 0, None)?;
        rows_of(ctx, OP, 1, Some(rows))?;
        let (np, k, o) = (g.out_h() * g.out_w(), g.patch_len(), g.out_channels);
        let (in_len, out_len) = (g.in_len(), g.out_len());
        let x = floats(ctx, OP, 0, rows * in_len)?;
        let dy = floats(ctx, OP, 1, rows * out_len)?;
        check_out(ctx, OP, o * k)?;
        // dW [O, K] += dY_r [O, P] · cols_rᵀ [P, K] for rows r0..r1
        let accumulate = |r0: usize, r1: usize, dw: &mut [T]| {
            dw.iter_mut().for_each(|v| *v = T::ZERO);
            let mut cols = g.cols_buffer();
            ramus_core::simd!(for r in r0..r1 {
                let b = g.lowered(&x[r * in_len..(r + 1) * in_len], &mut cols);
                T::gemm(GemmArgs {
                    m: o,
                    k: np,
                    n: k,
                    alpha: T::ONE,
                    a: &dy[r * out_len..(r + 1) * out_len],
                    a_strides: (np as isize, 1),
                    b,
                    b_strides: (1, np as isize),
                    beta: T::ONE,
                    c: dw,
                    c_row_stride: k as isize,
                });
            })
        };
        let parts = if rows.saturating_mul(g.macs()) >= 1 << 18 {
            rows.min(WEIGHT_GRAD_PARTS)
        } else {
            1
        };
        if parts <= 1 {
            accumulate(0, rows, ctx.out);
            return Ok(());
        }
        let block = rows.div_ceil(parts);
        let mut partial = vec![T::ZERO; parts * o * k];
        crate::parallel::for_each_chunk_mut(&mut partial, o * k, |i, dw| {
            accumulate((i * block).min(rows), ((i + 1) * block).min(rows), dw)
        });
        ctx.out.copy_from_slice(&partial[..o * k]);
        for p in partial[o * k..].chunks(o * k) {
            for (d, &v) in ctx.out.iter_mut().zip(p) {
                *d += v;
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------- max pool

/// Visits every output position `(c, oy, ox)` of one image with the index
/// (into the image) of its window's first maximum.
fn pool_argmax<T: Real>(g: &Pool2dGeom, x: &[T], mut f: impl FnMut(usize, usize)) {
    let (ho, wo) = (g.out_h(), g.out_w());
    let (h, w, s, p, k) = (g.height, g.width, g.stride, g.padding, g.kernel);
    for c in 0..g.channels {
        let base = c * h * w;
        for oy in 0..ho {
            // window rows iy in [y0, y1) of the image (padding never wins)
            let y0 = (oy * s).saturating_sub(p);
            let y1 = (oy * s + k - p).min(h);
            for ox in 0..wo {
                let x0 = (ox * s).saturating_sub(p);
                let x1 = (ox * s + k - p).min(w);
                let mut best = base + y0 * w + x0;
                let mut best_v = x[best];
                for iy in y0..y1 {
                    for ix in x0..x1 {
                        let i = base + iy * w + ix;
                        if x[i] > best_v {
                            best = i;
                            best_v = x[i];
                        }
                    }
                }
                f((c * ho + oy) * wo + ox, best);
            }
        }
    }
}

impl Kernel for MaxPool2d {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "max_pool2d";
        valid(OP, self.0.validate())?;
        let g = self.0;
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        let (in_len, out_len) = (g.in_len(), g.out_len());
        let x = floats(ctx, OP, 0, rows * in_len)?;
        check_out(ctx, OP, rows * out_len)?;
        let work = out_len * g.kernel * g.kernel;
        split_rows(
            ctx.out,
            out_len,
            rows,
            work,
            || (),
            #[inline(always)]
            |_, r, out| {
                let xr = &x[r * in_len..(r + 1) * in_len];
                pool_argmax(&g, xr, |o, a| out[o] = xr[a]);
            },
        );
        Ok(())
    }
}

impl Kernel for MaxPool2dBackward {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "max_pool2d_backward";
        valid(OP, self.0.validate())?;
        let g = self.0;
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        rows_of(ctx, OP, 1, Some(rows))?;
        let (in_len, out_len) = (g.in_len(), g.out_len());
        let x = floats(ctx, OP, 0, rows * in_len)?;
        let dy = floats(ctx, OP, 1, rows * out_len)?;
        check_out(ctx, OP, rows * in_len)?;
        let work = out_len * g.kernel * g.kernel;
        split_rows(
            ctx.out,
            in_len,
            rows,
            work,
            || (),
            #[inline(always)]
            |_, r, dx| {
                let (xr, dyr) = (
                    &x[r * in_len..(r + 1) * in_len],
                    &dy[r * out_len..(r + 1) * out_len],
                );
                dx.iter_mut().for_each(|v| *v = T::ZERO);
                pool_argmax(&g, xr, |o, a| dx[a] += dyr[o]);
            },
        );
        Ok(())
    }
}

impl Kernel for GlobalAvgPool {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "global_avg_pool";
        valid(OP, self.check())?;
        let (c, s) = (self.channels, self.spatial());
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        let x = floats(ctx, OP, 0, rows * c * s)?;
        check_out(ctx, OP, rows * c)?;
        let inv = T::ONE / T::from_f64(s as f64);
        for (o, xs) in ctx.out.iter_mut().zip(x.chunks(s)) {
            *o = xs.iter().copied().sum::<T>() * inv;
        }
        Ok(())
    }
}

impl Kernel for GlobalAvgPoolBackward {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "global_avg_pool_backward";
        valid(OP, self.pool.check())?;
        let (c, s) = (self.pool.channels, self.pool.spatial());
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        let dy = floats(ctx, OP, 0, rows * c)?;
        check_out(ctx, OP, rows * c * s)?;
        let inv = T::ONE / T::from_f64(s as f64);
        for (o, &d) in ctx.out.chunks_mut(s).zip(dy) {
            o.iter_mut().for_each(|v| *v = d * inv);
        }
        Ok(())
    }
}

impl Kernel for ChannelSum {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "channel_sum";
        valid(OP, check_cs(self.channels, self.spatial))?;
        let (c, s) = (self.channels, self.spatial);
        let rows = rows_of(ctx, OP, 0, None)?;
        let x = floats(ctx, OP, 0, rows * c * s)?;
        check_out(ctx, OP, c)?;
        let mut acc = vec![0f64; c];
        for row in x.chunks(c * s) {
            for (a, xs) in acc.iter_mut().zip(row.chunks(s)) {
                *a += xs.iter().map(|v| v.to_f64()).sum::<f64>();
            }
        }
        for (o, a) in ctx.out.iter_mut().zip(acc) {
            *o = T::from_f64(a);
        }
        Ok(())
    }
}

impl Kernel for ChannelBroadcast {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "channel_broadcast";
        valid(OP, check_cs(self.channels, self.spatial))?;
        let (c, s) = (self.channels, self.spatial);
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 1, Some(rows))?;
        let b = floats(ctx, OP, 0, c)?;
        check_out(ctx, OP, rows * c * s)?;
        for row in ctx.out.chunks_mut(c * s) {
            for (o, &v) in row.chunks_mut(s).zip(b) {
                o.iter_mut().for_each(|x| *x = v);
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------- batch norm

/// `Σ f(x)` over the rows and positions of channel `ch` of `x`, in f64:
/// each row's positions summed, then the rows.
fn channel_sum_of<T: Real>(
    n: &NormGeom,
    x: &[T],
    rows: usize,
    ch: usize,
    f: impl Fn(f64) -> f64,
) -> f64 {
    let (c, s) = (n.channels, n.spatial);
    (0..rows)
        .map(|r| {
            let at = r * c * s + ch * s;
            x[at..at + s].iter().map(|v| f(v.to_f64())).sum::<f64>()
        })
        .sum()
}

/// Per-channel `(mean, biased variance)` over all rows and positions of
/// `x` (two passes in f64). Channels are split over threads for large
/// inputs.
fn channel_moments<T: Real>(n: &NormGeom, x: &[T], rows: usize) -> Vec<(f64, f64)> {
    let (c, s) = (n.channels, n.spatial);
    let count = (rows * s) as f64;
    let mut stats = vec![(0.0, 0.0); c];
    if rows == 0 {
        return stats;
    }
    let stat = |ch: usize| {
        let mean = channel_sum_of(n, x, rows, ch, |v| v) / count;
        let var = channel_sum_of(n, x, rows, ch, |v| (v - mean).powi(2)) / count;
        (mean, var)
    };
    let threads = crate::parallel::threads();
    if threads > 1 && c > 1 && rows * c * s >= crate::parallel::min_split_elements() {
        let block = c.div_ceil(threads);
        crate::parallel::for_each_chunk_mut(&mut stats, block, |i, st| {
            for (j, v) in st.iter_mut().enumerate() {
                *v = stat(i * block + j);
            }
        });
    } else {
        stats
            .iter_mut()
            .enumerate()
            .for_each(|(ch, v)| *v = stat(ch));
    }
    stats
}

/// Per-channel `(mean, biased variance)` of a training batch and the
/// values per channel they are over: this rank's rows
/// ([`channel_moments`]), or with `sync` every rank's (the channel sums
/// and rows summed over the ranks, then the squared deviations from that
/// mean; one rank alone gets [`channel_moments`]'s numbers exactly).
fn batch_moments<T: Real>(
    n: &NormGeom,
    x: &[T],
    rows: usize,
    sync: Option<&mut (dyn NormSum + '_)>,
) -> Result<(Vec<(f64, f64)>, f64)> {
    let (c, s) = (n.channels, n.spatial);
    let Some(sync) = sync else {
        return Ok((channel_moments(n, x, rows), (rows * s) as f64));
    };
    let mut sums: Vec<f64> = (0..c)
        .map(|ch| channel_sum_of(n, x, rows, ch, |v| v))
        .collect();
    sums.push(rows as f64);
    sync.sum(&mut sums)?;
    let count = sums[c] * s as f64;
    if count == 0.0 {
        return Ok((vec![(0.0, 0.0); c], 0.0));
    }
    let mean: Vec<f64> = sums[..c].iter().map(|t| t / count).collect();
    let mut dev: Vec<f64> = (0..c)
        .map(|ch| channel_sum_of(n, x, rows, ch, |v| (v - mean[ch]).powi(2)))
        .collect();
    sync.sum(&mut dev)?;
    let moments = mean.iter().zip(dev).map(|(&m, d)| (m, d / count));
    Ok((moments.collect(), count))
}

/// [`batch_moments`] as `(mean, 1/sqrt(var + eps))` per channel.
fn batch_stats<T: Real>(
    n: &NormGeom,
    x: &[T],
    rows: usize,
    sync: Option<&mut (dyn NormSum + '_)>,
) -> Result<(Vec<(f64, f64)>, f64)> {
    let (mut stats, count) = batch_moments(n, x, rows, sync)?;
    if count > 0.0 {
        for st in &mut stats {
            st.1 = 1.0 / (st.1 + n.eps).sqrt();
        }
    }
    Ok((stats, count))
}

/// Per-channel `(Σ dy, Σ dy·x̂)` over rows and positions, with
/// `x̂ = (x - mean)·inv` from `stats[ch] = (mean, inv)` (any centre and scale:
/// the inference gradients pass the given means and a scale of 1).
fn channel_grad_sums<T: Real>(
    n: &NormGeom,
    x: &[T],
    dy: &[T],
    rows: usize,
    stats: &[(f64, f64)],
) -> Vec<(f64, f64)> {
    let (c, s) = (n.channels, n.spatial);
    let mut sums = vec![(0.0, 0.0); c];
    for r in 0..rows {
        for (ch, ((sd, sdx), &(mean, inv))) in sums.iter_mut().zip(stats).enumerate() {
            let o = r * c * s + ch * s;
            for (&xv, &d) in x[o..o + s].iter().zip(&dy[o..o + s]) {
                let d = d.to_f64();
                *sd += d;
                *sdx += d * (xv.to_f64() - mean) * inv;
            }
        }
    }
    sums
}

/// One training pass's update of a layer's running statistics: the batch's
/// per-channel mean and variance over `rows` rows of `x` (`[C*S]` each; the
/// variance unbiased, `Σ(x - mean)² / (M - 1)` with `M = rows·S`, or the
/// biased one when `M = 1`) blended into `mean` and `var` with
/// [`RUNNING_STATS_MOMENTUM`], in f64, each result rounded once. Nothing
/// changes for an empty batch. The CUDA kernel computes the same.
pub fn update_running_stats<T: Real>(
    n: &NormGeom,
    (x, rows): (&[T], usize),
    mean: &mut [T],
    var: &mut [T],
    sync: Option<&mut (dyn NormSum + '_)>,
) -> Result<()> {
    const OP: &str = "batch_norm running statistics";
    valid(OP, n.validate())?;
    let (c, s) = (n.channels, n.spatial);
    if x.len() != rows * c * s || mean.len() != c || var.len() != c {
        return Err(CoreError::kernel(
            OP,
            format!(
                "{} input values for {rows} rows of {c}x{s}, running statistics of {} and {} channels",
                x.len(),
                mean.len(),
                var.len()
            ),
        ));
    }
    if rows == 0 && sync.is_none() {
        return Ok(());
    }
    let (moments, count) = batch_moments(n, x, rows, sync)?;
    if count == 0.0 {
        return Ok(());
    }
    let unbias = if count > 1.0 {
        count / (count - 1.0)
    } else {
        1.0
    };
    let m = RUNNING_STATS_MOMENTUM;
    for ((rm, rv), (batch_mean, batch_var)) in mean.iter_mut().zip(var.iter_mut()).zip(moments) {
        *rm = T::from_f64((1.0 - m) * rm.to_f64() + m * batch_mean);
        *rv = T::from_f64((1.0 - m) * rv.to_f64() + m * batch_var * unbias);
    }
    Ok(())
}

impl Kernel for BatchNorm {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "batch_norm";
        valid(OP, self.0.validate())?;
        let n = self.0;
        let (c, s) = (n.channels, n.spatial);
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        let x = floats(ctx, OP, 0, rows * c * s)?;
        let gamma = floats(ctx, OP, 1, c)?;
        let beta = floats(ctx, OP, 2, c)?;
        check_out(ctx, OP, rows * c * s)?;
        let sync = ctx.norm_sum.as_deref_mut();
        let (stats, _) = batch_stats(&n, x, rows, sync)?;
        // y = x * a + b per channel, a = gamma * inv, b = beta - mean * a
        let ab: Vec<(T, T)> = stats
            .iter()
            .zip(gamma.iter().zip(beta))
            .map(|(&(mean, inv), (&gm, &bt))| {
                let a = gm.to_f64() * inv;
                (T::from_f64(a), T::from_f64(bt.to_f64() - mean * a))
            })
            .collect();
        channel_affine(ctx.out, x, s, &ab, rows);
        Ok(())
    }
}

impl Kernel for BatchNormBackwardInput {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "batch_norm_backward_input";
        valid(OP, self.0.validate())?;
        let n = self.0;
        let (c, s) = (n.channels, n.spatial);
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        rows_of(ctx, OP, 2, Some(rows))?;
        let x = floats(ctx, OP, 0, rows * c * s)?;
        let gamma = floats(ctx, OP, 1, c)?;
        let dy = floats(ctx, OP, 2, rows * c * s)?;
        check_out(ctx, OP, rows * c * s)?;
        let mut sync = ctx.norm_sum.as_deref_mut();
        let (stats, m) = batch_stats(&n, x, rows, sync.as_deref_mut())?;
        let mut sums = channel_grad_sums(&n, x, dy, rows, &stats);
        if let Some(sync) = sync {
            let mut flat: Vec<f64> = sums.iter().flat_map(|&(sd, sdx)| [sd, sdx]).collect();
            sync.sum(&mut flat)?;
            sums = flat.chunks(2).map(|p| (p[0], p[1])).collect();
        }
        // dx = k * (dy - sd/M - (x - mean)*inv * sdx/M), k = gamma * inv
        //    = k*dy + (x*q + p) with q = -k*inv*sdx/M, p = -k*sd/M - mean*q
        let coef: Vec<(T, T, T)> = stats
            .iter()
            .zip(&sums)
            .zip(gamma)
            .map(|((&(mean, inv), &(sd, sdx)), &gm)| {
                let k = gm.to_f64() * inv;
                let q = -k * inv * sdx / m;
                let p = -k * sd / m - mean * q;
                (T::from_f64(k), T::from_f64(q), T::from_f64(p))
            })
            .collect();
        split_rows(
            ctx.out,
            c * s,
            rows,
            c * s,
            || (),
            #[inline(always)]
            |_, r, out| {
                let o0 = r * c * s;
                let (xr, dyr) = (&x[o0..o0 + c * s], &dy[o0..o0 + c * s]);
                for (((o, xs), ds), &(k, q, p)) in out
                    .chunks_mut(s)
                    .zip(xr.chunks(s))
                    .zip(dyr.chunks(s))
                    .zip(&coef)
                {
                    for ((o, &xv), &d) in o.iter_mut().zip(xs).zip(ds) {
                        *o = k * d + xv * q + p;
                    }
                }
            },
        );
        Ok(())
    }
}

impl Kernel for BatchNormBackwardGamma {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "batch_norm_backward_gamma";
        valid(OP, self.0.validate())?;
        let n = self.0;
        let rows = rows_of(ctx, OP, 0, None)?;
        rows_of(ctx, OP, 1, Some(rows))?;
        let x = floats(ctx, OP, 0, rows * n.row_len())?;
        let dy = floats(ctx, OP, 1, rows * n.row_len())?;
        check_out(ctx, OP, n.channels)?;
        // this rank's sums: the parameter gradients are summed over the ranks
        let sync = ctx.norm_sum.as_deref_mut();
        let (stats, _) = batch_stats(&n, x, rows, sync)?;
        let sums = channel_grad_sums(&n, x, dy, rows, &stats);
        for (o, &(_, sdx)) in ctx.out.iter_mut().zip(&sums) {
            *o = T::from_f64(sdx);
        }
        Ok(())
    }
}

/// Per-channel `(scale, shift)` with `y = x·scale + shift`, checking the variances.
fn inference_affine<T: Real>(
    op: &str,
    n: &NormGeom,
    gamma: &[T],
    beta: Option<&[T]>,
    mean: &[T],
    var: &[T],
) -> Result<Vec<(T, T)>> {
    (0..n.channels)
        .map(|ch| {
            let v = var[ch].to_f64() + n.eps;
            if v.is_nan() || v <= 0.0 {
                return Err(CoreError::kernel(
                    op,
                    format!(
                        "variance {} of channel {ch} plus eps is not positive",
                        var[ch].to_f64()
                    ),
                ));
            }
            let a = gamma[ch].to_f64() / v.sqrt();
            let b = beta.map(|b| b[ch].to_f64()).unwrap_or(0.0) - mean[ch].to_f64() * a;
            Ok((T::from_f64(a), T::from_f64(b)))
        })
        .collect()
}

/// `out = x·a + b` per channel (`ab[ch] = (a, b)`) over `rows` rows of
/// `[C*s]`, rows split over threads.
fn channel_affine<T: Real>(out: &mut [T], x: &[T], s: usize, ab: &[(T, T)], rows: usize) {
    let len = s * ab.len();
    split_rows(
        out,
        len,
        rows,
        len,
        || (),
        #[inline(always)]
        |_, r, o| {
            let xr = &x[r * len..(r + 1) * len];
            for ((o, xs), &(a, b)) in o.chunks_mut(s).zip(xr.chunks(s)).zip(ab) {
                for (o, &v) in o.iter_mut().zip(xs) {
                    *o = v * a + b;
                }
            }
        },
    );
}

impl Kernel for BatchNormInference {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "batch_norm_inference";
        valid(OP, self.0.validate())?;
        let n = self.0;
        let (c, s) = (n.channels, n.spatial);
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 0, Some(rows))?;
        let x = floats(ctx, OP, 0, rows * c * s)?;
        let (gamma, beta) = (floats(ctx, OP, 1, c)?, floats(ctx, OP, 2, c)?);
        let (mean, var) = (floats(ctx, OP, 3, c)?, floats(ctx, OP, 4, c)?);
        check_out(ctx, OP, rows * c * s)?;
        let ab = inference_affine(OP, &n, gamma, Some(beta), mean, var)?;
        channel_affine(ctx.out, x, s, &ab, rows);
        Ok(())
    }
}

impl Kernel for BatchNormInferenceBackwardInput {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        const OP: &str = "batch_norm_inference_backward_input";
        valid(OP, self.0.validate())?;
        let n = self.0;
        let (c, s) = (n.channels, n.spatial);
        let rows = ctx.out_rows;
        rows_of(ctx, OP, 2, Some(rows))?;
        let (gamma, var) = (floats(ctx, OP, 0, c)?, floats(ctx, OP, 1, c)?);
        let dy = floats(ctx, OP, 2, rows * c * s)?;
        check_out(ctx, OP, rows * c * s)?;
        let zeros = vec![T::ZERO; c];
        let ab = inference_affine(OP, &n, gamma, None, &zeros, var)?;
        channel_affine(ctx.out, dy, s, &ab, rows);
        Ok(())
    }
}

impl Kernel for BatchNormInferenceBackwardParam {
    fn run<T: Real>(&self, ctx: &mut KernelCtx<'_, T>) -> Result<()> {
        let op = self.name();
        valid(op, self.geom.validate())?;
        let n = self.geom;
        let (c, s) = (n.channels, n.spatial);
        let rows = rows_of(ctx, op, 0, None)?;
        rows_of(ctx, op, 4, Some(rows))?;
        let x = floats(ctx, op, 0, rows * c * s)?;
        let gamma = floats(ctx, op, 1, c)?;
        let (mean, var) = (floats(ctx, op, 2, c)?, floats(ctx, op, 3, c)?);
        let dy = floats(ctx, op, 4, rows * c * s)?;
        check_out(ctx, op, c)?;
        // validates the variances
        inference_affine(op, &n, gamma, None, mean, var)?;
        // (v, u) = (Σ dy, Σ dy·(x - mean)): unit scale in channel_grad_sums
        let centre: Vec<(f64, f64)> = mean.iter().map(|m| (m.to_f64(), 1.0)).collect();
        let sums = channel_grad_sums(&n, x, dy, rows, &centre);
        for (ch, (o, &(v, u))) in ctx.out.iter_mut().zip(&sums).enumerate() {
            let ve = var[ch].to_f64() + n.eps;
            let gm = gamma[ch].to_f64();
            *o = T::from_f64(match self.param {
                NormParam::Gamma => u / ve.sqrt(),
                NormParam::Mean => -gm * v / ve.sqrt(),
                NormParam::Var => -0.5 * gm * u / (ve * ve.sqrt()),
            });
        }
        Ok(())
    }
}
