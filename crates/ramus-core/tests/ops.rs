//! Tests for every primitive op: forward kernels against straightforward
//! f64 loops, gradients (through the real autodiff and a small interpreter)
//! against central finite differences, shape inference errors, fusion
//! templates, kernel run-time errors and the op registry.

mod common;

use std::collections::HashMap;

use common::*;
use ramus_core::autodiff::differentiate;
use ramus_core::ops::{
    Add, AddScalar, BroadcastRows, Concat, Div, Embedding, Exp, ExpandChildren, Log, MatMul, Mul,
    Neg, Op, Pad, Relu, ReluBackward, Reshape, RsubScalar, Scale, Sigmoid, SigmoidBackward, Slice,
    SoftmaxXent, SoftmaxXentBackward, Sub, SumChildren, SumRows, Tanh, TanhBackward,
};
use ramus_core::{
    DType, Graph, GraphBuilder, NodeKind, OpDef, OpRegistry, Role, Source, Space, Sym, ValueType,
};
use ramus_cpu::kernels::{self, Arg, ArgData, KernelCtx};

const V: Space = Space::Vertex;
const E: Space = Space::Edge;
/// Forward results are compared within `FWD_TOL * (1 + |expected|)`.
const FWD_TOL: f64 = 1e-12;

fn rows(space: Space, w: usize) -> ValueType {
    ValueType::rows(space, w)
}
fn fixed(shape: &[usize]) -> ValueType {
    ValueType::fixed(shape)
}
fn sig(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// How test data for an operand is drawn.
#[derive(Clone, Copy, Debug)]
enum Dist {
    /// Uniform in [lo, hi).
    U(f64, f64),
    /// `lo <= |x| < hi`, random sign.
    Away(f64, f64),
}

impl Dist {
    fn sample(self, rng: &mut Rng, n: usize) -> Vec<f64> {
        match self {
            Dist::U(lo, hi) => rng.vec(n, lo, hi),
            Dist::Away(lo, hi) => rng.vec_away(n, lo, hi),
        }
    }
}

/// Element `j` of row `r` of a value that is either per-row or a broadcast row.
fn at(data: &[f64], per_row: bool, width: usize, r: usize, j: usize) -> f64 {
    if per_row {
        data[r * width + j]
    } else {
        data[j]
    }
}

fn fwd(
    op: &(impl OpDef + Clone + Into<Op>),
    args: &[(ValueType, Val)],
    topo: &Topo,
) -> (ValueType, Vec<f64>) {
    run_op(op, args, topo).unwrap_or_else(|e| panic!("{} failed: {e}", op.signature()))
}

// ======================================================================
// 1. Forward kernels against reference loops
// ======================================================================

type UnaryRef = (Op, fn(f64) -> f64, Dist);

fn unary_ops() -> Vec<UnaryRef> {
    vec![
        (prim(Neg), |x| -x, Dist::U(-3.0, 3.0)),
        (prim(Exp), f64::exp, Dist::U(-3.0, 3.0)),
        (prim(Log), f64::ln, Dist::U(0.01, 5.0)),
        (prim(Sigmoid), sig, Dist::U(-8.0, 8.0)),
        (prim(Tanh), f64::tanh, Dist::U(-4.0, 4.0)),
        (prim(Relu), |x| x.max(0.0), Dist::Away(0.01, 3.0)),
        (prim(Scale(-1.75)), |x| -1.75 * x, Dist::U(-3.0, 3.0)),
        (prim(Scale(0.0)), |x| 0.0 * x, Dist::U(-3.0, 3.0)),
        (prim(AddScalar(0.3)), |x| x + 0.3, Dist::U(-3.0, 3.0)),
        (prim(RsubScalar(2.5)), |x| 2.5 - x, Dist::U(-3.0, 3.0)),
    ]
}

/// (type, topology) layouts covering rows = 1, widths that are not
/// multiples of 8, edge rows, static values and the threaded path.
fn elementwise_layouts() -> Vec<(ValueType, Topo)> {
    vec![
        (rows(V, 1), Topo::vertices(1)),
        (rows(V, 13), Topo::vertices(1)),
        (rows(V, 8), Topo::vertices(5)),
        (rows(V, 17), Topo::vertices(7)),
        (rows(E, 9), Topo::from_children(&[0, 1, 3, 2])),
        (fixed(&[3, 5]), Topo::vertices(2)),
        (fixed(&[7]), Topo::vertices(2)),
        // rows * width >= 65536: split over threads
        (rows(V, 257), Topo::vertices(300)),
    ]
}

#[test]
fn unary_ops_forward() {
    let mut rng = Rng::new(1);
    for (op, f, dist) in unary_ops() {
        for (ty, topo) in elementwise_layouts() {
            let x = dist.sample(&mut rng, topo.len(&ty));
            let (out_ty, got) = fwd(&op, &[(ty.clone(), Val::F(x.clone()))], &topo);
            assert_eq!(out_ty, ty, "{} keeps the operand's type", op.signature());
            let want: Vec<f64> = x.iter().map(|&x| f(x)).collect();
            assert_close(
                &got,
                &want,
                FWD_TOL,
                &format!("{} on {ty} x {} rows", op.signature(), topo.rows(ty.space)),
            );
        }
    }
}

#[test]
fn sigmoid_and_exp_extremes() {
    let topo = Topo::vertices(1);
    let x = vec![-800.0, -40.0, -1e-3, 0.0, 1e-3, 40.0, 800.0];
    let (_, got) = fwd(&Sigmoid, &[(rows(V, 7), Val::F(x.clone()))], &topo);
    assert!(
        got.iter().all(|v| v.is_finite() && (0.0..=1.0).contains(v)),
        "sigmoid is stable: {got:?}"
    );
    let want: Vec<f64> = x
        .iter()
        .map(|&x| {
            if x >= 0.0 {
                1.0 / (1.0 + (-x).exp())
            } else {
                x.exp() / (1.0 + x.exp())
            }
        })
        .collect();
    assert_close(&got, &want, FWD_TOL, "sigmoid at extremes");
    let (_, got) = fwd(&Relu, &[(rows(V, 7), Val::F(x.clone()))], &topo);
    assert_eq!(got, vec![0.0, 0.0, 0.0, 0.0, 1e-3, 40.0, 800.0]);
}

type BinaryRef = (Op, fn(f64, f64) -> f64, Dist, Dist);

fn binary_ops() -> Vec<BinaryRef> {
    let u = Dist::U(-2.0, 2.0);
    vec![
        (prim(Add), |a, b| a + b, u, u),
        (prim(Sub), |a, b| a - b, u, u),
        (prim(Mul), |a, b| a * b, u, u),
        (prim(Div), |a, b| a / b, u, Dist::Away(0.5, 2.0)),
        (
            prim(SigmoidBackward),
            |y, g| g * y * (1.0 - y),
            Dist::U(0.0, 1.0),
            u,
        ),
        (
            prim(TanhBackward),
            |y, g| g * (1.0 - y * y),
            Dist::U(-1.0, 1.0),
            u,
        ),
        (
            prim(ReluBackward),
            |x, g| if x > 0.0 { g } else { 0.0 },
            Dist::Away(0.01, 2.0),
            u,
        ),
    ]
}

/// Operand layouts for binary ops: (type of a, type of b, topology).
fn binary_layouts() -> Vec<(ValueType, ValueType, Topo)> {
    vec![
        (rows(V, 13), rows(V, 13), Topo::vertices(5)),
        (rows(V, 1), rows(V, 1), Topo::vertices(1)),
        // static row broadcast as the 2nd operand (bias) ...
        (rows(V, 13), fixed(&[13]), Topo::vertices(5)),
        (rows(V, 6), fixed(&[1, 6]), Topo::vertices(1)),
        // ... and as the 1st operand
        (fixed(&[13]), rows(V, 13), Topo::vertices(5)),
        (fixed(&[6, 1]), rows(V, 6), Topo::vertices(3)),
        (rows(E, 9), fixed(&[9]), Topo::from_children(&[0, 1, 3, 2])),
        (fixed(&[9]), rows(E, 9), Topo::from_children(&[0, 1, 3, 2])),
        (rows(E, 9), rows(E, 9), Topo::from_children(&[0, 1, 3, 2])),
        // all static
        (fixed(&[3, 4]), fixed(&[3, 4]), Topo::vertices(2)),
        // threaded path, plain and broadcasting both ways
        (rows(V, 257), rows(V, 257), Topo::vertices(300)),
        (rows(V, 257), fixed(&[257]), Topo::vertices(300)),
        (fixed(&[257]), rows(V, 257), Topo::vertices(300)),
    ]
}

#[test]
fn binary_ops_forward_with_broadcasting() {
    let mut rng = Rng::new(2);
    for (op, f, da, db) in binary_ops() {
        for (ta, tb, topo) in binary_layouts() {
            let a = da.sample(&mut rng, topo.len(&ta));
            let b = db.sample(&mut rng, topo.len(&tb));
            let (out_ty, got) = fwd(
                &op,
                &[
                    (ta.clone(), Val::F(a.clone())),
                    (tb.clone(), Val::F(b.clone())),
                ],
                &topo,
            );
            let (space, width) = if ta.is_rows() {
                (ta.space, ta.width())
            } else if tb.is_rows() {
                (tb.space, tb.width())
            } else {
                (Space::Static, ta.width())
            };
            if space == Space::Static {
                assert_eq!(out_ty, ta, "all-static {} keeps the shape", op.name());
            } else {
                assert_eq!(out_ty, rows(space, width), "{} of {ta} and {tb}", op.name());
            }
            let n = topo.rows(space);
            let mut want = vec![0.0; n * width];
            for r in 0..n {
                for j in 0..width {
                    want[r * width + j] = f(
                        at(&a, ta.is_rows(), width, r, j),
                        at(&b, tb.is_rows(), width, r, j),
                    );
                }
            }
            assert_close(
                &got,
                &want,
                FWD_TOL,
                &format!("{} of {ta} and {tb} over {n} rows", op.name()),
            );
        }
    }
}

/// `op(A) · op(B)` for row-major `A: [ar, ac]`, `B: [br, bc]`.
#[allow(clippy::too_many_arguments)]
fn mm_ref(
    a: &[f64],
    ar: usize,
    ac: usize,
    ta: bool,
    b: &[f64],
    br: usize,
    bc: usize,
    tb: bool,
) -> (usize, usize, Vec<f64>) {
    let (m, k) = if ta { (ac, ar) } else { (ar, ac) };
    let (k2, n) = if tb { (bc, br) } else { (br, bc) };
    assert_eq!(k, k2, "test bug: inner dims");
    let ga = |i: usize, p: usize| if ta { a[p * ac + i] } else { a[i * ac + p] };
    let gb = |p: usize, j: usize| if tb { b[j * bc + p] } else { b[p * bc + j] };
    let mut c = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k).map(|p| ga(i, p) * gb(p, j)).sum();
        }
    }
    (m, n, c)
}

