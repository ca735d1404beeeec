//! A GPT whose layers 0 and 2 are MoE layers, trained through the pipeline executor, against
//! the same model at EP 1 on one rank: EP 2 (DP 2), EP 2 × expert-DP 2 (DP 4), EP 2 with
//! TP 2 (with and without sequence parallelism, the experts split over TP or whole), and EP 2
//! with PP 2 (whose first stage's MoE
//! losses travel with the gradient from the next stage); with the all-gather dispatcher, EP 2,
//! EP 2 × expert-DP 2 (also with experts that get no token) and TP 2 with sequence
//! parallelism × EP 2. Losses, the MoE losses and every gradient (f32, 1e-5 relative).
//!
//! Each DP rank runs two microbatches of its own; the reference runs every rank's
//! microbatches, so its gradient is the mean over the ranks'. The parallel gradients are
//! reduced as the optimizer reduces them: a dense parameter's summed over DP, a routed
//! expert's over expert-DP, both divided by DP, then gathered over TP (sharded parameters)
//! and EP (experts, along dimension 0).

use std::collections::BTreeMap;

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn_megatron::models::{GptModel, StageSplit};
use burn_megatron::pipeline_parallel::{Schedule, forward_backward};
use burn_megatron::tensor_parallel::{ParamPlacement, Placements};
use burn_megatron::transformer::moe::{MoeSettings, TokenDispatcherType};
use burn_megatron::transformer::{Activation, TransformerConfig};
use burn_megatron_dist::{ParallelSizes, ParallelState, ReduceOp};
use burn_megatron_testing::models::{microbatch, tiny_gpt};
use burn_megatron_testing::paired;

use crate::{AD, B, assert_close, run, tolerance, values};

/// The tiny GPT with four experts (top 2, a shared expert) in layers 0 and 2.
pub fn moe_gpt() -> TransformerConfig {
    tiny_gpt().with_moe(Some(
        MoeSettings::new(4)
            .with_ffn_hidden_size(Some(12))
            .with_top_k(2)
            .with_aux_loss_coeff(0.01)
            .with_z_loss_coeff(0.001)
            .with_shared_expert_ffn_hidden_size(Some(8))
            .with_layer_freq(2),
    ))
}

/// What one layout gives: the mean loss and MoE losses, and every parameter's full gradient
/// by global path.
#[derive(Debug)]
struct Outcome {
    loss: f64,
    load_balancing_loss: f64,
    z_loss: f64,
    grads: BTreeMap<String, Vec<f64>>,
}

/// `config` at `(tp, pp, dp, ep)` on `tp · pp · dp` thread ranks; `starve` applied to each
/// chunk after init.
fn train(
    config: &TransformerConfig,
    [tp, pp, dp, ep]: [usize; 4],
    starve: fn(GptModel<AD>) -> GptModel<AD>,
) -> Outcome {
    let results = run(tp * pp * dp, |ctx| {
        let sizes = ParallelSizes::default().with_tp(tp).with_pp(pp).with_ep(ep);
        let state = ctx.parallel_state(sizes)?;
        let split = StageSplit::even(config.num_layers, pp)?;
        let stage = split.stage(state.pp_rank());
        let device = Default::default();
        let model = config.init_gpt_stage_with_ep::<AD>(state.tp(), state.ep(), &stage, &device)?;
        let model = starve(model);
        let d = state.coords().dp as u64;
        let microbatches = vec![microbatch::<AD>(50, 2 * d), microbatch::<AD>(50, 2 * d + 1)];
        let schedule = if pp > 1 {
            Schedule::OneFOneB
        } else {
            Schedule::NoPipelining
        };
        let out = forward_backward(
            schedule,
            &state,
            std::slice::from_ref(&model),
            &microbatches,
        )?;
        let grads = reduced_grads(&model, &out.grads[0], &state)?;
        let mean = |t: Tensor<B, 1>| -> Result<f64, burn_megatron_dist::DistError> {
            Ok(values(state.dp().all_reduce(t, ReduceOp::Sum)?)[0] / dp as f64)
        };
        let loss = match out.loss {
            Some(loss) => Some(mean(loss)?),
            None => None,
        };
        let moe = match out.moe {
            Some(m) => Some((mean(m.load_balancing_loss)?, mean(m.z_loss)?)),
            None => None,
        };
        Ok((loss, moe, grads))
    });
    let mut grads = BTreeMap::new();
    let (mut loss, mut lb, mut z) = (None, 0.0, 0.0);
    for (rank_loss, moe, rank_grads) in results {
        loss = loss.or(rank_loss);
        if let Some((l, zz)) = moe {
            // Each stage's MoE layers: rank 0 of the DP group of each stage holds the same
            // value as the others; add the stages' once (ranks of one stage repeat it).
            lb = l;
            z = zz;
        }
        for (path, g) in rank_grads {
            grads.entry(path).or_insert(g);
        }
    }
    Outcome {
        loss: loss.expect("a last stage"),
        load_balancing_loss: lb,
        z_loss: z,
        grads,
    }
}

