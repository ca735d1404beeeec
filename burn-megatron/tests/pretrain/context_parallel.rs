//! `pretrain_gpt` with `--context-parallel-size 2`: every sequence split over two ranks
//! (the data loader hands each its chunks, the loss is averaged over the CP group, gradients
//! reduced over DP × CP) trains with the losses of one rank's plain training; the options
//! parse by Megatron's names; bad layouts are refused with errors that say what is valid.

use burn_megatron::context_parallel::CpCommType;
use burn_megatron::training::{PretrainArgs, PretrainConfig};
use burn_megatron::transformer::Recompute;
use clap::Parser;

use crate::equivalence::{assert_equal_to_reference, reference};
use crate::{assert_close, scratch, tiny_run, tolerance, train};

fn cp(tp: usize, pp: usize, cp: usize, comm: &str) -> PretrainConfig {
    tiny_run(tp, pp)
        .with_context_parallel_size(cp)
        .with_cp_comm_type(comm.into())
}

/// CP = 2 by each communication, with DP = 2 and the distributed optimizer, with TP = 2 and
/// sequence parallelism, and under PP = 2 (1F1B, also with full recomputation, whose rerun
/// forward passes exchange K/V inside the backward pass): the step and validation losses of
/// one rank's plain training.
#[test]
fn context_parallel_equals_single_rank_training() {
    let want = reference(&tiny_run(1, 1));
    assert_equal_to_reference("CP=2 p2p", &cp(1, 1, 2, "p2p"), &want);
    let dp = cp(1, 1, 2, "a2a")
        .with_data_parallel_size(2)
        .with_use_distributed_optimizer(true)
        .with_overlap_grad_reduce(true);
    assert_equal_to_reference(
        "CP=2 a2a DP=2 distributed optimizer, overlapped",
        &dp,
        &want,
    );
    let tp = cp(2, 1, 2, "all_gather").with_sequence_parallel(true);
    assert_equal_to_reference("TP=2 SP CP=2 all_gather", &tp, &want);
    assert_equal_to_reference("PP=2 CP=2 p2p", &cp(1, 2, 2, "p2p"), &want);
    let recompute = cp(1, 2, 2, "p2p").with_recompute(Recompute::Full);
    assert_equal_to_reference("PP=2 CP=2 p2p, full recomputation", &recompute, &want);
}

/// With hidden dropout (masks placed by global position), CP 2 trains as CP 1 does, and a
/// checkpoint saved at CP 2 (CP rank 0 writes it) resumes at CP 1 with the uninterrupted
/// run's losses.
#[test]
fn a_cp_2_run_with_dropout_resumes_at_cp_1() {
    let run = |cp_size: usize, iters: usize| {
        cp(1, 1, cp_size, "all_gather")
            .with_use_distributed_optimizer(true)
            .with_hidden_dropout(0.1)
            .with_train_iters(iters)
            .with_lr_decay_iters(Some(4))
            .with_eval_interval(0)
    };
    let uninterrupted = train(&run(1, 4)).losses();
    let at_cp_2 = train(&run(2, 4)).losses();
    assert_close(
        "CP 2 with dropout",
        &at_cp_2,
        &uninterrupted,
        tolerance::F32_TRAINING,
    );
    let dir = scratch("cp-2-resumed-at-cp-1");
    let stopped = train(
        &run(2, 2)
            .with_save(Some(dir.clone()))
            .with_save_interval(Some(2)),
    );
    assert_eq!(stopped.checkpoints, [dir.join("iter_0000002")]);
    let resumed = train(&run(1, 4).with_load(Some(dir.clone())));
    assert_eq!(resumed.resumed_from, Some(dir.join("iter_0000002")));
    assert_close(
        "saved at CP 2, resumed at CP 1",
        &resumed.losses(),
        &uninterrupted[2..],
        tolerance::F32_TRAINING,
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn options_by_megatron_names() {
    let args = [
        "pretrain_gpt",
        "--context-parallel-size",
        "4",
        "--cp-comm-type",
        "all_gather",
    ];
    let config = PretrainArgs::try_parse_from(args)
        .unwrap()
        .into_config()
        .unwrap();
    assert_eq!(config.context_parallel_size, 4);
    assert_eq!(config.cp_comm().unwrap(), CpCommType::AllGather);
    // TP 2 × PP 2 × CP 4 × DP 1.
    assert_eq!(config.world_size(), 16);
    let layout = config.check(16).unwrap();
    assert_eq!((layout.cp, layout.dp), (4, 1));
}

#[test]
fn bad_context_parallel_layouts_are_refused() {
    let error = |config: PretrainConfig, world: usize| config.check(world).unwrap_err().to_string();
    let e = error(cp(1, 1, 2, "ring"), 2);
    assert!(
        e.contains("--cp-comm-type ring is not supported: use p2p, all_gather or a2a"),
        "{e}"
    );
    let e = error(cp(1, 1, 3, "p2p"), 3);
    assert!(
        e.contains("--seq-length (16) must be divisible by 2 × --context-parallel-size = 6"),
        "{e}"
    );
    let e = error(
        cp(2, 1, 2, "p2p")
            .with_sequence_parallel(true)
            .with_seq_length(12),
        4,
    );
    assert!(
        e.contains("--seq-length (12) must be divisible by 2 × --context-parallel-size × TP = 8"),
        "{e}"
    );
    let e = error(cp(1, 1, 2, "p2p"), 3);
    assert!(
        e.contains("not a multiple of TP (1) × PP (1) × CP (2)"),
        "{e}"
    );
    let e = error(cp(1, 1, 2, "p2p").with_data_parallel_size(2), 2);
    assert!(
        e.contains("--data-parallel-size is 2: launch 4 ranks"),
        "{e}"
    );
    let e = error(cp(1, 1, 2, "p2p").with_attention_dropout(0.1), 2);
    assert!(e.contains("set --attention-dropout 0"), "{e}");
    let e = error(cp(2, 1, 4, "a2a").with_seq_length(32), 8);
    assert!(
        e.contains("splits each TP rank's 2 attention heads over --context-parallel-size 4"),
        "{e}"
    );
    let e = error(cp(1, 1, 0, "p2p"), 1);
    assert!(
        e.contains("--context-parallel-size (0) must be at least 1"),
        "{e}"
    );
}
