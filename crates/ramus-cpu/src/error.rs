//! Errors of the CPU engine.

/// Errors raised while running a batch.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Core(#[from] ramus_core::CoreError),
    #[error(transparent)]
    Graph(#[from] ramus_graph::GraphError),
    /// Inconsistent inputs for this model and batch.
    #[error("bad input: {0}")]
    Input(String),
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
