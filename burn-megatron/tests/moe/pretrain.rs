//! `pretrain_gpt` with MoE layers on CPU thread ranks: Megatron's options reach the model,
//! the loss falls at EP 2, the log carries the MoE losses and load, the layout errors, and
//! checkpoints: saved at EP 2 and resumed at EP 2 (with and without ZeRO-1), EP 1 and EP 4,
//! the next losses equal the uninterrupted run's.

use burn_megatron::training::{PretrainArgs, PretrainConfig, Silent, pretrain_on_threads};
use burn_megatron_testing::scratch_dir;
use clap::Parser;

use crate::{assert_close, tolerance};

/// `pretrain_gpt` with `extra` after a tiny model's options: 2 layers of width 16,
/// sequences of 16, 4 microbatches of 2 a step, 6 steps, no evaluation or checkpoint.
pub(crate) fn config(extra: &[&str]) -> PretrainConfig {
    let base = [
        "pretrain_gpt",
        "--num-layers",
        "2",
        "--hidden-size",
        "16",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--train-iters",
        "6",
        "--lr",
        "1e-2",
        "--min-lr",
        "1e-3",
        "--lr-warmup-iters",
        "1",
        "--eval-interval",
        "0",
        "--split",
        "90,10,0",
        "--tensor-model-parallel-size",
        "1",
        "--pipeline-model-parallel-size",
        "1",
    ];
    let args = PretrainArgs::parse_from(base.iter().chain(extra));
    args.into_config()
        .expect("valid options")
        .with_default_corpus_documents(200)
}

/// The MoE options of several `pretrain_gpt` runs: DP 2 × EP 2, 4 experts of width 24, top 2.
pub(crate) const EP_2: [&str; 10] = [
    "--data-parallel-size",
    "2",
    "--num-experts",
    "4",
    "--moe-router-topk",
    "2",
    "--expert-model-parallel-size",
    "2",
    "--moe-ffn-hidden-size",
    "24",
];

#[test]
fn pretrain_gpt_with_experts_at_ep_2_trains() {
    let mut args = EP_2.to_vec();
    args.extend_from_slice(&[
        "--moe-shared-expert-intermediate-size",
        "16",
        "--moe-aux-loss-coeff",
        "0.01",
        "--moe-z-loss-coeff",
        "0.001",
        "--moe-layer-freq",
        "([1]*1+[0]*1)",
    ]);
    let config = config(&args);
    let moe = config.model().moe.expect("MoE layers");
    assert_eq!(
        (moe.num_experts, moe.top_k, moe.ffn_hidden_size),
        (4, 2, Some(24))
    );
    assert_eq!(moe.moe_layers(2), vec![0]);
    let summary = pretrain_on_threads(&config, &Silent).expect("pretraining");
    let losses = summary.losses();
    assert!(
        losses.iter().all(|l| l.is_finite()) && losses[5] < losses[0] - 0.3,
        "the loss must fall: {losses:?}"
    );
    let report = summary.iterations[5]
        .moe
        .expect("the MoE report of a logged step");
    assert!(report.load_balancing_loss > 0.005 && report.load_balancing_loss < 0.05);
    assert!(report.z_loss > 0.0);
    assert!(report.expert_load_min <= 1.0 && report.expert_load_max >= 1.0);
}

#[test]
fn expert_layout_errors_name_the_options() {
    let err = |extra: &[&str]| {
        let config = config(extra);
        config
            .check(config.world_size())
            .expect_err("an invalid layout")
            .to_string()
    };
    let e = err(&[
        "--data-parallel-size",
        "2",
        "--num-experts",
        "4",
        "--expert-model-parallel-size",
        "4",
    ]);
    assert!(
        e.contains("--expert-model-parallel-size (4) must divide DP × CP"),
        "{e}"
    );
    assert!(!e.contains("span"), "{e}");
    // A Megatron script whose EP spans the TP ranks (--expert-tensor-parallel-size 1) is told
    // that this grid is not implemented.
    let spanning = config(&[
        "--data-parallel-size",
        "2",
        "--num-experts",
        "4",
        "--expert-model-parallel-size",
        "4",
        "--expert-tensor-parallel-size",
        "1",
    ])
    .with_tensor_model_parallel_size(2);
    let e = spanning
        .check(spanning.world_size())
        .expect_err("EP spanning TP")
        .to_string();
    assert!(
        e.contains("must divide DP × CP (2 × 1)") && e.contains("span the 2 TP ranks"),
        "{e}"
    );
    let three = config(&[
        "--data-parallel-size",
        "3",
        "--num-experts",
        "4",
        "--expert-model-parallel-size",
        "3",
    ])
    .with_global_batch_size(6);
    let e = three.check(3).expect_err("3 does not divide 4").to_string();
    assert!(
        e.contains("divisible by the expert-parallel size (3)"),
        "{e}"
    );
    let e = err(&["--num-experts", "4", "--moe-router-topk", "5"]);
    assert!(e.contains("top_k (5)"), "{e}");
    let e = err(&[
        "--expert-model-parallel-size",
        "2",
        "--data-parallel-size",
        "2",
    ]);
    assert!(e.contains("need --num-experts"), "{e}");
    let e = err(&["--expert-tensor-parallel-size", "1"]);
    assert!(e.contains("need --num-experts"), "{e}");
    let at_tp_2 = |extra: &[&str]| {
        let config = config(extra).with_tensor_model_parallel_size(2);
        config
            .check(config.world_size())
            .expect_err("an invalid layout")
            .to_string()
    };
    let e = at_tp_2(&["--num-experts", "4", "--expert-tensor-parallel-size", "4"]);
    assert!(e.contains("--expert-tensor-parallel-size 4: 1"), "{e}");
    let e = at_tp_2(&["--num-experts", "4", "--moe-ffn-hidden-size", "25"]);
    assert!(
        e.contains(
            "--moe-ffn-hidden-size (25) must be a multiple of the expert-tensor-parallel size (2"
        ),
        "{e}"
    );
    let e = err(&["--num-experts", "4", "--moe-layer-freq", "([1]*3)"]);
    assert!(e.contains("gives 3 layers, the model has 2"), "{e}");
    let bad = PretrainArgs::parse_from(["pretrain_gpt", "--moe-layer-freq", "[2,x]"]).into_config();
    assert!(
        bad.expect_err("a bad list")
            .to_string()
            .contains("--moe-layer-freq")
    );
}