/// Rows `[r, k]` · static B (`[k, n]`, or `[n, k]` with `trans_b`).
fn check_rows_times_static(
    rng: &mut Rng,
    space: Space,
    topo: &Topo,
    k: usize,
    n: usize,
    trans_b: bool,
) {
    let r = topo.rows(space);
    let a = rng.vec(r * k, -1.0, 1.0);
    let b_shape = if trans_b { [n, k] } else { [k, n] };
    let b = rng.vec(k * n, -1.0, 1.0);
    let op = MatMul {
        trans_a: false,
        trans_b,
    };
    let (ty, got) = fwd(
        &op,
        &[
            (rows(space, k), Val::F(a.clone())),
            (fixed(&b_shape), Val::F(b.clone())),
        ],
        topo,
    );
    assert_eq!(ty, rows(space, n));
    let (_, _, want) = mm_ref(&a, r, k, false, &b, b_shape[0], b_shape[1], trans_b);
    assert_close(
        &got,
        &want,
        FWD_TOL,
        &format!("matmul[{}] rows {r}x{k} by {b_shape:?}", op.attrs()),
    );
}

#[test]
fn matmul_rows_times_static_forward() {
    let mut rng = Rng::new(3);
    // a handful of rows takes the matrix-vector path (rows handled four at a
    // time plus a remainder), more rows the GEMM path: cover every row count
    // around the switch-over
    for trans_b in [false, true] {
        for r in (1..=13).chain([16, 33]) {
            check_rows_times_static(&mut rng, V, &Topo::vertices(r), 9, 6, trans_b);
        }
        for &(r, k, n) in &[
            (1, 1, 1),
            (2, 3, 1),
            (3, 1, 4),
            (5, 16, 3),
            (7, 8, 8),
            (11, 17, 9),
        ] {
            check_rows_times_static(&mut rng, V, &Topo::vertices(r), k, n, trans_b);
        }
        // edge rows: 6 edges and 3 edges
        check_rows_times_static(
            &mut rng,
            E,
            &Topo::from_children(&[0, 1, 3, 2]),
            5,
            7,
            trans_b,
        );
        check_rows_times_static(&mut rng, E, &Topo::from_children(&[3, 0]), 5, 7, trans_b);
    }
}

#[test]
fn matmul_threaded_paths_forward() {
    let mut rng = Rng::new(4);
    for trans_b in [false, true] {
        // large B (k * n well above 2^17): the small-row path splits columns
        // over threads; n not a multiple of the thread count
        for r in [1, 3, 4, 5, 8, 9] {
            check_rows_times_static(&mut rng, V, &Topo::vertices(r), 384, 385, trans_b);
        }
        check_rows_times_static(&mut rng, V, &Topo::vertices(2), 64, 2053, trans_b);
        // many rows and m * k * n >= 2^21: the GEMM is split into row blocks
        // over the pool (67 rows do not split evenly)
        check_rows_times_static(&mut rng, V, &Topo::vertices(100), 150, 150, trans_b);
        check_rows_times_static(&mut rng, V, &Topo::vertices(67), 200, 160, trans_b);
    }
}

#[test]
fn matmul_rows_transposed_times_rows_forward() {
    let mut rng = Rng::new(5);
    let cases: Vec<(Space, Topo, usize, usize)> = vec![
        (V, Topo::vertices(1), 3, 4),
        (V, Topo::vertices(5), 7, 2),
        (V, Topo::vertices(9), 1, 6),
        (V, Topo::vertices(70), 13, 11),
        (E, Topo::from_children(&[0, 1, 3, 2]), 4, 5),
        // output rows (= A's width) >= 64 with a large product: row-blocked GEMM
        // over a transposed A
        (V, Topo::vertices(150), 100, 150),
        (V, Topo::vertices(160), 67, 200),
    ];
    for (space, topo, wa, wb) in cases {
        let r = topo.rows(space);
        let a = rng.vec(r * wa, -1.0, 1.0);
        let b = rng.vec(r * wb, -1.0, 1.0);
        let op = MatMul {
            trans_a: true,
            trans_b: false,
        };
        let (ty, got) = fwd(
            &op,
            &[
                (rows(space, wa), Val::F(a.clone())),
                (rows(space, wb), Val::F(b.clone())),
            ],
            &topo,
        );
        assert_eq!(ty, fixed(&[wa, wb]));
        let (_, _, want) = mm_ref(&a, r, wa, true, &b, r, wb, false);
        assert_close(
            &got,
            &want,
            FWD_TOL,
            &format!("matmul Aᵀ·B over {r} {space:?} rows, {wa}x{wb}"),
        );
    }
}

#[test]
fn matmul_static_times_static_forward() {
    let mut rng = Rng::new(6);
    // (m, k, n) of op(A)·op(B): few rows take the small path when A is not
    // transposed; m >= 64 with a large product the row-blocked threaded GEMM
    for &(m, k, n) in &[
        (2, 3, 4),
        (5, 6, 7),
        (1, 9, 1),
        (4, 1, 3),
        (8, 17, 9),
        (9, 4, 5),
        (100, 150, 150),
        (67, 200, 160),
    ] {
        for ta in [false, true] {
            for tb in [false, true] {
                let a_shape = if ta { [k, m] } else { [m, k] };
                let b_shape = if tb { [n, k] } else { [k, n] };
                let a = rng.vec(m * k, -1.0, 1.0);
                let b = rng.vec(k * n, -1.0, 1.0);
                let op = MatMul {
                    trans_a: ta,
                    trans_b: tb,
                };
                let (ty, got) = fwd(
                    &op,
                    &[
                        (fixed(&a_shape), Val::F(a.clone())),
                        (fixed(&b_shape), Val::F(b.clone())),
                    ],
                    &Topo::vertices(3),
                );
                assert_eq!(ty, fixed(&[m, n]));
                let (_, _, want) = mm_ref(
                    &a, a_shape[0], a_shape[1], ta, &b, b_shape[0], b_shape[1], tb,
                );
                assert_close(
                    &got,
                    &want,
                    FWD_TOL,
                    &format!("matmul[{}] {a_shape:?} by {b_shape:?}", op.attrs()),
                );
            }
        }
    }
}

#[test]
fn f32_kernels_match_f64_reference() {
    // the f32 kernels use sgemm / f32 accumulation and polynomial exp: same
    // answers within f32 precision
    let mut rng = Rng::new(7);
    for &(r, k, n, tb) in &[
        (3, 10, 6, false),
        (3, 10, 6, true),
        (7, 10, 6, false),
        (7, 10, 6, true),
        (12, 10, 6, true),
        (2, 384, 385, true),
        (5, 384, 385, false),
        (100, 150, 150, false),
    ] {
        let a = rng.vec(r * k, -1.0, 1.0);
        let b = rng.vec(k * n, -1.0, 1.0);
        let b_shape = if tb { [n, k] } else { [k, n] };
        let op = MatMul {
            trans_a: false,
            trans_b: tb,
        };
        let got = run_op_f32(
            &op,
            &[
                (rows(V, k), Val::F(a.clone())),
                (fixed(&b_shape), Val::F(b.clone())),
            ],
            &Topo::vertices(r),
        )
        .unwrap();
        let (_, _, want) = mm_ref(&a, r, k, false, &b, b_shape[0], b_shape[1], tb);
        assert_close(
            &got,
            &want,
            1e-4,
            &format!("f32 matmul {r}x{k}x{n} trans_b={tb}"),
        );
    }
    // unary math, including the threaded path (300 x 257)
    for (op, f, lo, hi) in [
        (prim(Exp), f64::exp as fn(f64) -> f64, -10.0, 10.0),
        (prim(Tanh), f64::tanh, -6.0, 6.0),
        (prim(Sigmoid), sig, -20.0, 20.0),
    ] {
        for r in [5, 300] {
            let x: Vec<f64> = rng
                .vec(r * 257, lo, hi)
                .into_iter()
                .map(|v| v as f32 as f64)
                .collect();
            let got = run_op_f32(
                &op,
                &[(rows(V, 257), Val::F(x.clone()))],
                &Topo::vertices(r),
            )
            .unwrap();
            for (i, (&g, &x)) in got.iter().zip(&x).enumerate() {
                let w = f(x);
                assert!(
                    (g - w).abs() <= 1e-6 * w.abs() + 2e-7,
                    "f32 {}({x}) = {g}, expected {w} (element {i})",
                    op.name()
                );
            }
        }
    }
}

#[test]
fn concat_forward() {
    let mut rng = Rng::new(8);
    let cases: Vec<(Space, Topo, Vec<usize>)> = vec![
        (V, Topo::vertices(1), vec![3]),
        (V, Topo::vertices(4), vec![3, 5]),
        (V, Topo::vertices(3), vec![1, 7, 2]),
        (E, Topo::from_children(&[2, 0, 3]), vec![4, 1, 4, 9]),
    ];
    for (space, topo, widths) in cases {
        let r = topo.rows(space);
        let parts: Vec<Vec<f64>> = widths.iter().map(|&w| rng.vec(r * w, -1.0, 1.0)).collect();
        let args: Vec<(ValueType, Val)> = widths
            .iter()
            .zip(&parts)
            .map(|(&w, d)| (rows(space, w), Val::F(d.clone())))
            .collect();
        let (ty, got) = fwd(&Concat, &args, &topo);
        let total: usize = widths.iter().sum();
        assert_eq!(ty, rows(space, total));
        let mut want = Vec::new();
        for row in 0..r {
            for (&w, d) in widths.iter().zip(&parts) {
                want.extend_from_slice(&d[row * w..(row + 1) * w]);
            }
        }
        assert_close(&got, &want, 0.0, &format!("concat {widths:?}"));
    }
}

#[test]
fn slice_and_pad_forward() {
    let mut rng = Rng::new(9);
    for (space, topo) in [
        (V, Topo::vertices(1)),
        (V, Topo::vertices(4)),
        (E, Topo::from_children(&[1, 3])),
    ] {
        let r = topo.rows(space);
        let w = 10;
        let x = rng.vec(r * w, -1.0, 1.0);
        for (start, len) in [(0, 10), (0, 1), (9, 1), (3, 4), (2, 8)] {
            let (ty, got) = fwd(
                &Slice { start, len },
                &[(rows(space, w), Val::F(x.clone()))],
                &topo,
            );
            assert_eq!(ty, rows(space, len));
            let want: Vec<f64> = (0..r)
                .flat_map(|row| x[row * w + start..row * w + start + len].to_vec())
                .collect();
            assert_close(&got, &want, 0.0, &format!("slice {start}+{len}"));
        }
        let w = 3;
        let x = rng.vec(r * w, -1.0, 1.0);
        for (start, total) in [(0, 3), (0, 8), (5, 8), (2, 11)] {
            let (ty, got) = fwd(
                &Pad { start, total },
                &[(rows(space, w), Val::F(x.clone()))],
                &topo,
            );
            assert_eq!(ty, rows(space, total));
            let mut want = vec![0.0; r * total];
            for row in 0..r {
                want[row * total + start..row * total + start + w]
                    .copy_from_slice(&x[row * w..(row + 1) * w]);
            }
            assert_close(&got, &want, 0.0, &format!("pad at {start} of {total}"));
        }
    }
}

fn children_topologies() -> Vec<Topo> {
    vec![
        // vertices with 0, 1 and 3 children (and 2), edges grouped by parent
        Topo::from_children(&[0, 1, 3, 0, 2]),
        Topo::from_children(&[3]),
        Topo::from_children(&[1]),
        // edges interleaved across parents
        Topo {
            vertex_rows: 4,
            edge_parent: vec![2, 0, 2, 1, 2],
        },
    ]
}

