//! A simulated device for the [`Executor`](crate::Executor): it enforces a
//! memory budget, counts transfers and bytes, and checks every order it is
//! given against what a real device with one compute stream and one copy
//! stream per direction would do with it.
//!
//! Each tensor's contents are modelled as a version number: an op that
//! writes a tensor makes a new version, copies carry versions between the
//! device memory and the host slot. Copies are asynchronous: one issued
//! before op `k` (or after op `k - 1`) completes once
//! [`SimDevice::latency_ops`] more ops have been queued, or when waited
//! for, and each copy stream completes in issue order. The device reports
//! [`ExecutorError::Device`] naming the op and the tensor when
//!
//! * an op reads a tensor with no device memory, whose memory holds no data
//!   or stale data (an older version than the last one written), or whose
//!   prefetch neither completed nor was awaited by the compute stream (a
//!   tensor whose first use is a read, never written before, is an input
//!   and holds data from then on);
//! * an op writes a tensor while its offload is still reading it, unless
//!   the compute stream is ordered after that offload (it awaited a
//!   prefetch of the tensor, which waits for the tensor's offload on the
//!   device; the await completes the offload, as the event wait would);
//! * memory is released while a copy still reads or writes it (an offload
//!   not yet complete: reuse before the copy's event);
//! * a tensor is offloaded without data, prefetched without a host copy, or
//!   allocated twice.
//!
//! Allocations over the budget are refused (`Ok(false)`), as a full device
//! would; persistent tensors are resident from the start and count against
//! the budget.
//!
//! [`SimDevice::with_pool`] models the CUDA pool under a budget instead of
//! counting bytes: one chunk of exactly the budget carved by the pool's own
//! [`OffsetAllocator`] (best fit), the persistent tensors and the fixed
//! overhead (index arrays, scratch memory) carved first. An allocation is
//! then refused when no single free range holds it, however many bytes are
//! free in all — the fragmentation the device meets.
//!
//! For a plan with a [`Layout`](crate::Layout) the device keeps an arena
//! (carved from the pool model's chunk, or counted against the budget) and
//! checks every block it places: inside the arena, never over a tensor that still
//! holds memory, and — where the range was released while an offload still
//! read it ([`SwapDevice::release_offloading`]) — every write into it
//! ordered after that offload ([`SwapDevice::order_after_offload`]); such
//! an ordered write completes the offload first, as the stream's wait on
//! its event would.

use std::collections::VecDeque;

use crate::exec::{ExecutorError, SwapDevice};
use crate::offset_allocator::OffsetAllocator;
use crate::trace::{TensorId, Trace};
use serde::{Deserialize, Serialize};

/// What the simulated device counted.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SimDeviceCounts {
    /// Ops run.
    pub ops: usize,
    /// Bytes copied device → host.
    pub bytes_to_host: u64,
    /// Bytes copied host → device.
    pub bytes_to_device: u64,
    /// Copies device → host.
    pub copies_to_host: usize,
    /// Copies host → device.
    pub copies_to_device: usize,
    /// Allocations refused for the budget.
    pub refused_allocations: usize,
    /// Of those, refused although enough bytes were free in all (the pool
    /// model's fragmentation).
    pub fragmented_refusals: usize,
    /// Host waits for a copy that had not completed by itself yet.
    pub blocking_waits: usize,
    /// Device-side waits: a write into reused memory that waited for an
    /// offload still reading it, or the compute stream awaiting a prefetch
    /// that waited for the tensor's own offload (layout mode).
    #[serde(default)]
    pub device_waits: usize,
    /// The most device memory in use at once (a layout's arena counts
    /// whole, with the persistent tensors and the fixed overhead).
    pub peak_bytes: u64,
    /// Device memory in use now.
    pub used_bytes: u64,
}

/// One copy between host and device, in flight or complete (the
/// simulator's word for it: a transfer).
#[derive(Clone, Copy, Debug)]
struct Transfer {
    version: u64,
    /// Completes once this many ops have been queued.
    done_at: usize,
    complete: bool,
    /// For a prefetch: the compute stream waits for it.
    awaited: bool,
    /// For a prefetch: issued while the tensor's own offload (into the
    /// slot it copies from) was in flight, so it waits for that offload on
    /// the device, and so does whatever waits for the prefetch.
    after_offload: bool,
}

