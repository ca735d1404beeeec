//! The dense parameters' flat buffer cut into parts below 32-bit indices (Llama-3 8B at DP 4
//! with the distributed optimizer, or 16 of its layers on one GPU, pass 2³² elements a rank),
//! forced on the tiny GPT by lowering the part size to 8 192 elements: its buffer (18 176
//! elements at TP 1, each parameter aligned to 256) takes 3 parts, and 2 at TP 2 and on each
//! stage at PP 2.
//!
//! - Training: ten steps in parts equal ten steps in one part, at DP 1, DP 2 with and without
//!   the distributed optimizer (ZeRO-1), TP 2 × DP 2 and PP 2 × DP 2 with it: losses and
//!   parameters bit for bit without clipping (the norm, whose squares are added in another
//!   order, within 1e-6). With a clip that binds at every step the clip coefficient follows
//!   the norm's last bits, and AdamW carries them on: after ten steps the largest relative
//!   difference is 3e-7 at DP 1, 6.6e-7 at DP 2, 1.4e-7 at PP 2 × DP 2 (two parts a stage),
//!   1.5e-6 at TP 2 × DP 2 (measured; compared at 1e-5, the bound of every layout-equivalence
//!   test). The same with the reduction hooked into the backward
//!   pass (one hook a part, bit for bit the parts' reduction after the backward pass) and
//!   with the bucketed parameter gather. The memory accounting counts every part.
//! - Loss scaling: an +∞ in one part's gradient on one rank skips the step in every part of
//!   every rank.
//! - A single dense parameter above the part size is refused, naming it and
//!   `--tensor-model-parallel-size`.
//!
//! Checkpoints of the parts are tested with the checkpoints
//! (`zero_state_saved_in_dense_parts_loads_in_one_part_and_back`), the routed experts' parts
//! with the MoE tests (`expert_parts.rs`).

use burn_megatron::distributed::DataParallelConfig;
use burn_megatron::optimizer::{DistributedAdamWConfig, MAX_FLAT_NUMEL};
use burn_megatron_dist::ParallelSizes;

use super::data_parallel::{
    Layout, MAX_NORM, Options, Reduce, Run, STEPS, check, data_parallel_with, merge_stages,
    one_device,
};
use super::distributed_loss_scaling::{OVERFLOW, scaled};
use super::flat_adamw::assert_same;
use crate::{AD, assert_close, run, tiny_gpt, tolerance};

/// The part size that cuts the tiny GPT's dense buffer into several parts.
const SEVERAL: usize = 8192;

/// (TP, DP, distributed optimizer), and the parts the tiny GPT's buffer takes there.
const LAYOUTS: [(usize, usize, bool, usize); 4] = [
    (1, 1, false, 3),
    (1, 2, true, 3),
    (1, 2, false, 3),
    (2, 2, true, 2),
];

/// `got` (in parts) against `want` (one part), every replica: losses and parameters within
/// `tolerance`, the norms within 1e-6 (their squares are added in another order).
fn assert_parts_equal(label: &str, got: &[Run], want: &[Run], tolerance: f64) {
    assert_eq!(got.len(), want.len(), "{label}: replicas");
    for (rank, (g, w)) in got.iter().zip(want).enumerate() {
        let label = format!("{label}, replica {rank}");
        assert_close(
            &format!("{label}: norms"),
            &g.norms,
            &w.norms,
            tolerance::F32_SAME_ORDER,
        );
        assert_same(&label, &tiny_gpt(), &g.trajectory, &w.trajectory, tolerance);
    }
}

/// The tiny GPT's buffer takes the parts [`LAYOUTS`] says (one with the default size), and
/// the memory accounting counts every part: the gradient buffers of each part's layout, the
/// master weights and moments of each part's range.
#[test]
fn the_dense_buffer_takes_several_parts_and_the_memory_counts_them() {
    let config = tiny_gpt();
    for (tp, dp, zero, parts) in LAYOUTS {
        for (part_numel, want) in [(MAX_FLAT_NUMEL, 1), (SEVERAL, parts)] {
            run(tp * dp, |ctx| {
                let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp))?;
                let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
                let optim = DistributedAdamWConfig::new()
                    .with_data_parallel(
                        DataParallelConfig::new().with_use_distributed_optimizer(zero),
                    )
                    .with_part_numel(part_numel)
                    .init::<AD, _>(&model, &state, &[])?;
                let dense = optim.dense_states()?;
                let label = format!("TP {tp} x DP {dp}, ZeRO-1 {zero}, parts of {part_numel}");
                assert_eq!(dense.len(), want, "{label}: parts");
                for part in &dense {
                    assert!(part.layout.numel() <= part_numel, "{label}");
                }
                let memory = optim.memory(&model);
                let ranges: usize = dense.iter().map(|p| p.range.len()).sum();
                let layouts: usize = dense.iter().map(|p| p.layout.numel()).sum();
                assert_eq!(memory.exp_avg, 4 * ranges, "{label}");
                assert_eq!(memory.exp_avg_sq, memory.exp_avg, "{label}");
                assert_eq!(memory.grads, 4 * layouts, "{label}");
                // f32 parameters view the master weights without sharding.
                let main = if zero { memory.exp_avg } else { 0 };
                assert_eq!(memory.main_params, main, "{label}");
                Ok(())
            });
        }
    }
}

