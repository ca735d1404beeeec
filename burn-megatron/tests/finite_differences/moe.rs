//! The mixture-of-experts layer (EP = 1, dropless): the gradient of `Σ probe ∘ y + aux_loss`
//! with respect to the input and every element of every parameter (router, routed experts,
//! shared expert), against central differences, for softmax and sigmoid routing, SwiGLU and
//! GeLU experts, top-1 and top-2, pre-softmax, group-limited routing with scaled weights and
//! the sequence-level load-balancing loss; the router with Sinkhorn balancing; and the
//! all-gather token dispatcher at EP 2 over
//! thread ranks of different batch lengths (every rank's input and every parameter).
//!
//! Top-k is piecewise constant: a difference is exact only if no step changes a token's
//! choice. The layer is small and its scores well apart, so none does; a change would show as
//! a wildly wrong estimate, not a subtle one.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::transformer::Activation;
use burn_megatron::transformer::moe::{ExpertCapacity, TokenDispatcherType, TokenDropPolicy};
use burn_megatron::transformer::moe::{
    LoadBalancingType, MoeConfig, MoeLayer, RouterScoreFunction,
};
use burn_megatron_dist::{DistResult, ParallelSizes, ProcessGroup, ReduceOp};
use burn_megatron_testing::{assert_close, relative_difference, run, tolerance, values};

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

/// Each rank's input and gradients, analytic and estimated: the input's, and each
/// parameter's by path (a routed expert's: this rank's experts only).
type RankGradients = (
    Vec<f64>,
    Vec<f64>,
    Vec<(String, Vec<f64>)>,
    Vec<(String, Vec<f64>)>,
);

/// The layer at EP 2 with the all-gather dispatcher, ranks of 6 and 3 tokens (so rank 1's
/// tokens are padded in the all-gathers): the gradient of the ranks' summed loss
/// `Σ_r (Σ probe_r ∘ y_r + aux_loss_r)` with respect to every rank's input and every element
/// of every parameter, against central differences of that sum (all-reduced, so every rank
/// evaluates it). A replicated parameter (router, shared expert) moves on both ranks at once
/// and its gradient is the sum of the ranks' (what data parallelism sums); a routed expert's
/// moves on its own rank only.
fn check_expert_parallel(name: &str, config: MoeConfig) {
    const EP: usize = 2;
    let shape = |rank: usize| [2 - rank, 3, SHAPE[2]];
    let draw = |rank: usize, seed: u64| {
        init_full::<B, 3>(
            shape(rank),
            InitDistribution::Normal { std: 1.0 },
            seed + 10 * rank as u64,
            &device(),
        )
    };
    let ranks: Vec<RankGradients> = run(EP, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_ep(EP))?;
        let group = state.ep();
        let r = group.rank();
        let (x, probe) = (draw(r, 31), draw(r, 32));
        let tracked: MoeLayer<AD> = config
            .init(group, 5, &device())
            .expect("valid configuration");
        let x_tracked = Tensor::<AD, 3>::from_inner(x.clone()).require_grad();
        let out = tracked.try_forward(x_tracked.clone())?;
        let grads = ((out.output.clone() * Tensor::from_inner(probe.clone())).sum()
            + out.aux_loss())
        .backward();
        group.backward_failure()?;
        let analytic = gradients(&tracked, &grads);
        let analytic_input = values(x_tracked.grad(&grads).expect("the input's gradient"));
        let plain: MoeLayer<B> = config
            .init(group, 5, &device())
            .expect("valid configuration");
        let total = |layer: &MoeLayer<B>, x: Tensor<B, 3>| -> DistResult<f64> {
            let out = layer.try_forward(x)?;
            let part = out.aux_loss() + (out.output * probe.clone()).sum();
            Ok(group.all_reduce(part, ReduceOp::Sum)?.into_scalar())
        };
        let central = |shifted: &dyn Fn(f64) -> DistResult<f64>| -> DistResult<f64> {
            Ok((shifted(STEP)? - shifted(-STEP)?) / (2.0 * STEP))
        };
        // Every rank's input in turn: each rank moves its element only when it is its turn.
        let xs = values(x.clone());
        let mut numeric_input = Vec::new();
        for s in 0..EP {
            for e in 0..shape(s).iter().product::<usize>() {
                let d = central(&|delta| {
                    let mut v = xs.clone();
                    if s == r {
                        v[e] += delta;
                    }
                    total(
                        &plain,
                        Tensor::from_data(TensorData::new(v, shape(r)), &device()),
                    )
                })?;
                if s == r {
                    numeric_input.push(d);
                }
            }
        }
        // Every parameter: a replicated one everywhere at once, an expert on each rank in turn.
        let mut numeric = Vec::new();
        for ((id, params), (path, _)) in parameters(&plain).into_iter().zip(&analytic) {
            let turns: Vec<Option<usize>> = match path.starts_with("experts.") {
                true => (0..EP).map(Some).collect(),
                false => vec![None],
            };
            let mut estimate = Vec::new();
            for turn in turns {
                let mine = turn.is_none_or(|owner| owner == r);
                for index in 0..params.len() {
                    let d = central(&|delta| {
                        let layer = match mine {
                            true => plain.clone().map(&mut Perturb { id, index, delta }),
                            false => plain.clone(),
                        };
                        total(&layer, x.clone())
                    })?;
                    if mine {
                        estimate.push(d);
                    }
                }
            }
            numeric.push((path.clone(), estimate));
        }
        Ok((analytic_input, numeric_input, analytic, numeric))
    });
    let tol = tolerance::FINITE_DIFFERENCE_F64;
    for (r, (analytic_input, numeric_input, analytic, numeric)) in ranks.iter().enumerate() {
        let at = |what: &str| format!("{name}: rank {r}'s {what}");
        assert_close(&at("input"), analytic_input, numeric_input, tol);
        for (i, ((path, got), (_, estimate))) in analytic.iter().zip(numeric).enumerate() {
            let got = match path.starts_with("experts.") {
                true => got.clone(),
                false => ranks.iter().fold(vec![0.0; got.len()], |sum, rank| {
                    sum.iter().zip(&rank.2[i].1).map(|(a, b)| a + b).collect()
                }),
            };
            assert_close(&at(path), &got, estimate, tol);
        }
    }
}

