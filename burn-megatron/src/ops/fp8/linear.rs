//! The FP8 linear layer, `x · w + bias` through FP8 GEMMs, as one autodiff operation.
//!
//! Forward: `y = fp8_gemm(q(x), q(w)ᵀ) + bias`. Backward: `dx = fp8_gemm(q(dy), q(w))`,
//! `dw = fp8_gemm(q(x)ᵀ, q(dy)ᵀ)`, `db = Σ_tokens dy` in the model's dtype. Every GEMM gets
//! its operands K-contiguous (cuBLASLt's FP8 GEMM takes only the "TN" layout): with `x:
//! [tokens, d_in]` and `w: [d_in, d_out]` (Burn's layout), the forward casts `w` transposed
//! (`[d_out, d_in]`), `dx` takes `w` as it is (`[d_in, d_out]`, K = d_out), and `dw` takes
//! `x` and `dy` transposed (K = tokens). Activations and weights are E4M3; output gradients
//! E5M2 (`hybrid`) or E4M3 (`e4m3`).
//!
//! Where an operand is cast in both layouts (`x` when the weight needs a gradient, `w` when
//! the input does, `dy` when both do), both come from one cast ([`Fp8Ops::fp8_quantize_both`],
//! one read of the operand on our CUDA backend). The node keeps the transposed cast of `x` (one
//! byte an element on a GPU, against two for bf16) and the row-major cast of `w` (one byte a
//! weight, made with the forward's transposed cast, so `dx` sees the forward's quantised
//! weight), with their scales.
//!
//! Each scale comes from an amax ([`Fp8Config::recipe`]): the tensor's own
//! ([`Fp8Recipe::Tensorwise`], an amax pass before the casts) or a history of earlier ones
//! ([`Fp8Recipe::Delayed`], where this use's amax, only recorded, comes from the casts'
//! pass: [`Fp8Ops::fp8_quantize_both_amax`]). Where a
//! rank holds only part of a tensor ([`Fp8Split`]: a column-parallel weight and output
//! gradient, a row-parallel weight and input), its amax is the maximum over the
//! tensor-parallel group (one `[n]` all-reduce for the forward's operands, one `[1]` for the
//! gradient), so that every rank casts with the scale one device would use and TP = k equals
//! TP = 1. Under context parallelism ([`Fp8Linear::with_sequence_group`]) each rank holds part
//! of the sequence, so the amaxes of the input and of the output gradient are reduced over
//! the context-parallel group too, and CP = k equals CP = 1. A NaN amax is sent as +∞ (a
//! maximum over ranks then keeps it whatever the transport's NaN rule), and a non-finite amax
//! never becomes a scale.
//!
//! The weight's cast (amax, reduction, scale, both layouts) is kept in the layer until the
//! weight tensor is replaced ([`Fp8Config::cache_weights`]): the microbatches of one
//! optimizer step and a recomputed forward reuse it. The key is the weight's autodiff node,
//! which an optimizer step, a checkpoint load or any other new value replaces, so no
//! optimizer has to tell the layer. Under tensorwise scaling the cached copy is the one a
//! fresh cast of the same tensor gives. Under delayed scaling it is the cast of the first
//! forward pass after the weight changed, with that pass's scale, and the weight's amax is
//! recorded once per copy: Transformer Engine's FP8 weights cached after the first
//! microbatch (`is_first_microbatch`). Without the cache every forward casts the weight and,
//! under delayed scaling, records its amax.
//!
//! [`Fp8Config::backward`] runs the input gradient's or the weight gradient's GEMM (or both)
//! in the model's dtype on the unquantised `w` or `x`, which the node then keeps instead of
//! the FP8 layout (Transformer Engine's `override_linear_precision`): a diagnosis of which
//! GEMM a run's loss is sensitive to.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorData};
use burn_autodiff::NodeId;
use burn_autodiff::checkpoint::strategy::CheckpointStrategy;
use burn_autodiff::grads::Gradients;
use burn_megatron_dist::{DeviceTransport, DistError, DistResult, ProcessGroup, ReduceOp};

use super::scaling::{
    DelayedData, DelayedScaling, Fp8Config, Fp8Recipe, history_amaxes, scales_from_amaxes,
};
use super::{Fp8Blocks, Fp8Dtype, Fp8Ops, check_blockwise_shape};
use crate::error::DeviceError;
use crate::ops::autodiff::{BackwardStep, inner, parent, record, register};
use crate::ops::backward_hook::{BackwardHook, WeightGradient};
use crate::ops::linear::WeightProduct;
use crate::ops::primitive::{raw, wrap};
use crate::ops::write_slot::{WriteSlotOps, add_to_slot};

/// Which operands of an FP8 linear layer each rank holds only a part of, so that their amax
/// is reduced (maximum) over the layer's tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fp8Split {
    /// The input `x` is split by features (a row-parallel layer's).
    pub input: bool,
    /// The weight is split (always, in a tensor-parallel layer).
    pub weight: bool,
    /// The output gradient `dy` is split by features (a column-parallel layer's).
    pub grad_output: bool,
}

impl Fp8Split {
    /// Nothing split: a layer on one rank.
    pub const NONE: Self = Self {
        input: false,
        weight: false,
        grad_output: false,
    };
    /// A column-parallel layer: the weight's columns and so the output (and its gradient)
    /// split; the input is whole (copied or gathered into the region).
    pub const COLUMN_PARALLEL: Self = Self {
        input: false,
        weight: true,
        grad_output: true,
    };
    /// A row-parallel layer: the weight's rows and the input's features split; the output's
    /// gradient is whole (the backward of the reduction is a copy or an all-gather).
    pub const ROW_PARALLEL: Self = Self {
        input: true,
        weight: true,
        grad_output: false,
    };
}

/// The operands that get a scale, in the order of a state's array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operand {
    Input = 0,
    Weight = 1,
    GradOutput = 2,
}

/// The delayed-scaling states of one layer, `[input, weight, grad_output]`, keyed by the
/// backend they were made on (see [`Fp8Linear`]), and the states restored from a checkpoint
/// that the next first use on a backend starts from.
#[derive(Default)]
struct DelayedStates {
    by_backend: HashMap<TypeId, Box<dyn BackendStates>>,
    restored: Option<[DelayedData; 3]>,
}

/// A backend's `[DelayedScaling<B>; 3]`, readable to the host without naming `B` (a
/// checkpoint reads the layers' states from a model whose backend is the autodiff one).
trait BackendStates: Any + Send {
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
    fn to_data(&self) -> Result<[DelayedData; 3], DeviceError>;
}

impl<B: Backend> BackendStates for [DelayedScaling<B>; 3] {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }

    fn to_data(&self) -> Result<[DelayedData; 3], DeviceError> {
        let [input, weight, grad_output] = self;
        Ok([input.to_data()?, weight.to_data()?, grad_output.to_data()?])
    }
}

