//! The experts' products, every expert's in one foreign operation on the compute stream, with
//! no host synchronisation, by one of two [`Engine`]s:
//! - [`Engine::Grouped`]: cuBLAS's grouped GEMM (`cublasGemmGroupedBatchedEx`), one call for
//!   every expert's product, however many rows each has;
//! - [`Engine::Streams`]: one cuBLASLt GEMM an expert, spread over several streams: the compute
//!   stream and side streams that start after it (an event) and that it waits for at the end,
//!   so that the small products of fine-grained experts run side by side and fill the GPU.
//!
//! Blocks of one size, evenly spaced (the MoE layer pads many small experts' blocks to one
//! size), run as one strided-batched cuBLASLt GEMM, whatever the engine.
//!
//! The tokens are in expert-major blocks whose sizes (`counts`) are on the host already (the
//! dispatcher's one read), so every product's sizes and offsets are known here. What cuBLAS's
//! grouped GEMM needs on the device are its arrays of matrix pointers; they are computed on the
//! device thread from the tensors' base pointers and copied, from page-locked memory, on the
//! compute stream just before the GEMM (a ring of slots, each reused once the copy that read it
//! has passed, so the host waits only if it runs a whole ring ahead of the GPU).
//!
//! Products are described row-major, as in [`super::gemm`] (`GemmKey`); cuBLAS's
//! column-major grouped call gets each as its transpose: `y_eᵀ = op(w_e)ᵀ · x_eᵀ`. Experts
//! without rows are left out (their weight gradient is zero). bf16 and f16 accumulate in f32;
//! f32 uses TF32 tensor cores, as the dense GEMMs do.

use burn::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl_core::server::Binding;
use cudarc::cublas::result as blas;
use cudarc::cublas::sys;
use cudarc::driver::sys::{
    CU_MEMHOSTALLOC_PORTABLE, CUdeviceptr, CUstream, CUstream_flags, cuMemAlloc_v2, cuMemHostAlloc,
    cuMemcpyHtoDAsync_v2, cuMemsetD8Async, cuStreamCreate,
};

use super::device::CudaGpu;
use super::driver::check;
use super::event::Event;
use super::foreign::{ForeignContext, ForeignQueue, Lane, binding};
use super::gemm::{
    Batch, GemmKey, GemmUnsupported, LtState, OUTPUT_ALIGNMENT, WORKSPACE_BYTES, slot_of,
};
use super::runtime::MegatronCudaRuntime;

type Tensor = CubeTensor<MegatronCudaRuntime>;

/// The most problems (experts with rows) one call takes; more go to the caller's fallback.
pub const MAX_PROBLEMS: usize = 1024;

/// Slots of the pointer ring: calls in flight before the host waits for the GPU.
const SLOTS: usize = 64;

/// Pointers a slot holds: A's, B's and C's of [`MAX_PROBLEMS`] problems.
const SLOT_POINTERS: usize = 3 * MAX_PROBLEMS;

/// How the experts' products run (module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// One cuBLAS grouped GEMM.
    Grouped,
    /// One cuBLASLt GEMM an expert, over this many streams (the compute stream included; 1 runs
    /// them one after another on it). The compute stream alone while a CUDA graph is captured.
    Streams(usize),
}

/// `x_e · op(w[e])` for every expert `e` with rows, `counts[e]` rows of `x` after those of
/// experts `0..e`, in one foreign operation.
///
/// `x` is `[n, k]` (rows may be pitched), `w` a contiguous `[experts, k, m]` (`[experts, m, k]`
/// with `transpose_w`), both bf16, f16 or f32; the output is `[n, m]` of their dtype.
pub fn grouped_gemm(
    x: &Tensor,
    w: &Tensor,
    counts: &[usize],
    transpose_w: bool,
    engine: Engine,
) -> Result<Tensor, GemmUnsupported> {
    let dtype = same_dtype(x, w)?;
    let (n, k, ldx) = rows(x)?;
    let [experts, p, q, ldw, expert_stride] = stacked(w)?;
    let (w_k, m) = if transpose_w { (q, p) } else { (p, q) };
    check_counts(counts, experts, n, x, w)?;
    if w_k != k {
        return Err(shape_error(x, w));
    }
    let out = empty_device_contiguous_dtype(
        x.client.clone(),
        x.device.clone(),
        Shape::from(vec![n, m]),
        dtype,
    );
    let size = dtype.size() as u64;
    let blocks = blocks(counts)
        .map(|(e, start, rows)| Block {
            key: plain_key(dtype, [rows, m, k], [ldx, ldw, m], [false, transpose_w]),
            offsets: [
                (start * ldx) as u64 * size,
                (e * expert_stride) as u64 * size,
                (start * m) as u64 * size,
            ],
        })
        .collect();
    submit(
        engine,
        blocks,
        Vec::new(),
        [x, w, &out].map(binding),
        &x.device,
    );
    Ok(out)
}

