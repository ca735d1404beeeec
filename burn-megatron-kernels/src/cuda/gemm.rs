//! Dense GEMM through cuBLASLt, as a foreign operation on the compute stream: in order with
//! Burn's kernels, on Burn's device buffers, with no host synchronisation.
//!
//! Tensors are row-major (rows may be pitched); cuBLASLt is column-major. A row-major `[r, c]`
//! matrix with row stride `s` is the column-major `[c, r]` matrix with leading dimension `s`,
//! so `C = op(A) · op(B)` is computed as `Cᵀ = op(B)ᵀ · op(A)ᵀ` with the operands swapped and
//! each transpose folded into cuBLASLt's operation flags: nothing is materialised.
//!
//! bf16 and f16 inputs accumulate in f32; f32 inputs use TF32 tensor cores (as Burn's own f32
//! matmul does). The output is the inputs' type or f32.

use std::collections::HashMap;

use burn::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, FloatElement, IntElement};
use cubecl_core::server::Binding;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::sys::{CUdeviceptr, CUstream, cuMemAlloc_v2};

use super::foreign::{ForeignQueue, Lane, binding};
use super::runtime::MegatronCudaRuntime;
use crate::fused::fp8::Fp8Kind;

type Tensor = CubeTensor<MegatronCudaRuntime>;

/// Bytes of workspace cuBLASLt may use: what NVIDIA recommends for Hopper.
pub(super) const WORKSPACE_BYTES: usize = 32 << 20;

/// Why cuBLASLt cannot take a GEMM (the caller falls back to Burn's matmul).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GemmUnsupported {
    /// Inputs of another dtype, or of different dtypes.
    DType(DType, DType),
    /// An operand whose rows are not contiguous (a transposed view).
    Layout,
    /// Inner dimensions differ.
    Shape(Vec<usize>, Vec<usize>),
}

/// `op(a) · op(b)` (+ `bias` per output column), row-major, through cuBLASLt.
///
/// `a` is `[m, k]` (`[k, m]` with `transpose_a`), `b` is `[k, n]` (`[n, k]` with
/// `transpose_b`), `bias` is `[n]` of the output dtype. The output is `[m, n]`, of the inputs'
/// dtype unless `f32_output`.
pub fn gemm(
    a: &Tensor,
    b: &Tensor,
    transpose_a: bool,
    transpose_b: bool,
    bias: Option<&Tensor>,
    f32_output: bool,
) -> Result<Tensor, GemmUnsupported> {
    let p = Product::of(a, b, transpose_a, transpose_b)?;
    if bias.is_some_and(|t| t.meta.strides()[0] != 1) {
        return Err(GemmUnsupported::Layout);
    }
    let (m, n, k) = (p.m, p.n, p.k);
    let out_dtype = if f32_output { DType::F32 } else { a.dtype };
    let out = empty_device_contiguous_dtype(
        a.client.clone(),
        a.device.clone(),
        Shape::from(vec![m, n]),
        out_dtype,
    );
    let key = GemmKey {
        m,
        n,
        k,
        lda: p.lda,
        ldb: p.ldb,
        ldc: n,
        transpose_a: p.transpose_a,
        transpose_b: p.transpose_b,
        input: a.dtype,
        output: out_dtype,
        bias: bias.is_some(),
        accumulate: false,
        fp8: None,
        batch: None,
    };
    submit(key, a, b, binding(&out), bias, None);
    Ok(out)
}