/// A cast's scale (`[1]` f32: the values are multiplied by it before rounding) and its
/// reciprocal (the FP8 GEMM multiplies its product by the operands' reciprocals), made
/// together so that no GEMM launches a division.
#[derive(Clone)]
struct Scale<B: Backend> {
    scale: Tensor<B, 1>,
    inv: Tensor<B, 1>,
}

/// A weight's cast as the forward pass and the input gradient use it: its scale, its
/// row-major copy (`[d_in, d_out]`, for `dx`; `None` where nothing needs it) and its
/// transposed one (`[d_out, d_in]`, for the forward GEMM). Under blockwise scaling `scale`
/// holds the transposed copy's reciprocal block scales (in both fields) and `row_inv` the
/// row-major copy's (the same squares, laid out for that copy).
#[derive(Clone)]
struct WeightCast<B: Backend> {
    scale: Scale<B>,
    row: Option<Tensor<B, 2>>,
    row_inv: Option<Tensor<B, 1>>,
    transposed: Tensor<B, 2>,
}

/// One cached weight cast: the weight's autodiff node (held weakly: a dead node's id never
/// comes back, so its entry is dropped) and the cast, a `WeightCast` of the inner backend.
struct CachedWeight {
    id: NodeId,
    node: Weak<dyn Any + Send + Sync>,
    cast: Box<dyn Any + Send>,
}

/// The weight casts of one layer, one per live weight tensor it has cast (one, unless clones
/// of the module on several ranks share the layer).
type WeightCache = Vec<CachedWeight>;

/// One linear layer's FP8 settings and state: the [`Fp8Config`], the tensor-parallel group
/// and which operands are split over it, and (delayed scaling) the amax histories and scales
/// of its input, weight and output gradient.
///
/// Cloning shares the state: a module's clone (Burn's optimizers return the model they step,
/// `valid()` gives the inference copy) goes on with the same histories.
///
/// The state sits behind a mutex rather than in the module's parameters because it changes in
/// places where the module cannot be borrowed mutably: in the forward pass (`&self`, and a
/// pipeline schedule may run it on a shared model) and in the backward pass, inside Burn's
/// graph, where the output gradient's amax is recorded. It is keyed by the backend type the
/// tensors are on (the inner backend under `Autodiff`, so that the training model and its
/// `valid()` copy share one history) and made on first use on the input's device.
#[derive(Clone)]
pub struct Fp8Linear {
    config: Fp8Config,
    group: Option<ProcessGroup>,
    /// The context-parallel group: the tokens, so the input and the output gradient, are
    /// split over it.
    sequence: Option<ProcessGroup>,
    split: Fp8Split,
    delayed: Arc<Mutex<DelayedStates>>,
    weights: Arc<Mutex<WeightCache>>,
}

impl fmt::Debug for Fp8Linear {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fp8Linear")
            .field("config", &self.config)
            .field("group", &self.group.as_ref().map(|g| g.ranks().to_vec()))
            .field(
                "sequence",
                &self.sequence.as_ref().map(|g| g.ranks().to_vec()),
            )
            .field("split", &self.split)
            .finish_non_exhaustive()
    }
}

impl Fp8Linear {
    /// A layer's FP8 state: `config`, and the `group` over which the amaxes of the operands
    /// that `split` names are reduced (`None`: nothing is reduced).
    pub fn new(config: Fp8Config, group: Option<&ProcessGroup>, split: Fp8Split) -> Self {
        Self {
            config,
            group: group.cloned(),
            sequence: None,
            split,
            delayed: Arc::default(),
            weights: Arc::default(),
        }
    }

    /// The same layer (sharing its state) whose tokens are split over `sequence` (the
    /// context-parallel group; `None` or one rank: not split): the amaxes of its input and of
    /// its output gradient are then reduced over that group as well.
    pub fn with_sequence_group(self, sequence: Option<&ProcessGroup>) -> Self {
        Self {
            sequence: sequence.filter(|group| group.size() > 1).cloned(),
            ..self
        }
    }

    /// The settings.
    pub fn config(&self) -> &Fp8Config {
        &self.config
    }

    /// The delayed-scaling states `[input, weight, grad_output]` as kept for backend `B` (the
    /// inner backend of an `Autodiff` model); `None` before the layer's first use on `B` and
    /// under tensorwise scaling.
    pub fn delayed_states<B: Backend>(&self) -> Option<[DelayedScaling<B>; 3]> {
        let states = self.delayed.lock().unwrap_or_else(PoisonError::into_inner);
        states
            .by_backend
            .get(&TypeId::of::<B>())
            .and_then(|s| s.as_any().downcast_ref::<[DelayedScaling<B>; 3]>())
            .cloned()
    }

    /// The delayed-scaling states `[input, weight, grad_output]` on the host, for a
    /// checkpoint: those of the backend the layer ran on, or the restored ones it has not
    /// used yet; `None` if it has neither (tensorwise scaling, or never run). Reads the device.
    pub fn delayed_data(&self) -> Result<Option<[DelayedData; 3]>, DeviceError> {
        let states = self.delayed.lock().unwrap_or_else(PoisonError::into_inner);
        match states.by_backend.values().next() {
            Some(live) => live.to_data().map(Some),
            None => Ok(states.restored.clone()),
        }
    }

    /// Replaces the delayed-scaling states by `states` (`[input, weight, grad_output]`, a
    /// checkpoint's): the layer's next cast starts from them, on the device of its input,
    /// their histories cut or padded to `--fp8-amax-history-len`.
    pub fn restore_delayed(&self, states: [DelayedData; 3]) {
        let mut delayed = self.delayed.lock().unwrap_or_else(PoisonError::into_inner);
        delayed.by_backend.clear();
        delayed.restored = Some(states);
    }

    /// Replaces the delayed-scaling states `[input, weight, grad_output]` on backend `B` by
    /// `states` (e.g. reduced over the data-parallel ranks). No-op where the layer has no
    /// states on `B` yet.
    pub fn set_delayed_states<B: Backend>(&self, states: [DelayedScaling<B>; 3]) {
        let mut delayed = self.delayed.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(live) = delayed.by_backend.get_mut(&TypeId::of::<B>())
            && let Some(live) = live.as_any_mut().downcast_mut::<[DelayedScaling<B>; 3]>()
        {
            *live = states;
        }
    }

    /// Runs `f` on the delayed-scaling state of `operand`, made on `device` if there is none.
    fn with_state<B: Backend, T>(
        &self,
        operand: Operand,
        device: &B::Device,
        f: impl FnOnce(&mut DelayedScaling<B>) -> T,
    ) -> T {
        let mut states = self.delayed.lock().unwrap_or_else(PoisonError::into_inner);
        let DelayedStates {
            by_backend,
            restored,
        } = &mut *states;
        let entry = by_backend.entry(TypeId::of::<B>()).or_insert_with(|| {
            let len = self.config.amax_history_len;
            Box::new(match restored {
                Some(data) => data
                    .each_ref()
                    .map(|d| DelayedScaling::<B>::from_data(d, len, device)),
                None => [0, 1, 2].map(|_| DelayedScaling::<B>::new(len, device)),
            })
        });
        let state = entry
            .as_any_mut()
            .downcast_mut::<[DelayedScaling<B>; 3]>()
            .expect("the states under a backend's type id are that backend's");
        f(&mut state[operand as usize])
    }