/// `x_eᵀ · dy_e` for every expert `e` (zero where `counts[e]` is 0), in one foreign
/// operation: the weights' gradient of [`grouped_gemm`].
///
/// `x` is `[n, k]`, `dy` `[n, m]` (rows may be pitched), of one dtype; the output is
/// `[experts, k, m]` of that dtype.
pub fn grouped_weight_gradient(
    x: &Tensor,
    dy: &Tensor,
    counts: &[usize],
    engine: Engine,
) -> Result<Tensor, GemmUnsupported> {
    let dtype = same_dtype(x, dy)?;
    let (n, k, ldx) = rows(x)?;
    let (dy_n, m, ldy) = rows(dy)?;
    if dy_n != n {
        return Err(shape_error(x, dy));
    }
    check_counts(counts, counts.len(), n, x, dy)?;
    let shape = Shape::from(vec![counts.len(), k, m]);
    let (client, device) = (x.client.clone(), x.device.clone());
    // The products write with `ldc = m`, so the output must be contiguous.
    let out = empty_device_contiguous_dtype(client, device, shape, dtype);
    // The experts without rows get zeros: one fill a run of them, in the same operation.
    let block_bytes = (k * m) as u64 * dtype.size() as u64;
    let mut zeros: Vec<(u64, u64)> = Vec::new();
    for (e, _) in counts.iter().enumerate().filter(|(_, c)| **c == 0) {
        match zeros.last_mut() {
            Some((start, bytes)) if *start + *bytes == e as u64 * block_bytes => {
                *bytes += block_bytes
            }
            _ => zeros.push((e as u64 * block_bytes, block_bytes)),
        }
    }
    let size = dtype.size() as u64;
    let blocks = blocks(counts)
        .map(|(e, start, rows)| Block {
            key: plain_key(dtype, [k, m, rows], [ldx, ldy, m], [true, false]),
            offsets: [
                (start * ldx) as u64 * size,
                (start * ldy) as u64 * size,
                (e * k * m) as u64 * size,
            ],
        })
        .collect();
    submit(engine, blocks, zeros, [x, dy, &out].map(binding), &x.device);
    Ok(out)
}

