//! The mixture-of-experts layer (EP = 1, dropless): the gradient of `Σ probe ∘ y + aux_loss`
//! with respect to the input and every element of every parameter (router, routed experts,
//! shared expert), against central differences, for softmax and sigmoid routing, SwiGLU and
//! GeLU experts, top-1 and top-2, pre-softmax, group-limited routing with scaled weights and
//! the sequence-level load-balancing loss.
//!
//! Top-k is piecewise constant: a difference is exact only if no step changes a token's
//! choice. The layer is small and its scores well apart, so none does; a change would show as
//! a wildly wrong estimate, not a subtle one.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::transformer::Activation;
use burn_megatron::transformer::moe::{ExpertCapacity, TokenDropPolicy};
use burn_megatron::transformer::moe::{
    LoadBalancingType, MoeConfig, MoeLayer, RouterScoreFunction,
};
use burn_megatron_dist::ProcessGroup;
use burn_megatron_testing::{relative_difference, run, tolerance, values};

use crate::{AD, B, STEP, device};

const SHAPE: [usize; 3] = [2, 3, 4];

fn inputs() -> (Tensor<B, 3>, Tensor<B, 3>) {
    let normal = |seed| {
        init_full::<B, 3>(
            SHAPE,
            InitDistribution::Normal { std: 1.0 },
            seed,
            &device(),
        )
    };
    (normal(31), normal(32))
}

/// `Σ probe ∘ y + aux_loss` of `layer` on `x`.
fn loss(layer: &MoeLayer<B>, x: Tensor<B, 3>, probe: Tensor<B, 3>) -> f64 {
    let out = layer.forward(x);
    ((out.output.clone() * probe).sum() + out.aux_loss()).into_scalar()
}

/// Every float parameter's id and values.
fn parameters(layer: &MoeLayer<B>) -> Vec<(ParamId, Vec<f64>)> {
    struct Collect(Vec<(ParamId, Vec<f64>)>);
    impl ModuleVisitor<B> for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push((param.id, values(param.val())));
        }
    }
    let mut collect = Collect(Vec::new());
    layer.visit(&mut collect);
    collect.0
}

/// Every float parameter's path and gradient.
fn gradients(
    layer: &MoeLayer<AD>,
    grads: &burn_autodiff::grads::Gradients,
) -> Vec<(String, Vec<f64>)> {
    struct Collect<'a>(
        Vec<String>,
        &'a burn_autodiff::grads::Gradients,
        Vec<(String, Vec<f64>)>,
    );
    impl ModuleVisitor<AD> for Collect<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AD, D>>) {
            let path = self.0.join(".");
            let grad = param
                .grad(self.1)
                .unwrap_or_else(|| panic!("{path} has no gradient"));
            self.2.push((path, values(grad)));
        }
    }
    let mut collect = Collect(Vec::new(), grads, Vec::new());
    layer.visit(&mut collect);
    collect.2
}

/// Adds `delta` to element `index` of parameter `id`.
struct Perturb {
    id: ParamId,
    index: usize,
    delta: f64,
}

impl ModuleMapper<B> for Perturb {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if param.id != self.id {
            return param;
        }
        param.map(|value| {
            let shape = value.dims();
            let mut v = values(value);
            v[self.index] += self.delta;
            Tensor::from_data(TensorData::new(v, shape), &device())
        })
    }
}

fn check(name: &str, config: MoeConfig) {
    run(1, |ctx| {
        check_on(name, &config, ctx.world());
        Ok(())
    });
}

fn check_on(name: &str, config: &MoeConfig, group: &ProcessGroup) {
    let (x, probe) = inputs();
    let tracked: MoeLayer<AD> = config
        .init(group, 5, &device())
        .expect("valid configuration");
    let x_tracked = Tensor::<AD, 3>::from_inner(x.clone()).require_grad();
    let out = tracked.forward(x_tracked.clone());
    let grads = ((out.output.clone() * Tensor::from_inner(probe.clone())).sum() + out.aux_loss())
        .backward();
    let analytic = gradients(&tracked, &grads);
    let plain: MoeLayer<B> = config
        .init(group, 5, &device())
        .expect("valid configuration");
    // The input.
    let mut xs = values(x.clone());
    let estimate: Vec<f64> = (0..xs.len())
        .map(|i| {
            let mut shifted = |delta: f64| {
                xs[i] += delta;
                let x = Tensor::from_data(TensorData::new(xs.clone(), SHAPE), &device());
                xs[i] -= delta;
                loss(&plain, x, probe.clone())
            };
            (shifted(STEP) - shifted(-STEP)) / (2.0 * STEP)
        })
        .collect();
    let got = values(x_tracked.grad(&grads).expect("the input's gradient"));
    let diff = relative_difference(&format!("{name}: input"), &got, &estimate);
    assert!(
        diff < tolerance::FINITE_DIFFERENCE_F64,
        "{name}: input gradient off by {diff:.2e}"
    );
    // Every parameter, every element.
    for ((id, params), (path, got)) in parameters(&plain).into_iter().zip(analytic) {
        let estimate: Vec<f64> = (0..params.len())
            .map(|index| {
                let shifted = |delta| {
                    let layer = plain.clone().map(&mut Perturb { id, index, delta });
                    loss(&layer, x.clone(), probe.clone())
                };
                (shifted(STEP) - shifted(-STEP)) / (2.0 * STEP)
            })
            .collect();
        let diff = relative_difference(&format!("{name}: {path}"), &got, &estimate);
        assert!(
            diff < tolerance::FINITE_DIFFERENCE_F64,
            "{name}: gradient of {path} off by {diff:.2e}"
        );
    }
}

