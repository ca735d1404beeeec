//! The router on two tokens and three experts whose logits are logarithms, so that every
//! score, weight and loss is a fraction worked out by hand in the comments; Megatron's
//! routing options (pre-softmax, group-limited routing, the scaling factor, the sequence-level
//! loss) on cases of their own.

use burn::module::AutodiffModule;
use burn::tensor::{Tensor, TensorData};
use burn_megatron::transformer::moe::{
    AuxLossTerm, JitterSite, LoadBalancingType, Router, RouterScoreFunction, RouterSettings,
    Routing, expert_bias_update,
};

use crate::{AD, B, assert_close, tolerance, values};

/// Token 0 is `[1, 0]`, token 1 is `[0, 1]`, so their logits are the weight's rows:
/// `[0, ln 2, ln 1.5]` (softmax `[2, 4, 3] / 9`, log-sum-exp `ln 4.5`) and
/// `[ln 3, 0, ln 2]` (softmax `[3, 1, 2] / 6`, log-sum-exp `ln 6`).
fn route(score_function: RouterScoreFunction, top_k: usize, normalize_top_k: bool) -> Routing<B> {
    route_with(RouterSettings {
        score_function,
        top_k,
        pre_softmax: true,
        normalize_top_k,
        aux_loss_coeff: 0.1,
        z_loss_coeff: 0.01,
        ..Default::default()
    })
}

/// The two tokens of [`route`] with any settings.
fn route_with(settings: RouterSettings) -> Routing<B> {
    let device = Default::default();
    let (ln2, ln3, ln15) = (2f32.ln(), 3f32.ln(), 1.5f32.ln());
    let weight = Tensor::from_data(
        TensorData::new(vec![0.0, ln2, ln15, ln3, 0.0, ln2], [2, 3]),
        &device,
    );
    let router = Router::<B>::new(weight, settings);
    let tokens = Tensor::from_data(TensorData::new(vec![1f32, 0.0, 0.0, 1.0], [2, 2]), &device);
    router.route(tokens)
}

fn close(name: &str, got: Tensor<B, 1>, want: f64) {
    assert_close(name, &values(got), &[want], tolerance::F32);
}

/// Pre-softmax top-1 (`--moe-router-pre-softmax`, which softmax top-1 requires).
#[test]
fn softmax_top1() {
    let r = route(RouterScoreFunction::Softmax, 1, false);
    // Token 0 picks expert 1 (4/9), token 1 expert 0 (3/6).
    assert_eq!(r.read_experts().unwrap(), vec![1, 0]);
    assert_eq!(r.read_tokens_per_expert().unwrap(), vec![1, 1, 0]);
    assert_close(
        "weights",
        &values(r.weights),
        &[4.0 / 9.0, 0.5],
        tolerance::F32,
    );
    // f = [1/2, 1/2, 0]; P = ([2/9, 4/9, 3/9] + [3/6, 1/6, 2/6]) / 2 = [13, 11, 12] / 36;
    // 0.1 · 3 · (13/72 + 11/72) = 0.1.
    close("load-balancing loss", r.load_balancing_loss, 0.1);
    // 0.01 · ((ln 4.5)² + (ln 6)²) / 2.
    let z = 0.01 * (4.5f64.ln().powi(2) + 6f64.ln().powi(2)) / 2.0;
    close("z-loss", r.z_loss, z);
}

/// Pre-softmax top-2 with `normalize_top_k`, which gives Megatron's default weights.
#[test]
fn softmax_top2_normalized() {
    let r = route(RouterScoreFunction::Softmax, 2, true);
    // Token 0: experts 1 and 2 (4/9, 3/9); token 1: experts 0 and 2 (3/6, 2/6).
    assert_eq!(r.read_experts().unwrap(), vec![1, 2, 0, 2]);
    assert_eq!(r.read_tokens_per_expert().unwrap(), vec![1, 1, 2]);
    // Normalised: [4/7, 3/7] and [3/5, 2/5].
    assert_close(
        "weights",
        &values(r.weights),
        &[4.0 / 7.0, 3.0 / 7.0, 0.6, 0.4],
        tolerance::F32,
    );
    // f = [1, 1, 2] / 4, P = [13, 11, 12] / 36: 0.1 · 3 · (13 + 11 + 24) / 144 = 0.1.
    close("load-balancing loss", r.load_balancing_loss, 0.1);
}