#[test]
fn sum_and_expand_children_forward() {
    let mut rng = Rng::new(10);
    for topo in children_topologies() {
        for w in [1, 5, 9] {
            let (nv, ne) = (topo.vertex_rows, topo.edges());
            let x = rng.vec(ne * w, -1.0, 1.0);
            let (ty, got) = fwd(&SumChildren, &[(rows(E, w), Val::F(x.clone()))], &topo);
            assert_eq!(ty, rows(V, w));
            let mut want = vec![0.0; nv * w];
            for (e, &p) in topo.edge_parent.iter().enumerate() {
                for j in 0..w {
                    want[p as usize * w + j] += x[e * w + j];
                }
            }
            assert_close(
                &got,
                &want,
                FWD_TOL,
                &format!("sum_children over {:?}", topo.edge_parent),
            );

            let v = rng.vec(nv * w, -1.0, 1.0);
            let (ty, got) = fwd(&ExpandChildren, &[(rows(V, w), Val::F(v.clone()))], &topo);
            assert_eq!(ty, rows(E, w));
            let want: Vec<f64> = topo
                .edge_parent
                .iter()
                .flat_map(|&p| v[p as usize * w..(p as usize + 1) * w].to_vec())
                .collect();
            assert_close(
                &got,
                &want,
                0.0,
                &format!("expand_children over {:?}", topo.edge_parent),
            );
        }
    }
}

#[test]
fn sum_children_without_edges_gives_zeros() {
    let topo = Topo::vertices(3);
    let (_, got) = fwd(&SumChildren, &[(rows(E, 4), Val::F(vec![]))], &topo);
    assert_eq!(got, vec![0.0; 12]);
    let (_, got) = fwd(
        &ExpandChildren,
        &[(rows(V, 4), Val::F(vec![1.0; 12]))],
        &topo,
    );
    assert!(got.is_empty());
}

#[test]
fn sum_rows_and_mean_rows_forward() {
    let mut rng = Rng::new(11);
    let cases: Vec<(Space, Topo, usize)> = vec![
        (V, Topo::vertices(1), 5),
        (V, Topo::vertices(7), 13),
        (V, Topo::vertices(300), 3),
        (E, Topo::from_children(&[0, 1, 3, 2]), 4),
    ];
    for (space, topo, w) in cases {
        let r = topo.rows(space);
        let x = rng.vec(r * w, -1.0, 1.0);
        for mean in [false, true] {
            let (ty, got) = fwd(
                &SumRows { mean },
                &[(rows(space, w), Val::F(x.clone()))],
                &topo,
            );
            assert_eq!(ty, fixed(&[w]));
            let want: Vec<f64> = (0..w)
                .map(|j| {
                    let s: f64 = (0..r).map(|row| x[row * w + j]).sum();
                    if mean {
                        s / r as f64
                    } else {
                        s
                    }
                })
                .collect();
            assert_close(
                &got,
                &want,
                FWD_TOL,
                &format!("{} over {r} rows", SumRows { mean }.name()),
            );
        }
    }
    // no rows: both reduce to zeros
    for mean in [false, true] {
        let (_, got) = fwd(
            &SumRows { mean },
            &[(rows(E, 3), Val::F(vec![]))],
            &Topo::vertices(2),
        );
        assert_eq!(
            got,
            vec![0.0; 3],
            "{} of zero rows",
            SumRows { mean }.name()
        );
    }
}

#[test]
fn broadcast_rows_forward() {
    let mut rng = Rng::new(12);
    let cases: Vec<(ValueType, ValueType, Topo)> = vec![
        (fixed(&[5]), rows(V, 2), Topo::vertices(4)),
        (fixed(&[1, 5]), rows(V, 5), Topo::vertices(1)),
        (fixed(&[2, 3]), rows(V, 7), Topo::vertices(3)),
        (fixed(&[4]), rows(E, 1), Topo::from_children(&[0, 1, 3, 2])),
    ];
    for (sty, lty, topo) in cases {
        let r = topo.rows(lty.space);
        let s = rng.vec(sty.width(), -1.0, 1.0);
        let like = rng.vec(r * lty.width(), -1.0, 1.0);
        for mean in [false, true] {
            let op = BroadcastRows { mean };
            let (ty, got) = fwd(
                &op,
                &[
                    (sty.clone(), Val::F(s.clone())),
                    (lty.clone(), Val::F(like.clone())),
                ],
                &topo,
            );
            assert_eq!(ty, rows(lty.space, sty.width()));
            let k = if mean { 1.0 / r as f64 } else { 1.0 };
            let want: Vec<f64> = (0..r)
                .flat_map(|_| s.iter().map(|v| v * k).collect::<Vec<_>>())
                .collect();
            assert_close(
                &got,
                &want,
                FWD_TOL,
                &format!("{} of {sty} over {r} rows", op.name()),
            );
        }
    }
}

#[test]
fn reshape_forward() {
    let mut rng = Rng::new(13);
    for (from, to) in [
        (vec![2, 3], vec![3, 2]),
        (vec![6], vec![1, 6]),
        (vec![2, 3, 4], vec![24]),
        (vec![5], vec![5]),
    ] {
        let n: usize = from.iter().product();
        let x = rng.vec(n, -1.0, 1.0);
        let (ty, got) = fwd(
            &Reshape { shape: to.clone() },
            &[(fixed(&from), Val::F(x.clone()))],
            &Topo::vertices(3),
        );
        assert_eq!(ty, fixed(&to));
        assert_eq!(got, x, "reshape keeps the data in order");
    }
}

#[test]
fn embedding_forward() {
    let mut rng = Rng::new(14);
    for (vocab, h, space, topo) in [
        (7, 5, V, Topo::vertices(4)),
        (3, 1, V, Topo::vertices(1)),
        (9, 10, E, Topo::from_children(&[2, 0, 3])),
    ] {
        let table = rng.vec(vocab * h, -1.0, 1.0);
        let r = topo.rows(space);
        let mut tok = rng.idx(r, vocab);
        tok[0] = (vocab - 1) as u32; // the last row of the table
        let (ty, got) = fwd(
            &Embedding,
            &[
                (fixed(&[vocab, h]), Val::F(table.clone())),
                (ValueType::index_rows(space), Val::I(tok.clone())),
            ],
            &topo,
        );
        assert_eq!(ty, rows(space, h));
        let want: Vec<f64> = tok
            .iter()
            .flat_map(|&t| table[t as usize * h..(t as usize + 1) * h].to_vec())
            .collect();
        assert_close(&got, &want, 0.0, "embedding");
    }
}

fn xent_ref(x: &[f64], labels: &[u32], c: usize) -> (Vec<f64>, Vec<f64>) {
    let mut loss = Vec::new();
    let mut probs = Vec::new();
    for (r, &l) in labels.iter().enumerate() {
        let row = &x[r * c..(r + 1) * c];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
        loss.push(m + z.ln() - row[l as usize]);
        probs.extend(row.iter().map(|v| (v - m).exp() / z));
    }
    (loss, probs)
}

#[test]
fn softmax_xent_and_backward_forward() {
    let mut rng = Rng::new(15);
    for (space, topo, c, scale) in [
        (V, Topo::vertices(1), 1, 1.0),
        (V, Topo::vertices(1), 5, 3.0),
        (V, Topo::vertices(6), 11, 3.0),
        (E, Topo::from_children(&[2, 1]), 4, 1.0),
        // large scores: needs the max subtraction to stay finite
        (V, Topo::vertices(3), 4, 1000.0),
    ] {
        let r = topo.rows(space);
        let x = rng.vec(r * c, -scale, scale);
        let labels = rng.idx(r, c);
        let (ty, got) = fwd(
            &SoftmaxXent,
            &[
                (rows(space, c), Val::F(x.clone())),
                (ValueType::index_rows(space), Val::I(labels.clone())),
            ],
            &topo,
        );
        assert_eq!(ty, rows(space, 1));
        let (want, probs) = xent_ref(&x, &labels, c);
        assert!(
            got.iter().all(|v| v.is_finite() && *v >= 0.0),
            "losses are finite and non-negative: {got:?}"
        );
        assert_close(
            &got,
            &want,
            1e-11,
            &format!("softmax_xent {r}x{c} scale {scale}"),
        );

        let up = rng.vec(r, -2.0, 2.0);
        let (ty, got) = fwd(
            &SoftmaxXentBackward,
            &[
                (rows(space, c), Val::F(x.clone())),
                (ValueType::index_rows(space), Val::I(labels.clone())),
                (rows(space, 1), Val::F(up.clone())),
            ],
            &topo,
        );
        assert_eq!(ty, rows(space, c));
        let mut want = probs.clone();
        for (row, &l) in labels.iter().enumerate() {
            want[row * c + l as usize] -= 1.0;
            for j in 0..c {
                want[row * c + j] *= up[row];
            }
        }
        assert_close(
            &got,
            &want,
            FWD_TOL,
            &format!("softmax_xent_backward {r}x{c} scale {scale}"),
        );
    }
}

// ----------------------------------------------------------------------
// zero-row runs (a task whose vertices have no children runs its edge-space
// nodes over 0 edge rows)
// ----------------------------------------------------------------------

#[test]
fn structure_ops_on_zero_rows() {
    let topo = Topo::vertices(2); // no edges
    let empty = |w: usize| (rows(E, w), Val::F(vec![]));
    assert!(fwd(&Concat, &[empty(2), empty(3)], &topo).1.is_empty());
    assert!(fwd(&Slice { start: 1, len: 2 }, &[empty(4)], &topo)
        .1
        .is_empty());
    assert!(fwd(&Pad { start: 1, total: 6 }, &[empty(4)], &topo)
        .1
        .is_empty());
    assert!(fwd(
        &BroadcastRows { mean: true },
        &[(fixed(&[3]), Val::F(vec![1.0; 3])), empty(1)],
        &topo
    )
    .1
    .is_empty());
    let (_, got) = fwd(
        &MatMul {
            trans_a: true,
            trans_b: false,
        },
        &[empty(3), empty(2)],
        &topo,
    );
    assert_eq!(got, vec![0.0; 6], "Aᵀ·B over zero rows is zero");
    let (_, got) = fwd(
        &MatMul {
            trans_a: false,
            trans_b: true,
        },
        &[empty(3), (fixed(&[2, 3]), Val::F(vec![1.0; 6]))],
        &topo,
    );
    assert!(got.is_empty());
    let (_, got) = fwd(
        &MatMul {
            trans_a: false,
            trans_b: false,
        },
        &[empty(3), (fixed(&[3, 2]), Val::F(vec![1.0; 6]))],
        &topo,
    );
    assert!(got.is_empty());
    let (_, got) = fwd(
        &Embedding,
        &[
            (fixed(&[3, 2]), Val::F(vec![1.0; 6])),
            (ValueType::index_rows(E), Val::I(vec![])),
        ],
        &topo,
    );
    assert!(got.is_empty());
    let (_, got) = fwd(
        &SoftmaxXent,
        &[empty(3), (ValueType::index_rows(E), Val::I(vec![]))],
        &topo,
    );
    assert!(got.is_empty());
}