/// The all-gather dispatcher (dropless): softmax top-2 with SwiGLU experts and a shared
/// expert, and pre-softmax top-1 with GeLU experts, at EP 2; the same at EP 1, where its
/// collectives are identities.
#[test]
fn moe_all_gather_dispatcher() {
    let top2 = config(2, Activation::SwiGlu).with_token_dispatcher(TokenDispatcherType::AllGather);
    check("all-gather top-2 SwiGLU, EP 1", top2.clone());
    check_expert_parallel("all-gather top-2 SwiGLU, EP 2", top2);
    let top1 = config(1, Activation::Gelu)
        .with_pre_softmax(true)
        .with_token_dispatcher(TokenDispatcherType::AllGather);
    check_expert_parallel("all-gather top-1 GeLU, EP 2", top1);
}

/// The gradient of `Σ w ∘ permute_rows(x)` with respect to `x` against central differences:
/// `forward[i]` the row of `x` that output row `i` reads (`None`: a zero row), `readers[j]`
/// the output rows that read row `j` of `x` (`None`: fewer readers than the others).
fn check_permute_rows(
    name: &str,
    n: usize,
    forward: &[Option<usize>],
    readers: &[Vec<Option<usize>>],
) {
    use burn_megatron::ops::{RowIndex, permute_rows};
    let hidden = 3;
    let m = forward.len();
    let normal = |shape: [usize; 2], seed| {
        init_full::<B, 2>(
            shape,
            InitDistribution::Normal { std: 1.0 },
            seed,
            &device(),
        )
    };
    let (x, w) = (normal([n, hidden], 41), normal([m, hidden], 42));
    let backward: Vec<Option<usize>> = readers.iter().flatten().copied().collect();
    let loss = |x: Tensor<AD, 2>| {
        let y = permute_rows(
            x,
            &RowIndex::from_host(forward, &device()),
            &RowIndex::from_host(&backward, &device()),
        );
        (y * Tensor::from_inner(w.clone())).sum()
    };
    let tracked = Tensor::<AD, 2>::from_inner(x.clone()).require_grad();
    let y = values(
        permute_rows(
            tracked.clone(),
            &RowIndex::from_host(forward, &device()),
            &RowIndex::from_host(&backward, &device()),
        )
        .inner(),
    );
    let rows = values(x.clone());
    let want: Vec<f64> = forward
        .iter()
        .flat_map(|r| (0..hidden).map(move |c| (*r, c)))
        .map(|(r, c)| r.map_or(0.0, |r| rows[r * hidden + c]))
        .collect();
    assert_close(&format!("{name}: output"), &y, &want, 0.0);
    let grads = loss(tracked.clone()).backward();
    let got = values(tracked.grad(&grads).expect("x has a gradient"));
    let base = values(x);
    let fd: Vec<f64> = (0..base.len())
        .map(|i| {
            let shifted = |h: f64| {
                let mut v = base.clone();
                v[i] += h;
                let x = Tensor::<B, 2>::from_data(TensorData::new(v, [n, hidden]), &device());
                values(loss(Tensor::from_inner(x)).inner())[0]
            };
            (shifted(STEP) - shifted(-STEP)) / (2.0 * STEP)
        })
        .collect();
    assert_close(
        &format!("{name}: dx"),
        &got,
        &fd,
        tolerance::FINITE_DIFFERENCE_F64,
    );
}

