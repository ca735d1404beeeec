//! Page-locked host buffers for large reads, kept in a pool and handed out as [`Bytes`].
//!
//! Why: a device-to-host copy into ordinary (pageable) memory goes through the driver's own
//! staging buffer, and a fresh `Vec` takes a page fault per 4 KiB page on top; a checkpoint's
//! reads of a model's parameters then run at about 1 GB/s. Into page-locked memory the copy
//! engine writes directly, at the link's speed. Locking pages is itself slow (it touches
//! them all), so buffers are allocated once and reused: a [`Bytes`] read into one returns it
//! to the pool when dropped, and the next save of the same model finds buffers of its sizes.
//!
//! The pool is bounded (an eighth of the host's memory, at most 32 GiB, or
//! `BM_PINNED_HOST_MIB`); a read that does not fit in it gets pageable memory.

use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex, PoisonError};

use cubecl_common::bytes::{AllocationController, AllocationProperty, Bytes};
use cudarc::driver::sys::{
    CU_MEMHOSTALLOC_PORTABLE, CUcontext, cuCtxSetCurrent, cuMemFreeHost, cuMemHostAlloc,
};

use super::driver::check;

/// Reads smaller than this go to pageable memory: locking pages costs more than it saves.
pub const PINNED_MIN_BYTES: usize = 1 << 20;

/// Buffers are allocated in multiples of this, so that reads of nearby sizes share them.
const GRANULE: usize = 2 << 20;

/// Alignment of every buffer: the driver returns page-aligned memory.
const ALIGN: usize = 4096;

/// The most a device's pool locks by default (see [`default_limit`]); `BM_PINNED_HOST_MIB`
/// overrides it.
const DEFAULT_LIMIT: usize = 32 << 30;

/// An eighth of the host's memory (so that eight GPUs' pools lock at most all of it
/// together), at most [`DEFAULT_LIMIT`]; [`DEFAULT_LIMIT`] where the host's memory is unknown.
fn default_limit() -> usize {
    let total_kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| {
            let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<usize>().ok()
        });
    total_kib
        .map_or(DEFAULT_LIMIT, |kib| (kib << 10) / 8)
        .min(DEFAULT_LIMIT)
}

/// One page-locked allocation.
struct Block {
    ptr: *mut u8,
    capacity: usize,
}

// SAFETY: a block is plain host memory owned by whoever holds the `Block`.
unsafe impl Send for Block {}

/// A device's pool of page-locked buffers; clones share it.
#[derive(Clone)]
pub struct PinnedPool(Arc<Pool>);

struct Pool {
    context: CUcontext,
    limit: usize,
    state: Mutex<PoolState>,
}

// SAFETY: the context handle is only used to make it current before freeing; the state is
// behind its mutex.
unsafe impl Send for Pool {}
unsafe impl Sync for Pool {}

#[derive(Default)]
struct PoolState {
    free: Vec<Block>,
    /// Bytes allocated, free or lent.
    allocated: usize,
}

impl PinnedPool {
    /// An empty pool whose buffers belong to `context`.
    pub fn new(context: CUcontext) -> Self {
        let limit = std::env::var("BM_PINNED_HOST_MIB")
            .ok()
            .and_then(|mib| mib.parse::<usize>().ok())
            .map_or_else(default_limit, |mib| mib << 20);
        Self(Arc::new(Pool {
            context,
            limit,
            state: Mutex::new(PoolState::default()),
        }))
    }

