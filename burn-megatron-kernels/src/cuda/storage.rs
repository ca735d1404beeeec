//! Device memory for CubeCL's memory pools, allocated in stream order on the compute stream
//! (and, while a CUDA graph is captured there, outside it: see [`GpuStorage::set_capturing`]).

use std::collections::HashMap;

use cubecl_common::backtrace::BackTrace;
use cubecl_core::server::IoError;
use cubecl_runtime::storage::{ComputeStorage, StorageHandle, StorageId, StorageUtilization};
use cudarc::driver::sys::{
    CUdeviceptr, CUresult, CUstream, cuMemAlloc_v2, cuMemAllocAsync, cuMemFree_v2, cuMemFreeAsync,
};

/// A slice of device memory: what a binding resolves to.
#[derive(Debug, Clone, Copy)]
pub struct GpuResource {
    /// Device address of the first byte (offsets applied).
    pub ptr: u64,
    /// Length in bytes.
    pub size: u64,
}

/// The pools' backing store: `cuMemAllocAsync` pages on the compute stream, freed with
/// `cuMemFreeAsync` in stream order at the next flush.
pub struct GpuStorage {
    stream: CUstream,
    alignment: usize,
    /// Each page's address, and whether it was allocated outside stream order.
    pages: HashMap<StorageId, (CUdeviceptr, bool)>,
    to_free: Vec<StorageId>,
    capturing: bool,
}

// SAFETY: the storage is owned by the server, which is only used from its device thread.
unsafe impl Send for GpuStorage {}

impl core::fmt::Debug for GpuStorage {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "GpuStorage({} pages)", self.pages.len())
    }
}

impl GpuStorage {
    /// Storage whose allocations are ordered on `stream`.
    pub fn new(stream: CUstream, alignment: usize) -> Self {
        Self {
            stream,
            alignment,
            pages: HashMap::new(),
            to_free: Vec::new(),
            capturing: false,
        }
    }

    /// While the compute stream is captured into a CUDA graph, a `cuMemAllocAsync` there
    /// would become a node of the graph (memory that exists only while the graph runs): pages
    /// are then allocated with `cuMemAlloc`, and nothing is freed until the capture ends.
    pub fn set_capturing(&mut self, capturing: bool) {
        self.capturing = capturing;
    }
}

impl ComputeStorage for GpuStorage {
    type Resource = GpuResource;

    fn alignment(&self) -> usize {
        self.alignment
    }

    fn get(&mut self, handle: &StorageHandle) -> GpuResource {
        let (base, _) = self.pages[&handle.id];
        GpuResource {
            ptr: base + handle.offset(),
            size: handle.size(),
        }
    }

    fn alloc(&mut self, size: u64) -> Result<StorageHandle, IoError> {
        let mut ptr = 0;
        // SAFETY: allocation of `size` bytes ordered on our live stream (or, while it is
        // captured, outside it).
        let result = unsafe {
            match self.capturing {
                false => cuMemAllocAsync(&mut ptr, size as usize, self.stream),
                true => cuMemAlloc_v2(&mut ptr, size as usize),
            }
        };
        match result {
            CUresult::CUDA_SUCCESS => {}
            CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                return Err(IoError::BufferTooBig {
                    size,
                    backtrace: BackTrace::capture(),
                });
            }
            other => {
                return Err(IoError::Unknown {
                    description: format!("cuMemAllocAsync of {size} bytes failed: {other:?}"),
                    backtrace: BackTrace::capture(),
                });
            }
        }
        let id = StorageId::new();
        self.pages.insert(id, (ptr, self.capturing));
        Ok(StorageHandle::new(
            id,
            StorageUtilization { offset: 0, size },
        ))
    }

    fn dealloc(&mut self, id: StorageId) {
        self.to_free.push(id);
    }

    fn flush(&mut self) {
        if self.capturing {
            return;
        }
        for id in self.to_free.drain(..) {
            match self.pages.remove(&id) {
                // SAFETY: allocated by cuMemAllocAsync and freed once, after the work already
                // enqueued on the stream (which is what stream-ordered freeing guarantees).
                Some((ptr, false)) => unsafe {
                    cuMemFreeAsync(ptr, self.stream);
                },
                // SAFETY: allocated by cuMemAlloc and freed once; cuMemFree waits for the
                // device's work.
                Some((ptr, true)) => unsafe {
                    cuMemFree_v2(ptr);
                },
                None => {}
            }
        }
    }
}
