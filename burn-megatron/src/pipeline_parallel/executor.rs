//! Runs one rank's steps of a [`Plan`] on its model chunks.
//!
//! A forward pass keeps what its backward pass needs: with the autodiff graph, the stage's
//! input (a leaf that requires grad when it came from the previous stage) and its output;
//! under [`Recompute::Full`](crate::transformer::Recompute::Full) (and its uniform and block variants), no graph for the recomputed
//! layers, only each group's input, and the backward pass reruns the head, each group and the
//! embedding in turn, backpropagating through one at a time (the block method's stored layers
//! keep their graph, backpropagated first). The
//! gradient sent back to the previous stage is the input leaf's gradient.
//!
//! Every backward pass goes through [`Executor::backward_segment`], which first waits for the
//! tensor-parallel group (see the book's "Pipeline parallelism" chapter: this makes the
//! autodiff-lock deadlock of thread ranks impossible).
//!
//! The passes run on copies of the chunks that defer sequence parallelism's partial gradients
//! ([`SequenceParallelGrads::Deferred`]); the copies keep the chunks' parameter ids, so the
//! gradients are the chunks' own, and [`Executor::run`] sums the partial ones over TP in one
//! all-reduce after the backward passes.

use std::collections::HashMap;
use std::ops::Range;
use std::rc::Rc;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, Tensor};
use burn_megatron_dist::{DistBackend, ProcessGroup, ReduceOp};

use super::exchange::Mailbox;
use super::plan::{Compute, Payload, Plan, Step};
use crate::backend::ModelBackend;
use crate::data::Microbatch;
use crate::error::PipelineError;
use crate::error::{Error, Result};
use crate::models::GptModel;
use crate::tensor_parallel::{SequenceParallelGrads, sum_sequence_parallel_grads};
use crate::transformer::moe::MoeLosses;

/// The groups a rank's part of a pipeline talks over.
pub(crate) struct Groups {
    /// Pipeline group (`None` with PP = 1).
    pub pp: Option<ProcessGroup>,
    /// This rank's pipeline rank.
    pub pp_rank: usize,
    /// The first and last stage, for tied embeddings (`None` on a middle stage).
    pub embedding: Option<ProcessGroup>,
}

/// What one rank's part of a training step gives back.
#[derive(Debug)]
pub struct StepOutput<B: AutodiffBackend> {
    /// The step's loss, the mean of the microbatches' losses; on the last stage only.
    pub loss: Option<Tensor<B::InnerBackend, 1>>,
    /// Per model chunk, the gradient of the step's loss with respect to its parameters
    /// (the microbatches' gradients, each scaled by `1 / microbatches`, summed), times the
    /// loss scale if the step had one.
    pub grads: Vec<GradientsParams>,
    /// The most microbatches whose activations this rank held at once.
    pub max_live_activations: usize,
    /// The most device memory this rank's tensors held between two steps of the schedule
    /// (after each forward pass, backward pass and exchange), in bytes, where the backend
    /// tracks it (`BackendInfo::memory_in_use`: the pool's live bytes in queue order, so
    /// sampling it waits for nothing). A peak inside one pass is not seen.
    pub peak_memory_bytes: Option<u64>,
    /// The auxiliary losses and expert load of this rank's MoE layers; `None` for a dense
    /// model.
    pub moe: Option<MoeStepStats<B::InnerBackend>>,
}

/// What this rank's MoE layers did in one step, for the log.
#[derive(Debug, Clone)]
pub struct MoeStepStats<B: burn::tensor::backend::Backend> {
    /// `[1]`: the load-balancing losses of this rank's MoE layers, summed over the layers,
    /// averaged over the microbatches, coefficients included (what the step backpropagated).
    pub load_balancing_loss: Tensor<B, 1>,
    /// `[1]`: the z-losses, as `load_balancing_loss`.
    pub z_loss: Tensor<B, 1>,
    /// Per MoE layer of this rank (global index, in order): how many of this rank's token
    /// assignments each expert got (and kept) over the step's microbatches.
    pub tokens_per_expert: Vec<(usize, Vec<usize>)>,
    /// This rank's assignments dropped by over-full experts, over the layers and the step's
    /// microbatches.
    pub dropped: usize,
}