/// `permute_rows` (the dispatcher's gathers, whose gradient is a gather through the inverse):
/// a token's two copies (the dispatch, `c = 2`, one token with one copy dropped) with zero
/// rows, and a permutation with a zero row and a row nobody reads (its gradient zero).
#[test]
fn moe_permute_rows_gradient_matches_finite_differences() {
    let copies = [
        Some(2),
        Some(0),
        Some(3),
        None,
        Some(3),
        Some(0),
        Some(1),
        Some(2),
    ];
    let readers = vec![
        vec![Some(1), Some(5)],
        vec![Some(6), None],
        vec![Some(0), Some(7)],
        vec![Some(2), Some(4)],
    ];
    check_permute_rows("token copies", 4, &copies, &readers);
    let permutation = [Some(4), None, Some(0), Some(2), Some(1)];
    let readers = vec![
        vec![Some(2)],
        vec![Some(4)],
        vec![Some(3)],
        vec![None],
        vec![Some(0)],
    ];
    check_permute_rows("permutation", 5, &permutation, &readers);
}

/// `unpermute_rows` (the combine: each token's rows gathered, weighted by the router and
/// summed): the gradients of `Σ p ∘ y` with respect to the rows (3 tokens × 2 rows from 7,
/// one a zero row, one row never read) and to the weights, against central differences.
#[test]
fn moe_unpermute_rows_gradients_match_finite_differences() {
    use burn_megatron::ops::{RowIndex, unpermute_rows};
    let (tokens, k, n, hidden) = (3, 2, 7, 3);
    let forward = [Some(6), Some(1), Some(3), None, Some(0), Some(4)];
    let mut backward = vec![None; n];
    for (a, row) in forward.iter().enumerate() {
        if let Some(row) = row {
            backward[*row] = Some(a);
        }
    }
    let normal = |shape: [usize; 2], seed| {
        init_full::<B, 2>(
            shape,
            InitDistribution::Normal { std: 1.0 },
            seed,
            &device(),
        )
    };
    let (x, w, probe) = (
        normal([n, hidden], 51),
        normal([tokens, k], 52),
        normal([tokens, hidden], 53),
    );
    let loss = |x: Tensor<AD, 2>, w: Tensor<AD, 2>| {
        let y = unpermute_rows(
            x,
            &RowIndex::from_host(&forward, &device()),
            &RowIndex::from_host(&backward, &device()),
            w,
        );
        (y * Tensor::from_inner(probe.clone())).sum()
    };
    let (tx, tw) = (
        Tensor::<AD, 2>::from_inner(x.clone()).require_grad(),
        Tensor::<AD, 2>::from_inner(w.clone()).require_grad(),
    );
    let grads = loss(tx.clone(), tw.clone()).backward();
    let fd = |which: usize| {
        let base = values([&x, &w][which].clone());
        let shape = [&x, &w][which].dims();
        (0..base.len())
            .map(|i| {
                let shifted = |h: f64| {
                    let mut v = base.clone();
                    v[i] += h;
                    let t = Tensor::<AD, 2>::from_inner(Tensor::from_data(
                        TensorData::new(v, shape),
                        &device(),
                    ));
                    let (x, w) = match which {
                        0 => (t, Tensor::from_inner(w.clone())),
                        _ => (Tensor::from_inner(x.clone()), t),
                    };
                    values(loss(x, w).inner())[0]
                };
                (shifted(STEP) - shifted(-STEP)) / (2.0 * STEP)
            })
            .collect::<Vec<f64>>()
    };
    let dx = values(tx.grad(&grads).expect("the rows' gradient"));
    assert_close(
        "unpermute dx",
        &dx,
        &fd(0),
        tolerance::FINITE_DIFFERENCE_F64,
    );
    assert!(
        dx[2 * hidden..3 * hidden].iter().all(|g| *g == 0.0),
        "row 2 is never read"
    );
    let dw = values(tw.grad(&grads).expect("the weights' gradient"));
    assert_close(
        "unpermute dw",
        &dw,
        &fd(1),
        tolerance::FINITE_DIFFERENCE_F64,
    );
}

