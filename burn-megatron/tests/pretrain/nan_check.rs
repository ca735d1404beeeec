//! `--check-for-nan-in-loss-and-grad` on CPU thread ranks: a non-finite loss or parameter
//! stops `pretrain`'s loop and the Learner with a typed error naming the iteration and the
//! rank, before any checkpoint of that iteration is written; the check can be turned off;
//! the Learner's failures (bad data) are typed errors, not panics.
//!
//! `--lr 1e30` makes the weights about 1e30 after step 1 (still finite in f32), so step 2's
//! loss overflows to NaN. `--lr 1e39` is finite as a setting but infinite in f32: step 1's
//! update writes infinities and NaN into the weights while step 1's loss and gradient norm
//! were finite, so only the parameters' check before the save (or at the end) sees it.

use std::path::Path;
use std::sync::Mutex;

use burn::backend::{Autodiff, NdArray};
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::Tensor;
use burn_megatron::Error;
use burn_megatron::error::{InputError, NonFiniteValue, TrainingError};
use burn_megatron::optimizer::LrDecayStyle;
use burn_megatron::training::learner::{LearnerReporting, pretrain_with_learner};
use burn_megatron::training::{
    CpuTraining, PretrainConfig, PretrainData, Silent, check_finite_parameters, pretrain,
    pretrain_on_threads,
};
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_dist::{LaunchConfig, ParallelSizes, launch};

use crate::{run, scratch, tiny_run};

type AD = Autodiff<NdArray<f32>>;

/// Every rank's typed error of running `rank` on `config`'s thread ranks, in rank order
/// (the launch's own error keeps only messages), and the launch's message.
fn errors_of(
    config: &PretrainConfig,
    rank: impl Fn(burn_megatron_dist::RankContext, &PretrainData) -> burn_megatron::Result<()> + Sync,
) -> (Vec<(usize, Error)>, String) {
    let data = PretrainData::build(config).unwrap();
    let errors = Mutex::new(Vec::new());
    let launched = launch(
        LaunchConfig::new(config.world_size()).with_timeout(std::time::Duration::from_secs(60)),
        |ctx| {
            let r = ctx.rank();
            let result = rank(ctx, &data);
            if let Err(e) = &result {
                errors.lock().unwrap().push((r, e.clone()));
            }
            result
        },
    );
    let message = launched.expect_err("the run must fail").to_string();
    let mut errors = errors.into_inner().unwrap();
    errors.sort_by_key(|(r, _)| *r);
    (errors, message)
}

fn loop_errors(config: &PretrainConfig) -> (Vec<(usize, Error)>, String) {
    errors_of(config, |ctx, data| {
        pretrain::<CpuTraining>(&ctx, config, data, &Default::default(), &Silent).map(|_| ())
    })
}

fn learner_errors(config: &PretrainConfig, name: &str) -> (Vec<(usize, Error)>, String) {
    let reporting = LearnerReporting {
        directory: scratch(&format!("nan-learner-reports-{name}")),
        recorder: None,
        quiet: true,
        peak_flops_per_device: None,
    };
    let out = errors_of(config, |ctx, data| {
        pretrain_with_learner::<AD>(&ctx, config, data, &Default::default(), &reporting)
    });
    let _ = std::fs::remove_dir_all(&reporting.directory);
    out
}

/// A constant learning rate of `lr` from the first step, saving after every step in `root`.
fn exploding(tp: usize, pp: usize, lr: f64, root: &Path) -> PretrainConfig {
    tiny_run(tp, pp)
        .with_lr(lr)
        .with_min_lr(0.0)
        .with_lr_warmup_iters(0)
        .with_lr_decay_style(LrDecayStyle::Constant)
        .with_eval_interval(0)
        .with_save(Some(root.to_path_buf()))
        .with_save_interval(Some(1))
}