#[test]
fn elementwise_ops_on_zero_rows() {
    let topo = Topo::vertices(2); // no edges
    for (op, _, _) in unary_ops() {
        let r = run_op(&op, &[(rows(E, 4), Val::F(vec![]))], &topo);
        assert_eq!(
            r,
            Ok((rows(E, 4), vec![])),
            "{} over zero rows",
            op.signature()
        );
    }
    for (op, _, _, _) in binary_ops() {
        let r = run_op(
            &op,
            &[
                (rows(E, 4), Val::F(vec![])),
                (fixed(&[4]), Val::F(vec![1.0; 4])),
            ],
            &topo,
        );
        assert_eq!(
            r,
            Ok((rows(E, 4), vec![])),
            "{} over zero rows",
            op.signature()
        );
    }
}

#[test]
fn matmul_on_zero_rows_with_large_weights() {
    // a large B selects the column-threaded small-row path even for 0 rows
    let topo = Topo::vertices(2);
    let (k, n) = (384, 385);
    for trans_b in [false, true] {
        let shape = if trans_b { [n, k] } else { [k, n] };
        let r = run_op(
            &MatMul {
                trans_a: false,
                trans_b,
            },
            &[
                (rows(E, k), Val::F(vec![])),
                (fixed(&shape), Val::F(vec![0.5; k * n])),
            ],
            &topo,
        );
        assert_eq!(
            r,
            Ok((rows(E, n), vec![])),
            "matmul trans_b={trans_b} over zero rows"
        );
    }
}

// ======================================================================
// 2. Gradients against central finite differences
// ======================================================================

const PULL: Slot = Slot::Input(Source::Pull);
const G0: Slot = Slot::Input(Source::Gather(0));
const ALL: Slot = Slot::Input(Source::GatherAll);
const P0: Slot = Slot::Param(0);
const P1: Slot = Slot::Param(1);

/// The backward graph emitted `role` (so the gradient did not come out as zero by omission).
fn assert_has_output(r: &GradReport, role: Role) {
    assert!(
        r.backward.output(role).is_some(),
        "backward graph has no {role:?} output:\n{}",
        r.backward.listing(&[])
    );
}

fn edge_topo() -> Topo {
    Topo::from_children(&[2, 0, 1, 3])
}

#[test]
fn unary_ops_gradients() {
    let mut rng = Rng::new(20);
    for (op, _, dist) in unary_ops() {
        // the scale(0) entry has a zero gradient: FD agreement is still checked
        let zero = matches!(op.attrs().as_str(), "0") && op.name() == "scale";
        // vertex rows (Pull)
        let topo = Topo::vertices(3);
        let mut c = Case::new(topo.clone(), vec![]);
        let x = c.input(Source::Pull, rows(V, 5), Val::F(dist.sample(&mut rng, 15)));
        let y = c.b.apply(op.clone(), &[x]);
        let r = c.check(y, 100);
        if zero {
            r.assert_zero(PULL);
        } else {
            r.assert_nonzero(PULL);
            assert_has_output(&r, Role::PullGrad);
        }
        // edge rows (GatherAll)
        let topo = edge_topo();
        let mut c = Case::new(topo.clone(), vec![]);
        let n = topo.edges() * 4;
        let x = c.input(
            Source::GatherAll,
            rows(E, 4),
            Val::F(dist.sample(&mut rng, n)),
        );
        let y = c.b.apply(op.clone(), &[x]);
        let r = c.check(y, 101);
        if !zero {
            r.assert_nonzero(ALL);
            assert_has_output(&r, Role::ChildGradAll);
        }
        // a static parameter
        let mut c = Case::new(
            Topo::vertices(2),
            vec![(vec![2, 3], dist.sample(&mut rng, 6))],
        );
        let p = c.param(0);
        let y = c.b.apply(op.clone(), &[p]);
        let r = c.check(y, 102);
        if !zero {
            r.assert_nonzero(P0);
            assert_has_output(&r, Role::ParamGrad(0));
        }
    }
}

/// Binary op layouts for gradient checks.
#[derive(Clone, Copy, Debug)]
enum BinLayout {
    /// vertex rows (Pull) with vertex rows (Gather(0))
    RowsRows,
    /// vertex rows with a static [w] parameter (bias as 2nd operand)
    RowsBias,
    /// a static [1, w] parameter with vertex rows (1st operand broadcast)
    BiasRows,
    /// edge rows with a static [w, 1] parameter
    EdgeBias,
    /// two static [2, 3] parameters
    StaticStatic,
    /// the same vertex rows as both operands
    Same,
}

#[test]
fn binary_ops_gradients() {
    use BinLayout::*;
    let mut rng = Rng::new(21);
    let w = 4;
    for (op, _, da, db) in binary_ops() {
        let relu_b = op.name() == "relu_backward";
        for layout in [RowsRows, RowsBias, BiasRows, EdgeBias, StaticStatic, Same] {
            let seed = rng.next_u64();
            let (r, slot_a, slot_b) = match layout {
                RowsRows => {
                    let mut c = Case::new(Topo::vertices(3), vec![]);
                    let a = c.input(Source::Pull, rows(V, w), Val::F(da.sample(&mut rng, 3 * w)));
                    let b = c.input(
                        Source::Gather(0),
                        rows(V, w),
                        Val::F(db.sample(&mut rng, 3 * w)),
                    );
                    let y = c.b.apply(op.clone(), &[a, b]);
                    (c.check(y, seed), PULL, G0)
                }
                RowsBias => {
                    let mut c =
                        Case::new(Topo::vertices(3), vec![(vec![w], db.sample(&mut rng, w))]);
                    let a = c.input(Source::Pull, rows(V, w), Val::F(da.sample(&mut rng, 3 * w)));
                    let b = c.param(0);
                    let y = c.b.apply(op.clone(), &[a, b]);
                    (c.check(y, seed), PULL, P0)
                }
                BiasRows => {
                    let mut c = Case::new(
                        Topo::vertices(3),
                        vec![(vec![1, w], da.sample(&mut rng, w))],
                    );
                    let a = c.param(0);
                    let b = c.input(Source::Pull, rows(V, w), Val::F(db.sample(&mut rng, 3 * w)));
                    let y = c.b.apply(op.clone(), &[a, b]);
                    (c.check(y, seed), P0, PULL)
                }
                EdgeBias => {
                    let topo = edge_topo();
                    let n = topo.edges() * w;
                    let mut c = Case::new(topo, vec![(vec![w, 1], db.sample(&mut rng, w))]);
                    let a = c.input(
                        Source::GatherAll,
                        rows(E, w),
                        Val::F(da.sample(&mut rng, n)),
                    );
                    let b = c.param(0);
                    let y = c.b.apply(op.clone(), &[a, b]);
                    (c.check(y, seed), ALL, P0)
                }
                StaticStatic => {
                    let mut c = Case::new(
                        Topo::vertices(2),
                        vec![
                            (vec![2, 3], da.sample(&mut rng, 6)),
                            (vec![2, 3], db.sample(&mut rng, 6)),
                        ],
                    );
                    let (a, b) = (c.param(0), c.param(1));
                    let y = c.b.apply(op.clone(), &[a, b]);
                    (c.check(y, seed), P0, P1)
                }
                Same => {
                    // both operands drawn from the 2nd operand's range unless
                    // the 1st needs to avoid a kink (relu_backward)
                    let d = if relu_b { da } else { db };
                    let d = if op.name() == "div" {
                        Dist::Away(0.5, 2.0)
                    } else {
                        d
                    };
                    let mut c = Case::new(Topo::vertices(3), vec![]);
                    let x = c.input(Source::Pull, rows(V, w), Val::F(d.sample(&mut rng, 3 * w)));
                    let y = c.b.apply(op.clone(), &[x, x]);
                    let r = c.check(y, seed);
                    // x/x == 1 and sub(x, x) == 0: no dependence on x
                    if !matches!(op.name(), "div" | "sub") {
                        r.assert_nonzero(PULL);
                    }
                    continue;
                }
            };
            if relu_b {
                // d/dx of (x > 0 ? g : 0) is zero away from 0
                r.assert_zero(slot_a);
                r.assert_nonzero(slot_b);
            } else {
                r.assert_nonzero(slot_a);
                r.assert_nonzero(slot_b);
            }
        }
    }
}

#[test]
fn matmul_rows_times_static_gradients() {
    let mut rng = Rng::new(22);
    let (k, n) = (4, 3);
    for trans_b in [false, true] {
        for r in [1, 3, 5, 9] {
            let w_shape = if trans_b { vec![n, k] } else { vec![k, n] };
            let mut c = Case::new(
                Topo::vertices(r),
                vec![(w_shape, rng.vec(k * n, -1.0, 1.0))],
            );
            let x = c.input_rand(Source::Pull, rows(V, k), &mut rng, -1.0, 1.0);
            let w = c.param(0);
            let y = c.b.matmul(x, w, false, trans_b);
            let rep = c.check(y, 200 + r as u64);
            rep.assert_nonzero(PULL);
            rep.assert_nonzero(P0);
        }
        // edge rows
        let w_shape = if trans_b { vec![n, k] } else { vec![k, n] };
        let mut c = Case::new(edge_topo(), vec![(w_shape, rng.vec(k * n, -1.0, 1.0))]);
        let x = c.input_rand(Source::GatherAll, rows(E, k), &mut rng, -1.0, 1.0);
        let w = c.param(0);
        let y = c.b.matmul(x, w, false, trans_b);
        c.check(y, 210).assert_all_nonzero_except(&[]);
    }
    // linear = matmul(x, W, false, true) + bias
    let mut c = Case::new(
        Topo::vertices(5),
        vec![
            (vec![n, k], rng.vec(k * n, -1.0, 1.0)),
            (vec![n], rng.vec(n, -1.0, 1.0)),
        ],
    );
    let x = c.input_rand(Source::Pull, rows(V, k), &mut rng, -1.0, 1.0);
    let (w, b) = (c.param(0), c.param(1));
    let y = c.b.linear(x, w, Some(b));
    c.check(y, 211).assert_all_nonzero_except(&[]);
}

#[test]
fn matmul_rows_transposed_times_rows_gradients() {
    let mut rng = Rng::new(23);
    for r in [1, 5] {
        let mut c = Case::new(Topo::vertices(r), vec![]);
        let a = c.input_rand(Source::Pull, rows(V, 3), &mut rng, -1.0, 1.0);
        let b = c.input_rand(Source::Gather(0), rows(V, 4), &mut rng, -1.0, 1.0);
        let y = c.b.matmul(a, b, true, false);
        let rep = c.check(y, 300 + r as u64);
        rep.assert_nonzero(PULL);
        rep.assert_nonzero(G0);
    }
    // edge rows, the same value on both sides (Gram matrix): gradients add up
    let mut c = Case::new(edge_topo(), vec![]);
    let a = c.input_rand(Source::GatherAll, rows(E, 3), &mut rng, -1.0, 1.0);
    let y = c.b.matmul(a, a, true, false);
    c.check(y, 310).assert_nonzero(ALL);
}

#[test]
fn matmul_static_times_static_gradients() {
    let mut rng = Rng::new(24);
    for &(m, k, n) in &[(2, 3, 4), (5, 2, 3)] {
        for ta in [false, true] {
            for tb in [false, true] {
                let a_shape = if ta { vec![k, m] } else { vec![m, k] };
                let b_shape = if tb { vec![n, k] } else { vec![k, n] };
                let mut c = Case::new(
                    Topo::vertices(2),
                    vec![
                        (a_shape, rng.vec(m * k, -1.0, 1.0)),
                        (b_shape, rng.vec(k * n, -1.0, 1.0)),
                    ],
                );
                let (a, b) = (c.param(0), c.param(1));
                let y = c.b.matmul(a, b, ta, tb);
                let rep = c.check(y, 400);
                rep.assert_nonzero(P0);
                rep.assert_nonzero(P1);
                assert_has_output(&rep, Role::ParamGrad(0));
                assert_has_output(&rep, Role::ParamGrad(1));
            }
        }
    }
}

