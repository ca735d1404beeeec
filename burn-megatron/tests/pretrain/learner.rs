//! Training through burn-train's `Learner` with [`MegatronStrategy`]: one `SupervisedTraining`
//! per thread rank gives the losses of `pretrain`'s own loop (the same data, schedule,
//! optimizer and learning rate), which equal one rank's plain training; checkpoints written
//! every few steps resume with the uninterrupted run's losses.

use std::sync::atomic::{AtomicUsize, Ordering};

use burn::backend::{Autodiff, NdArray};
use burn_megatron::training::learner::{LearnerReporting, MetricRecorder, pretrain_with_learner};
use burn_megatron::training::{PretrainConfig, PretrainData};

use crate::equivalence::reference;
use crate::{assert_close, run, scratch, tiny_run, tolerance, train};

type AD = Autodiff<NdArray<f32>>;

/// Trains `config` through burn-train on its thread ranks (the library's
/// `pretrain_with_learner`, quietly), and returns the recorded metrics.
fn train_with_learner(config: &PretrainConfig) -> MetricRecorder {
    static RUNS: AtomicUsize = AtomicUsize::new(0);
    let data = PretrainData::build(config).unwrap();
    let reporting = LearnerReporting {
        directory: scratch(&format!("learner-{}", RUNS.fetch_add(1, Ordering::Relaxed))),
        recorder: Some(MetricRecorder::new()),
        quiet: true,
        peak_flops_per_device: None,
    };
    run(config.world_size(), |ctx| {
        pretrain_with_learner::<AD>(&ctx, config, &data, &Default::default(), &reporting)?;
        Ok(())
    });
    let _ = std::fs::remove_dir_all(&reporting.directory);
    reporting.recorder.unwrap()
}

/// TP = 2 × PP = 2, DP = 2 and TP = 2 × DP = 2 (each with the distributed optimizer) through
/// the `Learner` give `pretrain`'s losses and gradient norms exactly and its last validation
/// loss (the mean of two batches) within f32 rounding, and one rank's plain training within
/// the f32 training bound.
#[test]
fn learner_training_equals_the_pretrain_loop_and_one_rank() {
    let single = tiny_run(1, 1);
    let want = reference(&single);
    let dp2 = tiny_run(1, 1).with_data_parallel_size(2);
    for (what, config) in [
        ("TP=2 PP=2", tiny_run(2, 2)),
        ("DP=2", dp2.clone()),
        ("TP=2 DP=2", tiny_run(2, 1).with_data_parallel_size(2)),
        (
            "TP=2 DP=2 fp16 loss scaling",
            tiny_run(2, 1)
                .with_data_parallel_size(2)
                .with_fp16(true)
                .with_initial_loss_scale(1024.0)
                .with_loss_scale_window(2),
        ),
    ] {
        // Two validation batches: the Learner reports their mean, as the loop does.
        let config = config
            .with_use_distributed_optimizer(true)
            .with_eval_iters(2);
        let loop_run = train(&config);
        let got = train_with_learner(&config);
        let losses = got.values("Loss", true);
        assert_eq!(losses, loop_run.losses(), "{what}: losses against the loop");
        let norms: Vec<f64> = loop_run.iterations.iter().map(|r| r.grad_norm).collect();
        assert_eq!(
            got.values("Grad norm", true),
            norms,
            "{what}: gradient norms"
        );
        let scales: Vec<f64> = loop_run
            .iterations
            .iter()
            .filter_map(|r| r.loss_scale)
            .collect();
        assert_eq!(
            got.values("Loss scale", true),
            scales,
            "{what}: loss scales"
        );
        let valid = got.values("Loss", false);
        let last = loop_run.evaluations.last().unwrap().loss;
        // The loop averages the batches' losses in f64 on the host, the Learner in f32 on
        // the device.
        assert_eq!(valid.len(), 1, "{what}: one validation item");
        assert_close(&format!("{what}: validation loss"), &valid, &[last], 1e-6);
        assert_close(what, &losses, &want.0, tolerance::F32_TRAINING);
        let tokens = got.values("Tokens per second", true);
        assert_eq!(
            tokens.len(),
            config.train_iters,
            "{what}: one throughput per step"
        );
        assert!(
            tokens[1..].iter().all(|t| t.is_finite() && *t > 0.0),
            "{what}: {tokens:?}"
        );
    }
}