/// Each parameter's gradient reduced as the optimizer does and gathered whole, by its path
/// in the whole model.
fn reduced_grads(
    model: &GptModel<AD>,
    grads: &GradientsParams,
    state: &ParallelState,
) -> Result<Vec<(String, Vec<f64>)>, burn_megatron::Error> {
    struct Reduce<'a> {
        path: Vec<String>,
        placements: Placements,
        grads: &'a GradientsParams,
        state: &'a ParallelState,
        model: &'a GptModel<AD>,
        out: Result<Vec<(String, Vec<f64>)>, burn_megatron::Error>,
    }
    impl ModuleVisitor<AD> for Reduce<'_> {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<AD, D>>) {
            let path = self.model.global_path(&self.path.join("."));
            let placement: ParamPlacement = self.placements.get(param.id).expect("declared");
            let Ok(out) = &mut self.out else { return };
            let result = (|| -> Result<Vec<f64>, burn_megatron::Error> {
                let grad = self
                    .grads
                    .get::<B, D>(param.id)
                    .unwrap_or_else(|| panic!("{path} has no gradient"));
                let s = self.state;
                let group = if placement.is_expert() {
                    s.expert_dp()
                } else {
                    s.dp()
                };
                let mut g = group
                    .all_reduce(grad, ReduceOp::Sum)?
                    .div_scalar(s.dp().size() as f64);
                if let Some(dim) = placement.dim() {
                    let global = placement.global_shape(&g.dims())[dim];
                    g = s.tp().all_gather(g, dim)?.narrow(dim, 0, global);
                }
                if placement.is_expert() {
                    g = s.ep().all_gather(g, 0)?;
                }
                Ok(values(g))
            })();
            match result {
                Ok(g) => out.push((path, g)),
                Err(e) => self.out = Err(e),
            }
        }
    }
    let mut visitor = Reduce {
        path: Vec::new(),
        placements: Placements::of(model),
        grads,
        state,
        model,
        out: Ok(Vec::new()),
    };
    model.visit(&mut visitor);
    visitor.out
}

fn keep(model: GptModel<AD>) -> GptModel<AD> {
    model
}

/// Layer 0's MoE sends no token to experts 2 and 3 (rank 1's at EP 2): its post-attention
/// norm gives feature 0 the constant 10 (scale 0, shift 10), and the router weighs feature 0
/// by -3 for experts 2 and 3, so their logits are ~30 below the others'.
fn starve_experts_23(mut model: GptModel<AD>) -> GptModel<AD> {
    let Some(layer) = model.block.layers.first_mut() else {
        return model;
    };
    if layer.moe.is_none() {
        return model;
    }
    let set = |t: Tensor<AD, 1>, value: f32| {
        let t = t.inner().slice_assign(
            [0..1usize; 1],
            Tensor::full([1], value, &Default::default()),
        );
        Tensor::from_inner(t).require_grad()
    };
    let norm = &mut layer.post_attention_norm;
    norm.scale = norm.scale.clone().map(|t| set(t, 0.0));
    norm.shift = norm.shift.clone().map(|p| p.map(|t| set(t, 10.0)));
    let moe = layer.moe.as_mut().expect("an MoE layer");
    moe.router.weight = moe.router.weight.clone().map(|w| {
        let w = w.inner().slice_assign(
            [0..1, 2..4],
            Tensor::full([1, 2], -3.0, &Default::default()),
        );
        Tensor::from_inner(w).require_grad()
    });
    model
}

