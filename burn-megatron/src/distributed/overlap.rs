//! The data-parallel gradient reduction overlapped with the backward pass (Megatron's
//! `--overlap-grad-reduce`).
//!
//! The model marks each layer's input
//! ([`GptModel::set_backward_hook`](crate::models::GptModel::set_backward_hook)); when the backward pass
//! reaches layer `i`'s input, the gradients of layer `i` (and of every later layer, the final
//! norm and the output layer) are final. The hook ([`GradReduceOverlap`]) sums the step's
//! gradients in one flat f32 buffer laid out as the [`BufferLayout`] (Megatron's
//! `main_grad`): it takes them out of Burn's gradient container and adds them (cast to f32)
//! to their slots, and starts each reduction unit's collective, on a copy of the unit's
//! elements, as soon as its last gradient is in. The dense layers' weight gradients do not
//! pass through the container at all: the model's layers offer them to the hook
//! ([`BackwardHook::take_weight_gradient`]), whose buffer the weight-gradient GEMM adds them to
//! in place ([`LinearOps::gemm_add_slot`](crate::ops::LinearOps::gemm_add_slot): one cuBLASLt
//! GEMM with beta 1 on our CUDA backend, Megatron's gradient-accumulation fusion) instead of
//! writing a gradient in the model's dtype that a second kernel then adds. A unit is:
//!
//! - without the distributed optimizer, a bucket ([`BufferLayout::buckets`]) and its
//!   collective an all-reduce;
//! - with it, the same column range of every rank's shard (see
//!   [`grad_reduction`](super::grad_reduction)) and its collective a reduce-scatter. Our
//!   shards are contiguous, so a unit completes only once the last shard's part of it is
//!   final: at DP = 2 the reduce-scatters start during the second half of the backward
//!   pass.
//!
//! On GPUs (NCCL, collective checks off) the collectives run on the DP group's side stream
//! while the compute stream goes on with the earlier layers. Where collectives go through the
//! host (CPU thread ranks, or checks on), a rank must not wait for the others inside the
//! backward pass (book: "Burn's autodiff and thread ranks"), so the hook only copies and the collectives run after
//! backward, in the same order. Either way the collectives are those of
//! [`all_reduce_grads`](super::all_reduce_grads) or
//! [`reduce_scatter_grads`](super::reduce_scatter_grads) after the backward pass, on the same
//! ranges; the sums are the same bit for bit where the gradients are f32 (with gradients in a
//! narrower dtype, the fused GEMM's sum skips their rounding).
//!
//! Gradients the hook did not take (embeddings, whose tied copy is used again at the start of
//! the model; a tied output layer's copy on the last of several stages, which the pipeline
//! schedule reduces with the first stage's after the backward pass; any gradient not yet in
//! the container when the hook runs) are taken from the step's `GradientsParams` afterwards.
//! An untied output layer's gradient is taken at the first marker, with the last layer's.
//! The gradients sequence parallelism leaves partial (norms, row-parallel biases) are taken
//! afterwards too: the schedule sums them over TP after the backward pass. The hook takes the gradients out of the container, so
//! each bf16 gradient is freed as soon as it is in the f32 buffer, not after the whole backward
//! pass. A weight gradient offered after its unit's collective started would be lost: it is
//! an error, reported when the optimizer step collects the reduced gradients.
//!
//! Where the dense parameters' flat buffer is cut into parts below 32-bit indices
//! ([`flat_parts`](crate::optimizer::flat_parts)), each part has its own hook, f32 buffer and
//! units, and `PartsOverlap` gives the model the parts' hooks as one. The routed experts of MoE
//! layers have parts of their own, reduced over the expert-data-parallel group: their hooks
//! join the same `PartsOverlap`, and the experts' grouped weight-gradient products accumulate
//! in their f32 buffers
//! ([`hooked_grouped_linear`](crate::ops::hooked_grouped_linear)) as the dense GEMMs do.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Mutex, PoisonError};

use burn_autodiff::NodeId;

use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensorOps;
use burn::tensor::{DType, Shape, Tensor, TensorMetadata, TensorPrimitive};
use burn_autodiff::grads::Gradients;
use burn_megatron_dist::{DeviceTransport, DistBackend, ProcessGroup, ReduceOp};