#[test]
fn unbalanced_load_costs_more() {
    // Both tokens on the same expert: weight rows [0, 0, ln 2] and [0, 0, ln 3], that is
    // softmax [1, 1, 2] / 4 and [1, 1, 3] / 5; both tokens pick expert 2.
    let device = Default::default();
    let weight = Tensor::from_data(
        TensorData::new(vec![0.0, 0.0, 2f32.ln(), 0.0, 0.0, 3f32.ln()], [2, 3]),
        &device,
    );
    let router = Router::<B>::new(
        weight,
        RouterSettings {
            top_k: 1,
            pre_softmax: true,
            aux_loss_coeff: 0.1,
            ..Default::default()
        },
    );
    let tokens = Tensor::from_data(TensorData::new(vec![1f32, 0.0, 0.0, 1.0], [2, 2]), &device);
    let r = router.route(tokens);
    assert_eq!(r.read_experts().unwrap(), vec![2, 2]);
    // f = [0, 0, 1], P_2 = (2/4 + 3/5) / 2 = 11/20: 0.1 · 3 · 11/20 = 0.165.
    close("load-balancing loss", r.load_balancing_loss, 0.165);
    close("z-loss (coefficient 0)", r.z_loss, 0.0);
}

#[test]
fn sigmoid_top1() {
    let r = route(RouterScoreFunction::Sigmoid, 1, false);
    // σ of the logits: [1/2, 2/3, 3/5] and [3/4, 1/2, 2/3]: experts 1 and 0.
    assert_eq!(r.read_experts().unwrap(), vec![1, 0]);
    assert_close(
        "weights",
        &values(r.weights),
        &[2.0 / 3.0, 0.75],
        tolerance::F32,
    );
    // The loss normalises each token's scores: [15, 20, 18] / 53 and [9, 6, 8] / 23;
    // f = [1/2, 1/2, 0]: 0.1 · 3 · (1/2 · P_0 + 1/2 · P_1).
    let p0 = (15.0 / 53.0 + 9.0 / 23.0) / 2.0;
    let p1 = (20.0 / 53.0 + 6.0 / 23.0) / 2.0;
    close(
        "load-balancing loss",
        r.load_balancing_loss,
        0.3 * (p0 + p1) / 2.0,
    );
    // The z-loss reads the logits, whatever the score function.
    let z = 0.01 * (4.5f64.ln().powi(2) + 6f64.ln().powi(2)) / 2.0;
    close("z-loss", r.z_loss, z);
}

/// DeepSeek-V3's expert bias changes the choice, not the weight: a bias of `[0.3, 0, 0]`
/// lifts expert 0 (2/9 + 0.3 > 4/9) for token 0, whose weight is still its score 2/9; token 1
/// keeps expert 0 (3/6). Whatever the bias's dtype.
#[test]
fn expert_bias_picks_the_experts_but_not_their_weights() {
    let device = Default::default();
    let (ln2, ln3, ln15) = (2f32.ln(), 3f32.ln(), 1.5f32.ln());
    let weight = Tensor::from_data(
        TensorData::new(vec![0.0, ln2, ln15, ln3, 0.0, ln2], [2, 3]),
        &device,
    );
    let settings = RouterSettings {
        top_k: 1,
        pre_softmax: true,
        ..Default::default()
    };
    // The bias in the scores' dtype, or in another one (F64 here; F32 beside BF16 scores on a
    // GPU): the router adds it in the scores' dtype.
    for dtype in [burn::tensor::DType::F32, burn::tensor::DType::F64] {
        let bias = Tensor::<B, 1>::from_data(TensorData::new(vec![0.3f32, 0.0, 0.0], [3]), &device)
            .cast(dtype);
        let router = Router::<B>::new(weight.clone(), settings.clone()).with_expert_bias(bias);
        let tokens = Tensor::from_data(TensorData::new(vec![1f32, 0.0, 0.0, 1.0], [2, 2]), &device);
        let r = router.route(tokens);
        assert_eq!(r.read_experts().unwrap(), vec![0, 0], "{dtype:?}");
        assert_eq!(r.read_tokens_per_expert().unwrap(), vec![2, 0, 0]);
        assert_close(
            "weights",
            &values(r.weights),
            &[2.0 / 9.0, 0.5],
            tolerance::F32,
        );
    }
}