    /// How many weight tensors' FP8 casts the layer keeps now (those of weights that still
    /// exist): one while a model trains with [`Fp8Config::cache_weights`], none without.
    pub fn cached_weights(&self) -> usize {
        let cache = self.weights.lock().unwrap_or_else(PoisonError::into_inner);
        cache
            .iter()
            .filter(|entry| entry.node.strong_count() > 0)
            .count()
    }

    /// Whether the weight's cast is kept until the weight is replaced
    /// ([`Fp8Config::cache_weights`]).
    fn caches_weights(&self) -> bool {
        self.config.cache_weights
    }

    /// The cast kept for the weight whose autodiff node is `id`, if any; drops the entries of
    /// weights that no longer exist.
    fn cached_weight<B: Backend>(&self, id: NodeId) -> Option<WeightCast<B>> {
        let mut cache = self.weights.lock().unwrap_or_else(PoisonError::into_inner);
        cache.retain(|entry| entry.node.strong_count() > 0);
        cache
            .iter()
            .find(|entry| entry.id == id)
            .and_then(|entry| entry.cast.downcast_ref::<WeightCast<B>>())
            .cloned()
    }

    /// Keeps `cast` for the weight whose autodiff node is `node` (`id`).
    fn store_weight<B: Backend>(
        &self,
        id: NodeId,
        node: Weak<dyn Any + Send + Sync>,
        cast: WeightCast<B>,
    ) {
        let mut cache = self.weights.lock().unwrap_or_else(PoisonError::into_inner);
        cache.retain(|entry| entry.id != id && entry.node.strong_count() > 0);
        cache.push(CachedWeight {
            id,
            node,
            cast: Box::new(cast),
        });
    }

    /// Whether the scales come from histories (delayed scaling), so that the amaxes are only
    /// recorded, after the casts that can compute them.
    fn delayed(&self) -> bool {
        self.config.recipe == Fp8Recipe::Delayed
    }

    /// Whether each block of a tensor has its own scale (blockwise scaling): no amax is
    /// reduced or recorded.
    fn blockwise(&self) -> bool {
        self.config.recipe == Fp8Recipe::Blockwise
    }

    /// The scale of `operand`'s cast to `dtype` under tensorwise scaling, from its (reduced)
    /// `amax`, and its reciprocal.
    fn tensorwise_scale<B: Fp8Ops>(&self, amax: Tensor<B, 1>, dtype: Fp8Dtype) -> Scale<B> {
        let (scale, inv) = B::fp8_tensorwise_scale(amax, dtype, self.config.margin);
        Scale { scale, inv }
    }

    /// The groups over which `operand`'s amax is reduced, in the order of the reductions:
    /// the tensor-parallel group where [`Fp8Split`] says the operand is split over it, then
    /// the context-parallel group for the input and the output gradient (the tokens').
    fn groups(&self, operand: Operand) -> impl Iterator<Item = &ProcessGroup> {
        let split = match operand {
            Operand::Input => self.split.input,
            Operand::Weight => self.split.weight,
            Operand::GradOutput => self.split.grad_output,
        };
        let tp = self.group.as_ref().filter(|g| split && g.size() > 1);
        let sequence = self
            .sequence
            .as_ref()
            .filter(|_| operand != Operand::Weight);
        tp.into_iter().chain(sequence)
    }

    /// Whether `operand`'s amax is reduced over a group (of more than one rank).
    fn reduces(&self, operand: Operand) -> bool {
        self.groups(operand).next().is_some()
    }

    /// `x`'s amax (reduced over `operand`'s groups), and the tensorwise scale of its
    /// cast to `dtype` with its reciprocal; without a reduction in the amax's own launches.
    fn tensorwise<B: Fp8Ops + DeviceTransport>(
        &self,
        x: &Tensor<B, 2>,
        operand: Operand,
        dtype: Fp8Dtype,
    ) -> DistResult<(Tensor<B, 1>, Scale<B>)> {
        if !self.reduces(operand) {
            let (amax, scale, inv) = B::fp8_amax_scale(x.clone(), dtype, self.config.margin);
            return Ok((amax, Scale { scale, inv }));
        }
        let [amax] = self.reduce_amaxes([(B::fp8_amax(x.clone()), operand)])?;
        Ok((amax.clone(), self.tensorwise_scale(amax, dtype)))
    }

    /// The scale of `operand`'s next cast under delayed scaling, from its history (made on
    /// `device` at first use), and its reciprocal.
    fn delayed_scale<B: Backend>(&self, operand: Operand, device: &B::Device) -> Scale<B> {
        let scale: Tensor<B, 1> = self.with_state(operand, device, |s| s.scale());
        Scale {
            inv: scale.clone().recip(),
            scale,
        }
    }

    /// Records `operand`'s (reduced) `amax` after its cast: delayed scaling's history update.
    fn record<B: Fp8Ops>(&self, operand: Operand, amax: Tensor<B, 1>, dtype: Fp8Dtype) {
        if self.config.recipe == Fp8Recipe::Delayed {
            let (margin, algo) = (self.config.margin, self.config.amax_compute_algo);
            self.with_state(operand, &amax.device(), |s| {
                s.record(amax, dtype, margin, algo)
            });
        }
    }

    /// The amaxes, each reduced (maximum) over its operand's [`groups`](Self::groups), one
    /// all-reduce a group for all of them, a NaN sent as +∞ there (the maximum of a NaN is
    /// undefined); with nothing to reduce, as they are.
    fn reduce_amaxes<B: DeviceTransport, const N: usize>(
        &self,
        amaxes: [(Tensor<B, 1>, Operand); N],
    ) -> DistResult<[Tensor<B, 1>; N]> {
        self.try_reduce_amaxes(amaxes).map_err(|(error, _)| error)
    }

    /// [`reduce_amaxes`](Self::reduce_amaxes), an error with the group whose all-reduce
    /// failed.
    fn try_reduce_amaxes<B: DeviceTransport, const N: usize>(
        &self,
        amaxes: [(Tensor<B, 1>, Operand); N],
    ) -> Result<[Tensor<B, 1>; N], (DistError, ProcessGroup)> {
        if !amaxes.iter().any(|(_, operand)| self.reduces(*operand)) {
            // Nothing to reduce: a NaN amax stays NaN, which every use treats as +∞ does
            // (no scale from it, nothing recorded), without two launches an amax.
            return Ok(amaxes.map(|(amax, _)| amax));
        }
        let operands = amaxes.each_ref().map(|(_, operand)| *operand);
        let mut amaxes = amaxes.map(|(amax, _)| {
            let nan = amax.clone().is_nan();
            amax.mask_fill(nan, f32::INFINITY)
        });
        for group in [self.group.as_ref(), self.sequence.as_ref()]
            .into_iter()
            .flatten()
        {
            let mine: Vec<usize> = (0..N)
                .filter(|&i| self.groups(operands[i]).any(|g| std::ptr::eq(g, group)))
                .collect();
            if mine.is_empty() {
                continue;
            }
            let local = Tensor::cat(mine.iter().map(|&i| amaxes[i].clone()).collect(), 0);
            let reduced = group
                .all_reduce(local, ReduceOp::Max)
                .map_err(|error| (error, group.clone()))?;
            for (j, &i) in mine.iter().enumerate() {
                amaxes[i] = reduced.clone().narrow(0, j, 1);
            }
        }
        Ok(amaxes)
    }
}

