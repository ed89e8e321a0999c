//! A simulated device that replays a trace under a plan and a budget.
//!
//! The model is the one the CUDA mechanism implements: one compute stream,
//! one copy stream per direction (each a FIFO: copies on it complete in
//! issue order), and events ordering copies against compute.
//!
//! * An op's outputs (and any tensor at its first use) are allocated when it
//!   is launched ("pre-access"); tensors are freed after their last use.
//! * An offload is issued once its op has finished; the tensor's device
//!   memory is released only when the copy completes.
//! * A prefetch allocates its destination when it is issued (at the launch
//!   of its op) and starts when the host→device stream is free and the
//!   tensor's own offload has completed; the op that needs the tensor waits
//!   for it.
//! * An allocation that does not fit waits for in-flight offloads to
//!   complete (a stall); if it still does not fit, replay fails with
//!   [`SimError::BudgetExceeded`] naming the op, the tensor and the budget.
//! * Using a tensor that is on the host, or on its way there, fails with
//!   [`SimError::NotResident`].
//!
//! * With a [`Layout`] in the plan, each allocation also
//!   takes its block: an op whose block overlaps memory an offload is still
//!   reading waits for that copy (a memory stall), and so does a prefetch's
//!   copy; a block over memory still in use fails the replay.
//!
//! The report counts bytes and copies each way, peak memory, the compute
//! stream's stalls and whether prefetches completed in the order their ops
//! need them.

use crate::cost::CostModel;
use crate::error::SimError;
use crate::plan::{Action, Layout, Prediction, SwapPlan};
use crate::trace::{TensorId, Trace};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Which way a copy goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Direction {
    /// Device → host (offload, evict).
    ToHost,
    /// Host → device (prefetch, fetch).
    ToDevice,
}

/// One simulated copy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransferRecord {
    /// Index of the action in the plan.
    pub action: usize,
    /// The tensor.
    pub tensor: TensorId,
    /// Which way.
    pub direction: Direction,
    /// Bytes copied.
    pub bytes: u64,
    /// Whether compute waited for the whole copy (evict, fetch).
    pub synchronous: bool,
    /// When the copy was issued (its destination allocated).
    pub issue_s: f64,
    /// When the copy engine started it.
    pub start_s: f64,
    /// When it completed.
    pub end_s: f64,
    /// For copies to the device: the op that first used the tensor after it.
    pub used_by_op: Option<usize>,
    /// For copies to the device: how long that op waited for this copy.
    pub wait_s: f64,
    /// For offloads: the op whose allocations first found the tensor's
    /// device memory released (the copy complete); the number of ops if
    /// only the end of the iteration did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_before_op: Option<usize>,
}

/// The result of a replay.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    /// Iteration time: compute finished and both copy streams drained.
    pub total_s: f64,
    /// Sum of op durations.
    pub compute_s: f64,
    /// Time the compute stream was idle: `total_s - compute_s`.
    pub stall_s: f64,
    /// Part of the stall spent waiting for tensors to arrive.
    pub stall_data_s: f64,
    /// Part of the stall spent waiting for memory (offloads to complete).
    pub stall_memory_s: f64,
    /// Part of the stall spent draining the copy streams after the last op.
    pub drain_s: f64,
    /// The largest device memory in use at any time.
    pub peak_bytes: u64,
    /// The budget enforced (`None`: unlimited).
    pub budget_bytes: Option<u64>,
    /// Bytes copied device → host.
    pub bytes_to_host: u64,
    /// Bytes copied host → device.
    pub bytes_to_device: u64,
    /// Copies device → host.
    pub copies_to_host: usize,
    /// Copies host → device.
    pub copies_to_device: usize,
    /// Per op: device memory in use when it started.
    pub resident_bytes: Vec<u64>,
    /// Per op: when it started.
    pub op_start_s: Vec<f64>,
    /// Every copy, in issue order.
    pub transfers: Vec<TransferRecord>,
    /// Copies to the device that an op had to wait for.
    pub late_prefetches: usize,
    /// Adjacent pairs of copies to the device that completed in the
    /// opposite order of the ops that use them (Fig. 3.4's problem).
    pub out_of_order_prefetches: usize,
    /// Whether the iteration ends where it started: persistent tensors
    /// homed on the host are back there, every other persistent tensor is
    /// resident, and no prefetched tensor was left unused.
    pub end_state_consistent: bool,
}

