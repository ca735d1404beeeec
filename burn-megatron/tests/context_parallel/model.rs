//! The whole GPT and Llama models under context parallelism: each rank runs its two chunks of
//! every sequence through every layer, and the logits (put back in sequence order), the loss
//! and every parameter gradient (summed over CP, averaged over DP) equal the CP = 1 model's
//! (f32, 1e-5 relative). CP = 2 and 4, each communication, with TP 2 and sequence
//! parallelism, with DP 2, with chunks of one token, and in FP8 (the CPU emulation).

use burn::module::AutodiffModule;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::context_parallel::{CpCommType, CpContext, LoadBalancedSplit};
use burn_megatron::ops::fp8::{Fp8Config, Fp8Recipe};
use burn_megatron::pipeline_parallel::{Microbatch, forward_backward_no_pipelining};
use burn_megatron::tensor_parallel::gather_full_grads;
use burn_megatron::transformer::TransformerConfig;
use burn_megatron_dist::ParallelSizes;
use burn_megatron_testing::data_values;
use burn_megatron_testing::models::{tiny_gpt, tiny_llama, token_ids};

use crate::{AD, B, assert_close, run, tolerance};

/// One layout: `tp × cp × dp` ranks, sequence parallelism, the attention's communication.
#[derive(Debug, Clone, Copy)]
struct Layout {
    tp: usize,
    cp: usize,
    dp: usize,
    sp: bool,
    comm: CpCommType,
}

impl Layout {
    fn cp(cp: usize, comm: CpCommType) -> Self {
        Self {
            tp: 1,
            cp,
            dp: 1,
            sp: false,
            comm,
        }
    }
}

/// What one layout computes for the whole batch: logits `[rows, seq, vocab]` (real
/// vocabulary), the loss, every gradient by path (full shapes, real vocabulary rows).
struct Outcome {
    logits: Vec<f64>,
    loss: f64,
    grads: Vec<(String, Vec<f64>)>,
}

/// `[rows, seq]` tokens and next-token-like targets (the first position of each row ignored).
fn batch(rows: usize, seq: usize, vocab: usize) -> (Vec<i64>, Vec<i64>) {
    let tokens = token_ids(rows * seq, vocab, 3);
    let mut targets = token_ids(rows * seq, vocab, 103);
    for row in 0..rows {
        targets[row * seq] = -100;
    }
    (tokens, targets)
}

fn ints(values: &[i64], rows: usize, seq: usize) -> Tensor<AD, 2, Int> {
    Tensor::from_data(
        TensorData::new(values.to_vec(), [rows, seq]),
        &Default::default(),
    )
}

/// Rows of a vocabulary-split parameter beyond the real vocabulary are padding, whose amount
/// depends on TP.
fn real_rows(path: &str, data: &TensorData, vocab: usize) -> Vec<f64> {
    let v = data_values(data);
    if path.starts_with("embedding.") || path.starts_with("output.") {
        v[..vocab * data.shape[1]].to_vec()
    } else {
        v
    }
}