use super::BufferLayout;
use super::grad_reduction::shard_columns;
use crate::backend::ModelBackend;
use crate::error::InputError;
use crate::ops::{BackwardHook, WeightGradient, WriteSlotOps, node_id};

/// One collective of the reduction: where its elements come from in the flat buffer, and
/// the slots it waits for.
#[derive(Debug)]
struct Unit {
    /// Flat-buffer ranges, in the unit's element order (one range for a bucket; one per
    /// shard, same columns, for a reduce-scatter block).
    ranges: Vec<Range<usize>>,
    /// Slots (indices into `layout.params()`) with elements in it.
    slots: usize,
}

/// What one step's backward pass has done so far.
#[derive(Debug)]
struct StepState<B: Backend, P> {
    /// Each slot's parameter in the current model (its autodiff primitive, the key of its
    /// gradient), set by [`GradReduceOverlap::arm`].
    params: Vec<Option<P>>,
    /// Slots whose gradient is in its units (from an earlier microbatch, or this one).
    flushed: Vec<bool>,
    /// Slots flushed in the current backward pass.
    flushed_now: Vec<bool>,
    /// Slots whose weight gradient a GEMM added to `main` in the current backward pass, not
    /// counted yet. A pass begins at the stage output's marker
    /// ([`GptModel::mark_output`](crate::models::GptModel::mark_output)), before any GEMM.
    fused_now: Vec<bool>,
    /// Each slot's parameter by its autodiff node, set by [`GradReduceOverlap::arm`].
    node_slot: HashMap<NodeId, usize>,
    /// Slots each unit still waits for in the current backward pass.
    missing: Vec<usize>,
    /// Backward passes (microbatches) seen this step, and the last point reached.
    passes: usize,
    last_point: Option<usize>,
    /// The step's gradients summed in f32 (`[numel]`, laid out as the buffer), from the first
    /// gradient of the step to its end.
    main: Option<Tensor<B, 1>>,
    /// Each unit's reduced elements: a bucket's `[len]`, or this rank's `[1, columns]`.
    outputs: Vec<Option<Tensor<B, 2>>>,
    /// The first error met in the backward pass, reported by `finish`.
    error: Option<crate::Error>,
    /// Parameter elements the hook took in this step's backward passes (the first pass).
    hooked: usize,
    /// The same for the last finished step.
    last_hooked: usize,
    /// Parameter elements whose gradient a GEMM added to the buffer in this step's first
    /// backward pass, and in the last finished step's.
    fused: usize,
    last_fused: usize,
}

/// The hook that overlaps the data-parallel reduction with the backward pass (see the
/// [module docs](self)). Built by
/// [`DistributedAdamW::overlap_hook`](crate::optimizer::DistributedAdamW::overlap_hook).
pub struct GradReduceOverlap<BA: AutodiffBackend> {
    layout: BufferLayout,
    /// Per slot: the layer index at whose input its gradient is final, if any.
    final_at: Vec<Option<usize>>,
    /// Per slot: the units it has elements in.
    slot_units: Vec<Vec<usize>>,
    units: Vec<Unit>,
    slot_of: HashMap<ParamId, usize>,
    dp: ProcessGroup,
    sharded: bool,
    /// Whether collectives start inside the backward pass (on the device, unchecked).
    in_backward: bool,
    device: burn::tensor::Device<BA::InnerBackend>,
    /// Backward passes per step (microbatches of gradient accumulation): only the last one
    /// starts collectives, as under Megatron's `no_sync` for the others.
    microbatches: usize,
    /// Whether weight gradients offered by the layers are taken
    /// ([`DataParallelConfig::gradient_accumulation_fusion`](super::DataParallelConfig::gradient_accumulation_fusion)).
    fuse: bool,
    state: Mutex<StepState<BA::InnerBackend, BA::FloatTensorPrimitive>>,
}

impl<BA: AutodiffBackend> std::fmt::Debug for GradReduceOverlap<BA> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradReduceOverlap")
            .field("units", &self.units.len())
            .field("sharded", &self.sharded)
            .field("in_backward", &self.in_backward)
            .finish()
    }
}

