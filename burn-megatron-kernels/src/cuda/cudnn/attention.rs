//! Flash attention through cuDNN's fused scaled-dot-product-attention engines, forward and
//! backward, as foreign operations on the compute stream.
//!
//! The graphs are the ones cuDNN's fused engines recognise (its frontend builds the same):
//! - forward: `s = scale · q kᵀ`, the causal mask (`row ≥ col`, else −∞), `max`, `exp(s − max)`,
//!   `sum`, the row statistic `lse = max + ln sum` (f32, what our backward stores), `p = e / sum`
//!   in the input type, `o = p v`;
//! - backward: `delta = rowsum(dO ∘ o)`, `p = exp(scale · q kᵀ − lse)` (masked), `dv = pᵀ dO`,
//!   `ds = p ∘ (dO vᵀ − delta) · scale`, `dk = dsᵀ q`, `dq = ds k` accumulated in f32, then
//!   rounded. With grouped queries, `dk` and `dv` are summed over the query heads of a group.
//!
//! Nothing `[seq_q, seq_k]`-sized is stored: the engines tile it. cuDNN's backward accumulates
//! `dq` with atomics, so it is not bit-deterministic (our CubeCL kernels are).
//!
//! Inputs may be any views with contiguous, 16-byte aligned rows (e.g. q, k, v as views of a
//! packed QKV buffer); [`backward_into`] writes the gradients into views the caller gives.
//!
//! [`forward`] and [`backward`] return `None` when cuDNN cannot take the call (f32, head dims
//! that are not a multiple of 8 or above 128, key counts that are not a multiple of 128,
//! misaligned views, no libcudnn, or no engine for the graph); the caller then uses the CubeCL
//! kernels. A plan is built once per shape and layout, on first use (the device thread runs it
//! while the caller waits, with no GPU synchronisation), and kept for the process.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use burn::tensor::{DType, Shape};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cudarc::cudnn::sys;
use cudarc::driver::sys::{CUdeviceptr, CUresult, cuMemAlloc_v2};

use super::graph::{CudnnResult, DataType, Graph, Layout, Plan, Pointwise, Reduce, Uid, check};
use crate::cuda::foreign::{ForeignQueue, Lane, binding};
use crate::cuda::runtime::MegatronCudaRuntime;

type Tensor = CubeTensor<MegatronCudaRuntime>;

/// The largest head dimension routed to cuDNN.
pub const MAX_HEAD_DIM: usize = 128;

/// Key counts must be a multiple of this: cuDNN 9 up to 9.15 needs a padding mask otherwise.
pub const KEY_MULTIPLE: usize = 128;

// Unique ids of the graphs' non-virtual tensors.
const Q: Uid = 1;
const K: Uid = 2;
const V: Uid = 3;
const O: Uid = 4;
const STATS: Uid = 5;
const SCALE: Uid = 6;
const NEG_INF: Uid = 7;
const DO: Uid = 8;
const DQ: Uid = 9;
const DK: Uid = 10;
const DV: Uid = 11;
const DELTA: Uid = 12;
const DQ_F32: Uid = 13;
const ONE: Uid = 14;

/// The sizes, type and masking of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Sizes {
    dtype: DataType,
    batch: i64,
    heads: i64,
    kv_heads: i64,
    seq_q: i64,
    seq_k: i64,
    head_dim: i64,
    causal: bool,
}

impl Sizes {
    fn scores(&self) -> Layout {
        Layout::packed([self.batch, self.heads, self.seq_q, self.seq_k])
    }

