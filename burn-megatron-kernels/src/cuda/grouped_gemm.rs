//! The experts' grouped GEMMs through cuBLAS (`cublasGemmGroupedBatchedEx`), as one foreign
//! operation on the compute stream: one call for every expert's product, however many rows
//! each has, with no host synchronisation.
//!
//! The tokens are in expert-major blocks whose sizes (`counts`) are on the host already (the
//! dispatcher's one read), so every problem's sizes and offsets are known here. What cuBLAS
//! needs on the device are its arrays of matrix pointers; they are computed on the device
//! thread from the tensors' base pointers and copied, from page-locked memory, on the compute
//! stream just before the GEMM (a ring of slots, each reused once the copy that read it has
//! passed, so the host waits only if it runs a whole ring ahead of the GPU).
//!
//! Row-major tensors are column-major transposes, as in [`super::gemm`]: `y_e = x_e · op(w_e)`
//! is computed as `y_eᵀ = op(w_e)ᵀ · x_eᵀ`, and `dw_e = x_eᵀ · dy_e` as `dw_eᵀ = dy_eᵀ · x_e`.
//! Experts without rows are left out of the call (their weight gradient is zero). bf16 and
//! f16 accumulate in f32; f32 uses TF32 tensor cores, as the dense GEMMs do.

use burn::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros_client};
use burn_cubecl::ops::reshape;
use burn_cubecl::tensor::CubeTensor;
use cudarc::cublas::result as blas;
use cudarc::cublas::sys;
use cudarc::driver::sys::{
    CU_MEMHOSTALLOC_PORTABLE, CUdeviceptr, CUstream, cuMemAlloc_v2, cuMemHostAlloc,
    cuMemcpyHtoDAsync_v2,
};

use super::driver::check;
use super::event::Event;
use super::foreign::{ForeignQueue, Lane, binding};
use super::gemm::GemmUnsupported;
use super::runtime::MegatronCudaRuntime;

type Tensor = CubeTensor<MegatronCudaRuntime>;

/// The most problems (experts with rows) one call takes; more go to the caller's fallback.
pub const MAX_PROBLEMS: usize = 1024;

/// Slots of the pointer ring: calls in flight before the host waits for the GPU.
const SLOTS: usize = 64;

/// Pointers a slot holds: A's, B's and C's of [`MAX_PROBLEMS`] problems.
const SLOT_POINTERS: usize = 3 * MAX_PROBLEMS;

/// Bytes of workspace cuBLAS may use (what NVIDIA recommends for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// `x_e · op(w[e])` for every expert `e` with rows, `counts[e]` rows of `x` after those of
/// experts `0..e`, in one cuBLAS call.
///
/// `x` is `[n, k]` (rows may be pitched), `w` a contiguous `[experts, k, m]` (`[experts, m, k]`
/// with `transpose_w`), both bf16, f16 or f32; the output is `[n, m]` of their dtype.
pub fn grouped_gemm(
    x: &Tensor,
    w: &Tensor,
    counts: &[usize],
    transpose_w: bool,
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
    // cuBLAS's A is w_e (column-major [q, p], ld its row stride), B is x_e, C is y_e.
    let problems: Vec<Problem> = blocks(counts)
        .map(|(e, start, rows)| Problem {
            m: m as i32,
            n: rows as i32,
            k: k as i32,
            transpose_a: transpose_w,
            transpose_b: false,
            lda: ldw as i32,
            ldb: ldx as i32,
            ldc: m as i32,
            offsets: [
                (e * expert_stride) as u64 * size,
                (start * ldx) as u64 * size,
                (start * m) as u64 * size,
            ],
        })
        .collect();
    submit(dtype, problems, [w, x, &out]);
    Ok(out)
}

