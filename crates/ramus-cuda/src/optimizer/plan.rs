//! Where the optimizer's work lies on the device: dense runs and
//! row-gradient tables ([`Plan`]), checked and laid out without touching
//! the device, a step's segments as the kernels read them, and their split
//! into launches.

use cudarc::driver::DeviceRepr;

use super::layout::{GradLayout, ParamSlot, BLOCK, MAX_NORM_BLOCKS, MAX_SEGMENTS};
use crate::error::{CudaError, Result};
use crate::pool::DeviceView;

/// One segment as the kernels read it (`struct Segment`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct RawSegment {
    pub(super) value: u64,
    pub(super) grad: u64,
    pub(super) first: u64,
    pub(super) second: u64,
    pub(super) rows: u64,
    pub(super) len: u64,
    pub(super) width: u32,
    pub(super) table_rows: u32,
    /// The segment's first parameter (for the non-finite key).
    pub(super) slot: u32,
    /// The segment's learning-rate multiplier (`f32` bits; `float
    /// lr_scale` in the source).
    pub(super) lr_scale: u32,
}

impl RawSegment {
    pub(super) fn elements(&self) -> u64 {
        if self.width == 0 {
            self.len
        } else {
            self.len * u64::from(self.width)
        }
    }
}

/// Up to [`MAX_SEGMENTS`] segments (`struct Segments`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RawSegments {
    pub(super) s: [RawSegment; MAX_SEGMENTS],
}

// SAFETY: `RawSegments` is `repr(C)` plain data laid out exactly as `struct
// Segments` (each segment: six 8-byte fields, four u32, 64 bytes, no
// padding), passed by value (1024 bytes, within the parameter limit).
unsafe impl DeviceRepr for RawSegments {}

/// One launch's share of a step's segments.
#[derive(Clone, Copy, Debug)]
pub(super) struct Chunk {
    pub(super) segments: RawSegments,
    /// Segments in this launch (`gridDim.y`).
    pub(super) count: u32,
    /// Blocks per segment (`gridDim.x`).
    pub(super) grid_x: u32,
    /// First partial-sum slot of this launch (norm kernel).
    pub(super) slot_base: u32,
}

/// Splits `segments` into launches of at most [`MAX_SEGMENTS`], each as
/// wide as its largest segment needs (at most `max_blocks`). Returns the
/// launches and their total block count.
pub(super) fn launch_chunks(segments: &[RawSegment], max_blocks: u32) -> Result<(Vec<Chunk>, u32)> {
    let mut out = Vec::with_capacity(segments.len().div_ceil(MAX_SEGMENTS));
    let mut total: u32 = 0;
    for part in segments.chunks(MAX_SEGMENTS) {
        let widest = part.iter().map(RawSegment::elements).max().unwrap_or(0);
        let grid_x = widest
            .div_ceil(u64::from(BLOCK))
            .clamp(1, u64::from(max_blocks)) as u32;
        let mut raw = RawSegments::default();
        raw.s[..part.len()].copy_from_slice(part);
        let count = part.len() as u32; // at most MAX_SEGMENTS
        out.push(Chunk {
            segments: raw,
            count,
            grid_x,
            slot_base: total,
        });
        total = grid_x
            .checked_mul(count)
            .and_then(|blocks| total.checked_add(blocks))
            .ok_or_else(|| CudaError::BadArgument("too many optimizer segments".into()))?;
    }
    Ok((out, total))
}

/// A run of dense parameters contiguous in values, gradients and state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Run {
    pub(super) value: u64,
    pub(super) grad: u64,
    pub(super) first: u64,
    pub(super) second: u64,
    pub(super) len: usize,
    /// Its first parameter.
    pub(super) slot: u32,
    /// The learning-rate multiplier of its parameters (`f32` bits).
    pub(super) lr_scale: u32,
}

