//! What every generator shares: the roofline model of op times, the
//! optimizer's state per parameter, and a trace builder that times each op
//! by the bytes it touches and updates the parameters it registered.

use crate::trace::{Phase, TensorId, TensorKind, Trace, TraceBuilder, TraceError};

/// A roofline model of a device, for synthetic op durations.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceSpeed {
    /// Sustained arithmetic throughput, FLOP/s.
    pub flops_per_s: f64,
    /// Sustained device memory bandwidth, bytes/s.
    pub memory_bytes_per_s: f64,
    /// Fixed cost per op (launch), seconds.
    pub launch_s: f64,
}

impl DeviceSpeed {
    /// The AutoVM thesis' RTX 2080 Ti: ≈ 11 TFLOP/s FP32 sustained, 500 GB/s.
    pub fn rtx_2080_ti() -> DeviceSpeed {
        DeviceSpeed {
            flops_per_s: 11e12,
            memory_bytes_per_s: 500e9,
            launch_s: 5e-6,
        }
    }

    /// An H100: ≈ 50 TFLOP/s sustained (TF32), 2.5 TB/s.
    pub fn h100() -> DeviceSpeed {
        DeviceSpeed {
            flops_per_s: 50e12,
            memory_bytes_per_s: 2.5e12,
            launch_s: 4e-6,
        }
    }

    /// Seconds for an op doing `flops` and touching `bytes`.
    pub fn op_time(&self, flops: f64, bytes: u64) -> f64 {
        self.launch_s + (flops / self.flops_per_s).max(bytes as f64 / self.memory_bytes_per_s)
    }
}

/// The optimizer, which decides how much state each parameter carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Optimizer {
    /// Plain SGD: no state.
    Sgd,
    /// SGD with momentum: one buffer per parameter.
    Momentum,
    /// Adam: two moments per parameter.
    Adam,
}

impl Optimizer {
    pub(super) fn states(self) -> usize {
        match self {
            Optimizer::Sgd => 0,
            Optimizer::Momentum => 1,
            Optimizer::Adam => 2,
        }
    }
}

/// The tensors of a softmax cross-entropy loss.
pub(super) struct Loss {
    pub(super) logits: TensorId,
    pub(super) labels: TensorId,
    pub(super) loss: TensorId,
    /// The logits' gradient.
    pub(super) dlogits: TensorId,
}

/// A parameter group updated by one optimizer op.
struct Group {
    name: String,
    params: Vec<TensorId>,
    grads: Vec<TensorId>,
    states: Vec<TensorId>,
    elems: u64,
}

/// A trace builder that remembers sizes, to derive op durations, and the
/// parameter groups the optimizer updates at the end.
pub(super) struct Recorder {
    b: TraceBuilder,
    bytes: Vec<u64>,
    speed: DeviceSpeed,
    optimizer: Optimizer,
    elem_bytes: u64,
    groups: Vec<Group>,
}

impl Recorder {
    /// A recorder timing ops on `speed`, with parameters of `elem_bytes`
    /// bytes an element updated by `optimizer`.
    pub(super) fn new(speed: DeviceSpeed, optimizer: Optimizer, elem_bytes: u64) -> Recorder {
        Recorder {
            b: TraceBuilder::new(),
            bytes: Vec::new(),
            speed,
            optimizer,
            elem_bytes,
            groups: Vec::new(),
        }
    }

    /// Bytes of a recorded tensor.
    pub(super) fn bytes(&self, t: TensorId) -> u64 {
        self.bytes[t.index()]
    }

    pub(super) fn tensor(
        &mut self,
        name: impl Into<String>,
        bytes: u64,
        kind: TensorKind,
    ) -> TensorId {
        self.bytes.push(bytes);
        self.b.tensor(name, bytes, kind)
    }

    /// An op reading `reads` and writing `writes`, doing `flops`.
    pub(super) fn op(
        &mut self,
        name: impl Into<String>,
        phase: Phase,
        reads: &[TensorId],
        writes: &[TensorId],
        flops: f64,
    ) {
        let mut all: Vec<TensorId> = reads.iter().chain(writes).copied().collect();
        all.sort();
        all.dedup();
        let bytes: u64 = all
            .iter()
            .map(|t| self.bytes.get(t.index()).copied().unwrap_or(0))
            .sum();
        let d = self.speed.op_time(flops, bytes);
        self.b.timed_op(name, phase, reads, writes, d);
    }

    /// The tensors of a softmax cross-entropy loss over `rows` rows of
    /// `classes` logits (the labels are 8-byte class indices).
    pub(super) fn loss_tensors(&mut self, rows: u64, classes: u64) -> Loss {
        let eb = self.elem_bytes;
        Loss {
            logits: self.tensor("logits", rows * classes * eb, TensorKind::Activation),
            labels: self.tensor("labels", rows * 8, TensorKind::Activation),
            loss: self.tensor("loss", rows * eb, TensorKind::Activation),
            dlogits: self.tensor("logits.grad", rows * classes * eb, TensorKind::Gradient),
        }
    }

    /// The loss op: reads the logits and labels, writes the loss and the
    /// logits' gradient.
    pub(super) fn softmax_xent(&mut self, l: &Loss) {
        self.op(
            "softmax_xent",
            Phase::Forward,
            &[l.logits, l.labels],
            &[l.loss, l.dlogits],
            0.0,
        );
    }

    /// Adds a parameter group `name` (one parameter per part, of its
    /// number of elements) with its gradients and optimizer state; returns
    /// the parameters and their gradients.
    pub(super) fn params(
        &mut self,
        name: &str,
        parts: &[(&str, u64)],
    ) -> (Vec<TensorId>, Vec<TensorId>) {
        let eb = self.elem_bytes;
        let mut g = Group {
            name: name.to_string(),
            params: Vec::new(),
            grads: Vec::new(),
            states: Vec::new(),
            elems: 0,
        };
        for &(part, elems) in parts {
            g.params
                .push(self.tensor(format!("{name}.{part}"), elems * eb, TensorKind::Parameter));
            g.grads
                .push(self.tensor(format!("{name}.d{part}"), elems * eb, TensorKind::Gradient));
            for s in 0..self.optimizer.states() {
                g.states.push(self.tensor(
                    format!("{name}.{part}.state{s}"),
                    elems * eb,
                    TensorKind::OptimizerState,
                ));
            }
            g.elems += elems;
        }
        let out = (g.params.clone(), g.grads.clone());
        self.groups.push(g);
        out
    }

    /// Emits one optimizer op per parameter group, in the order they were
    /// added, and builds the trace.
    pub(super) fn finish(mut self) -> Result<Trace, TraceError> {
        let groups = std::mem::take(&mut self.groups);
        for g in &groups {
            let reads: Vec<TensorId> = g
                .params
                .iter()
                .chain(&g.grads)
                .chain(&g.states)
                .copied()
                .collect();
            let writes: Vec<TensorId> = g.params.iter().chain(&g.states).copied().collect();
            self.op(
                format!("{}.update", g.name),
                Phase::Optimizer,
                &reads,
                &writes,
                10.0 * g.elems as f64,
            );
        }
        self.b.build()
    }
}
