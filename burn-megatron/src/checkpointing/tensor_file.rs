//! A checkpoint's data file: safetensors, written in one pass together with its size, its
//! CRC-32 and a CRC-32 per block, and read memory-mapped, checking only the blocks a read
//! touches.
//!
//! Why blocks: a rank loading a checkpoint saved in another layout needs only some slices of
//! a file (its layers under PP, its rows, its distributed-optimizer range). With one checksum
//! per file it would have to read the whole file to trust any of it; with one per block it
//! reads, and checks, only the blocks that hold its slices.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use burn::tensor::TensorData;
use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};

use super::metadata::FileEntry;
use crate::error::CheckpointError;
use crate::error::Result;

/// The default block of [`FileEntry::block_crc32`]: small enough that a partial read checks
/// little beyond what it needs, large enough that the metadata stays small (4 KiB of JSON per
/// GiB).
pub const CHECKSUM_BLOCK_BYTES: usize = 1 << 20;

/// One tensor to write: its safetensors dtype, shape and bytes.
pub(crate) struct Blob {
    pub dtype: safetensors::Dtype,
    pub shape: Vec<usize>,
    pub bytes: BlobBytes,
}

/// A blob's bytes: a whole host tensor or a contiguous range of its bytes (no copy), or bytes
/// cut out of one.
pub(crate) enum BlobBytes {
    Data(TensorData),
    Range(TensorData, Range<usize>),
    Owned(Vec<u8>),
}

impl Blob {
    fn bytes(&self) -> &[u8] {
        match &self.bytes {
            BlobBytes::Data(data) => data.as_bytes(),
            BlobBytes::Range(data, range) => &data.as_bytes()[range.clone()],
            BlobBytes::Owned(bytes) => bytes,
        }
    }
}

/// Writes `tensors` (name, blob) to `path` as safetensors, synced, and returns its size and
/// checksums (blocks of `block_bytes`). The file is streamed: no second copy of the data is
/// made in memory.
pub(crate) fn write_tensor_file(
    path: &Path,
    mut tensors: Vec<(String, Blob)>,
    block_bytes: usize,
) -> Result<FileEntry> {
    // safetensors' own order: larger elements first (aligned), then by name.
    tensors.sort_by(|(a, x), (b, y)| y.dtype.cmp(&x.dtype).then(a.cmp(b)));
    let mut offset = 0;
    let mut infos = Vec::with_capacity(tensors.len());
    for (name, blob) in &tensors {
        let n = blob.bytes().len();
        infos.push((
            name.clone(),
            TensorInfo {
                dtype: blob.dtype,
                shape: blob.shape.clone(),
                data_offsets: (offset, offset + n),
            },
        ));
        offset += n;
    }
    let encode = |e: String| CheckpointError::file(path, format!("cannot encode safetensors: {e}"));
    let metadata = Metadata::new(None, infos).map_err(|e| encode(e.to_string()))?;
    let mut header = serde_json::to_vec(&metadata).map_err(|e| encode(e.to_string()))?;
    header.resize(header.len().next_multiple_of(8), b' ');

    let file = File::create(path).map_err(|e| CheckpointError::io(path, "create it", e))?;
    let mut out = ChecksumWriter::new(BufWriter::with_capacity(1 << 22, file), block_bytes);
    let written = (|| {
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        for (_, blob) in &tensors {
            out.write_all(blob.bytes())?;
        }
        out.flush()
    })();
    written.map_err(|e| CheckpointError::io(path, "write it", e))?;
    let (file, entry) = out.finish();
    file.into_inner()
        .map_err(|e| CheckpointError::io(path, "write it", e.into_error()))?
        .sync_all()
        .map_err(|e| CheckpointError::io(path, "sync it", e))?;
    Ok(entry)
}

/// Passes bytes through to `inner`, keeping the CRC-32 of every block of `block` bytes.
struct ChecksumWriter<W> {
    inner: W,
    block: usize,
    filled: usize,
    current: crc32fast::Hasher,
    blocks: Vec<crc32fast::Hasher>,
    bytes: u64,
}

impl<W: Write> ChecksumWriter<W> {
    fn new(inner: W, block: usize) -> Self {
        Self {
            inner,
            block: block.max(1),
            filled: 0,
            current: crc32fast::Hasher::new(),
            blocks: Vec::new(),
            bytes: 0,
        }
    }

    /// The writer back, and the file's entry: the whole CRC is the blocks' combined.
    fn finish(mut self) -> (W, FileEntry) {
        if self.filled > 0 {
            self.blocks.push(self.current.clone());
        }
        let mut whole = crc32fast::Hasher::new();
        for block in &self.blocks {
            whole.combine(block);
        }
        let entry = FileEntry {
            bytes: self.bytes,
            crc32: whole.finalize(),
            block_bytes: self.block as u64,
            block_crc32: self.blocks.into_iter().map(|h| h.finalize()).collect(),
        };
        (self.inner, entry)
    }
}

impl<W: Write> Write for ChecksumWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            let take = rest.len().min(self.block - self.filled);
            self.current.update(&rest[..take]);
            self.filled += take;
            rest = &rest[take..];
            if self.filled == self.block {
                let done = std::mem::replace(&mut self.current, crc32fast::Hasher::new());
                self.blocks.push(done);
                self.filled = 0;
            }
        }
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// A data file mapped for reading: its safetensors header (checked and parsed at open), and
/// which blocks have been checked so far. Threads may read and check it at once.
#[derive(Debug)]
pub(crate) struct MappedFile {
    path: PathBuf,
    map: Mmap,
    entry: FileEntry,
    data_start: usize,
    metadata: Metadata,
    checked: Mutex<Vec<bool>>,
    checked_bytes: AtomicU64,
}