/// A row-gradient table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Table {
    pub(super) value: u64,
    pub(super) grad: u64,
    pub(super) first: u64,
    pub(super) second: u64,
    pub(super) width: u32,
    pub(super) rows: u32,
    /// Its parameter.
    pub(super) slot: u32,
    /// Its learning-rate multiplier (`f32` bits).
    pub(super) lr_scale: u32,
}

/// Where everything is: dense runs and tables, with their state. Pure data
/// (device addresses), built and checked without touching the device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Plan {
    pub(super) runs: Vec<Run>,
    pub(super) tables: Vec<Table>,
}

pub(super) fn addr(view: Option<DeviceView<f32>>) -> u64 {
    view.map_or(0, |v| v.device_ptr())
}

fn end(view: &DeviceView<f32>) -> u64 {
    view.device_ptr() + view.byte_len() as u64
}

/// Checks `slots` (each gradient as long as its values, tables of whole
/// rows with 32-bit row ids, no values overlapping another slot's values or
/// gradient) and that `first` and `second` hold the total of all slots'
/// lengths.
fn check_slots(
    slots: &[ParamSlot],
    first: Option<DeviceView<f32>>,
    second: Option<DeviceView<f32>>,
) -> Result<()> {
    let bad = |p: usize, what: String| CudaError::BadArgument(format!("parameter {p}: {what}"));
    for (p, slot) in slots.iter().enumerate() {
        if slot.value.len() != slot.grad.len() {
            return Err(bad(
                p,
                format!(
                    "{} values but a gradient of {}",
                    slot.value.len(),
                    slot.grad.len()
                ),
            ));
        }
        if let GradLayout::Rows { width } = slot.layout {
            if width == 0 || slot.value.len() % width != 0 {
                return Err(bad(
                    p,
                    format!("{} values are not rows of {width}", slot.value.len()),
                ));
            }
            if u32::try_from(width).is_err() || u32::try_from(slot.value.len() / width).is_err() {
                return Err(bad(p, "table too large for 32-bit row ids".into()));
            }
        }
        for (q, other) in slots.iter().enumerate() {
            let values_clash = q > p && overlap(&slot.value, &other.value);
            if values_clash || overlap(&slot.value, &other.grad) {
                return Err(bad(
                    p,
                    format!("its values overlap parameter {q}'s values or gradient"),
                ));
            }
        }
    }
    let total: usize = slots.iter().map(|s| s.value.len()).sum();
    for state in [first, second].into_iter().flatten() {
        if state.len() != total {
            return Err(CudaError::BadArgument(format!(
                "optimizer state of {} floats for {total} parameters",
                state.len()
            )));
        }
    }
    if u32::try_from(slots.len()).is_err() {
        return Err(CudaError::BadArgument(format!(
            "{} parameters",
            slots.len()
        )));
    }
    Ok(())
}

fn overlap(a: &DeviceView<f32>, b: &DeviceView<f32>) -> bool {
    !a.is_empty() && !b.is_empty() && a.device_ptr() < end(b) && b.device_ptr() < end(a)
}

impl Plan {
    /// Checks `slots` and lays the optimizer state out in slot order
    /// (`first` and `second` hold the total of all slots' lengths).
    pub(super) fn new(
        slots: &[ParamSlot],
        first: Option<DeviceView<f32>>,
        second: Option<DeviceView<f32>>,
    ) -> Result<Self> {
        Self::with_scales(slots, &[], first, second)
    }

