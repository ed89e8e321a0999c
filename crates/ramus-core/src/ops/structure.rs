//! Ops that move or reduce data rather than compute on it elementwise:
//! feature-axis concat / slice / pad, child-set sum and expansion, row
//! reductions and broadcasts, reshape and embedding lookup.

use crate::op::{want_arity, want_float, Cost, OpDef};
use crate::types::{DType, Space, ValueType};

/// Concatenation of row values along the feature axis.
#[derive(Clone, Copy, Debug)]
pub struct Concat;

impl OpDef for Concat {
    fn name(&self) -> &'static str {
        "concat"
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        let first = inputs.first().ok_or("needs at least one operand")?;
        if !first.is_rows() {
            return Err("operands must be row values".into());
        }
        for t in inputs {
            want_float(t, "operand")?;
            if t.space != first.space {
                return Err(format!("operands in different spaces: {first} vs {t}"));
            }
        }
        Ok(ValueType::rows(
            first.space,
            inputs.iter().map(|t| t.width()).sum(),
        ))
    }
}

/// Columns `start..start + len` of a row value.
#[derive(Clone, Copy, Debug)]
pub struct Slice {
    pub start: usize,
    pub len: usize,
}

impl OpDef for Slice {
    fn name(&self) -> &'static str {
        "slice"
    }
    fn attrs(&self) -> String {
        format!("{}..{}", self.start, self.start + self.len)
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 1)?;
        let t = inputs[0];
        want_float(t, "operand")?;
        if !t.is_rows() {
            return Err("operand must be a row value".into());
        }
        if self.len == 0 || self.start + self.len > t.width() {
            return Err(format!(
                "columns {}..{} out of range for width {}",
                self.start,
                self.start + self.len,
                t.width()
            ));
        }
        Ok(ValueType::rows(t.space, self.len))
    }
    fn elementwise_template(&self) -> Option<String> {
        None
    }
}

/// Places a row value at columns `start..` of zero rows of width `total`
/// (the gradient of [`Slice`]).
#[derive(Clone, Copy, Debug)]
pub struct Pad {
    pub start: usize,
    pub total: usize,
}

impl OpDef for Pad {
    fn name(&self) -> &'static str {
        "pad"
    }
    fn attrs(&self) -> String {
        format!("{}/{}", self.start, self.total)
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 1)?;
        let t = inputs[0];
        want_float(t, "operand")?;
        if !t.is_rows() || self.start + t.width() > self.total {
            return Err(format!(
                "cannot place {t} at column {} of width {}",
                self.start, self.total
            ));
        }
        Ok(ValueType::rows(t.space, self.total))
    }
}

/// Sum of edge rows into their parent vertex rows (child-sum).
#[derive(Clone, Copy, Debug)]
pub struct SumChildren;

impl OpDef for SumChildren {
    fn name(&self) -> &'static str {
        "sum_children"
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 1)?;
        let t = inputs[0];
        want_float(t, "operand")?;
        if t.space != Space::Edge {
            return Err(format!(
                "operand must be an edge value (from gather_all), got {t}"
            ));
        }
        Ok(ValueType::rows(Space::Vertex, t.width()))
    }
}

/// Copies each vertex row to every child edge of that vertex (the gradient
/// of [`SumChildren`]; also lets a vertex value meet per-child values).
#[derive(Clone, Copy, Debug)]
pub struct ExpandChildren;

impl OpDef for ExpandChildren {
    fn name(&self) -> &'static str {
        "expand_children"
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 1)?;
        let t = inputs[0];
        want_float(t, "operand")?;
        if t.space != Space::Vertex {
            return Err(format!("operand must be a vertex value, got {t}"));
        }
        Ok(ValueType::rows(Space::Edge, t.width()))
    }
}

/// Sum (or mean) over rows: rows of width `w` → static `[w]`.
#[derive(Clone, Copy, Debug)]
pub struct SumRows {
    pub mean: bool,
}

impl OpDef for SumRows {
    fn name(&self) -> &'static str {
        if self.mean {
            "mean_rows"
        } else {
            "sum_rows"
        }
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 1)?;
        let t = inputs[0];
        want_float(t, "operand")?;
        if !t.is_rows() {
            return Err(format!("operand must be a row value, got {t}"));
        }
        Ok(ValueType::fixed(&[t.width()]))
    }
}

/// Repeats a static row for every row of a reference value (divided by the
/// row count when `mean`): the gradient of [`SumRows`].
#[derive(Clone, Copy, Debug)]
pub struct BroadcastRows {
    pub mean: bool,
}