#[test]
fn concat_slice_pad_gradients() {
    let mut rng = Rng::new(25);
    // concat of different inputs, one of them twice
    let mut c = Case::new(Topo::vertices(3), vec![]);
    let x = c.input_rand(Source::Pull, rows(V, 3), &mut rng, -1.0, 1.0);
    let g = c.input_rand(Source::Gather(0), rows(V, 2), &mut rng, -1.0, 1.0);
    let y = c.b.concat(&[x, g, x]);
    c.check(y, 500).assert_all_nonzero_except(&[]);
    // a single operand, edge rows
    let mut c = Case::new(edge_topo(), vec![]);
    let e = c.input_rand(Source::GatherAll, rows(E, 2), &mut rng, -1.0, 1.0);
    let y = c.b.concat(&[e]);
    c.check(y, 501).assert_nonzero(ALL);
    // slice
    for (start, len) in [(0, 7), (2, 3), (6, 1)] {
        let mut c = Case::new(Topo::vertices(3), vec![]);
        let x = c.input_rand(Source::Pull, rows(V, 7), &mut rng, -1.0, 1.0);
        let y = c.b.slice(x, start, len);
        let rep = c.check(y, 502);
        let (a, _) = rep.get(PULL);
        for (i, v) in a.iter().enumerate() {
            let col = i % 7;
            assert_eq!(
                *v == 0.0,
                !(start..start + len).contains(&col),
                "slice {start}+{len}: gradient of column {col} is {v}"
            );
        }
    }
    // split = slices
    let mut c = Case::new(Topo::vertices(2), vec![]);
    let x = c.input_rand(Source::Pull, rows(V, 6), &mut rng, -1.0, 1.0);
    let parts = c.b.split(x, 3);
    let y = c.b.concat(&[parts[2], parts[0]]);
    c.check(y, 503);
    // pad
    for (start, total) in [(0, 3), (2, 8), (5, 8)] {
        let mut c = Case::new(Topo::vertices(3), vec![]);
        let x = c.input_rand(Source::Pull, rows(V, 3), &mut rng, -1.0, 1.0);
        let y = c.b.pad(x, start, total);
        c.check(y, 504).assert_nonzero(PULL);
    }
}

#[test]
fn children_gradients() {
    let mut rng = Rng::new(26);
    for topo in children_topologies() {
        let ne = topo.edges();
        let mut c = Case::new(topo.clone(), vec![]);
        let e = c.input(
            Source::GatherAll,
            rows(E, 3),
            Val::F(rng.vec(ne * 3, -1.0, 1.0)),
        );
        let y = c.b.sum_children(e);
        c.check(y, 600).assert_nonzero(ALL);

        let nv = topo.vertex_rows;
        let mut c = Case::new(topo.clone(), vec![]);
        let x = c.input(Source::Pull, rows(V, 3), Val::F(rng.vec(nv * 3, -1.0, 1.0)));
        let y = c.b.expand_children(x);
        let rep = c.check(y, 601);
        // vertices without children get no gradient
        let (a, _) = rep.get(PULL);
        for v in 0..nv {
            let has_children = topo.edge_parent.contains(&(v as u32));
            assert_eq!(
                a[v * 3..v * 3 + 3].iter().any(|g| *g != 0.0),
                has_children,
                "vertex {v}"
            );
        }
    }
}

#[test]
fn row_reduction_and_broadcast_gradients() {
    let mut rng = Rng::new(27);
    for mean in [false, true] {
        for (space, topo) in [
            (V, Topo::vertices(1)),
            (V, Topo::vertices(4)),
            (E, edge_topo()),
        ] {
            let src = if space == V {
                Source::Pull
            } else {
                Source::GatherAll
            };
            let mut c = Case::new(topo, vec![]);
            let x = c.input_rand(src, rows(space, 5), &mut rng, -1.0, 1.0);
            let y = if mean {
                c.b.mean_rows(x)
            } else {
                c.b.sum_rows(x)
            };
            c.check(y, 700).assert_nonzero(Slot::Input(src));
        }
        for shape in [vec![5], vec![1, 5], vec![2, 3]] {
            let n: usize = shape.iter().product();
            let mut c = Case::new(Topo::vertices(4), vec![(shape, rng.vec(n, -1.0, 1.0))]);
            let s = c.param(0);
            let like = c.input_rand(Source::Pull, rows(V, 2), &mut rng, -1.0, 1.0);
            let y = c.b.broadcast_rows(s, like, mean);
            let rep = c.check(y, 701);
            rep.assert_nonzero(P0);
            // the reference only supplies the row count
            rep.assert_zero(PULL);
        }
    }
}

#[test]
fn reshape_gradient() {
    let mut rng = Rng::new(28);
    let mut c = Case::new(Topo::vertices(2), vec![(vec![2, 3], rng.vec(6, -1.0, 1.0))]);
    let p = c.param(0);
    let y = c.b.reshape(p, &[3, 2]);
    let y = c.b.exp(y); // make the gradient depend on position
    c.check(y, 800).assert_nonzero(P0);
}

#[test]
fn embedding_gradient_is_a_row_gradient() {
    let mut rng = Rng::new(29);
    let (vocab, h) = (6, 4);
    // token 2 appears twice (its row gradients must add), tokens 1, 3, 4 never
    let tokens = vec![2, 5, 2, 0];
    let mut c = Case::new(
        Topo::vertices(4),
        vec![(vec![vocab, h], rng.vec(vocab * h, -1.0, 1.0))],
    );
    let table = c.param(0);
    let tok = c.input(
        Source::Token,
        ValueType::index_rows(V),
        Val::I(tokens.clone()),
    );
    let y = c.b.embedding(table, tok);
    let y = c.b.tanh(y);
    let rep = c.check(y, 900);
    let o = rep
        .backward
        .output(Role::ParamRowGrad(0))
        .expect("embedding gives a ParamRowGrad");
    let aux = o.aux.expect("with an index node");
    assert_eq!(rep.backward.nodes[aux].ty.dtype, DType::Index);
    assert!(
        rep.backward.output(Role::ParamGrad(0)).is_none(),
        "no dense gradient for the table"
    );
    let (a, _) = rep.get(P0);
    for v in 0..vocab {
        let used = tokens.contains(&(v as u32));
        assert_eq!(
            a[v * h..(v + 1) * h].iter().any(|g| *g != 0.0),
            used,
            "table row {v}"
        );
    }
    // edge-space tokens, two lookups into the same table (two row gradients)
    let topo = edge_topo();
    let ne = topo.edges();
    let mut c = Case::new(topo, vec![(vec![vocab, h], rng.vec(vocab * h, -1.0, 1.0))]);
    let table = c.param(0);
    let t1 = c.input(
        Source::Label,
        ValueType::index_rows(E),
        Val::I(rng.idx(ne, vocab)),
    );
    let t2 = c.input(
        Source::Token,
        ValueType::index_rows(E),
        Val::I(rng.idx(ne, vocab)),
    );
    let y1 = c.b.embedding(table, t1);
    let y2 = c.b.embedding(table, t2);
    let x = c.input_rand(Source::GatherAll, rows(E, h), &mut rng, -1.0, 1.0);
    let y = c.b.mul(y1, x);
    let y = c.b.mul(y, y2);
    let rep = c.check(y, 901);
    rep.assert_all_nonzero_except(&[]);
    let row_grads = rep
        .backward
        .outputs
        .iter()
        .filter(|o| o.role == Role::ParamRowGrad(0))
        .count();
    assert_eq!(row_grads, 2, "one row gradient per lookup");
}

#[test]
fn softmax_xent_gradient() {
    let mut rng = Rng::new(30);
    for (r, classes) in [(1, 2), (4, 5), (3, 1)] {
        let mut c = Case::new(Topo::vertices(r), vec![]);
        let x = c.input_rand(Source::Pull, rows(V, classes), &mut rng, -2.0, 2.0);
        let l = c.input(
            Source::Label,
            ValueType::index_rows(V),
            Val::I(rng.idx(r, classes)),
        );
        let y = c.b.softmax_xent(x, l);
        let rep = c.check(y, 1000);
        if classes > 1 {
            rep.assert_nonzero(PULL);
        } else {
            // one class: the loss is identically 0
            rep.assert_zero(PULL);
        }
    }
    // the usual head: scalar mean loss, seeded with 1.0
    let mut c = Case::new(
        Topo::vertices(5),
        vec![(vec![3, 4], rng.vec(12, -1.0, 1.0))],
    );
    let x = c.input_rand(Source::HeadInput, rows(V, 4), &mut rng, -1.0, 1.0);
    let w = c.param(0);
    let logits = c.b.linear(x, w, None);
    let l = c.input(
        Source::Label,
        ValueType::index_rows(V),
        Val::I(vec![0, 2, 1, 2, 0]),
    );
    let losses = c.b.softmax_xent(logits, l);
    let loss = c.b.mean_rows(losses);
    let rep = c.check(loss, 1001);
    rep.assert_all_nonzero_except(&[]);
    assert_has_output(&rep, Role::HeadInputGrad);
}

#[test]
fn softmax_xent_backward_has_no_gradient() {
    let mut c = Case::new(Topo::vertices(3), vec![]);
    let mut rng = Rng::new(31);
    let x = c.input_rand(Source::Pull, rows(V, 4), &mut rng, -1.0, 1.0);
    let l = c.input(
        Source::Label,
        ValueType::index_rows(V),
        Val::I(vec![0, 3, 1]),
    );
    let g = c.input_rand(Source::Gather(0), rows(V, 1), &mut rng, -1.0, 1.0);
    let d = c.b.apply(prim(SoftmaxXentBackward), &[x, l, g]);
    let (graph, shapes, env) = c.finish(d);
    // the forward itself runs
    eval(&graph, &env, None, &HashMap::new()).unwrap();
    let err = differentiate(&graph, &shapes, "test")
        .expect_err("second derivatives of softmax_xent are not supported");
    let msg = err.to_string();
    assert!(
        msg.contains("softmax_xent_backward") && msg.contains("second derivatives"),
        "{msg}"
    );
}

