//! Expert parallelism against the single-device layer: EP = 1, 2, 4 over four experts, top-1
//! and top-2, SwiGLU and GeLU, with and without a shared expert, and batches where experts
//! (and so whole ranks) get no tokens.
//!
//! Each rank routes its own batch (of its own length). The reference runs the EP = 1 layer on
//! every rank's batch in turn and backpropagates the sum of the ranks' losses, so:
//! - each rank's output, losses and input gradient equal the reference's for its batch;
//! - the experts' gradients, gathered over EP in rank order, equal the reference's;
//! - the replicated parameters' (router, shared expert) gradients, summed over the ranks
//!   (what data parallelism does), equal the reference's.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::transformer::Activation;
use burn_megatron::transformer::moe::{
    BlockPadding, Exchange, MoeConfig, MoeLayer, RouterScoreFunction, TokenDispatcher,
    TokenDispatcherType,
};
use burn_megatron_dist::ParallelSizes;

use crate::{AD, B, assert_close, run, tolerance, values};

const HIDDEN: usize = 8;
const EXPERTS: usize = 4;
const SEED: u64 = 7;

// ANCHOR: config
pub(crate) fn config(top_k: usize, activation: Activation, shared: bool) -> MoeConfig {
    MoeConfig::new(HIDDEN, EXPERTS, 6)
        .with_top_k(top_k)
        .with_pre_softmax(top_k == 1)
        .with_activation(activation)
        .with_shared_expert_ffn_hidden_size(shared.then_some(5))
        .with_aux_loss_coeff(0.01)
        .with_z_loss_coeff(0.001)
        .with_init_std(0.3)
}
// ANCHOR_END: config

/// Whether experts 2 and 3 are kept from every token.
#[derive(Clone, Copy, PartialEq, Debug)]
pub(crate) enum Routing {
    /// As the router draws it.
    Free,
    /// Feature 0 of every token is 4 and the router weights it by -3 for experts 2 and 3:
    /// their logits are ~12 below the others', so experts 2 and 3 (rank 1 at EP 2, ranks 2
    /// and 3 at EP 4) never get a token, forward or backward.
    StarveExperts23,
}

/// Rank `rank`'s batch, `[2, 2 + rank, HIDDEN]`, and the weights of its loss `Σ probe ∘ y`.
pub(crate) fn batch(rank: usize, routing: Routing) -> (Tensor<B, 3>, Tensor<B, 3>) {
    let shape = [2, 2 + rank, HIDDEN];
    let normal = |seed| {
        init_full::<B, 3>(
            shape,
            InitDistribution::Normal { std: 1.0 },
            seed,
            &Default::default(),
        )
    };
    let mut x = normal(100 + rank as u64);
    if routing == Routing::StarveExperts23 {
        let [b, s, _] = shape;
        x = x.slice_assign(
            [0..b, 0..s, 0..1],
            Tensor::full([b, s, 1], 4.0, &Default::default()),
        );
    }
    (x, normal(200 + rank as u64))
}

fn layer(
    config: &MoeConfig,
    ep: &burn_megatron_dist::ProcessGroup,
    routing: Routing,
) -> MoeLayer<AD> {
    let mut layer = config
        .init::<AD>(ep, SEED, &Default::default())
        .expect("a valid MoE configuration");
    if routing == Routing::StarveExperts23 {
        layer.router.weight = layer.router.weight.map(|w| {
            let w = w.inner().slice_assign(
                [0..1, 2..4],
                Tensor::full([1, 2], -3.0, &Default::default()),
            );
            Tensor::from_inner(w).require_grad()
        });
    }
    layer
}

/// Each parameter's path and gradient.
pub(crate) type Grads = Vec<(String, Vec<f64>)>;

/// One batch's results on one rank.
pub(crate) struct Outcome {
    pub(crate) output: Vec<f64>,
    pub(crate) load_balancing_loss: f64,
    pub(crate) z_loss: f64,
    pub(crate) input_grad: Vec<f64>,
    pub(crate) tokens_per_expert: Vec<usize>,
}

