//! Megatron's indexed dataset: a `.bin` file of tokens and an `.idx` file that says where each
//! sequence lies, read through memory maps (Megatron-Core's `IndexedDataset`).
//!
//! The `.idx` layout, all integers little-endian, exactly as Megatron-Core's `_IndexWriter`
//! writes it:
//!
//! | bytes | what |
//! |---|---|
//! | 9 | magic `b"MMIDIDX\x00\x00"` |
//! | 8 | version, `u64` = 1 |
//! | 1 | dtype code ([`DType::code`]) |
//! | 8 | sequence count `S`, `u64` |
//! | 8 | document count `D + 1`, `u64` (the document indices, a leading 0 included) |
//! | 4·S | sequence lengths in tokens, `i32` |
//! | 8·S | sequence pointers: byte offsets into `.bin`, `i64` |
//! | 8·(D+1) | document indices: document `d` is sequences `idx[d]..idx[d+1]`, `i64` |
//! | S (optional) | sequence modes, `i8` (Megatron's multimodal datasets) |
//!
//! The `.bin` file is the sequences' tokens back to back in the dtype. A GPT corpus has one
//! sequence per document; Megatron's GPT sampling and splits count sequences.

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::{DType, DataError};

/// The first 9 bytes of every `.idx` file.
pub const INDEX_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// The only `.idx` version.
pub const INDEX_VERSION: u64 = 1;
/// Bytes of the `.idx` header: magic, version, dtype code, two counts.
pub const INDEX_HEADER_LEN: usize = 9 + 8 + 1 + 8 + 8;

/// `prefix.idx` (Megatron's `get_idx_path`): the suffix is appended, so dots in the prefix
/// stay.
pub fn index_file_path(prefix: impl AsRef<Path>) -> PathBuf {
    with_suffix(prefix.as_ref(), ".idx")
}

/// `prefix.bin` (Megatron's `get_bin_path`).
pub fn data_file_path(prefix: impl AsRef<Path>) -> PathBuf {
    with_suffix(prefix.as_ref(), ".bin")
}

fn with_suffix(prefix: &Path, suffix: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// A read-only file's bytes: memory-mapped, or empty (an empty file cannot be mapped).
#[derive(Debug)]
enum FileBytes {
    Mapped(Mmap),
    Empty,
}

impl FileBytes {
    fn open(path: &Path) -> Result<Self, DataError> {
        let file = File::open(path).map_err(|e| DataError::io(path, "open", e))?;
        let len = file
            .metadata()
            .map_err(|e| DataError::io(path, "read the metadata of", e))?
            .len();
        if len == 0 {
            return Ok(FileBytes::Empty);
        }
        // SAFETY: the map is read-only and private to this reader. Like every reader of
        // memory-mapped files (Megatron's NumPy memmap included), it assumes that no other
        // process truncates or rewrites the file while it is open.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(path, "memory-map", e))?;
        Ok(FileBytes::Mapped(map))
    }

    fn bytes(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(map) => map,
            FileBytes::Empty => &[],
        }
    }
}

/// A Megatron indexed dataset (`prefix.idx` + `prefix.bin`), memory-mapped and checked.
///
/// [`open`](Self::open) checks the whole index against itself and against the `.bin` file's
/// length, so every later read is in bounds: a malformed pair is a [`DataError`] naming the
/// file, never a panic or garbage tokens.
#[derive(Debug)]
pub struct IndexedDataset {
    idx_path: PathBuf,
    bin_path: PathBuf,
    idx: FileBytes,
    bin: FileBytes,
    dtype: DType,
    sequence_count: usize,
    document_count: usize,
    has_modes: bool,
}

impl IndexedDataset {
    /// Opens `prefix.idx` and `prefix.bin` and checks them.
    pub fn open(prefix: impl AsRef<Path>) -> Result<Self, DataError> {
        let prefix = prefix.as_ref();
        Self::open_files(index_file_path(prefix), data_file_path(prefix))
    }

    /// Opens an index and a data file of any names and checks them.
    pub fn open_files(
        idx_path: impl Into<PathBuf>,
        bin_path: impl Into<PathBuf>,
    ) -> Result<Self, DataError> {
        let idx_path = idx_path.into();
        let bin_path = bin_path.into();
        let idx = FileBytes::open(&idx_path)?;
        let bin = FileBytes::open(&bin_path)?;
        let header = Header::parse(&idx_path, idx.bytes())?;
        let dataset = IndexedDataset {
            idx_path,
            bin_path,
            idx,
            bin,
            dtype: header.dtype,
            sequence_count: header.sequence_count,
            document_count: header.document_count,
            has_modes: header.has_modes,
        };
        dataset.check_sequences()?;
        dataset.check_documents()?;
        Ok(dataset)
    }

    /// The `.idx` file.
    pub fn index_path(&self) -> &Path {
        &self.idx_path
    }

