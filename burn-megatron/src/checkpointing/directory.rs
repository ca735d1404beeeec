//! The checkpoint root directory: one directory per saved iteration (`iter_0000100`), a
//! `latest` hint, the temporary directories of saves in progress, and keeping the last K.
//!
//! # The publish protocol
//!
//! Every rank writes its files into `.tmp.iter_N`, each file synced. Once all have (an
//! agreement over the world), rank 0:
//!
//! 1. writes `metadata.json` into `.tmp.iter_N`, syncs it, syncs the directory;
//! 2. renames `.tmp.iter_N` to `iter_N` and syncs the root: the checkpoint is published. A
//!    re-save (`iter_N` is a complete checkpoint already) exchanges the two directories
//!    atomically instead (Linux's `renameat2(RENAME_EXCHANGE)`), the old checkpoint then in
//!    `.tmp.iter_N`; where the system cannot, it renames `iter_N` to `.old.iter_N` (the root
//!    synced), then `.tmp.iter_N` to `iter_N`;
//! 3. replaces `latest` with the name of the newest complete checkpoint (written to
//!    `.tmp.latest`, synced, renamed, the root synced);
//! 4. discards what the save superseded (the old `iter_N`, the checkpoints beyond keep-last):
//!    each is renamed to `.trash.*`, the root synced, then removed. A failure here is a
//!    warning: the checkpoint is published.
//!
//! A failed sync (of a file or a directory) is an error. A process killed at any point leaves
//! a state that readers interpret as either the previous checkpoint or the new one, never
//! a partial one:
//!
//! - A **complete checkpoint** is a directory `iter_N` holding `metadata.json` (written
//!   last, before the rename), or `.old.iter_N` holding it when `iter_N` does not (a re-save
//!   without the exchange killed between its two renames: the old checkpoint N, moved aside).
//!   Everything else (`.tmp.*`, `.trash.*`, `iter_N` without metadata) is ignored.
//! - The **newest** complete checkpoint is the one of the highest iteration. `latest` is a
//!   hint for people and tools, never trusted: a process killed between steps 2 and 3 leaves
//!   it naming the previous checkpoint, and loaders pick the newest anyway. It never names a
//!   directory that is missing or incomplete, but for that window of a re-save without the
//!   exchange (it names `iter_N` while the checkpoint is in `.old.iter_N`).
//! - **Recovery** ([`remove_partial_saves`], rank 0 at the start of every save): the
//!   temporary and trash directories are removed, an `.old.iter_N` is renamed back to
//!   `iter_N` when that is missing (and removed otherwise), and `latest` is rewritten when it
//!   does not name the newest complete checkpoint.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::metadata::METADATA_FILE;
use crate::error::CheckpointError;

/// The pointer file naming the newest complete checkpoint directory: a hint for people and
/// tools, rewritten by every save; loaders find the newest complete checkpoint themselves.
pub const LATEST_FILE: &str = "latest";

const PREFIX: &str = "iter_";
const TEMP_PREFIX: &str = ".tmp.";
const OLD_PREFIX: &str = ".old.";
const TRASH_PREFIX: &str = ".trash.";

/// The steps of the publish protocol (see the module's documentation), reported to a
/// [`Checkpointer`](super::Checkpointer)'s step hook as each one completes: for tests that
/// kill the process, or fail, at each step.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishStep {
    /// Every rank's files are in the temporary directory; no metadata yet.
    FilesWritten,
    /// `metadata.json` is written and synced, and the temporary directory synced.
    MetadataWritten,
    /// A re-save: the complete `iter_N` it replaces is renamed to `.old.iter_N`.
    OldMovedAside,
    /// The temporary directory is renamed to `iter_N`, the root synced: published.
    Renamed,
    /// `latest`'s new content is written and synced beside it, not renamed yet.
    LatestWritten,
    /// `latest` is replaced, the root synced.
    LatestUpdated,
    /// A superseded directory is renamed to `.trash.*` (the root synced) and is about to be
    /// removed. An error returned here is a failure of that removal.
    Discarding,
}

/// Called on the publishing rank as each [`PublishStep`] completes; an error is handled as a
/// failure of that step.
#[doc(hidden)]
pub type StepHook = fn(PublishStep) -> std::io::Result<()>;

/// Runs `hook` (if any) for `step`, an error naming `path`.
pub(crate) fn run_hook(
    hook: Option<StepHook>,
    step: PublishStep,
    path: &Path,
) -> Result<(), CheckpointError> {
    match hook {
        Some(hook) => hook(step).map_err(|e| CheckpointError::io(path, &format!("{step:?}"), e)),
        None => Ok(()),
    }
}

/// The directory name of iteration `iteration`'s checkpoint.
pub fn checkpoint_name(iteration: u64) -> String {
    format!("{PREFIX}{iteration:07}")
}

/// The temporary directory a save of `iteration` writes into.
pub(crate) fn temp_dir(root: &Path, iteration: u64) -> PathBuf {
    root.join(format!("{TEMP_PREFIX}{}", checkpoint_name(iteration)))
}

