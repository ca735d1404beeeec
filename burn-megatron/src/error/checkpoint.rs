//! Why a checkpoint cannot be saved or loaded.

use std::path::{Path, PathBuf};

/// A checkpoint that cannot be written, read or used, naming the file or directory and the
/// problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    /// A file cannot be read or written, or its content is wrong (checksum, size, format).
    #[error("checkpoint file {}: {problem}", file.display())]
    File {
        /// The file.
        file: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// The checkpoint does not fit the model it is loaded into (another configuration, a
    /// missing tensor or shard).
    #[error("checkpoint {}: {problem}", dir.display())]
    Mismatch {
        /// The checkpoint directory.
        dir: PathBuf,
        /// What does not fit.
        problem: String,
    },
    /// No complete checkpoint exists under the root directory.
    #[error("no checkpoint under {}: {problem}", root.display())]
    NotFound {
        /// The root directory checkpoints are saved into.
        root: PathBuf,
        /// What was looked for.
        problem: String,
    },
    /// Another rank failed during a collective save or load.
    #[error("checkpoint {}: {problem}", dir.display())]
    OtherRank {
        /// The checkpoint directory.
        dir: PathBuf,
        /// Which ranks failed.
        problem: String,
    },
}

impl CheckpointError {
    /// A problem with `file`.
    pub(crate) fn file(file: &Path, problem: impl Into<String>) -> Self {
        Self::File {
            file: file.to_path_buf(),
            problem: problem.into(),
        }
    }

    /// An I/O error on `file`, with what was being done.
    pub(crate) fn io(file: &Path, doing: &str, error: std::io::Error) -> Self {
        Self::file(file, format!("cannot {doing}: {error}"))
    }

    /// A mismatch between the checkpoint in `dir` and the model.
    pub(crate) fn mismatch(dir: &Path, problem: impl Into<String>) -> Self {
        Self::Mismatch {
            dir: dir.to_path_buf(),
            problem: problem.into(),
        }
    }
}