    /// [`Plan::new`] with slot `p`'s learning rate multiplied by
    /// `scales[p]` (empty: 1 for every slot); a dense run holds parameters
    /// of one multiplier.
    pub(super) fn with_scales(
        slots: &[ParamSlot],
        scales: &[f32],
        first: Option<DeviceView<f32>>,
        second: Option<DeviceView<f32>>,
    ) -> Result<Self> {
        check_slots(slots, first, second)?;
        if !scales.is_empty() && scales.len() != slots.len() {
            return Err(CudaError::BadArgument(format!(
                "{} learning-rate multipliers for {} parameters",
                scales.len(),
                slots.len()
            )));
        }
        let mut plan = Plan {
            runs: Vec::new(),
            tables: Vec::new(),
        };
        let mut at = 0;
        let mut previous: Option<(&ParamSlot, usize)> = None; // last dense slot, its run
        for (index, slot) in slots.iter().enumerate() {
            let lr_scale = scales.get(index).copied().unwrap_or(1.0).to_bits();
            let index = index as u32; // checked by check_slots
            let len = slot.value.len();
            let state = |v: Option<DeviceView<f32>>| -> Result<u64> {
                v.map(|v| v.slice(at..at + len)).transpose().map(addr)
            };
            let (first_at, second_at) = (state(first)?, state(second)?);
            at += len;
            match slot.layout {
                GradLayout::Rows { width } => {
                    previous = None;
                    plan.tables.push(Table {
                        value: slot.value.device_ptr(),
                        grad: slot.grad.device_ptr(),
                        first: first_at,
                        second: second_at,
                        width: width as u32,        // checked by check_slots
                        rows: (len / width) as u32, // checked by check_slots
                        slot: index,
                        lr_scale,
                    });
                }
                GradLayout::Frozen => previous = None,
                GradLayout::Dense if len == 0 => {}
                GradLayout::Dense => {
                    let extends = previous.filter(|&(last, run)| {
                        end(&last.value) == slot.value.device_ptr()
                            && end(&last.grad) == slot.grad.device_ptr()
                            && plan.runs[run].lr_scale == lr_scale
                    });
                    match extends {
                        Some((_, run)) => plan.runs[run].len += len,
                        None => plan.runs.push(Run {
                            value: slot.value.device_ptr(),
                            grad: slot.grad.device_ptr(),
                            first: first_at,
                            second: second_at,
                            len,
                            slot: index,
                            lr_scale,
                        }),
                    }
                    previous = Some((slot, plan.runs.len() - 1));
                }
            }
        }
        Ok(plan)
    }

    /// Segments of one step: every dense run, then every table with touched
    /// rows (`touched[t]`: the touched row ids of table `t`).
    pub(super) fn segments(&self, touched: &[DeviceView<u32>]) -> Result<Vec<RawSegment>> {
        if touched.len() != self.tables.len() {
            return Err(CudaError::BadArgument(format!(
                "{} touched-row lists for {} row-gradient tables",
                touched.len(),
                self.tables.len()
            )));
        }
        let mut out = Vec::with_capacity(self.runs.len() + self.tables.len());
        out.extend(self.runs.iter().map(|r| RawSegment {
            value: r.value,
            grad: r.grad,
            first: r.first,
            second: r.second,
            rows: 0,
            len: r.len as u64,
            width: 0,
            table_rows: 0,
            slot: r.slot,
            lr_scale: r.lr_scale,
        }));
        for (t, (table, rows)) in self.tables.iter().zip(touched).enumerate() {
            if rows.is_empty() {
                continue;
            }
            if rows.len() > table.rows as usize {
                return Err(CudaError::BadArgument(format!(
                    "{} touched rows for table {t} of {} rows (row ids must be unique)",
                    rows.len(),
                    table.rows
                )));
            }
            out.push(RawSegment {
                value: table.value,
                grad: table.grad,
                first: table.first,
                second: table.second,
                rows: rows.device_ptr(),
                len: rows.len() as u64,
                width: table.width,
                table_rows: table.rows,
                slot: table.slot,
                lr_scale: table.lr_scale,
            });
        }
        Ok(out)
    }

    /// Partial-sum slots the norm kernel may need in one step.
    pub(super) fn norm_slots(&self) -> usize {
        (self.runs.len() + self.tables.len()).max(1) * MAX_NORM_BLOCKS as usize
    }

    /// Partial-sum slots the norm kernel may need in one step of any plan
    /// for `slots` (whatever the multipliers: a segment per slot at most).
    pub(super) fn max_norm_slots(slots: &[ParamSlot]) -> usize {
        slots.len().max(1) * MAX_NORM_BLOCKS as usize
    }
}