/// The FP8 GEMM `(a · bᵀ) · a_scale_inv · b_scale_inv`, accumulated in f32, of output dtype
/// `out_dtype` (bf16, f16 or f32): `a: [m, k]` and `b: [n, k]` hold FP8 bits (`U8`, from
/// [`quantize`](crate::fused::fp8::quantize)), both K-contiguous as cuBLASLt's FP8 kernels
/// require; `a_scale_inv` and `b_scale_inv` are f32 `[1]` tensors on the device, read by the
/// GEMM (no host synchronisation). Not both operands E5M2, `k` a multiple of 16.
/// `fast_accumulation` lets the tensor cores' partial sums stay in their lower precision
/// longer (Transformer Engine's choice for the forward GEMM, not for the gradients').
#[allow(clippy::too_many_arguments)]
pub fn gemm_fp8(
    a: &Tensor,
    a_kind: Fp8Kind,
    a_scale_inv: &Tensor,
    b: &Tensor,
    b_kind: Fp8Kind,
    b_scale_inv: &Tensor,
    out_dtype: DType,
    fast_accumulation: bool,
) -> Result<Tensor, GemmUnsupported> {
    let fp8 = Fp8Gemm {
        a: a_kind,
        b: b_kind,
        fast_accumulation,
        blocks: None,
    };
    let key = fp8_key(a, a_scale_inv, b, b_scale_inv, fp8, out_dtype)?;
    Ok(fp8_product(key, a, a_scale_inv, b, b_scale_inv))
}

/// Enqueues the FP8 GEMM of `key` into a new `[m, n]` output of the key's dtype.
fn fp8_product(
    key: GemmKey,
    a: &Tensor,
    a_scale_inv: &Tensor,
    b: &Tensor,
    b_scale_inv: &Tensor,
) -> Tensor {
    let out = empty_device_contiguous_dtype(
        a.client.clone(),
        a.device.clone(),
        Shape::from(vec![key.m, key.n]),
        key.output,
    );
    let scales = Some((a_scale_inv, b_scale_inv));
    submit(key, a, b, binding(&out), None, scales);
    out
}

/// How a blockwise FP8 operand's reciprocal scales cover it (cuBLASLt's scale modes, CUDA
/// 12.9 and later, Hopper): `Vec128` one scale for 128 consecutive elements of a row along
/// `k` (`VEC128_32F`, scales `[k / 128, rows]`), `Square128` one for each 128 × 128 block
/// (`BLK128x128_32F`, scales `[rows / 128, ⌈k / 128⌉]`, each row padded to a multiple of 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockScaling {
    Vec128,
    Square128,
}

impl BlockScaling {
    /// The number of f32 scales of a `[rows, k]` operand.
    fn scale_len(self, rows: usize, k: usize) -> usize {
        match self {
            Self::Vec128 => rows * (k / 128),
            Self::Square128 => rows.div_ceil(128) * k.div_ceil(128).next_multiple_of(4),
        }
    }

    fn mode(self) -> sys::cublasLtMatmulMatrixScale_t {
        match self {
            Self::Vec128 => {
                sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
            }
            Self::Square128 => {
                sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
            }
        }
    }
}

/// [`gemm_fp8`] of two blockwise casts: `a: [m, k]` and `b: [n, k]` FP8 bits, each with its
/// reciprocal block scales (f32, in [`BlockScaling`]'s layout), accumulated in f32 with each
/// block's partial sum scaled, output `[m, n]` of `out_dtype`. `m`, `n`, `k` multiples of 128.
#[allow(clippy::too_many_arguments)]
pub fn gemm_fp8_blockwise(
    a: &Tensor,
    a_kind: Fp8Kind,
    a_scale_inv: &Tensor,
    a_blocks: BlockScaling,
    b: &Tensor,
    b_kind: Fp8Kind,
    b_scale_inv: &Tensor,
    b_blocks: BlockScaling,
    out_dtype: DType,
) -> Result<Tensor, GemmUnsupported> {
    let fp8 = Fp8Gemm {
        a: a_kind,
        b: b_kind,
        fast_accumulation: false,
        blocks: Some([a_blocks, b_blocks]),
    };
    let key = fp8_key(a, a_scale_inv, b, b_scale_inv, fp8, out_dtype)?;
    if ![key.m, key.n, key.k].iter().all(|d| d.is_multiple_of(128)) {
        return Err(GemmUnsupported::Shape(
            a.meta.shape().to_vec(),
            b.meta.shape().to_vec(),
        ));
    }
    Ok(fp8_product(key, a, a_scale_inv, b, b_scale_inv))
}

