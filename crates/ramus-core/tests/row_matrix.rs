//! Tests of the per-row matrix ops (`row_matmul`) and of the shared-row
//! embedding (`embedding_unk`): forward kernels against f64 loops,
//! gradients against central finite differences, shape errors and the
//! registry entries.

mod common;

use common::*;
use ramus_core::ops::{EmbeddingUnk, EmbeddingUnkBackward, RowMatMul};
use ramus_core::{GraphBuilder, OpDef, OpRegistry, Role, Source, Space, ValueType};

const V: Space = Space::Vertex;
const E: Space = Space::Edge;
const PULL: Slot = Slot::Input(Source::Pull);
const G0: Slot = Slot::Input(Source::Gather(0));
const P0: Slot = Slot::Param(0);

fn rows(space: Space, w: usize) -> ValueType {
    ValueType::rows(space, w)
}

/// `op(A)·op(B)` of one pair of stored matrices.
fn reference(p: &RowMatMul, a: &[f64], b: &[f64]) -> Vec<f64> {
    let (m, k, n) = (p.m, p.k, p.n);
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k)
                .map(|t| {
                    let x = if p.trans_a {
                        a[t * m + i]
                    } else {
                        a[i * k + t]
                    };
                    let y = if p.trans_b {
                        b[j * k + t]
                    } else {
                        b[t * n + j]
                    };
                    x * y
                })
                .sum();
        }
    }
    out
}

fn products() -> Vec<RowMatMul> {
    let mut all = Vec::new();
    for (m, k, n) in [(3, 4, 2), (4, 4, 1), (2, 6, 3), (1, 1, 1)] {
        for trans_a in [false, true] {
            for trans_b in [false, true] {
                all.push(RowMatMul {
                    m,
                    k,
                    n,
                    trans_a,
                    trans_b,
                });
            }
        }
    }
    all
}

#[test]
fn row_matmul_forward_matches_per_row_products() {
    let mut rng = Rng::new(71);
    for p in products() {
        let (sa, sb) = (p.m * p.k, p.k * p.n);
        // (A rows, B rows), (A static, B rows), (A rows, B static)
        for (a_rows, b_rows) in [(true, true), (false, true), (true, false)] {
            for (space, topo) in [
                (V, Topo::vertices(5)),
                (V, Topo::vertices(1)),
                (E, Topo::from_children(&[2, 0, 3])),
            ] {
                let r = topo.rows(space);
                let ty = |rows_valued: bool, size: usize, shape: &[usize]| {
                    if rows_valued {
                        rows(space, size)
                    } else {
                        ValueType::fixed(shape)
                    }
                };
                let a_ty = ty(a_rows, sa, &[p.m, p.k]);
                let b_ty = ty(b_rows, sb, &[p.k, p.n]);
                let a = rng.vec(if a_rows { r * sa } else { sa }, -1.0, 1.0);
                let b = rng.vec(if b_rows { r * sb } else { sb }, -1.0, 1.0);
                let (out_ty, got) = run_op(
                    &p,
                    &[(a_ty, Val::F(a.clone())), (b_ty, Val::F(b.clone()))],
                    &topo,
                )
                .unwrap_or_else(|e| panic!("{}: {e}", p.signature()));
                assert_eq!(out_ty, rows(space, p.m * p.n));
                let want: Vec<f64> = (0..r)
                    .flat_map(|row| {
                        let am = if a_rows {
                            &a[row * sa..(row + 1) * sa]
                        } else {
                            &a[..]
                        };
                        let bm = if b_rows {
                            &b[row * sb..(row + 1) * sb]
                        } else {
                            &b[..]
                        };
                        reference(&p, am, bm)
                    })
                    .collect();
                assert_close(
                    &got,
                    &want,
                    1e-12,
                    &format!("{} rows {a_rows}/{b_rows} x {r}", p.signature()),
                );
                // the f32 kernel agrees
                let a_ty = ty(a_rows, sa, &[p.m, p.k]);
                let b_ty = ty(b_rows, sb, &[p.k, p.n]);
                let got32 = run_op_f32(&p, &[(a_ty, Val::F(a)), (b_ty, Val::F(b))], &topo).unwrap();
                assert_close(&got32, &want, 1e-5, &format!("{} in f32", p.signature()));
            }
        }
    }
}

