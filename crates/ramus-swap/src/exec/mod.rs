//! Executing a swap plan: the ordering logic of the mechanism.
//!
//! The [`Executor`] walks one training iteration op by op and decides, on
//! the host, what a device must do before, around and after each op; the
//! device — the CUDA engine's copy streams, events and pool, or the
//! simulated [`SimDevice`](crate::SimDevice) of the tests — carries it out
//! through the small [`SwapDevice`] trait. The rules, the same as the
//! [`Simulator`](crate::Simulator)'s:
//!
//! * **Pre-access.** Before op `k` is queued, every tensor it uses that has
//!   no device memory yet (its outputs, at their first use) is allocated;
//!   every tensor it uses that is being prefetched is awaited (the compute
//!   stream waits on the prefetch's event, the host does not block).
//! * **Frees.** A tensor that is not persistent is released right after its
//!   last op is queued; later compute is ordered after it on the compute
//!   stream, and a prefetch into recycled memory waits for the compute
//!   stream to reach its issue point.
//! * **Offload** (after op `a`): queued on the device→host stream once op
//!   `a` has finished; the tensor's device memory is released only once the
//!   copy is known to be complete ([`SwapDevice::offload_complete`], or
//!   [`SwapDevice::wait_offload`] when an allocation needs the room).
//!   Completed offloads are reclaimed in issue order (the stream is FIFO).
//! * **Prefetch** (before op `p`, needed by op `b`): its destination is
//!   allocated at the issue point and the copy queued on the host→device
//!   stream after the tensor's offload.
//! * **Evict / Fetch** (naive swapping): synchronous; the host waits.
//! * **Budget.** An allocation that would exceed the executor's budget
//!   first waits for in-flight offloads, oldest first. With no plan and
//!   [`ExecOptions::on_demand`] (naive on-demand swapping), it then evicts
//!   the least-recently-used resident tensor the current op does not use
//!   (where the device refuses what the budget allows and only the op's own
//!   tensors are left, it clears them off the device once — inputs evicted,
//!   fresh outputs released — and places them again, largest first); an op
//!   that touches a tensor on the host fetches it synchronously.
//!   The device may refuse an allocation the budget allows (fragmentation
//!   of its heap): the executor then does the same, and with a plan
//!   ([`ExecOptions::fallback`]) evicts least-recently-used tensors as a
//!   last resort, fetching them back on demand (counted in the report).
//!   Otherwise it fails with [`ExecutorError::OutOfMemory`] naming the op, the
//!   tensor and the budget.
//!
//! **Layout mode.** A plan with a [`Layout`](crate::Layout) fixes every
//! allocation's offset in one arena ([`SwapDevice::reserve_arena`] at the
//! start, [`SwapDevice::release_arena`] once every copy has drained): the
//! executor places each tensor at its next block
//! ([`SwapDevice::allocate_at`]) instead of asking an allocator, so the
//! device's fragmentation cannot refuse what the plan allows. The host
//! never waits for memory: where a block takes memory that an offload may
//! still be reading, the offloaded tensor is released at once
//! ([`SwapDevice::release_offloading`]) and the new tensor's first write —
//! its prefetch or its op — waits for that copy on the device
//! ([`SwapDevice::order_after_offload`]), as does a prefetch of a tensor
//! whose own offload is still in flight. A layout that places a tensor over
//! one still in use is rejected naming both.
//!
//! A plan that cannot be carried out — an op using a tensor that is on the
//! host with no prefetch before it, a prefetch of what is not on the host,
//! an offload of what is not resident, an allocation over the budget — is
//! rejected with an error naming the op, the tensor and the action.
//! Persistent tensors are the device's own (parameters, their gradients,
//! optimizer state): they are resident from the start, never released, and
//! never moved unless [`ExecOptions::movable`] says so.
//!
//! The code: `device.rs` holds the device contract ([`SwapDevice`]) and
//! [`ExecutorError`]; this file checks a plan against its trace
//! ([`Executor::new`]); `run.rs` runs one iteration, one method per rule.

mod device;
mod run;

use crate::plan::{Action, SwapPlan};
use crate::trace::Trace;
pub use device::{ExecutorError, SwapDevice};
use serde::{Deserialize, Serialize};

