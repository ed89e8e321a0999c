//! Training-iteration traces: what an engine feeds the planner.
//!
//! A [`Trace`] is one training iteration in execution order: every op
//! (forward, backward, optimizer) with the tensors it reads and writes, and
//! optionally the op's measured duration from a profiled iteration. Tensors
//! carry a size in bytes and a [`TensorKind`]. The trace is independent of
//! Ramus' graph IR: an engine (CPU, CUDA, a CNN or a dynamic batch) records
//! it with a [`TraceBuilder`] or writes it as JSON.
//!
//! Lifetimes follow from the trace alone. Parameters and optimizer state are
//! *persistent*: they exist before the iteration starts and after it ends.
//! Every other tensor is allocated at its first use and freed after its last.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The largest total size of all tensors in a trace (2^62 bytes), so that
/// sums of sizes never overflow `u64`.
pub const MAX_TOTAL_BYTES: u64 = 1 << 62;

/// A tensor's index in its [`Trace`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TensorId(pub u32);

impl TensorId {
    /// The index into [`Trace::tensors`].
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for TensorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t{}", self.0)
    }
}

/// What a tensor is; decides its lifetime and whether it may be offloaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TensorKind {
    /// A trainable weight (persistent).
    Parameter,
    /// A value computed in the forward pass (including inputs and labels).
    Activation,
    /// A gradient: of an activation (short-lived) or of a parameter
    /// (written in the backward pass, read by the optimizer).
    Gradient,
    /// Scratch memory of one op (im2col buffers, cuDNN workspaces).
    Workspace,
    /// Optimizer state such as momentum or Adam moments (persistent).
    OptimizerState,
    /// A parameter's gradient held in a buffer of its own for the whole
    /// run (persistent): zeroed, accumulated over the backward pass and read
    /// by the optimizer, as the CUDA engine keeps them.
    ParameterGradient,
}

impl TensorKind {
    /// Whether tensors of this kind live across iterations.
    pub fn is_persistent(self) -> bool {
        matches!(
            self,
            TensorKind::Parameter | TensorKind::OptimizerState | TensorKind::ParameterGradient
        )
    }

    /// A short lower-case name.
    pub fn label(self) -> &'static str {
        match self {
            TensorKind::Parameter => "parameter",
            TensorKind::Activation => "activation",
            TensorKind::Gradient => "gradient",
            TensorKind::Workspace => "workspace",
            TensorKind::OptimizerState => "optimizer state",
            TensorKind::ParameterGradient => "parameter gradient",
        }
    }
}

/// The part of the training iteration an op belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Inference: the forward pass.
    Forward,
    /// Gradient computation.
    Backward,
    /// The weight update.
    Optimizer,
}

impl Phase {
    /// A short name: `fwd`, `bwd` or `opt`.
    pub fn label(self) -> &'static str {
        match self {
            Phase::Forward => "fwd",
            Phase::Backward => "bwd",
            Phase::Optimizer => "opt",
        }
    }
}

/// One tensor of a trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorInfo {
    /// A readable name, used in listings and errors.
    pub name: String,
    /// Size on the device in bytes.
    pub bytes: u64,
    /// What the tensor is.
    pub kind: TensorKind,
}

/// One op of a trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpInfo {
    /// A readable name, used in listings and errors.
    pub name: String,
    /// Forward, backward or optimizer.
    pub phase: Phase,
    /// Tensors the op reads.
    pub reads: Vec<TensorId>,
    /// Tensors the op writes (an in-place update lists a tensor in both).
    pub writes: Vec<TensorId>,
    /// Measured duration in seconds from a profiled iteration, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_s: Option<f64>,
}

/// Problems found while building or reading a trace.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TraceError {
    /// The trace has no ops.
    #[error("the trace has no ops")]
    Empty,
    /// An op names a tensor the trace does not have.
    #[error("op {op} `{op_name}` uses tensor {tensor}, but the trace has only {tensors} tensors")]
    UnknownTensor {
        /// Index of the op.
        op: usize,
        /// Name of the op.
        op_name: String,
        /// The unknown id.
        tensor: TensorId,
        /// How many tensors there are.
        tensors: usize,
    },
    /// A duration that is negative, infinite or NaN.
    #[error(
        "op {op} `{op_name}` has an invalid duration {value} s (must be finite and non-negative)"
    )]
    BadDuration {
        /// Index of the op.
        op: usize,
        /// Name of the op.
        op_name: String,
        /// The value given.
        value: f64,
    },
    /// More tensors than ids, or more bytes than the planner can add up.
    #[error("the trace is too large: {0}")]
    TooLarge(String),
    /// Durations given for some ops but not others, where all were asked for.
    #[error("expected {expected} durations, got {got}")]
    DurationCount {
        /// Number of ops.
        expected: usize,
        /// Number of durations given.
        got: usize,
    },
    /// Malformed JSON.
    #[error("invalid trace JSON: {0}")]
    Json(String),
    /// A synthetic model description that cannot be built.
    #[error("invalid model: {0}")]
    Spec(String),
}

