//! The error type of the core crate.

/// Errors raised while declaring models, running passes or kernels.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// A shape, space or dtype mismatch found while building a graph.
    #[error("{context}: op `{op}`: {message}")]
    Shape {
        context: String,
        op: String,
        message: String,
    },
    /// A model declaration that cannot be executed (missing scatter, bad head, ...).
    #[error("model `{model}`: {message}")]
    Model { model: String, message: String },
    /// A name that was looked up and not found.
    #[error("unknown {kind} `{name}`{hint}")]
    Unknown {
        kind: &'static str,
        name: String,
        hint: String,
    },
    /// A kernel that was given inconsistent arguments at run time.
    #[error("kernel `{op}`: {message}")]
    Kernel { op: String, message: String },
    /// A tensor whose shape does not match what was expected.
    #[error("tensor `{name}`: expected shape {expected:?}, got {got:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    /// The weight matrices of a model do not fit in the GPU register file
    /// (VPPS §III-A1): the persistent engine cannot cache them on chip.
    #[error("weights do not fit on chip: need {needed_regs} registers per thread, the device has {available_regs}: {message}")]
    NotOnChip {
        /// Registers per thread the weights (and gradients, if cached) need.
        needed_regs: usize,
        /// Registers per thread left for weights on the device.
        available_regs: usize,
        /// What was tried and the largest matrices by parameter id.
        message: String,
    },
    /// Invalid input to the persistent engine's register planner, script
    /// encoder or scheduler (see [`crate::vpps`]).
    #[error("vpps {what}: {message}")]
    Vpps {
        /// The stage that rejected it (`register plan`, `script`, `schedule`,
        /// `simulation`).
        what: String,
        /// What was wrong, naming the offending matrix, task or word.
        message: String,
    },
}

pub type Result<T, E = CoreError> = std::result::Result<T, E>;

impl CoreError {
    /// A kernel error of op `op` (the CPU kernels in `ramus_cpu::kernels` raise these).
    pub fn kernel(op: &str, message: impl Into<String>) -> Self {
        CoreError::Kernel {
            op: op.to_string(),
            message: message.into(),
        }
    }
    pub(crate) fn vpps(what: impl Into<String>, message: impl Into<String>) -> Self {
        CoreError::Vpps {
            what: what.into(),
            message: message.into(),
        }
    }
    pub(crate) fn model(model: &str, message: impl Into<String>) -> Self {
        CoreError::Model {
            model: model.to_string(),
            message: message.into(),
        }
    }
}
