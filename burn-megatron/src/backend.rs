//! The backend burn-megatron's models are generic over.

use burn::backend::ndarray::{
    FloatNdArrayElement, IntNdArrayElement, NdArrayTensor, QuantElement, SharedArray,
};
use std::sync::Arc;

use burn::backend::{Autodiff, NdArray};
use burn::tensor::{DType, Int, Tensor, TensorData, TensorPrimitive};
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::base::Checkpointer;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_autodiff::ops::{Backward, Ops, OpsKind};
use burn_megatron_dist::{DistBackend, DistResult, ProcessGroup};

use crate::error::{IdKind, InputError};
use crate::ops::GeluForm;
use crate::ops::cross_entropy::{
    VocabSlice, autodiff_cross_entropy, gradient_composition, statistics_composition,
};
use crate::ops::dropout::{DropoutMask, autodiff_dropout, dropout_composition};
use crate::ops::gelu::{add_bias, autodiff_bias_gelu};
use crate::ops::norm::{
    NormForward, NormGradients, NormKind, autodiff_norm,
    backward_composition as norm_backward_composition,
    forward_composition as norm_forward_composition,
};
use crate::ops::swiglu::{
    SwiGluBias, add_swiglu_bias, autodiff_swiglu, swiglu_derivatives, swiglu_forward,
};
use crate::optimizer::fused_adamw::{
    AdamWScalars, FlatAdamWBuffers, FlatAdamWOutput, flat_adamw_composition,
};
use crate::transformer::AttentionCore;

/// Code that runs inside the backward pass where the model marked a tensor
/// ([`ModelBackend::backward_hook`]).
pub trait BackwardHook: Send + Sync + std::fmt::Debug {
    /// Called when the backward pass reaches the tensor marked with `point`, with the
    /// gradients computed so far (the marked tensor's own is not yet passed on).
    fn on_backward(&self, point: usize, grads: &mut Gradients);
}

/// A [`DistBackend`] with the model's own operations: the dense GEMMs of the linear layers
/// (cuBLASLt on our CUDA backend, Burn's matmul elsewhere) and the ones that need their own
/// autodiff (`Autodiff<B>` records backwards that fold transposes into GEMMs, recompute
/// instead of storing, or are exact where Burn's are not: GeLU, SwiGLU).
pub trait ModelBackend: DistBackend {
    /// Bytes of device memory this process's tensors on `device` use now (the memory pool's
    /// live allocations, in queue order: no wait for the device), for the training log;
    /// `None` where the backend does not track it (the CPU).
    fn memory_in_use(_device: &Self::Device) -> Option<u64> {
        None
    }

    /// The id of `tensor`'s autodiff node (for a parameter, its leaf), `None` on a backend
    /// without autodiff. Thread ranks compare them to refuse parameters shared between ranks
    /// (see [`DistributedAdamWConfig::init`](crate::distributed::DistributedAdamWConfig::init)).
    fn autodiff_node(tensor: &Self::FloatTensorPrimitive) -> Option<u64> {
        let _ = tensor;
        None
    }

    /// `op(a) · op(b)`, where `op` transposes when asked; backends with a GEMM library fold
    /// the transposes into it.
    fn gemm(
        a: Tensor<Self, 2>,
        b: Tensor<Self, 2>,
        transpose_a: bool,
        transpose_b: bool,
    ) -> Tensor<Self, 2> {
        let a = if transpose_a { a.transpose() } else { a };
        let b = if transpose_b { b.transpose() } else { b };
        a.matmul(b)
    }

    /// `x · w + bias` for `x: [tokens, d_in]`, `w: [d_in, d_out]`, `bias: [d_out]`.
    fn linear(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        burn::tensor::module::linear(x, w, bias)
    }

    /// `x · w_tᵀ + bias` for a weight stored output-major, `w_t: [d_out, d_in]` (the output
    /// layer's vocabulary table). Unlike [`linear`](Self::linear) of a transposed view,
    /// `Autodiff<B>` records one node whose weight gradient is `w_t`'s own: it is final when
    /// that node's backward runs. Burn runs backward steps by depth, and a transpose of a
    /// parameter has depth 1, so its gradient would come after every layer's, too late to
    /// be reduced while the backward pass goes on.
    fn linear_output_major(
        x: Tensor<Self, 2>,
        w_t: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        let y = Self::gemm(x, w_t, false, true);
        match bias {
            Some(bias) => Self::bias_add(y, bias),
            None => y,
        }
    }

    /// Checks that every id of `ids` is a valid `kind` id for a vocabulary of `vocab_size`
    /// tokens.
    ///
    /// By default the ids are read back to the host (free on the CPU). Our CUDA backend
    /// checks them on the device instead and returns `Ok` at once: an invalid id fails the
    /// device's next read or sync with the same message, so a training step never waits.
    fn check_ids<const D: usize>(
        ids: Tensor<Self, D, Int>,
        kind: IdKind,
        vocab_size: usize,
    ) -> Result<(), InputError> {
        check_ids_on_host(&ids.into_data(), kind, vocab_size)
    }

    /// Per-token losses `[rows]` of this rank's logits slice `[rows, local]` against `targets`
    /// (`[rows]`), reduced over `tp` (see [`crate::ops::cross_entropy`]). `Autodiff<B>`
    /// records one node whose backward is [`cross_entropy_gradient`](Self::cross_entropy_gradient).
    fn cross_entropy(
        logits: Tensor<Self, 2>,
        targets: Tensor<Self, 1, Int>,
        slice: VocabSlice,
        tp: &ProcessGroup,
    ) -> DistResult<Tensor<Self, 1>> {
        Ok(crate::ops::cross_entropy::forward(logits, targets, slice, tp)?.losses)
    }

    /// This rank's `[max, Σ exp(x - max), target logit]` per row of `logits` (`[rows, local]`),
    /// f32 (f64 for f64 logits); padding columns are left out, and a target outside the slice
    /// has logit 0. CubeCL backends run one fused kernel.
    fn cross_entropy_statistics(
        logits: Tensor<Self, 2>,
        targets: Tensor<Self, 1, Int>,
        slice: VocabSlice,
    ) -> [Tensor<Self, 1>; 3] {
        statistics_composition(logits, targets, slice)
    }

    /// `(exp(x - max) / sum_exp - one_hot(target)) · grad_loss` per row of `logits`
    /// (`[rows, local]`), zero in padding columns, in the logits' dtype; `max` and `sum_exp`
    /// are the TP-reduced statistics. CubeCL backends run one fused kernel.
    fn cross_entropy_gradient(
        logits: Tensor<Self, 2>,
        targets: Tensor<Self, 1, Int>,
        max: Tensor<Self, 1>,
        sum_exp: Tensor<Self, 1>,
        grad_loss: Tensor<Self, 1>,
        slice: VocabSlice,
    ) -> Tensor<Self, 2> {
        gradient_composition(logits, targets, max, sum_exp, grad_loss, slice)
    }

    /// `softmax(scale · scores)` over the last dimension of `scores` (`[batch, heads, seq,
    /// seq]`), query `i` seeing keys `0..=i`, in the scores' dtype (f32 statistics).
    /// `Autodiff<B>` stores the probabilities; its backward is
    /// [`causal_softmax_backward`](Self::causal_softmax_backward). CubeCL backends run one
    /// kernel each way (`burn_megatron_kernels::fused::causal_softmax`).
    fn causal_softmax(scores: Tensor<Self, 4>, scale: f64) -> Tensor<Self, 4> {
        crate::ops::causal_softmax::forward_composition(scores, scale)
    }

    /// The gradient of [`causal_softmax`](Self::causal_softmax)'s unscaled scores from the
    /// probabilities `P` and their gradient `dP`: `scale · P ∘ (dP - Σ_row dP ∘ P)`.
    fn causal_softmax_backward(
        probs: Tensor<Self, 4>,
        grad: Tensor<Self, 4>,
        scale: f64,
    ) -> Tensor<Self, 4> {
        crate::ops::causal_softmax::backward_composition(probs, grad, scale)
    }

    /// `softmax(scale · scores)` over the last dimension of `scores` (`[batch, heads, queries,
    /// keys]`) with a padding mask: batch element `b` sees keys `0..key_lengths[b]` (all keys
    /// without lengths), and with `causal` (square scores) query `i` also only keys `0..=i`. A
    /// row that sees no key is zeros. In the scores' dtype, f32 statistics. `Autodiff<B>`
    /// stores the probabilities; its backward is
    /// [`masked_softmax_backward`](Self::masked_softmax_backward). CubeCL backends run one
    /// kernel each way.
    fn masked_softmax(
        scores: Tensor<Self, 4>,
        key_lengths: Option<Tensor<Self, 1, Int>>,
        scale: f64,
        causal: bool,
    ) -> Tensor<Self, 4> {
        crate::ops::causal_softmax::masked_forward_composition(scores, key_lengths, scale, causal)
    }

    /// The gradient of [`masked_softmax`](Self::masked_softmax)'s unscaled scores from the
    /// probabilities `P` and their gradient `dP`: `scale · P ∘ (dP - Σ_row dP ∘ P)` (masked
    /// probabilities are zero; `causal` lets a kernel skip the future).
    fn masked_softmax_backward(
        probs: Tensor<Self, 4>,
        grad: Tensor<Self, 4>,
        scale: f64,
        _causal: bool,
    ) -> Tensor<Self, 4> {
        crate::ops::causal_softmax::backward_composition(probs, grad, scale)
    }