/// `buffer[start..] += x_eᵀ · dy_e` for every expert `e` with rows, in f32, the products
/// accumulating in place (beta 1), in one foreign operation: the weights' gradient of
/// [`grouped_gemm`] summed into its slot of a flat f32 gradient buffer, laid out as the
/// `[experts, k, m]` stack (Megatron's gradient-accumulation fusion). Experts without rows add
/// nothing.
///
/// `x` is `[n, k]`, `dy` `[n, m]` (rows may be pitched), bf16, f16 or f32 of one dtype;
/// `buffer` a contiguous f32 `[numel]` that no other tensor shares, with `start + experts · k ·
/// m <= numel`, and `start` and `k · m` multiples of 4 (every block 16-byte aligned). cuBLAS's
/// grouped GEMM runs it where it takes an f32 output for these inputs (the cuBLAS of CUDA 12
/// on an H200 refuses one for bf16), else, and for [`Engine::Streams`], cuBLASLt GEMMs.
pub fn grouped_weight_gradient_accumulate_at(
    x: &Tensor,
    dy: &Tensor,
    counts: &[usize],
    engine: Engine,
    buffer: &Tensor,
    start: usize,
) -> Result<(), GemmUnsupported> {
    let dtype = same_dtype(x, dy)?;
    let (n, k, ldx) = rows(x)?;
    let (dy_n, m, ldy) = rows(dy)?;
    if dy_n != n {
        return Err(shape_error(x, dy));
    }
    check_counts(counts, counts.len(), n, x, dy)?;
    // Every expert's block starts aligned as the slot does.
    if !(k * m).is_multiple_of(OUTPUT_ALIGNMENT) {
        return Err(GemmUnsupported::Layout);
    }
    let slot = slot_of(buffer, start, counts.len() * k * m)?;
    let size = dtype.size() as u64;
    let f32_size = DType::F32.size() as u64;
    let blocks = blocks(counts)
        .map(|(e, first, rows)| Block {
            key: GemmKey {
                output: DType::F32,
                accumulate: true,
                ..plain_key(dtype, [k, m, rows], [ldx, ldy, m], [true, false])
            },
            offsets: [
                (first * ldx) as u64 * size,
                (first * ldy) as u64 * size,
                (e * k * m) as u64 * f32_size,
            ],
        })
        .collect();
    submit(
        engine,
        blocks,
        Vec::new(),
        [binding(x), binding(dy), slot],
        &x.device,
    );
    Ok(())
}

/// One expert's product, row-major: its plan's key and the byte offsets of its `a`, `b` and `c`
/// from their tensors' pointers.
#[derive(Debug, Clone, Copy)]
struct Block {
    key: GemmKey,
    offsets: [u64; 3],
}

impl Block {
    fn flops(&self) -> usize {
        self.key.m * self.key.n * self.key.k
    }
}

/// The key of `c [m, n] = op(a) · op(b)` (inner `k`) in `dtype`, row strides `lda`, `ldb`,
/// `ldc`, transposes of `a` and `b`.
fn plain_key(
    dtype: DType,
    [m, n, k]: [usize; 3],
    [lda, ldb, ldc]: [usize; 3],
    [transpose_a, transpose_b]: [bool; 2],
) -> GemmKey {
    GemmKey {
        m,
        n,
        k,
        lda,
        ldb,
        ldc,
        transpose_a,
        transpose_b,
        input: dtype,
        output: dtype,
        bias: false,
        accumulate: false,
        fp8: None,
        batch: None,
    }
}

/// `(expert, first row, rows)` of every expert with rows.
fn blocks(counts: &[usize]) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    let starts = counts.iter().scan(0, |start, &count| {
        let first = *start;
        *start += count;
        Some(first)
    });
    (0..counts.len())
        .zip(starts)
        .zip(counts)
        .filter(|(_, count)| **count > 0)
        .map(|((e, start), &count)| (e, start, count))
}

fn shape_error(a: &Tensor, b: &Tensor) -> GemmUnsupported {
    GemmUnsupported::Shape(a.meta.shape().to_vec(), b.meta.shape().to_vec())
}

fn same_dtype(a: &Tensor, b: &Tensor) -> Result<DType, GemmUnsupported> {
    match a.dtype == b.dtype && matches!(a.dtype, DType::BF16 | DType::F16 | DType::F32) {
        true => Ok(a.dtype),
        false => Err(GemmUnsupported::DType(a.dtype, b.dtype)),
    }
}

/// `(rows, cols, row stride)` of a 2D tensor with contiguous rows.
fn rows(t: &Tensor) -> Result<(usize, usize, usize), GemmUnsupported> {
    let (shape, strides) = (t.meta.shape(), t.meta.strides());
    match (shape.len(), strides.get(1), strides.first()) {
        (2, Some(1), Some(&ld)) if ld >= shape[1].max(1) && ld <= i32::MAX as usize => {
            Ok((shape[0], shape[1], ld))
        }
        _ => Err(GemmUnsupported::Layout),
    }
}

