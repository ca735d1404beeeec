//! Where each parameter of a model lives over the tensor-parallel group, as its layer declares
//! it, and gathering the full parameters or gradients.
//!
//! Every layer that holds parameters implements [`DeclarePlacements`]: a column-parallel
//! linear layer says "my weight is sharded along dimension 1 over TP", a vocabulary-parallel
//! table "sharded along dimension 0, with this many padding rows at the end", a norm
//! "replicated". Containers (attention, MLP, transformer layer, model) forward to their
//! children. Nothing is inferred from type or field names: a parameter that no layer declares
//! is reported, never silently treated as replicated.
//!
//! The declarations drive gathering full tensors (the equivalence tests), counting each
//! parameter once in the global gradient norm, and checkpoints, which store every parameter
//! by its full (unpadded) shape and cut it again for any layout.

use std::collections::HashMap;
use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, TensorData};
use burn_megatron_dist::{DistBackend, Placement, ProcessGroup};

use super::tp_context::SequenceParallelGrads;
use crate::error::{ConfigError, InputError, Result, read_data};

/// How one parameter is laid out over the tensor-parallel group.
///
/// A sharded parameter is cut evenly: rank `r` of `parts` holds
/// `[r · n, (r + 1) · n)` of the sharded dimension, `n` being its local length. The full
/// tensor may carry `padding` rows at the end of that dimension (Megatron's vocabulary
/// padding); they are not part of the parameter's value, so the full ("global") shape leaves
/// them out and a checkpoint does not store them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParamPlacement {
    /// [`Placement::Replicate`] or [`Placement::Shard`]`(dim)`; parameters are never
    /// [`Placement::Partial`].
    pub placement: Placement,
    /// This rank's index among the parts (its TP rank; 0 when replicated).
    pub rank: usize,
    /// The number of parts (the TP size; 1 when replicated).
    pub parts: usize,
    /// Padding entries at the end of the sharded dimension of the full tensor.
    pub padding: usize,
    /// For a routed expert's weight (`[local_experts, ..]`): the rank's slice of the experts
    /// over the expert-parallel group. Its gradient is reduced over the expert-data-parallel
    /// group, not the data-parallel one, and the global norm sums it over EP.
    pub expert: Option<ExpertShard>,
    /// A buffer the optimizer does not train (DeepSeek-V3's expert bias, updated from the
    /// load instead): no gradient, left out of the flat buffers and the gradient norm, saved
    /// in checkpoints like any parameter.
    pub frozen: bool,
}

/// Which experts of an MoE layer a rank holds: `[rank · n, (rank + 1) · n)` of the
/// `parts · n` experts, along dimension 0 of the expert weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertShard {
    /// The rank in the expert-parallel group.
    pub rank: usize,
    /// The expert-parallel size.
    pub parts: usize,
}

impl ParamPlacement {
    /// Every rank holds the whole parameter.
    pub fn replicated() -> Self {
        Self {
            placement: Placement::Replicate,
            rank: 0,
            parts: 1,
            padding: 0,
            expert: None,
            frozen: false,
        }
    }

    /// A replicated buffer that the optimizer leaves alone (`frozen` set).
    pub fn frozen_buffer() -> Self {
        Self {
            frozen: true,
            ..Self::replicated()
        }
    }

    /// A routed expert's weight: replicated over TP (expert tensor parallelism 1), this
    /// rank's experts of the `ep` group's along dimension 0.
    pub fn expert(ep: &ProcessGroup) -> Self {
        Self::replicated().with_experts(ep)
    }

    /// A routed expert's weight under expert tensor parallelism: this rank's experts of the
    /// `ep` group's along dimension 0, each sharded over `tp` along `dim` (its FFN width).
    pub fn expert_sharded(dim: usize, tp: &ProcessGroup, ep: &ProcessGroup) -> Self {
        Self::sharded(dim, tp).with_experts(ep)
    }

    /// The same placement for this rank's experts of the `ep` group's, along dimension 0.
    fn with_experts(self, ep: &ProcessGroup) -> Self {
        Self {
            expert: Some(ExpertShard {
                rank: ep.rank(),
                parts: ep.size(),
            }),
            ..self
        }
    }

    /// Whether it is a routed expert's weight ([`ParamPlacement::expert`]).
    pub fn is_expert(&self) -> bool {
        self.expert.is_some()
    }

    /// Each rank of `tp` holds an even slice along `dim`.
    pub fn sharded(dim: usize, tp: &ProcessGroup) -> Self {
        Self {
            placement: Placement::Shard(dim),
            rank: tp.rank(),
            parts: tp.size(),
            padding: 0,
            expert: None,
            frozen: false,
        }
    }