    /// Flash attention (see [`crate::ops::flash_attention`]): `softmax(scale · q kᵀ + mask)
    /// v` for `q: [batch, heads, seq_q, head_dim]` and `k, v: [batch, kv_heads, seq_k,
    /// head_dim]` (`heads` a multiple of `kv_heads`; query `i` sees keys `0..=i` when
    /// `causal`). Returns the output (q's dtype) and each query row's log-sum-exp `[batch,
    /// heads, seq_q]` (f32; f64 for f64 inputs). `Autodiff<B>` records one node storing the
    /// inputs, the output and `lse` (its `lse` is not tracked), whose backward is
    /// [`flash_attention_backward`](Self::flash_attention_backward). CubeCL backends run the
    /// kernels of `burn_megatron_kernels::fused::flash_attention` (head_dim up to 256, not
    /// f64); the default is the Burn composition, which materialises the scores.
    fn flash_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        scale: f64,
        causal: bool,
    ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
        crate::ops::flash_attention::forward_composition(q, k, v, scale, causal)
    }

    /// The gradients `[dq, dk, dv]` of [`flash_attention`](Self::flash_attention)'s output
    /// given its gradient `grad` (`[batch, heads, seq_q, head_dim]`), from the inputs, the
    /// output and `lse`; `dk` and `dv` are summed over the query heads of each key/value head.
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        out: Tensor<Self, 4>,
        lse: Tensor<Self, 3>,
        grad: Tensor<Self, 4>,
        scale: f64,
        causal: bool,
    ) -> [Tensor<Self, 4>; 3] {
        crate::ops::flash_attention::backward_composition(q, k, v, out, lse, grad, scale, causal)
    }

    /// Flash attention on the fused QKV projection's output `qkv: [batch, seq, groups,
    /// heads_per_group + 2, head_dim]` (see [`crate::ops::packed_flash_attention`]): the
    /// output `[batch, seq, heads, head_dim]` (qkv's dtype) and `lse` `[batch, heads, seq]`
    /// (f32; f64 for f64 inputs). `Autodiff<B>` records one node whose parent is `qkv`,
    /// storing `qkv`, the output and `lse` (its `lse` is not tracked), whose backward is
    /// [`packed_flash_attention_backward`](Self::packed_flash_attention_backward). CubeCL
    /// backends read q, k and v as views of `qkv` where one head stride exists (one head per
    /// group, or one group); the default splits `qkv` and calls
    /// [`flash_attention`](Self::flash_attention).
    fn packed_flash_attention(
        qkv: Tensor<Self, 5>,
        scale: f64,
        causal: bool,
    ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
        crate::ops::packed_flash_attention::forward_composition(qkv, scale, causal)
    }

    /// The gradient of [`packed_flash_attention`](Self::packed_flash_attention)'s `qkv`, one
    /// `[batch, seq, groups, heads_per_group + 2, head_dim]` tensor, given the output's
    /// gradient `grad` (`[batch, seq, heads, head_dim]`), from `qkv`, the output and `lse`.
    /// CubeCL backends write dq, dk and dv into views of one buffer where the forward could
    /// read views; the default calls
    /// [`flash_attention_backward`](Self::flash_attention_backward) and assembles the parts
    /// with one `cat`.
    fn packed_flash_attention_backward(
        qkv: Tensor<Self, 5>,
        out: Tensor<Self, 4>,
        lse: Tensor<Self, 3>,
        grad: Tensor<Self, 4>,
        scale: f64,
        causal: bool,
    ) -> Tensor<Self, 5> {
        crate::ops::packed_flash_attention::backward_composition(qkv, out, lse, grad, scale, causal)
    }

    /// The attention core, storing only `q`, `k` and `v` for the backward pass (selective
    /// recomputation): the `[batch, heads, seq, seq]` probabilities are recomputed there.
    fn recomputed_attention_core(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        core: AttentionCore,
    ) -> Tensor<Self, 4> {
        core.forward(q, k, v)
    }

    /// `x` itself. Under `Autodiff`, `hook` runs with `point` when the backward pass reaches
    /// `x`: after every operation that used `x` has put its gradients into the gradient
    /// container. A model marks each layer's input this way, so that a hook there sees that
    /// layer's parameter gradients final (Megatron's gradient hooks, which start a
    /// data-parallel bucket's reduction while the backward pass goes on).
    fn backward_hook<const D: usize>(
        x: Tensor<Self, D>,
        hook: &Arc<dyn BackwardHook>,
        point: usize,
    ) -> Tensor<Self, D> {
        let _ = (hook, point);
        x
    }

    /// `buffer` (`[numel]` f32) with `values` (`[n]`, any float dtype) cast to f32 written at
    /// `start..start + n`: how each gradient enters the flat fp32 gradient buffer. CubeCL
    /// backends write in place, in one kernel, when nothing else holds `buffer`.
    fn write_slot(
        buffer: Tensor<Self, 1>,
        start: usize,
        values: Tensor<Self, 1>,
    ) -> Tensor<Self, 1> {
        write_slot_composition(buffer, start, values)
    }

    /// `x + bias` for `x: [tokens, features]`, `bias: [features]`. `Autodiff<B>` records one
    /// node whose bias gradient is [`bias_gradient`](Self::bias_gradient).
    fn bias_add(x: Tensor<Self, 2>, bias: Tensor<Self, 1>) -> Tensor<Self, 2> {
        x + bias.unsqueeze()
    }

    /// Rotary position embeddings on the packed `qkv: [batch, seq, groups, heads_per_group + 2,
    /// head_dim]` (see [`crate::ops::rope`]): query and key heads rotated, value heads
    /// unchanged, in qkv's dtype with f32 angles. `Autodiff<B>` stores nothing; its backward is
    /// [`packed_rope_backward`](Self::packed_rope_backward). CubeCL backends run one kernel
    /// (`burn_megatron_kernels::fused::rope`).
    fn packed_rope(qkv: Tensor<Self, 5>, base: f64) -> Tensor<Self, 5> {
        crate::ops::rope::packed_rope_composition(qkv, base, false)
    }

    /// The gradient of [`packed_rope`](Self::packed_rope)'s input from its output's gradient:
    /// the rotation by `-angle`.
    fn packed_rope_backward(grad: Tensor<Self, 5>, base: f64) -> Tensor<Self, 5> {
        crate::ops::rope::packed_rope_composition(grad, base, true)
    }

    /// `residual + x ∘ m` (without a residual, `x ∘ m`) for `x` and `residual` of one shape:
    /// dropout with the mask `m` of [`crate::ops::dropout`], drawn from the global coordinates
    /// of each element, and the residual add after it. `Autodiff<B>` stores nothing but the
    /// mask's description; its backward is this op on the output's gradient. CubeCL backends
    /// draw the mask inside one kernel (`burn_megatron_kernels::fused::dropout`), others on
    /// the host.
    fn dropout(
        x: Tensor<Self, 4>,
        residual: Option<Tensor<Self, 4>>,
        mask: DropoutMask,
    ) -> Tensor<Self, 4> {
        dropout_composition(x, residual, mask)
    }

    /// `Σ_tokens dy` of `dy: [tokens, features]`, in `dy`'s dtype: the gradient of a bias added
    /// to every token. CubeCL backends sum in f32, in a fixed order, with no atomics
    /// (`burn_megatron_kernels::fused::column_sum`).
    fn bias_gradient(dy: Tensor<Self, 2>) -> Tensor<Self, 1> {
        dy.sum_dim(0).squeeze_dim::<1>(0)
    }

    /// `gelu(x + bias)` for `x: [tokens, features]`, `bias: [features]` (Megatron's
    /// bias-GeLU). `Autodiff<B>` stores `x` and the bias, and its backward calls
    /// [`bias_gelu_backward`](Self::bias_gelu_backward): the true derivative of this forward.
    fn bias_gelu(
        x: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
        form: GeluForm,
    ) -> Tensor<Self, 2> {
        form.forward(add_bias(x, bias))
    }

    /// The gradient of [`bias_gelu`](Self::bias_gelu)'s `x` given its output's gradient
    /// `grad: [tokens, features]`: `grad · gelu'(x + bias)`. The bias's gradient is its sum
    /// over the tokens.
    fn bias_gelu_backward(
        x: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
        grad: Tensor<Self, 2>,
        form: GeluForm,
    ) -> Tensor<Self, 2> {
        grad * form.derivative(add_bias(x, bias))
    }

    /// [`bias_gelu_backward`](Self::bias_gelu_backward) and the bias's gradient, its sum over
    /// the tokens, in `x`'s dtype. CubeCL backends take the bias gradient's first stage inside
    /// the backward kernel (the bits of [`bias_gradient`](Self::bias_gradient) of `dx`,
    /// without reading `dx` again); the default is the two calls.
    fn bias_gelu_backward_and_bias_gradient(
        x: Tensor<Self, 2>,
        bias: Tensor<Self, 1>,
        grad: Tensor<Self, 2>,
        form: GeluForm,
    ) -> (Tensor<Self, 2>, Tensor<Self, 1>) {
        let dx = Self::bias_gelu_backward(x, Some(bias), grad, form);
        let db = Self::bias_gradient(dx.clone());
        (dx, db)
    }

    /// `silu(gate + b_g) · (up + b_u)` for `gate, up: [tokens, features]` and optional biases
    /// `[b_g, b_u]` of `[features]` (SwiGLU's elementwise part, Megatron's bias-SwiGLU).
    /// `Autodiff<B>` stores `gate`, `up` and the biases, and its backward calls
    /// [`swiglu_backward`](Self::swiglu_backward).
    fn swiglu(
        gate: Tensor<Self, 2>,
        up: Tensor<Self, 2>,
        bias: Option<SwiGluBias<Self>>,
    ) -> Tensor<Self, 2> {
        let (gate, up) = add_swiglu_bias(gate, up, bias);
        swiglu_forward(gate, up)
    }

    /// The gradients `[d_gate, d_up]` of [`swiglu`](Self::swiglu) given its output's gradient
    /// `grad: [tokens, features]`. The biases' gradients are their sums over the tokens.
    fn swiglu_backward(
        gate: Tensor<Self, 2>,
        up: Tensor<Self, 2>,
        bias: Option<SwiGluBias<Self>>,
        grad: Tensor<Self, 2>,
    ) -> [Tensor<Self, 2>; 2] {
        let (gate, up) = add_swiglu_bias(gate, up, bias);
        swiglu_derivatives(gate, up, grad)
    }

    /// [`swiglu_backward`](Self::swiglu_backward) and both biases' gradients, their sums over
    /// the tokens, in `gate`'s dtype: `([d_gate, d_up], [d_b_g, d_b_u])`. CubeCL backends take
    /// the bias gradients' first stage inside the backward kernel (the bits of
    /// [`bias_gradient`](Self::bias_gradient) of each derivative, without reading them again);
    /// the default is the three calls.
    fn swiglu_backward_and_bias_gradients(
        gate: Tensor<Self, 2>,
        up: Tensor<Self, 2>,
        bias: SwiGluBias<Self>,
        grad: Tensor<Self, 2>,
    ) -> ([Tensor<Self, 2>; 2], [Tensor<Self, 1>; 2]) {
        let derivatives = Self::swiglu_backward(gate, up, Some(bias), grad);
        let bias_gradients = derivatives.clone().map(Self::bias_gradient);
        (derivatives, bias_gradients)
    }

    /// `norm(x) · scale (+ shift)` for `x: [rows, hidden]`, `scale, shift: [hidden]`
    /// (LayerNorm or RMSNorm, see [`crate::ops::norm()`]), in `x`'s dtype. `Autodiff<B>` records
    /// one node that stores `x`, the scale and the statistics of
    /// [`norm_forward`](Self::norm_forward), and calls [`norm_backward`](Self::norm_backward).
    fn norm(
        x: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        shift: Option<Tensor<Self, 1>>,
        kind: NormKind,
        epsilon: f64,
    ) -> Tensor<Self, 2> {
        Self::norm_forward(x, scale, shift, kind, epsilon).output
    }

    /// [`norm`](Self::norm)'s output and each row's `mean` and `rstd` (`[rows]`, f32; f64 for
    /// f64 inputs). CubeCL backends run one kernel (`burn_megatron_kernels::fused::norm`).
    fn norm_forward(
        x: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        shift: Option<Tensor<Self, 1>>,
        kind: NormKind,
        epsilon: f64,
    ) -> NormForward<Self> {
        norm_forward_composition(x, scale, shift, kind, epsilon)
    }

    /// The gradients of [`norm`](Self::norm)'s `x`, scale and (with `with_shift`) shift given
    /// its output's gradient `grad: [rows, hidden]` and the forward's statistics. CubeCL
    /// backends run one kernel for `dx` and a two-stage column reduction for the scale and
    /// shift (deterministic: no atomics).
    fn norm_backward(
        x: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        mean: Tensor<Self, 1>,
        rstd: Tensor<Self, 1>,
        grad: Tensor<Self, 2>,
        kind: NormKind,
        with_shift: bool,
    ) -> NormGradients<Self> {
        norm_backward_composition(x, scale, mean, rstd, grad, kind, with_shift)
    }

    /// Rows of `weight` (`[vocab, hidden]`) for `ids` (`[batch, seq]`), Burn's gather.
    /// `Autodiff<B>` records one node holding the ids, whose backward is
    /// [`embedding_gradient`](Self::embedding_gradient).
    fn embedding_lookup(weight: Tensor<Self, 2>, ids: Tensor<Self, 2, Int>) -> Tensor<Self, 3> {
        burn::tensor::module::embedding(weight, ids)
    }

    /// [`embedding_lookup`](Self::embedding_lookup) where an id of `vocab` (the table's row
    /// count) or more gives a zero row and adds nothing to the table's gradient: the tokens
    /// that another tensor-parallel rank's slice of the vocabulary holds. Pointing those at a
    /// row of this slice and masking the row would give the same values, but the gradient
    /// kernel would then sum every such token into that one row, one after the other.
    fn embedding_lookup_or_zero(
        weight: Tensor<Self, 2>,
        ids: Tensor<Self, 2, Int>,
    ) -> Tensor<Self, 3> {
        let vocab = weight.dims()[0] as i64;
        let in_range = ids.clone().lower_elem(vocab);
        let rows = burn::tensor::module::embedding(weight, ids.clamp_max(vocab - 1));
        let dtype = rows.dtype();
        rows * in_range.float().cast(dtype).unsqueeze_dim::<3>(2)
    }

    /// The gradient `[vocab, hidden]` of an embedding table from its output's gradient
    /// `grad` (`[tokens, hidden]`) and the ids (`[tokens]`), in `grad`'s dtype: row `v` sums
    /// the rows of `grad` whose id is `v`; ids of `vocab` or more add nothing (see
    /// [`embedding_lookup_or_zero`](Self::embedding_lookup_or_zero)). CubeCL backends run one
    /// deterministic kernel (`burn_megatron_kernels::fused::embedding`); the default is Burn's
    /// `select_add`.
    fn embedding_gradient(
        grad: Tensor<Self, 2>,
        ids: Tensor<Self, 1, Int>,
        vocab: usize,
    ) -> Tensor<Self, 2> {
        crate::ops::embedding::backward_composition(grad, ids, vocab)
    }

    /// One AdamW step over flat fp32 buffers (see [`crate::optimizer::fused_adamw`]): the
    /// updated master weights and moments, and with `model_dtype` the master weights cast to
    /// it. The step is skipped on the device when `found_inf` is set. CubeCL backends run one
    /// kernel (`burn_megatron_kernels::fused::adamw`) for all of it.
    fn flat_adamw(
        buffers: FlatAdamWBuffers<Self>,
        scalars: &AdamWScalars,
        model_dtype: Option<DType>,
    ) -> FlatAdamWOutput<Self> {
        flat_adamw_composition(buffers, scalars, model_dtype)
    }
}