/// Every float parameter's path and gradient; a parameter without one fails the test.
fn grads(
    layer: &MoeLayer<AD>,
    grads: &<AD as AutodiffBackend>::Gradients,
) -> Vec<(String, Vec<f64>)> {
    struct Collect<'a> {
        path: Vec<String>,
        grads: &'a <AD as AutodiffBackend>::Gradients,
        out: Vec<(String, Vec<f64>)>,
    }
    impl ModuleVisitor<AD> for Collect<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AD, D>>) {
            let path = self.path.join(".");
            let grad = param
                .grad(self.grads)
                .unwrap_or_else(|| panic!("{path} has no gradient"));
            self.out.push((path, values(grad)));
        }
    }
    let mut collect = Collect {
        path: Vec::new(),
        grads,
        out: Vec::new(),
    };
    layer.visit(&mut collect);
    collect.out
}

/// The reference: the EP = 1 layer on each of `ranks` batches, one backward of their summed
/// losses. Returns each batch's outcome and the parameters' gradients. It always runs the
/// all-to-all dispatcher (at EP 1 a local sort) with the blocks as they are (the CPU backend
/// pads none), whichever `config` tests.
pub(crate) fn reference(
    config: &MoeConfig,
    ranks: usize,
    routing: Routing,
) -> (Vec<Outcome>, Grads) {
    let config = &config
        .clone()
        .with_token_dispatcher(TokenDispatcherType::AllToAll)
        .with_block_padding(BlockPadding::Backend);
    run(1, |ctx| {
        let layer = layer(config, ctx.world(), routing);
        let mut total: Option<Tensor<AD, 1>> = None;
        let mut kept = Vec::new();
        for rank in 0..ranks {
            let (x, probe) = batch(rank, routing);
            let x = Tensor::<AD, 3>::from_inner(x).require_grad();
            let out = layer.try_forward(x.clone())?;
            let loss = (out.output.clone() * Tensor::from_inner(probe)).sum() + out.aux_loss();
            total = Some(match total {
                Some(t) => t + loss,
                None => loss,
            });
            kept.push((x, out));
        }
        let g = total.expect("at least one rank").backward();
        let outcomes = kept
            .into_iter()
            .map(|(x, out)| Outcome {
                output: values(out.output),
                load_balancing_loss: values(out.load_balancing_loss)[0],
                z_loss: values(out.z_loss)[0],
                input_grad: values(x.grad(&g).expect("the input's gradient")),
                tokens_per_expert: out.tokens_per_expert,
            })
            .collect();
        Ok((outcomes, grads(&layer, &g)))
    })
    .pop()
    .expect("one rank")
}

/// The layer on `ep` thread ranks: each rank's outcome and gradients.
pub(crate) fn expert_parallel(
    config: &MoeConfig,
    ep: usize,
    routing: Routing,
) -> Vec<(Outcome, Grads)> {
    run(ep, |ctx| {
        // ANCHOR: ep_rank
        let state = ctx.parallel_state(ParallelSizes::default().with_ep(ep))?;
        let layer = layer(config, state.ep(), routing);
        let (x, probe) = batch(state.ep().rank(), routing);
        let x = Tensor::<AD, 3>::from_inner(x).require_grad();
        let out = layer.try_forward(x.clone())?;
        let loss = (out.output.clone() * Tensor::from_inner(probe)).sum() + out.aux_loss();
        let g = loss.backward();
        // ANCHOR_END: ep_rank
        let outcome = Outcome {
            output: values(out.output),
            load_balancing_loss: values(out.load_balancing_loss)[0],
            z_loss: values(out.z_loss)[0],
            input_grad: values(x.grad(&g).expect("the input's gradient")),
            tokens_per_expert: out.tokens_per_expert,
        };
        Ok((outcome, grads(&layer, &g)))
    })
}