/// Makes the delayed-scaling states of `layers` the same on every rank of `group` (the
/// data-parallel group), unless their settings say `tp_only_amax_reduction`: each history
/// entry becomes its maximum over the group and each scale is computed again from its
/// history, as Transformer Engine's amax reduction over the data-parallel ranks does. Every
/// layer's histories and scales go in one all-reduce (on backend `B`, where they live; a scale
/// is kept only where its history holds no usable amax, which is then so on every rank, so its
/// maximum is it), and the scales are computed for all of them at once: a few launches, not a
/// few a layer (the gathering into one buffer and back still costs a few a state). The ranks
/// record their amaxes in step (the same layers, micro-batches and casts), so the entries
/// line up; a NaN amax, which a rank leaves out of its history, would shift that rank's
/// entries by one. Layers that have not run on `B` take no part.
pub fn reduce_delayed_states<'a, B: Backend + DeviceTransport>(
    layers: impl IntoIterator<Item = &'a Fp8Linear>,
    group: &ProcessGroup,
) -> DistResult<()> {
    if group.size() <= 1 {
        return Ok(());
    }
    let layers: Vec<_> = layers
        .into_iter()
        .filter_map(|fp8| fp8.delayed_states::<B>().map(|states| (fp8, states)))
        .collect();
    let Some((first, states)) = layers.first() else {
        return Ok(());
    };
    let config = first.config().clone();
    if config.tp_only_amax_reduction {
        return Ok(());
    }
    let len = states[0].history().dims()[0];
    if layers.iter().any(|(fp8, states)| {
        fp8.config() != &config || states.iter().any(|s| s.history().dims()[0] != len)
    }) {
        return Err(DistError::InvalidArgument(
            "FP8 layers of one model with different settings or history lengths: their \
             amax histories cannot be reduced together"
                .into(),
        ));
    }
    let n = 3 * layers.len();
    let all = layers.iter().flat_map(|(_, states)| states.iter());
    let pieces: Vec<Tensor<B, 1>> = (all.clone().map(|s| s.history()))
        .chain(all.map(|s| s.scale()))
        .collect();
    let reduced = group.all_reduce(Tensor::cat(pieces, 0), ReduceOp::Max)?;
    let histories = reduced.clone().narrow(0, 0, n * len).reshape([n, len]);
    let fallback = reduced.narrow(0, n * len, n);
    let amaxes = history_amaxes(histories.clone(), config.amax_compute_algo);
    let (forward, gradient) = (
        config.format.forward_dtype().max(),
        config.format.gradient_dtype().max(),
    );
    let tops: Vec<f32> = (0..layers.len())
        .flat_map(|_| [forward, forward, gradient])
        .collect();
    let device = amaxes.device();
    let tops = Tensor::<B, 1>::from_data(TensorData::new(tops, [n]), (&device, DType::F32));
    let scales = scales_from_amaxes(amaxes, fallback, tops, config.margin);
    for (j, (fp8, _)) in layers.iter().enumerate() {
        fp8.set_delayed_states([0, 1, 2].map(|o| {
            let i = 3 * j + o;
            DelayedScaling::from_tensors(
                histories.clone().narrow(0, i, 1).reshape([len]),
                scales.clone().narrow(0, i, 1),
            )
        }));
    }
    Ok(())
}

/// The FP8 linear layer as a backend operation: the forward alone on plain backends,
/// one autodiff node on `Autodiff<B>`.
pub trait Fp8LinearOps: Fp8Ops + DeviceTransport + WriteSlotOps {
    /// `x · w + bias` through FP8 GEMMs (see the [module docs](self)), for `x: [tokens,
    /// d_in]`, `w: [d_in, d_out]`, `bias: [d_out]`; the output has `x`'s dtype. Fails only
    /// if the amax reduction over the tensor-parallel group fails.
    fn fp8_linear(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
        fp8: &Fp8Linear,
    ) -> DistResult<Tensor<Self, 2>> {
        Ok(forward(x, Weight::Tensor(w), bias, fp8, Keep::default())?.output)
    }

    /// [`fp8_linear`](Self::fp8_linear) whose weight gradient the backward pass first offers
    /// to `hook` ([`BackwardHook::take_weight_gradient`]). Only `Autodiff` has a gradient to
    /// offer: the default is the plain forward.
    fn hooked_fp8_linear(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
        fp8: &Fp8Linear,
        hook: &Arc<dyn BackwardHook>,
    ) -> DistResult<Tensor<Self, 2>> {
        let _ = hook;
        Self::fp8_linear(x, w, bias, fp8)
    }

    /// `buffer` (`[numel]` f32) with the FP8 product `(a · bᵀ) · a_scale_inv · b_scale_inv`
    /// ([`Fp8Ops::fp8_gemm`], `[m, n]`) added row-major at `start..start + m · n`: the weight
    /// gradient summed into its slot of a flat f32 gradient buffer. The default computes the
    /// product in f32, then adds it ([`WriteSlotOps::add_slot`]); our CUDA backend runs one
    /// cuBLASLt FP8 GEMM that accumulates into the slot in place (beta 1, f32).
    #[allow(clippy::too_many_arguments)]
    fn fp8_gemm_add_slot(
        buffer: Tensor<Self, 1>,
        start: usize,
        a: Tensor<Self, 2>,
        a_dtype: Fp8Dtype,
        a_scale_inv: Tensor<Self, 1>,
        b: Tensor<Self, 2>,
        b_dtype: Fp8Dtype,
        b_scale_inv: Tensor<Self, 1>,
    ) -> Tensor<Self, 1> {
        let product = Self::fp8_gemm(a, a_dtype, a_scale_inv, b, b_dtype, b_scale_inv, DType::F32);
        add_to_slot(buffer, start, product)
    }
}

/// `x · w + bias` through FP8 GEMMs over the last dimension of an `x` of any rank (see the
/// [module docs](self)): flattened to `[tokens, d_in]` for [`Fp8LinearOps::fp8_linear`],
/// then reshaped back. Fails only if the amax reduction over the tensor-parallel group fails.
///
/// # Shapes
/// - `x`: `[..., d_in]`
/// - `w`: `[d_in, d_out]`
/// - `bias`: `[d_out]`
/// - output: `[..., d_out]`
pub fn fp8_linear<B: Fp8LinearOps, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    fp8: &Fp8Linear,
) -> DistResult<Tensor<B, D>> {
    hooked_fp8_linear(x, w, bias, fp8, None)
}