    /// The scores transposed in place (`[.., seq_k, seq_q]` over the same memory).
    fn scores_transposed(&self) -> Layout {
        self.scores().swapped(2, 3)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ForwardKey {
    sizes: Sizes,
    q: Layout,
    k: Layout,
    v: Layout,
    out: Layout,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct BackwardKey {
    sizes: Sizes,
    q: Layout,
    k: Layout,
    v: Layout,
    out: Layout,
    grad_out: Layout,
    dq: Layout,
    dk: Layout,
    dv: Layout,
}

/// A plan's identity. (A few hundred bytes on the stack per call; boxing would not pay.)
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Key {
    Forward(ForwardKey),
    Backward(BackwardKey),
}

/// `causal ? (row ≥ col ? x : −∞) : x`.
fn mask(g: &mut Graph, sizes: &Sizes, x: Uid) -> CudnnResult<Uid> {
    if !sizes.causal {
        return Ok(x);
    }
    let layout = sizes.scores();
    g.scalar(NEG_INF, DataType::Float)?;
    let row = g.temporary(DataType::Int32, layout)?;
    g.pointwise(
        Pointwise::CUDNN_POINTWISE_GEN_INDEX,
        DataType::Float,
        &[x],
        row,
        Some(2),
    )?;
    let col = g.temporary(DataType::Int32, layout)?;
    g.pointwise(
        Pointwise::CUDNN_POINTWISE_GEN_INDEX,
        DataType::Float,
        &[x],
        col,
        Some(3),
    )?;
    let keep = g.temporary(DataType::Boolean, layout)?;
    g.pointwise(
        Pointwise::CUDNN_POINTWISE_CMP_GE,
        DataType::Boolean,
        &[row, col],
        keep,
        None,
    )?;
    let y = g.temporary(DataType::Float, layout)?;
    g.pointwise(
        Pointwise::CUDNN_POINTWISE_BINARY_SELECT,
        DataType::Float,
        &[x, NEG_INF, keep],
        y,
        None,
    )?;
    Ok(y)
}

/// `scale · q kᵀ` (f32, `[batch, heads, seq_q, seq_k]`).
fn scaled_scores(g: &mut Graph, sizes: &Sizes) -> CudnnResult<Uid> {
    let f32 = DataType::Float;
    let raw = g.temporary(f32, sizes.scores())?;
    g.matmul(Q, K, raw)?;
    let scaled = g.temporary(f32, sizes.scores())?;
    g.pointwise(
        Pointwise::CUDNN_POINTWISE_MUL,
        f32,
        &[raw, SCALE],
        scaled,
        None,
    )?;
    Ok(scaled)
}

fn forward_graph(key: &ForwardKey) -> CudnnResult<Graph> {
    use Pointwise::*;
    let (s, f32) = (key.sizes, DataType::Float);
    let mut g = Graph::new();
    g.tensor(Q, s.dtype, key.q)?;
    g.tensor(K, s.dtype, key.k.swapped(2, 3))?;
    g.tensor(V, s.dtype, key.v)?;
    g.tensor(O, s.dtype, key.out)?;
    g.tensor(STATS, f32, s.scores().rows())?;
    g.scalar(SCALE, f32)?;
    let scores = scaled_scores(&mut g, &s)?;
    let scores = mask(&mut g, &s, scores)?;
    let (rows, all) = (s.scores().rows(), s.scores());
    let max = g.temporary(f32, rows)?;
    g.reduction(Reduce::CUDNN_REDUCE_TENSOR_MAX, scores, max)?;
    let centred = g.temporary(f32, all)?;
    g.pointwise(CUDNN_POINTWISE_SUB, f32, &[scores, max], centred, None)?;
    let exp = g.temporary(f32, all)?;
    g.pointwise(CUDNN_POINTWISE_EXP, f32, &[centred], exp, None)?;
    let sum = g.temporary(f32, rows)?;
    g.reduction(Reduce::CUDNN_REDUCE_TENSOR_ADD, exp, sum)?;
    let log = g.temporary(f32, rows)?;
    g.pointwise(CUDNN_POINTWISE_LOG, f32, &[sum], log, None)?;
    g.pointwise(CUDNN_POINTWISE_ADD, f32, &[max, log], STATS, None)?;
    let probs = g.temporary(s.dtype, all)?;
    g.pointwise(CUDNN_POINTWISE_DIV, f32, &[exp, sum], probs, None)?;
    g.matmul(probs, V, O)?;
    Ok(g)
}

/// `c = a · b`, summed over the query heads of each key/value head when they differ.
fn matmul_per_kv_head(g: &mut Graph, sizes: &Sizes, a: Uid, b: Uid, c: Uid) -> CudnnResult<()> {
    if sizes.heads == sizes.kv_heads {
        return g.matmul(a, b, c);
    }
    let per_query_head = Layout::packed([sizes.batch, sizes.heads, sizes.seq_k, sizes.head_dim]);
    let full = g.temporary(sizes.dtype, per_query_head)?;
    g.matmul(a, b, full)?;
    g.reduction(Reduce::CUDNN_REDUCE_TENSOR_ADD, full, c)
}

fn backward_graph(key: &BackwardKey) -> CudnnResult<Graph> {
    use Pointwise::*;
    let (s, f32) = (key.sizes, DataType::Float);
    let mut g = Graph::new();
    g.tensor(Q, s.dtype, key.q)?;
    g.tensor(K, s.dtype, key.k.swapped(2, 3))?;
    g.tensor(V, s.dtype, key.v.swapped(2, 3))?;
    g.tensor(O, s.dtype, key.out)?;
    g.tensor(DO, s.dtype, key.grad_out)?;
    g.tensor(STATS, f32, s.scores().rows())?;
    g.tensor(DQ, s.dtype, key.dq)?;
    g.tensor(DK, s.dtype, key.dk)?;
    g.tensor(DV, s.dtype, key.dv)?;
    g.tensor(DELTA, f32, s.scores().rows())?;
    g.tensor(DQ_F32, f32, Layout::packed(key.q.dims))?;
    g.scalar(SCALE, f32)?;
    g.scalar(ONE, f32)?;
    let (rows, all) = (s.scores().rows(), s.scores());

    // delta = rowsum(dO ∘ o), kept in memory for the engine.
    let [b, h, sq, d] = key.q.dims;
    let product = g.temporary(
        f32,
        Layout {
            dims: [b, h, sq, d],
            strides: [h * sq * d, sq * d, h * d, 1],
        },
    )?;
    g.pointwise(CUDNN_POINTWISE_MUL, f32, &[DO, O], product, None)?;
    let summed = g.temporary(f32, rows)?;
    g.reduction(Reduce::CUDNN_REDUCE_TENSOR_ADD, product, summed)?;
    g.pointwise(CUDNN_POINTWISE_MUL, f32, &[summed, ONE], DELTA, None)?;

    // p = exp(scale · q kᵀ − lse), masked.
    let scores = scaled_scores(&mut g, &s)?;
    let centred = g.temporary(f32, all)?;
    g.pointwise(CUDNN_POINTWISE_SUB, f32, &[scores, STATS], centred, None)?;
    let centred = mask(&mut g, &s, centred)?;
    let probs = g.temporary(f32, all)?;
    g.pointwise(CUDNN_POINTWISE_EXP, f32, &[centred], probs, None)?;

    // dv = pᵀ dO
    let probs_t = g.temporary(s.dtype, s.scores_transposed())?;
    g.reshape(probs, probs_t)?;
    matmul_per_kv_head(&mut g, &s, probs_t, DO, DV)?;

    // ds = p ∘ (dO vᵀ − delta) · scale
    let dp = g.temporary(f32, all)?;
    g.matmul(DO, V, dp)?;
    let centred_dp = g.temporary(f32, all)?;
    g.pointwise(CUDNN_POINTWISE_SUB, f32, &[dp, DELTA], centred_dp, None)?;
    let ds = g.temporary(f32, all)?;
    g.pointwise(CUDNN_POINTWISE_MUL, f32, &[centred_dp, probs], ds, None)?;
    let ds_scaled = g.temporary(f32, all)?;
    g.pointwise(CUDNN_POINTWISE_MUL, f32, &[ds, SCALE], ds_scaled, None)?;

    // dk = dsᵀ q
    let ds_t = g.temporary(s.dtype, s.scores_transposed())?;
    g.reshape(ds_scaled, ds_t)?;
    matmul_per_kv_head(&mut g, &s, ds_t, Q, DK)?;

    // dq = ds k, accumulated in f32, then rounded.
    let k_rows = g.temporary(s.dtype, key.k)?;
    g.reshape(K, k_rows)?;
    g.matmul(ds_scaled, k_rows, DQ_F32)?;
    g.pointwise(CUDNN_POINTWISE_IDENTITY, f32, &[DQ_F32], DQ, None)?;
    Ok(g)
}

/// A plan and its scratch memory: the engine's workspace, then (backward) `delta` and the f32
/// `dq`. Plans run one after another on the compute stream, so one allocation serves every
/// execution.
struct Prepared {
    plan: Plan,
    scratch: CUdeviceptr,
    scratch_bytes: usize,
    delta_offset: usize,
    dq_offset: usize,
}

/// Per-device cuDNN state: the handle and the plans.
struct CudnnState {
    handle: sys::cudnnHandle_t,
    plans: HashMap<Key, Prepared>,
}

// SAFETY: used only on the device thread, inside foreign operations.
unsafe impl Send for CudnnState {}

fn align(bytes: usize) -> usize {
    bytes.div_ceil(256) * 256
}

impl CudnnState {
    fn new() -> CudnnResult<Self> {
        // Loading libcudnn panics in cudarc when it is missing: report that as unsupported.
        let loaded = std::panic::catch_unwind(|| unsafe { sys::culib() }).is_ok();
        if !loaded {
            return Err("libcudnn could not be loaded".into());
        }
        let mut handle = std::ptr::null_mut();
        // SAFETY: creates a handle in the current context (the device thread's).
        check(unsafe { sys::cudnnCreate(&mut handle) }, "cudnnCreate")?;
        Ok(Self {
            handle,
            plans: HashMap::new(),
        })
    }

    fn prepare(&mut self, key: Key) -> CudnnResult<&Prepared> {
        if !self.plans.contains_key(&key) {
            let (graph, extra) = match &key {
                Key::Forward(k) => (forward_graph(k)?, [0, 0]),
                Key::Backward(k) => {
                    let rows = (k.sizes.batch * k.sizes.heads * k.sizes.seq_q) as usize;
                    (
                        backward_graph(k)?,
                        [rows * 4, rows * k.sizes.head_dim as usize * 4],
                    )
                }
            };
            let plan = graph.build(self.handle)?;
            let delta_offset = align(plan.workspace_bytes);
            let dq_offset = delta_offset + align(extra[0]);
            let bytes = dq_offset + align(extra[1]);
            let mut scratch = 0;
            if bytes > 0 {
                // SAFETY: allocation in the current context, kept for the process.
                let result = unsafe { cuMemAlloc_v2(&mut scratch, bytes) };
                if result != CUresult::CUDA_SUCCESS {
                    return Err(format!(
                        "cuMemAlloc of {bytes} bytes of cuDNN scratch: {result:?}"
                    ));
                }
            }
            self.plans.insert(
                key,
                Prepared {
                    plan,
                    scratch,
                    scratch_bytes: bytes,
                    delta_offset,
                    dq_offset,
                },
            );
        }
        Ok(&self.plans[&key])
    }
}

/// Bytes of device memory the cuDNN plans of `device` hold as scratch (outside Burn's pool).
pub fn scratch_bytes(device: &crate::cuda::CudaGpu) -> usize {
    ForeignQueue::new(device).run_blocking(|extensions| {
        match extensions.get_mut::<CudnnResult<CudnnState>>() {
            Some(Ok(state)) => state.plans.values().map(|p| p.scratch_bytes).sum(),
            _ => 0,
        }
    })
}

/// Whether a plan exists for `key` on `device`, building it on first use.
fn ready(queue: &ForeignQueue, device: usize, key: Key) -> bool {
    static KNOWN: Mutex<Option<HashMap<(usize, Key), bool>>> = Mutex::new(None);
    let mut known = KNOWN.lock().expect("the plan registry is not poisoned");
    let known = known.get_or_insert_with(HashMap::new);
    if let Some(&ok) = known.get(&(device, key)) {
        return ok;
    }
    let result = queue.run_blocking(move |extensions| {
        let state = match extensions.get_mut::<CudnnResult<CudnnState>>() {
            Some(state) => state,
            None => extensions.get_or_insert_with(CudnnState::new),
        };
        match state {
            Ok(state) => state.prepare(key).map(|_| ()),
            Err(why) => Err(why.clone()),
        }
    });
    if let Err(why) = &result {
        eprintln!(
            "burn-megatron: cuDNN attention is not used for {key:?}: {why}. The CubeCL flash \
             attention kernels run instead."
        );
    }
    known.insert((device, key), result.is_ok());
    result.is_ok()
}

fn data_type(dtype: DType) -> Option<DataType> {
    match dtype {
        DType::BF16 => Some(DataType::BFloat16),
        DType::F16 => Some(DataType::Half),
        _ => None,
    }
}

/// The layout of a 4D tensor whose rows (last dimension) are contiguous and 16-byte aligned.
fn layout_of(t: &Tensor) -> Option<Layout> {
    let (shape, strides) = (t.meta.shape(), t.meta.strides());
    if shape.len() != 4 || strides[3] != 1 {
        return None;
    }
    let element = t.dtype.size();
    let offset = t.handle.offset_start.unwrap_or(0) as usize;
    let aligned = offset.is_multiple_of(16)
        && strides[..3]
            .iter()
            .all(|s| (s * element).is_multiple_of(16));
    aligned.then(|| Layout {
        dims: [0, 1, 2, 3].map(|i| shape[i] as i64),
        strides: [0, 1, 2, 3].map(|i| strides[i] as i64),
    })
}

/// The sizes of `q` over `k`, if cuDNN can take them.
fn sizes_of(q: &Tensor, k: &Tensor, causal: bool) -> Option<Sizes> {
    let (qs, ks) = (q.meta.shape(), k.meta.shape());
    let dtype = data_type(q.dtype)?;
    let sizes = Sizes {
        dtype,
        batch: qs[0] as i64,
        heads: qs[1] as i64,
        kv_heads: ks[1] as i64,
        seq_q: qs[2] as i64,
        seq_k: ks[2] as i64,
        head_dim: qs[3] as i64,
        causal,
    };
    let d = qs[3];
    let takes = d.is_multiple_of(8)
        && d <= MAX_HEAD_DIM
        && ks[2].is_multiple_of(KEY_MULTIPLE)
        && ks[2] > 0
        && qs[2] > 0
        && qs[0] > 0;
    takes.then_some(sizes)
}

/// A `[batch, heads, seq, head_dim]` tensor stored as `[batch, seq, heads, head_dim]`: what
/// the model's head merge (and split, for gradients) reads without a copy.
fn empty_sequence_major(like: &Tensor, heads: usize) -> Tensor {
    let s = like.meta.shape();
    let stored = empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::from(vec![s[0], s[2], heads, s[3]]),
        like.dtype,
    );
    burn_cubecl::ops::permute(stored, &[0, 2, 1, 3])
}

fn layouts<const N: usize>(tensors: [&Tensor; N]) -> Option<[Layout; N]> {
    let mut out = [Layout::packed([0; 4]); N];
    for (slot, t) in out.iter_mut().zip(tensors) {
        *slot = layout_of(t)?;
    }
    Some(out)
}

/// `(out, lse)` of the attention of `q` over `k`, `v` (shapes as
/// [`crate::fused::flash_attention::forward`]), or `None` when cuDNN cannot take it.
pub fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    causal: bool,
) -> Option<(Tensor, Tensor)> {
    let sizes = sizes_of(q, k, causal)?;
    if k.dtype != q.dtype || v.dtype != q.dtype {
        return None;
    }
    let out = empty_sequence_major(q, sizes.heads as usize);
    let [q_layout, k_layout, v_layout, out_layout] = layouts([q, k, v, &out])?;
    let key = Key::Forward(ForwardKey {
        sizes,
        q: q_layout,
        k: k_layout,
        v: v_layout,
        out: out_layout,
    });
    let queue = ForeignQueue::new(&q.device);
    if !ready(&queue, q.device.index, key) {
        return None;
    }
    let lse = empty_device_contiguous_dtype(
        q.client.clone(),
        q.device.clone(),
        Shape::from(vec![
            sizes.batch as usize,
            sizes.heads as usize,
            sizes.seq_q as usize,
        ]),
        DType::F32,
    );
    let bindings = [q, k, v, &out, &lse].map(binding).to_vec();
    queue.submit(
        "cuDNN flash attention",
        bindings,
        Lane::Compute,
        move |ctx| {
            let p = ctx.pointers.to_vec();
            let device = [Q, K, V, O, STATS].into_iter().zip(p).collect();
            let mut scalars = vec![(SCALE, scale)];
            if causal {
                scalars.push((NEG_INF, f32::NEG_INFINITY));
            }
            run(ctx, key, device, scalars)
        },
    );
    Some((out, lse))
}

/// `[dq, dk, dv]` of [`forward`] (shapes as [`crate::fused::flash_attention::backward`]), or
/// `None` when cuDNN cannot take it.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    grad_out: &Tensor,
    scale: f32,
    causal: bool,
) -> Option<[Tensor; 3]> {
    let sizes = sizes_of(q, k, causal)?;
    let dq = empty_sequence_major(q, sizes.heads as usize);
    let dk = empty_sequence_major(k, sizes.kv_heads as usize);
    let dv = empty_sequence_major(v, sizes.kv_heads as usize);
    let grads = [dq, dk, dv];
    backward_into(q, k, v, out, lse, grad_out, &grads, scale, causal).then_some(grads)
}