#[test]
fn row_matmul_gradients_match_finite_differences() {
    let mut rng = Rng::new(72);
    for p in products() {
        let (sa, sb) = (p.m * p.k, p.k * p.n);
        // both operands per row
        for r in [1, 4] {
            let mut c = Case::new(Topo::vertices(r), vec![]);
            let a = c.input_rand(Source::Pull, rows(V, sa), &mut rng, -1.0, 1.0);
            let b = c.input_rand(Source::Gather(0), rows(V, sb), &mut rng, -1.0, 1.0);
            let y = c.b.row_matmul(a, b, p);
            let y = c.b.tanh(y);
            let rep = c.check(y, 700 + r as u64);
            rep.assert_nonzero(PULL);
            rep.assert_nonzero(G0);
        }
        // a static A (a shared weight) times per-row B
        let mut c = Case::new(Topo::vertices(3), vec![(vec![sa], rng.vec(sa, -1.0, 1.0))]);
        let a = c.param(0);
        let b = c.input_rand(Source::Pull, rows(V, sb), &mut rng, -1.0, 1.0);
        let y = c.b.row_matmul(a, b, p);
        let y = c.b.tanh(y);
        let rep = c.check(y, 720);
        rep.assert_nonzero(P0);
        rep.assert_nonzero(PULL);
        // per-row A times a static B, edge rows
        let topo = Topo::from_children(&[2, 0, 3]);
        let mut c = Case::new(topo, vec![(vec![p.k, p.n], rng.vec(sb, -1.0, 1.0))]);
        let a = c.input_rand(Source::GatherAll, rows(E, sa), &mut rng, -1.0, 1.0);
        let b = c.param(0);
        let y = c.b.row_matmul(a, b, p);
        let y = c.b.tanh(y);
        c.check(y, 730).assert_all_nonzero_except(&[]);
    }
}

#[test]
fn mv_rnn_composition_gradients() {
    // p = tanh(W [B a; A b]), P = W_M [A; B] over states [a; vec(A)]
    let mut rng = Rng::new(73);
    let n = 3;
    let mut c = Case::new(
        Topo::vertices(2),
        vec![
            (vec![n, 2 * n], rng.vec(2 * n * n, -1.0, 1.0)),
            (vec![2 * n, n], rng.vec(2 * n * n, -1.0, 1.0)),
        ],
    );
    let l = c.input_rand(Source::Gather(0), rows(V, n + n * n), &mut rng, -1.0, 1.0);
    let r = c.input_rand(Source::Gather(1), rows(V, n + n * n), &mut rng, -1.0, 1.0);
    let (a, am) = (c.b.slice(l, 0, n), c.b.slice(l, n, n * n));
    let (b, bm) = (c.b.slice(r, 0, n), c.b.slice(r, n, n * n));
    let ba = c.b.row_matmul(bm, a, RowMatMul::new(n, n, 1));
    let ab = c.b.row_matmul(am, b, RowMatMul::new(n, n, 1));
    let x = c.b.concat(&[ba, ab]);
    let w = c.param(0);
    let z = c.b.linear(x, w, None);
    let pv = c.b.tanh(z);
    let stacked = c.b.concat(&[am, bm]);
    let wm = c.param(1);
    let pm = c.b.row_matmul(
        wm,
        stacked,
        RowMatMul {
            trans_a: true,
            ..RowMatMul::new(n, 2 * n, n)
        },
    );
    let pm = c.b.tanh(pm);
    let y = c.b.concat(&[pv, pm]);
    c.check(y, 740).assert_all_nonzero_except(&[]);
}

#[test]
fn row_matmul_shape_errors_name_the_operand() {
    let err = |a: ValueType, b: ValueType, p: RowMatMul| {
        p.infer(&[&a, &b]).expect_err("the shapes are wrong")
    };
    let p = RowMatMul::new(2, 3, 1);
    let e = err(rows(V, 5), rows(V, 3), p);
    assert!(e.contains("A must hold a 2x3 matrix"), "{e}");
    let e = err(rows(V, 6), rows(V, 2), p);
    assert!(e.contains("B must hold a 3x1 matrix"), "{e}");
    let e = err(rows(V, 6), rows(E, 3), p);
    assert!(e.contains("different spaces"), "{e}");
    let e = err(ValueType::fixed(&[2, 3]), ValueType::fixed(&[3]), p);
    assert!(e.contains("at least one operand must be rows"), "{e}");
    let e = err(rows(V, 0), rows(V, 0), RowMatMul::new(0, 3, 1));
    assert!(e.contains("must be positive"), "{e}");
}

