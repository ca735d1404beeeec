//! Flash attention: `softmax(scale · q kᵀ + mask) v` without materialising the
//! `[batch, heads, seq_q, seq_k]` scores, forward and backward (Dao et al., FlashAttention-2).
//!
//! - Forward: each query row runs an online softmax over the keys (a running maximum `m`, a
//!   running sum `l` and an output accumulator rescaled whenever `m` grows) and writes the
//!   output and the row's log-sum-exp `lse = m + ln l` (natural log, f32). Memory is linear
//!   in the sequence: only `q`, `k`, `v`, the output and `lse` exist.
//! - Backward: `delta = rowsum(dO ∘ O)` first (f32, `[batch, heads, seq_q]`), then the
//!   probabilities are recomputed from `q`, `k` and `lse` (`p = exp(scale · q·k - lse)`), with
//!   `dp = dO·v` and `ds = p · (dp - delta)`: `dq = scale · Σ_keys ds · k` per query row,
//!   `dk = scale · Σ ds · q` and `dv = Σ p · dO` per key row, summed over the queries and the
//!   query heads that read that key. Each gradient row is owned by one thread, so no atomics
//!   are used and the same inputs give the same bits.
//!
//! Grouped-query attention (GQA, MQA) is native: query head `h` reads key/value head
//! `h / (heads / kv_heads)`, and K/V are never copied. Causal attention lets query `i` see
//! keys `0..=i` (`seq_q == seq_k`). Inputs are read by stride, so views from `swap_dims` or
//! `narrow` need no copy, and [`forward_into`] and [`backward_into`] write their outputs by
//! stride into tensors the caller gives (views of one packed buffer: see [`packed`]).
//! Arithmetic is f32 for f32, f16 and bf16 storage.
//!
//! `portable` is the implementation every CubeCL runtime runs (no tensor cores, no plane
//! operations; lavapipe in CI). [`tensor_core`] takes f16/bf16 inputs with head dim 64 or 128
//! on runtimes with warp-level MMA (CUDA); [`forward`] and [`backward`] choose it there.

pub mod packed;
mod portable;
pub mod tensor_core;

use burn::tensor::{DType, Shape};
use burn_cubecl::CubeRuntime;
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros_client};
use burn_cubecl::tensor::CubeTensor;

/// The largest head dimension the kernels take (their per-thread rows are sized by it).
pub const MAX_HEAD_DIM: usize = 256;

/// What the attention computes besides its inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionOptions {
    /// The factor on `q · k` before the softmax (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Whether query `i` sees only keys `0..=i` (needs `seq_q == seq_k`).
    pub causal: bool,
}

/// The sizes of one attention call, checked against each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Dims {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    seq_q: usize,
    seq_k: usize,
    head_dim: usize,
}

impl Dims {
    /// The sizes of `q: [batch, heads, seq_q, head_dim]` and `k, v: [batch, kv_heads, seq_k,
    /// head_dim]`; panics with what is wrong otherwise.
    fn of(q: &Shape, k: &Shape, v: &Shape, options: AttentionOptions) -> Self {
        let [q, k, v] = [q, k, v].map(|s| s.as_slice());
        assert!(
            q.len() == 4 && k.len() == 4 && v.len() == 4,
            "flash attention takes q: [batch, heads, seq_q, head_dim] and k, v: [batch, \
             kv_heads, seq_k, head_dim] (got q {q:?}, k {k:?}, v {v:?})"
        );
        assert_eq!(
            k, v,
            "flash attention: k and v must have one shape (got k {k:?}, v {v:?})"
        );
        assert!(
            q[0] == k[0] && q[3] == k[3],
            "flash attention: q {q:?} and k, v {k:?} must agree in batch and head_dim"
        );
        let dims = Self {
            batch: q[0],
            heads: q[1],
            kv_heads: k[1],
            seq_q: q[2],
            seq_k: k[2],
            head_dim: q[3],
        };
        assert!(
            dims.kv_heads > 0 && dims.heads.is_multiple_of(dims.kv_heads),
            "flash attention: the query heads ({}) must be a multiple of the key/value heads \
             ({})",
            dims.heads,
            dims.kv_heads
        );
        assert!(
            (1..=MAX_HEAD_DIM).contains(&dims.head_dim),
            "flash attention: head_dim must be in 1..={MAX_HEAD_DIM} (got {})",
            dims.head_dim
        );
        if options.causal {
            assert_eq!(
                dims.seq_q, dims.seq_k,
                "causal flash attention needs as many queries as keys (seq_q {}, seq_k {})",
                dims.seq_q, dims.seq_k
            );
        } else {
            assert!(
                dims.seq_k > 0 || dims.seq_q == 0,
                "flash attention needs at least one key (seq_q {}, seq_k 0)",
                dims.seq_q
            );
        }
        dims
    }

    /// Query heads per key/value head.
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

fn check_dtypes<R: CubeRuntime>(what: &str, reference: DType, tensors: &[&CubeTensor<R>]) {
    for t in tensors {
        assert_eq!(
            t.dtype, reference,
            "flash attention {what}: every input must have q's dtype ({reference:?}), got {:?} \
             (cast first)",
            t.dtype
        );
    }
}

/// The attention of `q: [batch, heads, seq_q, head_dim]` over `k, v: [batch, kv_heads, seq_k,
/// head_dim]` (one float dtype, any strides; `heads` a multiple of `kv_heads`, `head_dim` at
/// most [`MAX_HEAD_DIM`]).
///
/// Returns the output `[batch, heads, seq_q, head_dim]` in q's dtype and the log-sum-exp of
/// each query row's scaled, masked scores `[batch, heads, seq_q]` in f32 (what
/// [`backward`] needs).
pub fn forward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    options: AttentionOptions,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let out = empty(&q, q.meta.shape().clone(), q.dtype);
    let lse = forward_into(q, k, v, out.clone(), options);
    (out, lse)
}

