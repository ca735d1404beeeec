//! The experts' GEMMs: `y_e = x_e · w[e]` for every local expert `e` at once, where the
//! tokens are in expert-major blocks whose sizes the dispatcher has read to the host
//! (Megatron's `GroupedMLP`, PyTorch's `torch._grouped_mm`).
//!
//! One product per expert leaves the GPU idle between small GEMMs and, under autodiff, records
//! one node per expert and a concatenation. Here `Autodiff<B>` records one node for all experts,
//! whose backward is two grouped products: `dx = grouped(dy, wᵀ)` and `dw[e] = x_eᵀ · dy_e`
//! (zero for an expert without rows). So every expert's weight gets a gradient, whatever the
//! routing. Given a backward hook ([`hooked_grouped_linear`]), the node first offers `dw` to it
//! ([`BackwardHook::take_weight_gradient`]): the overlap hook of the distributed optimizer has
//! the products accumulate into its flat f32 buffer, as the dense layers' do. Our CUDA backend
//! runs each of the three products as one foreign operation in stream order
//! (`burn_megatron_kernels::cuda::grouped_gemm`): cuBLAS's grouped GEMM for many small experts,
//! cuBLASLt GEMMs spread over two streams for few large ones (each faster there, measured),
//! and one strided-batched cuBLASLt GEMM for blocks of one size, which the MoE layer makes of
//! many small experts' blocks where padding them costs little
//! ([`GroupedLinearOps::padded_block_rows`]); other backends loop over the experts with
//! [`LinearOps::gemm`].

use std::any::Any;
use std::sync::Arc;

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;

use super::autodiff::{BackwardStep, inner, parent, record, register};
use super::backward_hook::{BackwardHook, WeightGradient};
use super::linear::LinearOps;
use super::primitive::{raw, wrap};
use super::write_slot::add_to_slot;

/// The experts' grouped GEMMs. `counts[e]` rows of the tokens belong to expert `e`, after
/// those of experts `0..e`; the counts add up to the tokens' rows.
pub trait GroupedLinearOps: LinearOps {
    /// `x_e · op(w[e])` for every expert, in the tokens' order; `op` transposes when asked
    /// (the input gradient's product). Experts without rows are skipped.
    ///
    /// # Shapes
    /// - `x`: `[n, k]`
    /// - `w`: `[experts, k, m]` (`[experts, m, k]` with `transpose_w`)
    /// - output: `[n, m]`
    fn grouped_gemm(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 3>,
        counts: &[usize],
        transpose_w: bool,
    ) -> Tensor<Self, 2> {
        per_expert_gemm(x, w, counts, transpose_w)
    }

    /// `x_eᵀ · dy_e` for every expert: the weights' gradient, zero for an expert without rows.
    ///
    /// # Shapes
    /// - `x`: `[n, k]`
    /// - `dy`: `[n, m]`
    /// - output: `[experts, k, m]`
    fn grouped_weight_gradient(
        x: Tensor<Self, 2>,
        dy: Tensor<Self, 2>,
        counts: &[usize],
    ) -> Tensor<Self, 3> {
        per_expert_weight_gradient(x, dy, counts)
    }

    /// `buffer` (`[numel]` f32) with every expert's `x_eᵀ · dy_e` added row-major at
    /// `start..start + experts · k · m`, laid out as the `[experts, k, m]` stack: the weights'
    /// gradient summed into its slot of a flat f32 gradient buffer. The default computes the
    /// gradient, then adds it ([`WriteSlotOps::add_slot`](super::WriteSlotOps::add_slot)); our
    /// CUDA backend has the products accumulate into the slot in place (beta 1, f32).
    ///
    /// # Shapes
    /// - `buffer`: `[numel]`, f32
    /// - `x`: `[n, k]`
    /// - `dy`: `[n, m]`
    /// - output: `[numel]`
    fn grouped_weight_gradient_add_slot(
        buffer: Tensor<Self, 1>,
        start: usize,
        x: Tensor<Self, 2>,
        dy: Tensor<Self, 2>,
        counts: &[usize],
    ) -> Tensor<Self, 1> {
        grouped_weight_gradient_add_slot_composition(buffer, start, x, dy, counts)
    }

