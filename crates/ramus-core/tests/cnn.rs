//! Tests for the CNN ops (`ops/cnn.rs`): forward kernels against naive
//! loops (direct 7-loop convolution, window scans, per-channel statistics),
//! every gradient against f64 central finite differences through the real
//! autodiff, shape errors, the registry entries, execution classification of
//! batch statistics, and a small CNN built with `GraphBuilder` whose full
//! gradient matches finite differences.

mod common;

use std::collections::HashMap;

use common::*;
use ramus_core::model::{HeadRows, Init, ModelBuilder};
use ramus_core::ops::{
    BatchNorm, BatchNormBackwardGamma, BatchNormBackwardInput, ChannelBroadcast, ChannelSum,
    Conv2d, Conv2dBackwardInput, Conv2dBackwardWeight, Conv2dGeom, GlobalAvgPool,
    GlobalAvgPoolBackward, MaxPool2d, MaxPool2dBackward, NormGeom, Op, Pool2dGeom,
};
use ramus_core::plan::Phase;
use ramus_core::{GraphBuilder, NodeKind, OpDef, OpRegistry, Role, Source, Space, ValueType};

const V: Space = Space::Vertex;
const PULL: Slot = Slot::Input(Source::Pull);
const G0: Slot = Slot::Input(Source::Gather(0));

fn rows(w: usize) -> ValueType {
    ValueType::rows(V, w)
}
fn fixed(shape: &[usize]) -> ValueType {
    ValueType::fixed(shape)
}
fn fwd(op: &(impl OpDef + Clone + Into<Op>), args: &[(ValueType, Val)], topo: &Topo) -> Vec<f64> {
    run_op(op, args, topo)
        .unwrap_or_else(|e| panic!("{} failed: {e}", op.signature()))
        .1
}

#[allow(clippy::too_many_arguments)]
fn conv(
    c: usize,
    h: usize,
    w: usize,
    o: usize,
    kh: usize,
    kw: usize,
    s: usize,
    p: usize,
) -> Conv2dGeom {
    Conv2dGeom {
        in_channels: c,
        height: h,
        width: w,
        out_channels: o,
        kernel_h: kh,
        kernel_w: kw,
        stride: s,
        padding: p,
    }
}

fn pool(c: usize, h: usize, w: usize, k: usize, s: usize, p: usize) -> Pool2dGeom {
    Pool2dGeom {
        channels: c,
        height: h,
        width: w,
        kernel: k,
        stride: s,
        padding: p,
    }
}

/// Convolution cases: plain, stride 2 + padding 1 with non-square kernels,
/// 1x1 (the im2col-free path) and 1x1 with stride, kernels larger than the
/// unpadded image.
fn conv_cases() -> Vec<Conv2dGeom> {
    vec![
        conv(2, 5, 5, 3, 3, 3, 1, 0),
        conv(3, 6, 7, 2, 3, 2, 2, 1),
        conv(2, 7, 6, 4, 2, 3, 2, 1),
        conv(3, 4, 4, 5, 1, 1, 1, 0),
        conv(2, 5, 4, 3, 1, 1, 2, 0),
        conv(1, 3, 3, 2, 3, 3, 1, 1),
        conv(2, 4, 5, 3, 5, 4, 1, 2),
    ]
}

// ======================================================================
// Reference loops
// ======================================================================

/// Input pixel `(c, oy*s + ki - p, ox*s + kj - p)` or None in the padding.
fn pixel(g: &Conv2dGeom, oy: usize, ox: usize, ki: usize, kj: usize) -> Option<(usize, usize)> {
    let iy = (oy * g.stride + ki) as isize - g.padding as isize;
    let ix = (ox * g.stride + kj) as isize - g.padding as isize;
    (iy >= 0 && ix >= 0 && (iy as usize) < g.height && (ix as usize) < g.width)
        .then_some((iy as usize, ix as usize))
}

/// Direct convolution: seven nested loops (row, out channel, output y, x,
/// in channel, kernel y, x).
fn conv_ref(g: &Conv2dGeom, x: &[f64], w: &[f64], bias: Option<&[f64]>, n: usize) -> Vec<f64> {
    let (ho, wo) = (g.out_h(), g.out_w());
    let (c, h, wd, kh, kw) = (g.in_channels, g.height, g.width, g.kernel_h, g.kernel_w);
    let mut out = vec![0.0; n * g.out_len()];
    for r in 0..n {
        for o in 0..g.out_channels {
            for oy in 0..ho {
                for ox in 0..wo {
                    let mut acc = bias.map(|b| b[o]).unwrap_or(0.0);
                    for ci in 0..c {
                        for ki in 0..kh {
                            for kj in 0..kw {
                                if let Some((iy, ix)) = pixel(g, oy, ox, ki, kj) {
                                    acc += w[((o * c + ci) * kh + ki) * kw + kj]
                                        * x[r * g.in_len() + (ci * h + iy) * wd + ix];
                                }
                            }
                        }
                    }
                    out[r * g.out_len() + (o * ho + oy) * wo + ox] = acc;
                }
            }
        }
    }
    out
}

