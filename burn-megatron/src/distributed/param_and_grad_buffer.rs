//! One flat buffer for a model chunk's parameters and one for their gradients: Megatron's
//! `_ParamAndGradBuffer` (`megatron/core/distributed/param_and_grad_buffer.py`).
//!
//! # Layout
//!
//! Parameters are laid out in the **reverse** of the order the module visits them (roughly the
//! reverse of the forward pass), as Megatron does: the backward pass finishes the last layers'
//! gradients first, and they sit at the start of the buffer, so a data-parallel bucket (a
//! contiguous range, [`BufferLayout::buckets`]) is complete early and its reduction can overlap
//! the rest of the backward pass.
//!
//! Each parameter starts at a multiple of [`BufferConfig::param_alignment`] elements (256 by
//! default: 512 bytes in bf16, the allocation alignment of our CUDA runtime, so a parameter is
//! a view of the model-dtype buffer rather than a copy; Megatron pads to 64 for the same
//! reason). The total is padded to a multiple of `dp_size × param_alignment`, so that the
//! distributed optimizer's `dp_size` equal shards ([`BufferLayout::shard`]) start on parameter
//! alignment boundaries. Padding holds zeros in every buffer and never changes.
//!
//! ```text
//! offset 0                                                       numel
//! | output/last layer ... | pad | ... | embedding | pad ........ |
//! |<---- shard 0 ---->|<---- shard 1 ---->| ... (dp_size shards)  |
//! ```
//!
//! # Buffers
//!
//! - `main_params`: `[numel]` f32, the fp32 master weights (for an f32 model, the model's
//!   parameters are views of it);
//! - `grads`: `[numel]` f32, filled from a step's gradients by [`ParamAndGradBuffer::gather_grads`]
//!   (one cast-and-copy kernel per parameter on CubeCL backends, a cast and a `slice_assign`
//!   elsewhere). It lives for the optimizer step only: allocated (zeroed) by `gather_grads`
//!   after the backward pass and released by the step, so it never adds to the memory peak
//!   of the forward and backward passes, when the activations are held (at 1.3B parameters,
//!   5.2 GB less at the peak for one zero fill a step). With the data-parallel overlap hook ([`overlap`](super::overlap)) the
//!   gradients go into f32 reduction units during the backward pass instead, accumulating over
//!   microbatches as Megatron's `main_grad` do.

use std::collections::HashMap;
use std::ops::Range;

use burn::config::Config;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, Tensor};

use crate::error::{ConfigError, InputError};
use crate::tensor_parallel::{
    DeclarePlacements, ParamInfo, ParamKind, ParamPlacement, Path, try_param_infos,
};

/// How a [`ParamAndGradBuffer`] lays out its parameters.
#[derive(Config, Debug, Copy, PartialEq)]
pub struct BufferConfig {
    /// The data-parallel size the buffer is cut into shards for (the distributed optimizer's
    /// ranks): the total is padded to a multiple of `dp_size × param_alignment`.
    #[config(default = 1)]
    pub dp_size: usize,
    /// Each parameter starts at a multiple of this many elements.
    #[config(default = 256)]
    pub param_alignment: usize,
}

impl BufferConfig {
    /// Checks that both sizes are at least 1.
    pub fn validate(&self) -> core::result::Result<(), ConfigError> {
        if self.dp_size == 0 || self.param_alignment == 0 {
            return Err(ConfigError::Invalid(format!(
                "the flat buffer's dp_size ({}) and param_alignment ({}) must be at least 1",
                self.dp_size, self.param_alignment
            )));
        }
        Ok(())
    }
}

/// Where one parameter lives in the flat buffers.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSlot {
    /// Its id in the module (the key of its gradient).
    pub id: ParamId,
    /// Its path in the module, e.g. `block.layers.0.mlp.fc1.weight`: the key of its optimizer
    /// state in checkpoints.
    pub path: String,
    /// This rank's shape of it (its local TP slice).
    pub shape: Vec<usize>,
    /// Its layout over the TP group, as its layer declares it.
    pub placement: ParamPlacement,
    /// Bias, norm or weight, for the weight-decay policy.
    pub kind: ParamKind,
    /// Its first element's index in the buffers (a multiple of `param_alignment`).
    pub offset: usize,
    /// Its number of elements.
    pub numel: usize,
}

