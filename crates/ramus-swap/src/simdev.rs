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
//! [`ExecError::Device`] naming the op and the tensor when
//!
//! * an op reads a tensor with no device memory, whose memory holds no data
//!   or stale data (an older version than the last one written), or whose
//!   prefetch neither completed nor was awaited by the compute stream (a
//!   tensor whose first use is a read, never written before, is an input
//!   and holds data from then on);
//! * an op writes a tensor while its offload is still reading it;
//! * memory is released while a copy still reads or writes it (an offload
//!   not yet complete: reuse before the copy's event);
//! * a tensor is offloaded without data, prefetched without a host copy, or
//!   allocated twice.
//!
//! Allocations over the budget are refused (`Ok(false)`), as a full device
//! would; persistent tensors are resident from the start and count against
//! the budget.

use std::collections::VecDeque;

use crate::exec::{ExecError, SwapDevice};
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
    /// Host waits for a copy that had not completed by itself yet.
    pub blocking_waits: usize,
    /// The most device memory in use at once.
    pub peak_bytes: u64,
    /// Device memory in use now.
    pub used_bytes: u64,
}

/// One copy in flight.
#[derive(Clone, Copy, Debug)]
struct Copy {
    version: u64,
    /// Completes once this many ops have been queued.
    done_at: usize,
    complete: bool,
    /// For a prefetch: the compute stream waits for it.
    awaited: bool,
}

#[derive(Clone, Debug, Default)]
struct SimTensor {
    allocated: bool,
    /// Version held in device memory (`None`: uninitialised).
    data: Option<u64>,
    /// Version held in the host slot.
    host: Option<u64>,
    offload: Option<Copy>,
    prefetch: Option<Copy>,
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
        }
    }

    /// Starts another iteration of the trace on the same device: the
    /// persistent tensors' contents carry over, every other tensor starts
    /// anew, and every copy of the last iteration must have completed.
    pub fn start_iteration(&mut self) -> Result<(), ExecError> {
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

    fn violation(&self, message: String) -> ExecError {
        ExecError::Device {
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

    fn tensor(&self, tensor: TensorId) -> Result<usize, ExecError> {
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
    }

    fn complete_prefetch(&mut self, t: usize) {
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
    type Error = ExecError;

    fn budget_bytes(&self) -> Option<u64> {
        self.budget
    }

    fn allocate(&mut self, tensor: TensorId, bytes: u64) -> Result<bool, ExecError> {
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
        if self
            .budget
            .is_some_and(|b| self.counts.used_bytes + bytes > b)
        {
            self.counts.refused_allocations += 1;
            return Ok(false);
        }
        let st = &mut self.tensors[t];
        st.allocated = true;
        st.data = None;
        st.prefetch = None;
        self.counts.used_bytes += bytes;
        self.counts.peak_bytes = self.counts.peak_bytes.max(self.counts.used_bytes);
        Ok(true)
    }

    fn release(&mut self, tensor: TensorId) -> Result<(), ExecError> {
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
        let st = &mut self.tensors[t];
        st.allocated = false;
        st.data = None;
        st.prefetch = None;
        self.counts.used_bytes -= self.trace.tensors()[t].bytes;
        Ok(())
    }

    fn offload(&mut self, tensor: TensorId) -> Result<(), ExecError> {
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
        self.tensors[t].offload = Some(Copy {
            version,
            done_at: self.now + self.latency_ops,
            complete: false,
            awaited: false,
        });
        self.d2h.push_back(t);
        self.counts.copies_to_host += 1;
        self.counts.bytes_to_host += self.trace.tensors()[t].bytes;
        if self.latency_ops == 0 {
            self.advance();
        }
        Ok(())
    }

    fn offload_complete(&mut self, tensor: TensorId) -> Result<bool, ExecError> {
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

    fn wait_offload(&mut self, tensor: TensorId) -> Result<(), ExecError> {
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

    fn prefetch(&mut self, tensor: TensorId) -> Result<(), ExecError> {
        let t = self.tensor(tensor)?;
        self.advance();
        if !self.tensors[t].allocated {
            return Err(self.violation(format!(
                "{} prefetched into no device memory",
                self.label(t)
            )));
        }
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
        let done_at = self.now + self.latency_ops;
        let st = &mut self.tensors[t];
        st.data = Some(version);
        st.prefetch = Some(Copy {
            version,
            done_at,
            complete: false,
            awaited: false,
        });
        self.h2d.push_back(t);
        self.counts.copies_to_device += 1;
        self.counts.bytes_to_device += self.trace.tensors()[t].bytes;
        if self.latency_ops == 0 {
            self.advance();
        }
        Ok(())
    }

    fn await_prefetch(&mut self, tensor: TensorId) -> Result<(), ExecError> {
        let t = self.tensor(tensor)?;
        match self.tensors[t].prefetch.as_mut() {
            Some(c) => {
                c.awaited = true;
                Ok(())
            }
            None => Err(self.violation(format!(
                "the compute stream awaits a prefetch of {}, but none was issued",
                self.label(t)
            ))),
        }
    }

    fn wait_prefetch(&mut self, tensor: TensorId) -> Result<(), ExecError> {
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

    fn run_op(&mut self, op: usize) -> Result<(), ExecError> {
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
}