impl SimReport {
    /// The summary a [`SwapPlan`] carries.
    pub fn prediction(&self) -> Prediction {
        Prediction {
            peak_bytes: self.peak_bytes,
            bytes_to_host: self.bytes_to_host,
            bytes_to_device: self.bytes_to_device,
            copies_to_host: self.copies_to_host,
            copies_to_device: self.copies_to_device,
            compute_s: self.compute_s,
            total_s: self.total_s,
            stall_s: self.stall_s,
        }
    }
}

/// The simulated device: a cost model and a memory budget.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Simulator {
    /// Copy and op times.
    pub cost: CostModel,
    /// Device memory budget (`None`: unlimited).
    pub budget_bytes: Option<u64>,
}

#[derive(Clone, Copy, Debug)]
enum Loc {
    Unallocated,
    Resident,
    /// Copy to the host in flight; device memory held until `done`.
    Offloading {
        done: f64,
    },
    /// On the host; the host copy is complete at `done`.
    Host {
        done: f64,
    },
    /// Copy to the device in flight (memory allocated); `record` indexes
    /// the transfer records.
    Prefetching {
        done: f64,
        record: usize,
    },
    Freed,
}

impl Loc {
    fn describe(self) -> String {
        match self {
            Loc::Unallocated => "not yet allocated".into(),
            Loc::Resident => "resident".into(),
            Loc::Offloading { .. } => "being offloaded to the host".into(),
            Loc::Host { .. } => "on the host".into(),
            Loc::Prefetching { .. } => "being prefetched".into(),
            Loc::Freed => "already freed".into(),
        }
    }
}

struct Memory {
    used: u64,
    peak: u64,
    budget: u64,
    /// In-flight offloads in completion order: (done, tensor, bytes,
    /// transfer record).
    pending: VecDeque<(f64, usize, u64, usize)>,
    stall_s: f64,
    /// The op whose allocations memory released now serves.
    op: usize,
    /// Offloads whose memory was released: (transfer record, op).
    released: Vec<(usize, usize)>,
}

impl Memory {
    fn release_until(&mut self, t: f64, loc: &mut [Loc]) {
        while let Some(&(done, tensor, bytes, record)) = self.pending.front() {
            if done > t {
                break;
            }
            self.pending.pop_front();
            self.released.push((record, self.op));
            self.used -= bytes;
            if let Loc::Offloading { done } = loc[tensor] {
                loc[tensor] = Loc::Host { done };
            }
        }
    }

    /// Allocates `bytes` at time `now`, waiting for in-flight offloads if
    /// needed; returns the new time, or `None` if it cannot fit.
    fn alloc(&mut self, bytes: u64, mut now: f64, loc: &mut [Loc]) -> Option<f64> {
        self.release_until(now, loc);
        while self.used + bytes > self.budget {
            let &(done, _, _, _) = self.pending.front()?;
            if done > now {
                self.stall_s += done - now;
                now = done;
            }
            self.release_until(now, loc);
        }
        self.used += bytes;
        self.peak = self.peak.max(self.used);
        Some(now)
    }
}

/// A plan's layout during a replay: where each tensor's memory is, and
/// from when what held it before is gone.
struct Placement<'p> {
    layout: &'p Layout,
    /// Per tensor, its blocks in allocation order, and the next one.
    blocks: Vec<Vec<usize>>,
    next: Vec<usize>,
    /// Ranges held: (start, end, tensor, free from; infinite while in use).
    held: Vec<(u64, u64, usize, f64)>,
}