impl ParamSlot {
    /// The buffer range it occupies.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel
    }
}

/// The order, offsets and padding of a module's parameters in flat buffers (see the [module
/// docs](self)).
#[derive(Debug, Clone, PartialEq)]
pub struct BufferLayout {
    /// In buffer order (the reverse of visiting order).
    slots: Vec<ParamSlot>,
    by_id: HashMap<ParamId, usize>,
    /// Elements in each buffer, padding included.
    numel: usize,
    config: BufferConfig,
    /// Parameters of the module deliberately left to another buffer (the routed experts,
    /// reduced over another group): gathering gradients skips them.
    excluded: std::collections::HashSet<ParamId>,
}

impl BufferLayout {
    /// The layout of `infos` (a module's parameters in visiting order, as
    /// [`try_param_infos`] gives them).
    pub fn new(
        infos: &[ParamInfo],
        config: BufferConfig,
    ) -> core::result::Result<Self, ConfigError> {
        Self::new_where(infos, config, |_| true)
    }

    /// The layout of those of `infos` that `keep` accepts; the others belong to another
    /// buffer (as the routed experts, reduced over the expert-data-parallel group, do).
    pub fn new_where(
        infos: &[ParamInfo],
        config: BufferConfig,
        keep: impl Fn(&ParamInfo) -> bool,
    ) -> core::result::Result<Self, ConfigError> {
        config.validate()?;
        let align = config.param_alignment;
        let mut offset = 0;
        let mut slots = Vec::with_capacity(infos.len());
        let excluded = infos
            .iter()
            .filter(|info| !keep(info))
            .map(|info| info.id)
            .collect();
        for info in infos.iter().rev().filter(|info| keep(info)) {
            let numel = info.shape.iter().product::<usize>();
            slots.push(ParamSlot {
                id: info.id,
                path: info.path.clone(),
                shape: info.shape.clone(),
                placement: info.placement,
                kind: ParamKind::of(&info.path, &info.shape),
                offset,
                numel,
            });
            offset += numel.div_ceil(align) * align;
        }
        let shard_unit = config.dp_size * align;
        let numel = offset.div_ceil(shard_unit) * shard_unit;
        let by_id = slots.iter().enumerate().map(|(i, s)| (s.id, i)).collect();
        Ok(Self {
            slots,
            by_id,
            numel,
            config,
            excluded,
        })
    }

    /// Whether parameter `id` of the module belongs to another buffer.
    pub fn excludes(&self, id: ParamId) -> bool {
        self.excluded.contains(&id)
    }

    /// The parameters in buffer order (the reverse of the module's visiting order).
    pub fn params(&self) -> &[ParamSlot] {
        &self.slots
    }

    /// The slot of parameter `id`.
    pub fn slot(&self, id: ParamId) -> Option<&ParamSlot> {
        self.by_id.get(&id).map(|&i| &self.slots[i])
    }

    /// The slot of the parameter at `path`.
    pub fn slot_by_path(&self, path: &str) -> Option<&ParamSlot> {
        self.slots.iter().find(|s| s.path == path)
    }

    /// Elements in each buffer, padding included: a multiple of `dp_size × param_alignment`.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Elements that belong to parameters (padding left out).
    pub fn param_numel(&self) -> usize {
        self.slots.iter().map(|s| s.numel).sum()
    }

    /// The settings.
    pub fn config(&self) -> &BufferConfig {
        &self.config
    }

    /// The range of the buffers data-parallel rank `dp_rank` owns in the distributed optimizer:
    /// the `dp_rank`-th of `dp_size` equal shards. A shard may cut a parameter.
    pub fn shard(&self, dp_rank: usize) -> Range<usize> {
        let size = self.numel / self.config.dp_size;
        dp_rank * size..(dp_rank + 1) * size
    }

