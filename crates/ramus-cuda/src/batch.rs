//! What the CUDA batched engine and the swap path wrapped around it both
//! know about a batch: where a node's value lives ([`Buf`]) and the
//! vertices the head runs on ([`head_vertices`]). A leaf module, so that
//! neither imports the other for them.

use ramus_core::HeadRows;
use ramus_graph::{Schedule, NO_LABEL};

use crate::pool::DeviceView;

/// Where one node's value lives for the current batch.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Buf {
    Absent,
    Floats(DeviceView<f32>),
    Indices(DeviceView<u32>),
}

/// The vertices the head runs on, in head-row order.
pub(crate) fn head_vertices(rows: HeadRows, s: &Schedule) -> Vec<u32> {
    match rows {
        HeadRows::Roots => s.roots.clone(),
        HeadRows::Labelled => s
            .number
            .iter()
            .copied()
            .filter(|&v| s.labels[v as usize] != NO_LABEL)
            .collect(),
    }
}