/// The serialized form of a trace (validated into a [`Trace`] on reading).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct TraceData {
    tensors: Vec<TensorInfo>,
    ops: Vec<OpInfo>,
}

/// One validated training iteration: tensors and ops in execution order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "TraceData", into = "TraceData")]
pub struct Trace {
    tensors: Vec<TensorInfo>,
    ops: Vec<OpInfo>,
    /// Per op: the distinct tensors it reads or writes, sorted by id.
    uses: Vec<Vec<TensorId>>,
}

impl TryFrom<TraceData> for Trace {
    type Error = TraceError;
    fn try_from(d: TraceData) -> Result<Self, TraceError> {
        Trace::new(d.tensors, d.ops)
    }
}

impl From<Trace> for TraceData {
    fn from(t: Trace) -> Self {
        TraceData {
            tensors: t.tensors,
            ops: t.ops,
        }
    }
}

impl Trace {
    /// Validates and builds a trace. Tensor ids are indices into `tensors`.
    pub fn new(tensors: Vec<TensorInfo>, ops: Vec<OpInfo>) -> Result<Trace, TraceError> {
        if ops.is_empty() {
            return Err(TraceError::Empty);
        }
        if tensors.len() > u32::MAX as usize {
            return Err(TraceError::TooLarge(format!(
                "{} tensors (at most {})",
                tensors.len(),
                u32::MAX
            )));
        }
        let mut total: u64 = 0;
        for t in &tensors {
            total = total.saturating_add(t.bytes);
        }
        if total > MAX_TOTAL_BYTES {
            return Err(TraceError::TooLarge(format!(
                "tensors add up to {total} bytes (at most {MAX_TOTAL_BYTES})"
            )));
        }
        let mut uses = Vec::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            if let Some(d) = op.duration_s {
                if !d.is_finite() || d < 0.0 {
                    return Err(TraceError::BadDuration {
                        op: i,
                        op_name: op.name.clone(),
                        value: d,
                    });
                }
            }
            let mut u: Vec<TensorId> = op.reads.iter().chain(&op.writes).copied().collect();
            for &t in &u {
                if t.index() >= tensors.len() {
                    return Err(TraceError::UnknownTensor {
                        op: i,
                        op_name: op.name.clone(),
                        tensor: t,
                        tensors: tensors.len(),
                    });
                }
            }
            u.sort_unstable();
            u.dedup();
            uses.push(u);
        }
        Ok(Trace { tensors, ops, uses })
    }

    /// Reads a trace from JSON (the format [`Trace::to_json`] writes) and validates it.
    pub fn from_json(s: &str) -> Result<Trace, TraceError> {
        serde_json::from_str(s).map_err(|e| TraceError::Json(e.to_string()))
    }

    /// The trace as pretty-printed JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self)
            .unwrap_or_else(|e| format!("{{\"error\": \"cannot serialize trace: {e}\"}}"))
    }

    /// All tensors; a [`TensorId`] indexes this slice.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// All ops in execution order.
    pub fn ops(&self) -> &[OpInfo] {
        &self.ops
    }

    /// Number of ops.
    pub fn num_ops(&self) -> usize {
        self.ops.len()
    }

    /// Number of tensors.
    pub fn num_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// The tensor with this id. Ids come from this trace; an id from another
    /// trace that is out of range panics like any out-of-range index.
    pub fn tensor(&self, id: TensorId) -> &TensorInfo {
        &self.tensors[id.index()]
    }

    /// The tensor with this id, or `None` if out of range.
    pub fn get_tensor(&self, id: TensorId) -> Option<&TensorInfo> {
        self.tensors.get(id.index())
    }

    /// The distinct tensors op `op` reads or writes, sorted by id.
    pub fn uses(&self, op: usize) -> &[TensorId] {
        self.uses.get(op).map(Vec::as_slice).unwrap_or(&[])
    }

    /// Per tensor, the last op that uses it (`None`: no op does); the
    /// executor, the simulator and the planners free a tensor after it.
    pub fn last_uses(&self) -> Vec<Option<usize>> {
        let mut last = vec![None; self.tensors.len()];
        for (op, uses) in self.uses.iter().enumerate() {
            for &t in uses {
                last[t.index()] = Some(op);
            }
        }
        last
    }

    /// Bytes of the distinct tensors op `op` reads or writes: the least
    /// device memory the op can run in.
    pub fn working_set_bytes(&self, op: usize) -> u64 {
        self.uses(op).iter().map(|&t| self.tensor(t).bytes).sum()
    }

    /// Whether every op carries a measured duration.
    pub fn has_durations(&self) -> bool {
        self.ops.iter().all(|o| o.duration_s.is_some())
    }

    /// The same trace without measured durations (as an unprofiled first
    /// iteration would see it).
    pub fn without_durations(&self) -> Trace {
        let mut t = self.clone();
        for op in &mut t.ops {
            op.duration_s = None;
        }
        t
    }

    /// The same trace with these measured durations, one per op.
    pub fn with_durations(&self, durations: &[f64]) -> Result<Trace, TraceError> {
        if durations.len() != self.ops.len() {
            return Err(TraceError::DurationCount {
                expected: self.ops.len(),
                got: durations.len(),
            });
        }
        let mut ops = self.ops.clone();
        for (op, &d) in ops.iter_mut().zip(durations) {
            op.duration_s = Some(d);
        }
        Trace::new(self.tensors.clone(), ops)
    }

    /// Total bytes of persistent tensors (parameters and optimizer state).
    pub fn persistent_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|t| t.kind.is_persistent())
            .map(|t| t.bytes)
            .sum()
    }
}