/// The dims of a 3D tensor with contiguous rows (our runtime may pitch them), then its row
/// stride and its expert stride.
fn stacked(t: &Tensor) -> Result<[usize; 5], GemmUnsupported> {
    let (shape, strides) = (t.meta.shape(), t.meta.strides());
    if shape.len() != 3 {
        return Err(GemmUnsupported::Layout);
    }
    let (rows, cols) = (shape[1], shape[2]);
    let (expert_stride, row_stride) = (strides[0], strides[1]);
    match strides[2] == 1
        && row_stride >= cols.max(1)
        && row_stride <= i32::MAX as usize
        && expert_stride >= rows * row_stride
    {
        true => Ok([shape[0], rows, cols, row_stride, expert_stride]),
        false => Err(GemmUnsupported::Layout),
    }
}

/// One count per expert, adding up to the rows, each product's sizes within cuBLAS's `int`s,
/// and at most [`MAX_PROBLEMS`] experts with rows.
fn check_counts(
    counts: &[usize],
    experts: usize,
    rows: usize,
    a: &Tensor,
    b: &Tensor,
) -> Result<(), GemmUnsupported> {
    let with_rows = counts.iter().filter(|c| **c > 0).count();
    let fits = counts.len() == experts
        && counts.iter().sum::<usize>() == rows
        && with_rows <= MAX_PROBLEMS
        && rows <= i32::MAX as usize;
    match fits {
        true => Ok(()),
        false => Err(shape_error(a, b)),
    }
}

/// Enqueues the products of `blocks` on `device`'s compute stream by `engine`, after zeroing
/// the `zeros` ranges of `c` (byte offsets and lengths); `bindings` are the `a`, `b` and `c`
/// the blocks' offsets are relative to.
fn submit(
    engine: Engine,
    blocks: Vec<Block>,
    zeros: Vec<(u64, u64)>,
    bindings: [Binding; 3],
    device: &CudaGpu,
) {
    if blocks.is_empty() && zeros.is_empty() {
        return;
    }
    let queue = ForeignQueue::new(device);
    let name = match (as_batch(&blocks).is_some(), engine) {
        (true, _) => "cuBLASLt strided-batched GEMM",
        (false, Engine::Grouped) => "cuBLAS grouped GEMM",
        (false, Engine::Streams(_)) => "cuBLASLt GEMMs on streams",
    };
    queue.submit(name, bindings.into(), Lane::Compute, move |ctx| {
        for &(offset, bytes) in &zeros {
            // SAFETY: the range lies inside `c`, which the operation binds.
            unsafe {
                check(
                    cuMemsetD8Async(ctx.pointers[2] + offset, 0, bytes as usize, ctx.stream),
                    "cuMemsetD8Async",
                )
                .map_err(|e| e.to_string())?;
            }
        }
        if blocks.is_empty() {
            return Ok(());
        }
        if let Some(batched) = as_batch(&blocks) {
            return run_on_streams(ctx, &[batched], 1);
        }
        match engine {
            Engine::Grouped => {
                if ctx.extensions.get_mut::<GroupedState>().is_none() {
                    let state = GroupedState::new()?;
                    ctx.extensions.get_or_insert_with(|| state);
                }
                let state = ctx
                    .extensions
                    .get_mut::<GroupedState>()
                    .expect("created above");
                match state.run(ctx.stream, ctx.pointers, &blocks)? {
                    Ran::Done => Ok(()),
                    // An f32 output for narrower inputs, where this cuBLAS lacks it.
                    Ran::Refused => run_on_streams(ctx, &blocks, 1),
                }
            }
            // One stream while a CUDA graph is captured: its capture follows the compute
            // stream.
            Engine::Streams(streams) => {
                run_on_streams(ctx, &blocks, if ctx.capturing { 1 } else { streams })
            }
        }
    });
}