/// Megatron's update: counts `[6, 2, 2, 2]` (mean 3) move the bias by `rate · sign(mean −
/// count)`: down for the busy expert, up for the others; a count at the mean stays.
#[test]
fn expert_bias_update_follows_the_load() {
    let update = |counts: &[f32], rate| {
        let counts = Tensor::<B, 1>::from_data(
            TensorData::new(counts.to_vec(), [counts.len()]),
            &Default::default(),
        );
        expert_bias_update(counts, rate)
            .into_data()
            .to_vec::<f32>()
            .expect("f32")
    };
    assert_eq!(
        update(&[6.0, 2.0, 2.0, 2.0], 0.01),
        vec![-0.01, 0.01, 0.01, 0.01]
    );
    assert_eq!(update(&[3.0, 1.0, 2.0], 0.5), vec![-0.5, 0.5, 0.0]);
}

/// A router whose logits for token `t` (the one-hot vector `t`) are `logits[t]`, and its
/// routing of `batch` sequences made of those tokens in order.
fn route_logits(logits: &[Vec<f64>], batch: usize, settings: RouterSettings) -> Routing<B> {
    let device = Default::default();
    let (tokens, experts) = (logits.len(), logits[0].len());
    let weight: Vec<f32> = logits.iter().flatten().map(|&l| l as f32).collect();
    let weight = Tensor::from_data(TensorData::new(weight, [tokens, experts]), &device);
    let router = Router::<B>::new(weight, settings);
    let mut identity = vec![0f32; tokens * tokens];
    for t in 0..tokens {
        identity[t * tokens + t] = 1.0;
    }
    let identity = Tensor::from_data(TensorData::new(identity, [tokens, tokens]), &device);
    router
        .route_sequences_over(identity, batch, None)
        .expect("no group")
}

/// The logit whose sigmoid is `p`.
fn logit(p: f64) -> f64 {
    (p / (1.0 - p)).ln()
}

/// Megatron's default: the top-k of the logits, then a softmax over those k (the weights sum
/// to 1); `--moe-router-pre-softmax`: the top-k of the softmax over all experts, not
/// renormalised. The load-balancing loss reads the softmax over all experts either way.
#[test]
fn softmax_after_or_before_the_top_k() {
    let settings = RouterSettings {
        aux_loss_coeff: 0.1,
        ..Default::default()
    };
    let r = route_with(settings.clone());
    // Token 0: experts 1 and 2, logits ln 2 and ln 1.5: softmax [2, 1.5] / 3.5 = [4/7, 3/7];
    // token 1: experts 0 and 2, logits ln 3 and ln 2: [3/5, 2/5].
    assert_eq!(r.read_experts().unwrap(), vec![1, 2, 0, 2]);
    assert_close(
        "weights",
        &values(r.weights),
        &[4.0 / 7.0, 3.0 / 7.0, 0.6, 0.4],
        tolerance::F32,
    );
    close("load-balancing loss", r.load_balancing_loss, 0.1);
    let pre = route_with(RouterSettings {
        pre_softmax: true,
        ..settings
    });
    assert_eq!(pre.read_experts().unwrap(), vec![1, 2, 0, 2]);
    // The softmax over all three: [4/9, 3/9] and [3/6, 2/6].
    assert_close(
        "pre-softmax weights",
        &values(pre.weights),
        &[4.0 / 9.0, 3.0 / 9.0, 0.5, 2.0 / 6.0],
        tolerance::F32,
    );
    close("load-balancing loss", pre.load_balancing_loss, 0.1);
}