/// Gradients the schedule still changes after the backward pass, which the hook must leave
/// for then.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AfterBackward<'a> {
    /// Paths of copies of parameters held on another rank (a tied embedding's last-stage
    /// copy), to which the schedule adds the other copy's gradient.
    pub shared_copies: &'a [String],
    /// Parameters whose gradients are partial under sequence parallelism, which the schedule
    /// sums over TP.
    pub partial: &'a [ParamId],
}

/// A parameter's path in its model chunk: without the `0.` of a rank's chunks stepped as one
/// module (a `Vec` of one chunk; the hook follows one chunk).
fn in_chunk(path: &str) -> &str {
    path.strip_prefix("0.").unwrap_or(path)
}

/// The layer index in a path such as `block.layers.3.mlp.fc1.weight`.
fn layer_of(path: &str) -> Option<usize> {
    let rest = in_chunk(path).strip_prefix("block.layers.")?;
    rest.split('.').next()?.parse().ok()
}

impl<BA> GradReduceOverlap<BA>
where
    BA: AutodiffBackend,
    BA::InnerBackend: DistBackend + ModelBackend,
{
    /// The hook for a model chunk laid out as `layout`, reducing over `dp` in units of about
    /// `bucket_numel` elements, reduce-scattered when `sharded`, taking the weight gradients
    /// the layers offer when `fuse`; `after` names the gradients the schedule still changes
    /// after the backward pass.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        layout: &BufferLayout,
        dp: &ProcessGroup,
        bucket_numel: usize,
        sharded: bool,
        fuse: bool,
        microbatches: usize,
        after: AfterBackward<'_>,
        device: &burn::tensor::Device<BA::InnerBackend>,
    ) -> Self {
        let AfterBackward {
            shared_copies,
            partial,
        } = after;
        let size = dp.size();
        let units: Vec<Vec<Range<usize>>> = if sharded {
            let shard = layout.numel() / size;
            shard_columns(shard, size, bucket_numel)
                .into_iter()
                .map(|cols| {
                    (0..size)
                        .map(|s| s * shard + cols.start..s * shard + cols.end)
                        .collect()
                })
                .collect()
        } else {
            layout
                .buckets(bucket_numel)
                .into_iter()
                .map(|b| vec![b])
                .collect()
        };
        // Each slot's units: those with a range that overlaps the slot's.
        let mut slot_units = vec![Vec::new(); layout.params().len()];
        let mut counts = vec![0; units.len()];
        for (i, slot) in layout.params().iter().enumerate() {
            let range = slot.range();
            for (u, ranges) in units.iter().enumerate() {
                if ranges
                    .iter()
                    .any(|r| range.start.max(r.start) < range.end.min(r.end))
                {
                    slot_units[i].push(u);
                    counts[u] += 1;
                }
            }
        }
        let last = layout
            .params()
            .iter()
            .filter_map(|s| layer_of(&s.path))
            .max();
        let final_at = layout
            .params()
            .iter()
            .map(|s| match layer_of(&s.path) {
                // Partial under sequence parallelism: summed over TP after the backward pass
                // (`sum_sequence_parallel_grads`), then taken from `GradientsParams`.
                _ if partial.contains(&s.id) => None,
                Some(layer) => Some(layer),
                None if in_chunk(&s.path).starts_with("block.final_norm.") => last,
                // The output layer's gradient is final before the last layer's (its product
                // records the weight's own gradient: `linear_output_major`), as in
                // Megatron's first bucket. A tied copy on the last of several stages is left
                // for after the backward pass, where the schedule adds the first stage's
                // gradient to it.
                None if in_chunk(&s.path).starts_with("output.")
                    && !shared_copies.contains(&s.path) =>
                {
                    last
                }
                None => None,
            })
            .collect();
        let units: Vec<Unit> = units
            .into_iter()
            .zip(&counts)
            .map(|(ranges, &slots)| Unit { ranges, slots })
            .collect();
        // One replica has nothing to communicate: the buffer is the result (`finish_step`).
        let in_backward = <BA::InnerBackend as DeviceTransport>::collectives_on_device(device)
            && !dp.checks_collectives()
            && dp.size() > 1;
        let n_slots = layout.params().len();
        let n_units = units.len();
        Self {
            slot_of: layout
                .params()
                .iter()
                .enumerate()
                .map(|(i, s)| (s.id, i))
                .collect(),
            layout: layout.clone(),
            final_at,
            slot_units,
            units,
            dp: dp.clone(),
            sharded,
            in_backward,
            microbatches: microbatches.max(1),
            fuse,
            device: device.clone(),
            state: Mutex::new(StepState {
                params: (0..n_slots).map(|_| None).collect(),
                flushed: vec![false; n_slots],
                flushed_now: vec![false; n_slots],
                fused_now: vec![false; n_slots],
                node_slot: HashMap::new(),
                missing: counts,
                passes: 0,
                last_point: None,
                main: None,
                outputs: (0..n_units).map(|_| None).collect(),
                error: None,
                hooked: 0,
                last_hooked: 0,
                fused: 0,
                last_fused: 0,
            }),
        }
    }

    /// Starts counting a backward pass's flushes afresh.
    fn new_pass(&self, state: &mut StepState<BA::InnerBackend, BA::FloatTensorPrimitive>) {
        state.flushed_now.fill(false);
        state.fused_now.fill(false);
        for (missing, unit) in state.missing.iter_mut().zip(&self.units) {
            *missing = unit.slots;
        }
    }

    /// Whether the collectives start inside the backward pass (else after it; a group of one
    /// rank has none).
    pub fn overlaps(&self) -> bool {
        self.in_backward
    }

    /// Points the hook at `model`'s current parameters (their gradients' keys), for the next
    /// backward pass.
    pub(crate) fn arm<M: AutodiffModule<BA>>(&self, model: &M) {
        struct Collect<'a, P> {
            slot_of: &'a HashMap<ParamId, usize>,
            params: Vec<Option<P>>,
        }
        impl<BA: AutodiffBackend> ModuleVisitor<BA> for Collect<'_, BA::FloatTensorPrimitive> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<BA, D>>) {
                if let Some(&i) = self.slot_of.get(&param.id) {
                    self.params[i] = Some(param.val().into_primitive().tensor());
                }
            }
        }
        let mut collect = Collect {
            slot_of: &self.slot_of,
            params: (0..self.layout.params().len()).map(|_| None).collect(),
        };
        model.visit(&mut collect);
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.node_slot = collect
            .params
            .iter()
            .enumerate()
            .filter_map(|(i, p)| Some((node_id::<BA>(p.as_ref()?)?, i)))
            .collect();
        state.params = collect.params;
    }

    /// Adds slot `i`'s gradient (`[numel]`, any float dtype) to the f32 buffer, and counts the
    /// slot in ([`mark`](Self::mark)).
    fn flush(
        &self,
        state: &mut StepState<BA::InnerBackend, BA::FloatTensorPrimitive>,
        i: usize,
        grad: Tensor<BA::InnerBackend, 1>,
        start: bool,
    ) -> crate::Result<()> {
        let offset = self.layout.params()[i].offset;
        let main = state
            .main
            .take()
            .unwrap_or_else(|| self.zeros(self.layout.numel()));
        state.main = Some(<BA::InnerBackend as WriteSlotOps>::add_slot(
            main, offset, grad,
        ));
        self.mark(state, i, start)
    }

    /// Counts slot `i`'s gradient, in the buffer, as final for this backward pass, and starts
    /// the collectives of the units it completes when `start` holds.
    fn mark(
        &self,
        state: &mut StepState<BA::InnerBackend, BA::FloatTensorPrimitive>,
        i: usize,
        start: bool,
    ) -> crate::Result<()> {
        state.flushed[i] = true;
        state.flushed_now[i] = true;
        state.fused_now[i] = false;
        for &u in &self.slot_units[i] {
            state.missing[u] -= 1;
            if state.missing[u] == 0 && start {
                self.start_unit(state, u)?;
            }
        }
        Ok(())
    }

    /// `len` f32 zeros.
    fn zeros(&self, len: usize) -> Tensor<BA::InnerBackend, 1> {
        Tensor::zeros([len], (&self.device, DType::F32))
    }

    /// Starts unit `u`'s collective.
    fn start_unit(
        &self,
        state: &mut StepState<BA::InnerBackend, BA::FloatTensorPrimitive>,
        u: usize,
    ) -> crate::Result<()> {
        if state.outputs[u].is_some() {
            return Ok(());
        }
        // The unit's elements copied out of the buffer (a unit no gradient reached, all
        // padding, holds zeros): the collective gets a tensor of its own, and the buffer
        // stays ours alone, so that later gradients are still added to it in place.
        let ranges = &self.units[u].ranges;
        let mut input = self.zeros(ranges.iter().map(Range::len).sum());
        if let Some(main) = &state.main {
            let mut at = 0;
            for range in ranges {
                let part = main.clone().slice(range.clone());
                input = <BA::InnerBackend as WriteSlotOps>::write_slot(input, at, part);
                at += range.len();
            }
        }
        let size = self.dp.size();
        let output = if self.sharded {
            let columns = input.dims()[0] / size;
            self.dp
                .reduce_scatter(input.reshape([size, columns]), 0, ReduceOp::Avg)?
        } else {
            let len = input.dims()[0];
            self.dp.all_reduce(input, ReduceOp::Avg)?.reshape([1, len])
        };
        state.outputs[u] = Some(output);
        Ok(())
    }

    /// After the backward pass: the gradients the hook did not take come from `grads`, the
    /// remaining collectives run, and the result is what
    /// [`all_reduce_grads`](super::all_reduce_grads) (`[numel]`) or
    /// [`reduce_scatter_grads`](super::reduce_scatter_grads) (`[numel / dp]`) return. Every
    /// parameter of `model` must have a gradient in one place or the other.
    pub(crate) fn finish<M: AutodiffModule<BA>>(
        &self,
        model: &M,
        grads: &GradientsParams,
    ) -> crate::Result<Tensor<BA::InnerBackend, 1>> {
        let mut guard = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let state = &mut *guard;
        let outcome = self.finish_step(state, model, grads);
        // Whatever happened, the next step starts clean.
        state.flushed.fill(false);
        self.new_pass(state);
        state.passes = 0;
        state.last_point = None;
        state.main = None;
        state.fused_now.fill(false);
        state.outputs.iter_mut().for_each(|t| *t = None);
        state.error = None;
        state.last_hooked = std::mem::take(&mut state.hooked);
        state.last_fused = std::mem::take(&mut state.fused);
        outcome
    }

    /// Parameter elements whose gradients the hook took inside the last step's backward pass
    /// (the rest came from the step's `GradientsParams` after it).
    pub fn hooked_numel(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .last_hooked
    }

    /// Parameter elements whose gradients the weight-gradient GEMMs added to the buffer in
    /// the last step's first backward pass ([`BackwardHook::take_weight_gradient`]).
    pub fn fused_numel(&self) -> usize {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .last_fused
    }

    fn finish_step<M: AutodiffModule<BA>>(
        &self,
        state: &mut StepState<BA::InnerBackend, BA::FloatTensorPrimitive>,
        model: &M,
        grads: &GradientsParams,
    ) -> crate::Result<Tensor<BA::InnerBackend, 1>> {
        if let Some(error) = state.error.take() {
            return Err(error);
        }
        if state.passes != 0 && state.passes != self.microbatches {
            return Err(crate::error::ConfigError::Invalid(format!(
                "the gradient-reduction hook saw {} backward passes in a step made for {} \
                 microbatches: make the hook with the step's number of microbatches",
                state.passes, self.microbatches
            ))
            .into());
        }
        // A weight whose gradient a GEMM added after the last marker it passed (none passed
        // it) is in the buffer: counted now.
        for i in 0..self.layout.params().len() {
            if state.fused_now[i] && !state.flushed_now[i] {
                self.mark(state, i, false)?;
            }
        }
        let skip: Vec<ParamId> = self
            .layout
            .params()
            .iter()
            .zip(&state.flushed)
            .filter(|(_, flushed)| **flushed)
            .map(|(slot, _)| slot.id)
            .collect();
        let rest = super::param_and_grad_buffer::collect_grads::<BA, M>(
            &self.layout,
            model,
            grads,
            &skip,
        )?;
        let several = self.dp.size() > 1;
        for (id, grad) in rest {
            let i = self.slot_of[&id];
            self.flush(state, i, grad, several)?;
        }
        if !several {
            // The average over one replica is the buffer itself, in either layout (one shard
            // is the whole buffer): no unit is copied out and concatenated back.
            return Ok(state
                .main
                .take()
                .unwrap_or_else(|| self.zeros(self.layout.numel())));
        }
        for u in 0..self.units.len() {
            self.start_unit(state, u)?;
        }
        let outputs: Vec<Tensor<BA::InnerBackend, 2>> = state
            .outputs
            .iter_mut()
            .map(|o| o.take().expect("every unit's collective has run"))
            .collect();
        let out = Tensor::cat(outputs, 1);
        let len = out.dims()[1];
        Ok(out.reshape([len]))
    }
}