    /// `x_e · w[e]` for every expert; `Autodiff<B>` records one node whose backward is
    /// [`grouped_gemm`](Self::grouped_gemm) with `wᵀ` and
    /// [`grouped_weight_gradient`](Self::grouped_weight_gradient).
    ///
    /// # Shapes
    /// - `x`: `[n, k]`
    /// - `w`: `[experts, k, m]`
    /// - output: `[n, m]`
    fn grouped_linear(x: Tensor<Self, 2>, w: Tensor<Self, 3>, counts: &[usize]) -> Tensor<Self, 2> {
        Self::grouped_gemm(x, w, counts, false)
    }

    /// The rows every expert's block is padded to (with zero rows) before the products, or
    /// `None` to run them on the blocks as they are. Blocks of one size run as one
    /// strided-batched GEMM on our CUDA backend, where many small experts' blocks of
    /// different sizes take cuBLAS's grouped GEMM, at the price of the padding's rows. The
    /// default pads nothing; our CUDA backend pads by [`padded_block_rows`].
    fn padded_block_rows(counts: &[usize]) -> Option<usize> {
        let _ = counts;
        None
    }

    /// [`grouped_linear`](Self::grouped_linear) whose weight gradient the backward pass first
    /// offers to `hook` ([`BackwardHook::take_weight_gradient`]). Only `Autodiff` has a
    /// gradient to offer: the default is the plain product.
    fn hooked_grouped_linear(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 3>,
        counts: &[usize],
        hook: &Arc<dyn BackwardHook>,
    ) -> Tensor<Self, 2> {
        let _ = hook;
        Self::grouped_linear(x, w, counts)
    }
}

/// `x_e · w[e]` for every local expert `e`, its `counts[e]` rows of `x` after those of experts
/// `0..e`: [`GroupedLinearOps::grouped_linear`] after checking the shapes.
///
/// # Shapes
/// - `x`: `[Σ counts, k]`
/// - `w`: `[counts.len(), k, m]`
/// - output: `[Σ counts, m]`
///
/// # Panics
/// If the shapes and the counts disagree.
pub fn grouped_linear<B: GroupedLinearOps>(
    x: Tensor<B, 2>,
    w: Tensor<B, 3>,
    counts: &[usize],
) -> Tensor<B, 2> {
    hooked_grouped_linear(x, w, counts, None)
}

/// [`grouped_linear`] whose weights' gradient is offered to `hook` in the backward pass
/// ([`BackwardHook::take_weight_gradient`]): the experts of a model whose hook sums gradients
/// in a flat f32 buffer ([`GradReduceOverlap`](crate::distributed::GradReduceOverlap)) let
/// the weight-gradient products accumulate there.
///
/// # Shapes
/// As [`grouped_linear`].
///
/// # Panics
/// If the shapes and the counts disagree.
pub fn hooked_grouped_linear<B: GroupedLinearOps>(
    x: Tensor<B, 2>,
    w: Tensor<B, 3>,
    counts: &[usize],
    hook: Option<&Arc<dyn BackwardHook>>,
) -> Tensor<B, 2> {
    let ([n, k], [experts, w_k, _]) = (x.dims(), w.dims());
    assert_eq!(
        counts.len(),
        experts,
        "grouped_linear: {} counts for {experts} experts",
        counts.len()
    );
    let total: usize = counts.iter().sum();
    assert_eq!(
        total, n,
        "grouped_linear: the counts add up to {total}, the tokens have {n} rows"
    );
    assert_eq!(
        k, w_k,
        "grouped_linear: tokens of width {k}, weights of input width {w_k}"
    );
    match hook {
        Some(hook) => B::hooked_grouped_linear(x, w, counts, hook),
        None => B::grouped_linear(x, w, counts),
    }
}