impl<E: FloatNdArrayElement, I: IntNdArrayElement, Q: QuantElement> ModelBackend
    for NdArray<E, I, Q>
where
    NdArrayTensor: From<SharedArray<E>>,
    NdArrayTensor: From<SharedArray<I>>,
{
}

/// [`ModelBackend::check_ids`] on ids read back to the host: the first invalid id, in
/// row-major order, is the error.
pub fn check_ids_on_host(
    ids: &TensorData,
    kind: IdKind,
    vocab_size: usize,
) -> Result<(), InputError> {
    let ids = ids
        .clone()
        .convert::<i64>()
        .to_vec::<i64>()
        .expect("converted ids hold i64");
    match ids.into_iter().find(|&id| !kind.accepts(id, vocab_size)) {
        Some(id) => Err(InputError::IdOutOfRange {
            kind,
            id,
            vocab_size,
        }),
        None => Ok(()),
    }
}

/// CubeCL backends: the fused kernels of `burn_megatron_kernels::fused`.
#[cfg(feature = "fused")]
mod cube {
    use burn::tensor::{DType, Int, Shape, Tensor, TensorPrimitive};
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
    use burn_megatron_kernels::fused::adamw as adamw_kernels;
    use burn_megatron_kernels::fused::bias_gelu as gelu_kernels;
    use burn_megatron_kernels::fused::causal_softmax as softmax_kernels;
    use burn_megatron_kernels::fused::cross_entropy as kernels;
    use burn_megatron_kernels::fused::dropout as dropout_kernels;
    use burn_megatron_kernels::fused::embedding as embedding_kernels;
    use burn_megatron_kernels::fused::flash_attention as flash_kernels;
    pub(super) use burn_megatron_kernels::fused::flash_attention::packed::{self, ViewOffsets};
    use burn_megatron_kernels::fused::norm as norm_kernels;
    use burn_megatron_kernels::fused::rope as rope_kernels;

    use crate::ops::GeluForm;
    use crate::ops::cross_entropy::{VocabSlice, gradient_composition, statistics_composition};
    use crate::ops::gelu::add_bias;
    use crate::ops::norm::{
        NormForward, NormGradients, NormKind, backward_composition as norm_backward_composition,
        forward_composition as norm_forward_composition,
    };
    use crate::ops::swiglu::{SwiGluBias, add_swiglu_bias, swiglu_derivatives, swiglu_forward};
    use crate::optimizer::fused_adamw::{AdamWScalars, FlatAdamWBuffers, FlatAdamWOutput};

    type Cube<R, F, I, BT> = CubeBackend<R, F, I, BT>;
    /// An input's gradient and its bias's.
    type WithBiasGradient<B> = (Tensor<B, 2>, Tensor<B, 1>);
    /// Flash attention's output and log-sum-exp.
    type AttentionOutput<B> = (Tensor<B, 4>, Tensor<B, 3>);

    fn kernel_slice(slice: VocabSlice) -> kernels::VocabSlice {
        kernels::VocabSlice {
            start: slice.start,
            real: slice.real,
        }
    }

    fn float<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement, const D: usize>(
        tensor: burn_cubecl::tensor::CubeTensor<R>,
    ) -> Tensor<Cube<R, F, I, BT>, D> {
        Tensor::from_primitive(TensorPrimitive::Float(tensor))
    }

