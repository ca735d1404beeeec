//! The weight-decay policy: which parameters weight decay applies to, classified by their
//! path in the module, and the split of a step's gradients into the two groups.
//!
//! Megatron's default (`_get_param_groups` in `megatron/core/optimizer/__init__.py`) exempts
//! biases (a name ending in `bias`) and every other one-dimensional parameter, which in a
//! transformer are the norms' scales and shifts. Burn's optimizers apply one weight decay to
//! every parameter they step, so the groups are applied by stepping two optimizers (one with
//! weight decay, one without) on the two halves of the gradients:
//!
//! ```ignore
//! let groups = WeightDecayPolicy::default().groups(&model);
//! let (decay, no_decay) = groups.split(&model, grads);
//! model = adamw_with_decay.step(lr, model, decay);
//! model = adamw_without_decay.step(lr, model, no_decay);
//! ```

use std::collections::HashSet;

use burn::config::Config;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

pub use crate::tensor_parallel::ParamKind;
use crate::tensor_parallel::{DeclarePlacements, ParamInfo, param_infos};

/// Which parameter kinds weight decay applies to: Megatron's default exempts biases and norms
/// (its `no_weight_decay_cond` hook is the general form).
#[derive(Config, Debug, Copy, PartialEq)]
pub struct WeightDecayPolicy {
    /// Decay biases too.
    #[config(default = false)]
    pub decay_biases: bool,
    /// Decay norms' scales and shifts too.
    #[config(default = false)]
    pub decay_norms: bool,
}

impl Default for WeightDecayPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl WeightDecayPolicy {
    /// Whether weight decay applies to a parameter of `kind`.
    pub fn decays(&self, kind: ParamKind) -> bool {
        match kind {
            ParamKind::Bias => self.decay_biases,
            ParamKind::Norm => self.decay_norms,
            ParamKind::Weight => true,
        }
    }

    /// `module`'s float parameters in the two groups.
    pub fn groups<B: Backend, M: Module<B> + DeclarePlacements>(&self, module: &M) -> ParamGroups {
        let (mut decay, mut no_decay) = (Vec::new(), Vec::new());
        for info in param_infos(module) {
            let kind = ParamKind::of(&info.path, &info.shape);
            if self.decays(kind) {
                decay.push(info);
            } else {
                no_decay.push(info);
            }
        }
        ParamGroups { decay, no_decay }
    }
}

/// A module's parameters split by the [`WeightDecayPolicy`], each in visiting order.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamGroups {
    /// Parameters weight decay applies to.
    pub decay: Vec<ParamInfo>,
    /// Parameters exempt from weight decay.
    pub no_decay: Vec<ParamInfo>,
}

impl ParamGroups {
    /// Splits `grads` (of `module`, the module the groups were made from) into the gradients
    /// of the decayed parameters and those of the exempt ones. Gradients of parameters
    /// outside `module` go with the decayed group.
    pub fn split<B: AutodiffBackend, M: Module<B>>(
        &self,
        module: &M,
        mut grads: GradientsParams,
    ) -> (GradientsParams, GradientsParams) {
        struct Move<'a> {
            exempt: HashSet<ParamId>,
            from: &'a mut GradientsParams,
            to: GradientsParams,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Move<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if self.exempt.contains(&param.id)
                    && let Some(grad) = self.from.remove::<B::InnerBackend, D>(param.id)
                {
                    self.to.register(param.id, grad);
                }
            }
        }
        let mut visitor = Move {
            exempt: self.no_decay.iter().map(|p| p.id).collect(),
            from: &mut grads,
            to: GradientsParams::new(),
        };
        Module::<B>::visit(module, &mut visitor);
        let no_decay = visitor.to;
        (grads, no_decay)
    }
}
