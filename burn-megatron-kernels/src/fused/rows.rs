//! How the row kernels (norms, softmax-like reductions) lay rows onto threads, and their sum
//! over the threads of one row.
//!
//! A row of `vectors` vectors is handled by a group of `threads` threads (`CUBE_DIM_X`, a
//! power of two of at least 32), each holding up to [`MAX_ELEMENTS_PER_THREAD`] elements in
//! registers; a cube stacks `rows_per_cube` such groups (`CUBE_DIM_Y`), about 256 threads in
//! all, so short rows (GPT-2's 768) still fill the cube and long ones (16k) get up to 1 024
//! threads. The row sum uses plane (warp) sums where the runtime reports one fixed plane
//! size that divides the group, and shared memory otherwise: lavapipe reports no plane
//! feature, so CI runs the shared-memory path, and the GPU the plane path.

use burn_cubecl::CubeRuntime;
use cubecl::ir::features::Plane;
use cubecl::prelude::*;

/// Elements a thread keeps in registers, at most (the thread count grows to keep within it).
pub const MAX_ELEMENTS_PER_THREAD: usize = 32;
/// Threads per cube the layout aims for.
const CUBE_THREADS: u32 = 256;
/// Most threads per row.
const MAX_ROW_THREADS: u32 = 1024;

/// How [`RowLayout::for_row`] spreads a row over threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowLayout {
    /// Threads per row (`CUBE_DIM_X`).
    pub threads: u32,
    /// Vectors per thread (the last ones past the row's end are idle).
    pub per_thread: usize,
    /// Rows per cube (`CUBE_DIM_Y`).
    pub rows_per_cube: u32,
    /// The plane size the sums may use, 0 for shared memory only.
    pub plane: u32,
}

impl RowLayout {
    /// The layout of a row of `vectors` vectors of `width` elements on `client`'s device.
    pub fn for_row<R: CubeRuntime>(
        client: &ComputeClient<R>,
        vectors: usize,
        width: usize,
    ) -> Self {
        Self::for_row_with(client, vectors, width, MAX_ELEMENTS_PER_THREAD)
    }

    /// [`for_row`](Self::for_row) with at most `elements_per_thread` elements a thread (more
    /// threads a row), within `MAX_ROW_THREADS`.
    pub fn for_row_with<R: CubeRuntime>(
        client: &ComputeClient<R>,
        vectors: usize,
        width: usize,
        elements_per_thread: usize,
    ) -> Self {
        Self::for_row_in_cubes_of(client, vectors, width, elements_per_thread, CUBE_THREADS)
    }

    /// [`for_row_with`](Self::for_row_with) with rows stacked into cubes of about
    /// `cube_threads` threads.
    pub fn for_row_in_cubes_of<R: CubeRuntime>(
        client: &ComputeClient<R>,
        vectors: usize,
        width: usize,
        elements_per_thread: usize,
        cube_threads: u32,
    ) -> Self {
        let mut threads = 32u32;
        while threads < MAX_ROW_THREADS
            && vectors.div_ceil(threads as usize) * width > elements_per_thread
        {
            threads *= 2;
        }
        let plane = fixed_plane_size(client)
            .filter(|&p| p.is_power_of_two() && threads.is_multiple_of(p))
            .unwrap_or(0);
        Self {
            threads,
            per_thread: vectors.div_ceil(threads as usize).max(1),
            rows_per_cube: (cube_threads / threads).max(1),
            plane,
        }
    }

    /// A grid of cubes covering `rows`, each dimension within every runtime's limit.
    pub fn cube_count(&self, rows: usize) -> CubeCount {
        let cubes = rows.div_ceil(self.rows_per_cube as usize).max(1);
        let x = cubes.min(65_535);
        CubeCount::Static(x as u32, cubes.div_ceil(x) as u32, 1)
    }

    pub fn cube_dim(&self) -> CubeDim {
        CubeDim::new_2d(self.threads, self.rows_per_cube)
    }

    /// Shared-memory slots [`row_sum()`] needs.
    pub fn shared_slots(&self) -> usize {
        let per_row = self.threads.checked_div(self.plane).unwrap_or(self.threads);
        (per_row * self.rows_per_cube) as usize
    }
}

/// The plane size of `client`'s device if it reports plane operations of one fixed size.
pub fn fixed_plane_size<R: CubeRuntime>(client: &ComputeClient<R>) -> Option<u32> {
    let properties = client.properties();
    let hardware = &properties.hardware;
    (properties.features.plane.contains(Plane::Ops)
        && hardware.plane_size_min == hardware.plane_size_max
        && hardware.plane_size_max > 0)
        .then_some(hardware.plane_size_max)
}