/// Runs one forward and backward pass of `config` in `layout` over `rows · dp` rows of
/// `seq` tokens (DP rank `r` takes rows `r · rows..`), and puts the ranks' results together.
fn outcome(config: &TransformerConfig, layout: Layout, rows: usize, seq: usize) -> Outcome {
    let vocab = config.vocab_size;
    let Layout {
        tp,
        cp,
        dp,
        sp,
        comm,
    } = layout;
    let config = config.clone().with_sequence_parallel(sp);
    let (all_tokens, all_targets) = batch(rows * dp, seq, vocab);
    let ranks = run(tp * cp * dp, |ctx| {
        // ANCHOR: cp_model
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp).with_cp(cp))?;
        let model = config
            .init_gpt::<AD>(state.tp(), &Default::default())?
            .with_context_parallel(CpContext::new(state.cp(), comm))?;
        let split = LoadBalancedSplit::of_group(state.cp());
        let rows_of = |v: &[i64]| {
            let r = state.coords().dp;
            let t = ints(&v[r * rows * seq..(r + 1) * rows * seq], rows, seq);
            split.split(t, 1)
        };
        let (tokens, targets) = (rows_of(&all_tokens)?, rows_of(&all_targets)?);
        // ANCHOR_END: cp_model
        let eval = Tensor::from_data(tokens.to_data(), &Default::default());
        let logits = model.valid().try_forward(eval)?;
        let logits = state.tp().all_gather(logits, 2)?.narrow(2, 0, vocab);
        let (loss, grads) =
            forward_backward_no_pipelining(&model, &[Microbatch::new(tokens, targets)])?;
        let grads = gather_full_grads::<AD, _>(&model, &grads, state.tp())?;
        let grads: Vec<(String, Vec<f64>)> = grads
            .into_iter()
            .map(|(path, data)| {
                let values = real_rows(&path, &data, vocab);
                (path, values)
            })
            .collect();
        Ok((
            state.coords(),
            logits.into_data(),
            loss.into_scalar() as f64,
            grads,
        ))
    });
    // Every rank of a replica (TP × CP) holds its loss; the replicas' losses are averaged.
    let replica_loss = |d: usize| ranks.iter().find(|(c, ..)| c.dp == d).expect("a rank").2;
    for (coords, _, l, _) in &ranks {
        let want = replica_loss(coords.dp);
        assert_eq!(l.to_bits(), want.to_bits(), "rank {coords:?}'s loss");
    }
    let loss = (0..dp).map(replica_loss).sum::<f64>() / dp as f64;
    // Logits: TP rank 0 of each (dp, cp), put back in order over CP, rows by DP rank.
    let logits_of = |d: usize| {
        let mut parts: Vec<_> = ranks
            .iter()
            .filter(|(c, ..)| c.tp == 0 && c.dp == d)
            .map(|(c, logits, ..)| {
                (
                    c.cp,
                    Tensor::<B, 3>::from_data(logits.clone(), &Default::default()),
                )
            })
            .collect();
        parts.sort_by_key(|(cp, _)| *cp);
        LoadBalancedSplit::restore(parts.into_iter().map(|(_, t)| t).collect(), 1)
            .expect("the parts restore")
    };
    let logits = Tensor::cat((0..dp).map(logits_of).collect(), 0);
    // Gradients: summed over CP (each rank holds its tokens' share), averaged over DP.
    let mut grads: Vec<(String, Vec<f64>)> = Vec::new();
    for (c, _, _, rank_grads) in ranks.iter().filter(|(c, ..)| c.tp == 0) {
        if grads.is_empty() {
            grads = rank_grads
                .iter()
                .map(|(p, v)| (p.clone(), vec![0.0; v.len()]))
                .collect();
        }
        assert_eq!(grads.len(), rank_grads.len(), "rank {c:?}'s gradients");
        for ((path, sum), (p, v)) in grads.iter_mut().zip(rank_grads) {
            assert_eq!(path, p);
            for (s, x) in sum.iter_mut().zip(v) {
                *s += x / dp as f64;
            }
        }
    }
    Outcome {
        logits: data_values(&logits.into_data()),
        loss,
        grads,
    }
}

/// `config` in each layout equals it at CP = 1 on one rank, for `rows · dp` rows of `seq`
/// tokens.
fn assert_equivalent(name: &str, config: &TransformerConfig, layouts: &[Layout], seq: usize) {
    for &layout in layouts {
        let rows = 2;
        let want = outcome(
            config,
            Layout::cp(1, CpCommType::P2p),
            rows * layout.dp,
            seq,
        );
        let got = outcome(config, layout, rows, seq);
        let at = |what: &str| format!("{name} {layout:?} seq {seq}: {what}");
        assert_close(&at("logits"), &got.logits, &want.logits, tolerance::F32);
        assert_close(&at("loss"), &[got.loss], &[want.loss], tolerance::F32);
        assert_eq!(got.grads.len(), want.grads.len());
        for ((path, g), (p, w)) in got.grads.iter().zip(&want.grads) {
            assert_eq!(path, p);
            assert_close(&at(&format!("gradient of {path}")), g, w, tolerance::F32);
        }
    }
}

const COMMS: [CpCommType; 3] = [CpCommType::P2p, CpCommType::AllGather, CpCommType::A2a];

fn every_comm(cp: usize) -> Vec<Layout> {
    COMMS.map(|comm| Layout::cp(cp, comm)).to_vec()
}