/// Every rank's results equal the reference's for its batch; the gradients as the module doc
/// says.
pub(crate) fn assert_equivalent(name: &str, config: &MoeConfig, routing: Routing) {
    for ep in [1, 2, 4] {
        let at = |what: &str| format!("{name} EP={ep} {routing:?}: {what}");
        let (want, want_grads) = reference(config, ep, routing);
        if routing == Routing::StarveExperts23 {
            for outcome in &want {
                assert_eq!(
                    outcome.tokens_per_expert[2..],
                    [0, 0],
                    "experts 2 and 3 starve"
                );
            }
        }
        let got = expert_parallel(config, ep, routing);
        for (rank, ((g, _), w)) in got.iter().zip(&want).enumerate() {
            let at = |what: &str| at(&format!("rank {rank} {what}"));
            assert_eq!(
                g.tokens_per_expert,
                w.tokens_per_expert,
                "{}",
                at("routing")
            );
            assert_close(&at("output"), &g.output, &w.output, tolerance::F32);
            assert_close(
                &at("input gradient"),
                &g.input_grad,
                &w.input_grad,
                tolerance::F32,
            );
            let losses = |o: &Outcome| [o.load_balancing_loss, o.z_loss];
            assert_close(&at("losses"), &losses(g), &losses(w), tolerance::F32);
        }
        for (i, (path, want)) in want_grads.iter().enumerate() {
            let per_rank = got.iter().map(|(_, grads)| {
                assert_eq!(&grads[i].0, path, "the same parameters on every rank");
                &grads[i].1
            });
            let combined: Vec<f64> = if path.starts_with("experts.") {
                per_rank.flatten().copied().collect()
            } else {
                per_rank.fold(vec![0.0; want.len()], |sum, g| {
                    sum.iter().zip(g).map(|(a, b)| a + b).collect()
                })
            };
            assert_close(
                &at(&format!("gradient of {path}")),
                &combined,
                want,
                tolerance::F32,
            );
        }
    }
}

#[test]
fn top1_swiglu() {
    assert_equivalent(
        "top-1 SwiGLU",
        &config(1, Activation::SwiGlu, false),
        Routing::Free,
    );
}

#[test]
fn top2_swiglu_shared_expert() {
    assert_equivalent(
        "top-2 SwiGLU shared",
        &config(2, Activation::SwiGlu, true),
        Routing::Free,
    );
}

#[test]
fn top2_gelu_sigmoid_normalized() {
    let config = config(2, Activation::Gelu, false)
        .with_score_function(RouterScoreFunction::Sigmoid)
        .with_normalize_top_k(true);
    assert_equivalent("top-2 GeLU sigmoid", &config, Routing::Free);
}

#[test]
fn top1_with_starved_experts() {
    assert_equivalent(
        "top-1 SwiGLU",
        &config(1, Activation::SwiGlu, true),
        Routing::StarveExperts23,
    );
}

#[test]
fn top2_with_starved_experts() {
    assert_equivalent(
        "top-2 GeLU",
        &config(2, Activation::Gelu, false),
        Routing::StarveExperts23,
    );
}

/// Eight experts: two a rank at EP 4, four at EP 2, so each rank's block from every source
/// holds several experts' tokens, which the receiver regroups by expert.
#[test]
fn top2_eight_experts() {
    let config = MoeConfig {
        num_experts: 8,
        ..config(2, Activation::SwiGlu, true)
    };
    assert_equivalent("top-2 eight experts", &config, Routing::Free);
}

/// Experts that get no tokens still have gradients (zeros), on every rank.
#[test]
fn starved_experts_have_zero_gradients() {
    let config = config(2, Activation::SwiGlu, false);
    for (rank, (_, grads)) in expert_parallel(&config, 4, Routing::StarveExperts23)
        .into_iter()
        .enumerate()
    {
        for (path, grad) in grads.iter().filter(|(p, _)| p.starts_with("experts.")) {
            let largest = grad.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            if rank >= 2 {
                assert_eq!(largest, 0.0, "rank {rank} {path}");
            } else {
                assert!(largest > 0.0, "rank {rank} {path} should be trained");
            }
        }
    }
}