/// [`gemm_fp8`] added in place, in f32, to `buffer` at `start..start + m · n` (row-major):
/// the weight gradient's FP8 GEMM accumulating into its slot of a flat f32 gradient buffer
/// (beta 1, Megatron's gradient-accumulation fusion). `buffer` is a contiguous f32 `[numel]`
/// that no other tensor shares.
#[allow(clippy::too_many_arguments)]
pub fn gemm_fp8_accumulate_at(
    a: &Tensor,
    a_kind: Fp8Kind,
    a_scale_inv: &Tensor,
    b: &Tensor,
    b_kind: Fp8Kind,
    b_scale_inv: &Tensor,
    fast_accumulation: bool,
    buffer: &Tensor,
    start: usize,
) -> Result<(), GemmUnsupported> {
    let fp8 = Fp8Gemm {
        a: a_kind,
        b: b_kind,
        fast_accumulation,
        blocks: None,
    };
    let key = GemmKey {
        accumulate: true,
        ..fp8_key(a, a_scale_inv, b, b_scale_inv, fp8, DType::F32)?
    };
    let slot = slot_of(buffer, start, key.m * key.n)?;
    submit(key, a, b, slot, None, Some((a_scale_inv, b_scale_inv)));
    Ok(())
}

/// The f32 elements an accumulated output's start must be a multiple of: 16 bytes, the
/// alignment cuBLASLt's kernels need of an output they read (a slot at 28 bytes ran into
/// `CUBLAS_STATUS_NOT_SUPPORTED` on an H200).
pub(super) const OUTPUT_ALIGNMENT: usize = 4;

/// The plan key of [`gemm_fp8`] for these operands, after checking them.
fn fp8_key(
    a: &Tensor,
    a_scale_inv: &Tensor,
    b: &Tensor,
    b_scale_inv: &Tensor,
    fp8: Fp8Gemm,
    out_dtype: DType,
) -> Result<GemmKey, GemmUnsupported> {
    if a.dtype != DType::U8 || b.dtype != DType::U8 {
        return Err(GemmUnsupported::DType(a.dtype, b.dtype));
    }
    if (fp8.a, fp8.b) == (Fp8Kind::E5M2, Fp8Kind::E5M2)
        || !matches!(out_dtype, DType::F32 | DType::BF16 | DType::F16)
    {
        return Err(GemmUnsupported::DType(a.dtype, out_dtype));
    }
    let (a_view, b_view) = (Operand::of(a)?, Operand::of(b)?);
    let lens = match fp8.blocks {
        Some([a_blocks, b_blocks]) => [
            a_blocks.scale_len(a_view.rows, a_view.cols),
            b_blocks.scale_len(b_view.rows, b_view.cols),
        ],
        None => [1, 1],
    };
    for (scale, len) in [a_scale_inv, b_scale_inv].into_iter().zip(lens) {
        if scale.dtype != DType::F32
            || scale.meta.shape().num_elements() != len
            || !scale.is_contiguous()
        {
            return Err(GemmUnsupported::DType(scale.dtype, DType::F32));
        }
    }
    if a_view.transposed || b_view.transposed {
        return Err(GemmUnsupported::Layout);
    }
    let (m, k, n) = (a_view.rows, a_view.cols, b_view.rows);
    if b_view.cols != k || !k.is_multiple_of(16) || a_view.ld % 16 != 0 || b_view.ld % 16 != 0 {
        return Err(GemmUnsupported::Shape(
            a.meta.shape().to_vec(),
            b.meta.shape().to_vec(),
        ));
    }
    Ok(GemmKey {
        m,
        n,
        k,
        lda: a_view.ld,
        ldb: b_view.ld,
        ldc: n,
        transpose_a: false,
        transpose_b: true,
        input: DType::U8,
        output: out_dtype,
        bias: false,
        accumulate: false,
        fp8: Some(fp8),
        batch: None,
    })
}