    /// `ModelBackend::cross_entropy_statistics` in one kernel (f64 logits: the composition).
    pub(super) fn cross_entropy_statistics<R, F, I, BT>(
        logits: Tensor<Cube<R, F, I, BT>, 2>,
        targets: Tensor<Cube<R, F, I, BT>, 1, Int>,
        slice: VocabSlice,
    ) -> [Tensor<Cube<R, F, I, BT>, 1>; 3]
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        if logits.dtype() == DType::F64 {
            return statistics_composition(logits, targets, slice);
        }
        let stats = kernels::row_statistics(
            logits.into_primitive().tensor(),
            targets.into_primitive(),
            kernel_slice(slice),
        );
        [stats.max, stats.sum_exp, stats.target_logit].map(float)
    }

    /// `ModelBackend::cross_entropy_gradient` in one kernel (f64 logits: the composition).
    pub(super) fn cross_entropy_gradient<R, F, I, BT>(
        logits: Tensor<Cube<R, F, I, BT>, 2>,
        targets: Tensor<Cube<R, F, I, BT>, 1, Int>,
        max: Tensor<Cube<R, F, I, BT>, 1>,
        sum_exp: Tensor<Cube<R, F, I, BT>, 1>,
        grad_loss: Tensor<Cube<R, F, I, BT>, 1>,
        slice: VocabSlice,
    ) -> Tensor<Cube<R, F, I, BT>, 2>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        if logits.dtype() == DType::F64 {
            return gradient_composition(logits, targets, max, sum_exp, grad_loss, slice);
        }
        let [max, sum_exp, grad_loss] =
            [max, sum_exp, grad_loss].map(|t| t.cast(DType::F32).into_primitive().tensor());
        float(kernels::gradient(
            logits.into_primitive().tensor(),
            targets.into_primitive(),
            max,
            sum_exp,
            grad_loss,
            kernel_slice(slice),
        ))
    }

    /// `ModelBackend::causal_softmax` in one kernel (f64: the composition).
    pub(super) fn causal_softmax<R, F, I, BT>(
        scores: Tensor<Cube<R, F, I, BT>, 4>,
        scale: f64,
    ) -> Tensor<Cube<R, F, I, BT>, 4>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        if scores.dtype() == DType::F64 {
            return crate::ops::causal_softmax::forward_composition(scores, scale);
        }
        float(softmax_kernels::forward(
            scores.into_primitive().tensor(),
            scale,
        ))
    }

    /// `ModelBackend::dropout` in one kernel, the mask drawn in it (f64: the composition).
    pub(super) fn dropout<R, F, I, BT>(
        x: Tensor<Cube<R, F, I, BT>, 4>,
        residual: Option<Tensor<Cube<R, F, I, BT>, 4>>,
        mask: crate::ops::DropoutMask,
    ) -> Tensor<Cube<R, F, I, BT>, 4>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        if x.dtype() == DType::F64 {
            return crate::ops::dropout::dropout_composition(x, residual, mask);
        }
        let dims = x.dims();
        let [d0, d1, d2, d3] = dims;
        let flat = |t: Tensor<Cube<R, F, I, BT>, 4>| t.reshape([d0 * d1 * d2, d3]);
        let residual = residual.map(|r| flat(r.cast(x.dtype())).into_primitive().tensor());
        let placement = dropout_kernels::MaskPlacement {
            prob: mask.prob,
            seed: mask.seed,
            inner: [d1, d2],
            offset: mask.offset,
        };
        float::<R, F, I, BT, 2>(dropout_kernels::forward(
            flat(x).into_primitive().tensor(),
            residual,
            placement,
        ))
        .reshape(dims)
    }

    /// `ModelBackend::packed_rope` (with `inverse`, its backward) in one kernel (f64: the
    /// composition).
    pub(super) fn packed_rope<R, F, I, BT>(
        qkv: Tensor<Cube<R, F, I, BT>, 5>,
        base: f64,
        inverse: bool,
    ) -> Tensor<Cube<R, F, I, BT>, 5>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        if qkv.dtype() == DType::F64 {
            return crate::ops::rope::packed_rope_composition(qkv, base, inverse);
        }
        let dims = qkv.dims();
        let [batch, seq, groups, slots, head_dim] = dims;
        crate::ops::rope::check_shape(dims);
        let table = rope_table::<R, F, I, BT>(&qkv.device(), seq, head_dim, base);
        let layout = rope_kernels::PackedRows { seq, groups, slots };
        float::<R, F, I, BT, 2>(rope_kernels::rotate(
            qkv.reshape([batch * seq * groups * slots, head_dim])
                .into_primitive()
                .tensor(),
            table,
            layout,
            inverse,
        ))
        .reshape(dims)
    }

    /// The RoPE table `[cos, sin]` (`[seq, head_dim / 2]` f32 each) on `device`, computed
    /// and uploaded once per runtime, device, shape and base, then kept for the process.
    fn rope_table<R, F, I, BT>(
        device: &R::Device,
        seq: usize,
        head_dim: usize,
        base: f64,
    ) -> [burn_cubecl::tensor::CubeTensor<R>; 2]
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        use std::any::{Any, TypeId};
        use std::collections::HashMap;
        use std::sync::{Mutex, OnceLock};
        type Key = (TypeId, burn::tensor::backend::DeviceId, usize, usize, u64);
        static TABLES: OnceLock<Mutex<HashMap<Key, Box<dyn Any + Send + Sync>>>> = OnceLock::new();
        let key = (
            TypeId::of::<R>(),
            burn::tensor::backend::DeviceOps::id(device),
            seq,
            head_dim,
            base.to_bits(),
        );
        let mut tables = TABLES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let table = tables.entry(key).or_insert_with(|| {
            let table = crate::ops::rope::rotation_table(seq, head_dim, base).map(|values| {
                Tensor::<Cube<R, F, I, BT>, 2>::from_data(
                    burn::tensor::TensorData::new(values, [seq, head_dim / 2]),
                    (device, DType::F32),
                )
                .into_primitive()
                .tensor()
            });
            Box::new(table)
        });
        table
            .downcast_ref::<[burn_cubecl::tensor::CubeTensor<R>; 2]>()
            .expect("a RoPE table of this runtime")
            .clone()
    }

    /// `ModelBackend::masked_softmax` in one kernel (f64: the composition).
    pub(super) fn masked_softmax<R, F, I, BT>(
        scores: Tensor<Cube<R, F, I, BT>, 4>,
        key_lengths: Option<Tensor<Cube<R, F, I, BT>, 1, Int>>,
        scale: f64,
        causal: bool,
    ) -> Tensor<Cube<R, F, I, BT>, 4>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        if scores.dtype() == DType::F64 {
            return crate::ops::causal_softmax::masked_forward_composition(
                scores,
                key_lengths,
                scale,
                causal,
            );
        }
        float(softmax_kernels::masked_forward(
            scores.into_primitive().tensor(),
            key_lengths.map(|l| l.into_primitive()),
            scale,
            causal,
        ))
    }

    /// `ModelBackend::masked_softmax_backward` (and `causal_softmax_backward`, with `causal`) in
    /// one kernel (f64: the composition).
    pub(super) fn masked_softmax_backward<R, F, I, BT>(
        probs: Tensor<Cube<R, F, I, BT>, 4>,
        grad: Tensor<Cube<R, F, I, BT>, 4>,
        scale: f64,
        causal: bool,
    ) -> Tensor<Cube<R, F, I, BT>, 4>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        if probs.dtype() == DType::F64 {
            return crate::ops::causal_softmax::backward_composition(probs, grad, scale);
        }
        let grad = grad.cast(probs.dtype());
        float(softmax_kernels::masked_backward(
            probs.into_primitive().tensor(),
            grad.into_primitive().tensor(),
            scale,
            causal,
        ))
    }

    /// Whether the flash-attention kernels take these inputs (else: the composition).
    fn flash_kernels_take(dtype: DType, head_dim: usize) -> bool {
        dtype != DType::F64 && (1..=flash_kernels::MAX_HEAD_DIM).contains(&head_dim)
    }

    /// `ModelBackend::flash_attention` in one kernel (f64 or head_dim above 256: the
    /// composition).
    pub(super) fn flash_attention<R, F, I, BT>(
        q: Tensor<Cube<R, F, I, BT>, 4>,
        k: Tensor<Cube<R, F, I, BT>, 4>,
        v: Tensor<Cube<R, F, I, BT>, 4>,
        scale: f64,
        causal: bool,
    ) -> AttentionOutput<Cube<R, F, I, BT>>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        let dtype = q.dtype();
        if !flash_kernels_take(dtype, q.dims()[3]) {
            return crate::ops::flash_attention::forward_composition(q, k, v, scale, causal);
        }
        let raw = |t: Tensor<Cube<R, F, I, BT>, 4>| t.cast(dtype).into_primitive().tensor();
        let (out, lse) = flash_kernels::forward(
            raw(q),
            raw(k),
            raw(v),
            flash_kernels::AttentionOptions {
                scale: scale as f32,
                causal,
            },
        );
        (float(out), float(lse))
    }

    /// `ModelBackend::flash_attention_backward`: one kernel for `delta`, one for `dq`, one
    /// for `dk` and `dv` (f64 or head_dim above 256: the composition).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn flash_attention_backward<R, F, I, BT>(
        q: Tensor<Cube<R, F, I, BT>, 4>,
        k: Tensor<Cube<R, F, I, BT>, 4>,
        v: Tensor<Cube<R, F, I, BT>, 4>,
        out: Tensor<Cube<R, F, I, BT>, 4>,
        lse: Tensor<Cube<R, F, I, BT>, 3>,
        grad: Tensor<Cube<R, F, I, BT>, 4>,
        scale: f64,
        causal: bool,
    ) -> [Tensor<Cube<R, F, I, BT>, 4>; 3]
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        let dtype = q.dtype();
        if !flash_kernels_take(dtype, q.dims()[3]) {
            return crate::ops::flash_attention::backward_composition(
                q, k, v, out, lse, grad, scale, causal,
            );
        }
        let raw = |t: Tensor<Cube<R, F, I, BT>, 4>| t.cast(dtype).into_primitive().tensor();
        flash_kernels::backward(
            raw(q),
            raw(k),
            raw(v),
            raw(out),
            lse.cast(DType::F32).into_primitive().tensor(),
            raw(grad),
            flash_kernels::AttentionOptions {
                scale: scale as f32,
                causal,
            },
        )
        .map(float)
    }

    /// `ModelBackend::packed_flash_attention` by the kernels, reading q, k and v as views of
    /// `qkv` and writing the output into a `[batch, seq, heads, head_dim]` buffer; `None`
    /// (nothing done) where the views cannot be made (no single head stride for q, offsets
    /// that `offsets` forbids) or the kernels do not take the call (f64, head_dim above 256):
    /// the caller then runs the composition.
    pub(super) fn packed_flash_attention<R, F, I, BT>(
        qkv: &Tensor<Cube<R, F, I, BT>, 5>,
        scale: f64,
        causal: bool,
        offsets: ViewOffsets,
    ) -> Option<AttentionOutput<Cube<R, F, I, BT>>>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        let [batch, seq, groups, slots, head_dim] = qkv.dims();
        let heads = groups * (slots - 2);
        let raw = qkv.clone().into_primitive().tensor();
        if !flash_kernels_take(qkv.dtype(), head_dim) {
            return None;
        }
        let [q, k, v] = packed::views(&raw, offsets)?;
        let out = empty_device_contiguous_dtype::<R>(
            raw.client.clone(),
            raw.device.clone(),
            Shape::new([batch, seq, heads, head_dim]),
            raw.dtype,
        );
        let lse = flash_kernels::forward_into(
            q,
            k,
            v,
            burn_cubecl::ops::permute(out.clone(), &[0, 2, 1, 3]),
            flash_kernels::AttentionOptions {
                scale: scale as f32,
                causal,
            },
        );
        Some((float(out), float(lse)))
    }

    /// `ModelBackend::packed_flash_attention_backward` by the kernels: one `dqkv` buffer, the
    /// kernels reading views of `qkv` and writing views of `dqkv`; `None` (nothing done)
    /// where [`packed_flash_attention`] would be.
    pub(super) fn packed_flash_attention_backward<R, F, I, BT>(
        qkv: &Tensor<Cube<R, F, I, BT>, 5>,
        out: &Tensor<Cube<R, F, I, BT>, 4>,
        lse: &Tensor<Cube<R, F, I, BT>, 3>,
        grad: &Tensor<Cube<R, F, I, BT>, 4>,
        scale: f64,
        causal: bool,
        offsets: ViewOffsets,
    ) -> Option<Tensor<Cube<R, F, I, BT>, 5>>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        let dtype = qkv.dtype();
        if !flash_kernels_take(dtype, qkv.dims()[4]) {
            return None;
        }
        let raw = qkv.clone().into_primitive().tensor();
        let dqkv = empty_device_contiguous_dtype::<R>(
            raw.client.clone(),
            raw.device.clone(),
            raw.meta.shape().clone(),
            dtype,
        );
        let [q, k, v] = packed::views(&raw, offsets)?;
        let grads = packed::views(&dqkv, offsets)?;
        let heads_major = |t: &Tensor<Cube<R, F, I, BT>, 4>| {
            t.clone()
                .cast(dtype)
                .swap_dims(1, 2)
                .into_primitive()
                .tensor()
        };
        flash_kernels::backward_into(
            q,
            k,
            v,
            heads_major(out),
            lse.clone().cast(DType::F32).into_primitive().tensor(),
            heads_major(grad),
            grads,
            flash_kernels::AttentionOptions {
                scale: scale as f32,
                causal,
            },
        );
        Some(float(dqkv))
    }

    /// `ModelBackend::embedding_gradient` in one kernel (f64: the composition).
    pub(super) fn embedding_gradient<R, F, I, BT>(
        grad: Tensor<Cube<R, F, I, BT>, 2>,
        ids: Tensor<Cube<R, F, I, BT>, 1, Int>,
        vocab: usize,
    ) -> Tensor<Cube<R, F, I, BT>, 2>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        if grad.dtype() == DType::F64 {
            return crate::ops::embedding::backward_composition(grad, ids, vocab);
        }
        float(embedding_kernels::embedding_backward(
            grad.into_primitive().tensor(),
            ids.into_primitive(),
            vocab,
            embedding_kernels::BUCKETS,
        ))
    }

    /// `ModelBackend::flat_adamw` in one kernel.
    pub(super) fn flat_adamw<R, F, I, BT>(
        buffers: FlatAdamWBuffers<Cube<R, F, I, BT>>,
        scalars: &AdamWScalars,
        model_dtype: Option<DType>,
    ) -> FlatAdamWOutput<Cube<R, F, I, BT>>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        let raw = |t: Tensor<Cube<R, F, I, BT>, 1>| t.into_primitive().tensor();
        let out = adamw_kernels::adamw_step(
            adamw_kernels::AdamWBuffers {
                master: raw(buffers.master),
                grad: raw(buffers.grad),
                exp_avg: raw(buffers.exp_avg),
                exp_avg_sq: raw(buffers.exp_avg_sq),
                decay: raw(buffers.decay),
                step: raw(buffers.step),
                grad_factor: raw(buffers.grad_factor),
                found_inf: raw(buffers.found_inf),
            },
            adamw_kernels::AdamWScalars {
                lr: scalars.lr,
                beta_1: scalars.beta_1,
                beta_2: scalars.beta_2,
                ln_beta_1: scalars.ln_beta_1,
                ln_beta_2: scalars.ln_beta_2,
                epsilon: scalars.epsilon,
                decay_factor: scalars.decay_factor,
                block: scalars.block as u32,
            },
            model_dtype,
        );
        FlatAdamWOutput {
            master: float(out.master),
            exp_avg: float(out.exp_avg),
            exp_avg_sq: float(out.exp_avg_sq),
            model: out.model.map(float),
        }
    }

    fn kernel_form(form: GeluForm) -> gelu_kernels::Form {
        match form {
            GeluForm::Erf => gelu_kernels::Form::Erf,
            GeluForm::Tanh => gelu_kernels::Form::Tanh,
        }
    }

    /// `ModelBackend::bias_gelu` in one kernel (f64: the composition).
    pub(super) fn bias_gelu<R, F, I, BT>(
        x: Tensor<Cube<R, F, I, BT>, 2>,
        bias: Option<Tensor<Cube<R, F, I, BT>, 1>>,
        form: GeluForm,
    ) -> Tensor<Cube<R, F, I, BT>, 2>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        if x.dtype() == DType::F64 {
            return form.forward(add_bias(x, bias));
        }
        let dtype = x.dtype();
        let bias = bias.map(|b| b.cast(dtype).into_primitive().tensor());
        float(gelu_kernels::forward(
            x.into_primitive().tensor(),
            bias,
            kernel_form(form),
        ))
    }

    /// `ModelBackend::bias_gelu_backward` in one kernel (f64: the composition).
    pub(super) fn bias_gelu_backward<R, F, I, BT>(
        x: Tensor<Cube<R, F, I, BT>, 2>,
        bias: Option<Tensor<Cube<R, F, I, BT>, 1>>,
        grad: Tensor<Cube<R, F, I, BT>, 2>,
        form: GeluForm,
    ) -> Tensor<Cube<R, F, I, BT>, 2>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        if x.dtype() == DType::F64 {
            return grad * form.derivative(add_bias(x, bias));
        }
        let dtype = x.dtype();
        let bias = bias.map(|b| b.cast(dtype).into_primitive().tensor());
        let grad = grad.cast(dtype).into_primitive().tensor();
        float(gelu_kernels::backward(
            x.into_primitive().tensor(),
            bias,
            grad,
            kernel_form(form),
        ))
    }

    /// `ModelBackend::bias_gelu_backward_and_bias_gradient`: one kernel and the column sums'
    /// second stage (f64: the composition).
    pub(super) fn bias_gelu_backward_and_bias_gradient<R, F, I, BT>(
        x: Tensor<Cube<R, F, I, BT>, 2>,
        bias: Tensor<Cube<R, F, I, BT>, 1>,
        grad: Tensor<Cube<R, F, I, BT>, 2>,
        form: GeluForm,
    ) -> WithBiasGradient<Cube<R, F, I, BT>>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        if x.dtype() == DType::F64 {
            let dx = bias_gelu_backward(x, Some(bias), grad, form);
            return (dx.clone(), bias_gradient(dx));
        }
        let dtype = x.dtype();
        let (dx, db) = gelu_kernels::backward_and_bias_gradient(
            x.into_primitive().tensor(),
            bias.cast(dtype).into_primitive().tensor(),
            grad.cast(dtype).into_primitive().tensor(),
            kernel_form(form),
        );
        (float(dx), float(db))
    }

    /// `ModelBackend::write_slot` in one kernel, in place (the composition when `buffer` is
    /// shared, not contiguous f32, or `values` are f64).
    pub(super) fn write_slot<R, F, I, BT>(
        buffer: Tensor<Cube<R, F, I, BT>, 1>,
        start: usize,
        values: Tensor<Cube<R, F, I, BT>, 1>,
    ) -> Tensor<Cube<R, F, I, BT>, 1>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        let raw = buffer.into_primitive().tensor();
        let values_dtype = values.dtype();
        let direct = raw.dtype == DType::F32
            && raw.is_contiguous()
            && raw.can_mut()
            && matches!(values_dtype, DType::F32 | DType::F16 | DType::BF16);
        if !direct {
            return crate::backend::write_slot_composition(float(raw), start, values);
        }
        burn_megatron_kernels::fused::flat_copy::copy_into(
            values.into_primitive().tensor(),
            &raw,
            start,
        );
        float(raw)
    }

    /// `ModelBackend::swiglu` in one kernel (f64: the composition).
    pub(super) fn swiglu<R, F, I, BT>(
        gate: Tensor<Cube<R, F, I, BT>, 2>,
        up: Tensor<Cube<R, F, I, BT>, 2>,
        bias: Option<SwiGluBias<Cube<R, F, I, BT>>>,
    ) -> Tensor<Cube<R, F, I, BT>, 2>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        let dtype = gate.dtype();
        if dtype == DType::F64 {
            let (gate, up) = add_swiglu_bias(gate, up, bias);
            return swiglu_forward(gate, up);
        }
        float(burn_megatron_kernels::fused::swiglu::forward(
            gate.into_primitive().tensor(),
            up.cast(dtype).into_primitive().tensor(),
            swiglu_kernel_bias(bias, dtype),
        ))
    }

    /// The biases as the SwiGLU kernels take them, in the activations' dtype.
    fn swiglu_kernel_bias<R, F, I, BT>(
        bias: Option<SwiGluBias<Cube<R, F, I, BT>>>,
        dtype: DType,
    ) -> Option<burn_megatron_kernels::fused::swiglu::Biases<R>>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        bias.map(|[gate, up]| burn_megatron_kernels::fused::swiglu::Biases {
            gate: gate.cast(dtype).into_primitive().tensor(),
            up: up.cast(dtype).into_primitive().tensor(),
        })
    }

    /// `ModelBackend::swiglu_backward` in one kernel (f64: the composition).
    pub(super) fn swiglu_backward<R, F, I, BT>(
        gate: Tensor<Cube<R, F, I, BT>, 2>,
        up: Tensor<Cube<R, F, I, BT>, 2>,
        bias: Option<SwiGluBias<Cube<R, F, I, BT>>>,
        grad: Tensor<Cube<R, F, I, BT>, 2>,
    ) -> [Tensor<Cube<R, F, I, BT>, 2>; 2]
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        let dtype = gate.dtype();
        if dtype == DType::F64 {
            let (gate, up) = add_swiglu_bias(gate, up, bias);
            return swiglu_derivatives(gate, up, grad);
        }
        burn_megatron_kernels::fused::swiglu::backward(
            gate.into_primitive().tensor(),
            up.cast(dtype).into_primitive().tensor(),
            swiglu_kernel_bias(bias, dtype),
            grad.cast(dtype).into_primitive().tensor(),
        )
        .map(float)
    }

    /// `ModelBackend::swiglu_backward_and_bias_gradients`: one kernel and the column sums'
    /// second stage (f64: the composition).
    #[allow(clippy::type_complexity)]
    pub(super) fn swiglu_backward_and_bias_gradients<R, F, I, BT>(
        gate: Tensor<Cube<R, F, I, BT>, 2>,
        up: Tensor<Cube<R, F, I, BT>, 2>,
        bias: SwiGluBias<Cube<R, F, I, BT>>,
        grad: Tensor<Cube<R, F, I, BT>, 2>,
    ) -> (
        [Tensor<Cube<R, F, I, BT>, 2>; 2],
        [Tensor<Cube<R, F, I, BT>, 1>; 2],
    )
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        let dtype = gate.dtype();
        if dtype == DType::F64 {
            let derivatives = swiglu_backward(gate, up, Some(bias), grad);
            let bias_gradients = derivatives.clone().map(bias_gradient);
            return (derivatives, bias_gradients);
        }
        let (derivatives, bias_gradients) =
            burn_megatron_kernels::fused::swiglu::backward_and_bias_gradients(
                gate.into_primitive().tensor(),
                up.cast(dtype).into_primitive().tensor(),
                swiglu_kernel_bias(Some(bias), dtype).expect("the biases are given"),
                grad.cast(dtype).into_primitive().tensor(),
            );
        (derivatives.map(float), bias_gradients.map(float))
    }

    /// `ModelBackend::bias_gradient` as deterministic column sums (f64: the composition).
    pub(super) fn bias_gradient<R, F, I, BT>(
        dy: Tensor<Cube<R, F, I, BT>, 2>,
    ) -> Tensor<Cube<R, F, I, BT>, 1>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        let dtype = dy.dtype();
        if dtype == DType::F64 {
            return dy.sum_dim(0).squeeze_dim::<1>(0);
        }
        float(burn_megatron_kernels::fused::column_sum::column_sum(
            dy.into_primitive().tensor(),
            dtype,
        ))
    }

    fn kernel_kind(kind: NormKind) -> norm_kernels::Kind {
        match kind {
            NormKind::LayerNorm => norm_kernels::Kind::LayerNorm,
            NormKind::RmsNorm => norm_kernels::Kind::RmsNorm,
        }
    }

    /// `ModelBackend::norm_forward` in one kernel (f64: the composition).
    pub(super) fn norm_forward<R, F, I, BT>(
        x: Tensor<Cube<R, F, I, BT>, 2>,
        scale: Tensor<Cube<R, F, I, BT>, 1>,
        shift: Option<Tensor<Cube<R, F, I, BT>, 1>>,
        kind: NormKind,
        epsilon: f64,
    ) -> NormForward<Cube<R, F, I, BT>>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        if x.dtype() == DType::F64 {
            return norm_forward_composition(x, scale, shift, kind, epsilon);
        }
        let dtype = x.dtype();
        let raw = |t: Tensor<Cube<R, F, I, BT>, 1>| t.cast(dtype).into_primitive().tensor();
        let out = norm_kernels::forward(
            x.into_primitive().tensor(),
            raw(scale),
            shift.map(raw),
            kernel_kind(kind),
            epsilon,
        );
        NormForward {
            output: float(out.output),
            mean: float(out.mean),
            rstd: float(out.rstd),
        }
    }

    /// `ModelBackend::norm_backward`: one kernel for `dx`, two for the scale and shift
    /// (f64: the composition).
    pub(super) fn norm_backward<R, F, I, BT>(
        x: Tensor<Cube<R, F, I, BT>, 2>,
        scale: Tensor<Cube<R, F, I, BT>, 1>,
        mean: Tensor<Cube<R, F, I, BT>, 1>,
        rstd: Tensor<Cube<R, F, I, BT>, 1>,
        grad: Tensor<Cube<R, F, I, BT>, 2>,
        kind: NormKind,
        with_shift: bool,
    ) -> NormGradients<Cube<R, F, I, BT>>
    where
        R: CubeRuntime,
        F: FloatElement,
        I: IntElement,
        BT: BoolElement,
    {
        if x.dtype() == DType::F64 {
            return norm_backward_composition(x, scale, mean, rstd, grad, kind, with_shift);
        }
        let (dtype, scale_dtype) = (x.dtype(), scale.dtype());
        let [mean, rstd] = [mean, rstd].map(|t| t.cast(DType::F32).into_primitive().tensor());
        let out = norm_kernels::backward(
            x.into_primitive().tensor(),
            scale.cast(dtype).into_primitive().tensor(),
            mean,
            rstd,
            grad.cast(dtype).into_primitive().tensor(),
            kernel_kind(kind),
            with_shift,
        );
        let parameter = |t| float::<R, F, I, BT, 1>(t).cast(scale_dtype);
        NormGradients {
            x: float(out.x),
            scale: parameter(out.scale),
            shift: out.shift.map(parameter),
        }
    }

    /// The fused operations, the same on every CubeCL backend.
    macro_rules! fused_operations {
        () => {
            fn bias_gradient(dy: Tensor<Self, 2>) -> Tensor<Self, 1> {
                cube::bias_gradient(dy)
            }

            fn swiglu(
                gate: Tensor<Self, 2>,
                up: Tensor<Self, 2>,
                bias: Option<crate::ops::swiglu::SwiGluBias<Self>>,
            ) -> Tensor<Self, 2> {
                cube::swiglu(gate, up, bias)
            }

            fn dropout(
                x: Tensor<Self, 4>,
                residual: Option<Tensor<Self, 4>>,
                mask: crate::ops::DropoutMask,
            ) -> Tensor<Self, 4> {
                cube::dropout(x, residual, mask)
            }

            fn packed_rope(qkv: Tensor<Self, 5>, base: f64) -> Tensor<Self, 5> {
                cube::packed_rope(qkv, base, false)
            }

            fn packed_rope_backward(grad: Tensor<Self, 5>, base: f64) -> Tensor<Self, 5> {
                cube::packed_rope(grad, base, true)
            }

            fn write_slot(
                buffer: Tensor<Self, 1>,
                start: usize,
                values: Tensor<Self, 1>,
            ) -> Tensor<Self, 1> {
                cube::write_slot(buffer, start, values)
            }

            fn swiglu_backward(
                gate: Tensor<Self, 2>,
                up: Tensor<Self, 2>,
                bias: Option<crate::ops::swiglu::SwiGluBias<Self>>,
                grad: Tensor<Self, 2>,
            ) -> [Tensor<Self, 2>; 2] {
                cube::swiglu_backward(gate, up, bias, grad)
            }

            fn swiglu_backward_and_bias_gradients(
                gate: Tensor<Self, 2>,
                up: Tensor<Self, 2>,
                bias: crate::ops::swiglu::SwiGluBias<Self>,
                grad: Tensor<Self, 2>,
            ) -> ([Tensor<Self, 2>; 2], [Tensor<Self, 1>; 2]) {
                cube::swiglu_backward_and_bias_gradients(gate, up, bias, grad)
            }

            fn cross_entropy_statistics(
                logits: Tensor<Self, 2>,
                targets: Tensor<Self, 1, Int>,
                slice: VocabSlice,
            ) -> [Tensor<Self, 1>; 3] {
                cube::cross_entropy_statistics(logits, targets, slice)
            }

            fn cross_entropy_gradient(
                logits: Tensor<Self, 2>,
                targets: Tensor<Self, 1, Int>,
                max: Tensor<Self, 1>,
                sum_exp: Tensor<Self, 1>,
                grad_loss: Tensor<Self, 1>,
                slice: VocabSlice,
            ) -> Tensor<Self, 2> {
                cube::cross_entropy_gradient(logits, targets, max, sum_exp, grad_loss, slice)
            }

            fn causal_softmax(scores: Tensor<Self, 4>, scale: f64) -> Tensor<Self, 4> {
                cube::causal_softmax(scores, scale)
            }

            fn masked_softmax(
                scores: Tensor<Self, 4>,
                key_lengths: Option<Tensor<Self, 1, Int>>,
                scale: f64,
                causal: bool,
            ) -> Tensor<Self, 4> {
                cube::masked_softmax(scores, key_lengths, scale, causal)
            }

            fn masked_softmax_backward(
                probs: Tensor<Self, 4>,
                grad: Tensor<Self, 4>,
                scale: f64,
                causal: bool,
            ) -> Tensor<Self, 4> {
                cube::masked_softmax_backward(probs, grad, scale, causal)
            }

            fn bias_gelu(
                x: Tensor<Self, 2>,
                bias: Option<Tensor<Self, 1>>,
                form: crate::ops::GeluForm,
            ) -> Tensor<Self, 2> {
                cube::bias_gelu(x, bias, form)
            }

            fn bias_gelu_backward(
                x: Tensor<Self, 2>,
                bias: Option<Tensor<Self, 1>>,
                grad: Tensor<Self, 2>,
                form: crate::ops::GeluForm,
            ) -> Tensor<Self, 2> {
                cube::bias_gelu_backward(x, bias, grad, form)
            }

            fn bias_gelu_backward_and_bias_gradient(
                x: Tensor<Self, 2>,
                bias: Tensor<Self, 1>,
                grad: Tensor<Self, 2>,
                form: crate::ops::GeluForm,
            ) -> (Tensor<Self, 2>, Tensor<Self, 1>) {
                cube::bias_gelu_backward_and_bias_gradient(x, bias, grad, form)
            }

            fn causal_softmax_backward(
                probs: Tensor<Self, 4>,
                grad: Tensor<Self, 4>,
                scale: f64,
            ) -> Tensor<Self, 4> {
                cube::masked_softmax_backward(probs, grad, scale, true)
            }

            fn norm_forward(
                x: Tensor<Self, 2>,
                scale: Tensor<Self, 1>,
                shift: Option<Tensor<Self, 1>>,
                kind: crate::ops::NormKind,
                epsilon: f64,
            ) -> crate::ops::norm::NormForward<Self> {
                cube::norm_forward(x, scale, shift, kind, epsilon)
            }

            fn norm_backward(
                x: Tensor<Self, 2>,
                scale: Tensor<Self, 1>,
                mean: Tensor<Self, 1>,
                rstd: Tensor<Self, 1>,
                grad: Tensor<Self, 2>,
                kind: crate::ops::NormKind,
                with_shift: bool,
            ) -> crate::ops::norm::NormGradients<Self> {
                cube::norm_backward(x, scale, mean, rstd, grad, kind, with_shift)
            }

            fn flat_adamw(
                buffers: FlatAdamWBuffers<Self>,
                scalars: &AdamWScalars,
                model_dtype: Option<DType>,
            ) -> FlatAdamWOutput<Self> {
                cube::flat_adamw(buffers, scalars, model_dtype)
            }

            fn embedding_gradient(
                grad: Tensor<Self, 2>,
                ids: Tensor<Self, 1, Int>,
                vocab: usize,
            ) -> Tensor<Self, 2> {
                cube::embedding_gradient(grad, ids, vocab)
            }
        };
    }
    pub(super) use fused_operations;

    /// Flash attention through the CubeCL kernels (our CUDA backend puts cuDNN first), with
    /// views of packed QKV buffers starting where `$offsets` (a `ViewOffsets`) allows.
    macro_rules! flash_operations {
        ($offsets:expr) => {
            fn packed_flash_attention(
                qkv: Tensor<Self, 5>,
                scale: f64,
                causal: bool,
            ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
                cube::packed_flash_attention(&qkv, scale, causal, $offsets).unwrap_or_else(|| {
                    crate::ops::packed_flash_attention::forward_composition(qkv, scale, causal)
                })
            }

            fn packed_flash_attention_backward(
                qkv: Tensor<Self, 5>,
                out: Tensor<Self, 4>,
                lse: Tensor<Self, 3>,
                grad: Tensor<Self, 4>,
                scale: f64,
                causal: bool,
            ) -> Tensor<Self, 5> {
                cube::packed_flash_attention_backward(
                    &qkv, &out, &lse, &grad, scale, causal, $offsets,
                )
                .unwrap_or_else(|| {
                    crate::ops::packed_flash_attention::backward_composition(
                        qkv, out, lse, grad, scale, causal,
                    )
                })
            }

            fn flash_attention(
                q: Tensor<Self, 4>,
                k: Tensor<Self, 4>,
                v: Tensor<Self, 4>,
                scale: f64,
                causal: bool,
            ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
                cube::flash_attention(q, k, v, scale, causal)
            }

            fn flash_attention_backward(
                q: Tensor<Self, 4>,
                k: Tensor<Self, 4>,
                v: Tensor<Self, 4>,
                out: Tensor<Self, 4>,
                lse: Tensor<Self, 3>,
                grad: Tensor<Self, 4>,
                scale: f64,
                causal: bool,
            ) -> [Tensor<Self, 4>; 3] {
                cube::flash_attention_backward(q, k, v, out, lse, grad, scale, causal)
            }
        };
    }
    pub(super) use flash_operations;
}

