//! Process groups over NCCL, on the GPU machine (two or more GPUs): the collective suite that
//! runs on CPU ranks, on thread and process ranks; mismatches; the watchdog.
//!
//!     ../shared/gpu/pack test --release --features cuda -p burn-megatron-tests --test nccl
//!     source .gpu/env.sh && .gpu/bin/nccl --test-threads=1

use std::path::PathBuf;
use std::time::{Duration, Instant};

use burn::backend::Autodiff;
use burn::tensor::{DType, Tensor};
use burn_megatron_dist::{DistError, LaunchConfig, ReduceOp, SpawnConfig, launch, spawn_ranks};
use burn_megatron_kernels::cuda::{CudaGpu, MegatronCuda};
use burn_megatron_tests::collective_suite::Suite;

fn gpus() -> usize {
    let count = cudarc::driver::CudaContext::device_count().expect("CUDA") as usize;
    assert!(
        count >= 2,
        "these tests need two or more GPUs, found {count}"
    );
    count
}

fn config(world: usize) -> LaunchConfig {
    LaunchConfig::new(world).with_timeout(Duration::from_secs(60))
}

#[test]
fn suite_over_nccl_on_thread_ranks() {
    let world = gpus();
    for dtype in [DType::BF16, DType::F16] {
        let cases = launch(config(world), |ctx| {
            let gpu = CudaGpu::new(ctx.local_rank());
            Suite::<MegatronCuda>::new(&ctx, &gpu, dtype).run()
        })
        .unwrap_or_else(|e| panic!("{dtype:?}: {e}"));
        assert_eq!(cases, vec![10; world]);
    }
    // Autodiff tensors take the same path (their inner tensors).
    let cases = launch(config(world), |ctx| {
        let gpu = CudaGpu::new(ctx.local_rank());
        Suite::<Autodiff<MegatronCuda>>::new(&ctx, &gpu, DType::BF16).run()
    })
    .unwrap_or_else(|e| panic!("autodiff: {e}"));
    assert_eq!(cases, vec![10; world]);
}

#[test]
fn suite_over_nccl_without_checks() {
    let world = gpus();
    let cases = launch(config(world).with_collective_checks(false), |ctx| {
        let gpu = CudaGpu::new(ctx.local_rank());
        Suite::<MegatronCuda>::new(&ctx, &gpu, DType::BF16)
            .equal_shards_only()
            .run()
    })
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(cases, vec![10; world]);
}

#[test]
fn mismatched_gpu_collectives_are_errors() {
    let errors = launch(config(2), |ctx| {
        let gpu = CudaGpu::new(ctx.local_rank());
        let x = Tensor::<MegatronCuda, 1>::ones([4 + ctx.rank()], &gpu);
        match ctx.world().all_reduce(x, ReduceOp::Sum) {
            Err(e @ DistError::Mismatch { .. }) => Ok(e.to_string()),
            other => Err(format!("expected a mismatch, got {other:?}")),
        }
    })
    .unwrap_or_else(|e| panic!("{e}"));
    for error in errors {
        assert!(error.contains("rank 0: all_reduce(sum) [4]"), "{error}");
        assert!(error.contains("rank 1: all_reduce(sum) [5]"), "{error}");
    }
}

/// The `collective_ranks` binary: next to this test's binary (packed), or where cargo put it.
fn ranks_binary() -> PathBuf {
    let packed = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join("collective_ranks")));
    packed
        .filter(|p| p.exists())
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_collective_ranks").into())
}

fn spawn(args: &[&str]) -> (burn_megatron_dist::SpawnReport, Duration) {
    let mut config = SpawnConfig::new(gpus());
    config.master_port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    config.grace = Duration::from_secs(30);
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let start = Instant::now();
    let report = spawn_ranks(&config, ranks_binary().to_str().unwrap(), &args).unwrap();
    (report, start.elapsed())
}

#[test]
fn suite_over_nccl_on_process_ranks() {
    let (report, _) = spawn(&["suite", "--cuda"]);
    assert!(report.success(), "{report:?}");
    let (report, _) = spawn(&["suite", "--cuda", "--no-checks"]);
    assert!(report.success(), "{report:?}");
}