/// Sums of [`MoeLosses`] over a step's microbatches.
#[derive(Default)]
struct MoeTally<B: burn::tensor::backend::Backend> {
    load_balancing: Vec<Tensor<B, 1>>,
    z: Vec<Tensor<B, 1>>,
    tokens: std::collections::BTreeMap<usize, Vec<usize>>,
    dropped: usize,
}

impl<B: burn::tensor::backend::Backend> MoeTally<B> {
    fn add<BA: AutodiffBackend<InnerBackend = B>>(&mut self, losses: &MoeLosses<BA>) {
        if let Some(l) = losses.load_balancing_loss() {
            self.load_balancing.push(l.inner());
        }
        if let Some(z) = losses.z_loss() {
            self.z.push(z.inner());
        }
        self.dropped += losses.dropped;
        for (layer, counts) in &losses.tokens_per_expert {
            let total = self
                .tokens
                .entry(*layer)
                .or_insert_with(|| vec![0; counts.len()]);
            for (t, c) in total.iter_mut().zip(counts) {
                *t += c;
            }
        }
    }

    fn finish(self, microbatches: usize) -> Option<MoeStepStats<B>> {
        if self.tokens.is_empty() {
            return None;
        }
        let mean = |v: Vec<Tensor<B, 1>>| {
            Tensor::cat(v, 0)
                .sum()
                .div_scalar(microbatches.max(1) as f64)
        };
        Some(MoeStepStats {
            load_balancing_loss: mean(self.load_balancing),
            z_loss: mean(self.z),
            tokens_per_expert: self.tokens.into_iter().collect(),
            dropped: self.dropped,
        })
    }
}

/// What a forward pass kept for its backward pass.
enum Live<B: AutodiffBackend> {
    /// The autodiff graph of the whole stage.
    Graph {
        /// The embeddings (first stage) or the received input, a leaf that requires grad.
        start: Start<B>,
        /// The stage's output, or the loss (over `microbatches`) on the last stage.
        end: End<B>,
        /// The stage's MoE losses, scaled as the backward root (added to a last stage's
        /// loss already).
        aux: Option<Tensor<B, 1>>,
    },
    /// Full recomputation: no graph for the recomputed layers, only what reruns the stage
    /// piece by piece (the embedding from the tokens, each group of layers from its input,
    /// the head from the last layer's output); under the block method, the graph of the
    /// stored layers after them (and the head). Keeping no graph between passes also keeps
    /// one microbatch's backward pass from meeting another microbatch's graph.
    Recompute {
        call: u64,
        /// Each recomputed group's layers and input, in order.
        groups: Vec<(Range<usize>, Tensor<B::InnerBackend, 3>)>,
        /// The stored layers' graph (block method): their input (a leaf that requires grad),
        /// the stage's output or loss, and the stored layers' scaled MoE losses.
        stored: Option<StoredLayers<B>>,
        /// The last layer's output (last stage, no stored layers).
        output: Tensor<B::InnerBackend, 3>,
    },
}

/// The block method's stored layers: their input (a leaf that requires grad), the stage's
/// output or loss, and their scaled MoE losses.
type StoredLayers<B> = (Tensor<B, 3>, End<B>, Option<Tensor<B, 1>>);

enum Start<B: AutodiffBackend> {
    Embedded(Tensor<B, 3>),
    Received(Tensor<B, 3>),
}

enum End<B: AutodiffBackend> {
    Hidden(Tensor<B, 3>),
    Loss(Tensor<B, 1>),
}

pub(crate) struct Executor<'a, B: AutodiffBackend + ModelBackend>
where
    B::InnerBackend: DistBackend,
{
    /// The chunks, deferring sequence parallelism's partial gradients (same parameter ids).
    chunks: Rc<[GptModel<B>]>,
    microbatches: &'a [Microbatch<B>],
    groups: &'a Groups,
    pp_size: usize,
    device: B::Device,
    dtype: DType,
    live: HashMap<Compute, Live<B>>,
    mailbox: Mailbox<B::InnerBackend>,
    grads: Vec<GradientsParams>,
    losses: Vec<Tensor<B::InnerBackend, 1>>,
    max_live: usize,
    /// The most memory in use seen between steps.
    peak_memory: Option<u64>,
    /// `[1]` f32: the loss scale every backward pass starts from (fp16 loss scaling).
    loss_scale: Option<Tensor<B::InnerBackend, 1>>,
    /// The MoE layers' losses and load for the log.
    moe: MoeTally<B::InnerBackend>,
}