/// The blocks as one strided-batched cuBLASLt GEMM, where there are two or more, all of one
/// key, each operand's blocks evenly spaced: experts whose blocks are padded to one size (as
/// the MoE layer pads many small experts), whatever the engine: one GEMM of the same shape
/// repeated is what cuBLASLt's batched kernels are made for.
fn as_batch(blocks: &[Block]) -> Option<Block> {
    let first = *blocks.first()?;
    let second = blocks.get(1)?;
    if blocks.iter().any(|b| b.key != first.key) {
        return None;
    }
    let steps = [0, 1, 2].map(|o| second.offsets[o].checked_sub(first.offsets[o]));
    let evenly_spaced = blocks.iter().enumerate().all(|(i, b)| {
        (0..3).all(|o| {
            steps[o].is_some_and(|step| b.offsets[o] == first.offsets[o] + i as u64 * step)
        })
    });
    let key = first.key;
    let sizes = [key.input, key.input, key.output].map(|d| d.size() as u64);
    let strides = [0, 1, 2].map(|o| steps[o].map(|step| (step / sizes[o], step % sizes[o])));
    match (evenly_spaced, strides) {
        (true, [Some((a, 0)), Some((b, 0)), Some((c, 0))]) if a > 0 && b > 0 && c > 0 => {
            Some(Block {
                key: GemmKey {
                    batch: Some(Batch {
                        count: blocks.len(),
                        strides: [a, b, c].map(|s| s as usize),
                    }),
                    ..key
                },
                offsets: first.offsets,
            })
        }
        _ => None,
    }
}

/// The side streams of [`Engine::Streams`] and their cuBLASLt workspaces (the compute stream
/// uses cuBLASLt's own), created as more are asked for and kept for the process.
#[derive(Default)]
struct Fan {
    sides: Vec<(CUstream, CUdeviceptr)>,
}

// SAFETY: used only on the device thread, inside foreign operations.
unsafe impl Send for Fan {}

impl Fan {
    /// The first `count` side streams with their workspaces.
    fn sides(&mut self, count: usize) -> Result<&[(CUstream, CUdeviceptr)], String> {
        while self.sides.len() < count {
            let (mut stream, mut workspace) = (core::ptr::null_mut(), 0);
            // SAFETY: a stream and an allocation in the current context, kept for the process.
            unsafe {
                check(
                    cuStreamCreate(&mut stream, CUstream_flags::CU_STREAM_NON_BLOCKING as u32),
                    "cuStreamCreate",
                )
                .map_err(|e| e.to_string())?;
                check(cuMemAlloc_v2(&mut workspace, WORKSPACE_BYTES), "cuMemAlloc")
                    .map_err(|e| e.to_string())?;
            }
            self.sides.push((stream, workspace));
        }
        Ok(&self.sides[..count])
    }
}

/// Runs the blocks' GEMMs over `streams` streams: the side streams start after the compute
/// stream's work so far, each block goes to the stream with the fewest FLOPs queued (largest
/// first), and the compute stream then waits for every side stream, so that to the rest of the
/// queue this is one operation on the compute stream.
fn run_on_streams(
    ctx: &mut ForeignContext<'_>,
    blocks: &[Block],
    streams: usize,
) -> Result<(), String> {
    let streams = streams.clamp(1, blocks.len());
    let sides = ctx
        .extensions
        .get_or_insert_with(Fan::default)
        .sides(streams - 1)?
        .to_vec();
    let compute = ctx.stream;
    let event = |e: super::driver::DriverFailure| e.to_string();
    if !sides.is_empty() {
        let start = Event::record(compute).map_err(event)?;
        for (side, _) in &sides {
            start.wait_on(*side).map_err(event)?;
        }
    }
    let state = LtState::of(ctx.extensions);
    let lanes: Vec<(CUstream, CUdeviceptr)> = std::iter::once((compute, state.workspace))
        .chain(sides.iter().copied())
        .collect();
    let mut order: Vec<usize> = (0..blocks.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(blocks[i].flops()));
    let mut queued = vec![0usize; lanes.len()];
    let mut result = Ok(());
    for i in order {
        let block = &blocks[i];
        let lane = (0..lanes.len())
            .min_by_key(|&l| queued[l])
            .expect("one stream at least");
        queued[lane] += block.flops();
        let (stream, workspace) = lanes[lane];
        let pointers = [0, 1, 2].map(|o| ctx.pointers[o] + block.offsets[o]);
        result = state
            .plan(block.key)
            .map_err(|e| format!("{e:?} for {:?}", block.key))
            // SAFETY: the pointers address the blocks of the bound tensors that the key
            // describes; each workspace is used by its own stream only.
            .and_then(|plan| unsafe { state.run(&plan, block.key, pointers, stream, workspace) });
        if result.is_err() {
            break;
        }
    }
    // Joined even after an error, so that the compute stream never runs ahead of a side one.
    for (side, _) in &sides {
        Event::record(*side)
            .and_then(|end| end.wait_on(compute))
            .map_err(event)?;
    }
    result
}