/// [`backward`] writing `[dq, dk, dv]` into `grads` (q's, k's and v's shapes and dtype, any
/// 16-byte-aligned strides with contiguous rows: views of one packed gradient buffer, say).
/// Returns `false`, having enqueued nothing, when cuDNN cannot take the call.
#[allow(clippy::too_many_arguments)]
pub fn backward_into(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    grad_out: &Tensor,
    grads: &[Tensor; 3],
    scale: f32,
    causal: bool,
) -> bool {
    let Some(sizes) = sizes_of(q, k, causal) else {
        return false;
    };
    let [dq, dk, dv] = grads;
    let same = [k, v, out, grad_out, dq, dk, dv]
        .iter()
        .all(|t| t.dtype == q.dtype);
    let shapes = [(dq, q), (dk, k), (dv, v)]
        .iter()
        .all(|(g, t)| g.meta.shape() == t.meta.shape());
    let rows = [sizes.heads * sizes.seq_q, sizes.seq_q, 1].map(|s| s as usize);
    let lse_packed = lse.dtype == DType::F32 && lse.meta.strides()[..] == rows[..];
    if !same || !shapes || !lse_packed {
        return false;
    }
    let Some([q_l, k_l, v_l, out_l, grad_l, dq_l, dk_l, dv_l]) =
        layouts([q, k, v, out, grad_out, dq, dk, dv])
    else {
        return false;
    };
    let key = Key::Backward(BackwardKey {
        sizes,
        q: q_l,
        k: k_l,
        v: v_l,
        out: out_l,
        grad_out: grad_l,
        dq: dq_l,
        dk: dk_l,
        dv: dv_l,
    });
    let queue = ForeignQueue::new(&q.device);
    if !ready(&queue, q.device.index, key) {
        return false;
    }
    let bindings = [q, k, v, out, lse, grad_out, dq, dk, dv]
        .map(binding)
        .to_vec();
    queue.submit(
        "cuDNN flash attention backward",
        bindings,
        Lane::Compute,
        move |ctx| {
            let p = ctx.pointers.to_vec();
            let device = [Q, K, V, O, STATS, DO, DQ, DK, DV]
                .into_iter()
                .zip(p)
                .collect();
            let mut scalars = vec![(SCALE, scale), (ONE, 1.0)];
            if causal {
                scalars.push((NEG_INF, f32::NEG_INFINITY));
            }
            run(ctx, key, device, scalars)
        },
    );
    true
}