/// Sigmoid scores (DeepSeek-V3): top-k weights divided by their sum whenever `k > 1`
/// (Megatron's order: normalise, then scale), then multiplied by the scaling factor.
#[test]
fn sigmoid_top2_normalised_then_scaled() {
    let r = route_with(RouterSettings {
        score_function: RouterScoreFunction::Sigmoid,
        scaling_factor: Some(2.5),
        ..Default::default()
    });
    // σ: [1/2, 2/3, 3/5] → experts 1, 2: [2/3, 3/5] / (19/15) = [10/19, 9/19];
    // [3/4, 1/2, 2/3] → experts 0, 2: [3/4, 2/3] / (17/12) = [9/17, 8/17].
    assert_eq!(r.read_experts().unwrap(), vec![1, 2, 0, 2]);
    let want: Vec<f64> = [10.0 / 19.0, 9.0 / 19.0, 9.0 / 17.0, 8.0 / 17.0]
        .iter()
        .map(|w| 2.5 * w)
        .collect();
    assert_close("weights", &values(r.weights), &want, tolerance::F32);
    // Softmax (pre-softmax top-1) scaled: 2.5 · 4/9 and 2.5 · 1/2.
    let r = route_with(RouterSettings {
        top_k: 1,
        pre_softmax: true,
        scaling_factor: Some(2.5),
        ..Default::default()
    });
    assert_close(
        "softmax weights",
        &values(r.weights),
        &[2.5 * 4.0 / 9.0, 1.25],
        tolerance::F32,
    );
}

/// Group-limited routing over six experts in two groups of three, top-2 from one group: a
/// group's score is the sum of its top `top_k / group_top_k` = 2 scores (not of all three,
/// not its best one).
///
/// - Token 0, sigmoid scores `[0.9, 0.8, 0.01 | 0.7, 0.6, 0.65]`: group 0 scores 1.7,
///   group 1 1.35 (its sum of all three, 1.95, would win; its best, 0.7, loses either
///   way): experts 0 and 1, weights `[0.9, 0.8] / 1.7`.
/// - Token 1, `[0.95, 0.1, 0.05 | 0.7, 0.6, 0.65]`: group 0 scores 1.05, group 1 1.35, so
///   expert 0, the best of all, is out: experts 3 and 5, `[0.7, 0.65] / 1.35`.
///
/// The load-balancing loss counts the load by a plain top-2 of the normalised scores
/// (Megatron): experts `[0, 1]` and `[0, 3]`.
#[test]
fn group_limited_top_k_takes_the_best_groups_by_their_top_scores() {
    let scores = [
        vec![0.9, 0.8, 0.01, 0.7, 0.6, 0.65],
        vec![0.95, 0.1, 0.05, 0.7, 0.6, 0.65],
    ];
    let logits: Vec<Vec<f64>> = scores
        .iter()
        .map(|row| row.iter().map(|&p| logit(p)).collect())
        .collect();
    let settings = RouterSettings {
        score_function: RouterScoreFunction::Sigmoid,
        num_groups: Some(2),
        group_top_k: Some(1),
        scaling_factor: Some(2.5),
        aux_loss_coeff: 0.1,
        ..Default::default()
    };
    let r = route_logits(&logits, 1, settings.clone());
    assert_eq!(r.read_experts().unwrap(), vec![0, 1, 3, 5]);
    assert_eq!(r.read_tokens_per_expert().unwrap(), vec![1, 1, 0, 1, 0, 1]);
    let want: Vec<f64> = [0.9 / 1.7, 0.8 / 1.7, 0.7 / 1.35, 0.65 / 1.35]
        .iter()
        .map(|w| 2.5 * w)
        .collect();
    assert_close("weights", &values(r.weights), &want, tolerance::F32);
    // coeff · E / (T² k) · Σ_e c_e Σ_t p_te, p each token's scores over their sum.
    let counts = [2.0, 1.0, 0.0, 1.0, 0.0, 0.0];
    let mut loss = 0.0;
    for row in &scores {
        let sum: f64 = row.iter().sum();
        loss += row
            .iter()
            .zip(counts)
            .map(|(p, c)| c * p / sum)
            .sum::<f64>();
    }
    close(
        "load-balancing loss",
        r.load_balancing_loss,
        0.1 * 6.0 / 8.0 * loss,
    );
    // Without the groups, token 1 takes experts 0 and 3.
    let plain = route_logits(
        &logits,
        1,
        RouterSettings {
            num_groups: None,
            group_top_k: None,
            ..settings
        },
    );
    assert_eq!(plain.read_experts().unwrap(), vec![0, 1, 0, 3]);
}