#[derive(Clone, Debug, Default)]
struct SimTensor {
    allocated: bool,
    /// Version held in device memory (`None`: uninitialised).
    data: Option<u64>,
    /// Version held in the host slot.
    host: Option<u64>,
    offload: Option<Transfer>,
    prefetch: Option<Transfer>,
    /// Layout mode: tensors whose offload may still read this tensor's
    /// memory, not yet ordered before its writes / ordered before them.
    unordered: Vec<usize>,
    ordered: Vec<usize>,
}

/// The simulated device; see the module docs.
#[derive(Clone, Debug)]
pub struct SimDevice<'t> {
    trace: &'t Trace,
    budget: Option<u64>,
    latency_ops: usize,
    tensors: Vec<SimTensor>,
    /// The last version written, per tensor.
    latest: Vec<u64>,
    /// Whether the tensor ever held data (a tensor first read, never
    /// written, is an input: its first read gives it data).
    initialised: Vec<bool>,
    /// In-flight offloads and prefetches, in issue order.
    d2h: VecDeque<usize>,
    h2d: VecDeque<usize>,
    counts: SimDeviceCounts,
    /// Ops run so far, over all iterations (the clock of the copies).
    now: usize,
    /// The next op of the current iteration.
    next_op: usize,
    /// The pool model: the chunk's allocator and each tensor's offset.
    pool: Option<Pool>,
    /// Layout mode: the arena.
    arena: Option<Arena>,
}

/// The arena of a plan's layout.
#[derive(Clone, Debug)]
struct Arena {
    bytes: u64,
    /// Its offset in the pool model's chunk.
    base: Option<u64>,
    /// Per tensor, the range it holds.
    range: Vec<Option<(u64, u64)>>,
    /// Ranges released while their offload was in flight: (start, end,
    /// tensor).
    ghosts: Vec<(u64, u64, usize)>,
}

/// The CUDA pool under a budget: one chunk carved by best fit.
#[derive(Clone, Debug)]
struct Pool {
    chunk: OffsetAllocator,
    offset: Vec<Option<u64>>,
}

impl<'t> SimDevice<'t> {
    /// A device for `trace` holding at most `budget` bytes (`None`:
    /// unlimited), with its persistent tensors resident and valid; copies
    /// complete one op after they are issued.
    pub fn new(trace: &'t Trace, budget: Option<u64>) -> SimDevice<'t> {
        let mut tensors = vec![SimTensor::default(); trace.num_tensors()];
        let mut used = 0;
        for (t, info) in trace.tensors().iter().enumerate() {
            if info.kind.is_persistent() {
                tensors[t].allocated = true;
                tensors[t].data = Some(0);
                used += info.bytes;
            }
        }
        SimDevice {
            trace,
            budget,
            latency_ops: 1,
            tensors,
            latest: vec![0; trace.num_tensors()],
            initialised: trace
                .tensors()
                .iter()
                .map(|t| t.kind.is_persistent())
                .collect(),
            d2h: VecDeque::new(),
            h2d: VecDeque::new(),
            counts: SimDeviceCounts {
                peak_bytes: used,
                used_bytes: used,
                ..SimDeviceCounts::default()
            },
            now: 0,
            next_op: 0,
            pool: None,
            arena: None,
        }
    }

    /// A device like [`SimDevice::new`] whose memory is modelled as the CUDA
    /// pool's under a budget: one chunk of `budget` bytes, carved by best
    /// fit, holding the persistent tensors (in trace order) and
    /// `fixed_bytes` of other memory from the start. Allocations are
    /// refused when no free range of the chunk holds them.
    pub fn with_pool(
        trace: &'t Trace,
        budget: u64,
        fixed_bytes: u64,
    ) -> Result<SimDevice<'t>, ExecutorError> {
        let mut dev = SimDevice::new(trace, Some(budget));
        let mut chunk = OffsetAllocator::new(budget);
        let mut offset = vec![None; trace.num_tensors()];
        for (t, info) in trace.tensors().iter().enumerate() {
            if info.kind.is_persistent() {
                let block = chunk
                    .alloc(info.bytes)
                    .ok_or_else(|| ExecutorError::Device {
                        op: None,
                        message: format!(
                            "the persistent tensors do not fit a pool of {budget} bytes \
                         (t{t} `{}`)",
                            info.name
                        ),
                    })?;
                offset[t] = Some(block.offset);
            }
        }
        if fixed_bytes > 0 && chunk.alloc(fixed_bytes).is_none() {
            return Err(ExecutorError::Device {
                op: None,
                message: format!(
                    "{fixed_bytes} bytes of fixed overhead do not fit a pool of {budget} bytes \
                     after the persistent tensors"
                ),
            });
        }
        // bytes as the trace counts them (the chunk's are rounded up)
        dev.counts.used_bytes += fixed_bytes;
        dev.counts.peak_bytes = dev.counts.used_bytes;
        dev.pool = Some(Pool { chunk, offset });
        Ok(dev)
    }