/// Visits every (row, o, oy, ox, c, ki, kj) tap with its input and output index.
fn taps(g: &Conv2dGeom, n: usize, mut f: impl FnMut(usize, usize, usize)) {
    let (ho, wo) = (g.out_h(), g.out_w());
    let (c, h, wd, kh, kw) = (g.in_channels, g.height, g.width, g.kernel_h, g.kernel_w);
    for r in 0..n {
        for o in 0..g.out_channels {
            for oy in 0..ho {
                for ox in 0..wo {
                    for ci in 0..c {
                        for ki in 0..kh {
                            for kj in 0..kw {
                                if let Some((iy, ix)) = pixel(g, oy, ox, ki, kj) {
                                    let xi = r * g.in_len() + (ci * h + iy) * wd + ix;
                                    let yi = r * g.out_len() + (o * ho + oy) * wo + ox;
                                    let wi = ((o * c + ci) * kh + ki) * kw + kj;
                                    f(xi, yi, wi);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

fn conv_backward_input_ref(g: &Conv2dGeom, dy: &[f64], w: &[f64], n: usize) -> Vec<f64> {
    let mut dx = vec![0.0; n * g.in_len()];
    taps(g, n, |xi, yi, wi| dx[xi] += w[wi] * dy[yi]);
    dx
}

fn conv_backward_weight_ref(g: &Conv2dGeom, x: &[f64], dy: &[f64], n: usize) -> Vec<f64> {
    let mut dw = vec![0.0; g.out_channels * g.patch_len()];
    taps(g, n, |xi, yi, wi| dw[wi] += x[xi] * dy[yi]);
    dw
}

/// Max pooling by scanning each window over the padded image (padding is
/// -inf); returns the output and each output's argmax (first maximum).
fn pool_ref(g: &Pool2dGeom, x: &[f64], n: usize) -> (Vec<f64>, Vec<usize>) {
    let (ho, wo) = (g.out_h(), g.out_w());
    let (mut out, mut arg) = (Vec::new(), Vec::new());
    for r in 0..n {
        for c in 0..g.channels {
            for oy in 0..ho {
                for ox in 0..wo {
                    let (mut best, mut at) = (f64::NEG_INFINITY, usize::MAX);
                    for ki in 0..g.kernel {
                        for kj in 0..g.kernel {
                            let iy = (oy * g.stride + ki) as isize - g.padding as isize;
                            let ix = (ox * g.stride + kj) as isize - g.padding as isize;
                            if iy < 0 || ix < 0 || iy as usize >= g.height || ix as usize >= g.width
                            {
                                continue;
                            }
                            let i = r * g.in_len()
                                + (c * g.height + iy as usize) * g.width
                                + ix as usize;
                            if x[i] > best {
                                best = x[i];
                                at = i;
                            }
                        }
                    }
                    out.push(best);
                    arg.push(at);
                }
            }
        }
    }
    (out, arg)
}

/// Per-channel batch mean and biased variance over rows and positions.
fn bn_stats(n: &NormGeom, x: &[f64], rows: usize) -> Vec<(f64, f64)> {
    let (c, s) = (n.channels, n.spatial);
    (0..c)
        .map(|ch| {
            let vals: Vec<f64> = (0..rows)
                .flat_map(|r| (0..s).map(move |p| (r, p)))
                .map(|(r, p)| x[r * c * s + ch * s + p])
                .collect();
            let m = vals.iter().sum::<f64>() / vals.len() as f64;
            let v = vals.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / vals.len() as f64;
            (m, v)
        })
        .collect()
}

/// `gamma * (x - mean) / sqrt(var + eps) + beta` per channel.
fn bn_apply(n: &NormGeom, x: &[f64], st: &[(f64, f64)], gamma: &[f64], beta: &[f64]) -> Vec<f64> {
    let (c, s) = (n.channels, n.spatial);
    x.iter()
        .enumerate()
        .map(|(i, &v)| {
            let ch = (i / s) % c;
            gamma[ch] * (v - st[ch].0) / (st[ch].1 + n.eps).sqrt() + beta[ch]
        })
        .collect()
}

// ======================================================================
// Forward kernels against the loops
// ======================================================================

#[test]
fn conv2d_forward_matches_direct_convolution() {
    let mut rng = Rng::new(1);
    for g in conv_cases() {
        for n in [1, 3] {
            let topo = Topo::vertices(n);
            let x = rng.vec(n * g.in_len(), -1.0, 1.0);
            let w = rng.vec(g.out_channels * g.patch_len(), -1.0, 1.0);
            let b = rng.vec(g.out_channels, -1.0, 1.0);
            let wty = fixed(&[g.out_channels, g.patch_len()]);
            // 4-D weight and [1, O] bias are the same data
            let w4 = fixed(&[g.out_channels, g.in_channels, g.kernel_h, g.kernel_w]);
            for (wt, bias) in [(wty.clone(), None), (w4, Some(fixed(&[1, g.out_channels])))] {
                let mut args = vec![
                    (rows(g.in_len()), Val::F(x.clone())),
                    (wt, Val::F(w.clone())),
                ];
                if let Some(bt) = &bias {
                    args.push((bt.clone(), Val::F(b.clone())));
                }
                let (ty, got) = run_op(&Conv2d(g), &args, &topo).unwrap();
                assert_eq!(ty, rows(g.out_len()));
                let want = conv_ref(&g, &x, &w, bias.as_ref().map(|_| &b[..]), n);
                assert_close(&got, &want, 1e-12, &format!("conv2d {g:?} x {n}"));
                // f32 kernel
                let got32 = run_op_f32(&Conv2d(g), &args, &topo).unwrap();
                assert_close(&got32, &want, 2e-5, &format!("f32 conv2d {g:?}"));
            }
        }
    }
}

#[test]
fn conv2d_backward_ops_match_loops() {
    let mut rng = Rng::new(2);
    for g in conv_cases() {
        let n = 3;
        let topo = Topo::vertices(n);
        let x = rng.vec(n * g.in_len(), -1.0, 1.0);
        let dy = rng.vec(n * g.out_len(), -1.0, 1.0);
        let w = rng.vec(g.out_channels * g.patch_len(), -1.0, 1.0);
        let wty = fixed(&[g.out_channels, g.patch_len()]);
        let got = fwd(
            &Conv2dBackwardInput(g),
            &[
                (rows(g.out_len()), Val::F(dy.clone())),
                (wty, Val::F(w.clone())),
            ],
            &topo,
        );
        let want = conv_backward_input_ref(&g, &dy, &w, n);
        assert_close(&got, &want, 1e-12, &format!("conv2d_backward_input {g:?}"));
        let (ty, got) = run_op(
            &Conv2dBackwardWeight(g),
            &[
                (rows(g.in_len()), Val::F(x.clone())),
                (rows(g.out_len()), Val::F(dy.clone())),
            ],
            &topo,
        )
        .unwrap();
        assert_eq!(ty, fixed(&[g.out_channels, g.patch_len()]));
        let want = conv_backward_weight_ref(&g, &x, &dy, n);
        assert_close(&got, &want, 1e-12, &format!("conv2d_backward_weight {g:?}"));
    }
}

/// An op, its arguments and the expected result.
type OpCase = (Op, Vec<(ValueType, Val)>, Vec<f64>);

/// Sizes large enough to split rows over threads and to sum the weight
/// gradient in partial blocks; f32 and f64 agree with the loops.
#[test]
fn conv2d_threaded_paths_match_loops() {
    let mut rng = Rng::new(3);
    for g in [
        conv(8, 12, 12, 16, 3, 3, 1, 1),
        conv(16, 8, 8, 32, 1, 1, 1, 0),
    ] {
        let n = 11;
        let topo = Topo::vertices(n);
        let x = rng.vec(n * g.in_len(), -1.0, 1.0);
        let w = rng.vec(g.out_channels * g.patch_len(), -1.0, 1.0);
        let dy = rng.vec(n * g.out_len(), -1.0, 1.0);
        let wty = fixed(&[g.out_channels, g.patch_len()]);
        let xa = (rows(g.in_len()), Val::F(x.clone()));
        let wa = (wty, Val::F(w.clone()));
        let dya = (rows(g.out_len()), Val::F(dy.clone()));
        let cases: [OpCase; 3] = [
            (
                Conv2d(g).into(),
                vec![xa.clone(), wa.clone()],
                conv_ref(&g, &x, &w, None, n),
            ),
            (
                Conv2dBackwardInput(g).into(),
                vec![dya.clone(), wa.clone()],
                conv_backward_input_ref(&g, &dy, &w, n),
            ),
            (
                Conv2dBackwardWeight(g).into(),
                vec![xa.clone(), dya.clone()],
                conv_backward_weight_ref(&g, &x, &dy, n),
            ),
        ];
        for (op, args, want) in cases {
            let got = fwd(&op, &args, &topo);
            assert_close(&got, &want, 1e-11, &op.signature());
            let got32 = run_op_f32(&op, &args, &topo).unwrap();
            assert_close(&got32, &want, 1e-4, &format!("f32 {}", op.signature()));
        }
    }
}

fn pool_cases() -> Vec<Pool2dGeom> {
    vec![
        pool(2, 5, 5, 2, 2, 0),
        pool(3, 6, 7, 3, 2, 1),
        pool(2, 4, 4, 3, 1, 1),
        pool(1, 5, 6, 2, 1, 0),
        pool(2, 7, 7, 3, 3, 1),
        pool(1, 3, 4, 2, 3, 1),
    ]
}

#[test]
fn max_pool2d_forward_and_backward_match_window_scans() {
    let mut rng = Rng::new(4);
    for g in pool_cases() {
        let n = 3;
        let topo = Topo::vertices(n);
        let x = rng.vec(n * g.in_len(), -1.0, 1.0);
        let dy = rng.vec(n * g.out_len(), -1.0, 1.0);
        let (want, arg) = pool_ref(&g, &x, n);
        let xa = (rows(g.in_len()), Val::F(x.clone()));
        let (ty, got) = run_op(&MaxPool2d(g), std::slice::from_ref(&xa), &topo).unwrap();
        assert_eq!(ty, rows(g.out_len()));
        assert_close(&got, &want, 0.0, &format!("max_pool2d {g:?}"));
        let got32 = run_op_f32(&MaxPool2d(g), std::slice::from_ref(&xa), &topo).unwrap();
        assert_close(&got32, &want, 1e-6, "f32 max_pool2d");
        let mut dx = vec![0.0; n * g.in_len()];
        for (o, &a) in arg.iter().enumerate() {
            dx[a] += dy[o];
        }
        let got = fwd(
            &MaxPool2dBackward(g),
            &[xa, (rows(g.out_len()), Val::F(dy))],
            &topo,
        );
        assert_close(&got, &dx, 1e-12, &format!("max_pool2d_backward {g:?}"));
    }
}

/// Equal values: the first maximum of each window (row-major, padding
/// skipped) takes the output and the whole gradient.
#[test]
fn max_pool2d_ties_go_to_the_first_maximum() {
    let g = pool(1, 4, 4, 3, 2, 1);
    let topo = Topo::vertices(1);
    let x = vec![0.5; 16];
    let dy = vec![1.0, 2.0, 3.0, 4.0];
    let got = fwd(
        &MaxPool2dBackward(g),
        &[(rows(16), Val::F(x.clone())), (rows(4), Val::F(dy))],
        &topo,
    );
    // windows start at (-1,-1), (-1,1), (1,-1), (1,1): first in-image pixels
    let mut want = vec![0.0; 16];
    want[0] = 1.0;
    want[1] = 2.0;
    want[4] = 3.0;
    want[5] = 4.0;
    assert_eq!(got, want);
    let (_, arg) = pool_ref(&g, &x, 1);
    assert_eq!(arg, vec![0, 1, 4, 5]);
}

#[test]
fn global_avg_pool_and_channel_ops_forward() {
    let mut rng = Rng::new(5);
    let (c, h, w, n) = (3, 2, 5, 4);
    let s = h * w;
    let topo = Topo::vertices(n);
    let x = rng.vec(n * c * s, -1.0, 1.0);
    let gap = GlobalAvgPool {
        channels: c,
        height: h,
        width: w,
    };
    let got = fwd(&gap, &[(rows(c * s), Val::F(x.clone()))], &topo);
    let want: Vec<f64> = x
        .chunks(s)
        .map(|v| v.iter().sum::<f64>() / s as f64)
        .collect();
    assert_close(&got, &want, 1e-12, "global_avg_pool");
    let d = rng.vec(n * c, -1.0, 1.0);
    let got = fwd(
        &GlobalAvgPoolBackward { pool: gap },
        &[(rows(c), Val::F(d.clone()))],
        &topo,
    );
    let want: Vec<f64> = (0..n * c * s).map(|i| d[i / s] / s as f64).collect();
    assert_close(&got, &want, 1e-12, "global_avg_pool_backward");
    let cs = ChannelSum {
        channels: c,
        spatial: s,
    };
    let (ty, got) = run_op(&cs, &[(rows(c * s), Val::F(x.clone()))], &topo).unwrap();
    assert_eq!(ty, fixed(&[c]));
    let want: Vec<f64> = (0..c)
        .map(|ch| {
            (0..n * s)
                .map(|i| x[(i / s) * c * s + ch * s + i % s])
                .sum()
        })
        .collect();
    assert_close(&got, &want, 1e-12, "channel_sum");
    let b = rng.vec(c, -1.0, 1.0);
    let cb = ChannelBroadcast {
        channels: c,
        spatial: s,
    };
    let got = fwd(
        &cb,
        &[
            (fixed(&[c]), Val::F(b.clone())),
            (rows(1), Val::F(vec![0.0; n])),
        ],
        &topo,
    );
    let want: Vec<f64> = (0..n * c * s).map(|i| b[(i / s) % c]).collect();
    assert_close(&got, &want, 0.0, "channel_broadcast");
    // zero rows: empty rows, zero sums
    let z = Topo::vertices(0);
    let (_, got) = run_op(&cs, &[(rows(c * s), Val::F(vec![]))], &z).unwrap();
    assert_eq!(got, vec![0.0; c]);
}

#[test]
fn batch_norm_forward_matches_batch_statistics() {
    let mut rng = Rng::new(6);
    for (c, s, n, eps) in [(3, 4, 5, 1e-5), (2, 1, 7, 1e-3), (1, 9, 1, 0.1)] {
        let geom = NormGeom {
            channels: c,
            spatial: s,
            eps,
        };
        let topo = Topo::vertices(n);
        let x = rng.vec(n * c * s, -2.0, 3.0);
        let gamma = rng.vec(c, 0.5, 1.5);
        let beta = rng.vec(c, -1.0, 1.0);
        let args = [
            (rows(c * s), Val::F(x.clone())),
            (fixed(&[c]), Val::F(gamma.clone())),
            (fixed(&[1, c]), Val::F(beta.clone())),
        ];
        let got = fwd(&BatchNorm(geom), &args, &topo);
        let st = bn_stats(&geom, &x, n);
        let want = bn_apply(&geom, &x, &st, &gamma, &beta);
        assert_close(&got, &want, 1e-12, &format!("batch_norm C{c} S{s} x {n}"));
        let got32 = run_op_f32(&BatchNorm(geom), &args, &topo).unwrap();
        assert_close(&got32, &want, 2e-5, "f32 batch_norm");
        // normalized: per channel, mean beta and variance gamma^2 (up to eps)
        let out_st = bn_stats(&geom, &got, n);
        for ch in 0..c {
            assert!((out_st[ch].0 - beta[ch]).abs() < 1e-9);
            let v = gamma[ch] * gamma[ch] * st[ch].1 / (st[ch].1 + eps);
            assert!((out_st[ch].1 - v).abs() < 1e-9);
        }
        // the backward ops against the textbook formulas
        let dy = rng.vec(n * c * s, -1.0, 1.0);
        let m = (n * s) as f64;
        let xhat: Vec<f64> = bn_apply(&geom, &x, &st, &vec![1.0; c], &vec![0.0; c]);
        let sum_ch = |f: &dyn Fn(usize) -> f64, ch: usize| -> f64 {
            (0..n * s)
                .map(|i| f((i / s) * c * s + ch * s + i % s))
                .sum()
        };
        let want_dx: Vec<f64> = (0..n * c * s)
            .map(|i| {
                let ch = (i / s) % c;
                let inv = 1.0 / (st[ch].1 + eps).sqrt();
                let sd = sum_ch(&|j| dy[j], ch);
                let sdx = sum_ch(&|j| dy[j] * xhat[j], ch);
                gamma[ch] * inv / m * (m * dy[i] - sd - xhat[i] * sdx)
            })
            .collect();
        let got = fwd(
            &BatchNormBackwardInput(geom),
            &[
                (rows(c * s), Val::F(x.clone())),
                (fixed(&[c]), Val::F(gamma.clone())),
                (rows(c * s), Val::F(dy.clone())),
            ],
            &topo,
        );
        assert_close(&got, &want_dx, 1e-10, "batch_norm_backward_input");
        let got = fwd(
            &BatchNormBackwardGamma(geom),
            &[
                (rows(c * s), Val::F(x.clone())),
                (rows(c * s), Val::F(dy.clone())),
            ],
            &topo,
        );
        let want: Vec<f64> = (0..c).map(|ch| sum_ch(&|j| dy[j] * xhat[j], ch)).collect();
        assert_close(&got, &want, 1e-10, "batch_norm_backward_gamma");
    }
}

/// A large batch splits statistics over channels and rows over threads.
#[test]
fn batch_norm_threaded_path_matches_loops() {
    let mut rng = Rng::new(7);
    let geom = NormGeom {
        channels: 8,
        spatial: 64,
        eps: 1e-5,
    };
    let n = 300;
    let topo = Topo::vertices(n);
    let x = rng.vec(n * geom.channels * geom.spatial, -1.0, 2.0);
    let gamma = rng.vec(8, 0.5, 1.5);
    let beta = rng.vec(8, -1.0, 1.0);
    let got = fwd(
        &BatchNorm(geom),
        &[
            (rows(512), Val::F(x.clone())),
            (fixed(&[8]), Val::F(gamma.clone())),
            (fixed(&[8]), Val::F(beta.clone())),
        ],
        &topo,
    );
    let want = bn_apply(&geom, &x, &bn_stats(&geom, &x, n), &gamma, &beta);
    assert_close(&got, &want, 1e-10, "threaded batch_norm");
}

#[test]
fn batch_norm_inference_forward_and_bad_variance() {
    let mut rng = Rng::new(8);
    let geom = NormGeom {
        channels: 3,
        spatial: 4,
        eps: 1e-5,
    };
    let n = 2;
    let topo = Topo::vertices(n);
    let x = rng.vec(n * 12, -1.0, 1.0);
    let (gamma, beta) = (rng.vec(3, 0.5, 1.5), rng.vec(3, -1.0, 1.0));
    let (mean, var) = (rng.vec(3, -0.5, 0.5), rng.vec(3, 0.1, 2.0));
    let st: Vec<(f64, f64)> = mean.iter().copied().zip(var.iter().copied()).collect();
    let arg = |v: &Vec<f64>| (fixed(&[3]), Val::F(v.clone()));
    let mut args = vec![
        (rows(12), Val::F(x.clone())),
        arg(&gamma),
        arg(&beta),
        arg(&mean),
        arg(&var),
    ];
    let op = ramus_core::ops::BatchNormInference(geom);
    let got = fwd(&op, &args, &topo);
    assert_close(
        &got,
        &bn_apply(&geom, &x, &st, &gamma, &beta),
        1e-12,
        "batch_norm_inference",
    );
    args[4] = arg(&vec![0.5, -1.0, 0.5]);
    let err = run_op(&op, &args, &topo).unwrap_err();
    assert!(
        err.contains("channel 1") && err.contains("not positive"),
        "{err}"
    );
}

// ======================================================================
// Gradients against finite differences
// ======================================================================

#[test]
fn conv2d_gradients() {
    let mut rng = Rng::new(10);
    for (i, g) in conv_cases().into_iter().enumerate() {
        let n = 2;
        let w = rng.vec(g.out_channels * g.patch_len(), -1.0, 1.0);
        let b = rng.vec(g.out_channels, -1.0, 1.0);
        // a 4-D weight with bias, or a flat weight without
        let with_bias = i % 2 == 0;
        let wshape = if with_bias {
            vec![g.out_channels, g.in_channels, g.kernel_h, g.kernel_w]
        } else {
            vec![g.out_channels, g.patch_len()]
        };
        let mut params = vec![(wshape, w)];
        if with_bias {
            params.push((vec![g.out_channels], b));
        }
        let mut c = Case::new(Topo::vertices(n), params);
        let x = c.input_rand(Source::Pull, rows(g.in_len()), &mut rng, -1.0, 1.0);
        let wp = c.param(0);
        let bp = with_bias.then(|| c.param(1));
        let y = c.b.conv2d(x, wp, bp, g);
        let r = c.check(y, 100 + i as u64);
        r.assert_all_nonzero_except(&[]);
        assert!(r.backward.output(Role::ParamGrad(0)).is_some());
    }
}

/// The conv backward ops are differentiable too (adjoint pairs).
#[test]
fn conv2d_backward_ops_gradients() {
    let mut rng = Rng::new(11);
    for (i, g) in [conv(2, 5, 4, 3, 3, 2, 2, 1), conv(3, 3, 3, 2, 1, 1, 1, 0)]
        .into_iter()
        .enumerate()
    {
        let n = 2;
        let w = rng.vec(g.out_channels * g.patch_len(), -1.0, 1.0);
        let mut c = Case::new(
            Topo::vertices(n),
            vec![(vec![g.out_channels, g.patch_len()], w)],
        );
        let dy = c.input_rand(Source::Pull, rows(g.out_len()), &mut rng, -1.0, 1.0);
        let wp = c.param(0);
        let y = c.b.conv2d_backward_input(dy, wp, g);
        c.check(y, 200 + i as u64).assert_all_nonzero_except(&[]);

        let mut c = Case::new(Topo::vertices(n), vec![]);
        let x = c.input_rand(Source::Pull, rows(g.in_len()), &mut rng, -1.0, 1.0);
        let dy = c.input_rand(Source::Gather(0), rows(g.out_len()), &mut rng, -1.0, 1.0);
        let y = c.b.conv2d_backward_weight(x, dy, g);
        c.check(y, 210 + i as u64).assert_all_nonzero_except(&[]);
    }
}

#[test]
fn max_pool2d_gradient() {
    let mut rng = Rng::new(12);
    for (i, g) in pool_cases().into_iter().enumerate() {
        let mut c = Case::new(Topo::vertices(2), vec![]);
        let x = c.input_rand(Source::Pull, rows(g.in_len()), &mut rng, -1.0, 1.0);
        let y = c.b.max_pool2d(x, g);
        c.check(y, 300 + i as u64).assert_nonzero(PULL);
    }
    // second derivatives are refused with a clear error
    let g = pool(1, 4, 4, 2, 2, 0);
    let mut c = Case::new(Topo::vertices(1), vec![]);
    let x = c.input_rand(Source::Pull, rows(16), &mut rng, -1.0, 1.0);
    let dy = c.input_rand(Source::Gather(0), rows(4), &mut rng, -1.0, 1.0);
    let d = c.b.max_pool2d_backward(x, dy, g);
    let (graph, shapes, _) = c.finish(d);
    let err = ramus_core::autodiff::differentiate(&graph, &shapes, "t").unwrap_err();
    assert!(err.to_string().contains("second derivatives"), "{err}");
}

#[test]
fn global_avg_pool_and_channel_ops_gradients() {
    let mut rng = Rng::new(13);
    let (ch, h, w) = (3, 2, 3);
    let mut c = Case::new(Topo::vertices(3), vec![]);
    let x = c.input_rand(Source::Pull, rows(ch * h * w), &mut rng, -1.0, 1.0);
    let y = c.b.global_avg_pool(x, ch, h, w);
    c.check(y, 400).assert_nonzero(PULL);
    // the backward op, through the registry
    let reg = OpRegistry::standard();
    let mut c = Case::new(Topo::vertices(3), vec![]);
    let x = c.input_rand(Source::Pull, rows(ch), &mut rng, -1.0, 1.0);
    let y = reg.call(&mut c.b, "global_avg_pool_backward", &[x], &[3.0, 2.0, 3.0]);
    c.check(y, 401).assert_nonzero(PULL);
    // channel sum and broadcast; a [1, C] parameter
    let mut c = Case::new(
        Topo::vertices(3),
        vec![(vec![1, ch], rng.vec(ch, -1.0, 1.0))],
    );
    let x = c.input_rand(Source::Pull, rows(ch * 4), &mut rng, -1.0, 1.0);
    let p = c.param(0);
    let b = c.b.channel_broadcast(p, x, ch, 4);
    let y = c.b.mul(b, x);
    let s = c.b.channel_sum(y, ch, 4);
    let r = c.check(s, 402);
    r.assert_all_nonzero_except(&[]);
}

#[test]
fn batch_norm_gradients() {
    let mut rng = Rng::new(14);
    for (i, (ch, s, n)) in [(2, 6, 3), (3, 1, 4), (1, 4, 1)].into_iter().enumerate() {
        let geom = NormGeom {
            channels: ch,
            spatial: s,
            eps: 1e-3,
        };
        let params = vec![
            (vec![ch], rng.vec(ch, 0.5, 1.5)),
            (vec![1, ch], rng.vec(ch, -1.0, 1.0)),
        ];
        let mut c = Case::new(Topo::vertices(n), params);
        let x = c.input_rand(Source::Pull, rows(ch * s), &mut rng, -2.0, 2.0);
        let (gm, bt) = (c.param(0), c.param(1));
        let y = c.b.batch_norm(x, gm, bt, geom);
        // a nonlinearity after it, so the loss is not linear in the output
        let y = c.b.tanh(y);
        let r = c.check(y, 500 + i as u64);
        r.assert_all_nonzero_except(&[]);
    }
}

#[test]
fn batch_norm_inference_gradients() {
    let mut rng = Rng::new(15);
    let geom = NormGeom {
        channels: 2,
        spatial: 3,
        eps: 1e-5,
    };
    let params = vec![
        (vec![2], rng.vec(2, 0.5, 1.5)),
        (vec![2], rng.vec(2, -1.0, 1.0)),
        (vec![2], rng.vec(2, -0.5, 0.5)),
        (vec![2], rng.vec(2, 0.5, 2.0)),
    ];
    let mut c = Case::new(Topo::vertices(3), params);
    let x = c.input_rand(Source::Pull, rows(6), &mut rng, -2.0, 2.0);
    let p: Vec<_> = (0..4).map(|i| c.param(i)).collect();
    let y = c.b.batch_norm_inference(x, p[0], p[1], (p[2], p[3]), geom);
    let y = c.b.tanh(y);
    c.check(y, 600).assert_all_nonzero_except(&[]);
}

// ======================================================================
// Shape errors and the registry
// ======================================================================

fn shape_error(f: impl FnOnce(&mut GraphBuilder)) -> String {
    let mut b = GraphBuilder::new(
        "cnn-test",
        &[vec![4, 27], vec![4, 26], vec![4], vec![5], vec![4, 3, 3, 3]],
    );
    f(&mut b);
    match b.finish() {
        Ok(g) => panic!("expected a shape error, built:\n{}", g.listing(&[])),
        Err(e) => e.to_string(),
    }
}

#[track_caller]
fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "error `{msg}` does not mention `{p}`");
    }
}

#[test]
fn shape_errors_name_the_mismatch() {
    let g = conv(3, 8, 8, 4, 3, 3, 1, 1);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(100));
        let w = b.param(0);
        b.conv2d(x, w, None, g);
    });
    assert_mentions(
        &m,
        &[
            "cnn-test",
            "`conv2d[3x8x8->4,k3x3,s1,p1]`",
            "width 100",
            "needs 192",
        ],
    );
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(192));
        let w = b.param(1);
        b.conv2d(x, w, None, g);
    });
    assert_mentions(
        &m,
        &["weight must be static [4, 27]", "[4, 3, 3, 3]", "[4, 26]"],
    );
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(192));
        let (w, bias) = (b.param(4), b.param(3));
        b.conv2d(x, w, Some(bias), g);
    });
    assert_mentions(&m, &["bias must be a static [4] vector", "[5]"]);
    let m = shape_error(|b| {
        let x = b.param(0);
        let w = b.param(0);
        b.conv2d(x, w, None, g);
    });
    assert_mentions(&m, &["must be row values"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(12));
        let w = b.param(0);
        b.conv2d(x, w, None, conv(3, 2, 2, 4, 3, 3, 1, 0));
    });
    assert_mentions(&m, &["kernel 3x3 is larger than the padded image 2x2"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(192));
        let w = b.param(0);
        b.conv2d(x, w, None, conv(3, 8, 8, 4, 3, 3, 0, 1));
    });
    assert_mentions(&m, &["stride must be positive"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(192));
        let dy = b.input(Source::Gather(0), rows(255));
        b.conv2d_backward_weight(x, dy, g);
    });
    assert_mentions(&m, &["output gradient has width 255", "needs 256"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(48));
        b.max_pool2d(x, pool(3, 4, 4, 2, 2, 2));
    });
    assert_mentions(&m, &["`max_pool2d", "padding 2 exceeds half the window 2"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(47));
        b.max_pool2d(x, pool(3, 4, 4, 2, 2, 0));
    });
    assert_mentions(&m, &["input (3x4x4 image) has width 47", "needs 48"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(10));
        b.global_avg_pool(x, 3, 2, 2);
    });
    assert_mentions(&m, &["`global_avg_pool[3x2x2]`", "width 10", "needs 12"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(8));
        let (gm, bt) = (b.param(2), b.param(3));
        let geom = NormGeom {
            channels: 4,
            spatial: 2,
            eps: 1e-5,
        };
        b.batch_norm(x, gm, bt, geom);
    });
    assert_mentions(
        &m,
        &[
            "`batch_norm[C4,S2,eps0.00001]`",
            "beta must be a static [4] vector",
        ],
    );
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(8));
        let gm = b.param(2);
        let geom = NormGeom {
            channels: 4,
            spatial: 2,
            eps: -1.0,
        };
        b.batch_norm(x, gm, gm, geom);
    });
    assert_mentions(&m, &["eps must be finite and non-negative"]);
    let m = shape_error(|b| {
        let p = b.param(2);
        b.channel_broadcast(p, p, 4, 2);
    });
    assert_mentions(&m, &["reference must be row values"]);
}