/// A child-sum cell over edge and vertex rows with several seeded outputs:
/// exercises gradient accumulation across ops and spaces together.
#[test]
fn child_sum_cell_gradient() {
    let mut rng = Rng::new(32);
    let (h, xin) = (3, 2);
    let topo = Topo::from_children(&[0, 1, 3, 2]);
    let params = vec![
        (vec![h, h], rng.vec(h * h, -0.8, 0.8)),               // U_f
        (vec![h, xin], rng.vec(h * xin, -0.8, 0.8)),           // W_f
        (vec![h], rng.vec(h, -0.5, 0.5)),                      // b_f
        (vec![h, h + xin], rng.vec(h * (h + xin), -0.8, 0.8)), // W
    ];
    let mut c = Case::new(topo, params);
    let ch = c.input_rand(Source::GatherAll, rows(E, h), &mut rng, -1.0, 1.0);
    let x = c.input_rand(Source::Pull, rows(V, xin), &mut rng, -1.0, 1.0);
    let (uf, wf, bf, w) = (c.param(0), c.param(1), c.param(2), c.param(3));
    let b = &mut c.b;
    let hsum = b.sum_children(ch);
    let fx = b.linear(x, wf, Some(bf));
    let fx = b.expand_children(fx);
    let fh = b.matmul(ch, uf, false, true);
    let f = b.add(fh, fx);
    let f = b.sigmoid(f);
    let fc = b.mul(f, ch);
    let csum = b.sum_children(fc);
    let xh = b.concat(&[hsum, x]);
    let z = b.linear(xh, w, None);
    let z = b.relu(z);
    let z = b.add(z, csum);
    let out = b.tanh(z);
    b.output(Role::Scatter, out, None);
    let pushed = b.slice(out, 1, 2);
    b.output(Role::Push, pushed, None);
    let g = c.b.finish().unwrap();
    // relu inputs must stay away from 0 for FD: check the data gives margins
    let fwd = eval(&g, &c.env, None, &HashMap::new()).unwrap();
    let relu_node = g
        .nodes
        .iter()
        .position(|n| n.op().map(|o| o.name()) == Some("relu"))
        .unwrap();
    let pre = fwd[g.nodes[relu_node].inputs[0]].f();
    assert!(
        pre.iter().all(|v| v.abs() > 1e-4),
        "test data too close to the relu kink: {pre:?}"
    );
    let rep = grad_check(&g, &c.shapes, &c.env, 1100);
    rep.assert_all_nonzero_except(&[]);
    assert_has_output(&rep, Role::ChildGradAll);
    assert_has_output(&rep, Role::PullGrad);
}

// ======================================================================
// 3. Shape inference errors
// ======================================================================

/// Builds with `f` and returns the error message `finish()` reports.
fn shape_error(f: impl FnOnce(&mut GraphBuilder)) -> String {
    let mut b = GraphBuilder::new("shape-test", &[vec![3, 4], vec![4], vec![2, 3], vec![5]]);
    f(&mut b);
    match b.finish() {
        Ok(g) => panic!("expected a shape error, built:\n{}", g.listing(&[])),
        Err(e) => e.to_string(),
    }
}

#[track_caller]
fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(
            msg.contains(p),
            "error message `{msg}` does not mention `{p}`"
        );
    }
    assert!(
        msg.starts_with("shape-test: "),
        "error names the graph: {msg}"
    );
}

#[test]
fn elementwise_shape_errors() {
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 3));
        let y = b.input(Source::Gather(0), rows(V, 4));
        b.add(x, y);
    });
    assert_mentions(
        &m,
        &[
            "`add`",
            "row operands differ",
            "vertex[f[3]]",
            "vertex[f[4]]",
        ],
    );
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 3));
        let y = b.input(Source::GatherAll, rows(E, 3));
        b.mul(x, y);
    });
    assert_mentions(&m, &["`mul`", "row operands differ"]);
    // [2, 3] has 6 elements but is not a row
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 6));
        let p = b.param(2);
        b.sub(x, p);
    });
    assert_mentions(&m, &["`sub`", "does not broadcast"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 3));
        let p = b.param(1);
        b.div(p, x);
    });
    assert_mentions(&m, &["`div`", "does not broadcast"]);
    let m = shape_error(|b| {
        let p = b.param(1);
        let q = b.param(3);
        b.add(p, q);
    });
    assert_mentions(&m, &["`add`", "equal shapes"]);
    let m = shape_error(|b| {
        let t = b.input(Source::Token, ValueType::index_rows(V));
        b.exp(t);
    });
    assert_mentions(&m, &["`exp`", "must be float"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 3));
        b.scale(x, f64::NAN);
    });
    assert_mentions(&m, &["`scale[NaN]`", "not finite"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 3));
        let t = b.input(Source::Token, ValueType::index_rows(V));
        b.relu_backward(x, t);
    });
    assert_mentions(&m, &["`relu_backward`", "must be float"]);
}

#[test]
fn matmul_shape_errors() {
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 5));
        let w = b.param(0); // [3, 4]
        b.matmul(x, w, false, false);
    });
    assert_mentions(&m, &["matmul", "inner dimensions differ", "width 5"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 3));
        let w = b.param(0); // [3, 4]ᵀ is 4x3
        b.matmul(x, w, false, true);
    });
    assert_mentions(&m, &["matmul", "inner dimensions differ"]);
    let m = shape_error(|b| {
        let a = b.param(0);
        let c = b.param(2); // [3, 4] · [2, 3]
        b.matmul(a, c, false, false);
    });
    assert_mentions(&m, &["matmul", "inner dimensions differ: 4 vs 2"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 3));
        let y = b.input(Source::Gather(0), rows(V, 3));
        b.matmul(x, y, false, false);
    });
    assert_mentions(&m, &["matmul", "Aᵀ·B"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 3));
        let y = b.input(Source::GatherAll, rows(E, 3));
        b.matmul(x, y, true, false);
    });
    assert_mentions(&m, &["matmul", "same space"]);
    let m = shape_error(|b| {
        let a = b.param(0);
        let x = b.input(Source::Pull, rows(V, 4));
        b.matmul(a, x, false, false);
    });
    assert_mentions(&m, &["matmul", "not supported"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 3));
        let w = b.param(0);
        b.matmul(x, w, true, false);
    });
    assert_mentions(&m, &["matmul", "cannot be transposed"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 4));
        let v = b.param(1); // [4] is not a matrix
        b.matmul(x, v, false, false);
    });
    assert_mentions(&m, &["matmul", "must be a matrix"]);
}

#[test]
fn structure_shape_errors() {
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 4));
        b.slice(x, 2, 3);
    });
    assert_mentions(&m, &["`slice[2..5]`", "out of range for width 4"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 4));
        b.slice(x, 1, 0);
    });
    assert_mentions(&m, &["slice", "out of range"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 4));
        b.pad(x, 3, 6);
    });
    assert_mentions(&m, &["`pad[3/6]`", "cannot place"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 4));
        b.split(x, 3);
    });
    assert_mentions(&m, &["`split`", "does not split"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 4));
        let e = b.input(Source::GatherAll, rows(E, 4));
        b.concat(&[x, e]);
    });
    assert_mentions(&m, &["`concat`", "different spaces"]);
    let m = shape_error(|b| {
        let p = b.param(1);
        b.concat(&[p]);
    });
    assert_mentions(&m, &["`concat`", "row values"]);
    let m = shape_error(|b| {
        b.concat(&[]);
    });
    assert_mentions(&m, &["`concat`", "at least one"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 4));
        b.sum_children(x);
    });
    assert_mentions(&m, &["`sum_children`", "edge value"]);
    let m = shape_error(|b| {
        let e = b.input(Source::GatherAll, rows(E, 4));
        b.expand_children(e);
    });
    assert_mentions(&m, &["`expand_children`", "vertex value"]);
    let m = shape_error(|b| {
        let p = b.param(1);
        b.sum_rows(p);
    });
    assert_mentions(&m, &["`sum_rows`", "row value"]);
    let m = shape_error(|b| {
        let p = b.param(1);
        b.mean_rows(p);
    });
    assert_mentions(&m, &["`mean_rows`", "row value"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 4));
        b.broadcast_rows(x, x, false);
    });
    assert_mentions(
        &m,
        &["`broadcast_rows`", "static value and a row reference"],
    );
    let m = shape_error(|b| {
        let p = b.param(1);
        let q = b.param(3);
        b.broadcast_rows(p, q, true);
    });
    assert_mentions(&m, &["`broadcast_rows_mean`", "row reference"]);
    let m = shape_error(|b| {
        let p = b.param(0);
        b.reshape(p, &[5, 2]);
    });
    assert_mentions(&m, &["`reshape[[5, 2]]`", "cannot view"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 4));
        b.reshape(x, &[4]);
    });
    assert_mentions(&m, &["reshape", "cannot view"]);
}

#[test]
fn embedding_and_loss_shape_errors() {
    let m = shape_error(|b| {
        let table = b.param(0);
        let x = b.input(Source::Pull, rows(V, 1));
        b.embedding(table, x);
    });
    assert_mentions(&m, &["`embedding`", "index rows"]);
    let m = shape_error(|b| {
        let table = b.param(1);
        let t = b.input(Source::Token, ValueType::index_rows(V));
        b.embedding(table, t);
    });
    assert_mentions(&m, &["`embedding`", "table must be a static [V, H] matrix"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 4));
        let l = b.input(Source::Gather(0), rows(V, 1));
        b.softmax_xent(x, l);
    });
    assert_mentions(&m, &["`softmax_xent`", "labels must be index rows"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 4));
        let l = b.input(Source::Label, ValueType::index_rows(E));
        b.softmax_xent(x, l);
    });
    assert_mentions(&m, &["`softmax_xent`", "labels must be index rows"]);
    let m = shape_error(|b| {
        let p = b.param(0);
        let l = b.input(Source::Label, ValueType::index_rows(V));
        b.softmax_xent(p, l);
    });
    assert_mentions(&m, &["`softmax_xent`", "scores must be row values"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 4));
        let l = b.input(Source::Label, ValueType::index_rows(V));
        let g = b.input(Source::Gather(0), rows(V, 2));
        b.apply(prim(SoftmaxXentBackward), &[x, l, g]);
    });
    assert_mentions(&m, &["`softmax_xent_backward`", "[1]-wide"]);
    let m = shape_error(|b| {
        let x = b.input(Source::Pull, rows(V, 4));
        b.apply(prim(Add), &[x]);
    });
    assert_mentions(&m, &["`add`", "takes 2 inputs, got 1"]);
}

#[test]
fn first_shape_error_wins_and_poisons_later_ops() {
    let mut b = GraphBuilder::new("shape-test", &[]);
    let x = b.input(Source::Pull, rows(V, 3));
    let y = b.slice(x, 0, 9); // error
    let nodes = b.graph().nodes.len();
    let z = b.exp(y);
    let w = b.sum_children(x); // would be a second error
    assert!(b.failed());
    assert_eq!(
        b.graph().nodes.len(),
        nodes,
        "no nodes are added after an error"
    );
    assert!(b.ty(z).is_none() && b.ty(w).is_none());
    let msg = b.finish().unwrap_err().to_string();
    assert!(
        msg.contains("slice") && !msg.contains("sum_children"),
        "{msg}"
    );
}

// ======================================================================
// 4. Fusion templates
// ======================================================================

/// A tiny evaluator for the C expressions used as elementwise templates:
/// numbers (with `f` suffix), + - * /, unary -, `>`, `?:`, parentheses and
/// expf / logf / tanhf / fmaxf.
struct CExpr<'a> {
    s: &'a [u8],
    i: usize,
}

