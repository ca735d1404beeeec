//! The checkpoint root directory: one directory per saved iteration (`iter_0000100`), a
//! `latest` pointer, temporary directories for saves in progress, and keeping the last K.
//!
//! A save is written into `.tmp.iter_0000100` and renamed to `iter_0000100` only when every
//! rank's files and the metadata are complete; `latest` is then replaced atomically (written
//! to a temporary file, synced, renamed). A crash at any point leaves the previous
//! checkpoint, and `latest` pointing at it, untouched; the partial temporary directory is
//! never read and is removed by the next save.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::metadata::METADATA_FILE;
use crate::error::CheckpointError;

/// The pointer file naming the newest complete checkpoint directory.
pub const LATEST_FILE: &str = "latest";

const PREFIX: &str = "iter_";
const TEMP_PREFIX: &str = ".tmp.";

/// The directory name of iteration `iteration`'s checkpoint.
pub fn checkpoint_name(iteration: u64) -> String {
    format!("{PREFIX}{iteration:07}")
}

/// The temporary directory a save of `iteration` writes into.
pub(crate) fn temp_dir(root: &Path, iteration: u64) -> PathBuf {
    root.join(format!("{TEMP_PREFIX}{}", checkpoint_name(iteration)))
}

/// Writes `bytes` to `path` atomically: into a temporary file beside it, synced, then renamed
/// over `path`.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let tmp = temp_file(path);
    write_synced(&tmp, bytes)?;
    fs::rename(&tmp, path).map_err(|e| CheckpointError::io(path, "rename it into place", e))
}

/// The temporary file beside `path` that an atomic write of `path` goes through.
pub(crate) fn temp_file(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!("{TEMP_PREFIX}{name}"))
}

/// Syncs the finished file `tmp` (from [`temp_file`]) and renames it over `path`.
pub(crate) fn publish_file(tmp: &Path, path: &Path) -> Result<(), CheckpointError> {
    fs::File::open(tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| CheckpointError::io(tmp, "sync it", e))?;
    fs::rename(tmp, path).map_err(|e| CheckpointError::io(path, "rename it into place", e))
}

/// Writes `bytes` to `path` and syncs it to disk.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut file = fs::File::create(path).map_err(|e| CheckpointError::io(path, "create it", e))?;
    file.write_all(bytes)
        .and_then(|_| file.sync_all())
        .map_err(|e| CheckpointError::io(path, "write it", e))
}

/// Syncs a directory, so that renames and new files in it survive a crash.
pub(crate) fn sync_dir(dir: &Path) {
    // Not every platform can open a directory; the rename itself is still atomic there.
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// The complete checkpoints under `root` (those with a metadata file), oldest first, as
/// `(iteration, directory)`. Temporary directories of unfinished saves are left out.
pub fn list_checkpoints(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(CheckpointError::io(root, "list it", e)),
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(iteration) = name
            .strip_prefix(PREFIX)
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        if entry.path().join(METADATA_FILE).is_file() {
            found.push((iteration, entry.path()));
        }
    }
    found.sort();
    Ok(found)
}

/// The newest complete checkpoint under `root`: the one `latest` names, or, if the pointer
/// is missing or names no complete checkpoint, the highest complete iteration. `None` when
/// there is none.
pub fn latest_checkpoint(root: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    if let Ok(name) = fs::read_to_string(root.join(LATEST_FILE)) {
        let dir = root.join(name.trim());
        if dir.join(METADATA_FILE).is_file() {
            return Ok(Some(dir));
        }
    }
    Ok(list_checkpoints(root)?.pop().map(|(_, dir)| dir))
}

/// Removes temporary directories of unfinished saves under `root`.
pub fn remove_partial_saves(root: &Path) -> Result<(), CheckpointError> {
    let Ok(entries) = fs::read_dir(root) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(&format!("{TEMP_PREFIX}{PREFIX}")) && entry.path().is_dir() {
            fs::remove_dir_all(entry.path())
                .map_err(|e| CheckpointError::io(&entry.path(), "remove it", e))?;
        }
    }
    Ok(())
}

/// Removes all but the newest `keep` complete checkpoints under `root` (never the one
/// `latest` names).
pub fn keep_last(root: &Path, keep: usize) -> Result<(), CheckpointError> {
    let latest = latest_checkpoint(root)?;
    let all = list_checkpoints(root)?;
    let excess = all.len().saturating_sub(keep.max(1));
    for (_, dir) in all.into_iter().take(excess) {
        if Some(&dir) != latest.as_ref() {
            fs::remove_dir_all(&dir).map_err(|e| CheckpointError::io(&dir, "remove it", e))?;
        }
    }
    Ok(())
}