/// `x_eᵀ · dy_e` for every expert `e` (zero where `counts[e]` is 0), in one cuBLAS call: the
/// weights' gradient of [`grouped_gemm`].
///
/// `x` is `[n, k]`, `dy` `[n, m]` (rows may be pitched), of one dtype; the output is
/// `[experts, k, m]` of that dtype.
pub fn grouped_weight_gradient(
    x: &Tensor,
    dy: &Tensor,
    counts: &[usize],
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
    // The products write with `ldc = m`, so the output must be contiguous: zeros are filled
    // flat (a tensor of several dimensions may get pitched rows), then viewed as the stack.
    let out = match counts.contains(&0) {
        true => reshape(
            zeros_client(
                client,
                device,
                Shape::from(vec![shape.num_elements()]),
                dtype,
            ),
            shape,
        ),
        false => empty_device_contiguous_dtype(client, device, shape, dtype),
    };
    let size = dtype.size() as u64;
    // cuBLAS's A is dy_e (column-major [m, rows], ld ldy), B is x_e read transposed, C is dw_e.
    let problems: Vec<Problem> = blocks(counts)
        .map(|(e, start, rows)| Problem {
            m: m as i32,
            n: k as i32,
            k: rows as i32,
            transpose_a: false,
            transpose_b: true,
            lda: ldy as i32,
            ldb: ldx as i32,
            ldc: m as i32,
            offsets: [
                (start * ldy) as u64 * size,
                (start * ldx) as u64 * size,
                (e * k * m) as u64 * size,
            ],
        })
        .collect();
    submit(dtype, problems, [dy, x, &out]);
    Ok(out)
}

/// One expert's product in cuBLAS's column-major terms: `C [m, n] = op(A) · op(B)`, inner
/// dimension `k`; `offsets` are the byte offsets of A, B and C from their tensors' pointers.
#[derive(Debug, Clone, Copy)]
struct Problem {
    m: i32,
    n: i32,
    k: i32,
    transpose_a: bool,
    transpose_b: bool,
    lda: i32,
    ldb: i32,
    ldc: i32,
    offsets: [u64; 3],
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

/// Enqueues the grouped GEMM of `problems` on the compute stream; `tensors` are A's, B's and
/// C's tensors, the problems' offsets relative to them.
fn submit(dtype: DType, problems: Vec<Problem>, tensors: [&Tensor; 3]) {
    if problems.is_empty() {
        return;
    }
    let bindings = tensors.iter().map(|t| binding(t)).collect();
    let device = tensors[0].device.clone();
    ForeignQueue::new(&device).submit("cuBLAS grouped GEMM", bindings, Lane::Compute, move |ctx| {
        if ctx.extensions.get_mut::<GroupedState>().is_none() {
            let state = GroupedState::new()?;
            ctx.extensions.get_or_insert_with(|| state);
        }
        let state = ctx
            .extensions
            .get_mut::<GroupedState>()
            .expect("created above");
        state.run(ctx.stream, ctx.pointers, dtype, &problems)
    });
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

    /// Copies the problems' pointers to the device and runs the grouped GEMM, on `stream`.
    fn run(
        &mut self,
        stream: CUstream,
        bases: &[u64],
        dtype: DType,
        problems: &[Problem],
    ) -> Result<(), String> {
        self.bind(stream)?;
        let count = problems.len();
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
        for (i, problem) in problems.iter().enumerate() {
            for (operand, offset) in problem.offsets.iter().enumerate() {
                host[operand * count + i] = bases[operand] + offset;
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
        let each = |f: &dyn Fn(&Problem) -> i32| problems.iter().map(f).collect::<Vec<i32>>();
        let (transa, transb): (Vec<_>, Vec<_>) = problems
            .iter()
            .map(|p| (op(p.transpose_a), op(p.transpose_b)))
            .unzip();
        let (m, n, k) = (each(&|p| p.m), each(&|p| p.n), each(&|p| p.k));
        let (lda, ldb, ldc) = (each(&|p| p.lda), each(&|p| p.ldb), each(&|p| p.ldc));
        let (alpha, beta) = (vec![1.0f32; count], vec![0.0f32; count]);
        let group_size = vec![1i32; count];
        let (data, compute) = match dtype {
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
        let pointers = |operand: usize| (device + (operand * count * 8) as u64) as *const _;
        // SAFETY: the host arrays hold one entry per group (each problem its own group of
        // one); the device arrays address matrices inside the bound tensors, sized by them.
        unsafe {
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
                data,
                ldc.as_ptr(),
                count as i32,
                group_size.as_ptr(),
                compute,
            )
            .result()
            .map_err(|e| format!("cublasGemmGroupedBatchedEx: {e:?} for {problems:?}"))
        }
    }
}