    /// Data-parallel buckets: consecutive ranges covering the buffers, each ending at a
    /// parameter boundary once it holds at least `bucket_numel` elements (the last one takes
    /// the padding). In buffer order, so the first bucket's gradients are final first.
    pub fn buckets(&self, bucket_numel: usize) -> Vec<Range<usize>> {
        let mut buckets = Vec::new();
        let mut start = 0;
        for i in 0..self.slots.len() {
            let end = match self.slots.get(i + 1) {
                Some(next) => next.offset,
                None => self.numel,
            };
            if end - start >= bucket_numel.max(1) || i + 1 == self.slots.len() {
                buckets.push(start..end);
                start = end;
            }
        }
        buckets
    }

    /// One flag per block of `param_alignment` elements: 1 where `decays` holds for the
    /// block's parameter, 0 for exempt parameters and padding. `[numel / param_alignment]`.
    pub fn block_flags(&self, decays: impl Fn(&ParamSlot) -> bool) -> Vec<f32> {
        let align = self.config.param_alignment;
        let mut flags = vec![0.0; self.numel / align];
        for slot in &self.slots {
            if decays(slot) {
                let blocks = slot.offset / align..(slot.offset + slot.numel).div_ceil(align);
                flags[blocks].fill(1.0);
            }
        }
        flags
    }
}

/// A model chunk's flat fp32 master weights and fp32 gradients, and the layout that maps
/// them to its parameters (see the [module docs](self)). `B` is the inner (non-autodiff)
/// backend.
#[derive(Debug, Clone)]
pub struct ParamAndGradBuffer<B: Backend> {
    layout: BufferLayout,
    model_dtype: DType,
    /// `[numel]` f32.
    main_params: Tensor<B, 1>,
    /// `[numel]` f32.
    grads: Tensor<B, 1>,
}

impl<B: Backend> ParamAndGradBuffer<B> {
    /// The buffers of `module`'s parameters, the master weights copied from them (cast to
    /// f32) and the gradients zero. Every parameter must be declared (its layer's
    /// [`DeclarePlacements`]) and have the same dtype, f32, f16 or bf16.
    pub fn from_module<BA, M>(module: &M, config: BufferConfig) -> crate::Result<Self>
    where
        BA: AutodiffBackend<InnerBackend = B>,
        M: Module<BA> + DeclarePlacements,
    {
        Self::from_module_where(module, config, |_| true)
    }