/// Rows a padded block is a multiple of: 16 bytes of bf16, so that every block starts
/// aligned for cuBLASLt.
pub const PADDED_ROWS_MULTIPLE: usize = 8;

/// The rows to pad every block to where that costs at most `most_rows` times the rows
/// (`counts`' sum, at least one): the largest count rounded up to
/// [`PADDED_ROWS_MULTIPLE`]; `None` for fewer than two experts, or where the padding costs
/// more.
pub fn padded_block_rows(counts: &[usize], most_rows: f64) -> Option<usize> {
    let total: usize = counts.iter().sum();
    let largest = counts.iter().copied().max()?;
    let rows = largest
        .next_multiple_of(PADDED_ROWS_MULTIPLE)
        .max(PADDED_ROWS_MULTIPLE);
    let padded = rows * counts.len();
    (counts.len() >= 2 && total > 0 && padded as f64 <= most_rows * total as f64).then_some(rows)
}

/// Expert `e`'s matrix of stacked weights `[experts, rows, cols]`.
fn matrix<B: Backend>(w: &Tensor<B, 3>, e: usize) -> Tensor<B, 2> {
    let [_, rows, cols] = w.dims();
    w.clone().narrow(0, e, 1).reshape([rows, cols])
}

/// `(expert, first row, rows)` of every expert with rows.
fn blocks(counts: &[usize]) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    counts
        .iter()
        .scan(0, |start, &count| {
            let block = (*start, count);
            *start += count;
            Some(block)
        })
        .enumerate()
        .filter(|(_, (_, count))| *count > 0)
        .map(|(e, (start, count))| (e, start, count))
}

/// [`GroupedLinearOps::grouped_gemm`] as one [`LinearOps::gemm`] per expert with rows: the
/// composition, and the fallback where a grouped GEMM cannot take the operands.
pub fn per_expert_gemm<B: LinearOps>(
    x: Tensor<B, 2>,
    w: Tensor<B, 3>,
    counts: &[usize],
    transpose_w: bool,
) -> Tensor<B, 2> {
    let [_, rows, cols] = w.dims();
    let mut products: Vec<_> = blocks(counts)
        .map(|(e, start, count)| {
            B::gemm(
                x.clone().narrow(0, start, count),
                matrix(&w, e),
                false,
                transpose_w,
            )
        })
        .collect();
    match products.len() {
        0 => {
            let width = if transpose_w { rows } else { cols };
            Tensor::zeros([0, width], (&x.device(), x.dtype()))
        }
        // One expert with rows has them all: its product is the output.
        1 => products.remove(0),
        _ => Tensor::cat(products, 0),
    }
}

/// [`GroupedLinearOps::grouped_weight_gradient`] as one [`LinearOps::gemm`] per expert with
/// rows and zeros for the others: the composition, and the fallback.
pub fn per_expert_weight_gradient<B: LinearOps>(
    x: Tensor<B, 2>,
    dy: Tensor<B, 2>,
    counts: &[usize],
) -> Tensor<B, 3> {
    let ([_, k], [_, m]) = (x.dims(), dy.dims());
    let mut grads: Vec<Option<Tensor<B, 2>>> = vec![None; counts.len()];
    for (e, start, count) in blocks(counts) {
        let rows = |t: &Tensor<B, 2>| t.clone().narrow(0, start, count);
        grads[e] = Some(B::gemm(rows(&x), rows(&dy), true, false));
    }
    let grads: Vec<Tensor<B, 2>> = grads
        .into_iter()
        .map(|g| g.unwrap_or_else(|| Tensor::zeros([k, m], (&x.device(), x.dtype()))))
        .collect();
    match <[_; 1]>::try_from(grads) {
        // A stack of one is its matrix with a leading dimension, no copy.
        Ok([one]) => one.unsqueeze_dim(0),
        Err(grads) => Tensor::stack(grads, 0),
    }
}

