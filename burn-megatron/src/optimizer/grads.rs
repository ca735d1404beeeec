//! Walks over a rank's gradients by the module's parameters: the per-parameter reductions
//! (sum of squares, any non-finite value) that clipping and loss scaling reduce over the
//! model-parallel group, and scaling every gradient by a device scalar. Nothing here reads a
//! value back to the host.

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, FloatDType, Tensor};

use crate::error::{InputError, Result};
use std::collections::HashSet;

use burn::module::ParamId;

use crate::tensor_parallel::Path;

/// A per-parameter reduction of a gradient to one f32 value.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Reduction {
    /// `Σ g²`, accumulated in f32.
    SumOfSquares,
    /// 1 if any element is NaN or ±∞, else 0.
    NonFinite,
}

/// Which parameters a reduction counts.
pub(crate) enum Counted<'a> {
    /// Every parameter this rank holds: for the overflow check, where a value seen twice
    /// does no harm.
    Every,
    /// The listed parameters only: for the norm, each parameter of the model once over the
    /// model-parallel group (TP-replicated parameters on TP rank 0, a tied embedding's copy
    /// on the last pipeline stage not at all).
    Only(&'a HashSet<ParamId>),
}

impl Counted<'_> {
    fn counts(&self, id: ParamId) -> bool {
        match self {
            Counted::Every => true,
            Counted::Only(ids) => ids.contains(&id),
        }
    }
}

/// The sum over the counted parameters of `module` of `reduction` of their gradients: a `[1]`
/// f32 tensor on `device` (0 when nothing counts). A parameter without a gradient is an
/// [`InputError::MissingGradient`].
pub(crate) fn reduce_grads<B: AutodiffBackend, M: Module<B>>(
    module: &M,
    grads: &GradientsParams,
    reduction: Reduction,
    counted: &Counted<'_>,
    device: &burn::tensor::Device<B::InnerBackend>,
) -> Result<Tensor<B::InnerBackend, 1>> {
    struct Reduce<'a, B: AutodiffBackend> {
        path: Path,
        grads: &'a GradientsParams,
        reduction: Reduction,
        counted: &'a Counted<'a>,
        total: Tensor<B::InnerBackend, 1>,
        missing: Option<String>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Reduce<'_, B> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.enter(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if self.missing.is_some() || !self.counted.counts(param.id) {
                return;
            }
            let path = self.path.current();
            let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) else {
                self.missing = Some(path);
                return;
            };
            let value = match self.reduction {
                Reduction::SumOfSquares => grad.cast(FloatDType::F32).powi_scalar(2).sum(),
                Reduction::NonFinite => grad
                    .is_finite()
                    .bool_not()
                    .any()
                    .float()
                    .cast(FloatDType::F32),
            };
            self.total = self.total.clone() + value;
        }
    }
    let mut visitor = Reduce::<B> {
        path: Path::default(),
        grads,
        reduction,
        counted,
        total: Tensor::<B::InnerBackend, 1>::zeros([1], (device, DType::F32)),
        missing: None,
    };
    module.visit(&mut visitor);
    match visitor.missing {
        Some(path) => Err(InputError::MissingGradient { path }.into()),
        None => Ok(visitor.total),
    }
}

/// Multiplies every gradient of `module`'s parameters in `grads` by `factor` (a `[1]` f32
/// tensor on the device), in f32, keeping each gradient's dtype. Gradients of other parameters are left as
/// they are; a parameter without a gradient is skipped.
pub(crate) fn scale_grads<B: AutodiffBackend, M: Module<B>>(
    module: &M,
    grads: &mut GradientsParams,
    factor: &Tensor<B::InnerBackend, 1>,
) {
    struct Scale<'a, B: AutodiffBackend> {
        grads: &'a mut GradientsParams,
        factor: &'a Tensor<B::InnerBackend, 1>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Scale<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                let factor = self.factor.clone().reshape([1; D]);
                let dtype = grad.dtype();
                // The product is taken in f32: a loss scale's reciprocal (2^-32 by default)
                // underflows in f16.
                let scaled = if dtype == DType::F32 {
                    grad * factor
                } else {
                    (grad.cast(FloatDType::F32) * factor).cast(dtype)
                };
                self.grads.register(param.id, scaled);
            }
        }
    }
    module.visit(&mut Scale::<B> { grads, factor });
}

/// One gradient container for a rank's model chunks, from the one per chunk a pipeline
/// schedule returns: what an optimizer that steps the chunks as one module (a `Vec` of them,
/// under the interleaved schedule) takes. Moves the tensors; copies nothing.
pub fn merge_chunk_grads<B: AutodiffBackend, M: Module<B>>(
    chunks: &[M],
    mut grads: Vec<GradientsParams>,
) -> GradientsParams {
    if grads.len() == 1 {
        return grads.pop().expect("one container");
    }
    struct Move<'a> {
        from: &'a mut GradientsParams,
        to: &'a mut GradientsParams,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Move<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if let Some(grad) = self.from.remove::<B::InnerBackend, D>(param.id) {
                self.to.register(param.id, grad);
            }
        }
    }
    let mut out = GradientsParams::new();
    for (chunk, mut from) in chunks.iter().zip(grads) {
        chunk.visit(&mut Move {
            from: &mut from,
            to: &mut out,
        });
    }
    out
}