    /// [`from_module`](Self::from_module) for the parameters `keep` accepts
    /// ([`BufferLayout::new_where`]).
    pub fn from_module_where<BA, M>(
        module: &M,
        config: BufferConfig,
        keep: impl Fn(&ParamInfo) -> bool,
    ) -> crate::Result<Self>
    where
        BA: AutodiffBackend<InnerBackend = B>,
        M: Module<BA> + DeclarePlacements,
    {
        let infos = try_param_infos(module)?;
        let layout = BufferLayout::new_where(&infos, config, keep)?;
        struct Copy<'a, B: Backend> {
            layout: &'a BufferLayout,
            buffer: Option<Tensor<B, 1>>,
            dtypes: Vec<DType>,
        }
        impl<BA: AutodiffBackend> ModuleVisitor<BA> for Copy<'_, BA::InnerBackend> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<BA, D>>) {
                let Some(slot) = self.layout.slot(param.id) else {
                    return;
                };
                let value = param.val().inner();
                self.dtypes.push(value.dtype());
                let device = value.device();
                let flat = value.cast(DType::F32).reshape([slot.numel]);
                let buffer = self
                    .buffer
                    .take()
                    .unwrap_or_else(|| Tensor::zeros([self.layout.numel()], (&device, DType::F32)));
                self.buffer = Some(buffer.slice_assign(slot.range(), flat));
            }
        }
        let mut copy = Copy {
            layout: &layout,
            buffer: None,
            dtypes: Vec::new(),
        };
        module.visit(&mut copy);
        let Some(main_params) = copy.buffer.take() else {
            return Err(ConfigError::Invalid(
                "a flat buffer needs a module with at least one float parameter".into(),
            )
            .into());
        };
        let grads = Tensor::empty([0], (&main_params.device(), DType::F32));
        let model_dtype = copy.dtypes.first().copied().unwrap_or(DType::F32);
        if let Some(other) = copy.dtypes.iter().find(|d| **d != model_dtype) {
            return Err(ConfigError::Invalid(format!(
                "a flat buffer holds parameters of one dtype: found {model_dtype:?} and {other:?}"
            ))
            .into());
        }
        if !matches!(model_dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(ConfigError::Invalid(format!(
                "flat buffers keep fp32 master weights for f32, f16 or bf16 parameters, \
                 not {model_dtype:?}"
            ))
            .into());
        }
        Ok(Self {
            layout,
            model_dtype,
            main_params,
            grads,
        })
    }

    /// The layout.
    pub fn layout(&self) -> &BufferLayout {
        &self.layout
    }

    /// The dtype of the model's parameters.
    pub fn model_dtype(&self) -> DType {
        self.model_dtype
    }

    /// The fp32 master weights, `[numel]`.
    pub fn main_params(&self) -> Tensor<B, 1> {
        self.main_params.clone()
    }

    /// The fp32 gradients of the last [`gather_grads`](Self::gather_grads), `[numel]`, until
    /// [`release_grads`](Self::release_grads) (empty before and after).
    pub fn grads(&self) -> Tensor<B, 1> {
        self.grads.clone()
    }

    /// Frees the gradient buffer (the optimizer step is done with it); the next
    /// [`gather_grads`](Self::gather_grads) allocates it again.
    pub fn release_grads(&mut self) {
        let device = self.grads.device();
        self.grads = Tensor::empty([0], (&device, DType::F32));
    }

    /// Moves the master weights out (an empty tensor left behind), so that the optimizer can
    /// update them in place when nothing else holds them.
    pub(crate) fn take_main_params(&mut self) -> Tensor<B, 1> {
        let device = self.main_params.device();
        std::mem::replace(
            &mut self.main_params,
            Tensor::empty([0], (&device, DType::F32)),
        )
    }

    /// Replaces the master weights (`[numel]` f32): the fused optimizer's output.
    pub(crate) fn set_main_params(&mut self, main_params: Tensor<B, 1>) {
        self.main_params = main_params;
    }

    /// Copies `module`'s gradients from `grads` into the gradient buffer, cast to f32
    /// ([`WriteSlotOps::write_slot`](crate::ops::WriteSlotOps::write_slot): one kernel a
    /// parameter, in place, on CubeCL backends).
    /// Every parameter of `module` must be in the buffer and have a gradient of its shape:
    /// else an [`InputError`] naming it, and the buffer is left as it was.
    pub fn gather_grads<BA, M>(&mut self, module: &M, grads: &GradientsParams) -> crate::Result<()>
    where
        B: crate::backend::ModelBackend,
        BA: AutodiffBackend<InnerBackend = B>,
        M: Module<BA>,
    {
        let pieces = collect_grads::<BA, M>(&self.layout, module, grads, &[])?;
        // Written in place when the buffer is not shared; padding keeps its zeros.
        let device = self.main_params.device();
        let mut buffer =
            std::mem::replace(&mut self.grads, Tensor::empty([0], (&device, DType::F32)));
        if buffer.dims()[0] != self.layout.numel() {
            buffer = Tensor::zeros([self.layout.numel()], (&device, DType::F32));
        }
        for (id, grad) in pieces {
            let start = self
                .layout
                .slot(id)
                .expect("collected from the layout")
                .offset;
            buffer = B::write_slot(buffer, start, grad);
        }
        self.grads = buffer;
        Ok(())
    }

    /// `module` with every parameter replaced by its slice of `values` (`[numel]`, the model's
    /// dtype, e.g. the master weights or their cast): views, not copies, where the backend's
    /// alignment allows. `require_grad` is kept. Parameters outside the buffer keep their
    /// values.
    pub fn write_params<BA, M>(&self, module: M, values: Tensor<B, 1>) -> M
    where
        BA: AutodiffBackend<InnerBackend = B>,
        M: Module<BA>,
    {
        self.write_params_with(module, |slot| values.clone().slice(slot.range()))
    }

    /// [`write_params`](Self::write_params) with each parameter's values (`[numel]`, the
    /// model's dtype) given by `values` for its slot: e.g. a view of its bucket of a bucketed
    /// gather ([`GatheredParams::param`](super::GatheredParams::param)).
    pub fn write_params_with<BA, M>(
        &self,
        module: M,
        values: impl FnMut(&ParamSlot) -> Tensor<B, 1>,
    ) -> M
    where
        BA: AutodiffBackend<InnerBackend = B>,
        M: Module<BA>,
    {
        struct Write<'a, F> {
            layout: &'a BufferLayout,
            values: F,
        }
        impl<BA, F> ModuleMapper<BA> for Write<'_, F>
        where
            BA: AutodiffBackend,
            F: FnMut(&ParamSlot) -> Tensor<BA::InnerBackend, 1>,
        {
            fn map_float<const D: usize>(
                &mut self,
                param: Param<Tensor<BA, D>>,
            ) -> Param<Tensor<BA, D>> {
                let Some(slot) = self.layout.slot(param.id) else {
                    return param;
                };
                let values = (self.values)(slot);
                param.map(|old| {
                    let require_grad = old.is_require_grad();
                    let dims = old.dims();
                    drop(old);
                    let new = Tensor::from_inner(values.reshape(dims));
                    if require_grad {
                        new.require_grad()
                    } else {
                        new
                    }
                })
            }
        }
        module.map(&mut Write {
            layout: &self.layout,
            values,
        })
    }
}