/// GPT: learned positions (gathered at the chunks' global positions), LayerNorm, GeLU, biases,
/// tied embeddings.
fn gpt() -> TransformerConfig {
    TransformerConfig {
        max_sequence_length: 16,
        ..tiny_gpt()
    }
}

/// Llama: RoPE (at the chunks' global positions), grouped queries (4 heads in 2 groups: fewer
/// K/V heads than CP = 4), RMSNorm, SwiGLU.
fn llama() -> TransformerConfig {
    TransformerConfig {
        max_sequence_length: 16,
        ..tiny_llama()
    }
}

#[test]
fn gpt_at_cp_2_and_4_equals_cp_1() {
    assert_equivalent("GPT", &gpt(), &[every_comm(2), every_comm(4)].concat(), 16);
}

#[test]
fn llama_at_cp_2_and_4_equals_cp_1() {
    assert_equivalent(
        "Llama",
        &llama(),
        &[every_comm(2), every_comm(4)].concat(),
        16,
    );
}

#[test]
fn chunks_of_one_token_equal_cp_1() {
    assert_equivalent("GPT", &gpt(), &every_comm(4), 8);
    assert_equivalent("Llama", &llama(), &every_comm(2), 4);
}

#[test]
fn cp_2_with_tp_2_and_sequence_parallelism_equals_cp_1() {
    let layouts: Vec<Layout> = COMMS
        .into_iter()
        .flat_map(|comm| {
            [false, true].map(|sp| Layout {
                tp: 2,
                cp: 2,
                dp: 1,
                sp,
                comm,
            })
        })
        .collect();
    assert_equivalent("GPT", &gpt(), &layouts, 16);
    assert_equivalent("Llama", &llama(), &layouts, 16);
}

/// QK-norm: each rank normalises its chunks' query and key heads before RoPE at their global
/// positions; the norms' gradients sum over TP (heads) and CP (tokens). Also with heads wider
/// than hidden / heads.
#[test]
fn llama_with_qk_norm_at_cp_2_equals_cp_1() {
    let layouts = [
        Layout::cp(2, CpCommType::P2p),
        Layout {
            tp: 2,
            sp: true,
            ..Layout::cp(2, CpCommType::A2a)
        },
    ];
    let config = llama().with_qk_layernorm(true);
    assert_equivalent("Llama with QK-norm", &config, &layouts, 16);
    // Heads twice as wide as hidden / heads (`kv_channels`, as Qwen3's).
    let wide = config.clone().with_kv_channels(Some(2 * config.head_dim()));
    assert_equivalent("Llama with QK-norm and wide heads", &wide, &layouts, 16);
}

#[test]
fn cp_2_with_dp_2_equals_cp_1() {
    let layouts = [CpCommType::P2p, CpCommType::AllGather].map(|comm| Layout {
        dp: 2,
        ..Layout::cp(2, comm)
    });
    assert_equivalent("GPT", &gpt(), &layouts, 16);
    assert_equivalent("Llama", &llama(), &layouts, 16);
}

/// FP8 (the CPU emulation, which casts to FP8's values): each rank holds part of every
/// sequence, so the amaxes of the layers' inputs and output gradients are reduced over CP
/// (and over TP too where split), and every rank casts with CP = 1's scales. Delayed scaling
/// casts a single batch with its initial scales, and its amaxes go through the same
/// reductions.
#[test]
fn fp8_at_cp_2_and_4_equals_cp_1() {
    let layouts = [
        Layout::cp(2, CpCommType::P2p),
        Layout::cp(4, CpCommType::AllGather),
        Layout {
            tp: 2,
            sp: true,
            ..Layout::cp(2, CpCommType::A2a)
        },
    ];
    for recipe in [Fp8Recipe::Tensorwise, Fp8Recipe::Delayed] {
        let fp8 = Some(Fp8Config::new().with_recipe(recipe));
        let name = |model: &str| format!("{model} in FP8 ({recipe:?})");
        let gpt = gpt().with_fp8(fp8.clone());
        assert_equivalent(&name("GPT"), &gpt, &layouts, 16);
        assert_equivalent(&name("Llama"), &llama().with_fp8(fp8), &layouts, 16);
    }
}