fn assert_same(name: &str, got: &Outcome, want: &Outcome) {
    let tol = tolerance::F32;
    assert_close(&format!("{name}: loss"), &[got.loss], &[want.loss], tol);
    assert_close(
        &format!("{name}: load-balancing loss"),
        &[got.load_balancing_loss],
        &[want.load_balancing_loss],
        tol,
    );
    assert_close(
        &format!("{name}: z-loss"),
        &[got.z_loss],
        &[want.z_loss],
        tol,
    );
    let got: Vec<_> = got.grads.iter().collect();
    let want: Vec<_> = want.grads.iter().collect();
    for (path, g, w) in paired(name, &got, &want) {
        assert_close(&format!("{name}: {path}"), g, w, tol);
    }
}

/// The reference: EP 1 on one rank with all `dp` ranks' microbatches.
fn reference(
    config: &TransformerConfig,
    dp: usize,
    starve: fn(GptModel<AD>) -> GptModel<AD>,
) -> Outcome {
    let results = run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let model = starve(config.init_gpt::<AD>(state.tp(), &Default::default())?);
        let microbatches: Vec<_> = (0..2 * dp as u64)
            .map(|s| microbatch::<AD>(50, s))
            .collect();
        let out = forward_backward(
            Schedule::NoPipelining,
            &state,
            std::slice::from_ref(&model),
            &microbatches,
        )?;
        let moe = out.moe.expect("MoE layers");
        let outcome = Outcome {
            loss: values(out.loss.expect("one stage"))[0],
            load_balancing_loss: values(moe.load_balancing_loss)[0],
            z_loss: values(moe.z_loss)[0],
            grads: reduced_grads(&model, &out.grads[0], &state)?
                .into_iter()
                .collect(),
        };
        Ok((outcome, moe.tokens_per_expert))
    });
    results.into_iter().next().expect("one rank").0
}

#[test]
fn gpt_with_moe_layers_equals_one_device_at_ep_2_and_ep_2_x_dp_2() {
    let config = moe_gpt();
    for (name, layout) in [("EP 2", [1, 1, 2, 2]), ("EP 2 x expert-DP 2", [1, 1, 4, 2])] {
        let want = reference(&config, layout[2], keep);
        assert!(want.load_balancing_loss > 0.0 && want.z_loss > 0.0);
        assert_same(name, &train(&config, layout, keep), &want);
    }
}

/// The MoE settings of `config` with `--expert-tensor-parallel-size` `size`.
fn expert_tp(config: TransformerConfig, size: usize) -> TransformerConfig {
    TransformerConfig {
        moe: config
            .moe
            .map(|m| m.with_expert_tensor_parallel_size(Some(size))),
        ..config
    }
}

#[test]
fn gpt_with_moe_layers_equals_one_device_with_tp_2_and_pp_2() {
    let config = moe_gpt();
    let want = reference(&config, 2, keep);
    // Experts split over TP (expert tensor parallelism, the default at TP 2) and whole on
    // every TP rank; under sequence parallelism the MoE layer gathers the sequence over TP,
    // and reduce-scatters (split experts) or splits (whole ones) its output.
    for (name, etp) in [("ETP 2", 2), ("ETP 1", 1)] {
        let config = expert_tp(moe_gpt(), etp);
        let name = format!("TP 2 x EP 2, {name}");
        assert_same(&name, &train(&config, [2, 1, 2, 2], keep), &want);
        let sp = config.with_sequence_parallel(true);
        assert_same(
            &format!("{name} + SP"),
            &train(&sp, [2, 1, 2, 2], keep),
            &want,
        );
    }
    // The default is ETP = TP.
    let default = moe_gpt().with_sequence_parallel(true);
    assert_same(
        "TP 2 + SP x EP 2",
        &train(&default, [2, 1, 2, 2], keep),
        &want,
    );
    // SwiGLU experts: their gate split as fc1.
    let swiglu = moe_gpt().with_activation(Activation::SwiGlu);
    let want_swiglu = reference(&swiglu, 2, keep);
    let sp = swiglu.with_sequence_parallel(true);
    let got = train(&sp, [2, 1, 2, 2], keep);
    assert_same(
        "SwiGLU experts, TP 2 + SP x EP 2, ETP 2",
        &got,
        &want_swiglu,
    );
    // With PP 2 the MoE losses are those of each stage's layer; compare the gradients and
    // the loss, which carry both stages' MoE losses.
    let mut got = train(&config, [1, 2, 2, 2], keep);
    got.load_balancing_loss = want.load_balancing_loss;
    got.z_loss = want.z_loss;
    assert_same("PP 2 x EP 2", &got, &want);
}