/// DeepSeek's sequence-level loss: tokens A (softmax `[2, 4, 3] / 9`) and B (`[3, 1, 2] / 6`)
/// in two sequences `(A, A)` and `(B, B)`, pre-softmax top-1. Over the batch the load is
/// balanced between experts 0 and 1: `0.1 · 3 · (2/4 · 13/36 + 2/4 · 11/36) = 0.1`. Each
/// sequence alone sends both its tokens to one expert: `(A, A)` gives `3 · 1 · 4/9 = 4/3`,
/// `(B, B)` `3 · 1 · 1/2 = 3/2`, so the loss is `0.1 · (4/3 + 3/2) / 2 = 0.1 · 17/12`.
#[test]
fn sequence_level_loss_balances_each_sequence() {
    let (ln2, ln3, ln15) = (2f64.ln(), 3f64.ln(), 1.5f64.ln());
    let a = vec![0.0, ln2, ln15];
    let b = vec![ln3, 0.0, ln2];
    let logits = [a.clone(), a, b.clone(), b];
    let settings = RouterSettings {
        top_k: 1,
        pre_softmax: true,
        aux_loss_coeff: 0.1,
        ..Default::default()
    };
    let batch = route_logits(&logits, 2, settings.clone());
    assert_eq!(batch.read_experts().unwrap(), vec![1, 1, 0, 0]);
    close("aux_loss", batch.load_balancing_loss, 0.1);
    let seq = route_logits(
        &logits,
        2,
        RouterSettings {
            load_balancing: LoadBalancingType::SeqAuxLoss,
            ..settings.clone()
        },
    );
    close("seq_aux_loss", seq.load_balancing_loss, 0.1 * 17.0 / 12.0);
    // One sequence of all four tokens: the batch's loss.
    let one = route_logits(
        &logits,
        1,
        RouterSettings {
            load_balancing: LoadBalancingType::SeqAuxLoss,
            ..settings.clone()
        },
    );
    close("seq_aux_loss of one sequence", one.load_balancing_loss, 0.1);
    let none = route_logits(
        &logits,
        2,
        RouterSettings {
            load_balancing: LoadBalancingType::None,
            ..settings
        },
    );
    close("no loss", none.load_balancing_loss, 0.0);
}

/// The MoE losses come in the router's dtype (BF16 in a BF16 model), the cross-entropy in F32,
/// and Burn reads a binary kernel's operands in the left one's dtype: `add_to` joins them in
/// the loss's dtype, with the value and the gradients of the sum. (Added uncast on GPUs, the
/// main loss's gradient came back 4 times too large with 4 microbatches, and zero with a
/// coefficient of 0.) Here the losses are F64 beside an F32 loss.
#[test]
fn the_moe_losses_join_the_loss_in_its_dtype() {
    use burn::tensor::DType;
    use burn_megatron::transformer::moe::{MoeLosses, MoeOutput};

    use crate::AD;

    let device = Default::default();
    let loss = Tensor::<AD, 1>::from_data([2.0f32], &device).require_grad();
    let lb = Tensor::<AD, 1>::from_data([0.5f32], &device).require_grad();
    let output = MoeOutput {
        output: Tensor::zeros([1, 1, 1], &device),
        load_balancing_loss: lb.clone().cast(DType::F64),
        z_loss: Tensor::<AD, 1>::from_data([0.25f32], &device).cast(DType::F64),
        tokens_per_expert: vec![1],
        dropped: 0,
    };
    let mut losses = MoeLosses::default();
    losses.push(0, &output);
    // One microbatch of 4: the schedules divide the root by the number of microbatches.
    let root = losses.add_to(loss.clone()).div_scalar(4.0);
    assert_eq!(root.dtype(), DType::F32);
    assert_eq!(values(root.clone().inner()), [2.75 / 4.0]);
    let grads = root.backward();
    let grad = |t: &Tensor<AD, 1>| values(t.grad(&grads).expect("a gradient"));
    assert_eq!(grad(&loss), [0.25]);
    assert_eq!(grad(&lb), [0.25]);
}