#[cfg(feature = "cuda")]
mod cuda {
    use burn::tensor::TensorPrimitive;
    use burn::tensor::{DType, Int, Tensor};
    use burn_cubecl::cubecl::cuda::CudaRuntime;
    use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
    use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
    use burn_fusion::{Fusion, FusionBackend};
    use burn_megatron_kernels::cuda::cudnn::attention as cudnn_attention;
    use burn_megatron_kernels::cuda::{MegatronCudaRuntime, check_on_device, gemm};

    use super::{ModelBackend, cube};
    use crate::error::{IdKind, InputError};
    use crate::ops::cross_entropy::VocabSlice;
    use crate::ops::packed_flash_attention as packed_ops;
    use crate::optimizer::fused_adamw::{AdamWScalars, FlatAdamWBuffers, FlatAdamWOutput};

    /// CUDA kernels get device pointers: views may start at any element.
    const ANY: cube::ViewOffsets = cube::ViewOffsets::AnyElement;

    fn float<F: FloatElement, I: IntElement, BT: BoolElement, const D: usize>(
        tensor: burn_cubecl::tensor::CubeTensor<MegatronCudaRuntime>,
    ) -> Tensor<CubeBackend<MegatronCudaRuntime, F, I, BT>, D> {
        Tensor::from_primitive(TensorPrimitive::Float(tensor))
    }