/// [`fp8_linear`] whose weight gradient is offered to `hook` in the backward pass
/// ([`BackwardHook::take_weight_gradient`]): with the overlap hook of the distributed
/// optimizer, the weight-gradient FP8 GEMM accumulates into its flat f32 buffer.
///
/// # Shapes
/// As [`fp8_linear`].
pub fn hooked_fp8_linear<B: Fp8LinearOps, const D: usize>(
    x: Tensor<B, D>,
    w: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
    fp8: &Fp8Linear,
    hook: Option<&Arc<dyn BackwardHook>>,
) -> DistResult<Tensor<B, D>> {
    let dims = x.dims();
    let d_out = w.dims()[1];
    let tokens: usize = dims[..D - 1].iter().product();
    let x = x.reshape([tokens, dims[D - 1]]);
    let y = match hook {
        Some(hook) => B::hooked_fp8_linear(x, w, bias, fp8, hook)?,
        None => B::fp8_linear(x, w, bias, fp8)?,
    };
    let mut out = dims;
    out[D - 1] = d_out;
    Ok(y.reshape(out))
}

/// The casts of one operand under one scale that the GEMMs need, and its amax where asked.
struct Casts<B: Backend> {
    row: Option<Tensor<B, 2>>,
    transposed: Option<Tensor<B, 2>>,
    amax: Option<Tensor<B, 1>>,
}

/// `x` cast under `scale` to `dtype`: row-major with `row`, transposed with `transposed`
/// (both: one [`Fp8Ops::fp8_quantize_both`] pass), and with `amax` its amax (from that pass
/// where both layouts are cast).
fn cast<B: Fp8Ops>(
    x: Tensor<B, 2>,
    scale: Tensor<B, 1>,
    dtype: Fp8Dtype,
    [row, transposed]: [bool; 2],
    amax: bool,
) -> Casts<B> {
    match (row && transposed, amax) {
        (true, true) => {
            let (row, transposed, amax) = B::fp8_quantize_both_amax(x, scale, dtype);
            Casts {
                row: Some(row),
                transposed: Some(transposed),
                amax: Some(amax),
            }
        }
        (true, false) => {
            let (row, transposed) = B::fp8_quantize_both(x, scale, dtype);
            Casts {
                row: Some(row),
                transposed: Some(transposed),
                amax: None,
            }
        }
        (false, _) => Casts {
            amax: amax.then(|| B::fp8_amax(x.clone())),
            row: row.then(|| B::fp8_quantize(x.clone(), scale.clone(), dtype, false)),
            transposed: transposed.then(|| B::fp8_quantize(x, scale, dtype, true)),
        },
    }
}

/// What the forward pass casts for the backward pass besides what its GEMM needs.
#[derive(Debug, Clone, Copy, Default)]
struct Keep {
    /// The transposed cast of `x` (the weight needs a gradient).
    x_transposed: bool,
    /// The row-major cast of `w` (the input needs a gradient).
    w_row: bool,
}

/// The weight as the forward pass gets it: the tensor, to be cast, or its cast kept from an
/// earlier forward pass.
enum Weight<B: Backend> {
    Tensor(Tensor<B, 2>),
    Cast(WeightCast<B>),
}

/// The forward pass on a plain backend: the output, and the scales and casts the backward
/// needs ([`Keep`]); `w` is the weight's cast, whole (for the cache).
struct Forward<B: Backend> {
    output: Tensor<B, 2>,
    /// The reciprocal scale(s) of `x_transposed`.
    x_scale_inv: Tensor<B, 1>,
    x_transposed: Option<Tensor<B, 2>>,
    w: WeightCast<B>,
}

/// [`Forward`] of either recipe, the bias added to the FP8 product.
fn forward<B: Fp8Ops + DeviceTransport>(
    x: Tensor<B, 2>,
    w: Weight<B>,
    bias: Option<Tensor<B, 1>>,
    fp8: &Fp8Linear,
    keep: Keep,
) -> DistResult<Forward<B>> {
    let f = match fp8.blockwise() {
        true => blockwise_forward(x, w, fp8, keep)?,
        false => scaled_forward(x, w, fp8, keep)?,
    };
    let output = match bias {
        Some(bias) => B::bias_add(f.output, bias),
        None => f.output,
    };
    Ok(Forward { output, ..f })
}

/// [`forward`]'s product under tensorwise or delayed scaling: one scale an operand, amaxes
/// reduced over their groups and, delayed, recorded.
fn scaled_forward<B: Fp8Ops + DeviceTransport>(
    x: Tensor<B, 2>,
    w: Weight<B>,
    fp8: &Fp8Linear,
    keep: Keep,
) -> DistResult<Forward<B>> {
    let dtype = fp8.config.format.forward_dtype();
    let out_dtype = x.dtype();
    let (x_layouts, w_layouts) = ([true, keep.x_transposed], [keep.w_row, true]);
    let (x_cast, x_amax, x_scale, w_cast, w_amax);
    match w {
        // The weight's amax was recorded with its cast.
        Weight::Cast(cast_before) if fp8.delayed() => {
            x_scale = fp8.delayed_scale(Operand::Input, &x.device());
            let mut x_c = cast(x, x_scale.scale.clone(), dtype, x_layouts, true);
            let [x_a] =
                fp8.reduce_amaxes([(x_c.amax.take().expect("asked for"), Operand::Input)])?;
            (x_cast, x_amax) = (x_c, x_a);
            (w_cast, w_amax) = (cast_before, None);
        }
        Weight::Cast(cast_before) => {
            (x_amax, x_scale) = fp8.tensorwise(&x, Operand::Input, dtype)?;
            x_cast = cast(x, x_scale.scale.clone(), dtype, x_layouts, false);
            (w_cast, w_amax) = (cast_before, None);
        }
        Weight::Tensor(w) if fp8.delayed() => {
            let device = x.device();
            x_scale = fp8.delayed_scale(Operand::Input, &device);
            let w_scale = fp8.delayed_scale(Operand::Weight, &device);
            let (mut x_c, mut w_c) = (
                cast(x, x_scale.scale.clone(), dtype, x_layouts, true),
                cast(w, w_scale.scale.clone(), dtype, w_layouts, true),
            );
            let [x_a, w_a] = fp8.reduce_amaxes([
                (x_c.amax.take().expect("asked for"), Operand::Input),
                (w_c.amax.take().expect("asked for"), Operand::Weight),
            ])?;
            (x_cast, x_amax, w_amax) = (x_c, x_a, Some(w_a));
            w_cast = WeightCast::new(w_c, w_scale);
        }
        Weight::Tensor(w) => {
            let (x_a, w_a, w_scale);
            if fp8.reduces(Operand::Input) || fp8.reduces(Operand::Weight) {
                // Both amaxes in one all-reduce a group.
                [x_a, w_a] = fp8.reduce_amaxes([
                    (B::fp8_amax(x.clone()), Operand::Input),
                    (B::fp8_amax(w.clone()), Operand::Weight),
                ])?;
                x_scale = fp8.tensorwise_scale(x_a.clone(), dtype);
                w_scale = fp8.tensorwise_scale(w_a.clone(), dtype);
            } else {
                (x_a, x_scale) = fp8.tensorwise(&x, Operand::Input, dtype)?;
                (w_a, w_scale) = fp8.tensorwise(&w, Operand::Weight, dtype)?;
            }
            x_cast = cast(x, x_scale.scale.clone(), dtype, x_layouts, false);
            w_cast = WeightCast::new(
                cast(w, w_scale.scale.clone(), dtype, w_layouts, false),
                w_scale,
            );
            (x_amax, w_amax) = (x_a, Some(w_a));
        }
    }
    let output = B::fp8_gemm(
        x_cast.row.expect("cast row-major"),
        dtype,
        x_scale.inv.clone(),
        w_cast.transposed.clone(),
        dtype,
        w_cast.scale.inv.clone(),
        out_dtype,
    );
    fp8.record(Operand::Input, x_amax, dtype);
    if let Some(w_amax) = w_amax {
        fp8.record(Operand::Weight, w_amax, dtype);
    }
    Ok(Forward {
        output,
        x_scale_inv: x_scale.inv,
        x_transposed: x_cast.transposed,
        w: w_cast,
    })
}