/// A run with experts at DP `dp` × EP `ep` (4 experts, top 2, both losses, a shared expert,
/// layer 0 MoE) for `iters` of 4 steps.
fn moe_run(dp: usize, ep: usize, zero1: bool, iters: usize) -> PretrainConfig {
    moe_run_with(dp, ep, zero1, iters, &[])
}

/// [`moe_run`] with `extra` options.
pub(crate) fn moe_run_with(
    dp: usize,
    ep: usize,
    zero1: bool,
    iters: usize,
    extra: &[&str],
) -> PretrainConfig {
    let (dp, ep) = (dp.to_string(), ep.to_string());
    let mut args = vec![
        "--data-parallel-size",
        &dp,
        "--num-experts",
        "4",
        "--expert-model-parallel-size",
        &ep,
        "--moe-ffn-hidden-size",
        "24",
        "--moe-shared-expert-intermediate-size",
        "16",
        "--moe-aux-loss-coeff",
        "0.01",
        "--moe-z-loss-coeff",
        "0.001",
        "--moe-layer-freq",
        "2",
        "--lr-decay-iters",
        "4",
    ];
    if zero1 {
        args.push("--use-distributed-optimizer");
    }
    args.extend_from_slice(extra);
    config(&args).with_train_iters(iters)
}