/// Rank 1 sleeps 8 s past a 3 s timeout before its collective; rank 0's process must return
/// the timeout error within timeout + 5 s (it checks that itself and exits 0): from the host
/// rendezvous with checks on, from the NCCL watchdog with them off.
#[test]
fn watchdog_times_out_a_sleeping_rank() {
    for checks in ["--checks", "--no-checks"] {
        let (report, _) = spawn(&["sleep", "--cuda", checks, "--timeout-ms=3000"]);
        assert!(report.success(), "{checks}: {report:?}");
    }
}

/// Rank 1's process dies between GPU collectives; rank 0 must fail with that news well before
/// its 60 s timeout.
#[test]
fn a_crashed_process_releases_its_gpu_peers() {
    let (report, elapsed) = spawn(&["crash", "--cuda", "--no-checks", "--timeout-ms=60000"]);
    let codes: Vec<_> = report
        .statuses
        .iter()
        .map(|s| s.and_then(|s| s.code()))
        .collect();
    assert_eq!(codes[..2], [Some(0), Some(3)], "{report:?}");
    assert!(elapsed < Duration::from_secs(30), "took {elapsed:?}");
}

/// The tensor-parallel GPT over NCCL: TP = 2 with sequence parallelism on two GPUs gives the
/// one-GPU loss and gradients. Every collective of the forward pass, the backward pass and
/// the gradient gathering runs over NCCL. f32 with TF32 matmuls: agreement to 1e-3.
#[test]
fn tensor_parallel_gpt_over_nccl_matches_one_gpu() {
    use burn::tensor::{Int, TensorData};
    use burn_megatron::tensor_parallel::gather_full_grads;
    use burn_megatron::transformer::TransformerConfig;
    use burn_megatron_testing::{assert_close, data_values, tolerance};
    type A = Autodiff<MegatronCuda>;

    let model_config = TransformerConfig::new(64, 2, 4, 256, 50, 16).with_sequence_parallel(true);
    let run = |tp: usize| {
        launch(config(tp), |ctx| {
            let device = CudaGpu::new(ctx.local_rank());
            let model = model_config.init_gpt::<A>(ctx.world(), &device)?;
            let ids = |seed: i64| {
                let v: Vec<i64> = (0..2 * 16).map(|i| (i * 13 + seed) % 50).collect();
                Tensor::<A, 2, Int>::from_data(TensorData::new(v, [2, 16]), &device)
            };
            let (loss, grads) = burn_megatron::pipeline_parallel::forward_backward_no_pipelining(
                &model,
                &[burn_megatron::pipeline_parallel::Microbatch::new(
                    ids(1),
                    ids(2),
                )],
            )?;
            let grads = gather_full_grads::<A, _>(&model, &grads, ctx.world())?;
            let loss: f32 = loss.into_scalar().to_string().parse().unwrap();
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((loss, grads))
        })
        .unwrap_or_else(|e| panic!("TP={tp}: {e}"))
        .remove(0)
    };
    let (loss_tp2, grads_tp2) = run(2);
    let (loss_tp1, grads_tp1) = run(1);
    println!("loss TP=2 over NCCL {loss_tp2}, TP=1 {loss_tp1}");
    assert_close(
        "loss",
        &[loss_tp2 as f64],
        &[loss_tp1 as f64],
        tolerance::F32,
    );
    assert_eq!(grads_tp2.len(), grads_tp1.len());
    for ((path, a), (_, b)) in grads_tp2.iter().zip(&grads_tp1) {
        // TP pads the vocabulary to a multiple of TP: compare the real rows.
        let len = match path.as_str() {
            "embedding.weight" | "output.weight" => model_config.vocab_size * b.shape[1],
            _ => b.num_elements(),
        };
        let (a, b) = (data_values(a), data_values(b));
        let err = assert_close(path, &a[..len], &b[..len], tolerance::GPU_F32);
        println!("{path:>40}: relative difference {err:.2e}");
    }
}