/// [`forward`]'s product under blockwise scaling: nothing to reduce or record. The input is cast
/// row-major in blocks along `d_in` for the forward GEMM and, where [`Keep`] asks, transposed
/// in blocks along the tokens for the weight gradient (two casts: their blocks differ); the
/// weight in 128 × 128 squares, transposed for the forward GEMM and row-major for `dx`.
fn blockwise_forward<B: Fp8Ops>(
    x: Tensor<B, 2>,
    w: Weight<B>,
    fp8: &Fp8Linear,
    keep: Keep,
) -> DistResult<Forward<B>> {
    let (dtype, margin) = (fp8.config.format.forward_dtype(), fp8.config.margin);
    let out_dtype = x.dtype();
    let blockwise_shape = |[rows, cols]: [usize; 2]| {
        check_blockwise_shape(rows, cols).map_err(DistError::InvalidArgument)
    };
    blockwise_shape(x.dims())?;
    let cast = |t: Tensor<B, 2>, blocks, transpose| {
        B::fp8_quantize_blockwise(t, dtype, blocks, margin, transpose)
    };
    let w = match w {
        Weight::Cast(cast_before) => cast_before,
        Weight::Tensor(w) => {
            blockwise_shape(w.dims())?;
            let ((row, row_inv), (transposed, inv)) = match keep.w_row {
                true => {
                    let [(row, row_inv), transposed] =
                        B::fp8_quantize_blockwise_both(w, dtype, Fp8Blocks::Square, margin);
                    ((Some(row), Some(row_inv)), transposed)
                }
                false => ((None, None), cast(w, Fp8Blocks::Square, true)),
            };
            WeightCast {
                scale: Scale {
                    scale: inv.clone(),
                    inv,
                },
                row,
                row_inv,
                transposed,
            }
        }
    };
    let ((x_row, x_row_inv), x_transposed, x_scale_inv) = match keep.x_transposed {
        true => {
            let [row, (x_t, inv)] =
                B::fp8_quantize_blockwise_both(x, dtype, Fp8Blocks::Row, margin);
            (row, Some(x_t), inv)
        }
        false => {
            let device = x.device();
            (
                cast(x, Fp8Blocks::Row, false),
                None,
                Tensor::empty([0], &device),
            )
        }
    };
    let output = B::fp8_gemm_blockwise(
        x_row,
        dtype,
        x_row_inv,
        Fp8Blocks::Row,
        w.transposed.clone(),
        dtype,
        w.scale.inv.clone(),
        Fp8Blocks::Square,
        out_dtype,
    );
    Ok(Forward {
        output,
        x_scale_inv,
        x_transposed,
        w,
    })
}

/// One of the layer's FP8 GEMMs, `a · bᵀ` scaled: [`Fp8Ops::fp8_gemm_blockwise`] with the
/// operands' blocks under blockwise scaling, else [`Fp8Ops::fp8_gemm`] (one scale each).
#[allow(clippy::too_many_arguments)]
fn fp8_product<B: Fp8Ops>(
    blocks: Option<[Fp8Blocks; 2]>,
    a: Tensor<B, 2>,
    a_dtype: Fp8Dtype,
    a_scale_inv: Tensor<B, 1>,
    b: Tensor<B, 2>,
    b_dtype: Fp8Dtype,
    b_scale_inv: Tensor<B, 1>,
    out: DType,
) -> Tensor<B, 2> {
    match blocks {
        Some([a_blocks, b_blocks]) => B::fp8_gemm_blockwise(
            a,
            a_dtype,
            a_scale_inv,
            a_blocks,
            b,
            b_dtype,
            b_scale_inv,
            b_blocks,
            out,
        ),
        None => B::fp8_gemm(a, a_dtype, a_scale_inv, b, b_dtype, b_scale_inv, out),
    }
}

impl<B: Backend> WeightCast<B> {
    /// The weight's casts under `scale` (the transposed one always made).
    fn new(casts: Casts<B>, scale: Scale<B>) -> Self {
        Self {
            scale,
            row: casts.row,
            row_inv: None,
            transposed: casts.transposed.expect("the forward GEMM's layout"),
        }
    }

    /// The reciprocal scale(s) of the row-major copy.
    fn row_scale_inv(&self) -> Tensor<B, 1> {
        self.row_inv
            .clone()
            .unwrap_or_else(|| self.scale.inv.clone())
    }
}

impl<B: Fp8LinearOps, C: CheckpointStrategy> Fp8LinearOps for Autodiff<B, C> {
    fn fp8_linear(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
        fp8: &Fp8Linear,
    ) -> DistResult<Tensor<Self, 2>> {
        autodiff_fp8_linear::<B, C>(x, w, bias, fp8, None)
    }

    fn hooked_fp8_linear(
        x: Tensor<Self, 2>,
        w: Tensor<Self, 2>,
        bias: Option<Tensor<Self, 1>>,
        fp8: &Fp8Linear,
        hook: &Arc<dyn BackwardHook>,
    ) -> DistResult<Tensor<Self, 2>> {
        autodiff_fp8_linear::<B, C>(x, w, bias, fp8, Some(hook.clone()))
    }
}