/// Saves after 2 of 4 steps at `from`, resumes at `to`: the last two losses equal `to`'s
/// uninterrupted run's.
fn resume(name: &str, from: (usize, usize, bool), to: (usize, usize, bool)) {
    let dir = scratch_dir("bm-moe", name);
    let run = |(dp, ep, zero1): (usize, usize, bool), iters| moe_run(dp, ep, zero1, iters);
    let train = |c: &PretrainConfig| pretrain_on_threads(c, &Silent).expect("pretraining");
    let uninterrupted = train(&run(to, 4));
    let stopped = train(
        &run(from, 2)
            .with_save(Some(dir.clone()))
            .with_save_interval(Some(2)),
    );
    assert_eq!(stopped.checkpoints.len(), 1, "{name}");
    // Each EP rank's experts, and their optimizer state, in files of their own.
    let saved = &stopped.checkpoints[0];
    let optimizer = match from.2 {
        true => "optimizer_tp0_pp0_ep1_edp0.safetensors",
        false => "optimizer_tp0_pp0_ep1.safetensors",
    };
    for file in ["model_tp0_pp0_ep1.safetensors", optimizer] {
        assert!(saved.join(file).exists(), "{name}: {file}");
    }
    let resumed = train(&run(to, 4).with_load(Some(dir.clone())));
    assert!(resumed.resumed_from.is_some(), "{name}");
    let got = resumed.losses();
    let want = &uninterrupted.losses()[2..];
    assert_close(name, &got, want, tolerance::F32_TRAINING);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn checkpoint_with_experts_resumes_at_the_same_layout() {
    resume("ep2", (2, 2, false), (2, 2, false));
    resume("ep2-zero1", (2, 2, true), (2, 2, true));
}

#[test]
fn checkpoint_with_experts_reshards_to_ep_1_and_4() {
    resume("ep2-to-ep1", (2, 2, true), (2, 1, true));
    resume("ep2-to-ep4", (2, 2, false), (4, 4, true));
}

/// Expert tensor parallelism in checkpoints: saved at TP 2 × EP 2 (DP 2) with each expert's
/// width split over TP (every TP rank writes its half of its EP rank's experts), resumed with
/// split experts, with whole ones at TP 2, and at TP 1: the next losses equal the
/// uninterrupted runs'.
#[test]
fn checkpoint_with_split_experts_reshards_to_whole_ones() {
    let run = |tp: usize, etp: &str, iters| {
        let etp = ["--expert-tensor-parallel-size", etp];
        moe_run_with(2, 2, true, iters, &etp).with_tensor_model_parallel_size(tp)
    };
    let train = |c: &PretrainConfig| pretrain_on_threads(c, &Silent).expect("pretraining");
    let dir = scratch_dir("bm-moe", "etp");
    let stopped = train(
        &run(2, "2", 2)
            .with_save(Some(dir.clone()))
            .with_save_interval(Some(2)),
    );
    let saved = &stopped.checkpoints[0];
    for file in [
        "model_tp0_pp0_ep1.safetensors",
        "model_tp1_pp0_ep1.safetensors",
    ] {
        assert!(saved.join(file).exists(), "{file}");
    }
    for (name, tp, etp) in [
        ("ETP 2 to ETP 2", 2, "2"),
        ("ETP 2 to TP 2, ETP 1", 2, "1"),
        ("ETP 2 to TP 1", 1, "1"),
    ] {
        let uninterrupted = train(&run(tp, etp, 4));
        let resumed = train(&run(tp, etp, 4).with_load(Some(dir.clone())));
        assert!(resumed.resumed_from.is_some(), "{name}");
        let want = &uninterrupted.losses()[2..];
        assert_close(name, &resumed.losses(), want, tolerance::F32_TRAINING);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// `--moe-router-dtype` reaches the routers: on the CPU's f32 model `fp32` gives the default
/// run's losses exactly and `fp64` close ones (here the same: the f64 weights round back to
/// f32's), and every MoE layer's router has the dtype; an unknown dtype and the option
/// without `--num-experts` are refused.
#[test]
fn router_dtype_option_reaches_the_routers() {
    use burn_megatron::transformer::moe::RouterDtype;
    let run = |extra: &[&str]| {
        let config = moe_run_with(2, 2, false, 3, extra);
        pretrain_on_threads(&config, &Silent)
            .expect("pretraining")
            .losses()
    };
    let default = run(&[]);
    assert_eq!(run(&["--moe-router-dtype", "fp32"]), default);
    let fp64 = run(&["--moe-router-dtype", "fp64"]);
    assert_close("fp64 router", &fp64, &default, tolerance::F32_TRAINING);
    // The option reaches every MoE layer's router.
    let model = config(&["--num-experts", "4", "--moe-router-dtype", "fp64"]).model();
    assert_eq!(
        model.moe.as_ref().map(|moe| moe.router_dtype),
        Some(Some(RouterDtype::Fp64))
    );
    let dtypes = burn_megatron_testing::run(1, |ctx| {
        let gpt = model.init_gpt::<crate::AD>(ctx.world(), &Default::default())?;
        Ok(gpt
            .block
            .layers
            .iter()
            .map(|l| l.moe.as_ref().map(|moe| moe.router.settings().dtype))
            .collect::<Vec<_>>())
    })
    .remove(0);
    assert_eq!(dtypes, vec![Some(Some(RouterDtype::Fp64)); 2]);
    for (args, needle) in [
        (
            &["--num-experts", "4", "--moe-router-dtype", "bf16"][..],
            "--moe-router-dtype \"bf16\"",
        ),
        (&["--moe-router-dtype", "fp32"][..], "need --num-experts"),
    ] {
        let args = std::iter::once("pretrain_gpt").chain(args.iter().copied());
        let error = PretrainArgs::parse_from(args)
            .into_config()
            .and_then(|c| c.check(c.world_size()).map(|_| ()))
            .expect_err("refused")
            .to_string();
        assert!(error.contains(needle), "{error}");
    }
}

/// DeepSeek-V3's expert bias in pretrain_gpt: the bias moves by multiples of the rate, is
/// saved, and a run resumed after step 3 continues it (the saved bias steers the next
/// choices: a lost one changes the loss).
#[test]
fn expert_bias_moves_with_the_load_and_resumes() {
    let bias = [
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate",
        "0.05",
    ];
    let dir = scratch_dir("bm-moe", "bias");
    let train = |c: &PretrainConfig| pretrain_on_threads(c, &Silent).expect("pretraining");
    let uninterrupted = train(&moe_run_with(2, 2, true, 4, &bias));
    train(
        &moe_run_with(2, 2, true, 3, &bias)
            .with_save(Some(dir.clone()))
            .with_save_interval(Some(3)),
    );
    let resumed = train(&moe_run_with(2, 2, true, 4, &bias).with_load(Some(dir.clone())));
    assert_close(
        "resumed with the expert bias",
        &resumed.losses(),
        &uninterrupted.losses()[3..],
        tolerance::F32_TRAINING,
    );
    // Dense DP 1 (Burn's AdamW) also trains with a bias that has no gradient.
    let single = train(&moe_run_with(1, 1, false, 4, &bias));
    assert!(single.losses().iter().all(|l| l.is_finite()));
    let config = moe_run_with(2, 2, true, 4, &bias).model();
    let values = burn_megatron_testing::run(1, |ctx| {
        let model = config.init_gpt::<crate::AD>(ctx.world(), &Default::default())?;
        let checkpoint = burn_megatron::checkpointing::Checkpoint::open_latest(&dir)?;
        let model = checkpoint.load_model(model)?;
        let moe = model.block.layers[0]
            .moe
            .as_ref()
            .expect("layer 0 is an MoE layer");
        let bias = moe.router.expert_bias.as_ref().expect("an expert bias");
        Ok(crate::values(bias.val()))
    })
    .remove(0);
    // Three updates of ±0.05 (or 0): each value is a multiple of 0.05 within 0.15. (At this
    // rate the bias outweighs the router's scores and the load swings between experts 0, 1
    // and 2, 3 from step to step, so after two steps it can be back at zero.)
    assert!(
        values.iter().any(|&v| v != 0.0),
        "the bias moved: {values:?}"
    );
    for v in &values {
        let steps = v / 0.05;
        assert!(
            (steps - steps.round()).abs() < 1e-4 && v.abs() <= 0.1 + 1e-6,
            "{values:?}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The experts are buffers of their own (expert-DP = DP at EP 1): `--overlap-grad-reduce`
/// reduces the dense ones inside the backward pass and the experts after it, and the losses
/// are those of the reduction after the backward pass, at EP 1 and 2.
#[test]
fn overlapped_reduction_equals_the_plain_one() {
    let train = |c: &PretrainConfig| pretrain_on_threads(c, &Silent).expect("pretraining");
    for ep in [1, 2] {
        let plain = train(&moe_run(2, ep, true, 3));
        let overlapped = train(&moe_run_with(2, ep, true, 3, &["--overlap-grad-reduce"]));
        assert!(overlapped.reduced_in_backward > 0);
        assert_close(
            &format!("overlapped at EP {ep}"),
            &overlapped.losses(),
            &plain.losses(),
            tolerance::F32,
        );
    }
}

/// TP 2 × PP 2 × DP 2 with EP 2 and the MoE layer on the last stage only (`[0,1]`): the loss
/// falls, and the logging rank (stage 0, no MoE layer) reports the MoE losses and load that
/// the pipeline group brings it.
#[test]
fn pretrain_gpt_with_experts_at_tp_2_pp_2_ep_2() {
    let config = config(&[
        "--data-parallel-size",
        "2",
        "--num-experts",
        "4",
        "--expert-model-parallel-size",
        "2",
        "--moe-aux-loss-coeff",
        "0.01",
        "--moe-layer-freq",
        "[0,1]",
    ])
    .with_tensor_model_parallel_size(2)
    .with_pipeline_model_parallel_size(2);
    let summary = pretrain_on_threads(&config, &Silent).expect("pretraining");
    let losses = summary.losses();
    assert!(
        losses[5] < losses[0] - 0.3,
        "the loss must fall: {losses:?}"
    );
    let report = summary.iterations[5].moe.expect("the MoE report");
    assert!(report.load_balancing_loss > 0.005, "{report:?}");
    assert!(
        report.expert_load_min <= 1.0 && report.expert_load_max >= 1.0,
        "{report:?}"
    );
}

/// Through burn-train's `Learner` (`--learner`) at EP 2 × DP 2 with ZeRO-1: the losses of
/// `pretrain`'s own loop, exactly (the same schedule, MoE losses and optimizer), and its MoE
/// metrics the loop's report; with DeepSeek-V3's expert bias too, whose update moves the
/// losses (against the run without it) as the loop's does; with a capacity, whose dropped
/// assignments are a metric; and with `global_aux_loss` (the Learner's step counts the load
/// over DP and afresh each step, as the loop does).
#[test]
fn learner_with_experts_equals_the_pretrain_loop() {
    use burn_megatron::training::PretrainData;
    use burn_megatron::training::learner::{
        LearnerReporting, MetricRecorder, pretrain_with_learner,
    };
    let bias = [
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate",
        "0.05",
    ];
    let capacity = ["--moe-expert-capacity-factor", "0.5"];
    let global = ["--moe-router-load-balancing-type", "global_aux_loss"];
    let mut loop_losses = Vec::new();
    for extra in [&[][..], &bias[..], &capacity[..], &global[..]] {
        let config = moe_run_with(2, 2, true, 4, extra).with_eval_interval(0);
        let loop_run = pretrain_on_threads(&config, &Silent).expect("pretraining");
        let learner = config.clone().with_learner(true);
        let data = PretrainData::build(&learner).expect("data");
        let reporting = LearnerReporting {
            directory: scratch_dir("bm-moe", "learner"),
            recorder: Some(MetricRecorder::new()),
            quiet: true,
            peak_flops_per_device: None,
        };
        burn_megatron_testing::run(learner.world_size(), |ctx| {
            pretrain_with_learner::<crate::AD>(
                &ctx,
                &learner,
                &data,
                &Default::default(),
                &reporting,
            )?;
            Ok(())
        });
        let _ = std::fs::remove_dir_all(&reporting.directory);
        let recorder = reporting.recorder.expect("a recorder");
        let name = format!("Learner {extra:?}");
        assert_eq!(recorder.values("Loss", true), loop_run.losses(), "{name}");
        let reports: Vec<_> = loop_run
            .iterations
            .iter()
            .map(|i| i.moe.expect("the MoE report"))
            .collect();
        for (metric, want) in [
            (
                "Load-balancing loss",
                reports
                    .iter()
                    .map(|r| r.load_balancing_loss)
                    .collect::<Vec<_>>(),
            ),
            ("Z-loss", reports.iter().map(|r| r.z_loss).collect()),
            (
                "Expert load min",
                reports.iter().map(|r| r.expert_load_min).collect(),
            ),
            (
                "Expert load max",
                reports.iter().map(|r| r.expert_load_max).collect(),
            ),
        ] {
            let got = recorder.values(metric, true);
            assert_eq!(got.len(), 4, "{name}: {metric}");
            assert_close(&format!("{name}: {metric}"), &got, &want, tolerance::F32);
        }
        let dropped = recorder.values("Dropped assignments", true);
        match extra == capacity {
            true => {
                let want: Vec<f64> = reports
                    .iter()
                    .map(|r| 100.0 * r.dropped_assignments.expect("a capacity") / r.assignments)
                    .collect();
                assert!(want.iter().all(|&p| p >= 50.0), "{want:?}");
                assert_close(&format!("{name}: dropped"), &dropped, &want, tolerance::F32);
            }
            false => assert!(dropped.is_empty(), "{name}: no capacity, no metric"),
        }
        loop_losses.push(loop_run.losses());
    }
    // The bias steers the routing: without its update the later losses differ.
    assert_ne!(loop_losses[0][2..], loop_losses[1][2..]);
}

/// `checkpoint_tool convert`'s library call on a checkpoint saved at EP 2 × DP 2 (ZeRO-1):
/// the converted checkpoint (one rank, every expert in one file) resumes at EP 2 with the
/// uninterrupted run's losses.
#[test]
fn converted_checkpoint_with_experts_resumes() {
    use burn_megatron::checkpointing::{TargetLayout, convert_layout};
    let (saved, converted) = (
        scratch_dir("bm-moe", "convert-src"),
        scratch_dir("bm-moe", "convert-dst"),
    );
    let train = |c: &PretrainConfig| pretrain_on_threads(c, &Silent).expect("pretraining");
    let uninterrupted = train(&moe_run(2, 2, true, 4));
    let stopped = train(
        &moe_run(2, 2, true, 2)
            .with_save(Some(saved.clone()))
            .with_save_interval(Some(2)),
    );
    let dir = convert_layout(&stopped.checkpoints[0], &converted, TargetLayout::new(1, 1))
        .expect("converted");
    assert!(dir.join("model_tp0_pp0_ep0.safetensors").exists());
    let resumed = train(&moe_run(2, 2, true, 4).with_load(Some(converted.clone())));
    assert_close(
        "resumed from the converted checkpoint",
        &resumed.losses(),
        &uninterrupted.losses()[2..],
        tolerance::F32_TRAINING,
    );
    let _ = std::fs::remove_dir_all(saved);
    let _ = std::fs::remove_dir_all(converted);
}

/// Context parallelism: CP 2 with the experts split over the two CP ranks (EP 2, DP 1)
/// against one rank. Each CP rank's MoE losses are its share of the sequence batch's (the
/// load from both ranks' counts), so the losses, the logged MoE losses and the training
/// equal one rank's.
#[test]
fn context_parallel_with_experts_equals_one_rank() {
    let train = |c: &PretrainConfig| pretrain_on_threads(c, &Silent).expect("pretraining");
    let one = train(&moe_run(1, 1, true, 4));
    let cp = train(&moe_run_with(
        1,
        2,
        true,
        4,
        &["--context-parallel-size", "2"],
    ));
    assert_close(
        "CP 2 x EP 2",
        &cp.losses(),
        &one.losses(),
        tolerance::F32_TRAINING,
    );
    for (got, want) in cp.iterations.iter().zip(&one.iterations) {
        let (got, want) = (got.moe.expect("a report"), want.moe.expect("a report"));
        assert_close(
            "MoE losses",
            &[got.load_balancing_loss, got.z_loss],
            &[want.load_balancing_loss, want.z_loss],
            tolerance::F32_TRAINING,
        );
    }
}

/// `--moe-router-load-balancing-type global_aux_loss`: DP 2 × EP 2 with micro-batches of 2
/// equals one rank whose two micro-batches of 4 hold both DP ranks' (the load summed over DP
/// and averaged over the step's micro-batches, each DP rank's share counted twice since DP
/// averages the gradients), and CP 2 × EP 2 equals one rank (the shares add up over CP): the
/// losses and the logged MoE losses. The one rank's `aux_loss`, whose load is each
/// micro-batch's own, logs another load-balancing loss, so the comparison is sharp.
#[test]
fn global_aux_loss_equals_one_rank_holding_the_dp_and_cp_ranks_batches() {
    use burn_megatron::transformer::moe::LoadBalancingType;
    let train = |c: &PretrainConfig| pretrain_on_threads(c, &Silent).expect("pretraining");
    let global = ["--moe-router-load-balancing-type", "global_aux_loss"];
    let dp = moe_run_with(2, 2, true, 4, &global);
    assert_eq!(
        dp.model().moe.map(|moe| moe.load_balancing_type),
        Some(LoadBalancingType::GlobalAuxLoss)
    );
    let union = moe_run_with(1, 1, true, 4, &global).with_micro_batch_size(4);
    let cp_options = [&global[..], &["--context-parallel-size", "2"]].concat();
    let cp = moe_run_with(1, 2, true, 4, &cp_options);
    let one = moe_run_with(1, 1, true, 4, &global);
    let per_micro_batch = moe_run(1, 1, true, 4).with_micro_batch_size(4);
    let lb = |summary: &burn_megatron::training::PretrainSummary| -> Vec<f64> {
        let moe = summary.iterations.iter().map(|i| i.moe.expect("a report"));
        moe.map(|m| m.load_balancing_loss).collect()
    };
    for (name, layout, reference) in [("DP 2 x EP 2", dp, union), ("CP 2 x EP 2", cp, one)] {
        let (got, want) = (train(&layout), train(&reference));
        assert_close(name, &got.losses(), &want.losses(), tolerance::F32_TRAINING);
        assert_close(name, &lb(&got), &lb(&want), tolerance::F32_TRAINING);
        assert!(lb(&want).iter().all(|&l| l > 0.0));
        if name.starts_with("DP") {
            let other = lb(&train(&per_micro_batch));
            let apart = other
                .iter()
                .zip(lb(&want))
                .any(|(a, b)| (a - b).abs() > 1e-4 * b);
            assert!(
                apart,
                "aux_loss {other:?} against global_aux_loss {:?}",
                lb(&want)
            );
        }
    }
}

/// DeepSeek-V3's router options through `pretrain_gpt`
/// (`--moe-router-score-function sigmoid --moe-router-num-groups 2 --moe-router-group-topk 1
/// --moe-router-topk-scaling-factor 2.5 --moe-router-load-balancing-type seq_aux_loss`)
/// reach the model, and CP 2 with the experts split over the two CP ranks equals one rank:
/// the sequence-level loss's counts per sequence are summed over CP.
#[test]
fn context_parallel_with_router_options_equals_one_rank() {
    use burn_megatron::transformer::moe::{LoadBalancingType, RouterScoreFunction};
    let options = [
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-num-groups",
        "2",
        "--moe-router-group-topk",
        "1",
        "--moe-router-topk-scaling-factor",
        "2.5",
        "--moe-router-load-balancing-type",
        "seq_aux_loss",
    ];
    let one = moe_run_with(1, 1, true, 4, &options);
    let moe = one.model().moe.expect("MoE layers");
    assert_eq!(
        (
            moe.score_function,
            moe.num_groups,
            moe.group_top_k,
            moe.top_k_scaling_factor,
            moe.load_balancing_type
        ),
        (
            RouterScoreFunction::Sigmoid,
            Some(2),
            Some(1),
            Some(2.5),
            LoadBalancingType::SeqAuxLoss
        )
    );
    let train = |c: &PretrainConfig| pretrain_on_threads(c, &Silent).expect("pretraining");
    let one = train(&one);
    let mut cp_options = options.to_vec();
    cp_options.extend(["--context-parallel-size", "2"]);
    let cp = train(&moe_run_with(1, 2, true, 4, &cp_options));
    assert_close(
        "CP 2 x EP 2",
        &cp.losses(),
        &one.losses(),
        tolerance::F32_TRAINING,
    );
    assert_same_moe_losses(&cp, &one);
}

/// `--moe-router-load-balancing-type sinkhorn` through `pretrain_gpt`: CP 2 with the experts
/// split over the two CP ranks equals one rank, and the choice differs from the plain
/// top-k's (the losses differ from the run without it, whose load-balancing loss is also 0).
/// The sums over both halves of a sequence are checked directly in `sinkhorn.rs`: on this
/// tiny model the choice alone would not show their absence.
#[test]
fn context_parallel_with_sinkhorn_equals_one_rank() {
    use burn_megatron::transformer::moe::LoadBalancingType;
    let run = |ep: usize, extra: &[&str]| {
        let mut options = vec!["--moe-router-load-balancing-type", "sinkhorn"];
        options.extend_from_slice(extra);
        // moe_run_with's load-balancing loss off: Sinkhorn balancing takes none.
        moe_run_with(1, ep, true, 4, &options).with_moe_aux_loss_coeff(0.0)
    };
    let one = run(1, &[]);
    let moe = one.model().moe.expect("MoE layers");
    assert_eq!(moe.load_balancing_type, LoadBalancingType::Sinkhorn);
    let train = |c: &PretrainConfig| pretrain_on_threads(c, &Silent).expect("pretraining");
    let one = train(&one);
    let cp = train(&run(2, &["--context-parallel-size", "2"]));
    assert_close(
        "CP 2 x EP 2 with Sinkhorn",
        &cp.losses(),
        &one.losses(),
        tolerance::F32_TRAINING,
    );
    let plain = train(
        &moe_run_with(1, 1, true, 4, &["--moe-router-load-balancing-type", "none"])
            .with_moe_aux_loss_coeff(0.0),
    );
    let diff = burn_megatron_testing::relative_difference("plain", &plain.losses(), &one.losses());
    assert!(diff > 1e-4, "Sinkhorn's choice changed nothing: {diff:.2e}");
}

/// Megatron's MoE performance switches (`--moe-grouped-gemm`, `--moe-permute-fusion`,
/// `--moe-shared-expert-overlap`, as its Mixtral and DeepSeek-V3 scripts pass them) are
/// accepted and change nothing, on the command line and in a file; turning one off, or one
/// without `--num-experts`, is an error naming it.
#[test]
fn megatrons_moe_switches_are_accepted() {
    let parse = |extra: &[&str]| {
        let base = ["pretrain_gpt"];
        PretrainArgs::parse_from(base.iter().chain(extra)).into_config()
    };
    let experts = ["--num-experts", "4"];
    let plain = parse(&experts).expect("plain").to_string();
    let switches = [
        "--moe-grouped-gemm",
        "--moe-permute-fusion",
        "--moe-shared-expert-overlap",
    ];
    let all: Vec<&str> = experts.iter().chain(&switches).copied().collect();
    assert_eq!(parse(&all).expect("the switches").to_string(), plain);
    let dir = scratch_dir("bm-moe", "switches");
    let file = dir.join("run.toml");
    std::fs::write(
        &file,
        "num-experts = 4\nmoe-grouped-gemm = true\nmoe-permute-fusion = true\n",
    )
    .expect("writing the file");
    let from_file = parse(&["--config", file.to_str().expect("a UTF-8 path")]).expect("file");
    assert_eq!(from_file.to_string(), plain);
    for switch in switches {
        let e = parse(&["--num-experts", "4", switch, "false"])
            .expect_err("turned off")
            .to_string();
        assert!(e.contains(switch) && e.contains("always on here"), "{e}");
        let e = parse(&[switch]).expect_err("without experts").to_string();
        assert!(
            e.contains(switch) && e.contains("needs --num-experts"),
            "{e}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The router options' errors name the options: `global_aux_loss` with full recomputation, an
/// unknown type, a
/// NaN scaling factor, groups that do not split the experts, a group top-k above the groups,
/// softmax top-1 without pre-softmax, and any of them without `--num-experts`.
#[test]
fn router_option_errors_name_the_options() {
    let parse = |extra: &[&str]| {
        let base = ["pretrain_gpt", "--num-experts", "4"];
        PretrainArgs::parse_from(base.iter().chain(extra)).into_config()
    };
    let e = parse(&["--moe-router-load-balancing-type", "balanced"])
        .expect_err("unknown")
        .to_string();
    assert!(
        e.contains("use aux_loss, seq_aux_loss, global_aux_loss, sinkhorn or none"),
        "{e}"
    );

    let err = |extra: &[&str]| {
        let config = config(extra);
        config
            .check(config.world_size())
            .expect_err("invalid options")
            .to_string()
    };
    let e = err(&[
        "--num-experts",
        "4",
        "--moe-router-load-balancing-type",
        "global_aux_loss",
        "--recompute-granularity",
        "full",
    ]);
    assert!(
        e.contains("global_aux_loss with full recomputation is not supported yet"),
        "{e}"
    );
    let e = err(&[
        "--num-experts",
        "4",
        "--moe-router-load-balancing-type",
        "sinkhorn",
        "--moe-aux-loss-coeff",
        "0.01",
    ]);
    assert!(
        e.contains("sinkhorn does not take --moe-aux-loss-coeff"),
        "{e}"
    );
    let e = err(&[
        "--num-experts",
        "4",
        "--moe-router-topk-scaling-factor",
        "nan",
    ]);
    assert!(
        e.contains("--moe-router-topk-scaling-factor) is NaN"),
        "{e}"
    );
    let e = err(&[
        "--num-experts",
        "4",
        "--moe-router-num-groups",
        "3",
        "--moe-router-group-topk",
        "1",
    ]);
    assert!(
        e.contains("--moe-router-num-groups) must divide num_experts (4)"),
        "{e}"
    );
    let e = err(&[
        "--num-experts",
        "4",
        "--moe-router-num-groups",
        "2",
        "--moe-router-group-topk",
        "3",
    ]);
    assert!(e.contains("between 1 and num_groups (2)"), "{e}");
    let e = err(&["--num-experts", "4", "--moe-router-topk", "1"]);
    assert!(e.contains("--moe-router-pre-softmax"), "{e}");
    for option in [
        &["--moe-router-pre-softmax"][..],
        &["--moe-router-num-groups", "2"],
        &["--moe-router-topk-scaling-factor", "2.5"],
        &["--moe-router-load-balancing-type", "seq_aux_loss"],
    ] {
        let e = err(option);
        assert!(e.contains("need --num-experts"), "{option:?}: {e}");
    }
}

/// Megatron's lists (`--moe-router-load-balancing-type seq_aux_loss global_aux_loss
/// --moe-aux-loss-coeff 0.01 0.02`) and `--moe-input-jitter-eps` reach the model from the
/// command line and from a file (one value or a list); a list of types without as many
/// coefficients is an error naming both. Trained with both, CP 2 × EP 2 equals one rank (the
/// jitter is a function of the values, the same on every layout), and the run differs from
/// the one without them.
#[test]
fn load_balancing_lists_and_input_jitter_equal_one_rank_at_cp_2() {
    use burn_megatron::transformer::moe::{AuxLossTerm, LoadBalancingType};
    let list = [
        "--moe-router-load-balancing-type",
        "seq_aux_loss",
        "global_aux_loss",
        "--moe-aux-loss-coeff",
        "0.01",
        "0.02",
        "--moe-input-jitter-eps",
        "0.1",
    ];
    let parsed = config(&[&["--num-experts", "4"][..], &list].concat());
    let moe = parsed.model().moe.expect("MoE layers");
    let more = vec![AuxLossTerm::new(LoadBalancingType::GlobalAuxLoss, 0.02)];
    assert_eq!(
        (
            moe.load_balancing_type,
            moe.aux_loss_coeff,
            moe.more_aux_losses.clone(),
            moe.input_jitter_eps
        ),
        (LoadBalancingType::SeqAuxLoss, 0.01, more.clone(), Some(0.1))
    );
    let file = |text: &str| {
        let args = PretrainArgs::from_toml(text).expect("a valid file");
        (args.moe_router_load_balancing_type, args.moe_aux_loss_coeff)
    };
    assert_eq!(
        file("moe-router-load-balancing-type = \"seq_aux_loss\"\nmoe-aux-loss-coeff = 0.01"),
        (Some(vec!["seq_aux_loss".to_string()]), Some(vec![0.01]))
    );
    assert_eq!(
        file(
            "moe-router-load-balancing-type = [\"aux_loss\", \"seq_aux_loss\"]\nmoe-aux-loss-coeff = [0.01, 0.001]"
        ),
        (
            Some(vec!["aux_loss".to_string(), "seq_aux_loss".to_string()]),
            Some(vec![0.01, 0.001])
        )
    );
    let parse = |extra: &[&str]| {
        let base = ["pretrain_gpt", "--num-experts", "4"];
        PretrainArgs::parse_from(base.iter().chain(extra)).into_config()
    };
    let types = [
        "--moe-router-load-balancing-type",
        "aux_loss",
        "seq_aux_loss",
    ];
    let e = parse(&types).expect_err("no coefficients").to_string();
    assert!(
        e.contains("lists 2 types: give as many --moe-aux-loss-coeff"),
        "{e}"
    );
    let e = parse(&[&types[..], &["--moe-aux-loss-coeff", "0.01"]].concat())
        .expect_err("one coefficient for two types")
        .to_string();
    assert!(
        e.contains(
            "--moe-aux-loss-coeff 0.01 for --moe-router-load-balancing-type aux_loss seq_aux_loss"
        ),
        "{e}"
    );
    let empty = PretrainArgs::from_toml("num-experts = 4\nmoe-router-load-balancing-type = []")
        .expect("a valid file");
    let e = empty.into_config().expect_err("an empty list").to_string();
    assert!(e.contains("need at least one value"), "{e}");
    let e = parse(&["--moe-aux-loss-coeff", "0.01", "0.02"])
        .expect_err("two coefficients for the default type")
        .to_string();
    assert!(
        e.contains("for --moe-router-load-balancing-type aux_loss:"),
        "{e}"
    );

    // moe_run_with gives aux_loss 0.01; the list and the jitter replace it.
    let with_list = |ep: usize, extra: &[&str]| {
        moe_run_with(
            1,
            ep,
            true,
            4,
            &[&["--moe-input-jitter-eps", "0.1"][..], extra].concat(),
        )
        .with_moe_router_load_balancing_type(LoadBalancingType::SeqAuxLoss)
        .with_moe_more_aux_losses(more.clone())
    };
    let train = |c: &PretrainConfig| pretrain_on_threads(c, &Silent).expect("pretraining");
    let one = train(&with_list(1, &[]));
    let cp = train(&with_list(2, &["--context-parallel-size", "2"]));
    assert_close(
        "CP 2 x EP 2 with the list and the jitter",
        &cp.losses(),
        &one.losses(),
        tolerance::F32_TRAINING,
    );
    assert_same_moe_losses(&cp, &one);
    let plain = train(&moe_run_with(1, 1, true, 4, &[]));
    let diff = burn_megatron_testing::relative_difference("plain", &plain.losses(), &one.losses());
    assert!(
        diff > 1e-5,
        "the list and the jitter changed nothing: {diff:.2e}"
    );
}

/// The logged MoE losses of `got` equal `want`'s at every iteration, whose load-balancing
/// losses are above 0.
fn assert_same_moe_losses(
    got: &burn_megatron::training::PretrainSummary,
    want: &burn_megatron::training::PretrainSummary,
) {
    for (got, want) in got.iterations.iter().zip(&want.iterations) {
        let (got, want) = (got.moe.expect("a report"), want.moe.expect("a report"));
        assert!(want.load_balancing_loss > 0.0);
        assert_close(
            "MoE losses",
            &[got.load_balancing_loss, got.z_loss],
            &[want.load_balancing_loss, want.z_loss],
            tolerance::F32_TRAINING,
        );
    }
}