/// The binding of `buffer[start..start + len]`, a slot of a contiguous f32 `[numel]` that no
/// other tensor shares, starting on a 16-byte boundary (`start` a multiple of 4: cuBLASLt
/// refuses a less aligned output when it runs).
pub(super) fn slot_of(
    buffer: &Tensor,
    start: usize,
    len: usize,
) -> Result<Binding, GemmUnsupported> {
    if buffer.dtype != DType::F32 {
        return Err(GemmUnsupported::DType(buffer.dtype, DType::F32));
    }
    let shape = buffer.meta.shape();
    if shape.len() != 1
        || !buffer.is_contiguous()
        || !buffer.handle.can_mut()
        || !start.is_multiple_of(OUTPUT_ALIGNMENT)
    {
        return Err(GemmUnsupported::Layout);
    }
    if start + len > shape[0] {
        return Err(GemmUnsupported::Shape(vec![start, len], shape.to_vec()));
    }
    Ok(buffer
        .handle
        .clone()
        .offset_start((start * DType::F32.size()) as u64)
        .binding())
}

/// `acc += op(a) · op(b)` in place, for an f32 `[m, n]` accumulator with bf16, f16 or f32
/// inputs: Megatron's gradient-accumulation fusion, where the weight gradient is added
/// straight into the fp32 main-gradient buffer. `acc` must not be shared (the caller owns it).
pub fn gemm_accumulate(
    a: &Tensor,
    b: &Tensor,
    transpose_a: bool,
    transpose_b: bool,
    acc: &Tensor,
) -> Result<(), GemmUnsupported> {
    let p = Product::of(a, b, transpose_a, transpose_b)?;
    let acc_view = Operand::of(acc)?;
    if acc.dtype != DType::F32 {
        return Err(GemmUnsupported::DType(a.dtype, acc.dtype));
    }
    if acc_view.transposed || !acc.handle.can_mut() {
        return Err(GemmUnsupported::Layout);
    }
    if (acc_view.rows, acc_view.cols) != (p.m, p.n) {
        return Err(GemmUnsupported::Shape(
            a.meta.shape().to_vec(),
            acc.meta.shape().to_vec(),
        ));
    }
    submit(
        accumulate_key(&p, a.dtype, acc_view.ld),
        a,
        b,
        binding(acc),
        None,
        None,
    );
    Ok(())
}

/// `buffer[start..start + m·n] += op(a) · op(b)`, the `[m, n]` product added row-major to a
/// slot of a flat f32 buffer, in place: a weight's gradient accumulated into its slot of the
/// flat fp32 gradient buffer by the weight-gradient GEMM itself. `buffer` must be contiguous
/// and not shared (the caller owns it), and the slot must lie inside it, `start` a multiple
/// of 4 (16 bytes).
pub fn gemm_accumulate_at(
    a: &Tensor,
    b: &Tensor,
    transpose_a: bool,
    transpose_b: bool,
    buffer: &Tensor,
    start: usize,
) -> Result<(), GemmUnsupported> {
    let p = Product::of(a, b, transpose_a, transpose_b)?;
    let slot = slot_of(buffer, start, p.m * p.n)?;
    submit(accumulate_key(&p, a.dtype, p.n), a, b, slot, None, None);
    Ok(())
}

/// The plan key of `out += op(a) · op(b)` into f32 rows of stride `ldc`.
fn accumulate_key(p: &Product, input: DType, ldc: usize) -> GemmKey {
    GemmKey {
        m: p.m,
        n: p.n,
        k: p.k,
        lda: p.lda,
        ldb: p.ldb,
        ldc,
        transpose_a: p.transpose_a,
        transpose_b: p.transpose_b,
        input,
        output: DType::F32,
        bias: false,
        accumulate: true,
        fp8: None,
        batch: None,
    }
}