impl<'a, B> Executor<'a, B>
where
    B: AutodiffBackend + ModelBackend,
    B::InnerBackend: DistBackend,
{
    pub fn new(
        chunks: &[GptModel<B>],
        microbatches: &'a [Microbatch<B>],
        groups: &'a Groups,
        pp_size: usize,
    ) -> Self {
        let device = chunks[0].devices().into_iter().next().unwrap_or_default();
        let dtype = Tensor::<B::InnerBackend, 1>::zeros([1], &device).dtype();
        let grads = chunks.iter().map(|_| GradientsParams::new()).collect();
        let chunks = chunks
            .iter()
            .map(|chunk| {
                chunk
                    .clone()
                    .with_sequence_parallel_grads(SequenceParallelGrads::Deferred)
            })
            .collect();
        Self {
            chunks,
            microbatches,
            groups,
            pp_size,
            device,
            dtype,
            live: HashMap::new(),
            mailbox: Mailbox::new(),
            grads,
            losses: Vec::new(),
            max_live: 0,
            peak_memory: None,
            loss_scale: None,
            moe: MoeTally::default(),
        }
    }

    /// Starts every backward pass from the loss times `scale` (`[1]` f32, on the device), so
    /// that the gradients come out multiplied by it; the reported loss is not scaled.
    pub fn with_loss_scale(mut self, scale: Option<Tensor<B::InnerBackend, 1>>) -> Self {
        self.loss_scale = scale;
        self
    }

    /// The root of a microbatch's backward pass: its share of the step's mean loss, times the
    /// loss scale if there is one.
    fn backward_root(&self, loss: Tensor<B, 1>) -> Tensor<B, 1> {
        let share = loss.div_scalar(self.microbatches.len() as f64);
        match &self.loss_scale {
            Some(scale) => {
                let scale = scale.clone().cast(share.dtype());
                share * Tensor::from_inner(scale)
            }
            None => share,
        }
    }

    /// Runs every step of this rank in `plan`, then reduces the tied embeddings' gradients
    /// and sums the gradients sequence parallelism leaves partial over TP.
    pub fn run(mut self, plan: &Plan) -> Result<StepOutput<B>> {
        let single_stage = plan.pp * plan.virtual_size == 1;
        for step in plan.steps(self.groups.pp_rank) {
            self.step(step).map_err(|source| {
                if single_stage {
                    source
                } else {
                    self.failed(step, source)
                }
            })?;
            if let Some(bytes) = B::memory_in_use(&self.device) {
                self.peak_memory = Some(self.peak_memory.map_or(bytes, |p| p.max(bytes)));
            }
        }
        self.reduce_tied_embeddings()?;
        // Sequence parallelism's partial gradients (norms, row-parallel biases), left partial
        // by the deferring chunks' backward passes, summed over TP in one all-reduce.
        let tp = self.chunks[0].tp().clone();
        sum_sequence_parallel_grads(&self.chunks, &mut self.grads, &tp)?;
        let loss = (!self.losses.is_empty()).then(|| {
            let count = self.losses.len();
            Tensor::cat(std::mem::take(&mut self.losses), 0)
                .sum()
                .div_scalar(count as f64)
        });
        let microbatches = self.microbatches.len();
        Ok(StepOutput {
            loss,
            grads: self.grads,
            max_live_activations: self.max_live,
            peak_memory_bytes: self.peak_memory,
            moe: std::mem::take(&mut self.moe).finish(microbatches),
        })
    }

    fn failed(&self, step: &Step, source: Error) -> Error {
        let (what, chunk) = match step {
            Step::Forward(c) => (
                format!("the forward pass of microbatch {}", c.microbatch),
                c.chunk,
            ),
            Step::Backward(c) => (
                format!("the backward pass of microbatch {}", c.microbatch),
                c.chunk,
            ),
            Step::Exchange(t) => (
                format!("an exchange with its neighbours ({} transfers)", t.len()),
                t.first().map_or(0, |t| t.chunk),
            ),
        };
        let rank = self.chunks[0].tp().global_rank();
        PipelineError::StageFailed {
            stage: chunk * self.pp_size + self.groups.pp_rank,
            rank,
            step: what,
            source: Box::new(source),
        }
        .into()
    }

    fn step(&mut self, step: &Step) -> Result<()> {
        let phase = match step {
            Step::Forward(_) => "forward",
            Step::Backward(_) => "backward",
            Step::Exchange(_) => "exchange",
        };
        B::profile_phase(&self.device, phase);
        match step {
            Step::Forward(c) => self.forward(*c),
            Step::Backward(c) => self.backward(*c),
            Step::Exchange(transfers) => {
                let pp = self.groups.pp.as_ref().ok_or_else(|| {
                    internal("a plan with exchanges needs a pipeline group".into())
                })?;
                let (chunks, microbatches) = (Rc::clone(&self.chunks), self.microbatches);
                let shape = |t: &super::plan::Transfer| {
                    let [batch, seq] = microbatches[t.microbatch].tokens.dims();
                    chunks[t.chunk].activation_shape(batch, seq)
                };
                Ok(self
                    .mailbox
                    .exchange(pp, transfers, shape, self.dtype, &self.device)?)
            }
        }
    }

    fn forward(&mut self, c: Compute) -> Result<()> {
        let chunks = Rc::clone(&self.chunks);
        let model = &chunks[c.chunk];
        let data = &self.microbatches[c.microbatch];
        let stage = model.stage().clone();
        let call = model.next_call();
        let recompute = model.recompute();
        let live = if recompute.reruns_layers() {
            let mut x = if stage.is_first() {
                model.embed(data.tokens.clone(), call)?.inner()
            } else {
                self.take(Payload::Activation, c)?
            };
            let mut groups = Vec::new();
            let mut stored = None;
            // The recomputed layers' losses, for the log only: the backward pass reruns them.
            let mut logged = MoeLosses::default();
            for (range, rerun) in recompute.segments(model.layers().len()) {
                if rerun {
                    groups.push((range.clone(), x.clone()));
                    for layer in &model.layers()[range] {
                        x = layer
                            .clone()
                            .no_grad()
                            .try_forward_with_losses(Tensor::from_inner(x), call, &mut logged)?
                            .inner();
                    }
                } else {
                    // The block method's stored layers, the last segment: a graph from here.
                    let input = Tensor::<B, 3>::from_inner(x.clone()).require_grad();
                    let mut y = input.clone();
                    let mut losses = MoeLosses::default();
                    for layer in &model.layers()[range] {
                        y = layer.try_forward_with_losses(y, call, &mut losses)?;
                    }
                    x = y.clone().inner();
                    stored = Some((input, y, losses));
                }
            }
            self.moe.add(&logged);
            if let Some((_, _, losses)) = &stored {
                self.moe.add(losses);
            }
            let stored = match stored {
                Some((input, y, losses)) if stage.is_last() => {
                    let loss = model.loss(model.head(y)?, data.targets.clone())?;
                    self.losses.push(loss.clone().inner());
                    Some((
                        input,
                        End::Loss(self.backward_root(losses.add_to(loss))),
                        None,
                    ))
                }
                Some((input, y, losses)) => {
                    let aux = losses.total().map(|aux| self.backward_root(aux));
                    Some((input, End::Hidden(y), aux))
                }
                None => {
                    if stage.is_last() {
                        let logits = model.head(Tensor::from_inner(x.clone()))?;
                        let loss = model.loss(logits, data.targets.clone())?;
                        self.losses.push(loss.inner());
                    }
                    None
                }
            };
            if !stage.is_last() {
                self.mailbox
                    .outgoing
                    .insert((Payload::Activation, c), x.clone());
            }
            Live::Recompute {
                call,
                groups,
                stored,
                output: x,
            }
        } else {
            let start = if stage.is_first() {
                Start::Embedded(model.embed(data.tokens.clone(), call)?)
            } else {
                let input = self.take(Payload::Activation, c)?;
                Start::Received(Tensor::from_inner(input).require_grad())
            };
            let mut x = match &start {
                Start::Embedded(x) | Start::Received(x) => x.clone(),
            };
            let mut losses = MoeLosses::default();
            for (i, layer) in model.layers().iter().enumerate() {
                x = layer.try_forward_with_losses(
                    model.mark_layer_input(x, i),
                    call,
                    &mut losses,
                )?;
            }
            self.moe.add(&losses);
            let (end, aux) = if stage.is_last() {
                let logits = model.mark_output(model.head(x)?);
                let loss = model.loss(logits, data.targets.clone())?;
                self.losses.push(loss.clone().inner());
                (End::Loss(self.backward_root(losses.add_to(loss))), None)
            } else {
                let x = model.mark_output(x);
                self.mailbox
                    .outgoing
                    .insert((Payload::Activation, c), x.clone().inner());
                let aux = losses.total().map(|aux| self.backward_root(aux));
                (End::Hidden(x), aux)
            };
            Live::Graph { start, end, aux }
        };
        self.live.insert(c, live);
        self.max_live = self.max_live.max(self.live.len());
        Ok(())
    }

    fn backward(&mut self, c: Compute) -> Result<()> {
        let live = self.live.remove(&c).ok_or_else(|| {
            internal(format!(
                "plan runs the backward pass of microbatch {} (chunk {}) before its forward pass",
                c.microbatch, c.chunk
            ))
        })?;
        let chunks = Rc::clone(&self.chunks);
        let model = &chunks[c.chunk];
        let stage = model.stage().clone();
        let input_grad = match live {
            Live::Graph { start, end, aux } => {
                let root = match end {
                    End::Loss(root) => root,
                    End::Hidden(output) => {
                        with_aux(dot(output, self.take(Payload::Gradient, c)?), aux)
                    }
                };
                let grads = self.backward_segment(model, root, c.chunk)?;
                match &start {
                    Start::Received(input) => Some(grad_of(input, &grads)),
                    Start::Embedded(_) => None,
                }
            }
            Live::Recompute {
                call,
                groups,
                stored,
                output,
            } => {
                let mut upstream = match stored {
                    Some((input, end, aux)) => {
                        let root = match end {
                            End::Loss(root) => root,
                            End::Hidden(y) => {
                                with_aux(dot(y, self.take(Payload::Gradient, c)?), aux)
                            }
                        };
                        let grads = self.backward_segment(model, root, c.chunk)?;
                        grad_of(&input, &grads)
                    }
                    None if stage.is_last() => {
                        let last = Tensor::<B, 3>::from_inner(output).require_grad();
                        let targets = self.microbatches[c.microbatch].targets.clone();
                        let loss = model.loss(model.head(last.clone())?, targets)?;
                        let root = self.backward_root(loss);
                        let grads = self.backward_segment(model, root, c.chunk)?;
                        grad_of(&last, &grads)
                    }
                    None => self.take(Payload::Gradient, c)?,
                };
                for (range, input) in groups.into_iter().rev() {
                    let input = Tensor::<B, 3>::from_inner(input).require_grad();
                    let mut y = input.clone();
                    let mut losses = MoeLosses::default();
                    for layer in &model.layers()[range] {
                        y = layer.try_forward_with_losses(y, call, &mut losses)?;
                    }
                    let aux = losses.total().map(|aux| self.backward_root(aux));
                    let root = with_aux(dot(y, upstream), aux);
                    let grads = self.backward_segment(model, root, c.chunk)?;
                    upstream = grad_of(&input, &grads);
                }
                if stage.is_first() {
                    let tokens = self.microbatches[c.microbatch].tokens.clone();
                    let embedded = model.embed(tokens, call)?;
                    self.backward_segment(model, dot(embedded, upstream), c.chunk)?;
                    None
                } else {
                    Some(upstream)
                }
            }
        };
        if let Some(grad) = input_grad {
            self.mailbox.outgoing.insert((Payload::Gradient, c), grad);
        }
        Ok(())
    }

    /// Backpropagates from `root` and adds the parameter gradients to chunk `chunk`'s.
    ///
    /// Waits for the tensor-parallel group (and the expert-parallel group of a model with MoE
    /// layers) first. Burn's autodiff holds a graph's lock for a
    /// whole backward pass and, after it, locks every graph of the process in turn. A
    /// backward pass here can block only in a collective of the TP group; once every TP rank
    /// has reached this barrier, none of them is still inside its previous backward pass (or
    /// its clean-up), so a rank that blocks in a collective with the lock held waits only for
    /// peers that are themselves inside the same backward pass and will join it, and no
    /// cycle of waits can form.
    fn backward_segment(
        &mut self,
        model: &GptModel<B>,
        root: Tensor<B, 1>,
        chunk: usize,
    ) -> Result<B::Gradients> {
        let tp = model.tp();
        tp.barrier()?;
        // MoE layers' all-to-alls (or all-gathers and reduce-scatters) run inside the
        // backward pass too: the same argument for the expert-parallel group.
        let ep = model.expert_parallel_group().filter(|ep| ep.size() > 1);
        if let Some(ep) = ep {
            ep.barrier()?;
        }
        // And for the context-parallel group: its attention exchanges K/V (and their
        // gradients) inside the backward pass.
        let cp = model.context_parallel().map(|cp| &cp.group);
        if let Some(cp) = cp {
            cp.barrier()?;
        }
        let grads = root.backward();
        tp.backward_failure()?;
        if let Some(cp) = cp {
            cp.backward_failure()?;
        }
        if let Some(ep) = ep {
            ep.backward_failure()?;
        }
        accumulate(&mut self.grads[chunk], model, &grads);
        Ok(grads)
    }

    fn take(&mut self, payload: Payload, c: Compute) -> Result<Tensor<B::InnerBackend, 3>> {
        self.mailbox.arrived.remove(&(payload, c)).ok_or_else(|| {
            internal(format!(
                "plan uses the {payload:?} of microbatch {} (chunk {}) before receiving it",
                c.microbatch, c.chunk
            ))
        })
    }

    /// Megatron's `_allreduce_word_embedding_grads`: with tied embeddings over several stages,
    /// the first stage's embedding table and the last stage's copy get the sum of both
    /// gradients, so that they stay equal after the optimizer step.
    fn reduce_tied_embeddings(&mut self) -> Result<()> {
        let Some(group) = &self.groups.embedding else {
            return Ok(());
        };
        if group.size() < 2 || !self.chunks[0].ties_embeddings() {
            return Ok(());
        }
        let (chunk, weight) = if self.chunks[0].stage().is_first() {
            let embedding = self.chunks[0].embedding.as_ref();
            (0, embedding.map(|e| &e.weight))
        } else {
            let last = self.chunks.len() - 1;
            (last, self.chunks[last].output.as_ref().map(|o| &o.weight))
        };
        let Some(weight) = weight else {
            return Ok(());
        };
        let grads = &mut self.grads[chunk];
        let grad = grads
            .remove::<B::InnerBackend, 2>(weight.id)
            .unwrap_or_else(|| weight.val().inner().zeros_like());
        let sum = group.all_reduce(grad, ReduceOp::Sum)?;
        grads.register(weight.id, sum);
        Ok(())
    }
}

