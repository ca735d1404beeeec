//! The evaluation step: a schedule's forward passes only, on any backend (pass the chunks'
//! `valid()` models to run without the autodiff graph).

use burn::module::Module;
use burn::tensor::Tensor;

use super::exchange::Mailbox;
use super::executor::{Groups, internal};
use super::plan::{Payload, Plan, Step};
use crate::backend::ModelBackend;
use crate::data::Microbatch;
use crate::error::Result;
use crate::models::GptModel;

/// Runs this rank's forward steps of `plan` and returns the mean of the microbatches' losses
/// on the last stage (`None` elsewhere).
pub(crate) fn run<B: ModelBackend>(
    plan: &Plan,
    groups: &Groups,
    chunks: &[GptModel<B>],
    microbatches: &[Microbatch<B>],
) -> Result<Option<Tensor<B, 1>>> {
    let device = chunks[0].devices().into_iter().next().unwrap_or_default();
    let dtype = Tensor::<B, 1>::zeros([1], &device).dtype();
    let mut mailbox = Mailbox::<B>::new();
    let mut losses = Vec::new();
    for step in plan.steps(groups.pp_rank) {
        match step {
            Step::Forward(c) => {
                let model = &chunks[c.chunk];
                let data = &microbatches[c.microbatch];
                let call = model.next_call();
                let mut x = if model.stage().is_first() {
                    model.embed(data.tokens.clone(), call)?
                } else {
                    mailbox
                        .arrived
                        .remove(&(Payload::Activation, *c))
                        .ok_or_else(|| internal("forward pass before its input arrived".into()))?
                };
                for layer in model.layers() {
                    x = layer.try_forward(x, call)?;
                }
                if model.stage().is_last() {
                    losses.push(model.loss(model.head(x)?, data.targets.clone())?);
                } else {
                    mailbox.outgoing.insert((Payload::Activation, *c), x);
                }
            }
            Step::Backward(_) => {
                return Err(internal(
                    "a forward-only plan has no backward passes".into(),
                ));
            }
            Step::Exchange(transfers) => {
                let pp = groups.pp.as_ref().ok_or_else(|| {
                    internal("a plan with exchanges needs a pipeline group".into())
                })?;
                let shape = |t: &super::plan::Transfer| {
                    let [batch, seq] = microbatches[t.microbatch].tokens.dims();
                    chunks[t.chunk].activation_shape(batch, seq)
                };
                mailbox.exchange(pp, transfers, shape, dtype, &device)?;
            }
        }
    }
    Ok((!losses.is_empty()).then(|| {
        let count = losses.len();
        Tensor::cat(losses, 0).sum().div_scalar(count as f64)
    }))
}