/// Where a re-save of `iteration` moves the complete checkpoint it replaces.
pub(crate) fn old_dir(root: &Path, iteration: u64) -> PathBuf {
    root.join(format!("{OLD_PREFIX}{}", checkpoint_name(iteration)))
}

/// Whether `dir` holds a complete checkpoint (its metadata, written last).
pub(crate) fn is_complete(dir: &Path) -> bool {
    dir.join(METADATA_FILE).is_file()
}

/// The iteration a checkpoint directory's name (`iter_0000100`) stands for.
fn parse_iteration(name: &str) -> Option<u64> {
    name.strip_prefix(PREFIX)?.parse().ok()
}

/// The directory `path` is in (`.` for a bare file name).
fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Writes `bytes` to `path` atomically and durably: into a temporary file beside it, synced,
/// renamed over `path`, the directory synced.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let tmp = temp_file(path);
    write_synced(&tmp, bytes)?;
    rename_into_place(&tmp, path)
}

/// The temporary file beside `path` that an atomic write of `path` goes through.
pub(crate) fn temp_file(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!("{TEMP_PREFIX}{name}"))
}

/// Syncs the finished file `tmp` (from [`temp_file`]), renames it over `path` and syncs the
/// directory.
pub(crate) fn publish_file(tmp: &Path, path: &Path) -> Result<(), CheckpointError> {
    fs::File::open(tmp)
        .and_then(|f| f.sync_all())
        .map_err(|e| CheckpointError::io(tmp, "sync it", e))?;
    rename_into_place(tmp, path)
}

/// Renames the synced `tmp` over `path` and syncs the directory, so that the rename survives
/// a crash.
pub(crate) fn rename_into_place(tmp: &Path, path: &Path) -> Result<(), CheckpointError> {
    fs::rename(tmp, path).map_err(|e| CheckpointError::io(path, "rename it into place", e))?;
    sync_dir(parent(path))
}

/// Writes `bytes` to `path` and syncs it to disk.
pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), CheckpointError> {
    let mut file = fs::File::create(path).map_err(|e| CheckpointError::io(path, "create it", e))?;
    file.write_all(bytes)
        .map_err(|e| CheckpointError::io(path, "write it", e))?;
    file.sync_all()
        .map_err(|e| CheckpointError::io(path, "sync it", e))
}

/// Syncs a directory, so that renames and new files in it survive a crash. A failure is an
/// error naming the directory. (Only on Unix: elsewhere a directory cannot be opened to be
/// synced, and the renames themselves are what is atomic.)
pub(crate) fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    #[cfg(unix)]
    {
        let d = fs::File::open(dir)
            .map_err(|e| CheckpointError::io(dir, "open the directory to sync it", e))?;
        d.sync_all()
            .map_err(|e| CheckpointError::io(dir, "sync the directory", e))?;
    }
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}

/// Exchanges the directories `a` and `b` atomically (Linux's `renameat2` with
/// `RENAME_EXCHANGE`): `Ok(false)` where the kernel or the file system cannot.
pub(crate) fn exchange(a: &Path, b: &Path) -> Result<bool, CheckpointError> {
    #[cfg(target_os = "linux")]
    {
        use std::ffi::CString;
        use std::os::unix::ffi::OsStrExt;
        let path = |p: &Path| {
            CString::new(p.as_os_str().as_bytes())
                .map_err(|_| CheckpointError::file(p, "the path holds a NUL byte"))
        };
        let (ca, cb) = (path(a)?, path(b)?);
        // SAFETY: two NUL-terminated paths that live through the call.
        let rc = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                ca.as_ptr(),
                libc::AT_FDCWD,
                cb.as_ptr(),
                libc::RENAME_EXCHANGE,
            )
        };
        if rc == 0 {
            return Ok(true);
        }
        let error = std::io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP) => Ok(false),
            _ => Err(CheckpointError::io(
                b,
                "exchange it with the new save",
                error,
            )),
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (a, b);
        Ok(false)
    }
}

/// Creates `root` if needed (its parent synced, so that it survives a crash).
pub(crate) fn create_root(root: &Path) -> Result<(), CheckpointError> {
    if root.is_dir() {
        return Ok(());
    }
    fs::create_dir_all(root).map_err(|e| CheckpointError::io(root, "create it", e))?;
    sync_dir(parent(root))
}

