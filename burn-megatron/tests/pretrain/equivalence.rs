//! The loop at TP × PP equals plain single-rank training: the same samples, the same
//! microbatches, gradient accumulation, global-norm clipping, AdamW with and without weight
//! decay, Megatron's learning rate per step, and the same validation losses.

use burn::backend::{Autodiff, NdArray};
use burn::module::AutodiffModule;
use burn::optim::{AdamWConfig, Optimizer};
use burn_megatron::data::GptBatch;
use burn_megatron::optimizer::{GradClipConfig, WeightDecayPolicy, clip_grad_norm};
use burn_megatron::pipeline_parallel::{Microbatch, forward_backward_no_pipelining};
use burn_megatron::training::{PretrainConfig, PretrainData};
use burn_megatron_dist::ParallelSizes;

use crate::{assert_close, run, tiny_run, tolerance, train};

type AD = Autodiff<NdArray<f32>>;

/// The step losses and the validation losses of `config` trained on one rank from the
/// model's pieces.
pub fn reference(config: &PretrainConfig) -> (Vec<f64>, Vec<f64>) {
    let data = PretrainData::build(config).unwrap();
    let global = config.global_batch_size;
    let micro = config.micro_batch_size;
    let microbatches = |dataset: &_, first: usize| -> Vec<Microbatch<_>> {
        (0..global / micro)
            .map(|i| {
                GptBatch::read(dataset, first + i * micro, micro)
                    .unwrap()
                    .to_microbatch(config.vocab_size, &Default::default())
                    .unwrap()
            })
            .collect()
    };
    run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let mut model = config
            .model()
            .init_gpt::<AD>(state.tp(), &Default::default())?;
        let groups = WeightDecayPolicy::default().groups(&model);
        let adamw = AdamWConfig::new()
            .with_beta_1(config.adam_beta1)
            .with_beta_2(config.adam_beta2)
            .with_epsilon(config.adam_eps);
        let mut decay = adamw
            .clone()
            .with_weight_decay(config.weight_decay as f32)
            .init();
        let mut no_decay = adamw.with_weight_decay(0.0).init();
        let schedule = config.lr_schedule()?;
        let clip = GradClipConfig::new().with_max_norm(config.clip_grad);
        let (mut losses, mut evals) = (Vec::new(), Vec::new());
        for it in 0..config.train_iters {
            let batch = microbatches(&data.train, it * global);
            let (loss, grads) = forward_backward_no_pipelining(&model, &batch)?;
            let mut grads = vec![grads];
            clip_grad_norm(core::slice::from_ref(&model), &mut grads, &state, &clip)?;
            let (d, n) = groups.split(&model, grads.pop().unwrap());
            model = decay.step(schedule.lr(it), model, d);
            model = no_decay.step(schedule.lr(it), model, n);
            losses.push(loss.into_scalar() as f64);
            if (it + 1) % config.eval_interval == 0 {
                let valid = model.valid();
                let index = (it + 1) / config.eval_interval - 1;
                let mut total = 0.0;
                for j in 0..config.eval_iters {
                    let first = (index * config.eval_iters + j) * global;
                    let batch: Vec<
                        Microbatch<<AD as burn::tensor::backend::AutodiffBackend>::InnerBackend>,
                    > = (0..global / micro)
                        .map(|i| {
                            GptBatch::read(data.valid.as_ref().unwrap(), first + i * micro, micro)
                                .unwrap()
                                .to_microbatch(config.vocab_size, &Default::default())
                                .unwrap()
                        })
                        .collect();
                    let mut sum = 0.0;
                    for mb in &batch {
                        let logits = valid.try_forward(mb.tokens.clone())?;
                        sum += valid.loss(logits, mb.targets.clone())?.into_scalar() as f64;
                    }
                    total += sum / batch.len() as f64;
                }
                evals.push(total / config.eval_iters as f64);
            }
        }
        Ok((losses, evals))
    })
    .remove(0)
}

pub fn assert_equal_to_reference(what: &str, config: &PretrainConfig, want: &(Vec<f64>, Vec<f64>)) {
    let got = train(config);
    let losses = got.losses();
    let evals: Vec<f64> = got.evaluations.iter().map(|e| e.loss).collect();
    assert_eq!(losses.len(), config.train_iters, "{what}: steps");
    assert_close(
        &format!("{what}: first loss"),
        &losses[..1],
        &want.0[..1],
        tolerance::F32,
    );
    assert_close(
        &format!("{what}: losses"),
        &losses,
        &want.0,
        tolerance::F32_TRAINING,
    );
    assert_close(
        &format!("{what}: validation losses"),
        &evals,
        &want.1,
        tolerance::F32_TRAINING,
    );
    let iterations: Vec<u64> = got.iterations.iter().map(|r| r.iteration).collect();
    assert_eq!(iterations, [1, 2, 3, 4], "{what}");
    assert_eq!(got.iterations[3].consumed_samples, 32, "{what}");
}