/// Executes `key`'s plan on the operation's stream: `device` are the tensors' device
/// pointers, `scalars` the values passed by value (cuDNN reads them during the call).
fn run(
    ctx: &mut crate::cuda::foreign::ForeignContext<'_>,
    key: Key,
    device: Vec<(Uid, u64)>,
    scalars: Vec<(Uid, f32)>,
) -> Result<(), String> {
    let stream = ctx.stream;
    let state = ctx
        .extensions
        .get_mut::<CudnnResult<CudnnState>>()
        .ok_or("cuDNN was not initialised on this device")?
        .as_mut()
        .map_err(|e| e.clone())?;
    let handle = state.handle;
    let prepared = state.prepare(key)?;
    let scratch = prepared.scratch;
    let mut values: Vec<f32> = scalars.iter().map(|s| s.1).collect();
    let mut pointers: Vec<(Uid, *mut c_void)> = device
        .into_iter()
        .map(|(uid, ptr)| (uid, ptr as *mut c_void))
        .collect();
    if let Key::Backward(_) = key {
        pointers.push((
            DELTA,
            (scratch + prepared.delta_offset as u64) as *mut c_void,
        ));
        pointers.push((DQ_F32, (scratch + prepared.dq_offset as u64) as *mut c_void));
    }
    for (value, (uid, _)) in values.iter_mut().zip(&scalars) {
        pointers.push((*uid, value as *mut f32 as *mut c_void));
    }
    // SAFETY: the handle is this device's; the stream is the compute stream the tensors'
    // memory is ordered on; the pointers address the tensors the plan's graph declares, and
    // `values` outlives the call.
    unsafe {
        check(sys::cudnnSetStream(handle, stream as _), "cudnnSetStream")?;
        prepared
            .plan
            .execute(handle, &pointers, scratch as *mut c_void)
    }
}