impl MappedFile {
    /// Maps `path`, checks its size against `entry`, checks and parses its header. A file
    /// without block checksums (an older checkpoint) is checked whole here.
    pub fn open(path: &Path, entry: &FileEntry) -> Result<Self> {
        let file = File::open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => {
                CheckpointError::file(path, "missing (a shard file of this checkpoint)")
            }
            _ => CheckpointError::io(path, "open it", e),
        })?;
        let len = file
            .metadata()
            .map_err(|e| CheckpointError::io(path, "read its size", e))?
            .len();
        if len != entry.bytes {
            return Err(CheckpointError::file(
                path,
                format!(
                    "truncated or extended: {len} bytes, the metadata says {}",
                    entry.bytes
                ),
            )
            .into());
        }
        // SAFETY: a published checkpoint's files are never written again (a new save writes a
        // new directory), so the mapping's bytes do not change under us.
        let map =
            unsafe { Mmap::map(&file) }.map_err(|e| CheckpointError::io(path, "map it", e))?;
        let blocks = if entry.block_bytes == 0 {
            0
        } else {
            (entry.bytes as usize).div_ceil(entry.block_bytes as usize)
        };
        if entry.block_bytes > 0 && entry.block_crc32.len() != blocks {
            return Err(CheckpointError::file(
                path,
                format!(
                    "the metadata lists {} block checksums, the file has {blocks} blocks",
                    entry.block_crc32.len()
                ),
            )
            .into());
        }
        let mut mapped = Self {
            path: path.to_path_buf(),
            map,
            entry: entry.clone(),
            data_start: 0,
            metadata: Metadata::new(None, Vec::new()).expect("an empty header is valid"),
            checked: Mutex::new(vec![false; blocks]),
            checked_bytes: AtomicU64::new(0),
        };
        if blocks == 0 {
            mapped.check_whole()?;
        }
        let not_safetensors =
            |problem: String| CheckpointError::file(path, format!("not safetensors: {problem}"));
        mapped.check(0..8.min(mapped.map.len()))?;
        let n = mapped
            .map
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            .ok_or_else(|| not_safetensors("shorter than its 8-byte header length".into()))?;
        let header_end = 8usize
            .checked_add(n)
            .filter(|&end| end <= mapped.map.len())
            .ok_or_else(|| not_safetensors(format!("a header of {n} bytes past the end")))?;
        mapped.check(8..header_end)?;
        let (_, metadata) = safetensors::SafeTensors::read_metadata(&mapped.map)
            .map_err(|e| not_safetensors(e.to_string()))?;
        mapped.metadata = metadata;
        mapped.data_start = header_end;
        Ok(mapped)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensor `key`'s description and its data bytes (not yet checked: [`check`](Self::check)
    /// the ranges a read uses).
    pub fn tensor(&self, key: &str) -> Result<(&TensorInfo, &[u8], usize)> {
        let info = self.metadata.info(key).ok_or_else(|| {
            CheckpointError::file(&self.path, format!("no tensor {key} in the file"))
        })?;
        let (start, end) = info.data_offsets;
        let start = self.data_start + start;
        let end = self.data_start + end;
        Ok((info, &self.map[start..end], start))
    }

    /// Checks every not yet checked block overlapping `range` (file offsets) against its
    /// checksum; a mismatch names the file and the bytes. A thread claims the blocks it
    /// checks, so that two threads never check one block twice; a block another thread is
    /// still checking counts as checked (if it fails, that thread's error fails the read).
    pub fn check(&self, range: Range<usize>) -> Result<()> {
        let block = self.entry.block_bytes as usize;
        if block == 0 || range.is_empty() {
            return Ok(());
        }
        let claimed: Vec<usize> = {
            let mut checked = self.checked.lock().unwrap_or_else(|e| e.into_inner());
            (range.start / block..range.end.div_ceil(block))
                .filter(|&b| !std::mem::replace(&mut checked[b], true))
                .collect()
        };
        for (i, &b) in claimed.iter().enumerate() {
            let bytes = &self.map[b * block..((b + 1) * block).min(self.map.len())];
            let crc = crc32fast::hash(bytes);
            let expected = self.entry.block_crc32[b];
            if crc != expected {
                let mut checked = self.checked.lock().unwrap_or_else(|e| e.into_inner());
                for &b in &claimed[i..] {
                    checked[b] = false;
                }
                return Err(CheckpointError::file(
                    &self.path,
                    format!(
                        "corrupt: CRC-32 of bytes {}..{} is {crc:08x}, the metadata says \
                         {expected:08x}",
                        b * block,
                        b * block + bytes.len()
                    ),
                )
                .into());
            }
            self.checked_bytes
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Bytes of the file checked (and so read) so far.
    pub fn checked_bytes(&self) -> u64 {
        self.checked_bytes.load(Ordering::Relaxed)
    }

    fn check_whole(&self) -> Result<()> {
        let crc = crc32fast::hash(&self.map);
        if crc != self.entry.crc32 {
            return Err(CheckpointError::file(
                &self.path,
                format!(
                    "corrupt: CRC-32 {crc:08x}, the metadata says {:08x}",
                    self.entry.crc32
                ),
            )
            .into());
        }
        self.checked_bytes
            .store(self.map.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}