    /// Starts another iteration of the trace on the same device: the
    /// persistent tensors' contents carry over, every other tensor starts
    /// anew, and every copy of the last iteration must have completed.
    pub fn start_iteration(&mut self) -> Result<(), ExecutorError> {
        self.advance();
        if let Some(&t) = self.d2h.front().or(self.h2d.front()) {
            return Err(self.violation(format!(
                "a copy of {} is still in flight at the end of the iteration",
                self.label(t)
            )));
        }
        for (t, info) in self.trace.tensors().iter().enumerate() {
            if !info.kind.is_persistent() {
                self.initialised[t] = false;
            }
        }
        self.next_op = 0;
        Ok(())
    }

    /// The same device with copies completing `ops` ops after they are
    /// issued (0: at once).
    pub fn with_latency(mut self, ops: usize) -> SimDevice<'t> {
        self.latency_ops = ops;
        self
    }

    /// Ops after which a copy completes by itself.
    pub fn latency_ops(&self) -> usize {
        self.latency_ops
    }

    /// What the device counted so far.
    pub fn counts(&self) -> &SimDeviceCounts {
        &self.counts
    }

    /// Whether `tensor` holds device memory now.
    pub fn is_allocated(&self, tensor: TensorId) -> bool {
        self.tensors
            .get(tensor.index())
            .is_some_and(|t| t.allocated)
    }

    fn violation(&self, message: String) -> ExecutorError {
        ExecutorError::Device {
            op: Some(self.next_op),
            message,
        }
    }

    fn label(&self, t: usize) -> String {
        match self.trace.tensors().get(t) {
            Some(info) => format!("t{t} `{}`", info.name),
            None => format!("t{t}"),
        }
    }

    fn tensor(&self, tensor: TensorId) -> Result<usize, ExecutorError> {
        let t = tensor.index();
        if t >= self.tensors.len() {
            return Err(self.violation(format!(
                "tensor {tensor} does not exist (the trace has {})",
                self.tensors.len()
            )));
        }
        Ok(t)
    }

    /// Completes copies that are due by now, in stream order.
    fn advance(&mut self) {
        let now = self.now;
        while let Some(&t) = self.d2h.front() {
            match self.tensors[t].offload {
                Some(c) if c.done_at <= now => self.complete_offload(t),
                _ => break,
            }
        }
        while let Some(&t) = self.h2d.front() {
            match self.tensors[t].prefetch {
                Some(c) if c.done_at <= now => self.complete_prefetch(t),
                _ => break,
            }
        }
    }

    fn complete_offload(&mut self, t: usize) {
        if self.d2h.front() == Some(&t) {
            self.d2h.pop_front();
        }
        if let Some(c) = self.tensors[t].offload.as_mut() {
            c.complete = true;
            self.tensors[t].host = Some(c.version);
        }
        if let Some(arena) = self.arena.as_mut() {
            arena.ghosts.retain(|&(_, _, u)| u != t);
        }
    }

    /// Completes the d2h stream up to `t`'s offload (a wait on its event).
    fn complete_offloads_through(&mut self, t: usize) {
        while self.offload_in_flight(t) {
            let Some(&front) = self.d2h.front() else {
                break;
            };
            self.complete_offload(front);
        }
    }

    /// Layout mode, before anything writes `t`'s memory: every offload
    /// still reading it must be ordered before the write (which then waits
    /// for it).
    fn order_write(&mut self, t: usize, what: &str) -> Result<(), ExecutorError> {
        let unordered = std::mem::take(&mut self.tensors[t].unordered);
        if let Some(&u) = unordered.iter().find(|&&u| self.offload_in_flight(u)) {
            return Err(self.violation(format!(
                "{what} writes {}, whose memory the offload of {} still reads, without waiting \
                 for it",
                self.label(t),
                self.label(u)
            )));
        }
        for u in std::mem::take(&mut self.tensors[t].ordered) {
            if self.offload_in_flight(u) {
                self.counts.device_waits += 1;
                self.complete_offloads_through(u);
            }
        }
        Ok(())
    }

    fn complete_prefetch(&mut self, t: usize) {
        // a prefetch ordered after the tensor's offload completes after it
        if self.tensors[t].prefetch.is_some_and(|c| c.after_offload) {
            self.complete_offloads_through(t);
        }
        if self.h2d.front() == Some(&t) {
            self.h2d.pop_front();
        }
        if let Some(c) = self.tensors[t].prefetch.as_mut() {
            c.complete = true;
        }
    }

    fn offload_in_flight(&self, t: usize) -> bool {
        self.tensors[t].offload.is_some_and(|c| !c.complete)
    }

    /// Whether the compute stream may read what `t`'s device memory holds.
    fn prefetch_pending(&self, t: usize) -> bool {
        self.tensors[t]
            .prefetch
            .is_some_and(|c| !c.complete && !c.awaited)
    }
}