/// TP = 1 × PP = 1, TP = 2 × PP = 2 (with and without sequence parallelism) and TP = 1 ×
/// PP = 4 against one rank's plain training.
#[test]
fn layouts_equal_single_rank_training() {
    let single = tiny_run(1, 1);
    let want = reference(&single);
    assert!(
        want.0[3] < want.0[0] - 0.1,
        "the reference does not learn: {:?}",
        want.0
    );
    assert_equal_to_reference("TP=1 PP=1", &single, &want);
    assert_equal_to_reference("TP=2 PP=2", &tiny_run(2, 2), &want);
    assert_equal_to_reference(
        "TP=2 PP=2 SP",
        &tiny_run(2, 2).with_sequence_parallel(true),
        &want,
    );
    assert_equal_to_reference("TP=1 PP=4", &tiny_run(1, 4), &want);
}

/// A Llama (SwiGLU, RMSNorm, rope, two query groups for four heads, an untied output layer,
/// no biases) through `pretrain_gpt`'s options at TP = 2 × PP = 2 (with sequence parallelism
/// and full recomputation too, and the uniform and block methods) against one rank's plain
/// training.
#[test]
fn llama_layouts_equal_single_rank_training() {
    let llama = |tp, pp| {
        let args = [
            "--swiglu",
            "--normalization",
            "RMSNorm",
            "--position-embedding-type",
            "rope",
            "--rotary-base",
            "500000",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
        ];
        let parsed = <burn_megatron::training::PretrainArgs as clap::Parser>::try_parse_from(
            std::iter::once("pretrain_gpt").chain(args),
        )
        .unwrap()
        .into_config()
        .unwrap();
        let tiny = tiny_run(tp, pp);
        tiny.with_swiglu(parsed.swiglu)
            .with_ffn_hidden_size(Some(48))
            .with_normalization(parsed.normalization)
            .with_position_embedding(parsed.position_embedding)
            .with_num_query_groups(parsed.num_query_groups)
            .with_untie_embeddings_and_output_weights(parsed.untie_embeddings_and_output_weights)
            .with_add_bias_linear(parsed.add_bias_linear)
    };
    let single = llama(1, 1);
    let want = reference(&single);
    assert!(
        want.0[3] < want.0[0] - 0.1,
        "the reference does not learn: {:?}",
        want.0
    );
    assert_equal_to_reference("Llama TP=2 PP=2", &llama(2, 2), &want);
    assert_equal_to_reference(
        "Llama TP=2 PP=2 SP, full recomputation",
        &llama(2, 2)
            .with_sequence_parallel(true)
            .with_recompute(burn_megatron::transformer::Recompute::Full),
        &want,
    );
    assert_equal_to_reference(
        "Llama TP=2 PP=2 SP, --tp-comm-overlap",
        &llama(2, 2)
            .with_sequence_parallel(true)
            .with_tp_comm_overlap(true),
        &want,
    );
    // Megatron's two methods: groups of 2 layers, and the first layer of each stage rerun with
    // the rest stored (at PP 1 the stored layers end in the loss; at PP 2 the first stage's
    // send their output on).
    use burn_megatron::transformer::Recompute;
    for (what, tp, pp, recompute) in [
        (
            "uniform, groups of 2",
            2,
            2,
            Recompute::FullUniform { layers: 2 },
        ),
        ("block, 1 layer", 2, 2, Recompute::FullBlock { layers: 1 }),
        ("block, 1 layer", 1, 1, Recompute::FullBlock { layers: 1 }),
    ] {
        assert_equal_to_reference(
            &format!("Llama TP={tp} PP={pp}, {what}"),
            &llama(tp, pp).with_recompute(recompute),
            &want,
        );
    }
}