impl<BA> BackwardHook for GradReduceOverlap<BA>
where
    BA: AutodiffBackend<Gradients = Gradients>,
    BA::InnerBackend: DistBackend + ModelBackend,
{
    fn on_backward(&self, point: usize, grads: &mut Gradients) {
        let mut guard = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let state = &mut *guard;
        if state.error.is_some() {
            return;
        }
        // Layers are reached last first: a point not below the previous one starts a pass.
        if state.last_point.is_none_or(|last| point >= last) {
            state.passes += 1;
            self.new_pass(state);
        }
        state.last_point = Some(point);
        let start = self.in_backward && state.passes == self.microbatches;
        for i in 0..self.layout.params().len() {
            if state.flushed_now[i] || self.final_at[i].is_none_or(|at| at < point) {
                continue;
            }
            let Some(param) = state.params[i].as_ref() else {
                continue;
            };
            let slot = &self.layout.params()[i];
            // In the container (from any operation but a fused GEMM), or not yet: used
            // through an operation that runs later, it is taken after the backward pass.
            let outcome = match (BA::grad_remove(param, grads), state.fused_now[i]) {
                (Some(grad), _) => {
                    let shape = grad.shape();
                    if shape.as_slice() != slot.shape.as_slice() {
                        state.error = Some(
                            InputError::GradientShape {
                                path: slot.path.clone(),
                                expected: slot.shape.clone(),
                                got: shape.to_vec(),
                            }
                            .into(),
                        );
                        return;
                    }
                    let flat =
                        <BA::InnerBackend as FloatTensorOps<BA::InnerBackend>>::float_reshape(
                            grad,
                            Shape::new([slot.numel]),
                        );
                    let grad = Tensor::from_primitive(TensorPrimitive::Float(flat));
                    self.flush(state, i, grad, start)
                }
                (None, true) => self.mark(state, i, start),
                (None, false) => continue,
            };
            if state.passes == 1 {
                state.hooked += slot.numel;
            }
            if let Err(error) = outcome {
                state.error = Some(error);
                return;
            }
        }
    }

    /// Adds the weight's gradient to the buffer, the GEMM accumulating there, when the weight
    /// is one of this chunk's parameters whose gradient is taken inside the backward pass.
    fn take_weight_gradient(&self, weight: NodeId, gradient: &mut dyn WeightGradient) -> bool {
        if !self.fuse {
            return false;
        }
        let mut guard = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let state = &mut *guard;
        let Some(&i) = state.node_slot.get(&weight) else {
            return false;
        };
        let slot = &self.layout.params()[i];
        if state.error.is_some() || self.final_at[i].is_none() || slot.shape != gradient.shape() {
            return false;
        }
        if self.slot_units[i]
            .iter()
            .any(|&u| state.outputs[u].is_some())
        {
            state.error = Some(
                crate::error::ConfigError::Invalid(format!(
                    "the gradient of {} reached the data-parallel reduction after its \
                     bucket's collective started (an operation using the weight runs after \
                     the marker of its layer's input)",
                    slot.path
                ))
                .into(),
            );
            return false;
        }
        let main = state
            .main
            .take()
            .unwrap_or_else(|| self.zeros(self.layout.numel()));
        let (sum, taken) = match gradient.add_to(Box::new(main), slot.offset) {
            Ok(sum) => (sum, true),
            Err(main) => (main, false),
        };
        let sum = sum
            .downcast::<Tensor<BA::InnerBackend, 1>>()
            .expect("the buffer comes back as the tensor it went as");
        state.main = Some(*sum);
        // Counted at its layer's marker, unless it was counted already (a second use of the
        // weight, whose gradient joins the first in the buffer).
        state.fused_now[i] |= taken && !state.flushed_now[i];
        if taken && state.passes <= 1 {
            state.fused += slot.numel;
        }
        taken
    }
}