/// [`Fp8LinearOps::fp8_linear`] on `Autodiff<B>`: the inner backend's forward and one node
/// keeping `q(x)ᵀ`, `q(w)` and their scales, which offers the weight's gradient to `hook` when
/// there is one.
fn autodiff_fp8_linear<B: Fp8LinearOps, C: CheckpointStrategy>(
    x: Tensor<Autodiff<B, C>, 2>,
    w: Tensor<Autodiff<B, C>, 2>,
    bias: Option<Tensor<Autodiff<B, C>, 1>>,
    fp8: &Fp8Linear,
    hook: Option<Arc<dyn BackwardHook>>,
) -> DistResult<Tensor<Autodiff<B, C>, 2>> {
    let (x, w, bias) = (raw(x), raw(w), bias.map(raw));
    let (x_inner, w_inner) = (inner::<B, 2>(&x), inner::<B, 2>(&w));
    let (x_dtype, w_dtype) = (x_inner.dtype(), w_inner.dtype());
    let device = x_inner.device();
    let caches = fp8.caches_weights();
    let cached = match caches {
        true => fp8.cached_weight::<B>(w.node.id),
        false => None,
    };
    let hit = cached.is_some();
    // Under `Fp8Config::backward` a gradient's GEMM reads the unquantised operand instead.
    let backward = fp8.config.backward;
    let empty = || Tensor::<B, 2>::empty([0, 0], &device);
    let x_unquantised = match w.is_tracked() && backward.wgrad_unquantised() {
        true => x_inner.clone(),
        false => empty(),
    };
    let w_unquantised = match x.is_tracked() && backward.dgrad_unquantised() {
        true => w_inner.clone(),
        false => empty(),
    };
    let weight = match cached {
        Some(cast) => Weight::Cast(cast),
        None => Weight::Tensor(w_inner),
    };
    // The weight gradient reads the input's transposed cast, the input gradient the
    // weight's row-major one (cached with the rest, whatever this use needs).
    let keep = Keep {
        x_transposed: w.is_tracked() && !backward.wgrad_unquantised(),
        w_row: x.is_tracked() || caches,
    };
    let f = forward(x_inner, weight, bias.as_ref().map(inner), fp8, keep)?;
    if caches && !hit {
        let node: Arc<dyn Any + Send + Sync> = w.node.clone();
        fp8.store_weight(w.node.id, Arc::downgrade(&node), f.w.clone());
    }
    let w_scale_inv = f.w.row_scale_inv();
    let state = (
        raw(f.x_transposed.unwrap_or_else(empty)),
        raw(f.x_scale_inv),
        raw(f.w.row.unwrap_or_else(empty)),
        raw(w_scale_inv),
        raw(x_unquantised),
        raw(w_unquantised),
    );
    let step = Fp8LinearBackward {
        fp8: fp8.clone(),
        x_dtype,
        w_dtype,
        hook,
    };
    let output = raw(f.output);
    Ok(wrap(match &bias {
        Some(bias) => record::<B, C, _>(step, &[&x, &w, bias], state, output),
        None => record::<B, C, _>(step, &[&x, &w], state, output),
    }))
}

/// The backward of the FP8 linear layer: the output gradient's amax (reduced where split), its
/// scale and cast (as it is for `dx`, transposed for `dw`: one pass for both, which under
/// delayed scaling also gives the amax), the two FP8 GEMMs (the weight's first offered to
/// `hook`, [`BackwardHook::take_weight_gradient`]) and the bias gradient; then, under delayed
/// scaling, the gradient's amax recorded. Its parents are `[x, w]` or `[x, w, bias]`.
#[derive(Debug)]
struct Fp8LinearBackward {
    fp8: Fp8Linear,
    x_dtype: DType,
    w_dtype: DType,
    hook: Option<Arc<dyn BackwardHook>>,
}

/// The weight gradient of [`Fp8LinearBackward`], `q(x)ᵀ · q(dy)` scaled (the FP8 GEMM of the
/// transposed casts), offered to a hook before it is computed.
struct Fp8WeightProduct<B: Backend> {
    x_t: Tensor<B, 2>,
    x_dtype: Fp8Dtype,
    x_scale_inv: Tensor<B, 1>,
    dy_t: Tensor<B, 2>,
    dy_dtype: Fp8Dtype,
    dy_scale_inv: Tensor<B, 1>,
    /// The operands' blocks under blockwise scaling.
    blocks: Option<[Fp8Blocks; 2]>,
}

impl<B: Fp8LinearOps> WeightGradient for Fp8WeightProduct<B> {
    fn shape(&self) -> Vec<usize> {
        vec![self.x_t.dims()[0], self.dy_t.dims()[0]]
    }

    fn add_to(
        &mut self,
        buffer: Box<dyn Any + Send>,
        start: usize,
    ) -> Result<Box<dyn Any + Send>, Box<dyn Any + Send>> {
        let buffer = buffer.downcast::<Tensor<B, 1>>()?;
        if self.blocks.is_some() {
            // Blockwise: the product in f32, then added (no in-place GEMM for it yet).
            let product = fp8_product(
                self.blocks,
                self.x_t.clone(),
                self.x_dtype,
                self.x_scale_inv.clone(),
                self.dy_t.clone(),
                self.dy_dtype,
                self.dy_scale_inv.clone(),
                DType::F32,
            );
            return Ok(Box::new(add_to_slot(*buffer, start, product)));
        }
        Ok(Box::new(B::fp8_gemm_add_slot(
            *buffer,
            start,
            self.x_t.clone(),
            self.x_dtype,
            self.x_scale_inv.clone(),
            self.dy_t.clone(),
            self.dy_dtype,
            self.dy_scale_inv.clone(),
        )))
    }
}