    /// A page-locked buffer of at least `len` bytes: the smallest free one that fits (and
    /// wastes at most as much as it holds), else a new one. `None` when `len` is small, when a
    /// new one would pass the limit, or when the driver cannot lock the pages. Any thread may
    /// call it; pages are locked outside the pool's lock.
    pub fn take(&self, len: usize) -> Option<PinnedBytes> {
        if len < PINNED_MIN_BYTES {
            return None;
        }
        let capacity = {
            let mut state = self.state();
            let fits = |b: &Block| b.capacity >= len && b.capacity <= 2 * len;
            let best = (state.free.iter().enumerate())
                .filter(|(_, b)| fits(b))
                .min_by_key(|(_, b)| b.capacity)
                .map(|(i, _)| i);
            if let Some(i) = best {
                let block = state.free.swap_remove(i);
                return Some(self.lend(block));
            }
            let capacity = len.next_multiple_of(GRANULE);
            // Free buffers that did not fit go back to the driver before the limit is hit.
            while state.allocated + capacity > self.0.limit && !state.free.is_empty() {
                let block = state.free.swap_remove(0);
                state.allocated -= block.capacity;
                self.0.free(block);
            }
            if state.allocated + capacity > self.0.limit {
                return None;
            }
            state.allocated += capacity;
            capacity
        };
        let mut ptr = core::ptr::null_mut();
        // SAFETY: allocates host memory in the pool's context, made current here (a reader
        // thread of a checkpoint may have none current).
        let result = unsafe {
            let _ = cuCtxSetCurrent(self.0.context);
            cuMemHostAlloc(&mut ptr, capacity, CU_MEMHOSTALLOC_PORTABLE)
        };
        if check(result, "cuMemHostAlloc").is_err() {
            self.state().allocated -= capacity;
            return None;
        }
        Some(self.lend(Block {
            ptr: ptr.cast(),
            capacity,
        }))
    }

    /// Locks buffers of `sizes` bytes ahead of the reads that will need them (a save's), and
    /// keeps them free in the pool; sizes it cannot lock are skipped.
    pub fn prepare(&self, sizes: &[usize]) {
        let lent: Vec<PinnedBytes> = sizes.iter().filter_map(|&len| self.take(len)).collect();
        drop(lent);
    }

    fn lend(&self, block: Block) -> PinnedBytes {
        PinnedBytes {
            block: Some(block),
            pool: self.clone(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.0.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn give_back(&self, block: Block) {
        self.state().free.push(block);
    }
}

impl Pool {
    fn free(&self, block: Block) {
        // SAFETY: the block was allocated by cuMemHostAlloc in `context`, and nobody holds it.
        unsafe {
            let _ = cuCtxSetCurrent(self.context);
            let _ = cuMemFreeHost(block.ptr.cast());
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let free = core::mem::take(
            &mut self
                .state
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner)
                .free,
        );
        for block in free {
            self.free(block);
        }
    }
}

/// A buffer lent by a [`PinnedPool`]; it goes back to the pool when dropped.
pub struct PinnedBytes {
    block: Option<Block>,
    pool: PinnedPool,
}

impl PinnedBytes {
    /// The buffer's address, for a copy into it.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.block().ptr
    }

    /// The buffer as [`Bytes`] whose first `len` bytes are its content.
    ///
    /// # Safety
    /// The first `len` bytes must have been written (a completed copy into it).
    pub unsafe fn into_bytes(self, len: usize) -> Bytes {
        assert!(
            len <= self.block().capacity,
            "more bytes than the buffer holds"
        );
        // SAFETY: per this function's contract.
        unsafe { Bytes::from_controller(Box::new(self), len) }
    }

    fn block(&self) -> &Block {
        self.block.as_ref().expect("a lent buffer until dropped")
    }
}

impl Drop for PinnedBytes {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            self.pool.give_back(block);
        }
    }
}

impl AllocationController for PinnedBytes {
    fn alloc_align(&self) -> usize {
        ALIGN
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Pinned
    }

    unsafe fn memory_mut(&mut self) -> &mut [MaybeUninit<u8>] {
        let block = self.block();
        // SAFETY: the block is `capacity` bytes of host memory this controller alone holds.
        unsafe { core::slice::from_raw_parts_mut(block.ptr.cast(), block.capacity) }
    }

    fn memory(&self) -> &[MaybeUninit<u8>] {
        let block = self.block();
        // SAFETY: as above.
        unsafe { core::slice::from_raw_parts(block.ptr.cast(), block.capacity) }
    }
}