/// Counts per expert that disagree with the routing (as the BF16-rounded counts of the first
/// GPU run did) fail the plan on every rank alike, before any row index is built from them,
/// whichever the dispatcher. With right counts, the all-to-all plan's blocks are the counts,
/// unpadded, and the all-gather plan's rows a rank are its tokens.
#[test]
fn counts_that_disagree_with_the_routing_fail_every_rank() {
    for kind in [
        TokenDispatcherType::AllToAll,
        TokenDispatcherType::AllGather,
    ] {
        let errors = run(2, |ctx| {
            let state = ctx.parallel_state(ParallelSizes::default().with_ep(2))?;
            let dispatcher = TokenDispatcher::new(state.ep(), EXPERTS, kind);
            let device = Default::default();
            // Three tokens, top-2: experts [0, 1], [1, 3], [2, 1], so counts [1, 3, 1, 1].
            let experts = Tensor::<B, 2, Int>::from_data(
                TensorData::new(vec![0i64, 1, 1, 3, 2, 1], [3, 2]),
                &device,
            );
            let counts = |c: [i64; EXPERTS]| {
                Tensor::<B, 1, Int>::from_data(TensorData::new(c.to_vec(), [EXPERTS]), &device)
            };
            let plan = dispatcher.plan(experts.clone(), counts([1, 3, 1, 1]))?;
            assert_eq!(plan.tokens_per_expert, [1, 3, 1, 1]);
            // Rank 0's experts 0 and 1 get 1 + 3 rows from each rank, rank 1's 1 + 1.
            let expected_received = match state.ep().rank() {
                0 => [2, 6],
                _ => [2, 2],
            };
            assert_eq!(plan.local_counts, expected_received);
            match (&plan.exchange, kind) {
                (Exchange::AllToAll(rows), TokenDispatcherType::AllToAll) => {
                    // Each rank sends each rank the rows of its experts only (1 + 3 to rank
                    // 0's experts 0 and 1, 1 + 1 to rank 1's), unpadded, and receives what
                    // every rank sends it.
                    assert_eq!(rows.send_splits, [4, 2]);
                    let expected_recv = match state.ep().rank() {
                        0 => [4, 4],
                        _ => [2, 2],
                    };
                    assert_eq!(rows.recv_splits, expected_recv);
                }
                (Exchange::AllGather(rows), TokenDispatcherType::AllGather) => {
                    assert_eq!(rows.rows_per_rank, 3);
                }
                (exchange, kind) => panic!("{kind:?} planned {exchange:?}"),
            }
            // Rank 1's count of expert 1 one short, as BF16 rounds 257 to 256.
            let wrong = match state.ep().rank() {
                0 => [1, 3, 1, 1],
                _ => [1, 2, 1, 1],
            };
            Ok(dispatcher
                .plan(experts, counts(wrong))
                .err()
                .map(|e| e.to_string()))
        });
        for (rank, error) in errors.into_iter().enumerate() {
            let error =
                error.unwrap_or_else(|| panic!("{kind:?} rank {rank}: the plan took wrong counts"));
            assert!(
                error.contains("EP rank 1's counts per expert add up to 5, not to its 6"),
                "{kind:?} rank {rank}: {error}"
            );
        }
    }
}

/// Megatron's routing options at EP 1, 2 and 4: pre-softmax top-2 with the sequence-level
/// loss; DeepSeek-V3's router over eight experts (sigmoid, four groups of two, a token's
/// experts from its best two groups, weights normalised and scaled by 2.5, the
/// sequence-level loss) with and without starved experts.
#[test]
fn router_features() {
    use burn_megatron::transformer::moe::LoadBalancingType;
    let pre_softmax = config(2, Activation::SwiGlu, true)
        .with_pre_softmax(true)
        .with_load_balancing_type(LoadBalancingType::SeqAuxLoss);
    assert_equivalent("pre-softmax seq_aux_loss", &pre_softmax, Routing::Free);
    let deepseek = MoeConfig {
        num_experts: 8,
        ..config(2, Activation::SwiGlu, true)
    }
    .with_score_function(RouterScoreFunction::Sigmoid)
    .with_num_groups(Some(4))
    .with_group_top_k(Some(2))
    .with_top_k_scaling_factor(Some(2.5))
    .with_load_balancing_type(LoadBalancingType::SeqAuxLoss);
    assert_equivalent("DeepSeek-V3 router", &deepseek, Routing::Free);
    let deepseek_top4 = MoeConfig {
        top_k: 4,
        ..deepseek
    };
    assert_equivalent("DeepSeek-V3 router top-4", &deepseek_top4, Routing::Free);
}