/// [`GroupedLinearOps::grouped_weight_gradient_add_slot`] as the gradient
/// ([`GroupedLinearOps::grouped_weight_gradient`]) and its addition
/// ([`WriteSlotOps::add_slot`](super::WriteSlotOps::add_slot)).
pub fn grouped_weight_gradient_add_slot_composition<B: GroupedLinearOps>(
    buffer: Tensor<B, 1>,
    start: usize,
    x: Tensor<B, 2>,
    dy: Tensor<B, 2>,
    counts: &[usize],
) -> Tensor<B, 1> {
    add_to_slot(buffer, start, B::grouped_weight_gradient(x, dy, counts))
}

impl<B: GroupedLinearOps, C: CheckpointStrategy> GroupedLinearOps for Autodiff<B, C> {
    fn padded_block_rows(counts: &[usize]) -> Option<usize> {
        B::padded_block_rows(counts)
    }

    fn grouped_linear(x: Tensor<Self, 2>, w: Tensor<Self, 3>, counts: &[usize]) -> Tensor<Self, 2> {
        autodiff_grouped_linear::<B, C>(x, w, counts, None)
    }

    fn hooked_grouped_linear(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 3>,
        counts: &[usize],
        hook: &Arc<dyn BackwardHook>,
    ) -> Tensor<Self, 2> {
        autodiff_grouped_linear::<B, C>(x, w, counts, Some(hook.clone()))
    }
}

/// [`GroupedLinearOps::grouped_linear`] on `Autodiff<B>`: the inner backend's products and
/// one node storing `x`, `w` and the counts, which offers the weights' gradient to `hook` when
/// there is one.
fn autodiff_grouped_linear<B: GroupedLinearOps, C: CheckpointStrategy>(
    x: Tensor<Autodiff<B, C>, 2>,
    w: Tensor<Autodiff<B, C>, 3>,
    counts: &[usize],
    hook: Option<Arc<dyn BackwardHook>>,
) -> Tensor<Autodiff<B, C>, 2> {
    let (x, w) = (raw(x), raw(w));
    let output = B::grouped_linear(inner(&x), inner(&w), counts);
    let state = (x.primitive.clone(), w.primitive.clone(), counts.to_vec());
    wrap(record::<B, C, _>(
        GroupedLinearBackward { hook },
        &[&x, &w],
        state,
        raw(output),
    ))
}

/// The backward of `y_e = x_e · w[e]`: `dx = grouped(dy, wᵀ)`, `dw[e] = x_eᵀ · dy_e` (first
/// offered to `hook`, [`BackwardHook::take_weight_gradient`]). Its parents are `[x, w]`.
#[derive(Debug)]
struct GroupedLinearBackward {
    hook: Option<Arc<dyn BackwardHook>>,
}

/// The weights' gradient of [`GroupedLinearBackward`], offered to a hook before it is
/// computed.
struct ExpertsWeightProduct<B: GroupedLinearOps> {
    x: Tensor<B, 2>,
    dy: Tensor<B, 2>,
    counts: Vec<usize>,
}

impl<B: GroupedLinearOps> WeightGradient for ExpertsWeightProduct<B> {
    fn shape(&self) -> Vec<usize> {
        vec![self.counts.len(), self.x.dims()[1], self.dy.dims()[1]]
    }

    fn add_to(
        &mut self,
        buffer: Box<dyn Any + Send>,
        start: usize,
    ) -> Result<Box<dyn Any + Send>, Box<dyn Any + Send>> {
        let buffer = buffer.downcast::<Tensor<B, 1>>()?;
        Ok(Box::new(B::grouped_weight_gradient_add_slot(
            *buffer,
            start,
            self.x.clone(),
            self.dy.clone(),
            &self.counts,
        )))
    }
}