/// The hooks of a model chunk's flat buffers cut into parts below 32-bit indices (the dense
/// parameters past [`MAX_FLAT_NUMEL`](crate::optimizer::MAX_FLAT_NUMEL), and the routed
/// experts'), one [`GradReduceOverlap`] a part with its own f32 buffer and units, as the one
/// hook the model takes: each part's hook sees every marker, and a weight's gradient goes to
/// the part that holds the weight. Built by
/// [`DistributedAdamW::overlap_hook`](crate::optimizer::DistributedAdamW::overlap_hook).
pub(crate) struct PartsOverlap<BA: AutodiffBackend> {
    dense: Vec<GradReduceOverlap<BA>>,
    experts: Vec<GradReduceOverlap<BA>>,
}

impl<BA: AutodiffBackend> std::fmt::Debug for PartsOverlap<BA> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PartsOverlap")
            .field("dense", &self.dense)
            .field("experts", &self.experts)
            .finish()
    }
}

impl<BA> PartsOverlap<BA>
where
    BA: AutodiffBackend,
    BA::InnerBackend: DistBackend + ModelBackend,
{
    /// The hooks of the dense parts and of the experts' parts, each in buffer order.
    pub(crate) fn new(
        dense: Vec<GradReduceOverlap<BA>>,
        experts: Vec<GradReduceOverlap<BA>>,
    ) -> Self {
        Self { dense, experts }
    }

    /// The hooks of the dense parts, in buffer order.
    pub(crate) fn dense(&self) -> &[GradReduceOverlap<BA>] {
        &self.dense
    }

    /// The hooks of the experts' parts, in buffer order (none without MoE layers).
    pub(crate) fn experts(&self) -> &[GradReduceOverlap<BA>] {
        &self.experts
    }

    /// Every part's hook.
    fn all(&self) -> impl Iterator<Item = &GradReduceOverlap<BA>> {
        self.dense.iter().chain(&self.experts)
    }

    /// Points every part's hook at `model`'s current parameters.
    pub(crate) fn arm<M: AutodiffModule<BA>>(&self, model: &M) {
        self.all().for_each(|part| part.arm(model));
    }

    /// Whether the collectives start inside the backward pass (the same for every part of a
    /// kind).
    pub(crate) fn overlaps(&self) -> bool {
        self.all().any(GradReduceOverlap::overlaps)
    }

    /// [`GradReduceOverlap::hooked_numel`] over every part.
    pub(crate) fn hooked_numel(&self) -> usize {
        self.all().map(GradReduceOverlap::hooked_numel).sum()
    }

    /// [`GradReduceOverlap::fused_numel`] over every part.
    pub(crate) fn fused_numel(&self) -> usize {
        self.all().map(GradReduceOverlap::fused_numel).sum()
    }
}

impl<BA> BackwardHook for PartsOverlap<BA>
where
    BA: AutodiffBackend<Gradients = Gradients>,
    BA::InnerBackend: DistBackend + ModelBackend,
{
    fn on_backward(&self, point: usize, grads: &mut Gradients) {
        for part in self.all() {
            part.on_backward(point, grads);
        }
    }

    fn take_weight_gradient(&self, weight: NodeId, gradient: &mut dyn WeightGradient) -> bool {
        self.all()
            .any(|part| part.take_weight_gradient(weight, gradient))
    }
}