    /// The same placement whose full tensor ends in `padding` padding entries along the
    /// sharded dimension.
    pub fn with_padding(self, padding: usize) -> Self {
        Self { padding, ..self }
    }

    /// Whether every rank holds all of it.
    pub fn is_replicated(&self) -> bool {
        self.dim().is_none()
    }

    /// The sharded dimension, `None` when replicated.
    pub fn dim(&self) -> Option<usize> {
        match self.placement {
            Placement::Shard(dim) => Some(dim),
            Placement::Replicate | Placement::Partial => None,
        }
    }

    /// The full shape of the parameter (padding left out) from this rank's `local` shape:
    /// every expert of an expert weight.
    pub fn global_shape(&self, local: &[usize]) -> Vec<usize> {
        let mut shape = local.to_vec();
        if let Some(dim) = self.dim() {
            shape[dim] = local[dim] * self.parts - self.padding;
        }
        if let Some(expert) = self.expert {
            shape[0] = local[0] * expert.parts;
        }
        shape
    }

    /// The range of the sharded dimension of the padded full tensor this rank holds, given
    /// its local length there; the whole dimension when replicated.
    pub fn local_range(&self, local_len: usize) -> Range<usize> {
        self.rank * local_len..(self.rank + 1) * local_len
    }
}

/// The placements of a module's parameters, by [`ParamId`], as its layers declare them.
#[derive(Debug, Clone, Default)]
pub struct Placements {
    by_id: HashMap<ParamId, ParamPlacement>,
    /// Replicated parameters whose gradient on a rank covers only its part of the sequence.
    partial: Vec<ParamId>,
    /// Those of `partial` whose layer leaves that gradient partial after the backward pass,
    /// for [`sum_sequence_parallel_grads`](crate::tensor_parallel::sum_sequence_parallel_grads).
    deferred: Vec<ParamId>,
}

impl Placements {
    /// Records the placement of `param`.
    pub fn declare<B: Backend, const D: usize>(
        &mut self,
        param: &Param<Tensor<B, D>>,
        placement: ParamPlacement,
    ) {
        self.by_id.insert(param.id, placement);
    }

    /// Declares every float parameter of `module` replicated: how a model with no tensor
    /// parallelism (any Burn module) declares its parameters for data parallelism and the
    /// distributed optimizer.
    ///
    /// ```ignore
    /// impl<B: Backend> DeclarePlacements for MyModel<B> {
    ///     fn declare_placements(&self, out: &mut Placements) {
    ///         out.declare_replicated(self);
    ///     }
    /// }
    /// ```
    pub fn declare_replicated<B: Backend, M: Module<B>>(&mut self, module: &M) {
        struct Replicated<'a>(&'a mut Placements);
        impl<B: Backend> ModuleVisitor<B> for Replicated<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                self.0.declare(param, ParamPlacement::replicated());
            }
        }
        module.visit(&mut Replicated(self));
    }

    /// Declares that `param` (replicated, 1D: a norm's weight, a row-parallel bias) is applied
    /// to this rank's part of the sequence under sequence parallelism, so that each TP rank's
    /// gradient of it is partial (Megatron's "sequence-parallel parameters"), and where its
    /// layer sums that gradient over the TP group (its context's
    /// [`sequence_parallel_grads`](crate::tensor_parallel::TpContext::sequence_parallel_grads)):
    /// by *f* inside the backward pass ([`SequenceParallelGrads::SumInBackward`]), or after
    /// it ([`SequenceParallelGrads::Deferred`]), by
    /// [`sum_sequence_parallel_grads`](crate::tensor_parallel::sum_sequence_parallel_grads),
    /// all in one all-reduce (Megatron's `finalize_model_grads`).
    pub fn declare_partial_gradient<B: Backend>(
        &mut self,
        param: &Param<Tensor<B, 1>>,
        grads: SequenceParallelGrads,
    ) {
        self.partial.push(param.id);
        if grads == SequenceParallelGrads::Deferred {
            self.deferred.push(param.id);
        }
    }

    /// The parameters declared with [`declare_partial_gradient`](Self::declare_partial_gradient),
    /// in declaration order, wherever their gradients are summed. These are the ones a
    /// schedule sums after the backward pass: the schedules run their passes deferred,
    /// whatever the chunks they are given say.
    pub fn partial_gradients(&self) -> &[ParamId] {
        &self.partial
    }

    /// Those of [`partial_gradients`](Self::partial_gradients) whose layers defer the sum
    /// ([`SequenceParallelGrads::Deferred`]): the gradients a backward pass of this module
    /// leaves partial, in declaration order. Empty when the layers sum them in the backward
    /// pass.
    pub fn deferred_gradients(&self) -> &[ParamId] {
        &self.deferred
    }

    /// The placement declared for the parameter `id`.
    pub fn get(&self, id: ParamId) -> Option<ParamPlacement> {
        self.by_id.get(&id).copied()
    }

    /// All placements of `module`.
    pub fn of<M: DeclarePlacements>(module: &M) -> Self {
        let mut placements = Self::default();
        module.declare_placements(&mut placements);
        placements
    }
}

