//! Per-row matrix products: [`RowMatMul`] multiplies, for every row of a
//! run, a small matrix held in that row (row-major, flattened into the
//! row's columns) by another row's matrix or by a static matrix shared by
//! every row. This is how a vertex carries matrix state (an MV-RNN word's
//! or phrase's matrix `A ∈ R^{n×n}` is `n²` columns of its state row):
//!
//! * `row_matmul[n,n,1](B, a)` — a child's matrix times its sibling's
//!   vector, both per row (`B a`);
//! * `row_matmul[n,2n,n,Aᵀ](W_Mᵀ, [A; B])` — a shared (static) matrix times
//!   the stacked child matrices (`W_M [A; B]`).
//!
//! The gradients are again per-row products (a static operand's gradient is
//! the per-row product summed over rows), so the family is closed.

use crate::op::{want_arity, want_float, Cost, OpDef};
use crate::types::ValueType;

/// `C = op(A) · op(B)` per row, with `op(A): [m, k]`, `op(B): [k, n]` and
/// `C: [m, n]`, every matrix row-major. An operand is either rows (each
/// row holds its own matrix: `A` stored `[m, k]`, or `[k, m]` when
/// `trans_a`; `B` stored `[k, n]`, or `[n, k]` when `trans_b`) or a static
/// value of as many elements, shared by every row. At least one operand
/// is rows; the result has `m·n` columns in the rows' space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowMatMul {
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub trans_a: bool,
    pub trans_b: bool,
}

impl RowMatMul {
    /// A product without transposes.
    pub fn new(m: usize, k: usize, n: usize) -> Self {
        RowMatMul {
            m,
            k,
            n,
            trans_a: false,
            trans_b: false,
        }
    }

    /// Element `(i, t)` of `op(A)` within one matrix stored at `a`.
    #[inline]
    pub fn a_at<T: Copy>(&self, a: &[T], i: usize, t: usize) -> T {
        if self.trans_a {
            a[t * self.m + i]
        } else {
            a[i * self.k + t]
        }
    }
}

/// Elements of a value per row (rows) or in all (static).
fn elements(t: &ValueType) -> usize {
    if t.is_rows() {
        t.width()
    } else {
        t.shape.iter().product()
    }
}

impl OpDef for RowMatMul {
    fn name(&self) -> &'static str {
        "row_matmul"
    }
    fn attrs(&self) -> String {
        format!(
            "{}x{}x{}{}{}",
            self.m,
            self.k,
            self.n,
            if self.trans_a { ",Aᵀ" } else { "" },
            if self.trans_b { ",Bᵀ" } else { "" }
        )
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 2)?;
        let (a, b) = (inputs[0], inputs[1]);
        want_float(a, "A")?;
        want_float(b, "B")?;
        let (m, k, n) = (self.m, self.k, self.n);
        if m == 0 || k == 0 || n == 0 {
            return Err(format!("dimensions {m}x{k}x{n} must be positive"));
        }
        for (t, name, want) in [(a, "A", m * k), (b, "B", k * n)] {
            let got = elements(t);
            if got != want {
                let what = if t.is_rows() { "per row" } else { "in all" };
                return Err(format!(
                    "{name} must hold a {}x{} matrix ({want} elements {what}), got {t}",
                    if name == "A" { m } else { k },
                    if name == "A" { k } else { n },
                ));
            }
        }
        let space = match (a.is_rows(), b.is_rows()) {
            (true, true) if a.space != b.space => {
                return Err(format!("row operands in different spaces: {a} vs {b}"))
            }
            (true, _) => a.space,
            (false, true) => b.space,
            (false, false) => {
                return Err(
                    "at least one operand must be rows (use matmul for static products)".into(),
                )
            }
        };
        Ok(ValueType::rows(space, m * n))
    }
    fn cost(&self, inputs: &[&ValueType], out: &ValueType, rows: usize) -> Cost {
        let per_row = |t: &ValueType| if t.is_rows() { rows } else { 1 };
        let reads: usize = inputs.iter().map(|t| per_row(t) * elements(t)).sum();
        Cost {
            flops: 2.0 * (rows * self.m * self.k * self.n) as f64,
            bytes: 4.0 * (reads + rows * out.width()) as f64,
        }
    }
}