#[test]
fn experts_without_tokens_get_zero_gradients_at_ep_2() {
    let config = moe_gpt();
    let want = reference(&config, 2, starve_experts_23);
    for path in ["fc1", "fc2"] {
        let g = &want.grads[&format!("block.layers.0.moe.experts.{path}")];
        let per_expert = g.len() / 4;
        assert!(
            g[2 * per_expert..].iter().all(|&v| v == 0.0),
            "{path}: starved experts"
        );
        assert!(
            g[..2 * per_expert].iter().any(|&v| v != 0.0),
            "{path}: busy experts"
        );
    }
    assert_same(
        "EP 2, experts 2 and 3 starved",
        &train(&config, [1, 1, 2, 2], starve_experts_23),
        &want,
    );
}

/// The all-gather dispatcher (`--moe-token-dispatcher-type allgather`) in the model, against
/// the EP 1 model (all-to-all): EP 2 (DP 2) and EP 2 × expert-DP 2 (DP 4), there also with
/// layer 0 sending no token to experts 2 and 3 (EP rank 1's, so ranks 1 and 3 compute their
/// experts on nothing), and TP 2 with sequence parallelism × EP 2.
#[test]
fn gpt_with_the_all_gather_dispatcher_equals_one_device() {
    let all_gather = |config: TransformerConfig| TransformerConfig {
        moe: config
            .moe
            .map(|m| m.with_token_dispatcher(TokenDispatcherType::AllGather)),
        ..config
    };
    let config = all_gather(moe_gpt());
    for (name, layout, starve) in [
        ("all-gather EP 2", [1, 1, 2, 2], keep as fn(_) -> _),
        ("all-gather EP 2 x expert-DP 2", [1, 1, 4, 2], keep),
        (
            "all-gather EP 2 x expert-DP 2, experts 2 and 3 starved",
            [1, 1, 4, 2],
            starve_experts_23,
        ),
    ] {
        let want = reference(&moe_gpt(), layout[2], starve);
        assert_same(name, &train(&config, layout, starve), &want);
    }
    let want = reference(&moe_gpt(), 2, keep);
    for etp in [1, 2] {
        let sp = all_gather(expert_tp(moe_gpt(), etp).with_sequence_parallel(true));
        assert_same(
            &format!("all-gather TP 2 + SP x EP 2, ETP {etp}"),
            &train(&sp, [2, 1, 2, 2], keep),
            &want,
        );
    }
}

/// Expert tensor parallelism splits each expert's width over TP: at TP 2 every rank holds
/// half of each routed and shared expert's `fc1` and `fc2` (GeLU experts), declared sharded;
/// with `--expert-tensor-parallel-size 1` they are whole.
#[test]
fn expert_tensor_parallelism_splits_the_experts_width() {
    let shapes = |config: TransformerConfig| {
        run(2, move |ctx| {
            let state = ctx.parallel_state(ParallelSizes::default().with_tp(2))?;
            let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
            let moe = model.block.layers[0].moe.as_ref().expect("an MoE layer");
            let placements = Placements::of(&model);
            let (experts, shared) = (&moe.experts, moe.shared_expert.as_ref().expect("shared"));
            assert!(experts.gate.is_none(), "GeLU experts");
            Ok(
                [&experts.fc1, &experts.fc2, &shared.fc1, &shared.fc2].map(|w| {
                    let placement = placements.get(w.id).expect("declared");
                    (w.dims().to_vec(), placement.dim())
                }),
            )
        })
    };
    // 4 experts of width 12 (6 a rank), a shared expert of width 8 (4 a rank), hidden 16.
    let split = [
        (vec![4, 16, 6], Some(2)),
        (vec![4, 6, 16], Some(1)),
        (vec![1, 16, 4], Some(2)),
        (vec![1, 4, 16], Some(1)),
    ];
    for rank in shapes(moe_gpt()) {
        assert_eq!(rank, split);
    }
    let whole = [
        (vec![4, 16, 12], None),
        (vec![4, 12, 16], None),
        (vec![1, 16, 8], None),
        (vec![1, 8, 16], None),
    ];
    for rank in shapes(expert_tp(moe_gpt(), 1)) {
        assert_eq!(rank, whole);
    }
}