    /// The `.bin` file.
    pub fn data_path(&self) -> &Path {
        &self.bin_path
    }

    /// The tokens' dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of sequences (Megatron's `len(dataset)`).
    pub fn len(&self) -> usize {
        self.sequence_count
    }

    /// Whether there are no sequences.
    pub fn is_empty(&self) -> bool {
        self.sequence_count == 0
    }

    /// Number of documents (one less than the `.idx` header's document count).
    pub fn num_documents(&self) -> usize {
        self.document_count - 1
    }

    /// Tokens of sequence `i`.
    pub fn sequence_length(&self, i: usize) -> Result<usize, DataError> {
        self.check_sequence_index(i)?;
        Ok(self.length_at(i) as usize)
    }

    /// All sequence lengths, in tokens.
    pub fn sequence_lengths(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        (0..self.sequence_count).map(|i| self.length_at(i) as usize)
    }

    /// Byte offset of sequence `i` in the `.bin` file.
    pub fn sequence_pointer(&self, i: usize) -> Result<u64, DataError> {
        self.check_sequence_index(i)?;
        Ok(self.pointer_at(i) as u64)
    }

    /// The document indices as stored: `D + 1` values from 0 to the sequence count.
    pub fn document_indices(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        (0..self.document_count).map(|d| self.document_at(d) as usize)
    }

    /// The sequences of document `d`.
    pub fn document_sequences(&self, d: usize) -> Result<Range<usize>, DataError> {
        if d >= self.num_documents() {
            return Err(DataError::IndexOutOfRange {
                what: "document",
                index: d,
                len: self.num_documents(),
            });
        }
        Ok(self.document_at(d) as usize..self.document_at(d + 1) as usize)
    }

    /// The mode of sequence `i` in a multimodal dataset (Megatron's `sequence_modes`); `None`
    /// where the index has no modes.
    pub fn sequence_mode(&self, i: usize) -> Result<Option<i8>, DataError> {
        self.check_sequence_index(i)?;
        if !self.has_modes {
            return Ok(None);
        }
        let at = self.modes_offset() + i;
        Ok(Some(self.idx.bytes()[at] as i8))
    }

    /// The tokens of sequence `i`.
    pub fn get(&self, i: usize) -> Result<Vec<i64>, DataError> {
        let len = self.sequence_length(i)?;
        self.get_range(i, 0, len)
    }

    /// `length` tokens of sequence `i` from token `offset` (Megatron's `get(idx, offset,
    /// length)`).
    pub fn get_range(&self, i: usize, offset: usize, length: usize) -> Result<Vec<i64>, DataError> {
        let mut out = Vec::with_capacity(length);
        self.read_into(i, offset, length, &mut out)?;
        Ok(out)
    }

    /// Appends `length` tokens of sequence `i` from token `offset` to `out`.
    pub fn read_into(
        &self,
        i: usize,
        offset: usize,
        length: usize,
        out: &mut Vec<i64>,
    ) -> Result<(), DataError> {
        let seq_len = self.sequence_length(i)?;
        if !self.dtype.is_integer() {
            return Err(DataError::TokenDType {
                value: 0,
                dtype: self.dtype,
                hint: "this dataset holds floating-point values, not token ids",
            });
        }
        let end = offset.checked_add(length).filter(|&e| e <= seq_len);
        let Some(end) = end else {
            return Err(DataError::IndexOutOfRange {
                what: "token (offset + length) of the sequence",
                index: offset.saturating_add(length),
                len: seq_len,
            });
        };
        let size = self.dtype.size();
        let start = self.pointer_at(i) as usize + offset * size;
        // In bounds: `open` checked pointer + length · size against the file's length.
        let bytes = &self.bin.bytes()[start..start + (end - offset) * size];
        self.dtype.decode(bytes, out);
        Ok(())
    }

    fn check_sequence_index(&self, i: usize) -> Result<(), DataError> {
        if i >= self.sequence_count {
            return Err(DataError::IndexOutOfRange {
                what: "sequence",
                index: i,
                len: self.sequence_count,
            });
        }
        Ok(())
    }

    fn lengths_offset(&self) -> usize {
        INDEX_HEADER_LEN
    }

    fn pointers_offset(&self) -> usize {
        self.lengths_offset() + 4 * self.sequence_count
    }

    fn documents_offset(&self) -> usize {
        self.pointers_offset() + 8 * self.sequence_count
    }

    fn modes_offset(&self) -> usize {
        self.documents_offset() + 8 * self.document_count
    }

    fn length_at(&self, i: usize) -> i32 {
        let at = self.lengths_offset() + 4 * i;
        i32::from_le_bytes(array(&self.idx.bytes()[at..at + 4]))
    }

    fn pointer_at(&self, i: usize) -> i64 {
        let at = self.pointers_offset() + 8 * i;
        i64::from_le_bytes(array(&self.idx.bytes()[at..at + 8]))
    }

