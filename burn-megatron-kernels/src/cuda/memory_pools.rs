//! The memory pools of our CUDA runtime.
//!
//! CubeCL's default (`MemoryConfiguration::SubSlices`) slices every allocation above an eighth
//! of a quarter of the GPU's memory (4.4 GiB on an H200) out of pages of a quarter of the
//! memory (35 GiB). A 6 GiB buffer then needs a free 35 GiB page: a DP 4 run of GPT-3 6.7B on
//! H200s failed to allocate one while the pool held 44 GiB (2026-11-27, book "Benchmarks").
//! Here small allocations keep sliced pages (many tensors to a page, little
//! waste), and from 512 MiB up each allocation has a page of its own, about its own size (a
//! page is reused for any allocation it holds, and given back when the pool is cleaned).

use cubecl_core::MemoryConfiguration;
use cubecl_runtime::memory_management::{MemoryPoolOptions, PoolType};

const MIB: u64 = 1 << 20;

/// Sliced pools: `(page size, largest slice)`, smallest first.
const SLICED: [(u64, u64); 5] = [
    (8 * MIB, MIB / 8),
    (32 * MIB, MIB),
    (128 * MIB, 8 * MIB),
    (512 * MIB, 64 * MIB),
    (2048 * MIB, 512 * MIB),
];

/// The pools for a device whose largest allocation is `max_page` bytes, every size a multiple
/// of `alignment`: the sliced pools, then exclusive pools whose limits double from 1 GiB to
/// `max_page`. CubeCL's exclusive pool makes a page of the allocation's size or of its running
/// average size, whichever is larger: at most the pool's limit, and a pool's allocations are
/// above half its limit, so a page is less than twice the allocation that made it.
pub(crate) fn memory_configuration(max_page: u64, alignment: u64) -> MemoryConfiguration {
    let aligned = |bytes: u64| bytes.div_ceil(alignment) * alignment;
    let mut pool_options = vec![MemoryPoolOptions {
        // Allocations of zero bytes.
        pool_type: PoolType::ExclusivePages { max_alloc_size: 0 },
        dealloc_period: None,
    }];
    pool_options.extend(
        SLICED
            .iter()
            .map(|&(page_size, max_slice_size)| MemoryPoolOptions {
                pool_type: PoolType::SlicedPages {
                    page_size: aligned(page_size),
                    max_slice_size: aligned(max_slice_size),
                },
                dealloc_period: None,
            }),
    );
    let mut limit = 1024 * MIB;
    loop {
        let last = limit >= max_page;
        pool_options.push(MemoryPoolOptions {
            pool_type: PoolType::ExclusivePages {
                max_alloc_size: aligned(limit.min(max_page)),
            },
            dealloc_period: None,
        });
        if last {
            break;
        }
        limit *= 2;
    }
    MemoryConfiguration::Custom { pool_options }
}
