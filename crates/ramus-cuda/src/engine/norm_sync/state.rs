//! Synchronized batch normalisation's state on the CUDA engine (see the
//! parent module): the group handle, each layer's buffers and the sums of
//! a step, as the engine holds them.

use std::collections::HashMap;

use cudarc::driver::CudaEvent;

use ramus_core::graph::{NodeId, ParamId};
use ramus_core::ops::NormGeom;
use ramus_exec::data_parallel::Collective;

use crate::error::Result;
use crate::launch::synced_len;
use crate::pool::{DeviceView, PoolBuffer};

/// The group handle, each layer's device buffers, and the sums of the
/// last step with rows.
pub(crate) struct NormSync {
    pub(super) collective: Box<dyn Collective<f32>>,
    /// Per layer, by its input's node in the forward graph: the forward
    /// sums (`2C + 1`), the statistics (`2C + 1`) and the gradient sums
    /// (`2C`), allocated when synchronization is set up.
    pub(super) layers: HashMap<NodeId, (NormGeom, PoolBuffer<f32>)>,
    /// The sums of this step so far (of the last step with rows, once done).
    pub(super) calls: Vec<Call>,
    /// Recorded on a lane before a sum on the main stream, and on the main
    /// stream after it.
    pub(super) before_sum: CudaEvent,
    pub(super) after_sum: CudaEvent,
}

/// A layer's sums in a step, as a rank without rows repeats them.
#[derive(Clone, Copy, Debug)]
pub(super) enum Call {
    /// The forward pass's two sums, then its statistics (and running ones,
    /// with the parameters `[gamma, beta]` and `(mean, var)` if blended).
    Forward {
        layer: NodeId,
        params: [ParamId; 2],
        running: Option<(ParamId, ParamId)>,
    },
    /// The backward pass's gradient sums.
    Backward { layer: NodeId },
}

/// A layer's buffer: its forward sums, statistics and gradient sums.
pub(super) fn parts(norm: &NormGeom, buf: &PoolBuffer<f32>) -> Result<[DeviceView<f32>; 3]> {
    let (l, c) = (synced_len(norm), norm.channels);
    let v = buf.view();
    Ok([
        v.slice(0..l)?,
        v.slice(l..2 * l)?,
        v.slice(2 * l..2 * l + 2 * c)?,
    ])
}