/// What [`GroupedState::run`] did.
enum Ran {
    /// The grouped GEMM is enqueued.
    Done,
    /// cuBLAS does not take these operand types (an f32 output for bf16 or f16 inputs, in some
    /// versions), nothing was run: the caller runs the blocks another way.
    Refused,
}

/// Per-device cuBLAS state: the handle (bound to the compute stream), its workspace, and the
/// ring of page-locked and device slots for the pointer arrays.
struct GroupedState {
    handle: sys::cublasHandle_t,
    stream: CUstream,
    workspace: CUdeviceptr,
    host: *mut u64,
    device: CUdeviceptr,
    copied: Vec<Option<Event>>,
    next: usize,
    /// Whether cuBLAS refused an f32 output for narrower inputs ([`Ran::Refused`]).
    mixed_refused: bool,
}

// SAFETY: used only on the device thread, inside foreign operations.
unsafe impl Send for GroupedState {}

impl GroupedState {
    fn new() -> Result<Self, String> {
        let handle = blas::create_handle().map_err(|e| format!("cublasCreate: {e:?}"))?;
        let bytes = SLOTS * SLOT_POINTERS * 8;
        let (mut workspace, mut device, mut host) = (0, 0, core::ptr::null_mut());
        // SAFETY: allocations in the current (primary) context, kept for the process.
        unsafe {
            check(cuMemAlloc_v2(&mut workspace, WORKSPACE_BYTES), "cuMemAlloc")
                .map_err(|e| e.to_string())?;
            check(cuMemAlloc_v2(&mut device, bytes), "cuMemAlloc").map_err(|e| e.to_string())?;
            check(
                cuMemHostAlloc(&mut host, bytes, CU_MEMHOSTALLOC_PORTABLE),
                "cuMemHostAlloc",
            )
            .map_err(|e| e.to_string())?;
        }
        Ok(Self {
            handle,
            stream: core::ptr::null_mut(),
            workspace,
            host: host.cast(),
            device,
            copied: (0..SLOTS).map(|_| None).collect(),
            next: 0,
            mixed_refused: false,
        })
    }

    /// Binds the handle to `stream` (setting the stream resets cuBLAS's workspace, so it is set
    /// again after).
    fn bind(&mut self, stream: CUstream) -> Result<(), String> {
        if self.stream == stream {
            return Ok(());
        }
        // SAFETY: a live handle and stream; the workspace is ours for the process.
        unsafe {
            blas::set_stream(self.handle, stream as sys::cudaStream_t)
                .map_err(|e| format!("cublasSetStream: {e:?}"))?;
            sys::cublasSetWorkspace_v2(self.handle, self.workspace as *mut _, WORKSPACE_BYTES)
                .result()
                .map_err(|e| format!("cublasSetWorkspace: {e:?}"))?;
        }
        self.stream = stream;
        Ok(())
    }