/// Enqueues `out = op(a) · op(b) (+ bias | + out)` on the compute stream; FP8 operands are
/// scaled by `scales_inv` (`a`'s, `b`'s).
fn submit(
    key: GemmKey,
    a: &Tensor,
    b: &Tensor,
    out: Binding,
    bias: Option<&Tensor>,
    scales_inv: Option<(&Tensor, &Tensor)>,
) {
    let mut bindings = vec![binding(a), binding(b), out];
    bindings.extend(bias.map(binding));
    let scale_at = bindings.len();
    if let Some((a_scale, b_scale)) = scales_inv {
        bindings.extend([binding(a_scale), binding(b_scale)]);
    }
    let scaled = scales_inv.is_some();
    ForeignQueue::new(&a.device).submit("cuBLASLt GEMM", bindings, Lane::Compute, move |ctx| {
        let state = LtState::of(ctx.extensions);
        let plan = state.plan(key).map_err(|e| format!("{e:?} for {key:?}"))?;
        let p = ctx.pointers;
        // SAFETY: the pointers address the tensors the plan's layouts describe; the workspace
        // is used only on the compute stream, one GEMM after another.
        unsafe {
            if key.bias {
                let bias = sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER;
                set_desc(plan.desc, bias, &p[3]).map_err(|e| e.to_string())?;
            }
            if scaled {
                // cuBLASLt's A is our `b` and its B our `a` (see the module docs).
                use sys::cublasLtMatmulDescAttributes_t::*;
                for (attribute, pointer) in [
                    (CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &p[scale_at + 1]),
                    (CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &p[scale_at]),
                ] {
                    set_desc(plan.desc, attribute, pointer).map_err(|e| e.to_string())?;
                }
            }
            let workspace = state.workspace;
            state.run(&plan, key, [p[0], p[1], p[2]], ctx.stream, workspace)
        }
    });
}

/// A 2D operand as a row-major matrix in memory: `rows × cols` with row stride `ld`, read
/// transposed if the tensor is a transposed view of it.
struct Operand {
    rows: usize,
    cols: usize,
    ld: usize,
    transposed: bool,
}

impl Operand {
    fn of(t: &Tensor) -> Result<Self, GemmUnsupported> {
        let (shape, strides) = (t.meta.shape(), t.meta.strides());
        if shape.len() != 2 {
            return Err(GemmUnsupported::Layout);
        }
        let (r, c) = (shape[0], shape[1]);
        if strides[1] == 1 && strides[0] >= c.max(1) {
            Ok(Self {
                rows: r,
                cols: c,
                ld: strides[0],
                transposed: false,
            })
        } else if strides[0] == 1 && strides[1] >= r.max(1) {
            Ok(Self {
                rows: c,
                cols: r,
                ld: strides[1],
                transposed: true,
            })
        } else {
            Err(GemmUnsupported::Layout)
        }
    }
}

/// `op(a) · op(b)` checked and sized: `[m, k] · [k, n]`, with views folded into the flags.
struct Product {
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    transpose_a: bool,
    transpose_b: bool,
}

impl Product {
    fn of(
        a: &Tensor,
        b: &Tensor,
        transpose_a: bool,
        transpose_b: bool,
    ) -> Result<Self, GemmUnsupported> {
        if a.dtype != b.dtype || !matches!(a.dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(GemmUnsupported::DType(a.dtype, b.dtype));
        }
        let (a_view, b_view) = (Operand::of(a)?, Operand::of(b)?);
        // A transposed view of a row-major matrix is that matrix with the flag flipped.
        let transpose_a = transpose_a != a_view.transposed;
        let transpose_b = transpose_b != b_view.transposed;
        let (m, k) = if transpose_a {
            (a_view.cols, a_view.rows)
        } else {
            (a_view.rows, a_view.cols)
        };
        let (k2, n) = if transpose_b {
            (b_view.cols, b_view.rows)
        } else {
            (b_view.rows, b_view.cols)
        };
        if k != k2 {
            return Err(GemmUnsupported::Shape(
                a.meta.shape().to_vec(),
                b.meta.shape().to_vec(),
            ));
        }
        Ok(Self {
            m,
            n,
            k,
            lda: a_view.ld,
            ldb: b_view.ld,
            transpose_a,
            transpose_b,
        })
    }
}