#[test]
fn registry_builds_every_cnn_op_by_name() {
    let reg = OpRegistry::standard();
    let g = [3.0, 8.0, 8.0, 4.0, 3.0, 3.0, 2.0, 1.0];
    let pg = [3.0, 8.0, 8.0, 2.0];
    let ng = [3.0, 64.0, 1e-3];
    #[allow(clippy::type_complexity)]
    let calls: Vec<(&str, &[f64], Vec<ValueType>, ValueType)> = vec![
        ("conv2d", &g, vec![rows(192), fixed(&[4, 27])], rows(64)),
        (
            "conv2d",
            &g,
            vec![rows(192), fixed(&[4, 27]), fixed(&[4])],
            rows(64),
        ),
        (
            "conv2d",
            &g[..6],
            vec![rows(192), fixed(&[4, 27])],
            rows(4 * 36),
        ),
        (
            "conv2d_backward_input",
            &g,
            vec![rows(64), fixed(&[4, 27])],
            rows(192),
        ),
        (
            "conv2d_backward_weight",
            &g,
            vec![rows(192), rows(64)],
            fixed(&[4, 27]),
        ),
        ("max_pool2d", &pg, vec![rows(192)], rows(48)),
        (
            "max_pool2d_backward",
            &pg,
            vec![rows(192), rows(48)],
            rows(192),
        ),
        (
            "global_avg_pool",
            &[3.0, 8.0, 8.0],
            vec![rows(192)],
            rows(3),
        ),
        (
            "global_avg_pool_backward",
            &[3.0, 8.0, 8.0],
            vec![rows(3)],
            rows(192),
        ),
        ("channel_sum", &[3.0, 64.0], vec![rows(192)], fixed(&[3])),
        (
            "channel_broadcast",
            &[3.0, 64.0],
            vec![fixed(&[3]), rows(1)],
            rows(192),
        ),
        (
            "batch_norm",
            &ng,
            vec![rows(192), fixed(&[3]), fixed(&[3])],
            rows(192),
        ),
        (
            "batch_norm",
            &ng[..2],
            vec![rows(192), fixed(&[3]), fixed(&[3])],
            rows(192),
        ),
        (
            "batch_norm_backward_input",
            &ng,
            vec![rows(192), fixed(&[3]), rows(192)],
            rows(192),
        ),
        (
            "batch_norm_backward_gamma",
            &ng,
            vec![rows(192), rows(192)],
            fixed(&[3]),
        ),
        (
            "batch_norm_inference",
            &ng,
            vec![
                rows(192),
                fixed(&[3]),
                fixed(&[3]),
                fixed(&[3]),
                fixed(&[3]),
            ],
            rows(192),
        ),
        (
            "batch_norm_inference_backward_input",
            &ng,
            vec![fixed(&[3]), fixed(&[3]), rows(192)],
            rows(192),
        ),
    ];
    let mut seen = Vec::new();
    for (name, attrs, ins, out) in calls {
        let shapes: Vec<Vec<usize>> = ins
            .iter()
            .filter(|t| !t.is_rows())
            .map(|t| t.shape.clone())
            .collect();
        let mut b = GraphBuilder::new("reg", &shapes);
        let (mut p, mut k) = (0, 0);
        let syms: Vec<_> = ins
            .iter()
            .map(|t| {
                if t.is_rows() {
                    k += 1;
                    b.input(Source::Gather(k), t.clone())
                } else {
                    p += 1;
                    b.param(p - 1)
                }
            })
            .collect();
        let y = reg.call(&mut b, name, &syms, attrs);
        assert!(!b.failed(), "{name}: {:?}", b.finish().err());
        assert_eq!(b.ty(y), Some(&out), "{name}");
        let NodeKind::Op(op) = &b.graph().nodes[y.id()].kind else {
            panic!("{name} is not an op");
        };
        assert_eq!(op.name(), name);
        assert!(op.elementwise_template().is_none());
        assert!(
            reg.doc(name).is_some_and(|d| d.contains("attrs")),
            "{name} doc"
        );
        seen.push(name);
    }
    for name in [
        "batch_norm_inference_backward_gamma",
        "batch_norm_inference_backward_mean",
        "batch_norm_inference_backward_var",
    ] {
        let mut b = GraphBuilder::new("reg", &[vec![3]]);
        let x = b.input(Source::Pull, rows(192));
        let s = b.param(0);
        let y = reg.call(&mut b, name, &[x, s, s, s, x], &ng);
        assert_eq!(b.ty(y), Some(&fixed(&[3])), "{name}");
        seen.push(name);
    }
    let names = reg.names();
    for n in &seen {
        assert!(names.contains(n));
    }
    // bad attributes
    let fail = |name: &str, attrs: &[f64]| {
        let mut b = GraphBuilder::new("reg", &[]);
        let x = b.input(Source::Pull, rows(4));
        reg.call(&mut b, name, &[x], attrs);
        b.finish().unwrap_err().to_string()
    };
    assert_mentions(
        &fail("conv2d", &[3.0, 8.0, 8.0]),
        &["missing attribute 3 (O)"],
    );
    assert_mentions(
        &fail("conv2d", &[3.0, 8.0, 8.0, 4.0, 3.0, 3.0, 0.0]),
        &["stride must be positive"],
    );
    assert_mentions(
        &fail("max_pool2d", &[3.0, 8.0, 8.0, 2.5]),
        &["non-negative integer"],
    );
    assert_mentions(&fail("batch_norm", &[3.0]), &["missing attribute 1 (S)"]);
    assert_mentions(&fail("channel_sum", &[0.0, 4.0]), &["must be positive"]);
}

