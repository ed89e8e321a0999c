//! Softmax cross-entropy: per-row loss against index labels, and its
//! gradient with respect to the scores.

use crate::op::{want_arity, want_float, OpDef};
use crate::types::{DType, ValueType};

fn check_labels(inputs: &[&ValueType]) -> std::result::Result<(), String> {
    let (logits, labels) = (inputs[0], inputs[1]);
    want_float(logits, "scores")?;
    if !logits.is_rows() {
        return Err(format!("scores must be row values, got {logits}"));
    }
    if labels.dtype != DType::Index || labels.space != logits.space {
        return Err(format!(
            "labels must be index rows in the scores' space, got {labels}"
        ));
    }
    Ok(())
}

/// `-log softmax(scores)[label]` per row (a `[1]`-wide row value).
#[derive(Clone, Copy, Debug)]
pub struct SoftmaxXent;

impl OpDef for SoftmaxXent {
    fn name(&self) -> &'static str {
        "softmax_xent"
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 2)?;
        check_labels(inputs)?;
        Ok(ValueType::rows(inputs[0].space, 1))
    }
}

/// `(softmax(scores) - onehot(label)) * g` per row: the gradient of
/// [`SoftmaxXent`]. Used only inside backward graphs; it has no gradient of
/// its own (second derivatives of the loss are not supported).
#[derive(Clone, Copy, Debug)]
pub struct SoftmaxXentBackward;

impl OpDef for SoftmaxXentBackward {
    fn name(&self) -> &'static str {
        "softmax_xent_backward"
    }
    fn infer(&self, inputs: &[&ValueType]) -> std::result::Result<ValueType, String> {
        want_arity(inputs, 3)?;
        check_labels(inputs)?;
        let g = inputs[2];
        if g.space != inputs[0].space || g.width() != 1 {
            return Err(format!("upstream gradient must be [1]-wide rows, got {g}"));
        }
        Ok(inputs[0].clone())
    }
}