/// `module`'s gradients from `grads`, flattened (`[numel]`, their own dtype), for every
/// parameter of `layout` except those in `skip`, in visiting order. Every parameter of
/// `module` must be in the layout and (unless skipped) have a gradient of its shape: else an
/// [`InputError`] naming it.
pub(crate) fn collect_grads<BA, M>(
    layout: &BufferLayout,
    module: &M,
    grads: &GradientsParams,
    skip: &[ParamId],
) -> crate::Result<Vec<(ParamId, Tensor<BA::InnerBackend, 1>)>>
where
    BA: AutodiffBackend,
    M: Module<BA>,
{
    struct Gather<'a, B: Backend> {
        layout: &'a BufferLayout,
        grads: &'a GradientsParams,
        skip: &'a [ParamId],
        path: Path,
        seen: usize,
        pieces: Vec<(ParamId, Tensor<B, 1>)>,
        error: Option<InputError>,
    }
    impl<BA: AutodiffBackend> ModuleVisitor<BA> for Gather<'_, BA::InnerBackend> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<BA, D>>) {
            if self.error.is_some() {
                return;
            }
            let path = self.path.current();
            if self.layout.excludes(param.id) {
                return;
            }
            let Some(slot) = self.layout.slot(param.id) else {
                self.error = Some(InputError::UnknownParameter { path });
                return;
            };
            self.seen += 1;
            if self.skip.contains(&param.id) {
                return;
            }
            let Some(grad) = self.grads.get::<BA::InnerBackend, D>(param.id) else {
                self.error = Some(InputError::MissingGradient { path });
                return;
            };
            if grad.dims().as_slice() != slot.shape.as_slice() {
                self.error = Some(InputError::GradientShape {
                    path,
                    expected: slot.shape.clone(),
                    got: grad.dims().to_vec(),
                });
                return;
            }
            self.pieces.push((param.id, grad.reshape([slot.numel])));
        }
    }
    let mut gather = Gather {
        layout,
        grads,
        skip,
        path: Path::default(),
        seen: 0,
        pieces: Vec::with_capacity(layout.params().len()),
        error: None,
    };
    module.visit(&mut gather);
    if let Some(error) = gather.error {
        return Err(error.into());
    }
    if gather.seen != layout.params().len() {
        return Err(ConfigError::Invalid(format!(
            "the module has {} of the buffer's {} parameters: pass the module the buffer \
             was built from",
            gather.seen,
            layout.params().len()
        ))
        .into());
    }
    Ok(gather.pieces)
}