/// The complete checkpoints under `root`, oldest first, as `(iteration, directory)`:
/// each `iter_N` with a metadata file, and an `.old.iter_N` with one where `iter_N` has none
/// (the checkpoint a re-save moved aside when the process was killed before renaming the new
/// one in). Temporary directories of unfinished saves are left out.
pub fn list_checkpoints(root: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointError> {
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(CheckpointError::io(root, "list it", e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| CheckpointError::io(root, "list it", e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if let Some(iteration) = parse_iteration(&name) {
            if is_complete(&path) {
                found.push((iteration, path));
            }
        } else if let Some(current) = name.strip_prefix(OLD_PREFIX)
            && let Some(iteration) = parse_iteration(current)
            && is_complete(&path)
            && !is_complete(&root.join(current))
        {
            found.push((iteration, path));
        }
    }
    found.sort();
    Ok(found)
}

/// The newest complete checkpoint under `root`: the complete checkpoint (see
/// [`list_checkpoints`]) of the highest iteration, `None` when there is none. The `latest`
/// file is not trusted: a save killed after publishing its directory and before updating
/// `latest` leaves it naming the previous checkpoint, and a hand-edited one may name anything.
pub fn latest_checkpoint(root: &Path) -> Result<Option<PathBuf>, CheckpointError> {
    Ok(list_checkpoints(root)?.pop().map(|(_, dir)| dir))
}

/// Repairs what a killed save left under `root`: removes the temporary directories of
/// unfinished saves (`.tmp.iter_*`), the trash of an interrupted removal (`.trash.*`) and a
/// half-written `latest` (`.tmp.latest`); puts back the checkpoint a killed re-save moved
/// aside (`.old.iter_N` renamed to `iter_N` when `iter_N` is not complete, removed when it
/// is); rewrites `latest` when it does not name the newest complete checkpoint. Not safe to
/// run while a save is in progress under `root`.
pub fn remove_partial_saves(root: &Path) -> Result<(), CheckpointError> {
    let entries = match fs::read_dir(root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(CheckpointError::io(root, "list it", e)),
    };
    let latest_tmp = format!("{TEMP_PREFIX}{LATEST_FILE}");
    let mut changed = false;
    for entry in entries {
        let entry = entry.map_err(|e| CheckpointError::io(root, "list it", e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if let Some(current) = name.strip_prefix(OLD_PREFIX)
            && parse_iteration(current).is_some()
        {
            let current = root.join(current);
            if is_complete(&path) && !is_complete(&current) {
                if current.exists() {
                    remove(&current)?;
                }
                fs::rename(&path, &current).map_err(|e| {
                    CheckpointError::io(&current, "move the old checkpoint back", e)
                })?;
            } else {
                remove(&path)?;
            }
            changed = true;
        } else if name.starts_with(&format!("{TEMP_PREFIX}{PREFIX}"))
            || name.starts_with(TRASH_PREFIX)
            || name == latest_tmp
        {
            remove(&path)?;
            changed = true;
        }
    }
    if changed {
        sync_dir(root)?;
    }
    repair_latest(root)
}

/// Removes the file or directory `path`.
fn remove(path: &Path) -> Result<(), CheckpointError> {
    let removed = if path.is_dir() {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    };
    removed.map_err(|e| CheckpointError::io(path, "remove it", e))
}

/// Points `latest` at the newest complete checkpoint if it names anything else (removes it
/// when there is none).
fn repair_latest(root: &Path) -> Result<(), CheckpointError> {
    let latest = root.join(LATEST_FILE);
    let current = fs::read_to_string(&latest).ok();
    match latest_checkpoint(root)? {
        Some(newest) => {
            let name = newest
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if current.as_deref().map(str::trim) != Some(name.as_str()) {
                write_atomic(&latest, name.as_bytes())?;
            }
        }
        None if latest.exists() => {
            remove(&latest)?;
            sync_dir(root)?;
        }
        None => {}
    }
    Ok(())
}

/// Removes the superseded checkpoint directory `dir` under `root` so that no crash leaves
/// a half-removed directory that looks complete: renamed to `.trash.*`, the root synced, then
/// removed.
pub(crate) fn discard(
    root: &Path,
    dir: &Path,
    hook: Option<StepHook>,
) -> Result<(), CheckpointError> {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let trash = root.join(format!("{TRASH_PREFIX}{}", name.trim_start_matches('.')));
    if trash.exists() {
        remove(&trash)?;
    }
    fs::rename(dir, &trash).map_err(|e| CheckpointError::io(dir, "move it to the trash", e))?;
    sync_dir(root)?;
    run_hook(hook, PublishStep::Discarding, &trash)?;
    remove(&trash)
}

/// Removes all but the newest `keep` complete checkpoints under `root` (never the newest).
pub fn keep_last(root: &Path, keep: usize) -> Result<(), CheckpointError> {
    let errors = keep_last_except(root, keep, None, None)?;
    match errors.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Removes all but the newest `keep` complete checkpoints under `root`, never the newest nor
/// `protect`; the removals that failed (each tried).
pub(crate) fn keep_last_except(
    root: &Path,
    keep: usize,
    protect: Option<&Path>,
    hook: Option<StepHook>,
) -> Result<Vec<CheckpointError>, CheckpointError> {
    let all = list_checkpoints(root)?;
    let newest = all.last().map(|(_, dir)| dir.clone());
    let excess = all.len().saturating_sub(keep.max(1));
    let mut errors = Vec::new();
    for (_, dir) in all.into_iter().take(excess) {
        if Some(&dir) == newest.as_ref() || Some(dir.as_path()) == protect {
            continue;
        }
        if let Err(e) = discard(root, &dir, hook) {
            errors.push(e);
        }
    }
    Ok(errors)
}