/// The interleaved schedule from `--num-layers-per-virtual-pipeline-stage 1` (two chunks a
/// rank at PP = 2; the tied embedding's copy on rank 1's second chunk): alone, at TP = 2 × PP
/// = 2 with sequence parallelism, and at PP = 2 × DP = 2 with the distributed optimizer
/// stepping both chunks as one, against one rank's plain training.
#[test]
fn interleaved_pipeline_equals_single_rank_training() {
    let want = reference(&tiny_run(1, 1));
    let interleaved = |tp, pp| tiny_run(tp, pp).with_num_layers_per_virtual_pipeline_stage(Some(1));
    assert_equal_to_reference("PP=2 interleaved", &interleaved(1, 2), &want);
    assert_equal_to_reference(
        "TP=2 PP=2 SP interleaved",
        &interleaved(2, 2).with_sequence_parallel(true),
        &want,
    );
    assert_equal_to_reference(
        "PP=2 DP=2 interleaved, distributed optimizer",
        &interleaved(1, 2)
            .with_data_parallel_size(2)
            .with_use_distributed_optimizer(true),
        &want,
    );
}

/// `--decoder-first/last-pipeline-num-layers` (Megatron's uneven first and last stages) and
/// `--num-virtual-stages-per-pipeline-rank`: 3 + 1 layers at PP = 2 (alone, at TP = 2 × PP = 2
/// with sequence parallelism, and at PP = 2 × DP = 2 with the distributed optimizer), layers
/// 2, 1, 1 and 0 at PP = 4 (a last rank with only the output layer and the loss), and
/// interleaved with 2 chunks a rank (rank 0's chunks 2 + 1 layers, rank 1's 1 + 0), against
/// one rank's training.
#[test]
fn uneven_pipeline_stages_equal_single_rank_training() {
    let want = reference(&tiny_run(1, 1));
    let last = |tp, pp, n| tiny_run(tp, pp).with_decoder_last_pipeline_num_layers(Some(n));
    assert_equal_to_reference("PP=2, 3 + 1 layers", &last(1, 2, 1), &want);
    assert_equal_to_reference(
        "TP=2 PP=2 SP, 3 + 1 layers",
        &last(2, 2, 1).with_sequence_parallel(true),
        &want,
    );
    assert_equal_to_reference(
        "PP=2 DP=2 distributed optimizer, 3 + 1 layers",
        &last(1, 2, 1)
            .with_data_parallel_size(2)
            .with_use_distributed_optimizer(true),
        &want,
    );
    assert_equal_to_reference(
        "PP=4, 2 + 1 + 1 + 0 layers",
        &last(1, 4, 0).with_decoder_first_pipeline_num_layers(Some(2)),
        &want,
    );
    assert_equal_to_reference(
        "PP=2 interleaved, 2 chunks a rank, 3 + 1 layers",
        &last(1, 2, 1).with_num_virtual_stages_per_pipeline_rank(Some(2)),
        &want,
    );
}

/// DP = 2 (each DP rank reading its half of every global batch), with and without the
/// distributed optimizer, and TP = 2 × DP = 2 and PP = 2 × DP = 2 (1F1B) with it, against one
/// rank's plain training: the same step and validation losses.
#[test]
fn data_parallel_equals_single_rank_training() {
    let want = reference(&tiny_run(1, 1));
    let dp2 = tiny_run(1, 1).with_data_parallel_size(2);
    assert_equal_to_reference("DP=2", &dp2, &want);
    let zero = dp2.clone().with_use_distributed_optimizer(true);
    assert_equal_to_reference("DP=2 distributed optimizer", &zero, &want);
    let tp_dp = tiny_run(2, 1)
        .with_data_parallel_size(2)
        .with_use_distributed_optimizer(true);
    assert_equal_to_reference("TP=2 DP=2 distributed optimizer", &tp_dp, &want);
    let pp_dp = tiny_run(1, 2)
        .with_data_parallel_size(2)
        .with_use_distributed_optimizer(true);
    assert_equal_to_reference("PP=2 DP=2 distributed optimizer", &pp_dp, &want);
}