    /// burn-cuda's backend: Burn's own matmul (the reference our backend is tested against),
    /// and the fused kernels.
    impl<F: FloatElement, I: IntElement, BT: BoolElement> ModelBackend
        for CubeBackend<CudaRuntime, F, I, BT>
    {
        cube::fused_operations!();
        cube::flash_operations!(cube::ViewOffsets::AnyElement);
    }

    /// Our CUDA backend: the linear layers' GEMMs through cuBLASLt, in stream order, flash
    /// attention through cuDNN where it takes the call, the fused kernels, and id checks on
    /// the device.
    impl<F: FloatElement, I: IntElement, BT: BoolElement> ModelBackend
        for CubeBackend<MegatronCudaRuntime, F, I, BT>
    {
        cube::fused_operations!();

        fn memory_in_use(device: &Self::Device) -> Option<u64> {
            use burn_cubecl::cubecl::Runtime;
            MegatronCudaRuntime::client(device)
                .memory_usage()
                .ok()
                .map(|usage| usage.bytes_in_use)
        }

        fn flash_attention(
            q: Tensor<Self, 4>,
            k: Tensor<Self, 4>,
            v: Tensor<Self, 4>,
            scale: f64,
            causal: bool,
        ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
            let raw = |t: &Tensor<Self, 4>| t.clone().into_primitive().tensor();
            match cudnn_attention::forward(&raw(&q), &raw(&k), &raw(&v), scale as f32, causal) {
                Some((out, lse)) => (
                    Tensor::from_primitive(TensorPrimitive::Float(out)),
                    Tensor::from_primitive(TensorPrimitive::Float(lse)),
                ),
                None => cube::flash_attention(q, k, v, scale, causal),
            }
        }

        fn flash_attention_backward(
            q: Tensor<Self, 4>,
            k: Tensor<Self, 4>,
            v: Tensor<Self, 4>,
            out: Tensor<Self, 4>,
            lse: Tensor<Self, 3>,
            grad: Tensor<Self, 4>,
            scale: f64,
            causal: bool,
        ) -> [Tensor<Self, 4>; 3] {
            let raw = |t: &Tensor<Self, 4>| t.clone().into_primitive().tensor();
            let grads = cudnn_attention::backward(
                &raw(&q),
                &raw(&k),
                &raw(&v),
                &raw(&out),
                &lse.clone().into_primitive().tensor(),
                &raw(&grad),
                scale as f32,
                causal,
            );
            match grads {
                Some(grads) => grads.map(|g| Tensor::from_primitive(TensorPrimitive::Float(g))),
                None => cube::flash_attention_backward(q, k, v, out, lse, grad, scale, causal),
            }
        }

        /// cuDNN on views of `qkv` (one head stride: one head per group, or one group), else
        /// the CubeCL path.
        fn packed_flash_attention(
            qkv: Tensor<Self, 5>,
            scale: f64,
            causal: bool,
        ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
            let raw = qkv.clone().into_primitive().tensor();
            let attention = cube::packed::views(&raw, ANY)
                .and_then(|[q, k, v]| cudnn_attention::forward(&q, &k, &v, scale as f32, causal));
            match attention {
                // cuDNN stores the output `[batch, seq, heads, head_dim]`.
                Some((out, lse)) => (float::<F, I, BT, 4>(out).swap_dims(1, 2), float(lse)),
                None => cube::packed_flash_attention(&qkv, scale, causal, ANY)
                    .unwrap_or_else(|| packed_ops::forward_composition(qkv, scale, causal)),
            }
        }

        /// cuDNN reading views of `qkv` and writing dq, dk and dv into views of one `dqkv`
        /// buffer, else the CubeCL path.
        fn packed_flash_attention_backward(
            qkv: Tensor<Self, 5>,
            out: Tensor<Self, 4>,
            lse: Tensor<Self, 3>,
            grad: Tensor<Self, 4>,
            scale: f64,
            causal: bool,
        ) -> Tensor<Self, 5> {
            let raw = qkv.clone().into_primitive().tensor();
            let dqkv = empty_device_contiguous_dtype(
                raw.client.clone(),
                raw.device.clone(),
                raw.meta.shape().clone(),
                raw.dtype,
            );
            let views = cube::packed::views(&raw, ANY).zip(cube::packed::views(&dqkv, ANY));
            if let Some(([q, k, v], grads)) = views {
                let heads_major =
                    |t: &Tensor<Self, 4>| t.clone().swap_dims(1, 2).into_primitive().tensor();
                let written = cudnn_attention::backward_into(
                    &q,
                    &k,
                    &v,
                    &heads_major(&out),
                    &lse.clone().into_primitive().tensor(),
                    &heads_major(&grad),
                    &grads,
                    scale as f32,
                    causal,
                );
                if written {
                    return float(dqkv);
                }
            }
            cube::packed_flash_attention_backward(&qkv, &out, &lse, &grad, scale, causal, ANY)
                .unwrap_or_else(|| {
                    packed_ops::backward_composition(qkv, out, lse, grad, scale, causal)
                })
        }

        fn gemm(
            a: Tensor<Self, 2>,
            b: Tensor<Self, 2>,
            transpose_a: bool,
            transpose_b: bool,
        ) -> Tensor<Self, 2> {
            gemm::matmul(a, b, transpose_a, transpose_b)
        }

        fn linear(
            x: Tensor<Self, 2>,
            w: Tensor<Self, 2>,
            bias: Option<Tensor<Self, 1>>,
        ) -> Tensor<Self, 2> {
            gemm::linear(x, w, bias, false, false)
        }

        /// On the device: the smallest and largest id are computed there and checked at the
        /// device's next read or sync (see `burn_megatron_kernels::cuda::device_check`).
        fn check_ids<const D: usize>(
            ids: Tensor<Self, D, Int>,
            kind: IdKind,
            vocab_size: usize,
        ) -> Result<(), InputError> {
            if ids.shape().num_elements() == 0 {
                return Ok(());
            }
            let ids = ids.flatten::<1>(0, D - 1);
            let extremes = Tensor::cat(vec![ids.clone().min(), ids.max()], 0);
            check_on_device(extremes.into_primitive(), move |values| {
                let &[min, max] = values else {
                    return Some(format!("an id check read {} values, not 2", values.len()));
                };
                [max, min]
                    .into_iter()
                    .find(|&id| !kind.accepts(id, vocab_size))
                    .map(|id| {
                        InputError::IdOutOfRange {
                            kind,
                            id,
                            vocab_size,
                        }
                        .to_string()
                    })
            });
            Ok(())
        }
    }