fn config(top_k: usize, activation: Activation) -> MoeConfig {
    MoeConfig::new(SHAPE[2], 4, 3)
        .with_top_k(top_k)
        .with_activation(activation)
        .with_shared_expert_ffn_hidden_size(Some(2))
        .with_aux_loss_coeff(0.1)
        .with_z_loss_coeff(0.05)
        .with_init_std(0.7)
}

#[test]
fn moe_softmax_top2_swiglu() {
    check("softmax top-2 SwiGLU", config(2, Activation::SwiGlu));
}

#[test]
fn moe_softmax_top1_gelu() {
    check(
        "softmax top-1 GeLU",
        config(1, Activation::Gelu).with_pre_softmax(true),
    );
}

/// `--moe-router-pre-softmax`: the weights are the softmax over all experts.
#[test]
fn moe_pre_softmax_top2_swiglu() {
    check(
        "pre-softmax top-2 SwiGLU",
        config(2, Activation::SwiGlu).with_pre_softmax(true),
    );
}

/// DeepSeek-V3's router: sigmoid scores, two groups of two experts, a token's two experts
/// from its best group, weights normalised and scaled by 2.5.
#[test]
fn moe_group_limited_sigmoid_scaled_swiglu() {
    let config = config(2, Activation::SwiGlu)
        .with_score_function(RouterScoreFunction::Sigmoid)
        .with_num_groups(Some(2))
        .with_group_top_k(Some(1))
        .with_top_k_scaling_factor(Some(2.5));
    check("group-limited sigmoid ×2.5 SwiGLU", config);
}

/// The sequence-level load-balancing loss (two sequences of three tokens), softmax and
/// sigmoid scores: its gradient reaches the router.
#[test]
fn moe_sequence_aux_loss() {
    let config =
        config(2, Activation::Gelu).with_load_balancing_type(LoadBalancingType::SeqAuxLoss);
    check("seq_aux_loss softmax top-2 GeLU", config.clone());
    check(
        "seq_aux_loss sigmoid top-2 GeLU",
        config.with_score_function(RouterScoreFunction::Sigmoid),
    );
}

#[test]
fn moe_sigmoid_top2_normalized_swiglu() {
    let config = config(2, Activation::SwiGlu)
        .with_score_function(RouterScoreFunction::Sigmoid)
        .with_normalize_top_k(true);
    check("sigmoid top-2 normalised SwiGLU", config);
}

/// A capacity that drops: 6 tokens · top-2 over 4 experts at factor 0.5 is a capacity of 2,
/// so at most 8 of the 12 assignments stay. Dropping is a mask, piecewise constant like
/// top-k: the gradient through the kept assignments (and none through the dropped ones)
/// must match the differences.
fn check_dropping(name: &str, policy: TokenDropPolicy, pad: bool) {
    let config = config(2, Activation::SwiGlu).with_capacity(Some(
        ExpertCapacity::new(0.5)
            .with_drop_policy(policy)
            .with_pad_to_capacity(pad),
    ));
    run(1, |ctx| {
        let layer: MoeLayer<B> = config
            .init(ctx.world(), 5, &device())
            .expect("valid configuration");
        let kept: usize = layer.forward(inputs().0).tokens_per_expert.iter().sum();
        assert!(kept <= 8, "{name}: {kept} of 12 assignments kept");
        check_on(name, &config, ctx.world());
        Ok(())
    });
}

#[test]
fn moe_capacity_drops_by_probs() {
    check_dropping("capacity 0.5, probs", TokenDropPolicy::Probs, false);
}

#[test]
fn moe_capacity_drops_by_position_padded() {
    check_dropping(
        "capacity 0.5, position, padded",
        TokenDropPolicy::Position,
        true,
    );
}
