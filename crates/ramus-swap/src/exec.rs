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
//!   Otherwise it fails with [`ExecError::OutOfMemory`] naming the op, the
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

use std::collections::{BTreeSet, VecDeque};

use crate::cost::human_bytes;
use crate::plan::{Action, SwapPlan};
use crate::trace::{TensorId, Trace};
use serde::{Deserialize, Serialize};

/// What the executor asks of a device. Implementations queue work
/// asynchronously where they can; the executor orders it.
pub trait SwapDevice {
    /// The device's error; executor errors convert into it.
    type Error: From<ExecError>;

    /// The device's own memory limit, for error messages (`None`: none).
    fn budget_bytes(&self) -> Option<u64> {
        None
    }

    /// Reserves `bytes` of device memory for `tensor`. `Ok(false)` when
    /// they do not fit now (the executor then makes room and asks again).
    fn allocate(&mut self, tensor: TensorId, bytes: u64) -> Result<bool, Self::Error>;

    /// Returns `tensor`'s device memory. The executor calls it once no
    /// device work issued later can conflict: after the tensor's last op
    /// was queued on the compute stream, or after its offload completed.
    fn release(&mut self, tensor: TensorId) -> Result<(), Self::Error>;

    /// Queues the copy of `tensor` to its host slot on the device→host
    /// stream, after everything queued on the compute stream so far.
    fn offload(&mut self, tensor: TensorId) -> Result<(), Self::Error>;

    /// Whether `tensor`'s last offload has completed, without blocking.
    fn offload_complete(&mut self, tensor: TensorId) -> Result<bool, Self::Error>;

    /// Blocks until `tensor`'s last offload has completed.
    fn wait_offload(&mut self, tensor: TensorId) -> Result<(), Self::Error>;

    /// Queues the copy of `tensor`'s host slot into its (just allocated)
    /// device memory on the host→device stream, after its offload and
    /// after everything queued on the compute stream so far (the memory
    /// may have been another tensor's).
    fn prefetch(&mut self, tensor: TensorId) -> Result<(), Self::Error>;

    /// Makes the compute stream wait for `tensor`'s prefetch (on the
    /// device; the host does not block).
    fn await_prefetch(&mut self, tensor: TensorId) -> Result<(), Self::Error>;

    /// Blocks until `tensor`'s prefetch has completed.
    fn wait_prefetch(&mut self, tensor: TensorId) -> Result<(), Self::Error>;

    /// Queues op `op` on the compute stream; every tensor it uses is
    /// allocated and every one it reads is on the device (or awaited).
    fn run_op(&mut self, op: usize) -> Result<(), Self::Error>;

    /// Layout mode (a plan with a [`Layout`](crate::Layout)): reserves the
    /// arena of `bytes` in which every tensor of the iteration is placed.
    /// A device that cannot place tensors refuses.
    fn reserve_arena(&mut self, bytes: u64) -> Result<(), Self::Error> {
        Err(ExecError::Mismatch(format!(
            "the plan places its tensors in an arena of {bytes} bytes; this device cannot \
             place tensors at offsets"
        ))
        .into())
    }

    /// Layout mode: gives `tensor` the `bytes` at `offset` of the arena.
    /// No tensor the executor holds there overlaps them; memory released
    /// while an offload still read it is ordered by
    /// [`SwapDevice::order_after_offload`].
    fn allocate_at(
        &mut self,
        tensor: TensorId,
        offset: u64,
        bytes: u64,
    ) -> Result<(), Self::Error> {
        let _ = (offset, bytes);
        Err(ExecError::Mismatch(format!(
            "tensor {tensor} placed at an offset on a device that cannot place tensors"
        ))
        .into())
    }

    /// Layout mode: releases `tensor`'s device memory while its offload
    /// may still be reading it (the executor orders every later write into
    /// that memory after the offload). By default the host waits for the
    /// offload and releases the memory then.
    fn release_offloading(&mut self, tensor: TensorId) -> Result<(), Self::Error> {
        self.wait_offload(tensor)?;
        self.release(tensor)
    }

    /// Layout mode: every write into `tensor`'s just placed memory — its
    /// prefetch, or the op that first writes it — must wait on the device
    /// for `previous`'s last offload, which may still read that memory
    /// ([`SwapDevice::release_offloading`] released it). By default
    /// nothing: the default `release_offloading` waited already.
    fn order_after_offload(
        &mut self,
        tensor: TensorId,
        previous: TensorId,
    ) -> Result<(), Self::Error> {
        let _ = (tensor, previous);
        Ok(())
    }