/// `--overlap-grad-reduce` (the reduction started from inside the backward pass) gives the
/// same step and validation losses as reducing after it, with the plain all-reduce and with the
/// distributed optimizer, with gradient accumulation over microbatches and under PP = 2.
#[test]
fn overlapped_gradient_reduction_equals_single_rank_training() {
    let want = reference(&tiny_run(1, 1));
    let dp2 = tiny_run(1, 1).with_data_parallel_size(2);
    let zero = dp2.clone().with_use_distributed_optimizer(true);
    let pp_dp = tiny_run(1, 2)
        .with_data_parallel_size(2)
        .with_use_distributed_optimizer(true);
    for (what, after) in [
        ("DP=2", dp2),
        ("DP=2 distributed optimizer", zero),
        ("PP=2 DP=2 distributed optimizer", pp_dp),
    ] {
        let overlapped = after.clone().with_overlap_grad_reduce(true);
        assert_equal_to_reference(&format!("{what} overlapped"), &overlapped, &want);
        let (got, plain) = (train(&overlapped), train(&after));
        assert_eq!(got.losses(), plain.losses(), "{what}: overlapped and not");
        assert!(
            got.reduced_in_backward > 0 && plain.reduced_in_backward == 0,
            "{what}: the hook took {} elements",
            got.reduced_in_backward
        );
    }
}

/// The learning rate of each step is the schedule's, stepped once per global step, whatever
/// the DP size.
#[test]
fn learning_rate_steps_once_per_iteration() {
    for config in [tiny_run(2, 2), tiny_run(1, 1).with_data_parallel_size(4)] {
        let config = config.with_lr_warmup_iters(2).with_eval_interval(0);
        let schedule = config.lr_schedule().unwrap();
        let got: Vec<f64> = train(&config).iterations.iter().map(|r| r.lr).collect();
        let want: Vec<f64> = (0..4).map(|s| schedule.lr(s)).collect();
        assert_eq!(got, want);
    }
}

/// `lm loss`, Megatron's logged loss, is the mean of the iterations' losses since the last
/// logged iteration: with `--log-interval 3` over 7 iterations, the means of 1-3, 4-6 and 7
/// at the logged ones, and the running mean in between.
#[test]
fn lm_loss_is_the_mean_since_the_last_logged_iteration() {
    let config = tiny_run(1, 1)
        .with_train_iters(7)
        .with_log_interval(3)
        .with_eval_interval(0);
    let summary = train(&config);
    let losses = summary.losses();
    let mean = |range: std::ops::Range<usize>| {
        losses[range.clone()].iter().sum::<f64>() / range.len() as f64
    };
    let want = [
        mean(0..1),
        mean(0..2),
        mean(0..3),
        mean(3..4),
        mean(3..5),
        mean(3..6),
        mean(6..7),
    ];
    let got: Vec<f64> = summary.iterations.iter().map(|r| r.lm_loss).collect();
    assert_eq!(got, want);
    assert!(
        (got[2] - losses[2]).abs() > 1e-6,
        "the mean differs from the iteration's own loss"
    );
}

/// `--fp16`'s dynamic loss scaler in the loop (run in f32 here): a power-of-two scale is
/// exact, so the losses equal the unscaled run's bit for bit at TP = 2 × DP = 2; the scale
/// the log shows grows after each window of clean steps; and a run resumed from a
/// checkpoint continues with the uninterrupted losses and scales (the scaler's state is in
/// the checkpoint).
// ANCHOR: fp16_in_the_loop
#[test]
fn loss_scaling_in_the_loop_is_exact_and_resumes() {
    let base = tiny_run(2, 1)
        .with_data_parallel_size(2)
        .with_use_distributed_optimizer(true);
    let plain = train(&base);
    let scaled = base
        .clone()
        .with_fp16(true)
        .with_initial_loss_scale(1024.0)
        .with_loss_scale_window(2);
    let whole = train(&scaled);
    assert_eq!(whole.losses(), plain.losses(), "scaled and unscaled losses");
    let scales: Vec<Option<f64>> = whole.iterations.iter().map(|r| r.loss_scale).collect();
    assert_eq!(
        scales,
        [Some(1024.0), Some(1024.0), Some(2048.0), Some(2048.0)]
    );
    assert!(plain.iterations.iter().all(|r| r.loss_scale.is_none()));

    let root = crate::scratch("fp16-resume");
    let saving = scaled
        .clone()
        .with_save(Some(root.clone()))
        .with_save_interval(Some(2));
    train(&saving);
    std::fs::remove_dir_all(root.join("iter_0000004")).unwrap();
    let resumed = train(&saving.with_load(Some(root.clone())));
    assert_eq!(resumed.losses(), whole.losses()[2..], "resumed losses");
    let resumed_scales: Vec<Option<f64>> =
        resumed.iterations.iter().map(|r| r.loss_scale).collect();
    assert_eq!(resumed_scales, scales[2..], "resumed scales");
    let _ = std::fs::remove_dir_all(&root);
}
// ANCHOR_END: fp16_in_the_loop