/// Sinkhorn balancing (`--moe-router-load-balancing-type sinkhorn`), top-1 and top-2, with the
/// z-loss: the gradient of `Σ probe ∘ weights + z_loss` with respect to the router's weight
/// and the tokens, against central differences. The choice comes from the normalisation only
/// while gradients are tracked, so the differences are taken on the autodiff backend too;
/// the choice differs from the plain top-k's on these tokens, so the test covers it.
#[test]
fn router_sinkhorn() {
    use burn_megatron::transformer::moe::{Router, RouterSettings};
    const TOKENS: usize = 6;
    const HIDDEN: usize = 4;
    const EXPERTS: usize = 5;
    let normal = |shape: [usize; 2], seed| {
        values(init_full::<B, 2>(
            shape,
            InitDistribution::Normal { std: 1.0 },
            seed,
            &device(),
        ))
    };
    let (tokens, weight) = (normal([TOKENS, HIDDEN], 41), normal([HIDDEN, EXPERTS], 42));
    for top_k in [1, 2] {
        let settings = RouterSettings {
            top_k,
            load_balancing: LoadBalancingType::Sinkhorn,
            z_loss_coeff: 0.01,
            ..Default::default()
        };
        let probe = normal([TOKENS, top_k], 43);
        let tensor = |v: &[f64], shape: [usize; 2]| {
            Tensor::<AD, 2>::from_data(TensorData::new(v.to_vec(), shape), &device())
        };
        let route = |tokens: Tensor<AD, 2>, weight: Tensor<AD, 2>| {
            let routing = Router::new(weight, settings.clone()).route(tokens);
            let loss = (routing.weights.clone() * tensor(&probe, [TOKENS, top_k])).sum()
                + routing.z_loss.clone().sum();
            (routing, loss)
        };
        let (x, w) = (
            tensor(&tokens, [TOKENS, HIDDEN]).require_grad(),
            tensor(&weight, [HIDDEN, EXPERTS]).require_grad(),
        );
        let (routing, loss) = route(x.clone(), w.clone());
        let grads = loss.backward();
        let value = |tokens: &[f64], weight: &[f64]| {
            route(
                tensor(tokens, [TOKENS, HIDDEN]),
                tensor(weight, [HIDDEN, EXPERTS]),
            )
            .1
            .into_scalar()
        };
        assert_router_gradients(
            &format!("sinkhorn top-{top_k}"),
            [&tokens, &weight],
            [
                values(x.grad(&grads).expect("tokens")),
                values(w.grad(&grads).expect("weight")),
            ],
            value,
        );
        let evaluation = Router::<B>::new(w.inner(), settings).route(x.inner());
        assert_ne!(
            routing.read_experts().expect("experts"),
            evaluation.read_experts().expect("experts"),
            "sinkhorn top-{top_k}: Sinkhorn's choice equals the plain top-k's here"
        );
    }
}

