//! Op definitions (NNVM style): every op is declared once, as a type
//! implementing [`OpDef`], with its attributes — shape inference, an
//! elementwise code template for fusion code generation and a cost
//! estimate — and the checks op definitions share. A leaf module: it knows
//! value types, not graphs. The gradient builders (`FGradient`) are in
//! [`crate::gradient`], the CPU kernels in the CPU engine
//! (`ramus_cpu::kernels`); [`OpRegistry`] (in [`crate::registry`]) finds ops
//! by name and holds user-defined composite ops built from registered ones.

use std::fmt::Debug;

pub use crate::gradient::{GradCtx, GradTerm};
pub use crate::registry::{CompositeBuilder, OpRegistry, PrimitiveMaker};
use crate::types::{DType, ValueType};

/// Estimated work of one op application.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Cost {
    /// Floating-point operations.
    pub flops: f64,
    /// Bytes read and written (f32 elements).
    pub bytes: f64,
}

/// A registered op. See the module docs.
pub trait OpDef: Send + Sync + Debug {
    /// The registry name.
    fn name(&self) -> &'static str;
    /// Attribute values, rendered for listings and cache keys ("" if none).
    fn attrs(&self) -> String {
        String::new()
    }
    /// Name plus attributes, e.g. `slice[0..256]`.
    fn signature(&self) -> String {
        let a = self.attrs();
        if a.is_empty() {
            self.name().to_string()
        } else {
            format!("{}[{a}]", self.name())
        }
    }
    /// Result type for the given input types, or a message saying what is wrong.
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String>;
    /// The elementwise code template if the op is elementwise: a C
    /// expression over `{0}`, `{1}`, ... (float operands), e.g. `({0} + {1})`.
    fn elementwise_template(&self) -> Option<String> {
        None
    }
    /// For ops whose second operand is a static matrix used by many tasks
    /// (weights): `Some(trans_b)` asks the engine to pack `op(B)` once per
    /// pass and hand it over to the op's kernel when a run has at most
    /// `rows_limit` rows.
    fn packed_operand(&self) -> Option<PackedOperand> {
        None
    }
    /// True when an output row depends on other rows of the same run
    /// (batch statistics): such an op is only correct where all rows run
    /// together (eager and lazy phases, heads), and execution classification
    /// rejects it between `gather` and `scatter`, where a task sees only
    /// some rows.
    fn couples_rows(&self) -> bool {
        false
    }
    /// Estimated cost for `rows` rows.
    fn cost(&self, inputs: &[&ValueType], out: &ValueType, rows: usize) -> Cost {
        let n = if out.is_rows() {
            rows * out.width()
        } else {
            out.width()
        } as f64;
        let reads: f64 =
            inputs.iter().map(|t| if t.is_rows() { rows * t.width() } else { t.width() } as f64).sum();
        Cost {
            flops: n,
            bytes: 4.0 * (n + reads),
        }
    }
}

/// How an op wants its static second operand packed (see [`OpDef::packed_operand`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedOperand {
    pub trans_b: bool,
    pub rows_limit: usize,
}

/// Checks that `t` is a float value.
pub(crate) fn want_float(t: &ValueType, what: &str) -> std::result::Result<(), String> {
    if t.dtype == DType::Float {
        Ok(())
    } else {
        Err(format!("{what} must be float, got {t}"))
    }
}

/// Checks the input count.
pub(crate) fn want_arity(inputs: &[&ValueType], n: usize) -> std::result::Result<(), String> {
    if inputs.len() == n {
        Ok(())
    } else {
        Err(format!("takes {n} inputs, got {}", inputs.len()))
    }
}

/// Numeric attribute `i` (`name` in messages).
pub(crate) fn attr(attrs: &[f64], i: usize, name: &str) -> Result<f64, String> {
    attrs
        .get(i)
        .copied()
        .ok_or_else(|| format!("missing attribute {i} ({name})"))
}

/// Numeric attribute `i` as a count or size.
pub(crate) fn usize_attr(attrs: &[f64], i: usize, name: &str) -> Result<usize, String> {
    let v = attr(attrs, i, name)?;
    if v < 0.0 || v.fract() != 0.0 {
        return Err(format!(
            "attribute {name} must be a non-negative integer, got {v}"
        ));
    }
    Ok(v as usize)
}