impl CExpr<'_> {
    fn eval(src: &str) -> f64 {
        let mut p = CExpr {
            s: src.as_bytes(),
            i: 0,
        };
        let v = p.cond();
        p.ws();
        assert_eq!(p.i, p.s.len(), "trailing input in `{src}` at {}", p.i);
        v
    }
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn eat(&mut self, c: u8) -> bool {
        self.ws();
        if self.i < self.s.len() && self.s[self.i] == c {
            self.i += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, c: u8) {
        assert!(
            self.eat(c),
            "expected `{}` at {} in `{}`",
            c as char,
            self.i,
            String::from_utf8_lossy(self.s)
        );
    }
    fn cond(&mut self) -> f64 {
        let c = self.cmp();
        if self.eat(b'?') {
            let a = self.cond();
            self.expect(b':');
            let b = self.cond();
            if c != 0.0 {
                a
            } else {
                b
            }
        } else {
            c
        }
    }
    fn cmp(&mut self) -> f64 {
        let a = self.sum();
        if self.eat(b'>') {
            let b = self.sum();
            return if a > b { 1.0 } else { 0.0 };
        }
        if self.eat(b'<') {
            let b = self.sum();
            return if a < b { 1.0 } else { 0.0 };
        }
        a
    }
    fn sum(&mut self) -> f64 {
        let mut v = self.prod();
        loop {
            if self.eat(b'+') {
                v += self.prod();
            } else if self.eat(b'-') {
                v -= self.prod();
            } else {
                return v;
            }
        }
    }
    fn prod(&mut self) -> f64 {
        let mut v = self.unary();
        loop {
            if self.eat(b'*') {
                v *= self.unary();
            } else if self.eat(b'/') {
                v /= self.unary();
            } else {
                return v;
            }
        }
    }
    fn unary(&mut self) -> f64 {
        if self.eat(b'-') {
            -self.unary()
        } else {
            self.primary()
        }
    }
    fn primary(&mut self) -> f64 {
        self.ws();
        if self.eat(b'(') {
            let v = self.cond();
            self.expect(b')');
            return v;
        }
        let start = self.i;
        let c = self.s.get(self.i).copied().unwrap_or(0);
        if c.is_ascii_digit() || c == b'.' {
            while self.i < self.s.len()
                && (self.s[self.i].is_ascii_digit() || self.s[self.i] == b'.')
            {
                self.i += 1;
            }
            if self.i < self.s.len() && (self.s[self.i] == b'e' || self.s[self.i] == b'E') {
                self.i += 1;
                if self.s[self.i] == b'-' || self.s[self.i] == b'+' {
                    self.i += 1;
                }
                while self.i < self.s.len() && self.s[self.i].is_ascii_digit() {
                    self.i += 1;
                }
            }
            let v: f64 = std::str::from_utf8(&self.s[start..self.i])
                .unwrap()
                .parse()
                .expect("number");
            if self.i < self.s.len() && self.s[self.i] == b'f' {
                self.i += 1;
            }
            return v;
        }
        while self.i < self.s.len()
            && (self.s[self.i].is_ascii_alphanumeric() || self.s[self.i] == b'_')
        {
            self.i += 1;
        }
        let name = std::str::from_utf8(&self.s[start..self.i])
            .unwrap()
            .to_string();
        assert!(
            !name.is_empty(),
            "unexpected input at {} in `{}`",
            start,
            String::from_utf8_lossy(self.s)
        );
        self.expect(b'(');
        let mut args = vec![self.cond()];
        while self.eat(b',') {
            args.push(self.cond());
        }
        self.expect(b')');
        match (name.as_str(), args.as_slice()) {
            ("expf", [x]) => x.exp(),
            ("logf", [x]) => x.ln(),
            ("tanhf", [x]) => x.tanh(),
            ("fmaxf", [x, y]) => x.max(*y),
            _ => panic!("unknown function {name} with {} args", args.len()),
        }
    }
}

fn instantiate(template: &str, operands: &[f64]) -> String {
    let mut s = template.to_string();
    for (i, v) in operands.iter().enumerate() {
        s = s.replace(&format!("{{{i}}}"), &format!("({v:?})"));
    }
    assert!(
        !s.contains('{') && !s.contains('}'),
        "template `{template}` has operands beyond {}",
        operands.len()
    );
    s
}

#[test]
fn elementwise_templates_match_kernels() {
    let mut rng = Rng::new(40);
    for (op, _, dist) in unary_ops() {
        let t = op
            .elementwise_template()
            .unwrap_or_else(|| panic!("{} is elementwise", op.signature()));
        assert!(
            t.contains("{0}") && !t.contains("{1}"),
            "{}: `{t}`",
            op.signature()
        );
        let x = dist.sample(&mut rng, 16);
        let (_, got) = fwd(&op, &[(rows(V, 16), Val::F(x.clone()))], &Topo::vertices(1));
        let from_template: Vec<f64> = x
            .iter()
            .map(|&x| CExpr::eval(&instantiate(&t, &[x])))
            .collect();
        assert_close(
            &from_template,
            &got,
            1e-12,
            &format!("template `{t}` of {}", op.signature()),
        );
    }
    for (op, _, da, db) in binary_ops() {
        let t = op
            .elementwise_template()
            .unwrap_or_else(|| panic!("{} is elementwise", op.signature()));
        assert!(
            t.contains("{0}") && t.contains("{1}") && !t.contains("{2}"),
            "{}: `{t}`",
            op.name()
        );
        let a = da.sample(&mut rng, 16);
        let b = db.sample(&mut rng, 16);
        let (_, got) = fwd(
            &op,
            &[
                (rows(V, 16), Val::F(a.clone())),
                (rows(V, 16), Val::F(b.clone())),
            ],
            &Topo::vertices(1),
        );
        let from_template: Vec<f64> = a
            .iter()
            .zip(&b)
            .map(|(&a, &b)| CExpr::eval(&instantiate(&t, &[a, b])))
            .collect();
        assert_close(
            &from_template,
            &got,
            1e-12,
            &format!("template `{t}` of {}", op.name()),
        );
    }
    // scalar attributes appear in the template
    assert!(Scale(2.5).elementwise_template().unwrap().contains("2.5"));
    assert!(AddScalar(-0.75)
        .elementwise_template()
        .unwrap()
        .contains("-0.75"));
    assert!(RsubScalar(3.0)
        .elementwise_template()
        .unwrap()
        .contains('3'));
}

#[test]
fn non_elementwise_ops_have_no_template() {
    let ops: Vec<Op> = vec![
        prim(MatMul {
            trans_a: false,
            trans_b: false,
        }),
        prim(MatMul {
            trans_a: true,
            trans_b: false,
        }),
        prim(Concat),
        prim(Slice { start: 0, len: 1 }),
        prim(Pad { start: 0, total: 2 }),
        prim(SumChildren),
        prim(ExpandChildren),
        prim(SumRows { mean: false }),
        prim(SumRows { mean: true }),
        prim(BroadcastRows { mean: false }),
        prim(BroadcastRows { mean: true }),
        prim(Reshape { shape: vec![2] }),
        prim(Embedding),
        prim(SoftmaxXent),
        prim(SoftmaxXentBackward),
    ];
    for op in ops {
        assert_eq!(
            op.elementwise_template(),
            None,
            "{} is not elementwise",
            op.signature()
        );
    }
}

// ======================================================================
// Kernel run-time errors
// ======================================================================

#[test]
fn kernels_reject_bad_indices() {
    let topo = Topo::vertices(2);
    let err = run_op(
        &Embedding,
        &[
            (fixed(&[3, 2]), Val::F(vec![0.0; 6])),
            (ValueType::index_rows(V), Val::I(vec![1, 3])),
        ],
        &topo,
    )
    .unwrap_err();
    assert!(
        err.contains("embedding") && err.contains("token id 3 out of range"),
        "{err}"
    );
    let err = run_op(
        &SoftmaxXent,
        &[
            (rows(V, 3), Val::F(vec![0.0; 6])),
            (ValueType::index_rows(V), Val::I(vec![2, 3])),
        ],
        &topo,
    )
    .unwrap_err();
    assert!(
        err.contains("softmax_xent") && err.contains("label 3 of row 1 out of range"),
        "{err}"
    );
    let err = run_op(
        &SoftmaxXentBackward,
        &[
            (rows(V, 3), Val::F(vec![0.0; 6])),
            (ValueType::index_rows(V), Val::I(vec![7, 0])),
            (rows(V, 1), Val::F(vec![1.0; 2])),
        ],
        &topo,
    )
    .unwrap_err();
    assert!(
        err.contains("softmax_xent_backward") && err.contains("out of range"),
        "{err}"
    );
    // an edge whose parent row is not in the run
    let bad = Topo {
        vertex_rows: 2,
        edge_parent: vec![0, 2],
    };
    let err = run_op(&SumChildren, &[(rows(E, 1), Val::F(vec![1.0, 2.0]))], &bad).unwrap_err();
    assert!(
        err.contains("sum_children") && err.contains("out of range"),
        "{err}"
    );
    let err = run_op(
        &ExpandChildren,
        &[(rows(V, 1), Val::F(vec![1.0, 2.0]))],
        &bad,
    )
    .unwrap_err();
    assert!(
        err.contains("expand_children") && err.contains("out of range"),
        "{err}"
    );
}

#[test]
fn kernels_reject_inconsistent_arguments() {
    // raw contexts that the interpreter would never build
    let ty_e = rows(E, 2);
    let data = [1.0, 2.0, 3.0, 4.0];
    let args = [Arg {
        ty: &ty_e,
        rows: 2,
        data: ArgData::Float(&data[..]),
    }];
    let mut out = vec![0.0; 4];
    let mut ctx = KernelCtx {
        args: &args,
        out: &mut out,
        out_rows: 2,
        vertex_rows: 2,
        edge_parent: &[0, 0, 1],
        packed_b: None,
        norm_sum: None,
    };
    let err = kernels::run::<f64>(&SumChildren.into(), &mut ctx)
        .unwrap_err()
        .to_string();
    assert!(err.contains("edge topology does not match"), "{err}");

    let ty_v = rows(V, 4);
    let short = [1.0; 6];
    let args = [Arg {
        ty: &ty_v,
        rows: 2,
        data: ArgData::Float(&short[..]),
    }];
    let mut out = vec![0.0; 8];
    let mut ctx = KernelCtx {
        args: &args,
        out: &mut out,
        out_rows: 2,
        vertex_rows: 2,
        edge_parent: &[],
        packed_b: None,
        norm_sum: None,
    };
    let err = kernels::run::<f64>(&Exp.into(), &mut ctx)
        .unwrap_err()
        .to_string();
    assert!(err.contains("exp") && err.contains("need 8"), "{err}");

    let ty_i = ValueType::index_rows(V);
    let idx = [0u32, 1];
    let args = [Arg {
        ty: &ty_i,
        rows: 2,
        data: ArgData::Index(&idx[..]),
    }];
    let mut out = vec![0.0; 2];
    let mut ctx = KernelCtx {
        args: &args,
        out: &mut out,
        out_rows: 2,
        vertex_rows: 2,
        edge_parent: &[],
        packed_b: None,
        norm_sum: None,
    };
    let err = kernels::run::<f64>(&Neg.into(), &mut ctx)
        .unwrap_err()
        .to_string();
    assert!(err.contains("expected a float argument"), "{err}");
}

// ======================================================================
// 5. The op registry
// ======================================================================

/// The op node `s` refers to.
fn op_of(b: &GraphBuilder, s: Sym) -> Op {
    match &b.graph().nodes[s.id()].kind {
        NodeKind::Op(op) => op.clone(),
        k => panic!("node %{} is not an op: {k:?}", s.id()),
    }
}

