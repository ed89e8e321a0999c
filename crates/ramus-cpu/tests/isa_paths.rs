//! The kernels give the same results on the portable path (what
//! `RAMUS_CPU_ISA=portable` forces) as on the widest level this processor
//! has. One test: it switches the process-wide level, which would disturb
//! other tests running beside it in the same binary.

use ramus_core::graph::{Space, ValueType};
use ramus_core::isa::{set_isa, Isa};
use ramus_core::ops::*;
use ramus_cpu::kernels::{self, Arg, ArgData, KernelCtx, PackedB};

const ROWS: usize = 7;
/// Not a multiple of 8 or 16: every vector loop has a tail.
const WIDTH: usize = 37;

/// Deterministic values in about [-3, 3], none zero.
fn values(seed: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7 + seed * 13) as f32 * 0.731).sin() * 3.0 + 0.01)
        .collect()
}

/// Runs `op` on `args` (row operands of `WIDTH`, or static ones) into
/// `out_len` floats at the given level.
fn run(
    isa: Isa,
    op: &Op,
    args: &[Arg<'_, f32>],
    out_len: usize,
    packed: Option<&PackedB<f32>>,
) -> Vec<f32> {
    assert_eq!(set_isa(isa), isa, "{isa:?} is not available here");
    let mut out = vec![f32::NAN; out_len];
    let mut ctx = KernelCtx {
        args,
        out: &mut out,
        out_rows: ROWS,
        vertex_rows: ROWS,
        edge_parent: &[],
        packed_b: packed,
        norm_sum: None,
    };
    kernels::run(op, &mut ctx).unwrap_or_else(|e| panic!("{op:?} at {isa:?}: {e}"));
    out
}

/// Same bits, or both NaN.
fn same(x: f32, y: f32) -> bool {
    x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())
}

/// Elementwise ops and row sums: the vector loops do the same IEEE
/// operations per element in the same order (Rust never fuses `a * b + c`
/// into an FMA on its own, nor reorders float sums), so the results are
/// equal bit for bit.
fn elementwise_and_sums_agree(best: Isa) {
    let ty = ValueType::rows(Space::Vertex, WIDTH);
    let (x, y) = (values(1, ROWS * WIDTH), values(2, ROWS * WIDTH));
    let mut cases: Vec<(Op, usize, usize)> = vec![
        (Neg.into(), 1, ROWS * WIDTH),
        (Exp.into(), 1, ROWS * WIDTH),
        (Log.into(), 1, ROWS * WIDTH),
        (Sigmoid.into(), 1, ROWS * WIDTH),
        (Tanh.into(), 1, ROWS * WIDTH),
        (Relu.into(), 1, ROWS * WIDTH),
        (Scale(0.3).into(), 1, ROWS * WIDTH),
        (AddScalar(-1.5).into(), 1, ROWS * WIDTH),
        (RsubScalar(2.0).into(), 1, ROWS * WIDTH),
        (Add.into(), 2, ROWS * WIDTH),
        (Sub.into(), 2, ROWS * WIDTH),
        (Mul.into(), 2, ROWS * WIDTH),
        (Div.into(), 2, ROWS * WIDTH),
        (SigmoidBackward.into(), 2, ROWS * WIDTH),
        (TanhBackward.into(), 2, ROWS * WIDTH),
        (ReluBackward.into(), 2, ROWS * WIDTH),
    ];
    cases.push((SumRows { mean: false }.into(), 1, WIDTH));
    cases.push((SumRows { mean: true }.into(), 1, WIDTH));
    for (op, arity, out_len) in &cases {
        let args: Vec<_> = [&x, &y][..*arity]
            .iter()
            .map(|d| Arg {
                ty: &ty,
                rows: ROWS,
                data: ArgData::Float(d),
            })
            .collect();
        let portable = run(Isa::Portable, op, &args, *out_len, None);
        let wide = run(best, op, &args, *out_len, None);
        for (i, (p, w)) in portable.iter().zip(&wide).enumerate() {
            assert!(same(*p, *w), "{op:?} [{i}]: portable {p} vs {best:?} {w}");
        }
    }
}

/// Matrix products against a packed weight (explicit FMA kernels when
/// wide) and without (plain loops, equal bit for bit). For the packed one
/// each output is a length-`k` dot product summed in the same order on
/// both paths, one rounding per fused step against two per unfused one:
/// each is within `γ_k·Σ|a·b|` of the exact value (`γ_k = k·u/(1 - k·u)`,
/// `u = 2^-24`), so the two are within twice that of each other.
fn products_agree(best: Isa) {
    let k = WIDTH;
    for n in [5usize, 16, 50] {
        for trans_b in [false, true] {
            let a = values(3, ROWS * k);
            let b = values(4, k * n);
            let a_ty = ValueType::rows(Space::Vertex, k);
            let b_shape = if trans_b { [n, k] } else { [k, n] };
            let b_ty = ValueType::fixed(&b_shape);
            let args = [
                Arg {
                    ty: &a_ty,
                    rows: ROWS,
                    data: ArgData::Float(&a),
                },
                Arg {
                    ty: &b_ty,
                    rows: 0,
                    data: ArgData::Float(&b),
                },
            ];
            let op: Op = MatMul {
                trans_a: false,
                trans_b,
            }
            .into();
            let plain = [Isa::Portable, best].map(|isa| run(isa, &op, &args, ROWS * n, None));
            assert!(
                plain[0].iter().zip(&plain[1]).all(|(p, w)| same(*p, *w)),
                "unpacked matmul n={n} trans_b={trans_b}"
            );
            let packed = PackedB::pack(&b, b_shape[1], k, n, trans_b);
            let [p, w] =
                [Isa::Portable, best].map(|isa| run(isa, &op, &args, ROWS * n, Some(&packed)));
            let u = f64::from(f32::EPSILON) / 2.0;
            let gamma = k as f64 * u / (1.0 - k as f64 * u);
            for i in 0..ROWS {
                for j in 0..n {
                    let opb = |q: usize| if trans_b { b[j * k + q] } else { b[q * n + j] };
                    let abs: f64 = (0..k)
                        .map(|q| (f64::from(a[i * k + q]) * f64::from(opb(q))).abs())
                        .sum();
                    let (pv, wv) = (f64::from(p[i * n + j]), f64::from(w[i * n + j]));
                    assert!(
                        (pv - wv).abs() <= 2.0 * gamma * abs,
                        "packed n={n} trans_b={trans_b} ({i},{j}): {pv} vs {wv}"
                    );
                }
            }
        }
    }
}

#[test]
fn portable_and_widest_levels_agree() {
    let best = Isa::detected();
    elementwise_and_sums_agree(best);
    products_agree(best);
    set_isa(best);
}
