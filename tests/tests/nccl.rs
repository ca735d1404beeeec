//! Process groups over NCCL, on the GPU machine (two or more GPUs): the collective suite that
//! runs on CPU ranks, on thread and process ranks; mismatches; the watchdog; tensor
//! parallelism, and pipeline parallelism (PP = 2) with its batched point-to-point exchange.
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

/// The tensor-parallel GPT and Llama over NCCL: TP = 2 with sequence parallelism on two GPUs
/// gives the one-GPU loss and gradients. Every collective of the forward pass, the backward
/// pass and the gradient gathering runs over NCCL: the sequence gathers and scatters of the
/// attention and the embedding (an inner dimension of `[batch, seq, hidden]`, batch 2), the
/// MLP's flat ones on rank-major tokens, SwiGLU's one entry for two projections, and RoPE in
/// place. f32 with TF32 matmuls: agreement to 1e-3.
#[test]
fn tensor_parallel_gpt_over_nccl_matches_one_gpu() {
    use burn::tensor::{Int, TensorData};
    use burn_megatron::tensor_parallel::gather_full_grads;
    use burn_megatron::transformer::{
        Activation, Normalization, PositionEmbedding, TransformerConfig,
    };
    use burn_megatron_testing::{assert_close, data_values, tolerance};
    type A = Autodiff<MegatronCuda>;

    let gpt = TransformerConfig::new(64, 2, 4, 256, 50, 16).with_sequence_parallel(true);
    let llama = TransformerConfig::new(64, 2, 8, 96, 50, 16)
        .with_num_query_groups(Some(4))
        .with_normalization(Normalization::RmsNorm)
        .with_activation(Activation::SwiGlu)
        .with_position_embedding(PositionEmbedding::Rope { base: 10_000.0 })
        .with_add_bias_linear(false)
        .with_tie_embeddings(false)
        .with_sequence_parallel(true);
    for (name, model_config) in [("GPT", gpt), ("Llama", llama)] {
        let run = |tp: usize| {
            launch(config(tp), |ctx| {
                let device = CudaGpu::new(ctx.local_rank());
                let model = model_config.init_gpt::<A>(ctx.world(), &device)?;
                let ids = |seed: i64| {
                    let v: Vec<i64> = (0..2 * 16).map(|i| (i * 13 + seed) % 50).collect();
                    Tensor::<A, 2, Int>::from_data(TensorData::new(v, [2, 16]), &device)
                };
                let (loss, grads) =
                    burn_megatron::pipeline_parallel::forward_backward_no_pipelining(
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
            .unwrap_or_else(|e| panic!("{name} TP={tp}: {e}"))
            .remove(0)
        };
        let (loss_tp2, grads_tp2) = run(2);
        let (loss_tp1, grads_tp1) = run(1);
        println!("{name}: loss TP=2 over NCCL {loss_tp2}, TP=1 {loss_tp1}");
        assert_close(
            &format!("{name} loss"),
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
            let err = assert_close(
                &format!("{name} {path}"),
                &a[..len],
                &b[..len],
                tolerance::GPU_F32,
            );
            println!("{name} {path:>40}: relative difference {err:.2e}");
        }
    }
}

/// The values rank `rank` sends in the crossing exchange: exact in f32 (below 2^24).
fn crossing_values(rank: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7 + rank * 1_000_003) % 16_777_216) as f32)
        .collect()
}

