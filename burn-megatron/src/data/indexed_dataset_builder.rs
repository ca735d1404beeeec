//! Writes Megatron's indexed dataset incrementally (Megatron-Core's `IndexedDatasetBuilder`).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use super::indexed_dataset::{INDEX_MAGIC, INDEX_VERSION, data_file_path, index_file_path};
use super::{DType, DataError};

/// Builds `prefix.bin` and `prefix.idx`: tokens stream into the `.bin` file as sequences are
/// added; [`finalize`](Self::finalize) writes the `.idx` file (layout:
/// [`indexed_dataset`](super::indexed_dataset)).
///
/// ```no_run
/// # fn main() -> Result<(), burn_megatron::data::DataError> {
/// use burn_megatron::data::{DType, IndexedDatasetBuilder};
/// let mut builder = IndexedDatasetBuilder::new("corpus_text_document", DType::U16)?;
/// builder.add_document(&[72, 105, 256], &[3])?; // one document of one sequence
/// builder.finalize()?;
/// # Ok(()) }
/// ```
pub struct IndexedDatasetBuilder {
    bin_path: PathBuf,
    idx_path: PathBuf,
    bin: BufWriter<File>,
    dtype: DType,
    sequence_lengths: Vec<i32>,
    document_indices: Vec<i64>,
    sequence_modes: Option<Vec<i8>>,
    scratch: Vec<u8>,
}

impl IndexedDatasetBuilder {
    /// Creates (or truncates) `prefix.bin`; `prefix.idx` is written by `finalize`.
    pub fn new(prefix: impl AsRef<Path>, dtype: DType) -> Result<Self, DataError> {
        let prefix = prefix.as_ref();
        let bin_path = data_file_path(prefix);
        let file = File::create(&bin_path).map_err(|e| DataError::io(&bin_path, "create", e))?;
        Ok(IndexedDatasetBuilder {
            idx_path: index_file_path(prefix),
            bin_path,
            bin: BufWriter::new(file),
            dtype,
            sequence_lengths: Vec::new(),
            document_indices: vec![0],
            sequence_modes: None,
            scratch: Vec::new(),
        })
    }

    /// Also writes a mode per sequence (Megatron's `multimodal=True`); every sequence added
    /// before this call gets mode 0.
    pub fn with_modes(mut self) -> Self {
        self.sequence_modes = Some(vec![0; self.sequence_lengths.len()]);
        self
    }

    /// The dtype the tokens are written in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Sequences added so far.
    pub fn num_sequences(&self) -> usize {
        self.sequence_lengths.len()
    }

    /// Documents ended so far.
    pub fn num_documents(&self) -> usize {
        self.document_indices.len() - 1
    }

    /// Adds one sequence (Megatron's `add_item`); [`end_document`](Self::end_document) closes
    /// the document it belongs to. An error if a token does not fit the dtype; then nothing is
    /// written.
    pub fn add_item(&mut self, tokens: &[i64]) -> Result<(), DataError> {
        self.add_item_with_mode(tokens, 0)
    }

    /// [`add_item`](Self::add_item) with a sequence mode (kept only
    /// [`with_modes`](Self::with_modes)).
    pub fn add_item_with_mode(&mut self, tokens: &[i64], mode: i8) -> Result<(), DataError> {
        let length = i32::try_from(tokens.len()).map_err(|_| {
            DataError::Invalid(format!(
                "a sequence of {} tokens is longer than the format's i32 lengths allow",
                tokens.len()
            ))
        })?;
        self.scratch.clear();
        for &token in tokens {
            if !self.dtype.encode(token, &mut self.scratch) {
                return Err(DataError::TokenDType {
                    value: token,
                    dtype: self.dtype,
                    hint: self.dtype.widening_hint(),
                });
            }
        }
        self.bin
            .write_all(&self.scratch)
            .map_err(|e| DataError::io(&self.bin_path, "write", e))?;
        self.sequence_lengths.push(length);
        if let Some(modes) = &mut self.sequence_modes {
            modes.push(mode);
        }
        Ok(())
    }

    /// Ends the current document: the sequences added since the last call form it.
    pub fn end_document(&mut self) {
        self.document_indices
            .push(self.sequence_lengths.len() as i64);
    }

    /// Adds a whole document (Megatron's `add_document`): `tokens` split into sequences of
    /// `lengths` tokens (one length, `[tokens.len()]`, for a GPT corpus).
    pub fn add_document(&mut self, tokens: &[i64], lengths: &[usize]) -> Result<(), DataError> {
        let total: usize = lengths.iter().sum();
        if total != tokens.len() {
            return Err(DataError::Invalid(format!(
                "a document of {} tokens cannot be split into sequences of {lengths:?} tokens \
                 (they add up to {total})",
                tokens.len()
            )));
        }
        let mut start = 0;
        for &length in lengths {
            self.add_item(&tokens[start..start + length])?;
            start += length;
        }
        self.end_document();
        Ok(())
    }

    /// Flushes `prefix.bin` and writes `prefix.idx`. Sequences added since the last
    /// `end_document` form a last document (Megatron would leave them in none, and then refuse
    /// to read the file).
    pub fn finalize(mut self) -> Result<(), DataError> {
        if self.document_indices.last() != Some(&(self.sequence_lengths.len() as i64)) {
            self.end_document();
        }
        self.bin
            .flush()
            .map_err(|e| DataError::io(&self.bin_path, "write", e))?;
        let idx = self.index_bytes();
        std::fs::write(&self.idx_path, idx).map_err(|e| DataError::io(&self.idx_path, "write", e))
    }

    /// The `.idx` file's bytes.
    fn index_bytes(&self) -> Vec<u8> {
        let sequences = self.sequence_lengths.len();
        let mut out = Vec::with_capacity(34 + 12 * sequences + 8 * self.document_indices.len());
        out.extend_from_slice(INDEX_MAGIC);
        out.extend_from_slice(&INDEX_VERSION.to_le_bytes());
        out.push(self.dtype.code());
        out.extend_from_slice(&(sequences as u64).to_le_bytes());
        out.extend_from_slice(&(self.document_indices.len() as u64).to_le_bytes());
        for length in &self.sequence_lengths {
            out.extend_from_slice(&length.to_le_bytes());
        }
        let mut pointer = 0i64;
        for &length in &self.sequence_lengths {
            out.extend_from_slice(&pointer.to_le_bytes());
            pointer += length as i64 * self.dtype.size() as i64;
        }
        for index in &self.document_indices {
            out.extend_from_slice(&index.to_le_bytes());
        }
        if let Some(modes) = &self.sequence_modes {
            out.extend(modes.iter().map(|&m| m as u8));
        }
        out
    }
}