    /// Layout mode: returns the arena once the iteration's copies have
    /// completed and its tensors are released.
    fn release_arena(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// Why the executor cannot go on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExecError {
    /// An allocation that neither the budget nor the device can hold.
    #[error(
        "op {op} `{op_name}`: tensor {tensor} `{tensor_name}` ({bytes} bytes, {}) does not fit: \
         {resident} bytes ({}) are resident and the device memory budget is {}{}",
        human_bytes(*.bytes),
        human_bytes(*.resident),
        .budget.map_or("the device's memory".to_string(), |b| format!("{b} bytes ({})", human_bytes(b))),
        .hint
    )]
    OutOfMemory {
        /// Index of the op.
        op: usize,
        /// Name of the op.
        op_name: String,
        /// The tensor being allocated.
        tensor: TensorId,
        /// Its name.
        tensor_name: String,
        /// Its size.
        bytes: u64,
        /// Bytes resident (the executor's accounting).
        resident: u64,
        /// The budget, if one is known.
        budget: Option<u64>,
        /// What to do about it.
        hint: String,
    },
    /// An op uses a tensor that is not on the device and nothing brings it back.
    #[error(
        "op {op} `{op_name}` uses tensor {tensor} `{tensor_name}`, which is {state}: the plan \
         does not bring it back before the op"
    )]
    NotResident {
        /// Index of the op.
        op: usize,
        /// Name of the op.
        op_name: String,
        /// The tensor.
        tensor: TensorId,
        /// Its name.
        tensor_name: String,
        /// Where it is instead.
        state: String,
    },
    /// A plan action that cannot be carried out.
    #[error("plan action {index} ({action}): {message}")]
    InvalidAction {
        /// Index into the plan's actions.
        index: usize,
        /// The action, briefly.
        action: String,
        /// What is wrong.
        message: String,
    },
    /// The plan was made for another trace or asks for what this executor
    /// does not do.
    #[error("the swap plan does not fit this iteration: {0}")]
    Mismatch(String),
    /// A device found its orders inconsistent (the simulated device's
    /// checks), or failed.
    #[error("device{}: {message}", .op.map_or(String::new(), |op| format!(" at op {op}")))]
    Device {
        /// The op being prepared or run, if any.
        op: Option<usize>,
        /// What happened.
        message: String,
    },
}

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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Loc {
    Unallocated,
    Resident,
    /// Copy to the host in flight; device memory held until it completes.
    Offloading,
    /// On the host only.
    Host,
    /// Copy to the device in flight (memory allocated).
    Prefetching,
    Freed,
}

impl Loc {
    fn describe(self) -> &'static str {
        match self {
            Loc::Unallocated => "not yet allocated",
            Loc::Resident => "resident",
            Loc::Offloading => "being offloaded to the host",
            Loc::Host => "on the host",
            Loc::Prefetching => "being prefetched",
            Loc::Freed => "already freed (its last use is past)",
        }
    }
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

/// The per-iteration state of [`Executor::run`].
struct Run<'e, 't, D: SwapDevice> {
    ex: &'e Executor<'t>,
    dev: &'e mut D,
    loc: Vec<Loc>,
    used: u64,
    /// In-flight offloads in issue order.
    pending: VecDeque<usize>,
    /// Resident movable tensors by (last touch + 1, tensor).
    lru: BTreeSet<(usize, usize)>,
    touched: Vec<usize>,
    /// Tensors the executor evicted on its own under a plan.
    fallback: Vec<bool>,
    /// Naive swapping: the current op's pre-access cleared the op's own
    /// tensors off the device to defragment it (see `clear_op_tensors`);
    /// they are placed again, largest first.
    defragmented: bool,
    report: ExecReport,
    /// Layout mode: per tensor, its next block and the arena range it
    /// holds now.
    next_block: Vec<usize>,
    placed: Vec<Option<(u64, u64)>>,
    /// Layout mode: ranges released while an offload may still read them:
    /// (start, end, tensor).
    ghosts: Vec<(u64, u64, usize)>,
}