    impl<B: FusionBackend> ModelBackend for Fusion<B> {}
}

/// Burn's wgpu backend (lavapipe in CI): the fused kernels.
#[cfg(feature = "wgpu")]
mod wgpu {
    use burn::backend::wgpu::WgpuRuntime;
    use burn::tensor::{DType, Int, Tensor};
    use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};

    use super::{ModelBackend, cube};
    use crate::ops::cross_entropy::VocabSlice;
    use crate::optimizer::fused_adamw::{AdamWScalars, FlatAdamWBuffers, FlatAdamWOutput};

    impl<F: FloatElement, I: IntElement, BT: BoolElement> ModelBackend
        for CubeBackend<WgpuRuntime, F, I, BT>
    {
        cube::fused_operations!();
        cube::flash_operations!(cube::ViewOffsets::MemoryAlignment);
    }
}

impl<B: ModelBackend, C: CheckpointStrategy> ModelBackend for Autodiff<B, C> {
    fn memory_in_use(device: &Self::Device) -> Option<u64> {
        B::memory_in_use(device)
    }

    fn autodiff_node(tensor: &Self::FloatTensorPrimitive) -> Option<u64> {
        Some(tensor.node.id.value)
    }

    fn linear(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        autodiff_linear::<B, C>(x, w, bias, false)
    }

    fn linear_output_major(
        x: Tensor<Self, 2>,
        w_t: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        autodiff_linear::<B, C>(x, w_t, bias, true)
    }

    fn check_ids<const D: usize>(
        ids: Tensor<Self, D, Int>,
        kind: IdKind,
        vocab_size: usize,
    ) -> Result<(), InputError> {
        B::check_ids::<D>(
            Tensor::from_primitive(ids.into_primitive()),
            kind,
            vocab_size,
        )
    }

    fn recomputed_attention_core(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        core: AttentionCore,
    ) -> Tensor<Self, 4> {
        let [q, k, v] = [q, k, v].map(|t| t.into_primitive().tensor());
        let output = core
            .forward(
                wrap::<B, 4>(q.primitive.clone()),
                wrap::<B, 4>(k.primitive.clone()),
                wrap::<B, 4>(v.primitive.clone()),
            )
            .into_primitive()
            .tensor();
        let prep = RecomputedAttention
            .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
            .compute_bound()
            .stateful();
        let output = match prep {
            OpsKind::Tracked(prep) => {
                prep.finish((q.primitive, k.primitive, v.primitive, core), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        Tensor::from_primitive(TensorPrimitive::Float(output))
    }

    fn bias_gelu(
        x: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
        form: GeluForm,
    ) -> Tensor<Self, 2> {
        autodiff_bias_gelu(x, bias, form)
    }

    fn backward_hook<const D: usize>(
        x: Tensor<Self, D>,
        hook: &Arc<dyn BackwardHook>,
        point: usize,
    ) -> Tensor<Self, D> {
        let x = x.into_primitive().tensor();
        let output = match HookBackward
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((hook.clone(), point), x.primitive),
            OpsKind::UnTracked(prep) => prep.finish(x.primitive),
        };
        Tensor::from_primitive(TensorPrimitive::Float(output))
    }

    fn bias_add(x: Tensor<Self, 2>, bias: Tensor<Self, 1>) -> Tensor<Self, 2> {
        let x = x.into_primitive().tensor();
        let bias = bias.into_primitive().tensor();
        let output = <B as ModelBackend>::bias_add(
            wrap::<B, 2>(x.primitive.clone()),
            wrap::<B, 1>(bias.primitive.clone()),
        )
        .into_primitive()
        .tensor();
        let output = BiasAddBackward
            .prepare::<C>([x.node.clone(), bias.node.clone()])
            .compute_bound()
            .stateless(output);
        Tensor::from_primitive(TensorPrimitive::Float(output))
    }

    fn swiglu(
        gate: Tensor<Self, 2>,
        up: Tensor<Self, 2>,
        bias: Option<SwiGluBias<Self>>,
    ) -> Tensor<Self, 2> {
        autodiff_swiglu(gate, up, bias)
    }

    fn dropout(
        x: Tensor<Self, 4>,
        residual: Option<Tensor<Self, 4>>,
        mask: DropoutMask,
    ) -> Tensor<Self, 4> {
        autodiff_dropout(x, residual, mask)
    }

    fn packed_rope(qkv: Tensor<Self, 5>, base: f64) -> Tensor<Self, 5> {
        crate::ops::rope::autodiff_packed_rope(qkv, base)
    }

    fn cross_entropy(
        logits: Tensor<Self, 2>,
        targets: Tensor<Self, 1, Int>,
        slice: VocabSlice,
        tp: &ProcessGroup,
    ) -> DistResult<Tensor<Self, 1>> {
        autodiff_cross_entropy(logits, targets, slice, tp)
    }

    fn causal_softmax(scores: Tensor<Self, 4>, scale: f64) -> Tensor<Self, 4> {
        crate::ops::causal_softmax::autodiff_causal_softmax(scores, scale)
    }

    fn masked_softmax(
        scores: Tensor<Self, 4>,
        key_lengths: Option<Tensor<Self, 1, Int>>,
        scale: f64,
        causal: bool,
    ) -> Tensor<Self, 4> {
        crate::ops::causal_softmax::autodiff_masked_softmax(scores, key_lengths, scale, causal)
    }

    fn flash_attention(
        q: Tensor<Self, 4>,
        k: Tensor<Self, 4>,
        v: Tensor<Self, 4>,
        scale: f64,
        causal: bool,
    ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
        crate::ops::flash_attention::autodiff_flash_attention(q, k, v, scale, causal)
    }

    fn packed_flash_attention(
        qkv: Tensor<Self, 5>,
        scale: f64,
        causal: bool,
    ) -> (Tensor<Self, 4>, Tensor<Self, 3>) {
        crate::ops::packed_flash_attention::autodiff_packed_flash_attention(qkv, scale, causal)
    }

    fn norm(
        x: Tensor<Self, 2>,
        scale: Tensor<Self, 1>,
        shift: Option<Tensor<Self, 1>>,
        kind: NormKind,
        epsilon: f64,
    ) -> Tensor<Self, 2> {
        autodiff_norm(x, scale, shift, kind, epsilon)
    }

    fn embedding_lookup(weight: Tensor<Self, 2>, ids: Tensor<Self, 2, Int>) -> Tensor<Self, 3> {
        crate::ops::embedding::autodiff_embedding(weight, ids, false)
    }

    fn embedding_lookup_or_zero(
        weight: Tensor<Self, 2>,
        ids: Tensor<Self, 2, Int>,
    ) -> Tensor<Self, 3> {
        crate::ops::embedding::autodiff_embedding(weight, ids, true)
    }
}

pub(crate) fn wrap<B: burn::tensor::backend::Backend, const D: usize>(
    primitive: B::FloatTensorPrimitive,
) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(primitive))
}