impl<B: Fp8LinearOps> BackwardStep<B> for Fp8LinearBackward {
    /// `q(x)ᵀ` (empty when the weight needs no gradient or takes it unquantised), `1 /
    /// x_scale`, `q(w)` (empty when the input needs no gradient), `1 / w_scale`, and `x` and
    /// `w` unquantised where [`Fp8Config::backward`] has a gradient read them (else empty).
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
    );

    fn backward(
        self,
        dy: FloatTensor<B>,
        (x_t, x_scale_inv, w_q, w_scale_inv, x, w): <Self as BackwardStep<B>>::State,
        parents: &[Option<NodeId>],
        grads: &mut Gradients,
    ) {
        let dy = wrap::<B, 2>(dy);
        let fp8 = &self.fp8;
        let (forward_dtype, grad_dtype) = (
            fp8.config.format.forward_dtype(),
            fp8.config.format.gradient_dtype(),
        );
        // Backward has no error channel: a failed reduction is recorded on its group (its
        // every later call, and `backward_failure`, returns it) and the local amax used.
        let reduce = |local: Tensor<B, 1>| match fp8
            .try_reduce_amaxes([(local.clone(), Operand::GradOutput)])
        {
            Ok([amax]) => amax,
            Err((error, group)) => {
                group.fail_in_backward(error);
                local
            }
        };
        let (dx, dw) = (parent(parents, 0), parent(parents, 1));
        let backward = fp8.config.backward;
        let (dx_fp8, dw_fp8) = (!backward.dgrad_unquantised(), !backward.wgrad_unquantised());
        // The output gradient is cast for the GEMMs that run in FP8 (under delayed scaling its
        // amax is recorded whatever runs).
        let layouts = [dx.is_some() && dx_fp8, dw.is_some() && dw_fp8];
        // Each layout's cast with its reciprocal scale(s), and the amax to record.
        let (row, transposed, amax) = if fp8.blockwise() {
            let margin = fp8.config.margin;
            let cast_to = |transpose| {
                B::fp8_quantize_blockwise(dy.clone(), grad_dtype, Fp8Blocks::Row, margin, transpose)
            };
            match layouts {
                [true, true] => {
                    let [row, transposed] = B::fp8_quantize_blockwise_both(
                        dy.clone(),
                        grad_dtype,
                        Fp8Blocks::Row,
                        margin,
                    );
                    (Some(row), Some(transposed), None)
                }
                _ => (
                    layouts[0].then(|| cast_to(false)),
                    layouts[1].then(|| cast_to(true)),
                    None,
                ),
            }
        } else if fp8.delayed() {
            let scale = fp8.delayed_scale(Operand::GradOutput, &dy.device());
            let mut casts = cast(dy.clone(), scale.scale, grad_dtype, layouts, true);
            let amax = reduce(casts.amax.take().expect("asked for"));
            let inv = scale.inv;
            (
                casts.row.map(|row| (row, inv.clone())),
                casts.transposed.map(|t| (t, inv)),
                Some(amax),
            )
        } else {
            let (amax, scale) = match fp8.reduces(Operand::GradOutput) {
                true => {
                    let amax = reduce(B::fp8_amax(dy.clone()));
                    (amax.clone(), fp8.tensorwise_scale(amax, grad_dtype))
                }
                false => {
                    let margin = fp8.config.margin;
                    let (amax, scale, inv) = B::fp8_amax_scale(dy.clone(), grad_dtype, margin);
                    (amax, Scale { scale, inv })
                }
            };
            let casts = cast(dy.clone(), scale.scale, grad_dtype, layouts, false);
            let inv = scale.inv;
            (
                casts.row.map(|row| (row, inv.clone())),
                casts.transposed.map(|t| (t, inv)),
                Some(amax),
            )
        };
        let blocks = |a, b| fp8.blockwise().then_some([a, b]);
        register(grads, dx, || match (dx_fp8, row) {
            (true, Some((dy_row, dy_row_inv))) => fp8_product(
                blocks(Fp8Blocks::Row, Fp8Blocks::Square),
                dy_row,
                grad_dtype,
                dy_row_inv,
                wrap(w_q),
                forward_dtype,
                wrap(w_scale_inv),
                self.x_dtype,
            ),
            _ => B::gemm(dy.clone(), wrap(w), false, true),
        });
        if let (Some(node), false) = (dw, dw_fp8) {
            let mut weight = WeightProduct::new(wrap::<B, 2>(x), dy.clone());
            let taken = match &self.hook {
                Some(hook) => hook.take_weight_gradient(node, &mut weight),
                None => false,
            };
            if !taken {
                register(grads, Some(node), || weight.compute());
            }
        } else if let Some(node) = dw {
            let (dy_t, dy_scale_inv) = transposed.expect("cast for dw");
            let mut weight = Fp8WeightProduct {
                x_t: wrap(x_t),
                x_dtype: forward_dtype,
                x_scale_inv: wrap(x_scale_inv),
                dy_t,
                dy_dtype: grad_dtype,
                dy_scale_inv,
                blocks: blocks(Fp8Blocks::Row, Fp8Blocks::Row),
            };
            let taken = match &self.hook {
                Some(hook) => hook.take_weight_gradient(node, &mut weight),
                None => false,
            };
            if !taken {
                let gradient = fp8_product(
                    weight.blocks,
                    weight.x_t,
                    weight.x_dtype,
                    weight.x_scale_inv,
                    weight.dy_t,
                    weight.dy_dtype,
                    weight.dy_scale_inv,
                    self.w_dtype,
                );
                register(grads, Some(node), || gradient);
            }
        }
        register(grads, parent(parents, 2), || B::bias_gradient(dy));
        if let Some(amax) = amax {
            fp8.record(Operand::GradOutput, amax, grad_dtype);
        }
    }
}

/// Our CUDA backend and burn-cuda: the forward above on their [`Fp8Ops`]; ours accumulates
/// the weight gradient's FP8 GEMM in place into a flat f32 buffer.
#[cfg(feature = "cuda")]
mod cuda {
    use burn::tensor::{DType, Tensor};
    use burn_cubecl::cubecl::cuda::CudaRuntime;
    use burn_cubecl::{BoolElement, CubeBackend, FloatElement, IntElement};
    use burn_megatron_kernels::cuda::{MegatronCudaRuntime, gemm};

    use super::{Fp8Dtype, Fp8LinearOps};
    use crate::ops::fp8::cuda::{composed, kind};
    use crate::ops::primitive::{raw, wrap};
    use crate::ops::write_slot::add_to_slot;

    impl<F: FloatElement, I: IntElement, BT: BoolElement> Fp8LinearOps
        for CubeBackend<MegatronCudaRuntime, F, I, BT>
    {
        /// One cuBLASLt FP8 GEMM accumulating into the slot (beta 1, f32), where the buffer
        /// is ours alone; else the product and its addition.
        fn fp8_gemm_add_slot(
            buffer: Tensor<Self, 1>,
            start: usize,
            a: Tensor<Self, 2>,
            a_dtype: Fp8Dtype,
            a_scale_inv: Tensor<Self, 1>,
            b: Tensor<Self, 2>,
            b_dtype: Fp8Dtype,
            b_scale_inv: Tensor<Self, 1>,
        ) -> Tensor<Self, 1> {
            let into = raw(buffer);
            let (a_inv, b_inv) = (
                raw(a_scale_inv.clone().cast(DType::F32)),
                raw(b_scale_inv.clone().cast(DType::F32)),
            );
            // Under `BM_FP8_COMPOSITIONS=casts` the operands are grid values, not FP8 bits.
            let fused = match composed("casts") {
                true => Err(()),
                false => gemm::gemm_fp8_accumulate_at(
                    &raw(a.clone()),
                    kind(a_dtype),
                    &a_inv,
                    &raw(b.clone()),
                    kind(b_dtype),
                    &b_inv,
                    false,
                    &into,
                    start,
                )
                .map_err(|_| ()),
            };
            match fused {
                Ok(()) => wrap(into),
                Err(_) => {
                    let product = <Self as super::Fp8Ops>::fp8_gemm(
                        a,
                        a_dtype,
                        a_scale_inv,
                        b,
                        b_dtype,
                        b_scale_inv,
                        DType::F32,
                    );
                    add_to_slot(wrap(into), start, product)
                }
            }
        }
    }

    impl<F: FloatElement, I: IntElement, BT: BoolElement> Fp8LinearOps
        for CubeBackend<CudaRuntime, F, I, BT>
    {
    }
}

/// wgpu: the forward above on the compositions.
#[cfg(feature = "wgpu")]
impl<F, I, BT> Fp8LinearOps for burn_cubecl::CubeBackend<burn::backend::wgpu::WgpuRuntime, F, I, BT>
where
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
}