impl SwapDevice for SimDevice<'_> {
    type Error = ExecutorError;

    fn budget_bytes(&self) -> Option<u64> {
        self.budget
    }

    fn allocate(&mut self, tensor: TensorId, bytes: u64) -> Result<bool, ExecutorError> {
        let t = self.tensor(tensor)?;
        self.advance();
        if self.tensors[t].allocated {
            return Err(self.violation(format!("{} allocated twice", self.label(t))));
        }
        let expected = self.trace.tensors()[t].bytes;
        if bytes != expected {
            return Err(self.violation(format!(
                "{} allocated with {bytes} bytes; it has {expected}",
                self.label(t)
            )));
        }
        match self.pool.as_mut() {
            Some(pool) => match pool.chunk.alloc(bytes) {
                Some(block) => pool.offset[t] = Some(block.offset),
                None => {
                    self.counts.refused_allocations += 1;
                    if pool.chunk.free_bytes() >= bytes {
                        self.counts.fragmented_refusals += 1;
                    }
                    return Ok(false);
                }
            },
            None if self
                .budget
                .is_some_and(|b| self.counts.used_bytes + bytes > b) =>
            {
                self.counts.refused_allocations += 1;
                return Ok(false);
            }
            None => {}
        }
        let st = &mut self.tensors[t];
        st.allocated = true;
        st.data = None;
        st.prefetch = None;
        self.counts.used_bytes += bytes;
        self.counts.peak_bytes = self.counts.peak_bytes.max(self.counts.used_bytes);
        Ok(true)
    }

    fn release(&mut self, tensor: TensorId) -> Result<(), ExecutorError> {
        let t = self.tensor(tensor)?;
        self.advance();
        if !self.tensors[t].allocated {
            return Err(self.violation(format!("{} released without device memory", self.label(t))));
        }
        if self.offload_in_flight(t) {
            return Err(self.violation(format!(
                "the device memory of {} is released before its offload completed",
                self.label(t)
            )));
        }
        if self.prefetch_pending(t) {
            return Err(self.violation(format!(
                "the device memory of {} is released while its prefetch writes it",
                self.label(t)
            )));
        }
        if self.trace.tensors()[t].kind.is_persistent() {
            return Err(self.violation(format!("persistent tensor {} released", self.label(t))));
        }
        let label = self.label(t);
        if let Some(arena) = self.arena.as_mut() {
            if arena.range[t].take().is_some() {
                let st = &mut self.tensors[t];
                st.allocated = false;
                st.data = None;
                st.prefetch = None;
                return Ok(());
            }
        }
        if let Some(pool) = self.pool.as_mut() {
            let freed = pool.offset[t]
                .take()
                .ok_or_else(|| format!("{label} has no block in the pool"))
                .and_then(|at| pool.chunk.free(at).map_err(|e| format!("{label}: {e}")));
            if let Err(message) = freed {
                return Err(self.violation(message));
            }
        }
        let st = &mut self.tensors[t];
        st.allocated = false;
        st.data = None;
        st.prefetch = None;
        self.counts.used_bytes -= self.trace.tensors()[t].bytes;
        Ok(())
    }

    fn offload(&mut self, tensor: TensorId) -> Result<(), ExecutorError> {
        let t = self.tensor(tensor)?;
        self.advance();
        let Some(version) = self.tensors[t].data.filter(|_| self.tensors[t].allocated) else {
            return Err(self.violation(format!(
                "{} offloaded, but its device memory holds no data",
                self.label(t)
            )));
        };
        if self.prefetch_pending(t) {
            return Err(self.violation(format!(
                "{} offloaded while its prefetch is still in flight",
                self.label(t)
            )));
        }
        if self.offload_in_flight(t) {
            return Err(self.violation(format!("{} offloaded twice at once", self.label(t))));
        }
        self.tensors[t].offload = Some(Transfer {
            version,
            done_at: self.now + self.latency_ops,
            complete: false,
            awaited: false,
            after_offload: false,
        });
        self.d2h.push_back(t);
        self.counts.copies_to_host += 1;
        self.counts.bytes_to_host += self.trace.tensors()[t].bytes;
        if self.latency_ops == 0 {
            self.advance();
        }
        Ok(())
    }

    fn offload_complete(&mut self, tensor: TensorId) -> Result<bool, ExecutorError> {
        let t = self.tensor(tensor)?;
        self.advance();
        match self.tensors[t].offload {
            Some(c) => Ok(c.complete),
            None => Err(self.violation(format!(
                "completion of an offload of {} asked, but none was issued",
                self.label(t)
            ))),
        }
    }

    fn wait_offload(&mut self, tensor: TensorId) -> Result<(), ExecutorError> {
        let t = self.tensor(tensor)?;
        self.advance();
        if self.tensors[t].offload.is_none() {
            return Err(self.violation(format!(
                "waiting for an offload of {}, but none was issued",
                self.label(t)
            )));
        }
        if self.offload_in_flight(t) {
            self.counts.blocking_waits += 1;
        }
        // the stream is FIFO: everything issued before completes first
        while self.offload_in_flight(t) {
            let Some(&front) = self.d2h.front() else {
                break;
            };
            self.complete_offload(front);
        }
        Ok(())
    }

    fn prefetch(&mut self, tensor: TensorId) -> Result<(), ExecutorError> {
        let t = self.tensor(tensor)?;
        self.advance();
        if !self.tensors[t].allocated {
            return Err(self.violation(format!(
                "{} prefetched into no device memory",
                self.label(t)
            )));
        }
        self.order_write(t, "its prefetch")?;
        // ordered after the tensor's own offload on the device
        let source = match self.tensors[t].offload {
            Some(c) => Some(c.version),
            None => self.tensors[t].host,
        };
        let Some(version) = source else {
            return Err(self.violation(format!(
                "{} prefetched, but it has no host copy",
                self.label(t)
            )));
        };
        if self.latest[t] != version {
            return Err(self.violation(format!(
                "{} prefetched from a stale host copy (version {version}, latest {})",
                self.label(t),
                self.latest[t]
            )));
        }
        // the copy starts once that offload completed
        let after_offload = self.offload_in_flight(t);
        let offloaded_at = match self.tensors[t].offload {
            Some(c) if after_offload => c.done_at,
            _ => 0,
        };
        let done_at = (self.now + self.latency_ops).max(offloaded_at);
        let st = &mut self.tensors[t];
        st.data = Some(version);
        st.prefetch = Some(Transfer {
            version,
            done_at,
            complete: false,
            awaited: false,
            after_offload,
        });
        self.h2d.push_back(t);
        self.counts.copies_to_device += 1;
        self.counts.bytes_to_device += self.trace.tensors()[t].bytes;
        if self.latency_ops == 0 {
            self.advance();
        }
        Ok(())
    }

    fn await_prefetch(&mut self, tensor: TensorId) -> Result<(), ExecutorError> {
        let t = self.tensor(tensor)?;
        match self.tensors[t].prefetch.as_mut() {
            Some(c) => {
                c.awaited = true;
                // the compute stream waits for the prefetch, which waits for
                // the tensor's offload: later ops (a write of the tensor
                // among them) follow that offload, as a stream's wait on the
                // prefetch's event would order them
                if std::mem::take(&mut c.after_offload) && self.offload_in_flight(t) {
                    self.counts.device_waits += 1;
                    self.complete_offloads_through(t);
                }
                Ok(())
            }
            None => Err(self.violation(format!(
                "the compute stream awaits a prefetch of {}, but none was issued",
                self.label(t)
            ))),
        }
    }

    fn wait_prefetch(&mut self, tensor: TensorId) -> Result<(), ExecutorError> {
        let t = self.tensor(tensor)?;
        self.advance();
        if self.tensors[t].prefetch.is_none() {
            return Err(self.violation(format!(
                "waiting for a prefetch of {}, but none was issued",
                self.label(t)
            )));
        }
        if self.tensors[t].prefetch.is_some_and(|c| !c.complete) {
            self.counts.blocking_waits += 1;
        }
        while self.tensors[t].prefetch.is_some_and(|c| !c.complete) {
            let Some(&front) = self.h2d.front() else {
                break;
            };
            self.complete_prefetch(front);
        }
        Ok(())
    }

    fn run_op(&mut self, op: usize) -> Result<(), ExecutorError> {
        self.advance();
        if op != self.next_op {
            return Err(self.violation(format!(
                "op {op} run out of order (op {} is next)",
                self.next_op
            )));
        }
        let Some(info) = self.trace.ops().get(op) else {
            return Err(self.violation(format!("op {op} is not in the trace")));
        };
        let name = &info.name;
        for &tid in &info.reads {
            let t = tid.index();
            let st = &self.tensors[t];
            if !st.allocated {
                return Err(self.violation(format!(
                    "op `{name}` reads {}, which has no device memory",
                    self.label(t)
                )));
            }
            if self.prefetch_pending(t) {
                return Err(self.violation(format!(
                    "op `{name}` reads {} before its prefetch completed",
                    self.label(t)
                )));
            }
            match st.data {
                Some(v) if v == self.latest[t] => {}
                Some(v) => {
                    return Err(self.violation(format!(
                        "op `{name}` reads stale data of {} (version {v}, latest {})",
                        self.label(t),
                        self.latest[t]
                    )))
                }
                // the tensor's first appearance is a read: an input
                None if !self.initialised[t] => {}
                None => {
                    return Err(self.violation(format!(
                        "op `{name}` reads {}, whose device memory holds no data",
                        self.label(t)
                    )))
                }
            }
        }
        for &tid in &info.writes {
            let t = tid.index();
            if self.tensors[t].allocated {
                self.order_write(t, &format!("op `{name}`"))?;
            }
            if !self.tensors[t].allocated {
                return Err(self.violation(format!(
                    "op `{name}` writes {}, which has no device memory",
                    self.label(t)
                )));
            }
            if self.offload_in_flight(t) {
                return Err(self.violation(format!(
                    "op `{name}` writes {} while its offload reads it",
                    self.label(t)
                )));
            }
            if self.prefetch_pending(t) {
                return Err(self.violation(format!(
                    "op `{name}` writes {} while its prefetch writes it",
                    self.label(t)
                )));
            }
        }
        for &tid in &info.reads {
            let t = tid.index();
            if !self.initialised[t] {
                self.initialised[t] = true;
                self.tensors[t].data = Some(self.latest[t]);
            }
        }
        let mut written: Vec<usize> = info.writes.iter().map(|t| t.index()).collect();
        written.sort_unstable();
        written.dedup();
        for t in written {
            self.initialised[t] = true;
            self.latest[t] += 1;
            self.tensors[t].data = Some(self.latest[t]);
        }
        self.counts.ops += 1;
        self.now += 1;
        self.next_op += 1;
        Ok(())
    }

    fn reserve_arena(&mut self, bytes: u64) -> Result<(), ExecutorError> {
        if self.arena.is_some() {
            return Err(self.violation("an arena reserved twice".into()));
        }
        let base = match self.pool.as_mut() {
            Some(pool) => match pool.chunk.alloc(bytes) {
                Some(block) => Some(block.offset),
                None => {
                    return Err(ExecutorError::Device {
                        op: None,
                        message: format!(
                            "the arena of {bytes} bytes does not fit the pool ({} of {} bytes \
                             free, at most {} in one range)",
                            pool.chunk.free_bytes(),
                            pool.chunk.capacity(),
                            pool.chunk.largest_free_block()
                        ),
                    })
                }
            },
            None if self
                .budget
                .is_some_and(|b| self.counts.used_bytes + bytes > b) =>
            {
                return Err(ExecutorError::Device {
                    op: None,
                    message: format!(
                        "the arena of {bytes} bytes and the {} bytes in use exceed the budget \
                         of {} bytes",
                        self.counts.used_bytes,
                        self.budget.unwrap_or(0)
                    ),
                })
            }
            None => None,
        };
        self.arena = Some(Arena {
            bytes,
            base,
            range: vec![None; self.tensors.len()],
            ghosts: Vec::new(),
        });
        self.counts.used_bytes += bytes;
        self.counts.peak_bytes = self.counts.peak_bytes.max(self.counts.used_bytes);
        Ok(())
    }

    fn allocate_at(
        &mut self,
        tensor: TensorId,
        offset: u64,
        bytes: u64,
    ) -> Result<(), ExecutorError> {
        let t = self.tensor(tensor)?;
        self.advance();
        if self.tensors[t].allocated {
            return Err(self.violation(format!("{} allocated twice", self.label(t))));
        }
        let expected = self.trace.tensors()[t].bytes;
        if bytes != expected {
            return Err(self.violation(format!(
                "{} placed with {bytes} bytes; it has {expected}",
                self.label(t)
            )));
        }
        let Some(arena) = self.arena.as_ref() else {
            return Err(self.violation(format!(
                "{} placed at offset {offset} with no arena reserved",
                self.label(t)
            )));
        };
        let end = offset.saturating_add(bytes);
        if end > arena.bytes {
            return Err(self.violation(format!(
                "{} placed at bytes {offset}..{end}, past the arena's {}",
                self.label(t),
                arena.bytes
            )));
        }
        let over = |&(s, e): &(u64, u64)| s < end && offset < e;
        if let Some(u) = (0..arena.range.len()).find(|&u| arena.range[u].as_ref().is_some_and(over))
        {
            return Err(self.violation(format!(
                "{} placed at bytes {offset}..{end} of the arena, over {}, which still holds them",
                self.label(t),
                self.label(u)
            )));
        }
        let unordered: Vec<usize> = arena
            .ghosts
            .iter()
            .filter(|&&(s, e, _)| over(&(s, e)))
            .map(|&(_, _, u)| u)
            .collect();
        if let Some(arena) = self.arena.as_mut() {
            arena.range[t] = Some((offset, end));
        }
        let st = &mut self.tensors[t];
        st.allocated = true;
        st.data = None;
        st.prefetch = None;
        st.unordered = unordered;
        st.ordered.clear();
        // the arena's bytes are counted as a whole
        Ok(())
    }

    fn release_offloading(&mut self, tensor: TensorId) -> Result<(), ExecutorError> {
        let t = self.tensor(tensor)?;
        self.advance();
        if !self.tensors[t].allocated {
            return Err(self.violation(format!("{} released without device memory", self.label(t))));
        }
        if self.tensors[t].offload.is_none() {
            return Err(self.violation(format!(
                "{} released as offloading, but it was never offloaded",
                self.label(t)
            )));
        }
        let in_flight = self.offload_in_flight(t);
        let Some(arena) = self.arena.as_mut() else {
            return Err(self.violation(format!(
                "{} released as offloading outside an arena",
                self.label(t)
            )));
        };
        if let Some((s, e)) = arena.range[t].take() {
            if in_flight {
                arena.ghosts.push((s, e, t));
            }
        }
        let st = &mut self.tensors[t];
        st.allocated = false;
        st.data = None;
        st.prefetch = None;
        Ok(())
    }

    fn order_after_offload(
        &mut self,
        tensor: TensorId,
        previous: TensorId,
    ) -> Result<(), ExecutorError> {
        let t = self.tensor(tensor)?;
        let u = self.tensor(previous)?;
        let st = &mut self.tensors[t];
        st.unordered.retain(|&x| x != u);
        st.ordered.push(u);
        Ok(())
    }

    fn release_arena(&mut self) -> Result<(), ExecutorError> {
        self.advance();
        let Some(arena) = self.arena.take() else {
            return Err(self.violation("no arena to release".into()));
        };
        if let Some(u) = (0..arena.range.len()).find(|&u| arena.range[u].is_some()) {
            return Err(self.violation(format!(
                "the arena is released while {} still holds memory in it",
                self.label(u)
            )));
        }
        if let Some(&(_, _, u)) = arena
            .ghosts
            .iter()
            .find(|&&(_, _, u)| self.offload_in_flight(u))
        {
            return Err(self.violation(format!(
                "the arena is released while the offload of {} still reads it",
                self.label(u)
            )));
        }
        if let (Some(pool), Some(base)) = (self.pool.as_mut(), arena.base) {
            if let Err(e) = pool.chunk.free(base) {
                return Err(self.violation(format!("the arena: {e}")));
            }
        }
        self.counts.used_bytes -= arena.bytes;
        Ok(())
    }
}