/// [`ModelBackend::linear`] (or, with `output_major`, `linear_output_major`) on `Autodiff<B>`:
/// the inner backend's product and one node storing `x` and `w`.
fn autodiff_linear<B: ModelBackend, C: CheckpointStrategy>(
    x: Tensor<Autodiff<B, C>, 2>,
    w: Tensor<Autodiff<B, C>, 2>,
    bias: Option<Tensor<Autodiff<B, C>, 1>>,
    output_major: bool,
) -> Tensor<Autodiff<B, C>, 2> {
    let x = x.into_primitive().tensor();
    let w = w.into_primitive().tensor();
    let bias = bias.map(|b| b.into_primitive().tensor());
    let (inner_x, inner_w) = (
        wrap::<B, 2>(x.primitive.clone()),
        wrap::<B, 2>(w.primitive.clone()),
    );
    let inner_bias = bias.as_ref().map(|b| wrap::<B, 1>(b.primitive.clone()));
    let output = match output_major {
        false => <B as ModelBackend>::linear(inner_x, inner_w, inner_bias),
        true => <B as ModelBackend>::linear_output_major(inner_x, inner_w, inner_bias),
    }
    .into_primitive()
    .tensor();
    let state = (x.primitive.clone(), w.primitive.clone());
    let backward = LinearBackward { output_major };
    let output = match bias {
        Some(bias) => match backward
            .prepare::<C>([x.node.clone(), w.node.clone(), bias.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
        None => match backward
            .prepare::<C>([x.node.clone(), w.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
    };
    Tensor::from_primitive(TensorPrimitive::Float(output))
}

/// The backward of `y = x · w + bias` ([`ModelBackend::linear`]) or, with `output_major`, of
/// `y = x · wᵀ + bias` ([`ModelBackend::linear_output_major`], `w: [d_out, d_in]`): the
/// transposes folded into the GEMMs, the weight's gradient in the weight's own layout, and
/// `db = Σ_tokens dy`.
#[derive(Debug)]
struct LinearBackward {
    output_major: bool,
}

impl LinearBackward {
    fn run<B: ModelBackend>(
        &self,
        parents: &[Option<NodeId>],
        dy: B::FloatTensorPrimitive,
        (x, w): (B::FloatTensorPrimitive, B::FloatTensorPrimitive),
        grads: &mut Gradients,
    ) {
        let dy = wrap::<B, 2>(dy);
        if let Some(id) = parents[0] {
            // dx = dy · wᵀ, or dy · w for an output-major weight.
            let dx = B::gemm(dy.clone(), wrap(w), false, !self.output_major);
            grads.register::<B>(id, dx.into_primitive().tensor());
        }
        if let Some(id) = parents[1] {
            // dw = xᵀ · dy, or dyᵀ · x for an output-major weight.
            let dw = match self.output_major {
                false => B::gemm(wrap(x), dy.clone(), true, false),
                true => B::gemm(dy.clone(), wrap(x), true, false),
            };
            grads.register::<B>(id, dw.into_primitive().tensor());
        }
        if let Some(Some(id)) = parents.get(2) {
            let db = B::bias_gradient(dy);
            grads.register::<B>(*id, db.into_primitive().tensor());
        }
    }
}

impl<B: ModelBackend> Backward<B, 2> for LinearBackward {
    type State = (B::FloatTensorPrimitive, B::FloatTensorPrimitive);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let parents = ops.parents.map(|p| p.map(|node| node.id));
        self.run::<B>(&parents, dy, ops.state, grads);
    }
}

impl<B: ModelBackend> Backward<B, 3> for LinearBackward {
    type State = (B::FloatTensorPrimitive, B::FloatTensorPrimitive);

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let parents = ops.parents.map(|p| p.map(|node| node.id));
        self.run::<B>(&parents, dy, ops.state, grads);
    }
}

/// The backward of `y = x + bias`: `dx = dy`, `db = Σ_tokens dy` through
/// [`ModelBackend::bias_gradient`] (deterministic column sums on CubeCL backends, where
/// Burn's broadcast backward runs a generic reduction).
#[derive(Debug)]
struct BiasAddBackward;

impl<B: ModelBackend> Backward<B, 2> for BiasAddBackward {
    type State = ();

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [x, bias] = ops.parents.map(|p| p.map(|node| node.id));
        if let Some(id) = bias {
            let db = B::bias_gradient(wrap::<B, 2>(dy.clone()));
            grads.register::<B>(id, db.into_primitive().tensor());
        }
        if let Some(id) = x {
            grads.register::<B>(id, dy);
        }
    }
}

/// The backward of [`ModelBackend::backward_hook`]: runs the hook, then passes the gradient
/// through.
#[derive(Debug)]
struct HookBackward;

impl<B: ModelBackend> Backward<B, 1> for HookBackward {
    type State = (Arc<dyn BackwardHook>, usize);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (hook, point) = ops.state;
        hook.on_backward(point, grads);
        let dy = grads.consume::<B>(&ops.node);
        if let [Some(parent)] = ops.parents {
            grads.register::<B>(parent.id, dy);
        }
    }
}

/// [`ModelBackend::write_slot`] as Burn operations: a cast (unless already f32), then a
/// `slice_assign`.
pub fn write_slot_composition<B: burn::tensor::backend::Backend>(
    buffer: Tensor<B, 1>,
    start: usize,
    values: Tensor<B, 1>,
) -> Tensor<B, 1> {
    let n = values.dims()[0];
    let values = match values.dtype() {
        DType::F32 => values,
        _ => values.cast(DType::F32),
    };
    buffer.slice_assign(start..start + n, values)
}

/// `x + bias` over the last dimension of an `x` of any rank: flattened to `[tokens,
/// features]` for [`ModelBackend::bias_add`], then reshaped back.
pub fn bias_add<B: ModelBackend, const D: usize>(
    x: Tensor<B, D>,
    bias: Tensor<B, 1>,
) -> Tensor<B, D> {
    let dims = x.dims();
    let features = dims[D - 1];
    let tokens = dims.iter().product::<usize>() / features.max(1);
    B::bias_add(x.reshape([tokens, features]), bias).reshape(dims)
}

/// `x · w + bias` over the last dimension of an `x` of any rank: flattened to
/// `[tokens, d_in]` for [`ModelBackend::linear`], then reshaped back.
pub fn linear<B: ModelBackend, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    let dims = x.dims();
    let d_out = w.dims()[1];
    let tokens: usize = dims[..D - 1].iter().product();
    let y = <B as ModelBackend>::linear(x.reshape([tokens, dims[D - 1]]), w, bias);
    let mut out = dims;
    out[D - 1] = d_out;
    y.reshape(out)
}

/// `x · w_tᵀ + bias` over the last dimension of an `x` of any rank, for a weight stored
/// output-major (`w_t: [d_out, d_in]`): [`ModelBackend::linear_output_major`] on `x`
/// flattened to `[tokens, d_in]`, reshaped back.
pub fn linear_output_major<B: ModelBackend, const D: usize>(
    x: Tensor<B, D>,
    w_t: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    let dims = x.dims();
    let d_out = w_t.dims()[0];
    let tokens: usize = dims[..D - 1].iter().product();
    let y = <B as ModelBackend>::linear_output_major(x.reshape([tokens, dims[D - 1]]), w_t, bias);
    let mut out = dims;
    out[D - 1] = d_out;
    y.reshape(out)
}

#[derive(Debug)]
struct RecomputedAttention;

impl<B: ModelBackend> Backward<B, 3> for RecomputedAttention {
    type State = (
        B::FloatTensorPrimitive,
        B::FloatTensorPrimitive,
        B::FloatTensorPrimitive,
        AttentionCore,
    );

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let (q, k, v, core) = ops.state;
        let [grad_q, grad_k, grad_v] = core.backward(
            wrap::<B, 4>(q),
            wrap::<B, 4>(k),
            wrap::<B, 4>(v),
            wrap::<B, 4>(grad),
        );
        for (node, grad) in [(node_q, grad_q), (node_k, grad_k), (node_v, grad_v)] {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad.into_primitive().tensor());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn_megatron_testing::{assert_close, tolerance, values};

    use crate::init::{InitDistribution, init_full};

    type AD = Autodiff<NdArray>;

    /// `bias_add`'s node (bias gradient through `bias_gradient`) against Burn's broadcast add,
    /// for a 3D input: same output, same gradients of both inputs.
    #[test]
    fn bias_add_backward_matches_burns_autodiff() {
        let dev = Default::default();
        let normal = |shape: [usize; 3], seed| {
            init_full::<AD, 3>(shape, InitDistribution::Normal { std: 1.0 }, seed, &dev)
        };
        let run = |ours: bool| {
            let x = normal([2, 5, 7], 1).require_grad();
            let b = normal([1, 1, 7], 2).reshape([7]).require_grad();
            let y = if ours {
                super::bias_add(x.clone(), b.clone())
            } else {
                x.clone() + b.clone().unsqueeze()
            };
            let upstream = normal([2, 5, 7], 3).detach();
            let grads = (y.clone() * upstream).sum().backward();
            [
                values(y.inner()),
                values(x.grad(&grads).unwrap()),
                values(b.grad(&grads).unwrap()),
            ]
        };
        for (i, (a, b)) in run(true).iter().zip(run(false)).enumerate() {
            assert_close(&format!("bias_add {i}"), a, &b, tolerance::F32_SAME_ORDER);
        }
    }

    /// Our linear's hand-written backward (GEMMs with folded transposes) against Burn's own
    /// autodiff, for a 3D input, with and without bias, and for a transposed-view weight.
    #[test]
    fn linear_backward_matches_burns_autodiff() {
        let dev = Default::default();
        let normal = |shape: [usize; 3], seed| {
            init_full::<AD, 3>(shape, InitDistribution::Normal { std: 1.0 }, seed, &dev)
        };
        for (with_bias, transposed_weight) in [(true, false), (false, false), (true, true)] {
            let run = |ours: bool| {
                let x = normal([2, 5, 7], 1).require_grad();
                let stored = if transposed_weight {
                    [1, 3, 7]
                } else {
                    [1, 7, 3]
                };
                let w_param = normal(stored, 2).squeeze_dim::<2>(0).require_grad();
                let w = if transposed_weight {
                    w_param.clone().transpose()
                } else {
                    w_param.clone()
                };
                let b = with_bias.then(|| normal([1, 1, 3], 3).reshape([3]).require_grad());
                let y = if ours {
                    super::linear(x.clone(), w, b.clone())
                } else {
                    burn::tensor::module::linear(x.clone(), w, b.clone())
                };
                let upstream = normal([2, 5, 3], 4).detach();
                let grads = (y.clone() * upstream).sum().backward();
                let mut out = vec![
                    values(y.inner()),
                    values(x.grad(&grads).unwrap()),
                    values(w_param.grad(&grads).unwrap()),
                ];
                out.extend(b.map(|b| values(b.grad(&grads).unwrap())));
                out
            };
            for (i, (a, b)) in run(true).iter().zip(run(false)).enumerate() {
                assert_close(
                    &format!("output {i} (bias {with_bias}, transposed {transposed_weight})"),
                    a,
                    &b,
                    tolerance::F32_SAME_ORDER,
                );
            }
        }
    }

    /// `linear_output_major` (the weight stored `[d_out, d_in]`, no transposed view) against
    /// Burn's autodiff of `linear` on the transposed view, with and without bias.
    #[test]
    fn output_major_linear_matches_burns_autodiff() {
        let dev = Default::default();
        let normal = |shape: [usize; 3], seed| {
            init_full::<AD, 3>(shape, InitDistribution::Normal { std: 1.0 }, seed, &dev)
        };
        for with_bias in [false, true] {
            let run = |ours: bool| {
                let x = normal([2, 5, 7], 1).require_grad();
                let w_t = normal([1, 3, 7], 2).squeeze_dim::<2>(0).require_grad();
                let b = with_bias.then(|| normal([1, 1, 3], 3).reshape([3]).require_grad());
                let y = if ours {
                    super::linear_output_major(x.clone(), w_t.clone(), b.clone())
                } else {
                    burn::tensor::module::linear(x.clone(), w_t.clone().transpose(), b.clone())
                };
                let upstream = normal([2, 5, 3], 4).detach();
                let grads = (y.clone() * upstream).sum().backward();
                let mut out = vec![
                    values(y.inner()),
                    values(x.grad(&grads).unwrap()),
                    values(w_t.grad(&grads).unwrap()),
                ];
                out.extend(b.map(|b| values(b.grad(&grads).unwrap())));
                out
            };
            for (i, (a, b)) in run(true).iter().zip(run(false)).enumerate() {
                assert_close(
                    &format!("output {i} (bias {with_bias})"),
                    a,
                    &b,
                    tolerance::F32_SAME_ORDER,
                );
            }
        }
    }
}