/// `global_aux_loss` in training: the second micro-batch's loss counts the mean load of the
/// step's two micro-batches, its probabilities its own; after `reset_global_load` the count
/// starts again (the loss is then `aux_loss`'s), and evaluation (no autodiff) keeps nothing.
/// Token 0 alone, then token 1 alone (the tokens of [`route`]), pre-softmax top-1.
#[test]
fn global_loss_counts_the_load_of_the_step_so_far() {
    let settings = |load_balancing| RouterSettings {
        pre_softmax: true,
        top_k: 1,
        aux_loss_coeff: 0.1,
        load_balancing,
        ..Default::default()
    };
    let (ln2, ln3, ln15) = (2f32.ln(), 3f32.ln(), 1.5f32.ln());
    let weight = vec![0.0, ln2, ln15, ln3, 0.0, ln2];
    let token = |t: usize| {
        let mut x = vec![0f32; 2];
        x[t] = 1.0;
        TensorData::new(x, [1, 2])
    };
    let device = Default::default();
    let global = Router::<AD>::new(
        Tensor::from_data(TensorData::new(weight.clone(), [2, 3]), &device),
        settings(LoadBalancingType::GlobalAuxLoss),
    );
    let loss = |router: &Router<AD>, t| {
        let r = router.route(Tensor::from_data(token(t), &device));
        values(r.load_balancing_loss.inner())[0]
    };
    // Token 0 picks expert 1: load [0, 1, 0], P = [2, 4, 3] / 9: 0.1 · 3 · 4/9.
    let first = loss(&global, 0);
    // Token 1 picks expert 0: the mean load [1/2, 1/2, 0], P = [3, 1, 2] / 6:
    // 0.1 · 3 · (3/12 + 1/12) = 0.1 (aux_loss would count [1, 0, 0]: 0.1 · 3 · 1/2 = 0.15).
    let second = loss(&global, 1);
    global.reset_global_load();
    let after_reset = loss(&global, 1);
    let want = [0.4 / 3.0, 0.1, 0.15];
    assert_close(
        "training",
        &[first, second, after_reset],
        &want,
        tolerance::F32,
    );
    // Evaluation counts the micro-batch alone and keeps nothing: after it, the training
    // count goes on from the reset's micro-batch.
    let eval = global.valid();
    let plain = |t| {
        let r = eval.route(Tensor::<B, 2>::from_data(token(t), &device));
        values(r.load_balancing_loss)[0]
    };
    assert_close(
        "evaluation",
        &[plain(0), plain(1)],
        &[0.4 / 3.0, 0.15],
        tolerance::F32,
    );
    // [1, 0, 0] then [0, 1, 0]: the mean [1/2, 1/2, 0] with P = [2, 4, 3] / 9: 0.1 · 3 · 6/18.
    assert_close(
        "training again",
        &[loss(&global, 0)],
        &[0.1],
        tolerance::F32,
    );
}