/// Input jitter (`--moe-input-jitter-eps 0.3`, the factors of a fixed site) with a list of
/// load-balancing losses (`aux_loss 0.1` and `seq_aux_loss 0.05` over two sequences) and the
/// z-loss: the gradient of `Σ probe ∘ weights + losses` with respect to the router's weight
/// and the tokens, against central differences (on the autodiff backend, where the jitter
/// is drawn).
#[test]
fn router_input_jitter_with_a_list_of_losses() {
    use burn_megatron::transformer::moe::{AuxLossTerm, JitterSite, Router, RouterSettings};
    const TOKENS: usize = 6;
    const HIDDEN: usize = 4;
    const EXPERTS: usize = 5;
    const TOP_K: usize = 2;
    let normal = |shape: [usize; 2], seed| {
        values(init_full::<B, 2>(
            shape,
            InitDistribution::Normal { std: 1.0 },
            seed,
            &device(),
        ))
    };
    let (tokens, weight) = (normal([TOKENS, HIDDEN], 51), normal([HIDDEN, EXPERTS], 52));
    let probe = normal([TOKENS, TOP_K], 53);
    let settings = RouterSettings {
        top_k: TOP_K,
        aux_loss_coeff: 0.1,
        more_aux_losses: vec![AuxLossTerm::new(LoadBalancingType::SeqAuxLoss, 0.05)],
        z_loss_coeff: 0.01,
        input_jitter_eps: Some(0.3),
        ..Default::default()
    };
    let site = JitterSite::whole_sequence(5, TOKENS / 2);
    let tensor = |v: &[f64], shape: [usize; 2]| {
        Tensor::<AD, 2>::from_data(TensorData::new(v.to_vec(), shape), &device())
    };
    let route = |tokens: Tensor<AD, 2>, weight: Tensor<AD, 2>| {
        let routing = Router::new(weight, settings.clone())
            .route_at(tokens, 2, None, Some(&site))
            .expect("no group");
        (routing.weights.clone() * tensor(&probe, [TOKENS, TOP_K])).sum()
            + routing.load_balancing_loss.sum()
            + routing.z_loss.sum()
    };
    let (x, w) = (
        tensor(&tokens, [TOKENS, HIDDEN]).require_grad(),
        tensor(&weight, [HIDDEN, EXPERTS]).require_grad(),
    );
    let grads = route(x.clone(), w.clone()).backward();
    let value = |t: &[f64], w: &[f64]| {
        route(tensor(t, [TOKENS, HIDDEN]), tensor(w, [HIDDEN, EXPERTS])).into_scalar()
    };
    assert_router_gradients(
        "jitter",
        [&tokens, &weight],
        [
            values(x.grad(&grads).expect("tokens")),
            values(w.grad(&grads).expect("weight")),
        ],
        value,
    );
}

/// Checks a router's gradients with respect to its tokens and its weight (`got`, in that
/// order) against central differences of `value(tokens, weight)` at `at`.
fn assert_router_gradients(
    name: &str,
    at: [&[f64]; 2],
    got: [Vec<f64>; 2],
    value: impl Fn(&[f64], &[f64]) -> f64,
) {
    for (which, (what, got)) in ["tokens", "weight"].into_iter().zip(got).enumerate() {
        let want: Vec<f64> = (0..at[which].len())
            .map(|i| {
                let shifted = |delta: f64| {
                    let mut point = [at[0].to_vec(), at[1].to_vec()];
                    point[which][i] += delta;
                    value(&point[0], &point[1])
                };
                (shifted(STEP) - shifted(-STEP)) / (2.0 * STEP)
            })
            .collect();
        let diff = relative_difference(&format!("{name}: {what}"), &got, &want);
        assert!(
            diff < tolerance::FINITE_DIFFERENCE_F64,
            "{name}: gradient of the {what} off by {diff:.2e}"
        );
    }
}