    /// Copies the blocks' pointers to the device and runs the grouped GEMM, on `stream`, each
    /// block as its transpose (`cᵀ = op(b)ᵀ · op(a)ᵀ`: cuBLAS's A is our `b`); the blocks
    /// share one dtype, output and accumulation. An f32 output for narrower inputs that
    /// cuBLAS refused once is refused again without asking it.
    fn run(&mut self, stream: CUstream, bases: &[u64], blocks: &[Block]) -> Result<Ran, String> {
        let key = blocks[0].key;
        let mixed = key.output != key.input;
        if mixed && self.mixed_refused {
            return Ok(Ran::Refused);
        }
        self.bind(stream)?;
        let count = blocks.len();
        let slot = self.next;
        self.next = (self.next + 1) % SLOTS;
        if let Some(event) = self.copied[slot].take() {
            // Passed long ago unless the host runs a whole ring ahead of the GPU.
            event.synchronize().map_err(|e| e.to_string())?;
        }
        // SAFETY: the slot's host memory is not read by any pending copy (waited for above).
        let host = unsafe {
            core::slice::from_raw_parts_mut(self.host.add(slot * SLOT_POINTERS), 3 * count)
        };
        for (i, block) in blocks.iter().enumerate() {
            // cuBLAS's A, B and C are our b, a and c.
            for (operand, ours) in [1, 0, 2].into_iter().enumerate() {
                host[operand * count + i] = bases[ours] + block.offsets[ours];
            }
        }
        let device = self.device + (slot * SLOT_POINTERS * 8) as u64;
        // SAFETY: both ranges hold `3 · count` pointers; the copy is ordered before the GEMM on
        // the same stream, and the slot's device memory is rewritten only by a later copy on it.
        unsafe {
            check(
                cuMemcpyHtoDAsync_v2(device, host.as_ptr().cast(), 3 * count * 8, stream),
                "cuMemcpyHtoDAsync",
            )
            .map_err(|e| e.to_string())?;
        }
        self.copied[slot] = Some(Event::record(stream).map_err(|e| e.to_string())?);
        let op = |t: bool| match t {
            true => sys::cublasOperation_t::CUBLAS_OP_T,
            false => sys::cublasOperation_t::CUBLAS_OP_N,
        };
        let each = |f: &dyn Fn(&GemmKey) -> usize| {
            blocks
                .iter()
                .map(|b| f(&b.key) as i32)
                .collect::<Vec<i32>>()
        };
        let (transa, transb): (Vec<_>, Vec<_>) = blocks
            .iter()
            .map(|b| (op(b.key.transpose_b), op(b.key.transpose_a)))
            .unzip();
        let (m, n, k) = (each(&|p| p.n), each(&|p| p.m), each(&|p| p.k));
        let (lda, ldb, ldc) = (each(&|p| p.ldb), each(&|p| p.lda), each(&|p| p.ldc));
        let beta = if key.accumulate { 1.0f32 } else { 0.0 };
        let (alpha, beta) = (vec![1.0f32; count], vec![beta; count]);
        let group_size = vec![1i32; count];
        let (data, compute) = match key.input {
            DType::BF16 => (
                sys::cudaDataType_t::CUDA_R_16BF,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            DType::F16 => (
                sys::cudaDataType_t::CUDA_R_16F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            _ => (
                sys::cudaDataType_t::CUDA_R_32F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            ),
        };
        let output = match key.output {
            DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
            _ => data,
        };
        let pointers = |operand: usize| (device + (operand * count * 8) as u64) as *const _;
        // SAFETY: the host arrays hold one entry per group (each block its own group of one);
        // the device arrays address matrices inside the bound tensors, sized by them.
        let status = unsafe {
            sys::cublasGemmGroupedBatchedEx(
                self.handle,
                transa.as_ptr(),
                transb.as_ptr(),
                m.as_ptr(),
                n.as_ptr(),
                k.as_ptr(),
                alpha.as_ptr().cast(),
                pointers(0),
                data,
                lda.as_ptr(),
                pointers(1),
                data,
                ldb.as_ptr(),
                beta.as_ptr().cast(),
                pointers(2) as *const *mut _,
                output,
                ldc.as_ptr(),
                count as i32,
                group_size.as_ptr(),
                compute,
            )
        };
        match status {
            sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(Ran::Done),
            sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED if mixed => {
                self.mixed_refused = true;
                eprintln!(
                    "burn-megatron: cuBLAS's grouped GEMM takes no f32 output for {:?} inputs: \
                     the experts' weight gradients accumulate through cuBLASLt GEMMs instead.",
                    key.input
                );
                Ok(Ran::Refused)
            }
            status => Err(format!(
                "cublasGemmGroupedBatchedEx: {status:?} for {blocks:?}"
            )),
        }
    }
}
