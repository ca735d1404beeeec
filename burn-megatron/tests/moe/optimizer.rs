//! The flat-buffer AdamW with routed experts: at EP 2 × DP 2 (expert-DP 2), with and without
//! the distributed optimizer (ZeRO-1), two steps give the parameters and the global gradient
//! norms of EP 1 on one rank whose microbatches are every DP rank's. Clipping is on with a
//! small threshold, so that a wrong norm (an expert counted twice, or once per EP rank too
//! few) changes every parameter. With the parameters all-gathered in buckets
//! (`overlap_param_gather`), the dense and the experts' buffers alike, the same bits as one
//! gather.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn_megatron::distributed::DataParallelConfig;
use burn_megatron::models::{GptModel, Stage};
use burn_megatron::optimizer::DistributedAdamWConfig;
use burn_megatron::pipeline_parallel::{Schedule, forward_backward};
use burn_megatron::tensor_parallel::{ParamPlacement, Placements};
use burn_megatron_dist::{ParallelSizes, ParallelState};
use burn_megatron_testing::models::microbatch;
use burn_megatron_testing::paired;

use crate::gpt_model::moe_gpt;
use crate::{AD, B, assert_close, run, tolerance, values};

/// Every parameter, whole (experts gathered over EP), by path.
pub(crate) fn full_params(
    model: &GptModel<AD>,
    state: &ParallelState,
) -> Result<Vec<(String, Vec<f64>)>, burn_megatron_dist::DistError> {
    struct Gather<'a> {
        path: Vec<String>,
        placements: Placements,
        state: &'a ParallelState,
        out: Result<Vec<(String, Vec<f64>)>, burn_megatron_dist::DistError>,
    }
    impl ModuleVisitor<AD> for Gather<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AD, D>>) {
            let placement: ParamPlacement = self.placements.get(param.id).expect("declared");
            let Ok(out) = &mut self.out else { return };
            let value: Tensor<B, D> = param.val().inner();
            let value = match placement.is_expert() {
                true => self.state.ep().all_gather(value, 0),
                false => Ok(value),
            };
            match value {
                Ok(v) => out.push((self.path.join("."), values(v))),
                Err(e) => self.out = Err(e),
            }
        }
    }
    let mut visitor = Gather {
        path: Vec::new(),
        placements: Placements::of(model),
        state,
        out: Ok(Vec::new()),
    };
    model.visit(&mut visitor);
    visitor.out
}

type Params = Vec<(String, Vec<f64>)>;

/// The relative tolerance of parameters after two AdamW steps (see `assert_same`).
const PARAMS_AFTER_ADAM: f64 = 1e-3;

/// Two steps at `(dp, ep)`: the parameters after them and the two gradient norms. With
/// `bucketed`, the parameters are all-gathered in buckets small enough to cut them.
fn two_steps(dp: usize, ep: usize, zero1: bool, bucketed: bool) -> (Params, Vec<f64>) {
    let config = moe_gpt();
    run(dp, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_ep(ep))?;
        let stage = Stage::whole(config.num_layers);
        let mut model = config.init_gpt_stage_with_ep::<AD>(
            state.tp(),
            state.ep(),
            &stage,
            &Default::default(),
        )?;
        let mut optim = DistributedAdamWConfig::new()
            .with_clip_grad(Some(0.05))
            .with_data_parallel(
                DataParallelConfig::new()
                    .with_use_distributed_optimizer(zero1)
                    .with_overlap_param_gather(bucketed)
                    .with_bucket_numel(if bucketed { 700 } else { 40_000_000 }),
            )
            .init(&model, &state, &[])?;
        let mut norms = Vec::new();
        for step in 0..2u64 {
            // Four microbatches a step: DP rank d reads its 4 / dp consecutive ones.
            let (d, per_rank) = (state.coords().dp as u64, 4 / dp as u64);
            let microbatches: Vec<_> = (0..per_rank)
                .map(|j| microbatch::<AD>(50, 4 * step + d * per_rank + j))
                .collect();
            let out = forward_backward(
                Schedule::NoPipelining,
                &state,
                std::slice::from_ref(&model),
                &microbatches,
            )?;
            let step = optim.step(1e-2, model, &out.grads[0])?;
            model = step.model;
            if bucketed {
                assert!(optim.param_gathers() > 1, "{}", optim.param_gathers());
            }
            norms.push(values(step.grad_norm)[0]);
        }
        Ok((full_params(&model, &state)?, norms))
    })
    .into_iter()
    .next()
    .expect("rank 0")
}

fn assert_same(name: &str, got: &(Params, Vec<f64>), want: &(Params, Vec<f64>)) {
    assert_close(
        &format!("{name}: gradient norms"),
        &got.1,
        &want.1,
        tolerance::F32,
    );
    for (path, g, w) in paired(name, &got.0, &want.0) {
        // Two AdamW steps divide each gradient by the root of its square: rounding in
        // gradients summed in another order (over DP and EP rather than microbatches) grows
        // to about 1e-4 of a parameter.
        assert_close(&format!("{name}: {path}"), g, w, PARAMS_AFTER_ADAM);
    }
}

#[test]
fn experts_reduced_over_expert_dp_and_counted_once_in_the_norm() {
    let want = two_steps(1, 1, false, false);
    assert!(
        want.1[0] > 0.05,
        "clipping must be active: norm {}",
        want.1[0]
    );
    assert_same("EP 2 x DP 2", &two_steps(2, 2, false, false), &want);
    let zero1 = two_steps(4, 2, true, false);
    assert_same("EP 2 x expert-DP 2, ZeRO-1", &zero1, &want);
    let bucketed = two_steps(4, 2, true, true);
    assert_close("bucketed gather: norms", &bucketed.1, &zero1.1, 0.0);
    for (path, g, w) in paired("bucketed gather", &bucketed.0, &zero1.0) {
        assert_close(&format!("bucketed gather: {path}"), g, w, 0.0);
    }
}