impl<B: GroupedLinearOps> BackwardStep<B> for GroupedLinearBackward {
    type State = (FloatTensor<B>, FloatTensor<B>, Vec<usize>);

    fn backward(
        self,
        dy: FloatTensor<B>,
        (x, w, counts): <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        let dy = wrap::<B, 2>(dy);
        register(grads, parent(parents, 0), || {
            B::grouped_gemm(dy.clone(), wrap(w), &counts, true)
        });
        let mut weight = ExpertsWeightProduct {
            x: wrap(x),
            dy,
            counts,
        };
        let taken = match (&self.hook, parent(parents, 1)) {
            (Some(hook), Some(node)) => hook.take_weight_gradient(node, &mut weight),
            _ => false,
        };
        if !taken {
            let ExpertsWeightProduct { x, dy, counts } = weight;
            register(grads, parent(parents, 1), || {
                B::grouped_weight_gradient(x, dy, &counts)
            });
        }
    }
}

/// Our CUDA backend: every product of a layer's experts as one foreign operation in stream
/// order (`burn_megatron_kernels::cuda::grouped_gemm`), by the engine `engine` picks; the
/// per-expert loop where cuBLAS cannot take the operands. burn-cuda keeps the loop.
#[cfg(feature = "cuda")]
mod cuda {
    use burn::tensor::Tensor;
    use burn_cubecl::cubecl::cuda::CudaRuntime;
    use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
    use burn_megatron_kernels::cuda::MegatronCudaRuntime;
    use burn_megatron_kernels::cuda::grouped_gemm::{self, Engine};

    use super::{
        GroupedLinearOps, grouped_weight_gradient_add_slot_composition, padded_block_rows,
        per_expert_gemm, per_expert_weight_gradient,
    };
    use crate::ops::primitive::{raw, wrap};

    /// Streams of [`Engine::Streams`] for layers of few experts, unless `BM_GROUPED_GEMM`
    /// says otherwise.
    const STREAMS: usize = 2;

    /// Local experts above which a layer's products take cuBLAS's grouped GEMM.
    const GROUPED_ABOVE_EXPERTS: usize = 8;

    /// The engine of a layer with `experts` local experts: `BM_GROUPED_GEMM` = `grouped`,
    /// `streams` or `streams:N` forces one (read once); else cuBLAS's grouped GEMM for more
    /// than 8 local experts, cuBLASLt GEMMs on 2 streams for fewer. Measured on an H200 (book
    /// "Benchmarks", 2026-11-29): 8 Mixtral-like experts of 800-3 300 rows ran at 0.98-1.17 of
    /// a dense GEMM's TFLOP/s on 2 streams (fwd + bwd 688-721 TFLOP/s), against 0.4-0.9
    /// grouped; 32 and 64 DeepSeek-like experts of 64-660 rows at 210-275 TFLOP/s grouped,
    /// where the GEMMs on streams, about 11 µs of host time each, ran at 100-140 with 64
    /// experts; the DeepSeek-like preset on one GPU trained at 39.3k tokens/s grouped and
    /// 37.2-37.8k on streams.
    fn engine(experts: usize) -> Engine {
        static FORCED: std::sync::OnceLock<Option<Engine>> = std::sync::OnceLock::new();
        let forced = FORCED.get_or_init(|| {
            let value = std::env::var("BM_GROUPED_GEMM").ok()?;
            match value.as_str() {
                "grouped" => Some(Engine::Grouped),
                "streams" => Some(Engine::Streams(STREAMS)),
                other => match other.strip_prefix("streams:").map(str::parse) {
                    Some(Ok(n)) if n >= 1 => Some(Engine::Streams(n)),
                    _ => panic!("BM_GROUPED_GEMM={other}: expected grouped, streams or streams:N"),
                },
            }
        });
        forced.unwrap_or(match experts > GROUPED_ABOVE_EXPERTS {
            true => Engine::Grouped,
            false => Engine::Streams(STREAMS),
        })
    }