/// A module that declares where each of its float parameters lives over the TP group.
///
/// A layer declares its own parameters with [`Placements::declare`]; a container calls
/// `declare_placements` on each child. Every float parameter must be declared.
pub trait DeclarePlacements {
    /// Adds the placement of every float parameter of `self` to `out`.
    fn declare_placements(&self, out: &mut Placements);

    /// Paths of the parameters that copy a parameter counted on another rank (the last
    /// pipeline stage's copy of a tied embedding table): global norms and the distributed
    /// optimizer count each parameter once, so they leave these out.
    fn shared_copies(&self) -> Vec<String> {
        Vec::new()
    }
}

impl<T: DeclarePlacements> DeclarePlacements for Option<T> {
    fn declare_placements(&self, out: &mut Placements) {
        if let Some(inner) = self {
            inner.declare_placements(out);
        }
    }

    fn shared_copies(&self) -> Vec<String> {
        self.as_ref().map_or_else(Vec::new, T::shared_copies)
    }
}

/// A list of modules (a rank's model chunks): Burn visits item `i` under the path `i`, so
/// each item's shared copies are named `i.<path>`.
impl<T: DeclarePlacements> DeclarePlacements for Vec<T> {
    fn declare_placements(&self, out: &mut Placements) {
        for item in self {
            item.declare_placements(out);
        }
    }

    fn shared_copies(&self) -> Vec<String> {
        self.iter()
            .enumerate()
            .flat_map(|(i, item)| {
                item.shared_copies()
                    .into_iter()
                    .map(move |p| format!("{i}.{p}"))
            })
            .collect()
    }
}

/// Tracks the path of the parameter being visited.
#[derive(Default)]
pub(crate) struct Path {
    names: Vec<String>,
}

impl Path {
    pub(crate) fn enter(&mut self, name: &str) {
        self.names.push(name.to_string());
    }
    pub(crate) fn exit(&mut self) {
        self.names.pop();
    }
    pub(crate) fn current(&self) -> String {
        self.names.join(".")
    }
}

/// A float parameter of a module: what the optimizer and checkpoints need to know of it.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamInfo {
    /// Its id, the key of its gradient in [`GradientsParams`].
    pub id: ParamId,
    /// Its path in the module, e.g. `block.layers.0.mlp.fc1.weight`.
    pub path: String,
    /// Its layout over the TP group, as its layer declares it.
    pub placement: ParamPlacement,
    /// This rank's shape of it.
    pub shape: Vec<usize>,
}

impl ParamInfo {
    /// The full shape (padding left out).
    pub fn global_shape(&self) -> Vec<usize> {
        self.placement.global_shape(&self.shape)
    }
}

/// Every float parameter of `module`, in visiting order, with its id, path, declared
/// placement and shape. A parameter that no layer declares is a [`ConfigError::Invalid`]
/// naming it.
pub fn try_param_infos<B: Backend, M: Module<B> + DeclarePlacements>(
    module: &M,
) -> core::result::Result<Vec<ParamInfo>, ConfigError> {
    struct Collect {
        path: Path,
        placements: Placements,
        out: core::result::Result<Vec<ParamInfo>, ConfigError>,
    }
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let path = self.path.current();
            let Ok(out) = &mut self.out else { return };
            match self.placements.get(param.id) {
                Some(placement) => out.push(ParamInfo {
                    id: param.id,
                    path,
                    placement,
                    shape: param.val().dims().to_vec(),
                }),
                None => {
                    self.out = Err(ConfigError::Invalid(format!(
                        "parameter {path} has no declared placement: its layer's \
                         DeclarePlacements must declare every parameter"
                    )))
                }
            }
        }
    }
    let mut visitor = Collect {
        path: Path::default(),
        placements: Placements::of(module),
        out: Ok(Vec::new()),
    };
    module.visit(&mut visitor);
    visitor.out
}