// ======================================================================
// Batch statistics and execution classification
// ======================================================================

/// Batch norm between gather and scatter is rejected when the model is
/// built; a single-vertex CNN function runs it eagerly over all rows.
#[test]
fn batch_norm_is_rejected_per_task_and_eager_in_single_vertex_functions() {
    let geom = NormGeom {
        channels: 2,
        spatial: 2,
        eps: 1e-5,
    };
    let mut m = ModelBuilder::new("bn-tree", 4);
    let gm = m.param("gamma", &[2], Init::Zeros);
    let bt = m.param("beta", &[2], Init::Zeros);
    let w = m.param("W", &[2, 4], Init::Xavier);
    m.vertex_fn("cell", |f| {
        let l = f.gather(0);
        let (g, b) = (f.param(gm), f.param(bt));
        let h = f.batch_norm(l, g, b, geom);
        f.scatter(h);
        f.push(h);
    })
    .unwrap();
    m.head(HeadRows::Roots, 4, |hd| {
        let x = hd.input();
        let w = hd.param(w);
        let logits = hd.linear(x, w, None);
        let labels = hd.labels();
        let l = hd.softmax_xent(logits, labels);
        let loss = hd.mean_rows(l);
        hd.loss(loss);
    })
    .unwrap();
    let err = m.build().unwrap_err().to_string();
    assert_mentions(
        &err,
        &[
            "bn-tree/cell",
            "batch_norm[C2,S2",
            "couples the rows",
            "between gather and scatter",
        ],
    );

    // the static case: images pulled per vertex, the CNN in the function
    let cg = conv(1, 4, 4, 2, 3, 3, 1, 1);
    let mut m = ModelBuilder::new("cnn", 2);
    let wc = m.param("conv", &[2, 9], Init::Xavier);
    let gm = m.param("gamma", &[2], Init::Zeros);
    let bt = m.param("beta", &[2], Init::Zeros);
    let wo = m.param("W_out", &[3, 2], Init::Xavier);
    m.vertex_fn("image", |f| {
        let x = f.pull(16);
        let w = f.param(wc);
        let y = f.conv2d(x, w, None, cg);
        let (g, b) = (f.param(gm), f.param(bt));
        let y = f.batch_norm(
            y,
            g,
            b,
            NormGeom {
                channels: 2,
                spatial: 16,
                eps: 1e-5,
            },
        );
        let y = f.relu(y);
        let y = f.global_avg_pool(y, 2, 4, 4);
        f.push(y);
    })
    .unwrap();
    m.head(HeadRows::Roots, 2, |hd| {
        let x = hd.input();
        let w = hd.param(wo);
        let logits = hd.linear(x, w, None);
        let labels = hd.labels();
        let l = hd.softmax_xent(logits, labels);
        let loss = hd.mean_rows(l);
        hd.loss(loss);
        hd.logits(logits);
    })
    .unwrap();
    let model = m.build().unwrap();
    let f = &model.functions[0];
    for (graph, plan) in [
        (&f.forward, &f.forward_plan),
        (&f.backward, &f.backward_plan),
    ] {
        assert!(plan.per_task.is_empty() && plan.lazy.is_empty());
        for (i, node) in graph.nodes.iter().enumerate() {
            if node.op().is_some() {
                assert_eq!(plan.phase[i], Some(Phase::Eager));
            }
        }
    }
    // batch norm is never tabulated per token
    let mut b = GraphBuilder::new("hoist", &[vec![5, 4], vec![2], vec![2]]);
    let t = b.param(0);
    let tok = b.input(Source::Token, ValueType::index_rows(V));
    let e = b.embedding(t, tok);
    let (g, be) = (b.param(1), b.param(2));
    let y = b.batch_norm(
        e,
        g,
        be,
        NormGeom {
            channels: 2,
            spatial: 2,
            eps: 1e-5,
        },
    );
    b.output(Role::Push, y, None);
    let graph = b.finish().unwrap();
    let hoist = ramus_core::plan::token_hoist(&graph);
    assert_eq!(
        hoist.tabulated,
        vec![e.id()],
        "only the embedding is per-token"
    );
    // nor is a value read through a reduction over the batch's rows
    let mut b = GraphBuilder::new("hoist", &[vec![5, 4]]);
    let t = b.param(0);
    let tok = b.input(Source::Token, ValueType::index_rows(V));
    let e = b.embedding(t, tok);
    let mean = b.mean_rows(e);
    let y = b.add(e, mean);
    b.output(Role::Push, y, None);
    let hoist = ramus_core::plan::token_hoist(&b.finish().unwrap());
    assert_eq!(hoist.tabulated, vec![e.id()], "y depends on the batch mean");
}