/// Rank 0 and rank 1 each send a 64 MiB tensor (and a small one) to the other and receive
/// the other's, sends first, in one batch: one NCCL group, so it cannot deadlock. With and
/// without collective checks (with checks, headers travel through the host first).
#[test]
fn crossing_batched_exchange_over_nccl() {
    use burn::tensor::TensorData;
    use burn_megatron_dist::p2p::{P2pOp, batch_isend_irecv};
    gpus();
    const N: usize = 16 << 20;
    const SMALL: usize = 1000;
    for checks in [true, false] {
        let times = launch(config(2).with_collective_checks(checks), |ctx| {
            let device = CudaGpu::new(ctx.local_rank());
            let world = ctx.world();
            let (me, peer) = (world.rank(), 1 - world.rank());
            let tensor = |values: Vec<f32>| {
                let n = values.len();
                Tensor::<MegatronCuda, 1>::from_data(TensorData::new(values, [n]), &device)
            };
            let big = tensor(crossing_values(me, N));
            let small = tensor(crossing_values(me + 2, SMALL));
            let mut elapsed = Vec::new();
            for _ in 0..2 {
                let ops = vec![
                    P2pOp::Send {
                        tensor: big.clone(),
                        peer,
                    },
                    P2pOp::Send {
                        tensor: small.clone(),
                        peer,
                    },
                    P2pOp::Recv {
                        peer,
                        shape: [N],
                        dtype: DType::F32,
                    },
                    P2pOp::Recv {
                        peer,
                        shape: [SMALL],
                        dtype: DType::F32,
                    },
                ];
                let start = Instant::now();
                let received = batch_isend_irecv(world, ops, &device)?;
                world.synchronize()?;
                elapsed.push(start.elapsed());
                let got: Vec<Vec<f32>> = received
                    .into_iter()
                    .map(|t| t.into_data().to_vec::<f32>().expect("f32"))
                    .collect();
                assert_eq!(got.len(), 2);
                assert!(got[0] == crossing_values(peer, N), "rank {me}: big tensor");
                assert!(
                    got[1] == crossing_values(peer + 2, SMALL),
                    "rank {me}: small"
                );
            }
            // Ranks make different numbers of point-to-point calls (two batches of one send
            // against one batch of two receives); the collectives after them still meet.
            let ops = match me {
                0 => vec![
                    vec![P2pOp::Send {
                        tensor: small.clone(),
                        peer,
                    }],
                    vec![P2pOp::Send {
                        tensor: small.clone() * 2.0,
                        peer,
                    }],
                ],
                _ => vec![vec![
                    P2pOp::Recv {
                        peer,
                        shape: [SMALL],
                        dtype: DType::F32,
                    },
                    P2pOp::Recv {
                        peer,
                        shape: [SMALL],
                        dtype: DType::F32,
                    },
                ]],
            };
            for batch in ops {
                for (i, t) in batch_isend_irecv(world, batch, &device)?
                    .into_iter()
                    .enumerate()
                {
                    let want: Vec<f32> = crossing_values(2, SMALL)
                        .into_iter()
                        .map(|v| v * (i + 1) as f32)
                        .collect();
                    assert!(t.into_data().to_vec::<f32>().expect("f32") == want);
                }
            }
            world.barrier()?;
            let sum =
                world.all_reduce(Tensor::<MegatronCuda, 1>::ones([4], &device), ReduceOp::Sum)?;
            assert_eq!(sum.into_data().to_vec::<f32>().expect("f32"), vec![2.0; 4]);
            Ok::<_, DistError>(elapsed[1])
        })
        .unwrap_or_else(|e| panic!("checks={checks}: {e}"));
        let slowest = times.iter().max().expect("two ranks");
        let gbps = 2.0 * (N * 4) as f64 / slowest.as_secs_f64() / 1e9;
        println!(
            "crossing 2 × 64 MiB (checks {checks}): {:.2} ms, {gbps:.1} GB/s both ways",
            slowest.as_secs_f64() * 1e3
        );
    }
}

/// A stage's parameter path in the whole model: its layers are numbered from `offset`, and
/// a last stage's copy of a tied table is the embedding table.
fn global_path(path: &str, offset: usize, tied_copy: bool) -> String {
    if tied_copy && path == "output.weight" {
        return "embedding.weight".to_string();
    }
    match path.strip_prefix("block.layers.") {
        Some(rest) => {
            let (index, tail) = rest.split_once('.').expect("a layer's parameter");
            let index: usize = index.parse().expect("a layer index");
            format!("block.layers.{}.{tail}", index + offset)
        }
        None => path.to_string(),
    }
}