/// [`try_param_infos`] for modules whose layers declare every parameter (all of this
/// crate's).
///
/// # Panics
/// If a parameter has no declared placement: a bug in a layer's [`DeclarePlacements`].
pub fn param_infos<B: Backend, M: Module<B> + DeclarePlacements>(module: &M) -> Vec<ParamInfo> {
    try_param_infos(module).unwrap_or_else(|e| panic!("{e}"))
}

/// Every float parameter of `module` with its path (`"layers.0.mlp.fc1.weight"`) and layout.
pub fn param_shards<B: Backend, M: Module<B> + DeclarePlacements>(
    module: &M,
) -> Vec<(String, ParamPlacement)> {
    param_infos(module)
        .into_iter()
        .map(|info| (info.path, info.placement))
        .collect()
}

/// The full tensor of `local` (padding dropped), gathered over `tp`, on the host; a device
/// error names `what`.
fn gather<B: DistBackend, const D: usize>(
    local: Tensor<B, D>,
    placement: ParamPlacement,
    tp: &ProcessGroup,
    what: impl FnOnce() -> String,
) -> Result<TensorData> {
    let full = match placement.dim() {
        None => local,
        Some(dim) => {
            let global = placement.global_shape(&local.dims())[dim];
            tp.all_gather(local, dim)?.narrow(dim, 0, global)
        }
    };
    Ok(read_data(full, what).map_err(|e| e.on_rank(tp.global_rank()))?)
}

/// The full value of every float parameter (padding dropped), gathered over the TP group,
/// with its path. Every rank of the group must call it.
pub fn gather_full_params<B: DistBackend, M: Module<B> + DeclarePlacements>(
    module: &M,
    tp: &ProcessGroup,
) -> Result<Vec<(String, TensorData)>> {
    struct Gather<'a> {
        path: Path,
        placements: Placements,
        tp: &'a ProcessGroup,
        out: Result<Vec<(String, TensorData)>>,
    }
    impl<B: DistBackend> ModuleVisitor<B> for Gather<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let path = self.path.current();
            let Ok(out) = &mut self.out else { return };
            let result = declared(&self.placements, param.id, &path).and_then(|placement| {
                let what = || format!("parameter `{path}` gathered over TP");
                gather(param.val(), placement, self.tp, what)
            });
            match result {
                Ok(data) => out.push((path, data)),
                Err(e) => self.out = Err(e),
            }
        }
    }
    let mut visitor = Gather {
        path: Path::default(),
        placements: Placements::of(module),
        tp,
        out: Ok(Vec::new()),
    };
    module.visit(&mut visitor);
    visitor.out
}

fn declared(placements: &Placements, id: ParamId, path: &str) -> Result<ParamPlacement> {
    placements.get(id).ok_or_else(|| {
        ConfigError::Invalid(format!(
            "parameter {path} has no declared placement: its layer's DeclarePlacements must \
             declare every parameter"
        ))
        .into()
    })
}

/// The full gradient of every float parameter (padding dropped), gathered over the TP group,
/// with its path. A parameter without a gradient is an [`InputError::MissingGradient`].
/// Every rank of the group must call it.
pub fn gather_full_grads<B, M>(
    module: &M,
    grads: &GradientsParams,
    tp: &ProcessGroup,
) -> Result<Vec<(String, TensorData)>>
where
    B: AutodiffBackend,
    B::InnerBackend: DistBackend,
    M: Module<B> + DeclarePlacements,
{
    struct Gather<'a> {
        path: Path,
        placements: Placements,
        tp: &'a ProcessGroup,
        grads: &'a GradientsParams,
        out: Result<Vec<(String, TensorData)>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Gather<'_>
    where
        B::InnerBackend: DistBackend,
    {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let path = self.path.current();
            let Ok(out) = &mut self.out else { return };
            let result = declared(&self.placements, param.id, &path).and_then(|placement| {
                let grad = self
                    .grads
                    .get::<B::InnerBackend, D>(param.id)
                    .ok_or_else(|| InputError::MissingGradient { path: path.clone() })?;
                let what = || format!("the gradient of `{path}` gathered over TP");
                gather(grad, placement, self.tp, what)
            });
            match result {
                Ok(data) => out.push((path, data)),
                Err(e) => self.out = Err(e),
            }
        }
    }
    let mut visitor = Gather {
        path: Path::default(),
        placements: Placements::of(module),
        tp,
        grads,
        out: Ok(Vec::new()),
    };
    Module::<B>::visit(module, &mut visitor);
    visitor.out
}