/// Everything that selects a cuBLASLt plan: `c [m, n] = op(a) · op(b)`, row-major, inner
/// dimension `k`, row strides `lda`, `ldb`, `ldc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct GemmKey {
    pub(super) m: usize,
    pub(super) n: usize,
    pub(super) k: usize,
    pub(super) lda: usize,
    pub(super) ldb: usize,
    pub(super) ldc: usize,
    pub(super) transpose_a: bool,
    pub(super) transpose_b: bool,
    pub(super) input: DType,
    pub(super) output: DType,
    pub(super) bias: bool,
    pub(super) accumulate: bool,
    /// FP8 operands (`input` is then `U8`, the bytes holding them).
    pub(super) fp8: Option<Fp8Gemm>,
    /// A strided batch of such products (the padded experts' blocks), `None` for one.
    pub(super) batch: Option<Batch>,
}

/// `count` products of one key, each operand's matrices `strides` elements apart (`a`, `b`,
/// `c`): one cuBLASLt call for all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Batch {
    pub(super) count: usize,
    pub(super) strides: [usize; 3],
}

/// The FP8 formats of a GEMM's operands, its accumulation mode, and the operands' block
/// scaling (`a`'s, `b`'s; `None`: one scale each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Fp8Gemm {
    a: Fp8Kind,
    b: Fp8Kind,
    fast_accumulation: bool,
    blocks: Option<[BlockScaling; 2]>,
}

fn fp8_type(kind: Fp8Kind) -> sys::cudaDataType {
    match kind {
        Fp8Kind::E4M3 => sys::cudaDataType::CUDA_R_8F_E4M3,
        Fp8Kind::E5M2 => sys::cudaDataType::CUDA_R_8F_E5M2,
    }
}

/// Descriptors, layouts and the heuristic's algorithm for one key (kept for the process).
#[derive(Clone, Copy)]
pub(super) struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    first: sys::cublasLtMatrixLayout_t,
    second: sys::cublasLtMatrixLayout_t,
    out: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

/// Per-device cuBLASLt state: the handle, the compute stream's workspace and the plans.
pub(super) struct LtState {
    handle: sys::cublasLtHandle_t,
    pub(super) workspace: CUdeviceptr,
    plans: HashMap<GemmKey, Plan>,
}

// SAFETY: used only on the device thread, inside foreign operations.
unsafe impl Send for LtState {}

fn data_type(dtype: DType) -> sys::cudaDataType {
    match dtype {
        DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        _ => sys::cudaDataType::CUDA_R_32F,
    }
}

impl LtState {
    /// The device's state, created on first use.
    pub(super) fn of(extensions: &mut super::foreign::Extensions) -> &mut Self {
        if extensions.get_mut::<Self>().is_none() {
            extensions.get_or_insert_with(|| Self::new().expect("cuBLASLt"));
        }
        extensions.get_mut::<Self>().expect("created above")
    }