/// A list of load-balancing losses (`--moe-router-load-balancing-type aux_loss seq_aux_loss
/// --moe-aux-loss-coeff 0.1 0.2`) adds them up, each with its coefficient, on the tokens
/// of [`sequence_level_loss_balances_each_sequence`]: `0.1 · 1 + 0.2 · 17/12`. A loss with
/// coefficient 0 adds nothing, whichever place it has in the list; `global_aux_loss` in the
/// list adds its own (in training, on the step's first micro-batch the micro-batch's load:
/// `aux_loss`'s value).
#[test]
fn a_list_of_load_balancing_losses_adds_them_up() {
    let (ln2, ln3, ln15) = (2f64.ln(), 3f64.ln(), 1.5f64.ln());
    let a = vec![0.0, ln2, ln15];
    let b = vec![ln3, 0.0, ln2];
    let logits = [a.clone(), a, b.clone(), b];
    let list =
        |first: (LoadBalancingType, f64), more: &[(LoadBalancingType, f64)]| RouterSettings {
            top_k: 1,
            pre_softmax: true,
            load_balancing: first.0,
            aux_loss_coeff: first.1,
            more_aux_losses: more.iter().map(|&(t, c)| AuxLossTerm::new(t, c)).collect(),
            ..Default::default()
        };
    use LoadBalancingType::{AuxLoss, GlobalAuxLoss, SeqAuxLoss};
    let both = route_logits(&logits, 2, list((AuxLoss, 0.1), &[(SeqAuxLoss, 0.2)]));
    close(
        "aux + seq",
        both.load_balancing_loss,
        0.1 + 0.2 * 17.0 / 12.0,
    );
    let reversed = route_logits(&logits, 2, list((SeqAuxLoss, 0.2), &[(AuxLoss, 0.1)]));
    close(
        "seq + aux",
        reversed.load_balancing_loss,
        0.1 + 0.2 * 17.0 / 12.0,
    );
    let first_off = route_logits(&logits, 2, list((AuxLoss, 0.0), &[(SeqAuxLoss, 0.2)]));
    close(
        "0 · aux + seq",
        first_off.load_balancing_loss,
        0.2 * 17.0 / 12.0,
    );
    let second_off = route_logits(&logits, 2, list((AuxLoss, 0.1), &[(SeqAuxLoss, 0.0)]));
    close("aux + 0 · seq", second_off.load_balancing_loss, 0.1);

    let device = Default::default();
    let tokens = logits.len();
    let weight: Vec<f32> = logits.iter().flatten().map(|&l| l as f32).collect();
    let settings = list((SeqAuxLoss, 0.2), &[(GlobalAuxLoss, 0.3)]);
    let router = Router::<AD>::new(
        Tensor::from_data(TensorData::new(weight, [tokens, 3]), &device),
        settings,
    );
    let identity: Vec<f32> = (0..tokens * tokens)
        .map(|i| f32::from(u8::from(i % (tokens + 1) == 0)))
        .collect();
    let identity = Tensor::from_data(TensorData::new(identity, [tokens, tokens]), &device);
    let r = router
        .route_sequences_over(identity, 2, None)
        .expect("no group");
    close(
        "seq + global",
        r.load_balancing_loss.inner(),
        0.2 * 17.0 / 12.0 + 0.3,
    );
}