/// Records a trace op by op, as an engine runs (or plans) an iteration.
///
/// ```
/// use ramus_swap::{Phase, TensorKind, TraceBuilder};
/// let mut b = TraceBuilder::new();
/// let w = b.tensor("w", 4 << 20, TensorKind::Parameter);
/// let x = b.tensor("x", 64 << 20, TensorKind::Activation);
/// let y = b.tensor("y", 64 << 20, TensorKind::Activation);
/// b.op("fc", Phase::Forward, &[x, w], &[y]);
/// let trace = b.build().unwrap();
/// assert_eq!(trace.working_set_bytes(0), 132 << 20);
/// ```
#[derive(Clone, Debug, Default)]
pub struct TraceBuilder {
    tensors: Vec<TensorInfo>,
    ops: Vec<OpInfo>,
}

impl TraceBuilder {
    /// An empty builder.
    pub fn new() -> TraceBuilder {
        TraceBuilder::default()
    }

    /// Declares a tensor and returns its id.
    pub fn tensor(&mut self, name: impl Into<String>, bytes: u64, kind: TensorKind) -> TensorId {
        let id = TensorId(u32::try_from(self.tensors.len()).unwrap_or(u32::MAX));
        self.tensors.push(TensorInfo {
            name: name.into(),
            bytes,
            kind,
        });
        id
    }

    /// Appends an op without a measured duration; returns its index.
    pub fn op(
        &mut self,
        name: impl Into<String>,
        phase: Phase,
        reads: &[TensorId],
        writes: &[TensorId],
    ) -> usize {
        self.push(name.into(), phase, reads, writes, None)
    }

    /// Appends an op with a measured duration in seconds; returns its index.
    pub fn timed_op(
        &mut self,
        name: impl Into<String>,
        phase: Phase,
        reads: &[TensorId],
        writes: &[TensorId],
        duration_s: f64,
    ) -> usize {
        self.push(name.into(), phase, reads, writes, Some(duration_s))
    }

    fn push(
        &mut self,
        name: String,
        phase: Phase,
        reads: &[TensorId],
        writes: &[TensorId],
        duration_s: Option<f64>,
    ) -> usize {
        self.ops.push(OpInfo {
            name,
            phase,
            reads: reads.to_vec(),
            writes: writes.to_vec(),
            duration_s,
        });
        self.ops.len() - 1
    }

    /// Number of ops recorded so far.
    pub fn num_ops(&self) -> usize {
        self.ops.len()
    }

    /// Validates and returns the trace.
    pub fn build(self) -> Result<Trace, TraceError> {
        if self.tensors.len() > u32::MAX as usize {
            return Err(TraceError::TooLarge(format!(
                "{} tensors (at most {})",
                self.tensors.len(),
                u32::MAX
            )));
        }
        Trace::new(self.tensors, self.ops)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_tensor_is_named() {
        let mut b = TraceBuilder::new();
        let x = b.tensor("x", 8, TensorKind::Activation);
        b.op("bad", Phase::Forward, &[x, TensorId(7)], &[]);
        let e = b.build().unwrap_err();
        assert!(e.to_string().contains("`bad`"), "{e}");
        assert!(e.to_string().contains("t7"), "{e}");
    }

    #[test]
    fn bad_duration_and_empty_are_errors() {
        let mut b = TraceBuilder::new();
        let x = b.tensor("x", 8, TensorKind::Activation);
        b.timed_op("neg", Phase::Forward, &[x], &[], -1.0);
        assert!(matches!(b.build(), Err(TraceError::BadDuration { .. })));
        assert_eq!(TraceBuilder::new().build(), Err(TraceError::Empty));
    }

    #[test]
    fn json_round_trip_validates() {
        let mut b = TraceBuilder::new();
        let x = b.tensor("x", 8, TensorKind::Activation);
        let y = b.tensor("y", 16, TensorKind::Activation);
        b.timed_op("f", Phase::Forward, &[x], &[y, y], 1e-3);
        let t = b.build().unwrap();
        assert_eq!(t.uses(0), &[x, y]);
        let back = Trace::from_json(&t.to_json()).unwrap();
        assert_eq!(back, t);
        let broken = t
            .to_json()
            .replace("\"reads\": [\n        0\n      ]", "\"reads\": [9]");
        assert!(Trace::from_json(&broken).is_err());
    }
}