// ======================================================================
// End to end: a small CNN
// ======================================================================

/// conv → relu → max_pool → global_avg_pool → linear → softmax_xent → mean:
/// the whole gradient (image input and every parameter) against finite
/// differences.
#[test]
fn two_layer_cnn_gradient_matches_finite_differences() {
    let mut rng = Rng::new(20);
    let (n, classes) = (3, 3);
    let cg = conv(2, 6, 6, 3, 3, 3, 1, 1);
    let pg = pool(3, 6, 6, 2, 2, 0);
    let params = vec![
        (vec![3, 2, 3, 3], rng.vec(54, -0.5, 0.5)),
        (vec![3], rng.vec(3, -0.1, 0.1)),
        (vec![classes, 3], rng.vec(classes * 3, -1.0, 1.0)),
        (vec![classes], rng.vec(classes, -0.1, 0.1)),
    ];
    let mut c = Case::new(Topo::vertices(n), params);
    let x = c.input_rand(Source::Pull, rows(cg.in_len()), &mut rng, -1.0, 1.0);
    let labels = c.input(
        Source::Label,
        ValueType::index_rows(V),
        Val::I(vec![0, 2, 1]),
    );
    let (w1, b1, w2, b2) = (c.param(0), c.param(1), c.param(2), c.param(3));
    let h = c.b.conv2d(x, w1, Some(b1), cg);
    let h = c.b.relu(h);
    let h = c.b.max_pool2d(h, pg);
    let h = c.b.global_avg_pool(h, 3, 3, 3);
    let logits = c.b.linear(h, w2, Some(b2));
    let l = c.b.softmax_xent(logits, labels);
    let loss = c.b.mean_rows(l);
    let r = c.check(loss, 700);
    r.assert_all_nonzero_except(&[]);
    for role in [
        Role::PullGrad,
        Role::ParamGrad(0),
        Role::ParamGrad(1),
        Role::ParamGrad(2),
        Role::ParamGrad(3),
    ] {
        assert!(r.backward.output(role).is_some(), "{role:?}");
    }
}

