//! What can go wrong in reading, writing, sampling or tokenizing data.
//!
//! Every error about a file names the file: a malformed `.idx`/`.bin` pair is reported before
//! any token is read, so a bad file never turns into a panic, an out-of-bounds read or silently
//! wrong tokens.

use std::path::{Path, PathBuf};

/// Data that cannot be read, written, sampled or tokenized, with what is wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DataError {
    /// The operating system refused an operation on a file.
    #[error("{operation} {}: {message}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done ("open", "write", "memory-map", ...).
        operation: &'static str,
        /// The system's message.
        message: String,
    },
    /// A file ends before a part its header promises.
    #[error(
        "{} is truncated: its {what} needs bytes {}..{} but the file has {len} bytes",
        path.display(), needed.start, needed.end
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// The part that does not fit, e.g. "sequence pointers".
        what: &'static str,
        /// The byte range the part needs.
        needed: core::ops::Range<u64>,
        /// The file's length in bytes.
        len: u64,
    },
    /// The `.idx` file does not start with Megatron's `MMIDIDX\0\0`.
    #[error(
        "{} is not a Megatron index: it starts with {found:?}, not b\"MMIDIDX\\0\\0\"",
        path.display()
    )]
    BadMagic {
        /// The file.
        path: PathBuf,
        /// Its first (up to 9) bytes.
        found: Vec<u8>,
    },
    /// The `.idx` version is not 1, the only one Megatron writes.
    #[error("{} has index version {version}; only version 1 exists", path.display())]
    BadVersion {
        /// The file.
        path: PathBuf,
        /// The version found.
        version: u64,
    },
    /// The dtype code is none of Megatron's (1 to 8).
    #[error(
        "{} has dtype code {code}; Megatron's codes are 1 (u8), 2 (i8), 3 (i16), 4 (i32), \
         5 (i64), 6 (f64), 7 (f32), 8 (u16)",
        path.display()
    )]
    UnknownDType {
        /// The file.
        path: PathBuf,
        /// The code found.
        code: u8,
    },
    /// The index contradicts itself (counts, document boundaries, lengths).
    #[error("{} is inconsistent: {problem}", path.display())]
    InconsistentIndex {
        /// The file.
        path: PathBuf,
        /// What contradicts what.
        problem: String,
    },
    /// A sequence's bytes lie outside the `.bin` file.
    #[error(
        "{}: sequence {sequence} ({length} tokens of {item_size} bytes at byte {pointer}) lies \
         outside the file's {bin_len} bytes",
        path.display()
    )]
    SequenceOutOfRange {
        /// The `.bin` file.
        path: PathBuf,
        /// The sequence.
        sequence: usize,
        /// Its byte offset, as the index gives it.
        pointer: i64,
        /// Its length in tokens, as the index gives it.
        length: i32,
        /// Bytes per token.
        item_size: usize,
        /// The `.bin` file's length.
        bin_len: u64,
    },
    /// An index past the end of a dataset, a sequence or a document.
    #[error("{what} {index} is out of range: there are {len}")]
    IndexOutOfRange {
        /// What was indexed, e.g. "sample".
        what: &'static str,
        /// The index asked for.
        index: usize,
        /// How many there are.
        len: usize,
    },
    /// A token id the dataset's dtype cannot hold, or a floating-point dataset read as tokens.
    #[error("token {value} cannot be stored as {dtype}: {hint}")]
    TokenDType {
        /// The token id (or, for a floating-point dataset, 0).
        value: i64,
        /// The dataset's dtype.
        dtype: super::DType,
        /// What to do about it.
        hint: &'static str,
    },
    /// A line of the input that is not the JSON object expected.
    #[error("{}:{line}: {problem}", path.display())]
    BadInput {
        /// The input file.
        path: PathBuf,
        /// Its 1-based line number.
        line: usize,
        /// What is wrong with the line.
        problem: String,
    },
    /// The tokenizer failed or could not be loaded.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A setting of a dataset, a split or a blend that cannot be used.
    #[error("{0}")]
    Invalid(String),
}

impl DataError {
    pub(crate) fn io(path: &Path, operation: &'static str, err: std::io::Error) -> Self {
        DataError::Io {
            path: path.to_path_buf(),
            operation,
            message: err.to_string(),
        }
    }
}