impl<'p> Placement<'p> {
    fn new(layout: &'p Layout, tensors: usize) -> Placement<'p> {
        let mut blocks = vec![Vec::new(); tensors];
        for (i, b) in layout.blocks.iter().enumerate() {
            if let Some(v) = blocks.get_mut(b.tensor.index()) {
                v.push(i);
            }
        }
        Placement {
            layout,
            blocks,
            next: vec![0; tensors],
            held: Vec::new(),
        }
    }

    /// Places tensor `t`'s next block at time `now`; returns when the
    /// memory under it is free (copies still reading it complete).
    fn place(&mut self, t: usize, now: f64) -> Result<f64, String> {
        let block = self.blocks[t]
            .get(self.next[t])
            .and_then(|&i| self.layout.blocks.get(i))
            .ok_or_else(|| {
                format!(
                    "the layout has no block for allocation {} of t{t}",
                    self.next[t] + 1
                )
            })?;
        self.next[t] += 1;
        let (start, end) = (block.offset, block.end());
        let mut free_at = now;
        for &(s, e, u, free) in &self.held {
            if s < end && start < e {
                if free.is_infinite() {
                    return Err(format!(
                        "the layout places t{t} at bytes {start}..{end} over t{u}, still in use"
                    ));
                }
                free_at = free_at.max(free);
            }
        }
        self.held
            .retain(|&(s, e, _, free)| !(s < end && start < e) && free > now);
        self.held.push((start, end, t, f64::INFINITY));
        Ok(free_at)
    }

    /// Tensor `t`'s memory is free from `at` on.
    fn free(&mut self, t: usize, at: f64) {
        for h in &mut self.held {
            if h.2 == t && h.3.is_infinite() {
                h.3 = at;
            }
        }
    }
}

/// Places tensor `t`'s next block, if the plan has a layout; returns when
/// its memory is free.
fn place(placement: &mut Option<Placement<'_>>, t: usize, now: f64) -> Result<f64, SimError> {
    match placement.as_mut() {
        Some(p) => p.place(t, now).map_err(SimError::TraceMismatch),
        None => Ok(now),
    }
}

/// Tensor `t`'s block is free from `at`, if the plan has a layout.
fn free(placement: &mut Option<Placement<'_>>, t: usize, at: f64) {
    if let Some(p) = placement.as_mut() {
        p.free(t, at);
    }
}

/// One copy stream: a FIFO that is free from `free` on.
#[derive(Default)]
struct Stream {
    free: f64,
    /// Bytes copied on it so far.
    bytes: u64,
}

impl Stream {
    /// Queues a copy of `bytes` taking `duration` that can start at `ready`;
    /// returns when it starts and ends.
    fn copy(&mut self, ready: f64, duration: f64, bytes: u64) -> (f64, f64) {
        let start = ready.max(self.free);
        let end = start + duration;
        self.free = end;
        self.bytes += bytes;
        (start, end)
    }
}

/// A copy's record before an op has used it.
fn record(
    action: usize,
    a: &Action,
    direction: Direction,
    synchronous: bool,
    issue_s: f64,
    start_s: f64,
    end_s: f64,
) -> TransferRecord {
    TransferRecord {
        action,
        tensor: a.tensor(),
        direction,
        bytes: a.bytes(),
        synchronous,
        issue_s,
        start_s,
        end_s,
        used_by_op: None,
        wait_s: 0.0,
        released_before_op: None,
    }
}

fn invalid_action(index: usize, a: &Action, message: String) -> SimError {
    SimError::InvalidAction {
        index,
        action: brief(a),
        message,
    }
}

/// Evicts and offloads move only resident tensors.
fn require_resident(loc: Loc, index: usize, a: &Action) -> Result<(), SimError> {
    match loc {
        Loc::Resident => Ok(()),
        other => Err(invalid_action(
            index,
            a,
            format!("the tensor is {}, not resident", other.describe()),
        )),
    }
}

impl Simulator {
    /// A device with this cost model and budget.
    pub fn new(cost: CostModel, budget_bytes: Option<u64>) -> Simulator {
        Simulator { cost, budget_bytes }
    }