#[test]
fn registry_calls_every_primitive_by_name() {
    let reg = OpRegistry::standard();
    let mut b = GraphBuilder::new("reg", &[vec![4, 3], vec![4], vec![5, 4]]);
    let x = b.input(Source::Pull, rows(V, 4));
    let e = b.input(Source::GatherAll, rows(E, 4));
    let tok = b.input(Source::Token, ValueType::index_rows(V));
    let (w, bias, table) = (b.param(0), b.param(1), b.param(2));
    #[allow(clippy::type_complexity)]
    let calls: Vec<(&str, Vec<Sym>, Vec<f64>, &str)> = vec![
        ("neg", vec![x], vec![], "neg"),
        ("exp", vec![x], vec![], "exp"),
        ("log", vec![x], vec![], "log"),
        ("sigmoid", vec![x], vec![], "sigmoid"),
        ("tanh", vec![x], vec![], "tanh"),
        ("relu", vec![x], vec![], "relu"),
        ("scale", vec![x], vec![1.5], "scale[1.5]"),
        ("add_scalar", vec![x], vec![-2.0], "add_scalar[-2]"),
        ("rsub_scalar", vec![x], vec![1.0], "rsub_scalar[1]"),
        ("add", vec![x, bias], vec![], "add"),
        ("sub", vec![bias, x], vec![], "sub"),
        ("mul", vec![x, x], vec![], "mul"),
        ("div", vec![x, x], vec![], "div"),
        ("sigmoid_backward", vec![x, x], vec![], "sigmoid_backward"),
        ("tanh_backward", vec![x, x], vec![], "tanh_backward"),
        ("relu_backward", vec![x, x], vec![], "relu_backward"),
        ("matmul", vec![x, w], vec![], "matmul[AB]"),
        ("matmul", vec![x, w], vec![0.0, 0.0], "matmul[AB]"),
        ("matmul", vec![x, table], vec![0.0, 1.0], "matmul[ABᵀ]"),
        ("matmul", vec![x, x], vec![1.0], "matmul[AᵀB]"),
        ("concat", vec![x, x, x], vec![], "concat"),
        ("slice", vec![x], vec![1.0, 2.0], "slice[1..3]"),
        ("pad", vec![x], vec![2.0, 7.0], "pad[2/7]"),
        ("sum_children", vec![e], vec![], "sum_children"),
        ("expand_children", vec![x], vec![], "expand_children"),
        ("sum_rows", vec![x], vec![], "sum_rows"),
        ("mean_rows", vec![x], vec![], "mean_rows"),
        ("broadcast_rows", vec![bias, e], vec![], "broadcast_rows"),
        (
            "broadcast_rows_mean",
            vec![bias, e],
            vec![],
            "broadcast_rows_mean",
        ),
        ("reshape", vec![bias], vec![2.0, 2.0], "reshape[[2, 2]]"),
        ("embedding", vec![table, tok], vec![], "embedding"),
        ("softmax_xent", vec![x, tok], vec![], "softmax_xent"),
    ];
    let ones = b.input(Source::Gather(0), rows(V, 1));
    let calls: Vec<(&str, Vec<Sym>, Vec<f64>, &str)> = calls
        .into_iter()
        .chain([(
            "softmax_xent_backward",
            vec![x, tok, ones],
            vec![],
            "softmax_xent_backward",
        )])
        .collect();
    let names = reg.names();
    for (name, inputs, attrs, sig) in calls {
        assert!(names.contains(&name), "registry lists {name}");
        assert!(
            reg.doc(name).is_some_and(|d| !d.is_empty()),
            "{name} has a doc line"
        );
        let y = reg.call(&mut b, name, &inputs, &attrs);
        assert!(!b.failed(), "calling {name}: {:?}", b.ty(y));
        let op = op_of(&b, y);
        assert_eq!(
            op.name(),
            name,
            "registry entry {name} makes an op of that name"
        );
        assert_eq!(op.signature(), sig);
    }
    // the ops built by name compute the same as the builder methods
    let mut c = Case::new(Topo::vertices(3), vec![]);
    let mut rng = Rng::new(50);
    let x = c.input_rand(Source::Pull, rows(V, 5), &mut rng, -1.0, 1.0);
    let a = reg.call(&mut c.b, "rsub_scalar", &[x], &[2.0]);
    let bm = c.b.rsub_scalar(x, 2.0);
    let d = c.b.sub(a, bm);
    let (g, _, env) = c.finish(d);
    let vals = eval(&g, &env, None, &HashMap::new()).unwrap();
    assert!(vals[g.output(Role::Loss).unwrap().node]
        .f()
        .iter()
        .all(|v| *v == 0.0));
}

#[test]
fn registry_reports_bad_calls() {
    let reg = OpRegistry::standard();
    let fail = |name: &str, attrs: &[f64]| -> String {
        let mut b = GraphBuilder::new("reg", &[]);
        let x = b.input(Source::Pull, rows(V, 4));
        reg.call(&mut b, name, &[x], attrs);
        b.finish().unwrap_err().to_string()
    };
    let m = fail("gelu", &[]);
    assert!(m.contains("`gelu`") && m.contains("no such op"), "{m}");
    for known in ["add", "matmul", "softmax_xent", "sum_children", "embedding"] {
        assert!(m.contains(known), "unknown-op error lists `{known}`: {m}");
    }
    let m = fail("scale", &[]);
    assert!(
        m.contains("`scale`") && m.contains("missing attribute 0 (a)"),
        "{m}"
    );
    let m = fail("slice", &[1.0]);
    assert!(m.contains("missing attribute 1 (len)"), "{m}");
    let m = fail("slice", &[1.5, 2.0]);
    assert!(m.contains("non-negative integer"), "{m}");
    let m = fail("pad", &[-1.0, 2.0]);
    assert!(m.contains("non-negative integer"), "{m}");
    let m = fail("matmul", &[0.5]);
    assert!(m.contains("must be 0 or 1"), "{m}");
    let m = fail("matmul", &[0.0, 0.0, 1.0]);
    assert!(m.contains("at most 2 attributes"), "{m}");
    let m = fail("reshape", &[]);
    assert!(m.contains("new shape"), "{m}");
    // a primitive applied to the wrong number of inputs
    let m = fail("add", &[]);
    assert!(m.contains("takes 2 inputs, got 1"), "{m}");
}

fn swish_registry() -> OpRegistry {
    let mut reg = OpRegistry::standard();
    reg.register_composite("swish_1702", 1, "x*sigmoid(1.702x)", |b, x| {
        let s = b.scale(x[0], 1.702);
        let s = b.sigmoid(s);
        b.mul(x[0], s)
    })
    .unwrap();
    reg
}

#[test]
fn registry_composite_forward_and_gradient() {
    let reg = swish_registry();
    assert!(reg.names().contains(&"swish_1702"));
    assert_eq!(
        reg.doc("swish_1702").as_deref(),
        Some("(composite) x*sigmoid(1.702x)")
    );
    let mut rng = Rng::new(51);
    // vertex rows
    let mut c = Case::new(Topo::vertices(4), vec![]);
    let x = c.input_rand(Source::Pull, rows(V, 6), &mut rng, -3.0, 3.0);
    let y = reg.call(&mut c.b, "swish_1702", &[x], &[]);
    let (g, shapes, env) = c.finish(y);
    let vals = eval(&g, &env, None, &HashMap::new()).unwrap();
    let want: Vec<f64> = env.inputs[&Source::Pull]
        .f()
        .iter()
        .map(|&x| x * sig(1.702 * x))
        .collect();
    assert_close(
        vals[g.output(Role::Loss).unwrap().node].f(),
        &want,
        FWD_TOL,
        "swish_1702",
    );
    grad_check(&g, &shapes, &env, 5100).assert_nonzero(PULL);
    // applied to a parameter, inside a scalar loss
    let mut c = Case::new(Topo::vertices(3), vec![(vec![5], rng.vec(5, -2.0, 2.0))]);
    let p = c.param(0);
    let x = c.input_rand(Source::Pull, rows(V, 5), &mut rng, -1.0, 1.0);
    let s = reg.call(&mut c.b, "swish_1702", &[p], &[]);
    let y = c.b.mul(x, s);
    let y = c.b.sum_rows(y);
    let y = c.b.reshape(y, &[1, 5]);
    let ones = c.input(Source::Gather(0), fixed(&[5, 1]), Val::F(vec![1.0; 5]));
    let y = c.b.matmul(y, ones, false, false);
    let loss = c.b.reshape(y, &[1]);
    c.check(loss, 5101).assert_nonzero(P0);
}

#[test]
fn registry_composite_errors() {
    let mut reg = swish_registry();
    let err = reg
        .register_composite("swish_1702", 1, "again", |_, x| x[0])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("swish_1702") && err.contains("already exists"),
        "{err}"
    );
    let err = reg
        .register_composite("add", 2, "shadowing a primitive", |_, x| x[0])
        .unwrap_err()
        .to_string();
    assert!(err.contains("`add` already exists"), "{err}");
    let mut b = GraphBuilder::new("reg", &[]);
    let x = b.input(Source::Pull, rows(V, 4));
    reg.call(&mut b, "swish_1702", &[x, x], &[]);
    let m = b.finish().unwrap_err().to_string();
    assert!(
        m.contains("`swish_1702`") && m.contains("takes 1 inputs, got 2"),
        "{m}"
    );
    // the unknown-op listing includes composites
    let mut b = GraphBuilder::new("reg", &[]);
    reg.call(&mut b, "nope", &[], &[]);
    let m = b.finish().unwrap_err().to_string();
    assert!(m.contains("swish_1702"), "{m}");
}

// ======================================================================
// The checker itself: a wrong gradient must be caught
// ======================================================================

/// The backward graph of `x + 1` over Pull rows of width 3: its gradient
/// is the upstream gradient `g` itself.
fn backward_of_add_one() -> Graph {
    let mut b = GraphBuilder::new("add_one", &[]);
    let x = b.input(Source::Pull, rows(V, 3));
    let y = b.add_scalar(x, 1.0);
    b.output(Role::Loss, y, None);
    let g = b.finish().unwrap();
    differentiate(&g, &[], "add_one").unwrap()
}

/// `exp(x)` checked against a deliberately wrong gradient built from
/// existing ops: that of `x + 1` (`g` instead of `g * exp(x)`).
#[test]
#[should_panic(expected = "gradient mismatch")]
fn grad_check_catches_a_wrong_gradient() {
    let mut rng = Rng::new(60);
    let mut c = Case::new(Topo::vertices(2), vec![]);
    let x = c.input_rand(Source::Pull, rows(V, 3), &mut rng, -1.0, 1.0);
    let y = c.b.exp(x);
    let (g, shapes, env) = c.finish(y);
    grad_check_backward(&g, &shapes, &env, 6000, backward_of_add_one());
}

/// The control for the test above: the same backward graph passes for the
/// forward graph it belongs to, so the mismatch there is the gradient's.
#[test]
fn grad_check_accepts_the_matching_gradient() {
    let mut rng = Rng::new(60);
    let mut c = Case::new(Topo::vertices(2), vec![]);
    let x = c.input_rand(Source::Pull, rows(V, 3), &mut rng, -1.0, 1.0);
    let y = c.b.add_scalar(x, 1.0);
    let (g, shapes, env) = c.finish(y);
    let report = grad_check_backward(&g, &shapes, &env, 6000, backward_of_add_one());
    assert!(!report.slots.is_empty());
}
