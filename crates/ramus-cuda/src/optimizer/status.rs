//! The host's side of the optimizer's non-finite check: decoding a step's
//! status words, and the buffers a skipped step restores.

use std::sync::Arc;

use super::layout::{GradLayout, ParamSlot, STATUS_WORDS};
use super::plan::RawSegment;
use crate::error::Result;
use crate::pool::{DevicePool, PoolBuffer};

/// Bits of a non-finite gradient's key below its segment's first slot: the
/// element's offset in the segment (`(slot << 40) | offset` in the source).
const KEY_OFFSET_BITS: u32 = 40;

/// What became of one [`super::DeviceOptimizer::step`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStatus {
    /// False when the loss or a gradient was not finite: nothing changed.
    pub applied: bool,
    /// The first parameter (slot index, in declaration order) with a
    /// non-finite gradient element, if any.
    pub nonfinite_gradient: Option<usize>,
    /// The global gradient norm before clipping (not finite when skipped
    /// for a gradient).
    pub norm: f64,
    /// The loss the step checked (0 for a step given none).
    pub loss: f32,
}

/// Decodes the status words a step copied back: the norm (words 0-1), the
/// skip flag (word 3) and the reported key of its first non-finite
/// gradient (words 6-7, complemented; 0: none), named as the slot whose
/// gradient holds that element, and the loss checked (word 8).
pub(super) fn decode(words: &[u32], slots: &[ParamSlot]) -> StepStatus {
    let word = |i: usize| words.get(i).copied().map_or(0, u64::from);
    let norm = f64::from_bits(word(0) | (word(1) << 32));
    let report = word(6) | (word(7) << 32);
    let nonfinite_gradient = (report != 0).then_some(!report).and_then(|key| {
        let first = (key >> KEY_OFFSET_BITS) as usize;
        let offset = key & ((1 << KEY_OFFSET_BITS) - 1);
        let address = slots.get(first)?.grad.device_ptr() + 4 * offset;
        // a run's later slots follow its first one in the gradient buffer
        (first..slots.len()).find(|&p| {
            let g = &slots[p].grad;
            g.device_ptr() <= address && address < g.device_ptr() + g.byte_len() as u64
        })
    });
    debug_assert!(words.len() >= STATUS_WORDS);
    StepStatus {
        applied: word(3) == 0,
        nonfinite_gradient,
        norm,
        loss: f32::from_bits(word(8) as u32),
    }
}

/// One segment per run of frozen slots (buffers) adjacent in memory, with
/// its kept copy in a buffer allocated here (in slot order), or nothing for
/// a model without buffers.
pub(super) fn buffer_segments(
    pool: &Arc<DevicePool>,
    slots: &[ParamSlot],
) -> Result<(Vec<RawSegment>, Option<PoolBuffer<f32>>)> {
    let frozen: Vec<&ParamSlot> = slots
        .iter()
        .filter(|s| s.layout == GradLayout::Frozen && !s.value.is_empty())
        .collect();
    let total: usize = frozen.iter().map(|s| s.value.len()).sum();
    if total == 0 {
        return Ok((Vec::new(), None));
    }
    let kept = pool.alloc::<f32>(total)?;
    let mut segments: Vec<RawSegment> = Vec::new();
    let mut at = 0;
    for slot in frozen {
        let copy = kept.view().slice(at..at + slot.value.len())?;
        at += slot.value.len();
        let len = slot.value.len() as u64;
        match segments.last_mut() {
            Some(last) if last.value + 4 * last.len == slot.value.device_ptr() => last.len += len,
            _ => segments.push(RawSegment {
                value: slot.value.device_ptr(),
                first: copy.device_ptr(),
                len,
                ..RawSegment::default()
            }),
        }
    }
    Ok((segments, Some(kept)))
}
