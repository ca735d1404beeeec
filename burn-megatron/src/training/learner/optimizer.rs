//! [`DistributedAdamW`] as a Burn [`Optimizer`], so that a burn-train `Learner` steps it.
//!
//! burn-train keeps the `Learner`'s optimizer private, yet the strategy needs what the step
//! produced (the global gradient norm) and the optimizer's sharded state (checkpoints). So
//! [`MegatronOptimizer`] is a handle: its clones share one optimizer, one goes into the
//! `Learner` and one into the [`MegatronStrategy`](super::MegatronStrategy).

use std::any::Any;
use std::sync::{Arc, Mutex, MutexGuard};

use burn::module::AutodiffModule;
use burn::optim::{GradientsParams, LearningRate, MultiGradientsParams, Optimizer};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use super::failure::fail;
use crate::backend::ModelBackend;
use crate::optimizer::DistributedAdamW;
use crate::optimizer::{DynamicLossScaler, LossScalerState};

/// The current fp16 loss scale, for a model's step: a handle on the
/// [`MegatronOptimizer`] that owns the scaler. It is type-erased so that a module can hold it
/// whatever its backend (a module's fields are cloned into its inference copy, whose backend
/// differs); [`scale`](Self::scale) gives the tensor back for the backend that made it.
#[derive(Clone)]
pub struct LossScale(Arc<dyn Fn() -> Box<dyn Any + Send> + Send + Sync>);

impl LossScale {
    /// The scale (`[1]` f32 on the device) for the next backward pass, or `None` when the
    /// optimizer has no loss scaler. Panics if `B` is not the backend of the optimizer's
    /// inner tensors, a programming error.
    pub fn scale<B: burn::tensor::backend::Backend>(&self) -> Option<Tensor<B, 1>> {
        *(self.0)()
            .downcast::<Option<Tensor<B, 1>>>()
            .unwrap_or_else(|_| panic!("LossScale read for another backend than its optimizer's"))
    }
}

impl core::fmt::Debug for LossScale {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("LossScale")
    }
}

struct Shared<B: AutodiffBackend> {
    optim: DistributedAdamW<B>,
    /// With fp16: the dynamic loss scaler the step divides out and updates.
    scaler: Option<DynamicLossScaler<B::InnerBackend>>,
    /// The last step's global gradient norm, `[1]` f32 on the device.
    grad_norm: Option<Tensor<B::InnerBackend, 1>>,
    /// The loss scale the last step's backward pass used, `[1]` f32 on the device.
    used_scale: Option<Tensor<B::InnerBackend, 1>>,
}

/// A shared handle on this rank's [`DistributedAdamW`]: data-parallel gradient reduction
/// (all-reduce, or reduce-scatter with the distributed optimizer), global-norm clipping over
/// every rank, the fused AdamW step on fp32 master weights, and the parameters' all-gather.
///
/// Burn's `Optimizer::step` cannot fail, so a failing step (a collective that timed out, a
/// rank that died) unwinds: under [`MegatronStrategy`](super::MegatronStrategy) the typed
/// error reaches [`pretrain_with_learner`](super::pretrain_with_learner)'s `Result`; under
/// another strategy it is a panic with the error's message, which thread and process
/// launchers turn into that rank's error, releasing the others.
///
/// With [`with_loss_scaler`](Self::with_loss_scaler) it is fp16's step: the loss scale is
/// divided out and an overflow skips the step, on the device.
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
    /// [`DistributedAdamWConfig::init`](crate::optimizer::DistributedAdamWConfig::init)).
    pub fn new(optim: DistributedAdamW<B>) -> Self {
        Self {
            shared: Arc::new(Mutex::new(Shared {
                optim,
                scaler: None,
                grad_norm: None,
                used_scale: None,
            })),
        }
    }

    /// With fp16's dynamic loss scaler: each step divides `scaler`'s scale out of the
    /// gradients, skips the update on every rank if any gradient overflowed, and updates the
    /// scale ([`DistributedAdamW::step_scaled`]). The model's step must multiply its loss by
    /// the same scale: give it [`loss_scale`](Self::loss_scale)
    /// ([`ParallelGpt::with_loss_scale`](super::ParallelGpt::with_loss_scale)).
    pub fn with_loss_scaler(self, scaler: DynamicLossScaler<B::InnerBackend>) -> Self {
        self.lock().scaler = Some(scaler);
        self
    }

    /// The loss scale the next backward pass must use, `[1]` f32 on the device; `None`
    /// without a loss scaler.
    pub fn current_loss_scale(&self) -> Option<Tensor<B::InnerBackend, 1>> {
        self.lock().scaler.as_ref().map(|s| s.scale())
    }

    /// A handle on [`current_loss_scale`](Self::current_loss_scale) for the model's step.
    pub fn loss_scale(&self) -> LossScale {
        let optim = self.clone();
        LossScale(Arc::new(move || {
            Box::new(optim.current_loss_scale()) as Box<dyn Any + Send>
        }))
    }

    /// The loss scale the last step's backward pass used.
    pub fn last_loss_scale(&self) -> Option<Tensor<B::InnerBackend, 1>> {
        self.lock().used_scale.clone()
    }

    /// The loss scaler's state, for a checkpoint (one read from the device; a device error is
    /// a [`DeviceError`](crate::error::DeviceError)).
    pub fn loss_scaler_state(
        &self,
    ) -> core::result::Result<Option<LossScalerState>, crate::error::DeviceError> {
        self.lock().scaler.as_ref().map(|s| s.state()).transpose()
    }

    /// Continues the loss scaler from a checkpoint's `state`.
    pub fn load_loss_scaler_state(&self, state: &LossScalerState) -> crate::Result<()> {
        if let Some(scaler) = self.lock().scaler.as_mut() {
            scaler.load_state(state)?;
        }
        Ok(())
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
        let Shared { optim, scaler, .. } = &mut *shared;
        let used_scale = scaler.as_ref().map(|s| s.scale());
        let step = match scaler.as_mut() {
            Some(scaler) => optim.step_scaled(lr, module, &grads, scaler),
            None => optim.step(lr, module, &grads),
        };
        match step {
            Ok(step) => {
                shared.grad_norm = Some(step.grad_norm);
                shared.used_scale = used_scale;
                step.model
            }
            Err(e) => {
                let rank = shared.optim.global_rank();
                drop(shared);
                fail(rank, "the distributed optimizer's step", e)
            }
        }
    }

    fn step_multi(&mut self, _: LearningRate, _: M, _: MultiGradientsParams) -> M {
        let rank = self.lock().optim.global_rank();
        let error = crate::error::ConfigError::Invalid(
            "MegatronOptimizer steps one device's gradients per rank: run one rank per device \
             (MegatronStrategy), not burn-train's multi-device strategy"
                .to_string(),
        );
        fail(rank, "the distributed optimizer's step", error.into())
    }

    fn to_record(&self) {}

    fn load_record(self, _: ()) -> Self {
        self
    }
}
