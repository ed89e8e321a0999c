//! The swap path's state kept across steps ([`SwapRuntime`]: copy streams,
//! per-tensor device memory and pinned host slots, the prepared iteration
//! of every batch shape) and the types its steps and its device share.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream};

use ramus_exec::OptimizerConfig;
use ramus_swap::{ExecOptions, Policy, SwapPlan, TensorId};

use super::steps::{Kind, Shape, SwapProgram};
use super::{HostSlot, SwapConfig, SwapStepReport};
use crate::batch::Buf;
use crate::error::{InCall, Result};
use crate::pinned::PinnedBuffer;
use crate::pool::PoolBuffer;

/// How a training step on the swap path updates the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Update {
    /// The fused optimizer update, the step's last op.
    Fused,
    /// None: the caller sums the gradients over the ranks, then updates
    /// (a data-parallel or accumulated step, `SplitStep`); `first`: the
    /// step's first batch, before which the running statistics are kept.
    Split { first: bool },
}

/// A training step's optimizer and update.
#[derive(Clone, Copy)]
pub(super) struct Training<'a> {
    pub(super) config: &'a OptimizerConfig,
    pub(super) update: Update,
}

impl Training<'_> {
    /// Whether the step ends in the fused update.
    pub(super) fn fused(training: Option<Self>) -> bool {
        training.is_some_and(|t| t.update == Update::Fused)
    }
}

/// A tensor's device memory.
pub(super) enum Mem {
    Floats(PoolBuffer<f32>),
    Indices(PoolBuffer<u32>),
    /// A range of the step's arena (a plan with a layout): valid while the
    /// arena is held, which is until the executor has drained every copy.
    Placed(Buf),
}

impl Mem {
    pub(super) fn buf(&self) -> Buf {
        match self {
            Mem::Floats(b) => Buf::Floats(b.view()),
            Mem::Indices(b) => Buf::Indices(b.view()),
            Mem::Placed(b) => *b,
        }
    }

    /// Device address and bytes of the tensor's elements.
    pub(super) fn raw(&self) -> (u64, usize) {
        match self.buf() {
            Buf::Floats(v) => (v.device_ptr(), v.byte_len()),
            Buf::Indices(v) => (v.device_ptr(), v.byte_len()),
            Buf::Absent => (0, 0),
        }
    }
}

/// Per trace tensor: device memory, host slot and the events of its copies.
#[derive(Default)]
pub(super) struct Slot {
    pub(super) mem: Option<Mem>,
    pub(super) host: Option<HostSlot>,
    pub(super) offloaded: Option<CudaEvent>,
    pub(super) prefetched: Option<CudaEvent>,
    /// Layout mode: tensors whose offload may still read this tensor's
    /// (just placed) memory; its first write waits for their events.
    pub(super) write_after: Vec<TensorId>,
}

/// How a prepared batch shape is executed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    /// Mode, budget and plan not decided yet.
    New,
    /// Planned without op times; the next iteration is timed.
    Profile,
    /// Settled.
    Ready,
}

/// The iteration of one batch shape, and how it runs.
pub(super) struct Prepared {
    pub(super) program: SwapProgram,
    pub(super) stage: Stage,
    pub(super) policy: Option<Policy>,
    pub(super) plan: Option<SwapPlan>,
    pub(super) options: ExecOptions,
    pub(super) overhead: u64,
    pub(super) plan_budget: Option<u64>,
    pub(super) trace_peak: u64,
    /// Seconds the last planning of this iteration took (deciding the mode
    /// and making the plan), and whether the step in progress made it.
    pub(super) plan_seconds: f64,
    pub(super) planned_now: bool,
}

/// What a prepared iteration is cached by: a static-graph model's batch
/// shape, or a fingerprint of a dynamic batch's ops and tensors.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) enum PrepKey {
    Static(Shape, Kind),
    Dynamic(u64, Kind),
}

/// Dynamic batch structures whose plans are kept at most.
const MAX_DYNAMIC_PLANS: usize = 64;

/// The no-swap mode's laid-out plan ([`crate::swap::resident_plan`]) for a
/// static-graph step (a dynamic batch would pay the packing every batch),
/// where its arena fits `room` (the largest free block plus the persistent
/// tensors). Otherwise `None`: tensors are allocated one by one, so that an
/// Timing events of a profiled iteration.
#[derive(Default)]
pub(super) struct Profile {
    pub(super) ops: Vec<Option<(CudaEvent, CudaEvent)>>,
    /// (to the host?, bytes, start, end)
    pub(super) copies: Vec<(bool, usize, CudaEvent, CudaEvent)>,
}