impl OpDef for BroadcastRows {
    fn name(&self) -> &'static str {
        if self.mean {
            "broadcast_rows_mean"
        } else {
            "broadcast_rows"
        }
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 2)?;
        let (s, r) = (inputs[0], inputs[1]);
        want_float(s, "operand")?;
        if s.is_rows() || !r.is_rows() {
            return Err(format!(
                "needs a static value and a row reference, got {s} and {r}"
            ));
        }
        Ok(ValueType::rows(r.space, s.width()))
    }
}

/// A static value viewed with another shape of the same element count.
#[derive(Clone, Debug)]
pub struct Reshape {
    pub shape: Vec<usize>,
}

impl OpDef for Reshape {
    fn name(&self) -> &'static str {
        "reshape"
    }
    fn attrs(&self) -> String {
        format!("{:?}", self.shape)
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 1)?;
        let t = inputs[0];
        want_float(t, "operand")?;
        if t.is_rows() || t.width() != self.shape.iter().product::<usize>() {
            return Err(format!("cannot view {t} as {:?}", self.shape));
        }
        Ok(ValueType::fixed(&self.shape))
    }
    fn cost(&self, _: &[&ValueType], out: &ValueType, _: usize) -> Cost {
        Cost {
            flops: 0.0,
            bytes: 8.0 * out.width() as f64,
        }
    }
}

/// Looks up rows of a `[V, H]` table by an index row (word embeddings).
#[derive(Clone, Copy, Debug)]
pub struct Embedding;

impl OpDef for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 2)?;
        let (table, idx) = (inputs[0], inputs[1]);
        want_float(table, "table")?;
        if table.is_rows() || table.shape.len() != 2 {
            return Err(format!("table must be a static [V, H] matrix, got {table}"));
        }
        if idx.dtype != DType::Index || !idx.is_rows() {
            return Err(format!(
                "second operand must be index rows (tokens), got {idx}"
            ));
        }
        Ok(ValueType::rows(idx.space, table.shape[1]))
    }
    fn cost(&self, _: &[&ValueType], out: &ValueType, rows: usize) -> Cost {
        Cost {
            flops: 0.0,
            bytes: 8.0 * (rows * out.width()) as f64,
        }
    }
}

/// Looks up rows of a `[R, H]` table by an index row, where a token that
/// has no row of its own (`token >= R`) reads row 0 — the unknown word's.
/// For tables too large to give every word a row (an MV-RNN's per-word
/// matrices): the first `R` token ids get their own row, the rest share
/// the unknown word's.
#[derive(Clone, Copy, Debug)]
pub struct EmbeddingUnk;

/// The row of table `rows` rows long that token `t` reads (see [`EmbeddingUnk`]).
#[inline]
pub fn unk_row(t: u32, rows: usize) -> usize {
    if (t as usize) < rows {
        t as usize
    } else {
        0
    }
}

impl OpDef for EmbeddingUnk {
    fn name(&self) -> &'static str {
        "embedding_unk"
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        Embedding.infer(inputs)
    }
    fn cost(&self, _: &[&ValueType], out: &ValueType, rows: usize) -> Cost {
        Cost {
            flops: 0.0,
            bytes: 8.0 * (rows * out.width()) as f64,
        }
    }
}

/// The gradient of [`EmbeddingUnk`]'s `[rows, H]` table: each row of the
/// upstream gradient `(grad rows [H], tokens)` added into the row its token
/// read. Dense (a static value): the table is small by construction.
#[derive(Clone, Copy, Debug)]
pub struct EmbeddingUnkBackward {
    pub rows: usize,
}

impl OpDef for EmbeddingUnkBackward {
    fn name(&self) -> &'static str {
        "embedding_unk_backward"
    }
    fn attrs(&self) -> String {
        self.rows.to_string()
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 2)?;
        let (gr, idx) = (inputs[0], inputs[1]);
        want_float(gr, "gradient")?;
        if !gr.is_rows() {
            return Err(format!("gradient must be rows, got {gr}"));
        }
        if idx.dtype != DType::Index || !idx.is_rows() || idx.space != gr.space {
            return Err(format!(
                "second operand must be index rows (tokens) in the gradient's space, got {idx}"
            ));
        }
        if self.rows == 0 {
            return Err("the table must have rows".into());
        }
        Ok(ValueType::fixed(&[self.rows, gr.width()]))
    }
    fn cost(&self, inputs: &[&ValueType], out: &ValueType, rows: usize) -> Cost {
        let w = inputs.first().map_or(0, |t| t.width());
        Cost {
            flops: (rows * w) as f64,
            bytes: 4.0 * (2 * rows * w + out.shape.iter().product::<usize>()) as f64,
        }
    }
}
