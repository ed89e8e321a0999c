//! Errors of the measurement: each names the file (and line) it is about.

/// Why the workspace could not be measured.
#[derive(Debug, thiserror::Error)]
pub enum ShapeError {
    /// A file or directory could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// What the system said.
        source: std::io::Error,
    },
    /// A Rust source file does not parse.
    #[error("{file}:{line}:{column}: does not parse: {message}")]
    Parse {
        /// The file, relative to the workspace.
        file: String,
        /// Line of the error (1-based).
        line: usize,
        /// Column of the error (1-based).
        column: usize,
        /// What the parser said.
        message: String,
    },
    /// A `mod name;` declaration whose file is missing.
    #[error("{file}:{line}: `mod {name};` has no file: looked for {tried}")]
    ModuleFile {
        /// The file that declares the module.
        file: String,
        /// Line of the declaration.
        line: usize,
        /// The module's name.
        name: String,
        /// The paths looked for, relative to the workspace.
        tried: String,
    },
    /// A Cargo.toml that does not parse or lacks `[package] name`.
    #[error("{file}: {message}")]
    Manifest {
        /// The manifest, relative to the workspace.
        file: String,
        /// What is wrong.
        message: String,
    },
    /// The baseline file does not parse.
    #[error("{file}: not a shape baseline: {message}")]
    Baseline {
        /// The baseline file.
        file: String,
        /// What the JSON parser said.
        message: String,
    },
}

/// Result of the measurement.
pub type Result<T> = std::result::Result<T, ShapeError>;