/// The swap path's state, kept across steps.
pub(super) struct SwapRuntime {
    pub(super) config: SwapConfig,
    pub(super) d2h: Arc<CudaStream>,
    pub(super) h2d: Arc<CudaStream>,
    /// Recorded on the compute stream when a copy must follow it.
    pub(super) mark: CudaEvent,
    /// Ops queued on the compute stream so far, and when `mark` was recorded.
    pub(super) epoch: u64,
    pub(super) mark_epoch: Option<u64>,
    pub(super) slots: Vec<Slot>,
    pub(super) prepared: HashMap<PrepKey, Prepared>,
    pub(super) upload: PinnedBuffer,
    pub(super) loss: PinnedBuffer,
    pub(super) logits: PinnedBuffer,
    /// Floats of scores the last iteration copied into `logits`.
    pub(super) logits_len: usize,
    pub(super) workspace: Option<PoolBuffer<f32>>,
    /// Layout mode: the arena of the step in progress.
    pub(super) arena: Option<PoolBuffer<f32>>,
    pub(super) report: Option<SwapStepReport>,
}

impl SwapRuntime {
    pub(super) fn new(
        engine_device: &crate::device::CudaDevice,
        config: SwapConfig,
    ) -> Result<Self> {
        Ok(SwapRuntime {
            config,
            d2h: engine_device.new_stream()?,
            h2d: engine_device.new_stream()?,
            mark: engine_device.new_event()?,
            epoch: 0,
            mark_epoch: None,
            slots: Vec::new(),
            prepared: HashMap::new(),
            upload: PinnedBuffer::new(engine_device)?,
            loss: PinnedBuffer::new(engine_device)?,
            logits: PinnedBuffer::new(engine_device)?,
            logits_len: 0,
            workspace: None,
            arena: None,
            report: None,
        })
    }

    /// A host slot of at least `bytes` for tensor `t`.
    pub(super) fn ensure_host(
        &mut self,
        t: usize,
        bytes: usize,
        device: &crate::device::CudaDevice,
    ) -> Result<()> {
        if self.slots.len() <= t {
            self.slots.resize_with(t + 1, Slot::default);
        }
        match &self.slots[t].host {
            Some(h) if h.bytes() >= bytes => return Ok(()),
            Some(_) => {
                // a smaller slot (another batch shape's tensor) may still be
                // used by a copy: drain before freeing it
                self.drain()?;
                self.slots[t].host = None;
            }
            None => {}
        }
        self.slots[t].host = Some(HostSlot::new(device, bytes)?);
        Ok(())
    }

    pub(super) fn config(&self) -> &SwapConfig {
        &self.config
    }

    /// Puts a prepared iteration back in the cache, forgetting the
    /// dynamic ones when there are too many (each batch of trees may have
    /// a structure of its own).
    pub(super) fn keep(&mut self, key: PrepKey, prep: Prepared) {
        if matches!(key, PrepKey::Dynamic(..)) && !self.prepared.contains_key(&key) {
            let dynamic = self
                .prepared
                .keys()
                .filter(|k| matches!(k, PrepKey::Dynamic(..)))
                .count();
            if dynamic >= MAX_DYNAMIC_PLANS {
                self.prepared
                    .retain(|k, _| !matches!(k, PrepKey::Dynamic(..)));
            }
        }
        self.prepared.insert(key, prep);
    }

    pub(super) fn last_report(&self) -> Option<&SwapStepReport> {
        self.report.as_ref()
    }

    /// Drains both copy streams (before host slots may be freed or device
    /// memory dropped after a failed step).
    pub(super) fn drain(&self) -> Result<()> {
        self.d2h.synchronize().in_call("cuStreamSynchronize")?;
        self.h2d.synchronize().in_call("cuStreamSynchronize")
    }
}

impl Drop for SwapRuntime {
    fn drop(&mut self) {
        if let Err(e) = self.drain() {
            // a copy may still use the host slots: leak them rather than free
            eprintln!("ramus-cuda: leaking swap host slots after a failed drain: {e}");
            for slot in self.slots.drain(..) {
                std::mem::forget(slot);
            }
        }
    }
}