/// A run that checkpoints every 2 steps, interrupted after step 2 (its step-4 checkpoint
/// removed), resumes with the uninterrupted run's losses and loss scales for steps 3 and 4
/// (model, sharded optimizer state, loss scaler, learning rate, data and dropout masks
/// continue), at TP = 2 × DP = 2 with dropout and fp16 loss scaling (run in f32) on;
/// `pretrain`'s own loop resumes from the same checkpoint with the same losses.
#[test]
fn learner_checkpoints_resume_with_the_uninterrupted_losses() {
    let config = tiny_run(2, 1)
        .with_data_parallel_size(2)
        .with_use_distributed_optimizer(true)
        .with_hidden_dropout(0.1)
        .with_fp16(true)
        .with_initial_loss_scale(1024.0)
        .with_loss_scale_window(2);
    let uninterrupted = train_with_learner(&config);
    let whole = uninterrupted.values("Loss", true);
    let scales = uninterrupted.values("Loss scale", true);
    assert_eq!(
        scales,
        [1024.0, 1024.0, 2048.0, 2048.0],
        "the scale grows every 2 steps"
    );
    let root = scratch("learner-resume");
    let saving = config
        .clone()
        .with_save(Some(root.clone()))
        .with_save_interval(Some(2));
    let saved = train_with_learner(&saving).values("Loss", true);
    assert_eq!(saved, whole, "saving checkpoints changes nothing");
    let interrupt = || {
        assert!(root.join("iter_0000002/metadata.json").exists());
        std::fs::remove_dir_all(root.join("iter_0000004")).unwrap();
    };
    interrupt();
    let resuming = saving.with_load(Some(root.clone()));
    let resumed = train_with_learner(&resuming);
    assert_eq!(
        resumed.values("Loss", true),
        whole[2..],
        "the resumed steps"
    );
    assert_eq!(
        resumed.values("Loss scale", true),
        scales[2..],
        "the resumed scales"
    );
    interrupt();
    let by_the_loop = train(&resuming).losses();
    assert_eq!(
        by_the_loop,
        whole[2..],
        "pretrain's loop resuming from the Learner's checkpoint"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// `DataParallelShard` over a Burn loader of 5 batches at DP 2: rank 0 takes batches 0 and
/// 2, rank 1 batches 1 and 3, and both drop the incomplete last round (batch 4), so the
/// ranks take the same number of steps.
#[test]
fn data_parallel_shard_deals_batches_round_by_round() {
    use burn::data::dataloader::DataLoaderBuilder;
    use burn::data::dataloader::batcher::Batcher;
    use burn::data::dataset::InMemDataset;
    use burn::tensor::backend::Backend;
    use burn::tensor::{Int, Tensor, TensorData};
    use burn_megatron::training::learner::DataParallelShard;
    use burn_megatron_dist::ParallelSizes;

    #[derive(Clone)]
    struct Ids;
    impl<B: Backend> Batcher<B, i64, Tensor<B, 1, Int>> for Ids {
        fn batch(&self, items: Vec<i64>, device: &B::Device) -> Tensor<B, 1, Int> {
            let n = items.len();
            Tensor::from_data(TensorData::new(items, [n]), device)
        }
    }
    let taken = run(2, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let loader = DataLoaderBuilder::new(Ids)
            .batch_size(2)
            .build(InMemDataset::new((0..10i64).collect()));
        let shard = DataParallelShard::<NdArray, _>::new(loader, &state);
        let batches: Vec<Vec<i64>> = burn::data::dataloader::DataLoader::iter(&shard)
            .map(|b| b.into_data().convert::<i64>().to_vec::<i64>().unwrap())
            .collect();
        Ok(batches)
    });
    assert_eq!(taken[0], [vec![0, 1], vec![4, 5]], "rank 0");
    assert_eq!(taken[1], [vec![2, 3], vec![6, 7]], "rank 1");
}
