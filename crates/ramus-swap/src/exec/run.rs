//! Running one iteration: [`Executor::run`] and its per-iteration state,
//! whose methods are the steps of the module docs' rules — the actions
//! around an op, pre-access, frees, reclaiming offloaded memory, making
//! room (waiting, evicting, defragmenting) and placing tensors by a layout.

use super::device::{ExecutorError, SwapDevice};
use super::{brief, ExecReport, Executor};
use crate::plan::Action;
use crate::trace::{TensorId, Trace};
use std::collections::{BTreeSet, VecDeque};

/// Where a tensor is, in the executor's accounting.
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

impl Executor<'_> {
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

    /// One op: the actions before it, pre-access, the op itself, frees and
    /// the actions after it. `#[inline]`: the body of [`Executor::run`]'s
    /// loop, compiled as part of it.
    #[inline]
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
                    return Err(ExecutorError::NotResident {
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

    fn action(&self, i: usize) -> Result<&Action, ExecutorError> {
        self.ex
            .plan
            .and_then(|p| p.actions.get(i))
            .ok_or_else(|| ExecutorError::Mismatch(format!("no plan action {i}")))
    }

    fn invalid(&self, i: usize, message: String) -> ExecutorError {
        let action = self
            .action(i)
            .map(|a| brief(a, self.trace()))
            .unwrap_or_default();
        ExecutorError::InvalidAction {
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
            return Err(ExecutorError::Mismatch("no layout to place tensors by".into()).into());
        };
        let name = self.name(t);
        let block = blocks_of[t]
            .get(self.next_block[t])
            .and_then(|&i| plan.layout.as_ref().and_then(|l| l.blocks.get(i)))
            .ok_or_else(|| {
                ExecutorError::Mismatch(format!(
                    "op {op}: the layout has no block for allocation {} of t{t} `{name}`",
                    self.next_block[t] + 1
                ))
            })?
            .clone();
        if block.from_op != op {
            return Err(ExecutorError::Mismatch(format!(
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
                return Err(ExecutorError::Mismatch(format!(
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
            return Err(ExecutorError::OutOfMemory {
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