/// A residual block with batch norm and a strided, padded second conv:
/// conv → batch_norm → relu → conv + x → relu → strided conv → pool → linear.
#[test]
fn residual_block_with_batch_norm_gradient_matches_finite_differences() {
    let mut rng = Rng::new(21);
    let n = 3;
    let c1 = conv(2, 5, 5, 2, 3, 3, 1, 1);
    let c2 = conv(2, 5, 5, 3, 2, 3, 2, 1);
    let (h2, w2) = (c2.out_h(), c2.out_w());
    let norm = NormGeom {
        channels: 2,
        spatial: 25,
        eps: 1e-5,
    };
    let params = vec![
        (vec![2, 18], rng.vec(36, -0.5, 0.5)),
        (vec![2], rng.vec(2, 0.5, 1.5)),
        (vec![2], rng.vec(2, -0.5, 0.5)),
        (vec![3, 12], rng.vec(36, -0.5, 0.5)),
        (vec![2, 3], rng.vec(6, -1.0, 1.0)),
    ];
    let mut c = Case::new(Topo::vertices(n), params);
    let x = c.input_rand(Source::Gather(0), rows(c1.in_len()), &mut rng, -1.0, 1.0);
    let labels = c.input(
        Source::Label,
        ValueType::index_rows(V),
        Val::I(vec![1, 0, 1]),
    );
    let p: Vec<_> = (0..5).map(|i| c.param(i)).collect();
    let h = c.b.conv2d(x, p[0], None, c1);
    let h = c.b.batch_norm(h, p[1], p[2], norm);
    let h = c.b.relu(h);
    let h = c.b.add(h, x);
    let h = c.b.conv2d(h, p[3], None, c2);
    let h = c.b.tanh(h);
    let h = c.b.global_avg_pool(h, 3, h2, w2);
    let logits = c.b.linear(h, p[4], None);
    let l = c.b.softmax_xent(logits, labels);
    let loss = c.b.sum_rows(l);
    let r = c.check(loss, 701);
    r.assert_all_nonzero_except(&[]);
    r.assert_nonzero(G0);
}