/// Ten steps with the dense buffer in parts equal ten steps in one part (see the [module
/// docs](self)), and both equal one device.
#[test]
fn dense_parameters_in_parts_train_as_in_one() {
    let config = tiny_gpt();
    let device = one_device(&config, STEPS, None);
    assert!(device.norms.iter().all(|&n| n > MAX_NORM), "the clip binds");
    // LAYOUTS', and PP 2 × DP 2 (1F1B, a tied embedding's copy on the last stage).
    let layouts = LAYOUTS
        .map(|(tp, dp, zero, _)| (tp, 1, dp, zero))
        .into_iter()
        .chain([(1, 2, 2, true)]);
    for (tp, pp, dp, zero) in layouts {
        let layout = Layout { tp, pp, dp };
        for (clip, tolerance) in [(Some(MAX_NORM), tolerance::F32), (None, 0.0)] {
            let one = Options {
                clip,
                ..Options::new(zero)
            };
            let parts = Options {
                part_numel: SEVERAL,
                ..one
            };
            let want = data_parallel_with(&config, layout, one, &device);
            let got = data_parallel_with(&config, layout, parts, &device);
            let label = format!("{layout:?}, ZeRO-1 {zero}, clip {clip:?}, in parts");
            assert_parts_equal(&label, &got, &want, tolerance);
            if clip.is_some() {
                check(&label, &config, &got, &device, tolerance::F32);
            }
        }
    }
}

/// The reduction hooked into the backward pass (one hook a part, the weight-gradient GEMMs
/// adding into the part that holds the weight) gives the bits of the parts' reduction after
/// the backward pass, and one part's results within 1e-5; so does the bucketed parameter
/// gather, at DP 2 and TP 2 × DP 2 with ZeRO-1 and at DP 2 without it (no gather).
#[test]
fn dense_parts_with_the_overlapped_reduction_and_bucketed_gather() {
    let config = tiny_gpt();
    let device = one_device(&config, STEPS, None);
    for (tp, dp, zero) in [(1, 2, true), (2, 2, true), (1, 2, false)] {
        let layout = Layout { tp, pp: 1, dp };
        let one = data_parallel_with(&config, layout, Options::new(zero), &device);
        let after = Options {
            part_numel: SEVERAL,
            ..Options::new(zero)
        };
        let after_runs = data_parallel_with(&config, layout, after, &device);
        let hooked = Options {
            reduce: Reduce::Hooked,
            ..after
        };
        let mut variants = vec![("hooked", hooked)];
        if zero {
            let gather = Options {
                param_gather: true,
                ..after
            };
            variants.push(("bucketed gather", gather));
            variants.push((
                "hooked, bucketed gather",
                Options {
                    reduce: Reduce::Hooked,
                    ..gather
                },
            ));
        }
        for (name, options) in variants {
            let got = data_parallel_with(&config, layout, options, &device);
            let label = format!("{layout:?}, ZeRO-1 {zero}, in parts, {name}");
            for (g, a) in got.iter().zip(&after_runs) {
                assert_close(&format!("{label}: norms"), &g.norms, &a.norms, 0.0);
                assert_same(&label, &config, &g.trajectory, &a.trajectory, 0.0);
            }
            assert_parts_equal(&label, &got, &one, tolerance::F32);
        }
    }
}

/// A loss-scaled run in parts at DP 2 (with and without ZeRO-1): the +∞ one rank injects into
/// a norm's gradient (in the last part) skips the step in every part of every rank (each
/// part's step count one short), and the run equals one device without that step.
#[test]
fn an_overflow_in_one_dense_part_skips_every_part() {
    let want = one_device(
        &tiny_gpt(),
        super::distributed_loss_scaling::STEPS,
        Some(OVERFLOW),
    );
    for zero in [false, true] {
        let layout = Layout {
            tp: 1,
            pp: 1,
            dp: 2,
        };
        let got = merge_stages(scaled(layout, zero, SEVERAL), &want);
        check(
            &format!("DP 2, ZeRO-1 {zero}, loss scale, in parts"),
            &tiny_gpt(),
            &got,
            &want,
            tolerance::F32,
        );
    }
}

/// A dense parameter whose own buffer passes the part size cannot be cut: refused when the
/// optimizer is built, naming it, its size and the option (the word embeddings, 52 × 16
/// elements aligned to 1 024, in parts of 1 000).
#[test]
fn a_dense_parameter_above_the_part_size_is_refused() {
    let errors = run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let model = tiny_gpt().init_gpt::<AD>(state.tp(), &Default::default())?;
        let error = match DistributedAdamWConfig::new()
            .with_part_numel(1000)
            .init::<AD, _>(&model, &state, &[])
        {
            Ok(_) => return Err("an 832-element table taken in parts of 1000".into()),
            Err(e) => e.to_string(),
        };
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(error)
    });
    let error = &errors[0];
    for part in [
        "`embedding.weight` alone",
        "alone (832 elements",
        "would hold 1024 elements, more than the 1000",
        "--tensor-model-parallel-size",
    ] {
        assert!(error.contains(part), "{part}: {error}");
    }
}
