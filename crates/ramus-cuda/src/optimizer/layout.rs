//! What the device optimizer's parts share (a leaf module): the
//! parameters as it sees them, and the limits of its kernels' launches
//! that the generated source and the host-side plan both follow.

use crate::pool::DeviceView;

/// Segments (dense runs and tables) one launch covers (`RAMUS_MAX_SEGMENTS`
/// in the generated source).
pub const MAX_SEGMENTS: usize = 16;
/// Threads per block of both kernels (`RAMUS_BLOCK`).
pub(super) const BLOCK: u32 = 256;
/// Blocks per segment of a norm launch at most: bounds the partial sums.
pub(super) const MAX_NORM_BLOCKS: u32 = 128;
/// Words of the optimizer's status block (see `State::words` in
/// `optimizer.rs`).
pub(super) const STATUS_WORDS: usize = 9;

/// How a parameter's gradient arrives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradLayout {
    /// A gradient for every element: the whole parameter is updated.
    Dense,
    /// Row gradients of an embedding table with rows of `width` floats:
    /// only the rows named in each step's touched list are updated.
    Rows { width: usize },
    /// No gradient: a non-trained buffer (batch normalisation's running
    /// statistics, [`ramus_core::ParamKind::Buffer`]) that the optimizer
    /// leaves alone — no step, no weight decay, not in the clipping norm.
    Frozen,
}

/// One parameter as the optimizer sees it on the device.
#[derive(Clone, Copy, Debug)]
pub struct ParamSlot {
    /// The parameter's values (updated in place).
    pub value: DeviceView<f32>,
    /// Its gradient, as long as `value` (for tables, only touched rows are read).
    pub grad: DeviceView<f32>,
    pub layout: GradLayout,
}