impl<'t> Executor<'t> {
    /// An executor for `trace`, following `plan` if given. Checks that the
    /// plan belongs to the trace and moves only movable tensors.
    pub fn new(
        trace: &'t Trace,
        plan: Option<&'t SwapPlan>,
        options: ExecOptions,
    ) -> Result<Executor<'t>, ExecError> {
        let n = trace.num_ops();
        let nt = trace.num_tensors();
        let movable = match &options.movable {
            Some(m) if m.len() != nt => {
                return Err(ExecError::Mismatch(format!(
                    "{} movable flags for {nt} tensors",
                    m.len()
                )))
            }
            Some(m) => m.clone(),
            None => trace
                .tensors()
                .iter()
                .map(|t| !t.kind.is_persistent())
                .collect(),
        };
        let last_use = trace.last_uses();
        let mut actions_at = vec![Vec::new(); 2 * n];
        if let Some(plan) = plan {
            if plan.num_ops != n {
                return Err(ExecError::Mismatch(format!(
                    "the plan is for {} ops, the iteration has {n}",
                    plan.num_ops
                )));
            }
            if let Some(&t) = plan.host_resident_at_start.first() {
                return Err(ExecError::Mismatch(format!(
                    "the plan starts with persistent tensor {t} `{}` on the host; this device \
                     keeps persistent tensors resident",
                    trace.get_tensor(t).map_or("?", |i| i.name.as_str())
                )));
            }
            for (i, a) in plan.actions.iter().enumerate() {
                let invalid = |message: String| ExecError::InvalidAction {
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
        }
        let blocks_of = match plan.and_then(|p| p.layout.as_ref().map(|l| (p, l))) {
            Some((plan, layout)) => {
                layout
                    .check(trace, plan)
                    .map_err(|e| ExecError::Mismatch(e.to_string()))?;
                let mut of = vec![Vec::new(); nt];
                for (i, b) in layout.blocks.iter().enumerate() {
                    of[b.tensor.index()].push(i);
                }
                Some(of)
            }
            None => None,
        };
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

    /// Runs one iteration on `device`. Persistent tensors must already be
    /// on it; everything else starts unallocated and ends freed (or on the
    /// host, where a plan leaves it there).
    pub fn run<D: SwapDevice>(&self, device: &mut D) -> Result<ExecReport, D::Error> {
        let trace = self.trace;
        let nt = trace.num_tensors();
        let mut run = Run {
            ex: self,
            dev: device,
            loc: vec![Loc::Unallocated; nt],
            used: 0,
            pending: VecDeque::new(),
            lru: BTreeSet::new(),
            touched: vec![0; nt],
            fallback: vec![false; nt],
            defragmented: false,
            report: ExecReport::default(),
            next_block: vec![0; nt],
            placed: vec![None; nt],
            ghosts: Vec::new(),
        };
        if let Some(layout) = self.plan.and_then(|p| p.layout.as_ref()) {
            run.dev.reserve_arena(layout.arena_bytes)?;
        }
        for (t, info) in trace.tensors().iter().enumerate() {
            if info.kind.is_persistent() {
                run.loc[t] = Loc::Resident;
                run.used += info.bytes;
                if self.movable[t] {
                    run.lru.insert((0, t));
                }
            }
        }
        run.report.peak_bytes = run.used;
        for op in 0..trace.num_ops() {
            run.op(op)?;
        }
        run.finish()?;
        Ok(run.report)
    }
}

impl<D: SwapDevice> Run<'_, '_, D> {
    fn trace(&self) -> &Trace {
        self.ex.trace
    }

    fn name(&self, t: usize) -> String {
        self.trace().tensors()[t].name.clone()
    }

    fn bytes(&self, t: usize) -> u64 {
        self.trace().tensors()[t].bytes
    }

    fn op(&mut self, op: usize) -> Result<(), D::Error> {
        let ex = self.ex;
        let trace = ex.trace;
        for &i in &ex.actions_at[2 * op] {
            self.before(op, i)?;
        }
        // Pre-access: allocate first uses, bring back what naive swapping
        // (or a fallback eviction) left on the host. Where naive swapping
        // meets a fragmented device it clears the op's own tensors off it
        // once (see `clear_op_tensors`), and a second pass places them
        // again, largest first.
        self.defragmented = false;
        self.pre_access(op)?;
        if self.defragmented {
            self.pre_access(op)?;
        }
        for &tid in trace.uses(op) {
            let t = tid.index();
            if self.loc[t] == Loc::Prefetching {
                self.dev.await_prefetch(tid)?;
                self.set_resident(t);
            }
        }
        self.dev.run_op(op)?;
        self.report.ops += 1;
        for &tid in trace.uses(op) {
            self.touch(tid.index(), op);
        }
        for &tid in trace.uses(op) {
            let t = tid.index();
            let persistent = trace.tensors()[t].kind.is_persistent();
            if !persistent && ex.last_use[t] == Some(op) && self.loc[t] == Loc::Resident {
                self.dev.release(tid)?;
                self.placed[t] = None;
                self.used -= self.bytes(t);
                self.lru.remove(&(self.touched[t], t));
                self.loc[t] = Loc::Freed;
            }
        }
        for &i in &ex.actions_at[2 * op + 1] {
            self.after(op, i)?;
        }
        Ok(())
    }

    /// One pre-access pass over op `op`'s tensors: in the trace's order, or
    /// largest first once the op's tensors were cleared to defragment.
    fn pre_access(&mut self, op: usize) -> Result<(), D::Error> {
        let ex = self.ex;
        let trace = ex.trace;
        // the trace's own list, copied only for the rare re-placement
        let largest_first;
        let uses: &[TensorId] = if self.defragmented {
            let mut sorted = trace.uses(op).to_vec();
            sorted.sort_by_key(|t| std::cmp::Reverse(trace.tensors()[t.index()].bytes));
            largest_first = sorted;
            &largest_first
        } else {
            trace.uses(op)
        };
        for &tid in uses {
            let t = tid.index();
            match self.loc[t] {
                Loc::Unallocated => {
                    self.make_room_and_allocate(op, t)?;
                    self.loc[t] = Loc::Resident;
                }
                Loc::Resident | Loc::Prefetching => {}
                Loc::Host | Loc::Offloading if ex.options.on_demand || self.fallback[t] => {
                    self.fetch_now(op, t)?;
                    if ex.options.on_demand {
                        self.report.sync_fetches += 1;
                    } else {
                        self.report.fallback_fetches += 1;
                    }
                }
                other => {
                    return Err(ExecError::NotResident {
                        op,
                        op_name: trace.ops()[op].name.clone(),
                        tensor: tid,
                        tensor_name: self.name(t),
                        state: other.describe().to_string(),
                    }
                    .into())
                }
            }
        }
        Ok(())
    }

    fn action(&self, i: usize) -> Result<&Action, ExecError> {
        self.ex
            .plan
            .and_then(|p| p.actions.get(i))
            .ok_or_else(|| ExecError::Mismatch(format!("no plan action {i}")))
    }

    fn invalid(&self, i: usize, message: String) -> ExecError {
        let action = self
            .action(i)
            .map(|a| brief(a, self.trace()))
            .unwrap_or_default();
        ExecError::InvalidAction {
            index: i,
            action,
            message,
        }
    }

    /// An action placed before op `op`.
    fn before(&mut self, op: usize, i: usize) -> Result<(), D::Error> {
        let a = self.action(i)?.clone();
        let tid = a.tensor();
        let t = tid.index();
        match a {
            // the executor moved the tensor on its own: it is back already
            Action::Prefetch { .. } | Action::Fetch { .. }
                if self.fallback[t] && matches!(self.loc[t], Loc::Resident | Loc::Prefetching) => {}
            Action::Evict { .. } if self.fallback[t] && self.loc[t] != Loc::Resident => {}
            Action::Prefetch { .. } | Action::Fetch { .. } => {
                if !matches!(self.loc[t], Loc::Host | Loc::Offloading) {
                    return Err(self
                        .invalid(
                            i,
                            format!("the tensor is {}, not on the host", self.loc[t].describe()),
                        )
                        .into());
                }
                if self.ex.blocks_of.is_some() && self.loc[t] == Loc::Offloading {
                    // its own offload may still read the old memory; the
                    // prefetch waits for that offload on the device
                    self.release_in_flight(t)?;
                } else {
                    self.settle_offload(t)?;
                }
                self.make_room_and_allocate(op, t)?;
                self.dev.prefetch(tid)?;
                self.count_to_device(t);
                if matches!(a, Action::Fetch { .. }) {
                    self.dev.wait_prefetch(tid)?;
                    self.set_resident(t);
                    self.touch(t, op);
                    self.report.sync_fetches += 1;
                } else {
                    self.loc[t] = Loc::Prefetching;
                    self.report.prefetches += 1;
                }
            }
            Action::Evict { .. } => {
                if self.loc[t] != Loc::Resident {
                    return Err(self
                        .invalid(
                            i,
                            format!("the tensor is {}, not resident", self.loc[t].describe()),
                        )
                        .into());
                }
                if self.ex.trace.uses(op).contains(&tid) {
                    return Err(self
                        .invalid(i, format!("op {op} itself uses the tensor"))
                        .into());
                }
                self.evict_now(t)?;
                self.report.sync_evictions += 1;
            }
            Action::Offload { .. } => {
                return Err(self
                    .invalid(i, "an offload placed before an op".into())
                    .into())
            }
        }
        Ok(())
    }

    /// An action placed after op `op`.
    fn after(&mut self, op: usize, i: usize) -> Result<(), D::Error> {
        let a = self.action(i)?.clone();
        let tid = a.tensor();
        let t = tid.index();
        let Action::Offload { .. } = a else {
            return Err(self
                .invalid(i, "only offloads are placed after an op".into())
                .into());
        };
        match self.loc[t] {
            Loc::Resident => {
                self.dev.offload(tid)?;
                self.count_to_host(t);
                self.lru.remove(&(self.touched[t], t));
                self.loc[t] = Loc::Offloading;
                self.pending.push_back(t);
                self.report.offloads += 1;
            }
            // evicted already on the executor's own initiative
            Loc::Host if self.fallback[t] => {}
            other => {
                return Err(self
                    .invalid(
                        i,
                        format!(
                            "after op {op} the tensor is {}, not resident",
                            other.describe()
                        ),
                    )
                    .into())
            }
        }
        Ok(())
    }

    fn set_resident(&mut self, t: usize) {
        self.loc[t] = Loc::Resident;
        if self.ex.movable[t] {
            self.lru.insert((self.touched[t], t));
        }
    }

    fn touch(&mut self, t: usize, op: usize) {
        if self.loc[t] == Loc::Resident && self.ex.movable[t] {
            self.lru.remove(&(self.touched[t], t));
            self.touched[t] = op + 1;
            self.lru.insert((op + 1, t));
        } else {
            self.touched[t] = op + 1;
        }
    }

    fn count_to_host(&mut self, t: usize) {
        self.report.bytes_to_host += self.bytes(t);
        self.report.copies_to_host += 1;
    }

    fn count_to_device(&mut self, t: usize) {
        self.report.bytes_to_device += self.bytes(t);
        self.report.copies_to_device += 1;
    }

    /// Releases the memory of offloads that have completed, in issue order.
    fn reclaim(&mut self) -> Result<(), D::Error> {
        while let Some(&t) = self.pending.front() {
            if !self.dev.offload_complete(TensorId(t as u32))? {
                break;
            }
            self.pending.pop_front();
            self.finish_offload(t)?;
        }
        let mut i = 0;
        while i < self.ghosts.len() {
            if self
                .dev
                .offload_complete(TensorId(self.ghosts[i].2 as u32))?
            {
                self.ghosts.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Layout mode: releases the memory of tensor `t`, whose offload may
    /// still be reading it; later writes into that range are ordered after
    /// the offload ([`SwapDevice::order_after_offload`]).
    fn release_in_flight(&mut self, t: usize) -> Result<(), D::Error> {
        self.pending.retain(|&p| p != t);
        self.dev.release_offloading(TensorId(t as u32))?;
        if let Some((start, end)) = self.placed[t].take() {
            self.ghosts.push((start, end, t));
        }
        self.used -= self.bytes(t);
        self.loc[t] = Loc::Host;
        Ok(())
    }

    /// Layout mode: places tensor `t` for op `op` at its next block of the
    /// layout, after releasing offloaded tensors whose memory it takes.
    fn place(&mut self, op: usize, t: usize) -> Result<(), D::Error> {
        let ex = self.ex;
        let (Some(plan), Some(blocks_of)) = (ex.plan, ex.blocks_of.as_ref()) else {
            return Err(ExecError::Mismatch("no layout to place tensors by".into()).into());
        };
        let name = self.name(t);
        let block = blocks_of[t]
            .get(self.next_block[t])
            .and_then(|&i| plan.layout.as_ref().and_then(|l| l.blocks.get(i)))
            .ok_or_else(|| {
                ExecError::Mismatch(format!(
                    "op {op}: the layout has no block for allocation {} of t{t} `{name}`",
                    self.next_block[t] + 1
                ))
            })?
            .clone();
        if block.from_op != op {
            return Err(ExecError::Mismatch(format!(
                "the layout allocates t{t} `{name}` before op {}, the iteration before op {op}",
                block.from_op
            ))
            .into());
        }
        self.next_block[t] += 1;
        self.reclaim()?;
        let (start, end) = (block.offset, block.end());
        let overlapping: Vec<usize> = (0..self.placed.len())
            .filter(|&u| self.placed[u].is_some_and(|(s, e)| s < end && start < e))
            .collect();
        for u in overlapping {
            if self.loc[u] != Loc::Offloading {
                return Err(ExecError::Mismatch(format!(
                    "op {op} `{}`: the layout places t{t} `{name}` at bytes {start}..{end} of the \
                     arena, over t{u} `{}`, which is {}",
                    self.trace().ops()[op].name,
                    self.name(u),
                    self.loc[u].describe()
                ))
                .into());
            }
            self.release_in_flight(u)?;
        }
        let tid = TensorId(t as u32);
        let ghosts: Vec<usize> = self
            .ghosts
            .iter()
            .filter(|&&(s, e, _)| s < end && start < e)
            .map(|&(_, _, u)| u)
            .collect();
        self.dev.allocate_at(tid, start, block.bytes)?;
        for u in ghosts {
            self.dev.order_after_offload(tid, TensorId(u as u32))?;
            self.report.reuses_after_offload += 1;
        }
        self.placed[t] = Some((start, end));
        self.used += block.bytes;
        self.report.peak_bytes = self.report.peak_bytes.max(self.used);
        Ok(())
    }

    fn finish_offload(&mut self, t: usize) -> Result<(), D::Error> {
        self.dev.release(TensorId(t as u32))?;
        self.placed[t] = None;
        self.used -= self.bytes(t);
        if self.loc[t] == Loc::Offloading {
            self.loc[t] = Loc::Host;
        }
        Ok(())
    }

    /// Synchronous eviction of a resident tensor.
    fn evict_now(&mut self, t: usize) -> Result<(), D::Error> {
        let tid = TensorId(t as u32);
        self.dev.offload(tid)?;
        self.count_to_host(t);
        self.dev.wait_offload(tid)?;
        self.lru.remove(&(self.touched[t], t));
        self.dev.release(tid)?;
        self.placed[t] = None;
        self.used -= self.bytes(t);
        self.loc[t] = Loc::Host;
        Ok(())
    }

    /// Waits for tensor `t`'s offload (and those issued before it, the
    /// stream being FIFO) and reclaims their memory, so that the tensor is
    /// on the host only and can be allocated again.
    fn settle_offload(&mut self, t: usize) -> Result<(), D::Error> {
        while self.loc[t] == Loc::Offloading {
            let Some(front) = self.pending.pop_front() else {
                break;
            };
            self.dev.wait_offload(TensorId(front as u32))?;
            self.report.offload_waits += 1;
            self.finish_offload(front)?;
        }
        Ok(())
    }

    /// Synchronous fetch of a tensor on the host for op `op`.
    fn fetch_now(&mut self, op: usize, t: usize) -> Result<(), D::Error> {
        let tid = TensorId(t as u32);
        self.settle_offload(t)?;
        self.make_room_and_allocate(op, t)?;
        self.dev.prefetch(tid)?;
        self.count_to_device(t);
        self.dev.wait_prefetch(tid)?;
        self.set_resident(t);
        self.touch(t, op);
        Ok(())
    }

    /// The least-recently-used movable resident tensor that op `op` does
    /// not use.
    fn victim(&self, op: usize, for_tensor: usize) -> Option<usize> {
        let uses = self.trace().uses(op);
        self.lru
            .iter()
            .map(|&(_, t)| t)
            .find(|&t| t != for_tensor && !uses.contains(&TensorId(t as u32)))
    }

    /// Naive swapping when the device refuses an allocation its budget
    /// allows (its free memory is fragmented) and every other resident
    /// movable tensor is one op `op` uses: clears the op's tensors but `t`
    /// off the device — inputs evicted to the host (fetched back before the
    /// op runs, as paging would), outputs allocated in this pre-access
    /// released (they hold nothing yet) — so that the pre-access can place
    /// them again, largest first.
    fn clear_op_tensors(&mut self, op: usize, t: usize) -> Result<(), D::Error> {
        self.defragmented = true;
        let trace = self.ex.trace;
        for &tid in trace.uses(op) {
            let u = tid.index();
            if u == t || self.loc[u] != Loc::Resident || !self.ex.movable[u] {
                continue;
            }
            if self.lru.contains(&(self.touched[u], u)) {
                self.evict_now(u)?;
                self.report.sync_evictions += 1;
            } else {
                self.dev.release(tid)?;
                self.placed[u] = None;
                self.used -= self.bytes(u);
                self.loc[u] = Loc::Unallocated;
            }
        }
        Ok(())
    }

    /// Allocates tensor `t` for op `op` (at or before it), making room first.
    fn make_room_and_allocate(&mut self, op: usize, t: usize) -> Result<(), D::Error> {
        if self.ex.blocks_of.is_some() {
            return self.place(op, t);
        }
        let bytes = self.bytes(t);
        let tid = TensorId(t as u32);
        let budget = self.ex.options.budget_bytes;
        loop {
            self.reclaim()?;
            let within = budget.is_none_or(|b| self.used + bytes <= b);
            if within && self.dev.allocate(tid, bytes)? {
                self.used += bytes;
                self.report.peak_bytes = self.report.peak_bytes.max(self.used);
                return Ok(());
            }
            if let Some(&oldest) = self.pending.front() {
                self.dev.wait_offload(TensorId(oldest as u32))?;
                self.report.offload_waits += 1;
                continue;
            }
            let opts = &self.ex.options;
            // a plan's own budget is binding; the device refusing what it
            // allows is what the fallback is for
            let may_evict = opts.on_demand || (opts.fallback && within);
            if may_evict {
                if let Some(v) = self.victim(op, t) {
                    self.evict_now(v)?;
                    if opts.on_demand {
                        self.report.sync_evictions += 1;
                    } else {
                        self.report.fallback_evictions += 1;
                        self.fallback[v] = true;
                    }
                    continue;
                }
                if opts.on_demand && within && !self.defragmented {
                    self.clear_op_tensors(op, t)?;
                    continue;
                }
            }
            let hint = if !within {
                if self.ex.plan.is_some() {
                    "; the plan does not free enough memory before this point".to_string()
                } else {
                    "; raise the budget, lower the batch size or enable swapping".to_string()
                }
            } else if may_evict {
                "; the device's free memory is too fragmented to hold the op's tensors \
                 together"
                    .to_string()
            } else {
                "; the device cannot hold it (raise the budget, lower the batch size or \
                 enable swapping)"
                    .to_string()
            };
            return Err(ExecError::OutOfMemory {
                op,
                op_name: self.trace().ops()[op].name.clone(),
                tensor: tid,
                tensor_name: self.name(t),
                bytes,
                resident: self.used,
                budget: if within {
                    self.dev.budget_bytes().or(budget)
                } else {
                    budget
                },
                hint,
            }
            .into());
        }
    }

    /// Drains in-flight copies at the end of the iteration.
    fn finish(&mut self) -> Result<(), D::Error> {
        while let Some(t) = self.pending.pop_front() {
            self.dev.wait_offload(TensorId(t as u32))?;
            self.finish_offload(t)?;
        }
        while let Some((_, _, t)) = self.ghosts.pop() {
            self.dev.wait_offload(TensorId(t as u32))?;
        }
        for t in 0..self.loc.len() {
            if self.loc[t] == Loc::Prefetching {
                let tid = TensorId(t as u32);
                self.dev.wait_prefetch(tid)?;
                self.dev.release(tid)?;
                self.placed[t] = None;
                self.used -= self.bytes(t);
                self.loc[t] = Loc::Freed;
                self.report.unused_prefetches += 1;
            } else if self.loc[t] == Loc::Resident
                && !self.trace().tensors()[t].kind.is_persistent()
            {
                // never used after its allocation: cannot happen for a
                // trace's tensors, which are freed after their last use
                self.dev.release(TensorId(t as u32))?;
                self.placed[t] = None;
                self.used -= self.bytes(t);
                self.loc[t] = Loc::Freed;
            }
        }
        if self.ex.blocks_of.is_some() {
            self.dev.release_arena()?;
        }
        Ok(())
    }
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