/// The names under `root` (checkpoints, temporary directories, `latest`).
fn saved(root: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root)
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Whether anything under `root` is about iteration `iteration` (a checkpoint, finished or
/// not).
fn anything_of(root: &Path, iteration: u64) -> bool {
    let tag = format!("{iteration:07}");
    saved(root).iter().any(|n| n.contains(&tag))
}

fn non_finite(error: &Error) -> (u64, usize, &NonFiniteValue) {
    match error {
        Error::Training(TrainingError::NonFinite {
            iteration,
            rank,
            value,
        }) => (*iteration, *rank, value),
        other => panic!("not a non-finite error: {other:?}"),
    }
}

/// The loss of step 2 is NaN: every rank stops at iteration 2 naming itself, step 1's
/// checkpoint stays the latest and nothing of iteration 2 is written.
#[test]
fn a_nan_loss_stops_the_loop_before_its_checkpoint() {
    let root = scratch("nan-loss");
    let config = exploding(2, 1, 1e30, &root);
    assert!(config.check_for_nan_in_loss_and_grad, "on by default");
    let (errors, message) = loop_errors(&config);
    assert_eq!(errors.len(), 2, "{errors:?}");
    for (rank, error) in &errors {
        let (iteration, seen_on, value) = non_finite(error);
        assert_eq!((iteration, seen_on), (2, *rank), "{error}");
        assert!(
            matches!(value, NonFiniteValue::Loss(v) if !v.is_finite()),
            "{error}"
        );
        let text = error.to_string();
        assert!(
            text.contains("iteration 2") && text.contains(&format!("rank {rank}")),
            "{text}"
        );
    }
    assert!(
        message.contains("iteration 2: the loss is NaN") && !message.contains("panicked"),
        "{message}"
    );
    assert!(
        root.join("iter_0000001/metadata.json").exists(),
        "{:?}",
        saved(&root)
    );
    assert!(!anything_of(&root, 2), "{:?}", saved(&root));
    let latest = std::fs::read_to_string(root.join("latest")).unwrap_or_default();
    assert!(!latest.contains('2'), "latest: {latest}");
    let _ = std::fs::remove_dir_all(&root);
}

/// Step 1's update makes the weights non-finite while its loss and gradient norm were
/// finite: the parameters' check before the save stops every rank at iteration 1, naming
/// rank 0 (the lowest rank holding one) and, on rank 0, the parameter. No checkpoint is
/// written. Without a save, the check at the end of the run stops it the same way.
#[test]
fn non_finite_weights_stop_the_loop_before_any_save() {
    let root = scratch("nan-weights");
    let config = exploding(1, 2, 1e39, &root);
    let (errors, message) = loop_errors(&config);
    assert_eq!(errors.len(), 2, "{errors:?}");
    for (rank, error) in &errors {
        let (iteration, seen_on, value) = non_finite(error);
        assert_eq!((iteration, seen_on), (1, *rank), "{error}");
        match value {
            NonFiniteValue::Parameter {
                on_rank: 0,
                path: Some(path),
            } if *rank == 0 => assert!(!path.is_empty()),
            NonFiniteValue::Parameter {
                on_rank: 0,
                path: None,
            } if *rank != 0 => {}
            other => panic!("rank {rank}: {other:?}"),
        }
    }
    assert!(
        message.contains("iteration 1") && message.contains("of rank 0 holds NaN or infinity"),
        "{message}"
    );
    assert!(saved(&root).is_empty(), "{:?}", saved(&root));

    let unsaved = config
        .with_save(None)
        .with_save_interval(None)
        .with_no_save(true)
        .with_train_iters(1);
    let (errors, _) = loop_errors(&unsaved);
    for (rank, error) in &errors {
        assert_eq!(non_finite(error).0, 1, "rank {rank}: {error}");
    }
    assert_eq!(errors.len(), 2);
    let _ = std::fs::remove_dir_all(&root);
}

/// `--check-for-nan-in-loss-and-grad false`: the same exploding run goes on and logs NaN
/// (the negative control of the two tests above).
#[test]
fn the_check_can_be_turned_off() {
    let root = scratch("nan-off");
    let config = exploding(2, 1, 1e39, &root)
        .with_save(None)
        .with_save_interval(None)
        .with_no_save(true)
        .with_train_iters(2)
        .with_check_for_nan_in_loss_and_grad(false);
    let summary = pretrain_on_threads(&config, &Silent).expect("no check, no error");
    let losses = summary.losses();
    assert_eq!(losses.len(), 2);
    assert!(losses[0].is_finite() && losses[1].is_nan(), "{losses:?}");
}

/// The Learner: the device flag stops the run at step 2's NaN loss before its checkpoint
/// (step 1's is written), and the parameters' check stops `--lr 1e39` at iteration 1
/// before any save; both are typed errors on every rank.
#[test]
fn the_learner_stops_at_non_finite_values_before_saving() {
    let root = scratch("nan-learner-loss");
    let config = exploding(2, 1, 1e30, &root).with_use_distributed_optimizer(true);
    let (errors, message) = learner_errors(&config, "loss");
    assert_eq!(errors.len(), 2, "{errors:?}");
    for (rank, error) in &errors {
        let (iteration, seen_on, value) = non_finite(error);
        assert_eq!((iteration, seen_on), (2, *rank), "{error}");
        assert!(
            matches!(value, NonFiniteValue::Loss(v) if !v.is_finite()),
            "{error}"
        );
    }
    assert!(!message.contains("panicked"), "{message}");
    assert!(
        root.join("iter_0000001/metadata.json").exists(),
        "{:?}",
        saved(&root)
    );
    assert!(!anything_of(&root, 2), "{:?}", saved(&root));
    let _ = std::fs::remove_dir_all(&root);

    let root = scratch("nan-learner-weights");
    let config = exploding(2, 1, 1e39, &root).with_use_distributed_optimizer(true);
    let (errors, _) = learner_errors(&config, "weights");
    assert_eq!(errors.len(), 2, "{errors:?}");
    for (rank, error) in &errors {
        let (iteration, _, value) = non_finite(error);
        assert_eq!(iteration, 1, "rank {rank}: {error}");
        assert!(
            matches!(value, NonFiniteValue::Parameter { on_rank: 0, .. }),
            "rank {rank}: {error}"
        );
    }
    assert!(saved(&root).is_empty(), "{:?}", saved(&root));
    let _ = std::fs::remove_dir_all(&root);
}

/// A token id outside the vocabulary, found by the Learner's data loader (whose Burn trait
/// cannot fail), reaches `pretrain_with_learner`'s `Result` as the typed input error on the
/// reading rank; no rank's error says it panicked.
#[test]
fn the_learners_bad_data_is_a_typed_error() {
    let dir = scratch("nan-bad-data");
    std::fs::create_dir_all(&dir).unwrap();
    let corpus = burn_megatron::data::write_default_corpus(&dir.join("corpus"), 300, 7).unwrap();
    let config = tiny_run(2, 1)
        .with_data_path(vec![corpus.prefix.to_string_lossy().into_owned()])
        .with_vocab_size(100);
    let (errors, message) = learner_errors(&config, "bad-data");
    let (rank, error) = errors.first().expect("an error");
    assert_eq!(*rank, 0, "TP rank 0 reads: {errors:?}");
    assert!(
        matches!(
            error,
            Error::Input(InputError::IdOutOfRange {
                vocab_size: 100,
                ..
            })
        ),
        "{error:?}"
    );
    assert!(!message.contains("panicked"), "{message}");
    for (rank, error) in &errors {
        assert!(
            !error.to_string().contains("panicked"),
            "rank {rank}: {error}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A NaN injected into one weight of rank 1: `check_finite_parameters` fails on both ranks
/// with the iteration and rank 1, and rank 1's error names the parameter; a clean model
/// passes.
#[test]
fn an_injected_nan_names_the_iteration_the_rank_and_the_parameter() {
    /// Poisons the `index`-th float parameter with NaN, recording its path.
    struct Poison {
        index: usize,
        seen: usize,
        path: Vec<String>,
        poisoned: Option<String>,
    }
    impl<B: burn::tensor::backend::Backend> ModuleMapper<B> for Poison {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.path.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, tensor, mapper) = param.consume();
            let tensor = if self.seen == self.index {
                self.poisoned = Some(self.path.join("."));
                tensor.clone().mul_scalar(f32::NAN)
            } else {
                tensor
            };
            self.seen += 1;
            Param::from_mapped_value(id, tensor, mapper)
        }
    }
    let config = TransformerConfig::new(16, 2, 4, 32, 50, 8).with_make_vocab_size_divisible_by(4);
    let outcomes = run(2, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(2))?;
        let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let clean = check_finite_parameters(&state, &model, 6);
        let mut poison = Poison {
            index: 3,
            seen: 0,
            path: Vec::new(),
            poisoned: None,
        };
        let model = match ctx.rank() {
            1 => model.map(&mut poison),
            _ => model,
        };
        let poisoned = check_finite_parameters(&state, &model, 7);
        Ok((clean, poisoned, poison.poisoned))
    });
    let injected = outcomes[1].2.clone().expect("rank 1 poisoned a parameter");
    for (rank, (clean, poisoned, _)) in outcomes.into_iter().enumerate() {
        clean.unwrap_or_else(|e| panic!("rank {rank}: a clean model fails: {e}"));
        let error = poisoned.expect_err("the NaN is found");
        let (iteration, seen_on, value) = non_finite(&error);
        assert_eq!((iteration, seen_on), (7, rank), "{error}");
        let want = NonFiniteValue::Parameter {
            on_rank: 1,
            path: (rank == 1).then(|| injected.clone()),
        };
        assert_eq!(*value, want, "rank {rank}");
        let text = error.to_string();
        assert!(
            text.contains("iteration 7") && text.contains("of rank 1 holds NaN"),
            "{text}"
        );
    }
}