    /// Enqueues `plan` (made for `key`) on `stream`: `c = op(a) · op(b)` (`+ c` where the key
    /// accumulates), `a`, `b`, `c` device pointers, with `workspace` ([`WORKSPACE_BYTES`]).
    ///
    /// # Safety
    /// The pointers address matrices of the key's layouts; `workspace` is used by no other
    /// stream while this GEMM may run.
    pub(super) unsafe fn run(
        &self,
        plan: &Plan,
        key: GemmKey,
        [a, b, c]: [u64; 3],
        stream: CUstream,
        workspace: CUdeviceptr,
    ) -> Result<(), String> {
        let alpha = 1.0f32;
        let beta = if key.accumulate { 1.0f32 } else { 0.0 };
        // SAFETY: as the caller promises; cuBLASLt's first operand is our `b` (module docs).
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const _,
                &beta as *const f32 as *const _,
                b as *const _,
                plan.first,
                a as *const _,
                plan.second,
                c as *const _,
                plan.out,
                c as *mut _,
                plan.out,
                &plan.algo,
                workspace as *mut _,
                WORKSPACE_BYTES,
                stream as sys::cudaStream_t,
            )
            .map_err(|e| format!("cublasLtMatmul: {e} for {key:?}"))
        }
    }

    fn new() -> Result<Self, String> {
        let handle = lt::create_handle().map_err(|e| format!("cublasLtCreate: {e}"))?;
        let mut workspace = 0;
        // SAFETY: allocation in the current (primary) context.
        let result = unsafe { cuMemAlloc_v2(&mut workspace, WORKSPACE_BYTES) };
        if result != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemAlloc of the cuBLASLt workspace: {result:?}"));
        }
        Ok(Self {
            handle,
            workspace,
            plans: HashMap::new(),
        })
    }

    pub(super) fn plan(&mut self, key: GemmKey) -> Result<Plan, lt::CublasError> {
        if let Some(plan) = self.plans.get(&key) {
            return Ok(*plan);
        }
        let compute = match key.input {
            DType::F32 => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            _ => sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        };
        let desc = lt::create_matmul_desc(compute, sys::cudaDataType::CUDA_R_32F)?;
        let op = |transpose: bool| -> i32 { transpose as i32 };
        // The first cuBLASLt operand is B, the second A (see the module docs).
        let (trans_first, trans_second) = (op(key.transpose_b), op(key.transpose_a));
        // SAFETY: attributes of a descriptor we own, each of its attribute's type.
        unsafe {
            use sys::cublasLtMatmulDescAttributes_t::*;
            set_desc(desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_first)?;
            set_desc(desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_second)?;
            if let Some(fp8) = key.fp8 {
                set_desc(
                    desc,
                    CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                    &(fp8.fast_accumulation as i8),
                )?;
                if let Some([a_blocks, b_blocks]) = fp8.blocks {
                    // cuBLASLt's A is our `b`, its B our `a` (module docs).
                    set_desc(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &b_blocks.mode())?;
                    set_desc(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &a_blocks.mode())?;
                    // The heuristic refuses block scaling without scale pointers (an invalid
                    // value): any device address until each call sets the operands' own.
                    set_desc(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &self.workspace)?;
                    set_desc(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &self.workspace)?;
                }
            }
            if key.bias {
                let epilogue = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS;
                set_desc(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
            }
        }
        // A row-major [r, c] matrix with row stride s is column-major [c, r] with ld s.
        let layout = |dtype: sys::cudaDataType, rows: usize, cols: usize, ld: usize| {
            lt::create_matrix_layout(dtype, cols as u64, rows as u64, ld as i64)
        };
        let (a_type, b_type) = match key.fp8 {
            Some(fp8) => (fp8_type(fp8.a), fp8_type(fp8.b)),
            None => (data_type(key.input), data_type(key.input)),
        };
        // The stored (row-major) shapes of the operands.
        let (b_rows, b_cols) = if key.transpose_b {
            (key.n, key.k)
        } else {
            (key.k, key.n)
        };
        let (a_rows, a_cols) = if key.transpose_a {
            (key.k, key.m)
        } else {
            (key.m, key.k)
        };
        let first = layout(b_type, b_rows, b_cols, key.ldb)?;
        let second = layout(a_type, a_rows, a_cols, key.lda)?;
        let out = layout(data_type(key.output), key.m, key.n, key.ldc)?;
        if let Some(batch) = key.batch {
            let count = batch.count as i32;
            let [a_stride, b_stride, c_stride] = batch.strides.map(|s| s as i64);
            for (layout, stride) in [(first, b_stride), (second, a_stride), (out, c_stride)] {
                use sys::cublasLtMatrixLayoutAttribute_t::*;
                // SAFETY: attributes of a layout we own, each of its attribute's type.
                unsafe {
                    set_layout(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count)?;
                    set_layout(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride)?;
                }
            }
        }
        let pref = lt::create_matmul_pref()?;
        // SAFETY: as above.
        let heuristic = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &WORKSPACE_BYTES as *const usize as *const _,
                core::mem::size_of::<usize>(),
            )?;
            let heuristic =
                lt::get_matmul_algo_heuristic(self.handle, desc, first, second, out, out, pref);
            let _ = lt::destroy_matmul_pref(pref);
            heuristic?
        };
        let plan = Plan {
            desc,
            first,
            second,
            out,
            algo: heuristic.algo,
        };
        self.plans.insert(key, plan);
        Ok(plan)
    }
}

