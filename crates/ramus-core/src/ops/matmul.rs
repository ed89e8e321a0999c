//! Matrix multiplication with transpose flags: `op(A) · op(B)`.
//!
//! Supported operand combinations:
//! * rows `[R, k]` · static `[k, n]` (or `[n, k]` with `trans_b`) → rows `[R, n]`
//!   (a linear layer applied to every vertex of a task);
//! * rows`ᵀ` · rows (`trans_a`, same space) → static `[wa, wb]`, contracting over
//!   rows (the weight-gradient GEMM that lazy batching runs once per batch);
//! * static · static → static.

use crate::op::{want_arity, want_float, Cost, OpDef, PackedOperand};
use crate::types::ValueType;

/// `op(A) · op(B)`, see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatMul {
    pub trans_a: bool,
    pub trans_b: bool,
}

/// Dimensions `(m, k, n)` of the product for concrete row counts.
pub fn dims(
    op: &MatMul,
    a: &ValueType,
    a_rows: usize,
    b: &ValueType,
    b_rows: usize,
) -> (usize, usize, usize) {
    let (ar, ac) = if a.is_rows() {
        (a_rows, a.width())
    } else {
        (a.shape[0], a.shape[1])
    };
    let (br, bc) = if b.is_rows() {
        (b_rows, b.width())
    } else {
        (b.shape[0], b.shape[1])
    };
    let (m, k) = if op.trans_a { (ac, ar) } else { (ar, ac) };
    let n = if op.trans_b { br } else { bc };
    (m, k, n)
}

impl OpDef for MatMul {
    fn name(&self) -> &'static str {
        "matmul"
    }
    fn attrs(&self) -> String {
        format!(
            "{}{}",
            if self.trans_a { "Aᵀ" } else { "A" },
            if self.trans_b { "Bᵀ" } else { "B" }
        )
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 2)?;
        let (a, b) = (inputs[0], inputs[1]);
        want_float(a, "A")?;
        want_float(b, "B")?;
        for (t, name) in [(a, "A"), (b, "B")] {
            if !t.is_rows() && t.shape.len() != 2 {
                return Err(format!(
                    "static {name} must be a matrix, got shape {:?}",
                    t.shape
                ));
            }
        }
        match (a.is_rows(), b.is_rows()) {
            (true, false) => {
                if self.trans_a {
                    return Err("rows operand A cannot be transposed against a static B".into());
                }
                let (k, n) = if self.trans_b {
                    (b.shape[1], b.shape[0])
                } else {
                    (b.shape[0], b.shape[1])
                };
                if k != a.width() {
                    return Err(format!(
                        "inner dimensions differ: A has width {}, op(B) is {k}x{n}",
                        a.width()
                    ));
                }
                Ok(ValueType::rows(a.space, n))
            }
            (true, true) => {
                if !self.trans_a || self.trans_b || a.space != b.space {
                    return Err("two row operands multiply only as Aᵀ·B over the same space".into());
                }
                Ok(ValueType::fixed(&[a.width(), b.width()]))
            }
            (false, false) => {
                let (m, k) = if self.trans_a {
                    (a.shape[1], a.shape[0])
                } else {
                    (a.shape[0], a.shape[1])
                };
                let (k2, n) = if self.trans_b {
                    (b.shape[1], b.shape[0])
                } else {
                    (b.shape[0], b.shape[1])
                };
                if k != k2 {
                    return Err(format!("inner dimensions differ: {k} vs {k2}"));
                }
                Ok(ValueType::fixed(&[m, n]))
            }
            (false, true) => Err("a static A times row operand B is not supported".into()),
        }
    }
    fn packed_operand(&self) -> Option<PackedOperand> {
        (!self.trans_a).then_some(PackedOperand {
            trans_b: self.trans_b,
            rows_limit: PACKED_MAX_M,
        })
    }
    fn cost(&self, inputs: &[&ValueType], out: &ValueType, rows: usize) -> Cost {
        let (m, k, n) = dims(self, inputs[0], rows, inputs[1], rows);
        let out_elems = if out.is_rows() {
            rows * out.width()
        } else {
            out.width()
        };
        Cost {
            flops: 2.0 * (m * k * n) as f64,
            bytes: 4.0 * (m * k + k * n + out_elems) as f64,
        }
    }
}

/// Runs with at most this many rows use a packed weight operand when the
/// engine supplies one; larger runs amortize GEMM packing themselves.
pub const PACKED_MAX_M: usize = 128;