/// `--moe-input-jitter-eps`: in training the router routes its input times the factors of
/// its [`JitterSite`] (uniform in `(1 − ε, 1 + ε)`: spread over the range, their mean near
/// 1), with the gradient of the product whose factors are constants; in evaluation it routes
/// the input as it is. Without a site each call draws afresh.
#[test]
fn input_jitter_scales_the_routers_input_in_training_only() {
    use burn::module::AutodiffModule;
    let device = Default::default();
    let (tokens, hidden, experts, eps) = (32, 8, 4, 0.2);
    let weight: Vec<f32> = (0..hidden * experts)
        .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
        .collect();
    let input: Vec<f32> = (0..tokens * hidden)
        .map(|i| ((i * 53 % 31) as f32 - 15.0) / 9.0)
        .collect();
    let weight = Tensor::<AD, 2>::from_data(TensorData::new(weight, [hidden, experts]), &device);
    let input = Tensor::<B, 2>::from_data(TensorData::new(input, [tokens, hidden]), &device);
    let settings = RouterSettings {
        top_k: 2,
        aux_loss_coeff: 0.1,
        z_loss_coeff: 0.01,
        ..Default::default()
    };
    let plain = Router::new(weight.clone(), settings.clone());
    let jittered = Router::new(
        weight,
        RouterSettings {
            input_jitter_eps: Some(eps),
            ..settings
        },
    );
    let site = JitterSite::whole_sequence(7, tokens);
    let factors: Tensor<B, 2> = site.factors(eps, 1, hidden, &device);
    let f = values(factors.clone());
    let (low, high) = f
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &v| (l.min(v), h.max(v)));
    let mean = f.iter().sum::<f64>() / f.len() as f64;
    assert!(
        low > 1.0 - eps && high < 1.0 + eps && high - low > 1.8 * eps && (mean - 1.0).abs() < 0.02,
        "factors from {low} to {high}, mean {mean}"
    );
    // Training: the jittered router's routing and gradients are the plain router's on the
    // product, the input's gradient times the factors.
    let x = Tensor::<AD, 2>::from_inner(input.clone()).require_grad();
    let y = Tensor::<AD, 2>::from_inner(input.clone() * factors.clone()).require_grad();
    let got = jittered
        .route_at(x.clone(), 1, None, Some(&site))
        .expect("no group");
    let want = plain.route(y.clone());
    assert_eq!(got.read_experts().unwrap(), want.read_experts().unwrap());
    let sum = |r: &Routing<AD>| {
        r.weights.clone().sum() + r.load_balancing_loss.clone().sum() + r.z_loss.clone().sum()
    };
    assert_close(
        "weights and losses",
        &values(sum(&got).inner()),
        &values(sum(&want).inner()),
        tolerance::F32,
    );
    let (gx, gy) = (sum(&got).backward(), sum(&want).backward());
    let want_x = values(y.grad(&gy).expect("a gradient") * factors);
    assert_close(
        "input gradient",
        &values(x.grad(&gx).expect("a gradient")),
        &want_x,
        tolerance::F32,
    );
    let weight_grad = |r: &Router<AD>, g| values(r.weight.val().grad(g).expect("a gradient"));
    assert_close(
        "weight gradient",
        &weight_grad(&jittered, &gx),
        &weight_grad(&plain, &gy),
        tolerance::F32,
    );
    // The jitter moved the routing: the plain router on the input itself differs.
    let unjittered = plain.route(Tensor::from_inner(input.clone()));
    let apart = (values(sum(&unjittered).inner())[0] - values(sum(&want).inner())[0]).abs();
    assert!(apart > 1e-4, "the jitter changed nothing: {apart:e}");
    // Without a site, two calls draw different factors.
    let draw = || {
        values(
            jittered
                .route(Tensor::from_inner(input.clone()))
                .weights
                .inner(),
        )
    };
    assert_ne!(draw(), draw());
    // Evaluation: no jitter.
    let (eval_jittered, eval_plain) = (jittered.valid(), plain.valid());
    assert_eq!(
        values(eval_jittered.route(input.clone()).weights),
        values(eval_plain.route(input).weights)
    );
}

/// The jitter's factors are drawn at global coordinates: a rank holding positions 4-7 and
/// 12-15 of two 16-token sequences (context parallelism's chunks) draws the rows one device
/// draws there.
#[test]
fn input_jitter_factors_depend_on_the_global_positions_only() {
    let device = Default::default();
    let (batch, seq, hidden) = (2, 16, 3);
    let whole: Tensor<B, 2> =
        JitterSite::whole_sequence(11, seq).factors(0.1, batch, hidden, &device);
    let whole = whole.reshape([batch, seq, hidden]);
    let positions: Vec<usize> = (4..8).chain(12..16).collect();
    let part = JitterSite {
        seed: 11,
        positions,
        sequence_length: seq,
    };
    let part: Tensor<B, 2> = part.factors(0.1, batch, hidden, &device);
    let want = Tensor::cat(
        vec![whole.clone().narrow(1, 4, 4), whole.narrow(1, 12, 4)],
        1,
    );
    assert_eq!(values(part), values(want.reshape([batch * 8, hidden])));
}
