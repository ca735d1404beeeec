//! [`DistributedAdamW`] as a Burn [`Optimizer`], so that a burn-train `Learner` steps it.
//!
//! burn-train keeps the `Learner`'s optimizer private, yet the strategy needs what the step
//! produced (the global gradient norm) and the optimizer's sharded state (checkpoints). So
//! [`MegatronOptimizer`] is a handle: its clones share one optimizer, one goes into the
//! `Learner` and one into the [`MegatronStrategy`](super::MegatronStrategy).

use std::sync::{Arc, Mutex, MutexGuard};

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use crate::backend::ModelBackend;
use crate::distributed::DistributedAdamW;

struct Shared<B: AutodiffBackend> {
    optim: DistributedAdamW<B>,
    /// The last step's global gradient norm, `[1]` f32 on the device.
    grad_norm: Option<Tensor<B::InnerBackend, 1>>,
}

/// A shared handle on this rank's [`DistributedAdamW`]: data-parallel gradient reduction
/// (all-reduce, or reduce-scatter with the distributed optimizer), global-norm clipping over
/// every rank, the fused AdamW step on fp32 master weights, and the parameters' all-gather.
///
/// Burn's `Optimizer::step` cannot fail, so a failing step (a collective that timed out, a
/// rank that died) panics with the error's message; thread and process launchers turn the
/// panic into that rank's error and release the others.
///
/// Its Burn record is empty: the state is sharded over data-parallel ranks and goes into our
/// sharded checkpoints (`MegatronStrategy::with_checkpoints`), never into burn-train's
/// per-epoch files, which the strategy refuses.
pub struct MegatronOptimizer<B: AutodiffBackend> {
    shared: Arc<Mutex<Shared<B>>>,
}

impl<B: AutodiffBackend> Clone for MegatronOptimizer<B> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<B> MegatronOptimizer<B>
where
    B: AutodiffBackend,
    B::InnerBackend: ModelBackend,
{
    /// A handle on `optim` (built for this rank's model by
    /// [`DistributedAdamWConfig::init`](crate::distributed::DistributedAdamWConfig::init)).
    pub fn new(optim: DistributedAdamW<B>) -> Self {
        Self {
            shared: Arc::new(Mutex::new(Shared {
                optim,
                grad_norm: None,
            })),
        }
    }

    /// The global gradient norm (before clipping) of the last step, `[1]` f32 on the device.
    pub fn last_grad_norm(&self) -> Option<Tensor<B::InnerBackend, 1>> {
        self.lock().grad_norm.clone()
    }

    /// Runs `f` on the optimizer (its state for checkpoints, loading a checkpoint).
    pub fn with<R>(&self, f: impl FnOnce(&mut DistributedAdamW<B>) -> R) -> R {
        f(&mut self.lock().optim)
    }

    fn lock(&self) -> MutexGuard<'_, Shared<B>> {
        // A panic while the lock was held left the optimizer as it was before that step.
        self.shared.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<B, M> Optimizer<M, B> for MegatronOptimizer<B>
where
    B: AutodiffBackend,
    B::InnerBackend: ModelBackend,
    M: AutodiffModule<B>,
{
    type Record = ();

    fn step(&mut self, lr: LearningRate, module: M, grads: GradientsParams) -> M {
        let mut shared = self.lock();
        match shared.optim.step(lr, module, &grads) {
            Ok(step) => {
                shared.grad_norm = Some(step.grad_norm);
                step.model
            }
            Err(e) => panic!("the distributed optimizer's step failed: {e}"),
        }
    }

    fn step_multi(&mut self, _: LearningRate, _: M, _: MultiGradientsParams) -> M {
        panic!(
            "MegatronOptimizer steps one device's gradients per rank: run one rank per device \
             (MegatronStrategy), not burn-train's multi-device strategy"
        )
    }

    fn to_record(&self) {}

    fn load_record(self, _: ()) -> Self {
        self
    }
}