/// How the executor treats memory.
#[derive(Clone, Debug, PartialEq)]
pub struct ExecOptions {
    /// Bytes the executor lets tensors occupy (persistent ones included);
    /// `None`: only the device's own limit.
    pub budget_bytes: Option<u64>,
    /// Naive on-demand swapping: make room by evicting least-recently-used
    /// tensors synchronously, fetch touched tensors synchronously.
    pub on_demand: bool,
    /// With a plan: when the device refuses an allocation the budget allows,
    /// evict least-recently-used tensors instead of failing.
    pub fallback: bool,
    /// Per tensor, whether it may leave the device (`None`: every tensor
    /// that is not persistent).
    pub movable: Option<Vec<bool>>,
}

impl ExecOptions {
    /// No swapping: every allocation must fit (an error names the op, the
    /// tensor and the budget otherwise).
    pub fn resident(budget_bytes: Option<u64>) -> ExecOptions {
        ExecOptions {
            budget_bytes,
            on_demand: false,
            fallback: false,
            movable: None,
        }
    }

    /// Naive on-demand swapping (least-recently-used, synchronous) under
    /// `budget_bytes` and whatever the device refuses.
    pub fn on_demand(budget_bytes: Option<u64>) -> ExecOptions {
        ExecOptions {
            on_demand: true,
            ..ExecOptions::resident(budget_bytes)
        }
    }

    /// Following a plan made for `budget_bytes`, with on-demand eviction as
    /// a last resort when the device refuses an allocation the plan allows.
    pub fn planned(budget_bytes: Option<u64>) -> ExecOptions {
        ExecOptions {
            fallback: true,
            ..ExecOptions::resident(budget_bytes)
        }
    }
}

/// What one iteration did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ExecReport {
    /// Ops run.
    pub ops: usize,
    /// Bytes copied device → host (offloads and evictions).
    pub bytes_to_host: u64,
    /// Bytes copied host → device (prefetches and fetches).
    pub bytes_to_device: u64,
    /// Copies device → host.
    pub copies_to_host: usize,
    /// Copies host → device.
    pub copies_to_device: usize,
    /// Asynchronous offloads issued (plan).
    pub offloads: usize,
    /// Asynchronous prefetches issued (plan).
    pub prefetches: usize,
    /// Synchronous evictions (naive swapping, or a plan's `Evict`).
    pub sync_evictions: usize,
    /// Synchronous fetches (naive swapping, or a plan's `Fetch`).
    pub sync_fetches: usize,
    /// Evictions a plan did not ask for: the device refused an allocation
    /// the plan allows.
    pub fallback_evictions: usize,
    /// Fetches of tensors evicted that way.
    pub fallback_fetches: usize,
    /// Times the host blocked on an offload to get memory back.
    pub offload_waits: usize,
    /// Prefetched tensors no op used before the iteration ended.
    pub unused_prefetches: usize,
    /// The most bytes resident at once, in the executor's accounting
    /// (persistent tensors, and memory held by in-flight copies, included).
    pub peak_bytes: u64,
    /// Layout mode: allocations placed over memory an offload might still
    /// be reading, ordered after that offload on the device.
    #[serde(default)]
    pub reuses_after_offload: usize,
}

/// Drives one iteration of a trace (and an optional plan) on a device.
#[derive(Clone, Debug)]
pub struct Executor<'t> {
    trace: &'t Trace,
    plan: Option<&'t SwapPlan>,
    options: ExecOptions,
    movable: Vec<bool>,
    last_use: Vec<Option<usize>>,
    /// Plan action indices by position (`2 * op` before, `2 * op + 1` after).
    actions_at: Vec<Vec<usize>>,
    /// Layout mode: per tensor, the indices of its blocks in the plan's
    /// layout, in allocation order.
    blocks_of: Option<Vec<Vec<usize>>>,
}

impl<'t> Executor<'t> {
    /// An executor for `trace`, following `plan` if given. Checks that the
    /// plan belongs to the trace and moves only movable tensors.
    pub fn new(
        trace: &'t Trace,
        plan: Option<&'t SwapPlan>,
        options: ExecOptions,
    ) -> Result<Executor<'t>, ExecutorError> {
        let movable = movable_flags(trace, &options)?;
        let last_use = trace.last_uses();
        let actions_at = match plan {
            Some(plan) => actions_by_position(trace, plan, &movable)?,
            None => vec![Vec::new(); 2 * trace.num_ops()],
        };
        let blocks_of = blocks_by_tensor(trace, plan)?;
        Ok(Executor {
            trace,
            plan,
            options,
            movable,
            last_use,
            actions_at,
            blocks_of,
        })
    }

    /// The trace being executed.
    pub fn trace(&self) -> &Trace {
        self.trace
    }
}