    /// The most rows a padded layer may run, as a multiple of its tokens' rows. Measured on an
    /// H200 (book "Mixture of experts", 2026-11-29): 64 DeepSeek-like experts padded to 1.71
    /// times their rows ran their three products at 331 TFLOP/s of real work, against 143-151
    /// by cuBLAS's grouped GEMM, so padding pays well past 2; the bound keeps the padded
    /// activations' memory within twice the rows'.
    const MOST_PADDED_ROWS: f64 = 2.0;

    /// Whether the layers of more than 8 local experts pad their blocks: `BM_EXPERT_PADDING`
    /// = `off` says no (read once), for measuring.
    fn padding_on() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| match std::env::var("BM_EXPERT_PADDING").as_deref() {
            Err(_) | Ok("auto") => true,
            Ok("off") => false,
            Ok(other) => panic!("BM_EXPERT_PADDING={other}: expected auto or off"),
        })
    }

    impl<F: FloatElement, I: IntElement, BT: BoolElement> GroupedLinearOps
        for CubeBackend<MegatronCudaRuntime, F, I, BT>
    {
        /// Layers of more than 8 local experts pad their blocks to one size (one strided-batched
        /// cuBLASLt GEMM a product) where that at most doubles the rows.
        fn padded_block_rows(counts: &[usize]) -> Option<usize> {
            let many = counts.len() > GROUPED_ABOVE_EXPERTS;
            match many && padding_on() {
                true => padded_block_rows(counts, MOST_PADDED_ROWS),
                false => None,
            }
        }

        /// The products by the engine `engine` picks; the composition where cuBLAS cannot
        /// take the operands.
        fn grouped_gemm(
            x: Tensor<Self, 2>,
            w: Tensor<Self, 3>,
            counts: &[usize],
            transpose_w: bool,
        ) -> Tensor<Self, 2> {
            let engine = engine(counts.len());
            match grouped_gemm::grouped_gemm(
                &raw(x.clone()),
                &raw(w.clone()),
                counts,
                transpose_w,
                engine,
            ) {
                Ok(y) => wrap(y),
                Err(_) => per_expert_gemm(x, w, counts, transpose_w),
            }
        }

        fn grouped_weight_gradient(
            x: Tensor<Self, 2>,
            dy: Tensor<Self, 2>,
            counts: &[usize],
        ) -> Tensor<Self, 3> {
            let engine = engine(counts.len());
            match grouped_gemm::grouped_weight_gradient(
                &raw(x.clone()),
                &raw(dy.clone()),
                counts,
                engine,
            ) {
                Ok(dw) => wrap(dw),
                Err(_) => per_expert_weight_gradient(x, dy, counts),
            }
        }

        /// The products accumulating into the slot in place (beta 1, f32), by the engine
        /// `engine` picks, where the buffer is ours alone; else the gradient and its addition.
        fn grouped_weight_gradient_add_slot(
            buffer: Tensor<Self, 1>,
            start: usize,
            x: Tensor<Self, 2>,
            dy: Tensor<Self, 2>,
            counts: &[usize],
        ) -> Tensor<Self, 1> {
            let into = raw(buffer);
            match grouped_gemm::grouped_weight_gradient_accumulate_at(
                &raw(x.clone()),
                &raw(dy.clone()),
                counts,
                engine(counts.len()),
                &into,
                start,
            ) {
                Ok(()) => wrap(into),
                Err(_) => {
                    grouped_weight_gradient_add_slot_composition(wrap(into), start, x, dy, counts)
                }
            }
        }
    }

    impl<F: FloatElement, I: IntElement, BT: BoolElement> GroupedLinearOps
        for CubeBackend<CudaRuntime, F, I, BT>
    {
    }
}

/// wgpu: the per-expert loop.
#[cfg(feature = "wgpu")]
impl<F, I, BT> GroupedLinearOps
    for burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, F, I, BT>
where
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}