/// This thread's row: rows are stacked `CUBE_DIM_Y` to a cube, cubes on a 2D grid.
#[cube]
pub fn row_of_thread() -> usize {
    ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_Y + UNIT_POS_Y) as usize
}

/// The sum of `value` over the `threads` threads of this thread's row (`UNIT_POS_Y`), the
/// same on each of them. Every thread of the cube must call it (it synchronises the cube).
/// `shared` has [`RowLayout::shared_slots`] slots; it is free again on return.
#[cube]
pub fn row_sum(
    shared: &mut SharedMemory<f32>,
    value: f32,
    #[comptime] threads: u32,
    #[comptime] plane: u32,
) -> f32 {
    row_reduce(shared, value, threads, plane, false)
}

/// The sums of `a` and of `b` over the threads of this thread's row: two [`row_sum()`]s (the
/// same bits) with the barriers of one. `shared` has twice [`RowLayout::shared_slots`]
/// slots, `slots` being that count; it is free again on return.
#[cube]
pub fn row_sum_pair(
    shared: &mut SharedMemory<f32>,
    a: f32,
    b: f32,
    #[comptime] threads: u32,
    #[comptime] plane: u32,
    #[comptime] slots: usize,
) -> (f32, f32) {
    let x = UNIT_POS_X as usize;
    let y = UNIT_POS_Y as usize;
    let mut total_a = a;
    let mut total_b = b;
    if plane > 0 {
        let plane_a = plane_sum(a);
        let plane_b = plane_sum(b);
        total_a = plane_a;
        total_b = plane_b;
        if threads != plane {
            let planes = comptime!((threads / plane) as usize);
            if UNIT_POS_PLANE == 0 {
                let at = y * planes + x / comptime!(plane as usize);
                shared[at] = plane_a;
                shared[slots + at] = plane_b;
            }
            sync_cube();
            total_a = shared[y * planes];
            total_b = shared[slots + y * planes];
            #[unroll]
            for p in 1..planes {
                total_a += shared[y * planes + p];
                total_b += shared[slots + y * planes + p];
            }
            // Every thread has read the slots before the next reduction overwrites them.
            sync_cube();
        }
    } else {
        let base = y * CUBE_DIM_X as usize;
        shared[base + x] = total_a;
        shared[slots + base + x] = total_b;
        sync_cube();
        let mut half = CUBE_DIM_X as usize / 2;
        while half > 0 {
            if x < half {
                shared[base + x] += shared[base + x + half];
                shared[slots + base + x] += shared[slots + base + x + half];
            }
            sync_cube();
            half /= 2;
        }
        total_a = shared[base];
        total_b = shared[slots + base];
        sync_cube();
    }
    (total_a, total_b)
}

/// The maximum of `value` over the threads of this thread's row, as [`row_sum()`].
#[cube]
pub fn row_max(
    shared: &mut SharedMemory<f32>,
    value: f32,
    #[comptime] threads: u32,
    #[comptime] plane: u32,
) -> f32 {
    row_reduce(shared, value, threads, plane, true)
}

/// `a + b`, or the larger of the two when `max`.
#[cube]
fn combine(a: f32, b: f32, #[comptime] max: bool) -> f32 {
    if max { f32::max(a, b) } else { a + b }
}

/// [`row_sum()`] (`max` false) or [`row_max`] (`max` true).
#[cube]
fn row_reduce(
    shared: &mut SharedMemory<f32>,
    value: f32,
    #[comptime] threads: u32,
    #[comptime] plane: u32,
    #[comptime] max: bool,
) -> f32 {
    let x = UNIT_POS_X as usize;
    let y = UNIT_POS_Y as usize;
    let mut total = value;
    if plane > 0 {
        let plane_total = if max {
            plane_max(value)
        } else {
            plane_sum(value)
        };
        total = plane_total;
        if threads != plane {
            let planes = comptime!((threads / plane) as usize);
            if UNIT_POS_PLANE == 0 {
                shared[y * planes + x / comptime!(plane as usize)] = plane_total;
            }
            sync_cube();
            total = shared[y * planes];
            #[unroll]
            for p in 1..planes {
                total = combine(total, shared[y * planes + p], max);
            }
            // Every thread has read the slots before the next reduction overwrites them.
            sync_cube();
        }
    } else {
        // Runtime values: a `let mut` of a comptime value would be folded at expansion.
        let base = y * CUBE_DIM_X as usize;
        shared[base + x] = total;
        sync_cube();
        let mut half = CUBE_DIM_X as usize / 2;
        while half > 0 {
            if x < half {
                shared[base + x] = combine(shared[base + x], shared[base + x + half], max);
            }
            sync_cube();
            half /= 2;
        }
        total = shared[base];
        sync_cube();
    }
    total
}