/// Sets `attribute` of a matmul descriptor to `value`.
///
/// # Safety
/// `desc` is live and `T` is the attribute's type.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attribute: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<(), lt::CublasError> {
    let size = core::mem::size_of::<T>();
    // SAFETY: as the caller promises; `value` is `size` bytes.
    unsafe { lt::set_matmul_desc_attribute(desc, attribute, value as *const T as *const _, size) }
}

/// Sets `attribute` of a matrix layout to `value`.
///
/// # Safety
/// `layout` is live and `T` is the attribute's type.
unsafe fn set_layout<T>(
    layout: sys::cublasLtMatrixLayout_t,
    attribute: sys::cublasLtMatrixLayoutAttribute_t,
    value: &T,
) -> Result<(), lt::CublasError> {
    let size = core::mem::size_of::<T>();
    // SAFETY: as the caller promises; `value` is `size` bytes.
    unsafe {
        lt::set_matrix_layout_attribute(layout, attribute, value as *const T as *const _, size)
    }
}

/// A Burn backend on our runtime, whatever its element types.
type OurBackend<F, I, BT> = burn_cubecl::CubeBackend<MegatronCudaRuntime, F, I, BT>;

/// `op(a) · op(b)` on Burn tensors of our backend: cuBLASLt when it can take the operands
/// (2D, row-major or transposed views, f32/bf16/f16), Burn's matmul otherwise.
pub fn matmul<F: FloatElement, I: IntElement, BT: BoolElement>(
    a: burn::tensor::Tensor<OurBackend<F, I, BT>, 2>,
    b: burn::tensor::Tensor<OurBackend<F, I, BT>, 2>,
    transpose_a: bool,
    transpose_b: bool,
) -> burn::tensor::Tensor<OurBackend<F, I, BT>, 2> {
    linear(a, b, None, transpose_a, transpose_b)
}

/// `op(x) · op(w) + bias`, the bias added by cuBLASLt's epilogue; Burn's ops where cuBLASLt
/// cannot take the operands.
pub fn linear<F: FloatElement, I: IntElement, BT: BoolElement>(
    x: burn::tensor::Tensor<OurBackend<F, I, BT>, 2>,
    w: burn::tensor::Tensor<OurBackend<F, I, BT>, 2>,
    bias: Option<burn::tensor::Tensor<OurBackend<F, I, BT>, 1>>,
    transpose_x: bool,
    transpose_w: bool,
) -> burn::tensor::Tensor<OurBackend<F, I, BT>, 2> {
    use burn::tensor::TensorPrimitive;
    let raw =
        |t: &burn::tensor::Tensor<OurBackend<F, I, BT>, 2>| t.clone().into_primitive().tensor();
    let raw_bias = bias.as_ref().map(|b| b.clone().into_primitive().tensor());
    let dtypes_match = bias.as_ref().is_none_or(|b| b.dtype() == x.dtype());
    let fused = match dtypes_match {
        true => gemm(
            &raw(&x),
            &raw(&w),
            transpose_x,
            transpose_w,
            raw_bias.as_ref(),
            false,
        )
        .ok(),
        false => None,
    };
    match fused {
        Some(out) => burn::tensor::Tensor::from_primitive(TensorPrimitive::Float(out)),
        None => {
            let x = if transpose_x { x.transpose() } else { x };
            let w = if transpose_w { w.transpose() } else { w };
            let out = x.matmul(w);
            match bias {
                Some(bias) => out + bias.unsqueeze(),
                None => out,
            }
        }
    }
}
