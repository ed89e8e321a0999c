//! The replay itself: one iteration walked op by op, each step a method of
//! [`Replay`] — copies issued before the op, its launch (allocations, waits
//! for prefetched inputs, compute), frees after its last uses, offloads
//! issued after it — and the report at the end.

use super::report::{Direction, SimReport, TransferRecord};
use crate::cost::CostModel;
use crate::error::SimError;
use crate::plan::{Action, Layout, SwapPlan};
use crate::trace::{TensorId, Trace};
use std::collections::VecDeque;

/// Where a tensor is during a replay.
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

/// Device memory during a replay: bytes in use against the budget, and
/// the offloads whose memory is released when their copies complete.
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

/// The arena of a plan's layout during a replay: where each tensor's
/// memory is, and from when what held it before is gone.
struct Arena<'p> {
    layout: &'p Layout,
    /// Per tensor, its blocks in allocation order, and the next one.
    blocks: Vec<Vec<usize>>,
    next: Vec<usize>,
    /// Ranges held: (start, end, tensor, free from; infinite while in use).
    held: Vec<(u64, u64, usize, f64)>,
}

impl<'p> Arena<'p> {
    fn new(layout: &'p Layout, tensors: usize) -> Arena<'p> {
        let mut blocks = vec![Vec::new(); tensors];
        for (i, b) in layout.blocks.iter().enumerate() {
            if let Some(v) = blocks.get_mut(b.tensor.index()) {
                v.push(i);
            }
        }
        Arena {
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

/// A copy's record before an op has used it; `span` is when it starts and
/// ends.
fn record(
    action: usize,
    a: &Action,
    direction: Direction,
    synchronous: bool,
    issue_s: f64,
    (start_s, end_s): (f64, f64),
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

/// Checks the plan's actions against the trace and buckets them by
/// position (`2 * op` before op, `2 * op + 1` after it), keeping plan order.
fn actions_by_position(trace: &Trace, plan: &SwapPlan) -> Result<Vec<Vec<usize>>, SimError> {
    let n = trace.num_ops();
    if plan.num_ops != n {
        return Err(SimError::TraceMismatch(format!(
            "the plan is for {} ops, the trace has {n}",
            plan.num_ops
        )));
    }
    let nt = trace.num_tensors();
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
                    trace.ops()[*needed_by_op].name
                )));
            }
        }
        at[pos].push(i);
    }
    Ok(at)
}

/// The persistent tensors the plan homes on the host between iterations,
/// as a flag per tensor.
fn homed_on_host(trace: &Trace, plan: &SwapPlan) -> Result<Vec<bool>, SimError> {
    let mut homed = vec![false; trace.num_tensors()];
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
    Ok(homed)
}

/// Replays one iteration of `trace` under `plan` on a device with this
/// cost model and budget.
pub(super) fn replay(
    cost: CostModel,
    budget_bytes: Option<u64>,
    trace: &Trace,
    plan: &SwapPlan,
) -> Result<SimReport, SimError> {
    let at = actions_by_position(trace, plan)?;
    Replay::new(cost, budget_bytes, trace, plan)?.run(&at)
}

/// One replay of a trace under a plan (see the [module docs](super)).
struct Replay<'a> {
    cost: CostModel,
    budget_bytes: Option<u64>,
    trace: &'a Trace,
    plan: &'a SwapPlan,
    last_use: Vec<Option<usize>>,
    /// Persistent tensors the plan homes on the host between iterations.
    homed: Vec<bool>,
    mem: Memory,
    loc: Vec<Loc>,
    /// The plan's arena, if it has a layout.
    arena: Option<Arena<'a>>,
    /// The compute stream's clock.
    now: f64,
    h2d: Stream,
    d2h: Stream,
    compute_s: f64,
    stall_data_s: f64,
    transfers: Vec<TransferRecord>,
    resident_bytes: Vec<u64>,
    op_start_s: Vec<f64>,
}

