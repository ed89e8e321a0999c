//! The CPU kernels against the op metadata that passes in `ramus-core`
//! answer without running them.

use ramus_core::graph::{Space, ValueType};
use ramus_core::ops::*;
use ramus_cpu::kernels::{self, Arg, ArgData, KernelCtx};

/// Runs elementwise `op` in f32 on `arity` all-zero row operands of width 3.
fn on_zeros(op: &Op, arity: usize) -> Vec<f32> {
    let ty = ValueType::rows(Space::Vertex, 3);
    let zeros = [0.0f32; 6];
    let args: Vec<Arg<'_, f32>> = (0..arity)
        .map(|_| Arg {
            ty: &ty,
            rows: 2,
            data: ArgData::Float(&zeros),
        })
        .collect();
    let mut out = vec![f32::NAN; 6];
    let mut ctx = KernelCtx {
        args: &args,
        out: &mut out,
        out_rows: 2,
        vertex_rows: 2,
        edge_parent: &[],
        packed_b: None,
        norm_sum: None,
    };
    kernels::run(op, &mut ctx).unwrap_or_else(|e| panic!("{op:?}: {e}"));
    out
}

/// `Op::maps_zero_to_zero` (which refactoring of child reads trusts) says
/// exactly what every elementwise kernel does with zeros, scalar
/// attributes at the edges of f32 included.
#[test]
fn maps_zero_to_zero_matches_the_kernels() {
    let mut cases: Vec<(Op, usize)> = vec![
        (Neg.into(), 1),
        (Exp.into(), 1),
        (Log.into(), 1),
        (Sigmoid.into(), 1),
        (Tanh.into(), 1),
        (Relu.into(), 1),
        (Add.into(), 2),
        (Sub.into(), 2),
        (Mul.into(), 2),
        (Div.into(), 2),
        (SigmoidBackward.into(), 2),
        (TanhBackward.into(), 2),
        (ReluBackward.into(), 2),
    ];
    for a in [0.0, -0.0, 1.0, -2.5, 1e-50, 1e300] {
        cases.push((Scale(a).into(), 1));
        cases.push((AddScalar(a).into(), 1));
        cases.push((RsubScalar(a).into(), 1));
    }
    let mut both = [0, 0];
    for (op, arity) in &cases {
        let zero = on_zeros(op, *arity).iter().all(|&x| x == 0.0);
        assert_eq!(op.maps_zero_to_zero(), zero, "{op:?}");
        both[zero as usize] += 1;
    }
    // both answers occur, so the comparison means something
    assert!(both[0] > 0 && both[1] > 0, "{both:?}");
}