    /// A device with the plan's own budget.
    pub fn for_plan(cost: CostModel, plan: &SwapPlan) -> Simulator {
        Simulator::new(cost, plan.budget_bytes)
    }

    /// Replays one iteration of `trace` under `plan`.
    pub fn run(&self, trace: &Trace, plan: &SwapPlan) -> Result<SimReport, SimError> {
        let n = trace.num_ops();
        if plan.num_ops != n {
            return Err(SimError::TraceMismatch(format!(
                "the plan is for {} ops, the trace has {n}",
                plan.num_ops
            )));
        }
        let nt = trace.num_tensors();
        let tensor_name = |t: usize| trace.tensors()[t].name.clone();
        let op_name = |op: usize| trace.ops()[op].name.clone();

        // Validate actions and bucket them by position, keeping plan order.
        let mut at: Vec<Vec<usize>> = vec![Vec::new(); 2 * n];
        for (i, a) in plan.actions.iter().enumerate() {
            let invalid = |message: String| invalid_action(i, a, message);
            let t = a.tensor().index();
            let Some(info) = trace.tensors().get(t) else {
                return Err(invalid(format!("the trace has only {nt} tensors")));
            };
            if info.bytes != a.bytes() {
                return Err(invalid(format!(
                    "the action moves {} bytes, the trace's tensor has {}",
                    a.bytes(),
                    info.bytes
                )));
            }
            let pos = a.position();
            if pos >= 2 * n {
                return Err(invalid(format!("the trace has only {n} ops")));
            }
            if let Action::Prefetch {
                issue_before_op,
                needed_by_op,
                ..
            } = a
            {
                if needed_by_op < issue_before_op || *needed_by_op >= n {
                    return Err(invalid(format!(
                        "needed by op {needed_by_op}, which is not at or after the issue point"
                    )));
                }
                if !trace.uses(*needed_by_op).contains(&a.tensor()) {
                    return Err(invalid(format!(
                        "op {needed_by_op} `{}` does not use the tensor",
                        op_name(*needed_by_op)
                    )));
                }
            }
            at[pos].push(i);
        }

        let last_use = trace.last_uses();

        let budget = self.budget_bytes.unwrap_or(u64::MAX);
        let over_budget = |op: usize, t: usize, used: u64| SimError::BudgetExceeded {
            op,
            op_name: op_name(op),
            tensor: TensorId(t as u32),
            tensor_name: tensor_name(t),
            bytes: trace.tensors()[t].bytes,
            resident: used,
            budget,
        };
        let mut mem = Memory {
            used: 0,
            peak: 0,
            budget,
            pending: VecDeque::new(),
            stall_s: 0.0,
            op: 0,
            released: Vec::new(),
        };
        let mut loc = vec![Loc::Unallocated; nt];
        let mut homed = vec![false; nt];
        for &t in &plan.host_resident_at_start {
            let Some(info) = trace.tensors().get(t.index()) else {
                return Err(SimError::TraceMismatch(format!(
                    "host-resident tensor {t} is not in the trace"
                )));
            };
            if !info.kind.is_persistent() {
                return Err(SimError::TraceMismatch(format!(
                    "host-resident tensor {t} `{}` is not persistent",
                    info.name
                )));
            }
            homed[t.index()] = true;
        }
        for (t, info) in trace.tensors().iter().enumerate() {
            if !info.kind.is_persistent() {
                continue;
            }
            if homed[t] {
                loc[t] = Loc::Host { done: 0.0 };
            } else {
                // Nothing is in flight yet: the allocation fits or fails at once.
                mem.alloc(info.bytes, 0.0, &mut loc)
                    .ok_or_else(|| over_budget(0, t, mem.used))?;
                loc[t] = Loc::Resident;
            }
        }

        let mut placement = plan
            .layout
            .as_ref()
            .map(|l| Placement::new(l, trace.num_tensors()));
        let mut now = 0.0f64;
        let mut h2d = Stream::default();
        let mut d2h = Stream::default();
        let mut compute_s = 0.0;
        let mut stall_data_s = 0.0;
        let mut transfers: Vec<TransferRecord> = Vec::new();
        let mut resident_bytes = Vec::with_capacity(n);
        let mut op_start_s = Vec::with_capacity(n);

        for op in 0..n {
            mem.op = op;
            // Copies issued before the op is launched.
            for &i in &at[2 * op] {
                let a = &plan.actions[i];
                let t = a.tensor().index();
                let bytes = a.bytes();
                let invalid = |message: String| invalid_action(i, a, message);
                mem.release_until(now, &mut loc);
                match a {
                    Action::Prefetch { .. } | Action::Fetch { .. } => {
                        let host_done = match loc[t] {
                            Loc::Host { done } | Loc::Offloading { done } => done,
                            other => {
                                return Err(invalid(format!(
                                    "the tensor is {}, not on the host",
                                    other.describe()
                                )))
                            }
                        };
                        let issue = now;
                        now = mem
                            .alloc(bytes, now, &mut loc)
                            .ok_or_else(|| over_budget(op, t, mem.used))?;
                        let free_at = place(&mut placement, t, now)?;
                        let (start, end) = h2d.copy(
                            now.max(host_done).max(free_at),
                            self.cost.h2d_time(bytes),
                            bytes,
                        );
                        let sync = matches!(a, Action::Fetch { .. });
                        transfers.push(record(i, a, Direction::ToDevice, sync, issue, start, end));
                        let record = transfers.len() - 1;
                        if sync {
                            transfers[record].wait_s = end - now;
                            stall_data_s += end - now;
                            now = end;
                            loc[t] = Loc::Resident;
                            transfers[record].used_by_op = Some(op);
                        } else {
                            loc[t] = Loc::Prefetching { done: end, record };
                        }
                    }
                    Action::Evict { .. } => {
                        require_resident(loc[t], i, a)?;
                        let (start, end) = d2h.copy(now, self.cost.d2h_time(bytes), bytes);
                        transfers.push(record(i, a, Direction::ToHost, true, now, start, end));
                        mem.stall_s += end - now;
                        now = end;
                        // Everything queued before it on the stream is done too.
                        mem.release_until(now, &mut loc);
                        mem.used -= bytes;
                        free(&mut placement, t, end);
                        loc[t] = Loc::Host { done: end };
                    }
                    Action::Offload { .. } => {
                        return Err(invalid("an offload placed before an op".into()));
                    }
                }
            }

            // Launch: allocate first uses, then wait for prefetched inputs.
            for &tid in trace.uses(op) {
                let t = tid.index();
                match loc[t] {
                    Loc::Unallocated => {
                        now = mem
                            .alloc(trace.tensors()[t].bytes, now, &mut loc)
                            .ok_or_else(|| over_budget(op, t, mem.used))?;
                        // memory an offload still reads: the op waits for it
                        let free_at = place(&mut placement, t, now)?;
                        if free_at > now {
                            mem.stall_s += free_at - now;
                            now = free_at;
                        }
                        loc[t] = Loc::Resident;
                    }
                    Loc::Resident | Loc::Prefetching { .. } => {}
                    other => {
                        return Err(SimError::NotResident {
                            op,
                            op_name: op_name(op),
                            tensor: tid,
                            tensor_name: tensor_name(t),
                            state: other.describe(),
                        })
                    }
                }
            }
            let ready = now;
            let mut start = now;
            for &tid in trace.uses(op) {
                let t = tid.index();
                if let Loc::Prefetching { done, record } = loc[t] {
                    let r = &mut transfers[record];
                    r.used_by_op = Some(op);
                    r.wait_s = (done - ready).max(0.0);
                    start = start.max(done);
                    loc[t] = Loc::Resident;
                }
            }
            stall_data_s += start - ready;
            // what completes from here on serves the next op's allocations
            mem.op = op + 1;
            mem.release_until(start, &mut loc);
            resident_bytes.push(mem.used);
            op_start_s.push(start);
            let d = self.cost.op_time(&trace.ops()[op]);
            compute_s += d;
            now = start + d;

            // Frees after the last use.
            for &tid in trace.uses(op) {
                let t = tid.index();
                if !trace.tensors()[t].kind.is_persistent() && last_use[t] == Some(op) {
                    if let Loc::Resident = loc[t] {
                        mem.used -= trace.tensors()[t].bytes;
                        free(&mut placement, t, now);
                        loc[t] = Loc::Freed;
                    }
                }
            }

            // Offloads issued after the op.
            for &i in &at[2 * op + 1] {
                let a = &plan.actions[i];
                let t = a.tensor().index();
                let bytes = a.bytes();
                require_resident(loc[t], i, a)?;
                let (start, end) = d2h.copy(now, self.cost.d2h_time(bytes), bytes);
                transfers.push(record(i, a, Direction::ToHost, false, now, start, end));
                loc[t] = Loc::Offloading { done: end };
                free(&mut placement, t, end);
                mem.pending.push_back((end, t, bytes, transfers.len() - 1));
            }
        }

        let total_s = now.max(h2d.free).max(d2h.free);
        let drain_s = total_s - now;
        mem.op = n;
        mem.release_until(f64::INFINITY, &mut loc);
        for &(record, op) in &mem.released {
            if let Some(r) = transfers.get_mut(record) {
                r.released_before_op = Some(op);
            }
        }

        let mut end_state_consistent = true;
        for (t, info) in trace.tensors().iter().enumerate() {
            let ok = match loc[t] {
                Loc::Host { .. } | Loc::Offloading { .. } => !info.kind.is_persistent() || homed[t],
                Loc::Resident => !info.kind.is_persistent() || !homed[t],
                Loc::Prefetching { .. } => false,
                Loc::Unallocated | Loc::Freed => !info.kind.is_persistent(),
            };
            end_state_consistent &= ok;
        }

        let to_device: Vec<&TransferRecord> = transfers
            .iter()
            .filter(|r| r.direction == Direction::ToDevice)
            .collect();
        let late_prefetches = to_device.iter().filter(|r| r.wait_s > 0.0).count();
        let out_of_order_prefetches = to_device
            .windows(2)
            .filter(|w| match (w[0].used_by_op, w[1].used_by_op) {
                (Some(a), Some(b)) => b < a,
                _ => false,
            })
            .count();
        let copies_to_device = to_device.len();
        let copies_to_host = transfers.len() - copies_to_device;
        Ok(SimReport {
            total_s,
            compute_s,
            stall_s: (total_s - compute_s).max(0.0),
            stall_data_s,
            stall_memory_s: mem.stall_s,
            drain_s,
            peak_bytes: mem.peak,
            budget_bytes: self.budget_bytes,
            bytes_to_host: d2h.bytes,
            bytes_to_device: h2d.bytes,
            copies_to_host,
            copies_to_device,
            resident_bytes,
            op_start_s,
            transfers,
            late_prefetches,
            out_of_order_prefetches,
            end_state_consistent,
        })
    }
}

fn brief(a: &Action) -> String {
    match a {
        Action::Offload {
            tensor, after_op, ..
        } => format!("offload {tensor} after op {after_op}"),
        Action::Prefetch {
            tensor,
            issue_before_op,
            needed_by_op,
            ..
        } => format!("prefetch {tensor} before op {issue_before_op}, needed by op {needed_by_op}"),
        Action::Evict {
            tensor, before_op, ..
        } => format!("evict {tensor} before op {before_op}"),
        Action::Fetch {
            tensor, before_op, ..
        } => format!("fetch {tensor} before op {before_op}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Policy;
    use crate::trace::{Phase, TensorKind, TraceBuilder};

    fn plan(actions: Vec<Action>, n: usize, budget: Option<u64>) -> SwapPlan {
        SwapPlan {
            policy: Policy::AutoVmEarliest,
            budget_bytes: budget,
            unplanned_peak_bytes: 0,
            num_ops: n,
            host_resident_at_start: vec![],
            actions,
            offloads: vec![],
            predicted: Prediction::default(),
            notes: vec![],
            layout: None,
        }
    }

    /// x: used by ops 0 and 3; y: 100 bytes written at 1, 2.
    fn trace() -> Trace {
        let mut b = TraceBuilder::new();
        let x = b.tensor("x", 100, TensorKind::Activation);
        let y = b.tensor("y", 100, TensorKind::Activation);
        let z = b.tensor("z", 50, TensorKind::Activation);
        b.timed_op("a", Phase::Forward, &[], &[x], 1.0);
        b.timed_op("b", Phase::Forward, &[], &[y], 1.0);
        b.timed_op("c", Phase::Forward, &[y], &[z], 1.0);
        b.timed_op("d", Phase::Backward, &[x, z], &[], 1.0);
        b.build().unwrap()
    }

    fn cost() -> CostModel {
        CostModel {
            h2d_bytes_per_s: 100.0,
            d2h_bytes_per_s: 100.0,
            latency_s: 0.0,
            default_op_time_s: 1.0,
        }
    }

    fn x_round_trip(issue: usize) -> Vec<Action> {
        vec![
            Action::Offload {
                tensor: TensorId(0),
                name: "x".into(),
                bytes: 100,
                after_op: 0,
            },
            Action::Prefetch {
                tensor: TensorId(0),
                name: "x".into(),
                bytes: 100,
                issue_before_op: issue,
                needed_by_op: 3,
            },
        ]
    }

    #[test]
    fn unplanned_replay_exceeds_a_budget_and_names_the_tensor() {
        let t = trace();
        let e = Simulator::new(cost(), Some(200))
            .run(&t, &plan(vec![], 4, Some(200)))
            .unwrap_err();
        match &e {
            SimError::BudgetExceeded {
                op, tensor, budget, ..
            } => assert_eq!((*op, *tensor, *budget), (2, TensorId(2), 200)),
            other => panic!("{other}"),
        }
        assert!(e.to_string().contains("`c`") && e.to_string().contains("`z`"));
    }

    #[test]
    fn offload_and_prefetch_fit_and_are_timed() {
        let t = trace();
        // Offloads take 2 s here.
        let slow = CostModel {
            d2h_bytes_per_s: 50.0,
            ..cost()
        };
        let r = Simulator::new(slow, Some(200))
            .run(&t, &plan(x_round_trip(3), 4, Some(200)))
            .unwrap();
        // The offload of x runs from t=1 to t=3 while b computes; c's output
        // only fits once it has completed (memory stall of 1 s), and d waits
        // for the prefetch issued at its own launch (data stall of 1 s).
        assert_eq!(r.op_start_s, vec![0.0, 1.0, 3.0, 5.0]);
        assert_eq!(r.peak_bytes, 200);
        assert_eq!((r.bytes_to_host, r.bytes_to_device), (100, 100));
        assert_eq!(r.stall_memory_s, 1.0);
        assert_eq!(r.stall_data_s, 1.0);
        assert_eq!(r.total_s, 6.0);
        assert_eq!(r.stall_s, 2.0);
        assert_eq!(r.late_prefetches, 1);
        assert!(r.end_state_consistent);
    }

    #[test]
    fn using_an_offloaded_tensor_is_an_error() {
        let t = trace();
        let mut actions = x_round_trip(3);
        actions.pop();
        let e = Simulator::new(cost(), None)
            .run(&t, &plan(actions, 4, None))
            .unwrap_err();
        assert!(matches!(e, SimError::NotResident { op: 3, .. }), "{e}");
    }

    #[test]
    fn prefetch_needs_the_tensor_on_the_host() {
        let t = trace();
        let actions = vec![x_round_trip(3).remove(1)];
        let e = Simulator::new(cost(), None)
            .run(&t, &plan(actions, 4, None))
            .unwrap_err();
        assert!(matches!(e, SimError::InvalidAction { .. }), "{e}");
    }
}