/// The interpreter's forward value of a CNN agrees between the registry
/// and the builder (same ops, same numbers).
#[test]
fn registry_and_builder_agree() {
    let reg = OpRegistry::standard();
    let mut rng = Rng::new(22);
    let cg = conv(1, 4, 4, 2, 3, 3, 2, 1);
    let mut c = Case::new(
        Topo::vertices(2),
        vec![(vec![2, 9], rng.vec(18, -1.0, 1.0))],
    );
    let x = c.input_rand(Source::Pull, rows(16), &mut rng, -1.0, 1.0);
    let w = c.param(0);
    let a = reg.call(
        &mut c.b,
        "conv2d",
        &[x, w],
        &[1.0, 4.0, 4.0, 2.0, 3.0, 3.0, 2.0, 1.0],
    );
    let bm = c.b.conv2d(x, w, None, cg);
    let d = c.b.sub(a, bm);
    let (g, _, env) = c.finish(d);
    let vals = eval(&g, &env, None, &HashMap::new()).unwrap();
    assert!(vals[g.output(Role::Loss).unwrap().node]
        .f()
        .iter()
        .all(|v| *v == 0.0));
}

/// Kernels called with inconsistent data or geometry return errors naming
/// the op instead of panicking.
#[test]
fn kernels_reject_inconsistent_arguments() {
    use ramus_cpu::kernels::{self, Arg, ArgData, KernelCtx};
    fn run(
        op: &(impl OpDef + Clone + Into<Op>),
        args: &[(ValueType, usize, Vec<f64>)],
        out_len: usize,
        out_rows: usize,
    ) -> String {
        let kargs: Vec<Arg<'_, f64>> = args
            .iter()
            .map(|(ty, rows, d)| Arg {
                ty,
                rows: *rows,
                data: ArgData::Float(d),
            })
            .collect();
        let mut out = vec![0.0; out_len];
        let mut ctx = KernelCtx {
            args: &kargs,
            out: &mut out,
            out_rows,
            vertex_rows: out_rows,
            edge_parent: &[],
            packed_b: None,
            norm_sum: None,
        };
        kernels::run::<f64>(&op.clone().into(), &mut ctx)
            .expect_err("kernel should fail")
            .to_string()
    }
    let g = conv(1, 4, 4, 2, 3, 3, 1, 1);
    // weight data too short
    let m = run(
        &Conv2d(g),
        &[
            (rows(16), 2, vec![0.0; 32]),
            (fixed(&[2, 9]), 1, vec![0.0; 17]),
        ],
        64,
        2,
    );
    assert_mentions(&m, &["conv2d", "argument 1 holds 17 elements, expected 18"]);
    // output gradient rows differ from the input rows
    let m = run(
        &Conv2dBackwardWeight(g),
        &[(rows(16), 2, vec![0.0; 32]), (rows(32), 3, vec![0.0; 96])],
        18,
        1,
    );
    assert_mentions(
        &m,
        &[
            "conv2d_backward_weight",
            "argument 1 has 3 rows, expected 2",
        ],
    );
    // a geometry that `infer` would have rejected
    let m = run(
        &MaxPool2d(pool(1, 4, 4, 2, 0, 0)),
        &[(rows(16), 1, vec![0.0; 16])],
        4,
        1,
    );
    assert_mentions(&m, &["max_pool2d", "stride must be positive"]);
    let m = run(
        &GlobalAvgPool {
            channels: 2,
            height: 0,
            width: 3,
        },
        &[(rows(0), 1, vec![])],
        2,
        1,
    );
    assert_mentions(&m, &["global_avg_pool", "must be positive"]);
    let m = run(
        &BatchNorm(NormGeom {
            channels: 2,
            spatial: 2,
            eps: 1e-5,
        }),
        &[
            (rows(4), 2, vec![0.0; 8]),
            (fixed(&[2]), 1, vec![1.0; 2]),
            (fixed(&[2]), 1, vec![0.0; 2]),
        ],
        12,
        3,
    );
    assert_mentions(&m, &["batch_norm", "argument 0 has 2 rows, expected 3"]);
}