/// Per tensor, whether it may leave the device: as `options` says, or
/// every tensor that is not persistent.
fn movable_flags(trace: &Trace, options: &ExecOptions) -> Result<Vec<bool>, ExecutorError> {
    let nt = trace.num_tensors();
    match &options.movable {
        Some(m) if m.len() != nt => Err(ExecutorError::Mismatch(format!(
            "{} movable flags for {nt} tensors",
            m.len()
        ))),
        Some(m) => Ok(m.clone()),
        None => Ok(trace
            .tensors()
            .iter()
            .map(|t| !t.kind.is_persistent())
            .collect()),
    }
}

/// Checks that `plan` belongs to `trace` and moves only movable tensors;
/// returns its action indices by position (`2 * op` before the op,
/// `2 * op + 1` after it), in plan order.
fn actions_by_position(
    trace: &Trace,
    plan: &SwapPlan,
    movable: &[bool],
) -> Result<Vec<Vec<usize>>, ExecutorError> {
    let n = trace.num_ops();
    let nt = trace.num_tensors();
    if plan.num_ops != n {
        return Err(ExecutorError::Mismatch(format!(
            "the plan is for {} ops, the iteration has {n}",
            plan.num_ops
        )));
    }
    if let Some(&t) = plan.host_resident_at_start.first() {
        return Err(ExecutorError::Mismatch(format!(
            "the plan starts with persistent tensor {t} `{}` on the host; this device \
             keeps persistent tensors resident",
            trace.get_tensor(t).map_or("?", |i| i.name.as_str())
        )));
    }
    let mut actions_at = vec![Vec::new(); 2 * n];
    for (i, a) in plan.actions.iter().enumerate() {
        let invalid = |message: String| ExecutorError::InvalidAction {
            index: i,
            action: brief(a, trace),
            message,
        };
        let t = a.tensor();
        let Some(info) = trace.get_tensor(t) else {
            return Err(invalid(format!("the iteration has only {nt} tensors")));
        };
        if info.bytes != a.bytes() {
            return Err(invalid(format!(
                "it moves {} bytes; the tensor has {}",
                a.bytes(),
                info.bytes
            )));
        }
        if !movable[t.index()] {
            return Err(invalid(format!(
                "the tensor is a {} and stays on the device",
                info.kind.label()
            )));
        }
        let pos = a.position();
        if pos >= 2 * n {
            return Err(invalid(format!("the iteration has only {n} ops")));
        }
        if let Action::Prefetch {
            issue_before_op,
            needed_by_op,
            ..
        } = a
        {
            if needed_by_op < issue_before_op
                || *needed_by_op >= n
                || !trace.uses(*needed_by_op).contains(&t)
            {
                return Err(invalid(format!(
                    "op {needed_by_op} is not an op at or after the issue point that \
                     uses the tensor"
                )));
            }
        }
        actions_at[pos].push(i);
    }
    Ok(actions_at)
}

/// Layout mode (a plan with a layout, checked against the trace): per
/// tensor, the indices of its blocks in allocation order.
fn blocks_by_tensor(
    trace: &Trace,
    plan: Option<&SwapPlan>,
) -> Result<Option<Vec<Vec<usize>>>, ExecutorError> {
    let Some((plan, layout)) = plan.and_then(|p| p.layout.as_ref().map(|l| (p, l))) else {
        return Ok(None);
    };
    layout
        .check(trace, plan)
        .map_err(|e| ExecutorError::Mismatch(e.to_string()))?;
    let mut of = vec![Vec::new(); trace.num_tensors()];
    for (i, b) in layout.blocks.iter().enumerate() {
        of[b.tensor.index()].push(i);
    }
    Ok(Some(of))
}

/// An action, briefly, with the tensor's name.
fn brief(a: &Action, trace: &Trace) -> String {
    let t = a.tensor();
    let name = trace.get_tensor(t).map_or("?", |i| i.name.as_str());
    match a {
        Action::Offload { after_op, .. } => format!("offload {t} `{name}` after op {after_op}"),
        Action::Prefetch {
            issue_before_op,
            needed_by_op,
            ..
        } => format!(
            "prefetch {t} `{name}` before op {issue_before_op}, needed by op {needed_by_op}"
        ),
        Action::Evict { before_op, .. } => format!("evict {t} `{name}` before op {before_op}"),
        Action::Fetch { before_op, .. } => format!("fetch {t} `{name}` before op {before_op}"),
    }
}