    fn document_at(&self, d: usize) -> i64 {
        let at = self.documents_offset() + 8 * d;
        i64::from_le_bytes(array(&self.idx.bytes()[at..at + 8]))
    }

    /// Every sequence has a non-negative length and lies inside the `.bin` file.
    fn check_sequences(&self) -> Result<(), DataError> {
        let bin_len = self.bin.bytes().len() as u64;
        let size = self.dtype.size();
        for i in 0..self.sequence_count {
            let length = self.length_at(i);
            let pointer = self.pointer_at(i);
            let end = (pointer >= 0 && length >= 0)
                .then(|| (pointer as u64).checked_add(length as u64 * size as u64))
                .flatten();
            if end.is_none_or(|end| end > bin_len) {
                return Err(DataError::SequenceOutOfRange {
                    path: self.bin_path.clone(),
                    sequence: i,
                    pointer,
                    length,
                    item_size: size,
                    bin_len,
                });
            }
        }
        Ok(())
    }

    /// The document indices start at 0, never decrease and end at the sequence count.
    fn check_documents(&self) -> Result<(), DataError> {
        let problem = |problem: String| {
            Err(DataError::InconsistentIndex {
                path: self.idx_path.clone(),
                problem,
            })
        };
        let first = self.document_at(0);
        if first != 0 {
            return problem(format!("the document indices start at {first}, not 0"));
        }
        let mut previous = 0;
        for d in 1..self.document_count {
            let index = self.document_at(d);
            if index < previous {
                return problem(format!(
                    "document index {d} ({index}) is below the one before it ({previous})"
                ));
            }
            previous = index;
        }
        if previous != self.sequence_count as i64 {
            return problem(format!(
                "the last document index is {previous}, but there are {} sequences",
                self.sequence_count
            ));
        }
        Ok(())
    }
}

fn array<const N: usize>(bytes: &[u8]) -> [u8; N] {
    let mut out = [0; N];
    out.copy_from_slice(bytes);
    out
}

/// The `.idx` header, checked against the file's length.
struct Header {
    dtype: DType,
    sequence_count: usize,
    document_count: usize,
    has_modes: bool,
}

impl Header {
    fn parse(path: &Path, bytes: &[u8]) -> Result<Self, DataError> {
        let len = bytes.len() as u64;
        let magic_seen = &bytes[..bytes.len().min(INDEX_MAGIC.len())];
        if magic_seen != &INDEX_MAGIC[..magic_seen.len()] {
            return Err(DataError::BadMagic {
                path: path.to_path_buf(),
                found: magic_seen.to_vec(),
            });
        }
        if bytes.len() < INDEX_HEADER_LEN {
            return Err(DataError::Truncated {
                path: path.to_path_buf(),
                what: "header",
                needed: 0..INDEX_HEADER_LEN as u64,
                len,
            });
        }
        let version = u64::from_le_bytes(array(&bytes[9..17]));
        if version != INDEX_VERSION {
            return Err(DataError::BadVersion {
                path: path.to_path_buf(),
                version,
            });
        }
        let code = bytes[17];
        let dtype = DType::from_code(code).ok_or(DataError::UnknownDType {
            path: path.to_path_buf(),
            code,
        })?;
        let sequences = u64::from_le_bytes(array(&bytes[18..26]));
        let documents = u64::from_le_bytes(array(&bytes[26..34]));
        if documents == 0 {
            return Err(DataError::InconsistentIndex {
                path: path.to_path_buf(),
                problem: "the document count is 0; Megatron's document indices hold at least \
                          the leading 0"
                    .into(),
            });
        }
        // u128: the counts come from the file and may be anything up to 2⁶⁴ - 1.
        let parts: [(&'static str, u128); 3] = [
            ("sequence lengths", 4 * sequences as u128),
            ("sequence pointers", 8 * sequences as u128),
            ("document indices", 8 * documents as u128),
        ];
        let mut end = INDEX_HEADER_LEN as u128;
        for (what, size) in parts {
            let start = end;
            end += size;
            if end > len as u128 {
                return Err(DataError::Truncated {
                    path: path.to_path_buf(),
                    what,
                    needed: clamp(start)..clamp(end),
                    len,
                });
            }
        }
        // The counts fit in the file, so they fit in usize.
        let (sequence_count, document_count) = (sequences as usize, documents as usize);
        let trailing = len as u128 - end;
        let has_modes = match trailing {
            0 => false,
            t if t == sequences as u128 && sequences > 0 => true,
            t => {
                return Err(DataError::InconsistentIndex {
                    path: path.to_path_buf(),
                    problem: format!(
                        "{t} bytes follow the document indices: expected none, or one mode \
                         byte per sequence ({sequences})"
                    ),
                });
            }
        };
        Ok(Header {
            dtype,
            sequence_count,
            document_count,
            has_modes,
        })
    }
}

fn clamp(x: u128) -> u64 {
    x.min(u64::MAX as u128) as u64
}