/// [`forward`] writing the output into `out` (q's shape and dtype, any strides: a `[batch,
/// seq, heads, head_dim]` buffer seen as `[batch, heads, seq, head_dim]` lets the caller merge
/// heads without a copy). Returns the log-sum-exp `[batch, heads, seq_q]` (f32).
pub fn forward_into<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    options: AttentionOptions,
) -> CubeTensor<R> {
    let dims = Dims::of(q.meta.shape(), k.meta.shape(), v.meta.shape(), options);
    check_dtypes("forward", q.dtype, &[&k, &v, &out]);
    assert_eq!(
        out.meta.shape(),
        q.meta.shape(),
        "flash attention forward: out must have q's shape"
    );
    let lse = empty(
        &q,
        Shape::new([dims.batch, dims.heads, dims.seq_q]),
        DType::F32,
    );
    if dims.batch * dims.heads * dims.seq_q == 0 {
        return lse;
    }
    if tensor_core::supports(&q) {
        tensor_core::forward_into(q, k, v, out, lse.clone(), options.scale, options.causal);
    } else {
        portable::forward(q, k, v, out, lse.clone(), dims, options);
    }
    lse
}

fn empty<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype::<R>(like.client.clone(), like.device.clone(), shape, dtype)
}

/// The gradients `[dq, dk, dv]` of [`forward`]'s output given its gradient `grad_out`
/// (`[batch, heads, seq_q, head_dim]`), from the inputs, the output and its `lse`
/// (`[batch, heads, seq_q]`, f32). `dq` has q's shape, `dk` and `dv` k's (each summed over
/// the query heads that share the key/value head), all in q's dtype. `q`, `k`, `v`, `out` and
/// `grad_out` share one dtype; any strides.
pub fn backward<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    grad_out: CubeTensor<R>,
    options: AttentionOptions,
) -> [CubeTensor<R>; 3] {
    let grads = [&q, &k, &v].map(|t| empty(&q, t.meta.shape().clone(), q.dtype));
    backward_into(q, k, v, out, lse, grad_out, grads.clone(), options);
    grads
}

/// [`backward`] writing `[dq, dk, dv]` into `grads` (q's, k's and v's shapes, q's dtype, any
/// strides: views of one packed gradient buffer, say). Every element of `grads` is written.
#[allow(clippy::too_many_arguments)]
pub fn backward_into<R: CubeRuntime>(
    q: CubeTensor<R>,
    k: CubeTensor<R>,
    v: CubeTensor<R>,
    out: CubeTensor<R>,
    lse: CubeTensor<R>,
    grad_out: CubeTensor<R>,
    grads: [CubeTensor<R>; 3],
    options: AttentionOptions,
) {
    let dims = Dims::of(q.meta.shape(), k.meta.shape(), v.meta.shape(), options);
    check_dtypes("backward", q.dtype, &[&k, &v, &out, &grad_out]);
    check_dtypes(
        "backward output",
        q.dtype,
        &[&grads[0], &grads[1], &grads[2]],
    );
    for (name, t, want) in [
        ("dq", &grads[0], &q),
        ("dk", &grads[1], &k),
        ("dv", &grads[2], &v),
    ] {
        assert_eq!(
            t.meta.shape(),
            want.meta.shape(),
            "flash attention backward: {name} must have the shape of its input"
        );
    }
    assert_eq!(
        lse.dtype,
        DType::F32,
        "flash attention backward: lse must be f32"
    );
    let rows = [dims.batch, dims.heads, dims.seq_q];
    for (name, t, want) in [
        ("out", &out, q.meta.shape().as_slice()),
        ("grad_out", &grad_out, q.meta.shape().as_slice()),
        ("lse", &lse, &rows[..]),
    ] {
        assert_eq!(
            t.meta.shape().as_slice(),
            want,
            "flash attention backward: {name} has the wrong shape (q {:?})",
            q.meta.shape().as_slice()
        );
    }
    if dims.batch * dims.heads * dims.seq_q == 0 || dims.batch * dims.kv_heads * dims.seq_k == 0 {
        // No query sees a key: every gradient is zero (or empty).
        for t in grads {
            fill_zeros(t);
        }
        return;
    }
    if tensor_core::supports(&q) {
        let scale = options.scale;
        tensor_core::backward_into(q, k, v, out, lse, grad_out, grads, scale, options.causal);
    } else {
        portable::backward(q, k, v, out, lse, grad_out, grads, dims, options);
    }
}

/// Writes zeros into every element of `t` (any strides).
fn fill_zeros<R: CubeRuntime>(t: CubeTensor<R>) {
    if t.meta.shape().num_elements() == 0 {
        return;
    }
    let zeros = zeros_client::<R>(
        t.client.clone(),
        t.device.clone(),
        t.meta.shape().clone(),
        t.dtype,
    );
    let (client, dtype) = (t.client.clone(), t.dtype.into());
    cubecl::std::tensor::copy_into(&client, zeros.binding(), t.binding(), dtype);
}