/// A plan that does not fit the executor (a bug in a schedule, not in the user's input).
pub(crate) fn internal(message: String) -> Error {
    burn_megatron_dist::DistError::InvalidArgument(message).into()
}

/// `sum(output · upstream)`: the root whose backward pass carries `upstream`, the gradient of
/// `output`, into the graph behind `output`.
fn dot<B: AutodiffBackend>(
    output: Tensor<B, 3>,
    upstream: Tensor<B::InnerBackend, 3>,
) -> Tensor<B, 1> {
    (output * Tensor::from_inner(upstream)).sum()
}

/// `root` plus a stage's scaled MoE losses, if it has any: they backpropagate with the
/// gradient that came from the next stage (Megatron's `MoEAuxLossAutoScaler`).
fn with_aux<B: AutodiffBackend>(root: Tensor<B, 1>, aux: Option<Tensor<B, 1>>) -> Tensor<B, 1> {
    match aux {
        // In the root's dtype: Burn reads both operands in the left one's (`MoeLosses::add_to`).
        Some(aux) => {
            let dtype = root.dtype();
            root + aux.cast(dtype)
        }
        None => root,
    }
}

/// The gradient of `leaf`; zero where nothing that was backpropagated depends on it.
fn grad_of<B: AutodiffBackend>(
    leaf: &Tensor<B, 3>,
    grads: &B::Gradients,
) -> Tensor<B::InnerBackend, 3> {
    leaf.grad(grads)
        .unwrap_or_else(|| leaf.clone().inner().zeros_like())
}

/// Adds the gradients `grads` holds for `module`'s parameters to `total`.
pub(crate) fn accumulate<B: AutodiffBackend, M: Module<B>>(
    total: &mut GradientsParams,
    module: &M,
    grads: &B::Gradients,
) {
    struct Add<'a, B: AutodiffBackend> {
        total: &'a mut GradientsParams,
        grads: &'a B::Gradients,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Add<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = param.grad(self.grads) {
                let sum = match self.total.remove::<B::InnerBackend, D>(param.id) {
                    Some(previous) => previous + grad,
                    None => grad,
                };
                self.total.register(param.id, sum);
            }
        }
    }
    module.visit(&mut Add { total, grads });
}
