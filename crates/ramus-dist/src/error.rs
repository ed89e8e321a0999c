//! The one error type of the crate.

use thiserror::Error;

/// What went wrong, naming the variable, rank or address.
#[derive(Debug, Error)]
pub enum DistError {
    /// A launch variable is missing, malformed or inconsistent.
    #[error("launch environment: {0}")]
    Env(String),
    /// The rendezvous failed: a rank did not join, rank 0 could not be
    /// reached or went away, or a greeting did not fit.
    #[error("rendezvous on {addr}: {message}")]
    Rendezvous { addr: String, message: String },
    /// Sizes that cannot be sharded.
    #[error("{0}")]
    Config(String),
}

impl From<DistError> for ramus_exec::ExecError {
    fn from(e: DistError) -> Self {
        ramus_exec::ExecError::Config(e.to_string())
    }
}

pub type Result<T> = std::result::Result<T, DistError>;