#[test]
fn embedding_unk_shares_row_zero_beyond_the_table() {
    let mut rng = Rng::new(74);
    let (table_rows, h) = (3, 4);
    let table = rng.vec(table_rows * h, -1.0, 1.0);
    let tokens = vec![2, 7, 0, 3, 1];
    let topo = Topo::vertices(tokens.len());
    let (ty, got) = run_op(
        &EmbeddingUnk,
        &[
            (ValueType::fixed(&[table_rows, h]), Val::F(table.clone())),
            (ValueType::index_rows(V), Val::I(tokens.clone())),
        ],
        &topo,
    )
    .unwrap();
    assert_eq!(ty, rows(V, h));
    let want: Vec<f64> = tokens
        .iter()
        .flat_map(|&t| {
            let i = if (t as usize) < table_rows {
                t as usize
            } else {
                0
            };
            table[i * h..(i + 1) * h].to_vec()
        })
        .collect();
    assert_close(&got, &want, 0.0, "embedding_unk");
    // the backward scatters every row into the row its token read
    let grads = rng.vec(tokens.len() * h, -1.0, 1.0);
    let (ty, dt) = run_op(
        &EmbeddingUnkBackward { rows: table_rows },
        &[
            (rows(V, h), Val::F(grads.clone())),
            (ValueType::index_rows(V), Val::I(tokens.clone())),
        ],
        &topo,
    )
    .unwrap();
    assert_eq!(ty, ValueType::fixed(&[table_rows, h]));
    let mut want = vec![0.0; table_rows * h];
    for (r, &t) in tokens.iter().enumerate() {
        let i = if (t as usize) < table_rows {
            t as usize
        } else {
            0
        };
        for j in 0..h {
            want[i * h + j] += grads[r * h + j];
        }
    }
    assert_close(&dt, &want, 1e-12, "embedding_unk_backward");
}

#[test]
fn embedding_unk_gradient_is_dense_and_checks() {
    let mut rng = Rng::new(75);
    let (table_rows, h) = (3, 4);
    // tokens 5 and 9 share row 0 with token 0; row 2 is never read
    let tokens = vec![5, 1, 9, 0];
    let mut c = Case::new(
        Topo::vertices(tokens.len()),
        vec![(vec![table_rows, h], rng.vec(table_rows * h, -1.0, 1.0))],
    );
    let table = c.param(0);
    let tok = c.input(Source::Token, ValueType::index_rows(V), Val::I(tokens));
    let y = c.b.embedding_unk(table, tok);
    let y = c.b.tanh(y);
    let rep = c.check(y, 750);
    assert!(
        rep.backward.output(Role::ParamGrad(0)).is_some(),
        "a dense table gradient"
    );
    let (a, _) = rep.get(P0);
    for row in 0..table_rows {
        assert_eq!(
            a[row * h..(row + 1) * h].iter().any(|g| *g != 0.0),
            row != 2,
            "table row {row}"
        );
    }
}

#[test]
fn registry_builds_the_new_ops() {
    let reg = OpRegistry::standard();
    let mut b = GraphBuilder::new("registry", &[vec![2, 3], vec![4, 2]]);
    let x = b.input(Source::Pull, rows(V, 3));
    let w = b.param(0);
    let y = reg.call(&mut b, "row_matmul", &[w, x], &[2.0, 3.0, 1.0]);
    assert_eq!(b.ty(y), Some(&rows(V, 2)));
    let t = b.param(1);
    let tok = b.input(Source::Token, ValueType::index_rows(V));
    let e = reg.call(&mut b, "embedding_unk", &[t, tok], &[]);
    assert_eq!(b.ty(e), Some(&rows(V, 2)));
    let bad = reg.call(&mut b, "row_matmul", &[w, x], &[2.0, 3.0, 1.0, 2.0]);
    let _ = bad;
    let err = b.finish().expect_err("a transpose flag of 2 is refused");
    assert!(err.to_string().contains("trans_a must be 0 or 1"), "{err}");
    for name in ["row_matmul", "embedding_unk", "embedding_unk_backward"] {
        assert!(reg.doc(name).is_some(), "{name} is registered");
    }
}