// The steps below are `#[inline]`: they are the body of one loop over the
// ops, and inlined they compile to what that loop was as one function.
impl<'a> Replay<'a> {
    /// Checks the plan against the trace and starts the iteration: every
    /// persistent tensor resident, or on the host where the plan homes it.
    fn new(
        cost: CostModel,
        budget_bytes: Option<u64>,
        trace: &'a Trace,
        plan: &'a SwapPlan,
    ) -> Result<Replay<'a>, SimError> {
        let homed = homed_on_host(trace, plan)?;
        let n = trace.num_ops();
        let mut replay = Replay {
            cost,
            budget_bytes,
            trace,
            plan,
            last_use: trace.last_uses(),
            homed,
            mem: Memory {
                used: 0,
                peak: 0,
                budget: budget_bytes.unwrap_or(u64::MAX),
                pending: VecDeque::new(),
                stall_s: 0.0,
                op: 0,
                released: Vec::new(),
            },
            loc: vec![Loc::Unallocated; trace.num_tensors()],
            arena: plan
                .layout
                .as_ref()
                .map(|l| Arena::new(l, trace.num_tensors())),
            now: 0.0,
            h2d: Stream::default(),
            d2h: Stream::default(),
            compute_s: 0.0,
            stall_data_s: 0.0,
            transfers: Vec::new(),
            resident_bytes: Vec::with_capacity(n),
            op_start_s: Vec::with_capacity(n),
        };
        for (t, info) in trace.tensors().iter().enumerate() {
            if !info.kind.is_persistent() {
                continue;
            }
            if replay.homed[t] {
                replay.loc[t] = Loc::Host { done: 0.0 };
            } else {
                // Nothing is in flight yet: the allocation fits or fails at once.
                if replay.mem.alloc(info.bytes, 0.0, &mut replay.loc).is_none() {
                    return Err(replay.over_budget(0, t));
                }
                replay.loc[t] = Loc::Resident;
            }
        }
        Ok(replay)
    }

    /// Replays every op, with the plan's action indices `at` by position
    /// (`2 * op` before the op, `2 * op + 1` after it), and reports.
    fn run(mut self, at: &[Vec<usize>]) -> Result<SimReport, SimError> {
        for op in 0..self.trace.num_ops() {
            self.op(op, &at[2 * op], &at[2 * op + 1])?;
        }
        Ok(self.finish())
    }

    /// The error for allocating tensor `t` at op `op` over the budget.
    fn over_budget(&self, op: usize, t: usize) -> SimError {
        let info = &self.trace.tensors()[t];
        SimError::BudgetExceeded {
            op,
            op_name: self.trace.ops()[op].name.clone(),
            tensor: TensorId(t as u32),
            tensor_name: info.name.clone(),
            bytes: info.bytes,
            resident: self.mem.used,
            budget: self.mem.budget,
        }
    }

    /// Allocates `bytes` for tensor `t` at op `op`, waiting for in-flight
    /// offloads if needed; moves the clock to when it fits.
    #[inline]
    fn alloc(&mut self, op: usize, t: usize, bytes: u64) -> Result<(), SimError> {
        match self.mem.alloc(bytes, self.now, &mut self.loc) {
            Some(now) => {
                self.now = now;
                Ok(())
            }
            None => Err(self.over_budget(op, t)),
        }
    }

    /// Places tensor `t`'s next block, if the plan has a layout; returns
    /// when its memory is free.
    #[inline]
    fn place(&mut self, t: usize) -> Result<f64, SimError> {
        match self.arena.as_mut() {
            Some(a) => a.place(t, self.now).map_err(SimError::TraceMismatch),
            None => Ok(self.now),
        }
    }

    /// Tensor `t`'s block is free from `at`, if the plan has a layout.
    #[inline]
    fn free(&mut self, t: usize, at: f64) {
        if let Some(a) = self.arena.as_mut() {
            a.free(t, at);
        }
    }

    /// One op: the copies issued `before` it, its launch and compute, the
    /// frees after its last uses and the offloads issued `after` it.
    #[inline]
    fn op(&mut self, op: usize, before: &[usize], after: &[usize]) -> Result<(), SimError> {
        self.mem.op = op;
        let plan = self.plan;
        for &i in before {
            let a = &plan.actions[i];
            self.mem.release_until(self.now, &mut self.loc);
            match a {
                Action::Prefetch { .. } | Action::Fetch { .. } => self.copy_in(op, i, a)?,
                Action::Evict { .. } => self.evict(i, a)?,
                Action::Offload { .. } => {
                    return Err(invalid_action(
                        i,
                        a,
                        "an offload placed before an op".into(),
                    ));
                }
            }
        }
        self.launch(op)?;
        self.free_after(op);
        for &i in after {
            self.offload(i, &plan.actions[i])?;
        }
        Ok(())
    }

    /// A prefetch or (synchronous) fetch issued before op `op`.
    #[inline]
    fn copy_in(&mut self, op: usize, i: usize, a: &Action) -> Result<(), SimError> {
        let t = a.tensor().index();
        let bytes = a.bytes();
        let host_done = match self.loc[t] {
            Loc::Host { done } | Loc::Offloading { done } => done,
            other => {
                return Err(invalid_action(
                    i,
                    a,
                    format!("the tensor is {}, not on the host", other.describe()),
                ))
            }
        };
        let issue = self.now;
        self.alloc(op, t, bytes)?;
        let free_at = self.place(t)?;
        let (start, end) = self.h2d.copy(
            self.now.max(host_done).max(free_at),
            self.cost.h2d_time(bytes),
            bytes,
        );
        let sync = matches!(a, Action::Fetch { .. });
        self.transfers
            .push(record(i, a, Direction::ToDevice, sync, issue, (start, end)));
        let record = self.transfers.len() - 1;
        if sync {
            self.transfers[record].wait_s = end - self.now;
            self.stall_data_s += end - self.now;
            self.now = end;
            self.loc[t] = Loc::Resident;
            self.transfers[record].used_by_op = Some(op);
        } else {
            self.loc[t] = Loc::Prefetching { done: end, record };
        }
        Ok(())
    }

    /// Queues action `i`'s copy of its (resident) tensor to the host at the
    /// compute stream's clock; returns when the copy ends.
    #[inline]
    fn copy_out(&mut self, i: usize, a: &Action, synchronous: bool) -> Result<f64, SimError> {
        let bytes = a.bytes();
        require_resident(self.loc[a.tensor().index()], i, a)?;
        let now = self.now;
        let (start, end) = self.d2h.copy(now, self.cost.d2h_time(bytes), bytes);
        self.transfers.push(record(
            i,
            a,
            Direction::ToHost,
            synchronous,
            now,
            (start, end),
        ));
        Ok(end)
    }

    /// A synchronous eviction: compute waits for the copy to the host.
    #[inline]
    fn evict(&mut self, i: usize, a: &Action) -> Result<(), SimError> {
        let t = a.tensor().index();
        let bytes = a.bytes();
        let end = self.copy_out(i, a, true)?;
        self.mem.stall_s += end - self.now;
        self.now = end;
        // Everything queued before it on the stream is done too.
        self.mem.release_until(self.now, &mut self.loc);
        self.mem.used -= bytes;
        self.free(t, end);
        self.loc[t] = Loc::Host { done: end };
        Ok(())
    }

    /// Launches op `op`: allocates first uses, waits for prefetched inputs,
    /// then computes.
    #[inline]
    fn launch(&mut self, op: usize) -> Result<(), SimError> {
        let trace = self.trace;
        for &tid in trace.uses(op) {
            let t = tid.index();
            match self.loc[t] {
                Loc::Unallocated => {
                    self.alloc(op, t, trace.tensors()[t].bytes)?;
                    // memory an offload still reads: the op waits for it
                    let free_at = self.place(t)?;
                    if free_at > self.now {
                        self.mem.stall_s += free_at - self.now;
                        self.now = free_at;
                    }
                    self.loc[t] = Loc::Resident;
                }
                Loc::Resident | Loc::Prefetching { .. } => {}
                other => {
                    return Err(SimError::NotResident {
                        op,
                        op_name: trace.ops()[op].name.clone(),
                        tensor: tid,
                        tensor_name: trace.tensors()[t].name.clone(),
                        state: other.describe(),
                    })
                }
            }
        }
        let ready = self.now;
        let mut start = ready;
        for &tid in trace.uses(op) {
            let t = tid.index();
            if let Loc::Prefetching { done, record } = self.loc[t] {
                let r = &mut self.transfers[record];
                r.used_by_op = Some(op);
                r.wait_s = (done - ready).max(0.0);
                start = start.max(done);
                self.loc[t] = Loc::Resident;
            }
        }
        self.stall_data_s += start - ready;
        // what completes from here on serves the next op's allocations
        self.mem.op = op + 1;
        self.mem.release_until(start, &mut self.loc);
        self.resident_bytes.push(self.mem.used);
        self.op_start_s.push(start);
        let d = self.cost.op_time(&trace.ops()[op]);
        self.compute_s += d;
        self.now = start + d;
        Ok(())
    }

    /// Frees the tensors op `op` used last.
    #[inline]
    fn free_after(&mut self, op: usize) {
        let trace = self.trace;
        for &tid in trace.uses(op) {
            let t = tid.index();
            let info = &trace.tensors()[t];
            if !info.kind.is_persistent() && self.last_use[t] == Some(op) {
                if let Loc::Resident = self.loc[t] {
                    self.mem.used -= info.bytes;
                    self.free(t, self.now);
                    self.loc[t] = Loc::Freed;
                }
            }
        }
    }

    /// An offload issued after the op: its memory is released when the
    /// copy completes.
    #[inline]
    fn offload(&mut self, i: usize, a: &Action) -> Result<(), SimError> {
        let t = a.tensor().index();
        let bytes = a.bytes();
        let end = self.copy_out(i, a, false)?;
        self.loc[t] = Loc::Offloading { done: end };
        self.free(t, end);
        self.mem
            .pending
            .push_back((end, t, bytes, self.transfers.len() - 1));
        Ok(())
    }

    /// Whether the iteration ends where it started (see
    /// [`SimReport::end_state_consistent`]).
    fn end_state_consistent(&self) -> bool {
        self.trace.tensors().iter().enumerate().all(|(t, info)| {
            let persistent = info.kind.is_persistent();
            match self.loc[t] {
                Loc::Host { .. } | Loc::Offloading { .. } => !persistent || self.homed[t],
                Loc::Resident => !persistent || !self.homed[t],
                Loc::Prefetching { .. } => false,
                Loc::Unallocated | Loc::Freed => !persistent,
            }
        })
    }

    /// Drains the copy streams and reports.
    fn finish(mut self) -> SimReport {
        let total_s = self.now.max(self.h2d.free).max(self.d2h.free);
        let drain_s = total_s - self.now;
        self.mem.op = self.trace.num_ops();
        self.mem.release_until(f64::INFINITY, &mut self.loc);
        for &(record, op) in &self.mem.released {
            if let Some(r) = self.transfers.get_mut(record) {
                r.released_before_op = Some(op);
            }
        }
        let end_state_consistent = self.end_state_consistent();
        let to_device: Vec<&TransferRecord> = self
            .transfers
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
        let copies_to_host = self.transfers.len() - copies_to_device;
        SimReport {
            total_s,
            compute_s: self.compute_s,
            stall_s: (total_s - self.compute_s).max(0.0),
            stall_data_s: self.stall_data_s,
            stall_memory_s: self.mem.stall_s,
            drain_s,
            peak_bytes: self.mem.peak,
            budget_bytes: self.budget_bytes,
            bytes_to_host: self.d2h.bytes,
            bytes_to_device: self.h2d.bytes,
            copies_to_host,
            copies_to_device,
            resident_bytes: self.resident_bytes,
            op_start_s: self.op_start_s,
            transfers: self.transfers,
            late_prefetches,
            out_of_order_prefetches,
            end_state_consistent,
        }
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