/// A small GPT with PP = 2 over NCCL (thread ranks, GPU = rank), 1F1B and GPipe with M = 4:
/// the loss and every gradient equal PP = 1 (gradient accumulation) on one GPU. Also prints
/// tokens/s of both and the measured bubble against the plan's.
#[test]
fn pipeline_parallel_gpt_over_nccl_matches_one_gpu() {
    use std::collections::BTreeMap;

    use burn::tensor::{Int, TensorData};
    use burn_megatron::pipeline_parallel::{
        Microbatch, Schedule, StageSplit, forward_backward, forward_backward_no_pipelining,
    };
    use burn_megatron::tensor_parallel::gather_full_grads;
    use burn_megatron::transformer::TransformerConfig;
    use burn_megatron_dist::ParallelSizes;
    use burn_megatron_testing::{assert_close, data_values, tolerance};
    type A = Autodiff<MegatronCuda>;
    type Failure = Box<dyn std::error::Error + Send + Sync>;
    gpus();

    const M: usize = 4;
    const TIMED: usize = 10;
    let model_config = TransformerConfig::new(64, 2, 4, 256, 50, 16);
    let tokens_per_step = (M * 2 * 16) as f64;
    let microbatches = |device: &CudaGpu| -> Vec<Microbatch<A>> {
        let ids = |seed: i64| {
            let v: Vec<i64> = (0..2 * 16).map(|i| (i * 13 + seed * 7) % 50).collect();
            Tensor::<A, 2, Int>::from_data(TensorData::new(v, [2, 16]), device)
        };
        (0..M as i64)
            .map(|i| Microbatch::new(ids(2 * i + 1), ids(2 * i + 2)))
            .collect()
    };
    // Wall time of a step, over `TIMED` steps ended by reading a value (the queue drained).
    fn time(
        mut step: impl FnMut() -> Result<Tensor<MegatronCuda, 1>, Failure>,
    ) -> Result<f64, Failure> {
        step()?.into_data();
        let start = Instant::now();
        let mut last = None;
        for _ in 0..TIMED {
            last = Some(step()?);
        }
        last.expect("timed steps").into_data();
        Ok(start.elapsed().as_secs_f64() / TIMED as f64)
    }

    let (loss_ref, grads_ref, step_ref) = launch(config(1), |ctx| {
        let device = CudaGpu::new(ctx.local_rank());
        let model = model_config.init_gpt::<A>(ctx.world(), &device)?;
        let mbs = microbatches(&device);
        let (loss, grads) = forward_backward_no_pipelining(&model, &mbs)?;
        let grads: BTreeMap<_, _> = gather_full_grads::<A, _>(&model, &grads, ctx.world())?
            .into_iter()
            .collect();
        let loss = data_values(&loss.into_data())[0];
        let step = time(|| Ok(forward_backward_no_pipelining(&model, &mbs)?.0))?;
        Ok::<_, Failure>((loss, grads, step))
    })
    .unwrap_or_else(|e| panic!("PP=1: {e}"))
    .remove(0);
    println!(
        "PP=1 on one GPU: loss {loss_ref}, {:.2} ms/step, {:.0} tokens/s",
        step_ref * 1e3,
        tokens_per_step / step_ref
    );

    for schedule in [Schedule::OneFOneB, Schedule::GPipe] {
        let per_rank = launch(config(2), |ctx| {
            let device = CudaGpu::new(ctx.local_rank());
            let state = ctx.parallel_state(ParallelSizes::default().with_pp(2))?;
            let split = StageSplit::even(model_config.num_layers, 2)?;
            let chunk = model_config.init_gpt_stage::<A>(
                state.tp(),
                &split.stage(state.virtual_stage(0)),
                &device,
            )?;
            let chunks = [chunk];
            let mbs = microbatches(&device);
            let out = forward_backward(schedule, &state, &chunks, &mbs)?;
            let mut grads = BTreeMap::new();
            let offset = chunks[0].stage().layers.start;
            let tied_copy = chunks[0].ties_embeddings() && !chunks[0].stage().is_first();
            for (path, data) in gather_full_grads::<A, _>(&chunks[0], &out.grads[0], state.tp())? {
                grads.insert(global_path(&path, offset, tied_copy), data);
            }
            let loss = out.loss.map(|l| data_values(&l.into_data())[0]);
            let step = time(|| {
                let out = forward_backward(schedule, &state, &chunks, &mbs)?;
                Ok(match out.loss {
                    Some(loss) => loss,
                    None => Tensor::zeros([1], &device),
                })
            })?;
            state.pp().barrier()?;
            Ok::<_, Failure>((loss, grads, step))
        })
        .unwrap_or_else(|e| panic!("{schedule} PP=2: {e}"));
        let loss = per_rank
            .iter()
            .find_map(|(loss, _, _)| *loss)
            .expect("the last stage reports the loss");
        let step = per_rank.iter().map(|(_, _, s)| *s).fold(0.0, f64::max);
        let planned = schedule.plan(2, 1, M).and_then(|p| p.bubble_fraction());
        let planned = planned.expect("a plan");
        // Ideal PP = 2 time is half of PP = 1's; the rest, over the step, is bubble (and
        // communication).
        let measured = 1.0 - step_ref / (2.0 * step);
        println!(
            "{schedule} PP=2 M={M} over NCCL: loss {loss}, {:.2} ms/step, {:.0} tokens/s \
             ({:.2}× PP=1); bubble measured {measured:.2}, plan {planned:.2}",
            step * 1e3,
            tokens_per_step / step,
            step_ref / step
        );
        assert_close(
            &format!("{schedule}: loss"),
            &[loss],
            &[loss_ref],
            tolerance::F32,
        );
        let mut grads = BTreeMap::new();
        for (_, rank_grads, _) in per_rank {
            for (path, data) in rank_grads {
                if let Some(previous) = grads.insert(path.clone(), data.clone()) {
                    assert_eq!(previous, data, "{schedule}: the copies of {path} differ");
                }
            }
        }
        let got: Vec<_> = grads.keys().collect();
        let want: Vec<_> = grads_ref.keys().collect();
        assert_eq!(got, want, "{schedule}: parameters");
        for (path, data) in &grads_ref {
            let err = assert_close(
                &format!("{schedule}: gradient of {path}"),
                &data_values(&grads[path]),
                &data_values(data),
                tolerance::GPU_F32,
            );
            println!("{schedule} {path:>40}: relative difference {err:.2e}");
        }
    }
}
