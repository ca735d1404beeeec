//! The dispatchers handing the experts blocks of one size ([`BlockPadding::Always`]: each
//! local expert's tokens followed by zero rows, the layout our CUDA backend runs as one
//! strided-batched GEMM a product) against the single-device layer with its blocks as they
//! are: outputs, losses and every gradient at EP 1, 2 and 4, by all-to-all and by
//! all-gather, with starved experts, with a capacity (dropping, padded to it or not); and the
//! layout itself, row by row.

use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::transformer::Activation;
use burn_megatron::transformer::moe::{
    BlockPadding, ExpertCapacity, MoeConfig, TokenDispatcher, TokenDispatcherType, TokenDropPolicy,
};
use burn_megatron_dist::ParallelSizes;

use crate::expert_parallel::{Routing, assert_equivalent, config};
use crate::{B, assert_close, run, tolerance, values};

const HIDDEN: usize = 3;
const EXPERTS: usize = 4;

fn padded(config: MoeConfig) -> MoeConfig {
    config.with_block_padding(BlockPadding::Always)
}

#[test]
fn padded_blocks_equal_one_device() {
    assert_equivalent(
        "padded top-2 SwiGLU shared",
        &padded(config(2, Activation::SwiGlu, true)),
        Routing::Free,
    );
    assert_equivalent(
        "padded top-1 GeLU starved",
        &padded(config(1, Activation::Gelu, false)),
        Routing::StarveExperts23,
    );
    // Two local experts even at EP 4, so every size pads.
    let eight = MoeConfig {
        num_experts: 8,
        ..config(2, Activation::SwiGlu, false)
    };
    assert_equivalent(
        "padded top-2 eight experts",
        &padded(eight.clone()),
        Routing::Free,
    );
    let gathering =
        |config: MoeConfig| padded(config).with_token_dispatcher(TokenDispatcherType::AllGather);
    assert_equivalent(
        "all-gather padded top-2 SwiGLU shared",
        &gathering(config(2, Activation::SwiGlu, true)),
        Routing::Free,
    );
    assert_equivalent(
        "all-gather padded top-1 GeLU starved",
        &gathering(config(1, Activation::Gelu, false)),
        Routing::StarveExperts23,
    );
    assert_equivalent(
        "all-gather padded top-2 eight experts",
        &gathering(eight),
        Routing::Free,
    );
}

#[test]
fn padded_blocks_with_a_capacity_equal_one_device() {
    for (policy, pad) in [
        (TokenDropPolicy::Probs, false),
        (TokenDropPolicy::Position, true),
    ] {
        let capacity = ExpertCapacity::new(0.5)
            .with_drop_policy(policy)
            .with_pad_to_capacity(pad);
        for kind in [
            TokenDispatcherType::AllToAll,
            TokenDispatcherType::AllGather,
        ] {
            let config = config(2, Activation::SwiGlu, true)
                .with_capacity(Some(capacity))
                .with_token_dispatcher(kind);
            assert_equivalent(
                &format!("{kind:?} padded top-2 {policy:?} 0.5 pad {pad}"),
                &padded(config),
                Routing::Free,
            );
        }
    }
}

/// Three tokens, top-2, experts `[0, 1]`, `[1, 3]`, `[2, 1]` (counts `[1, 3, 1, 1]`) on
/// every rank: by either dispatcher, each padded block holds the rows of the unpadded plan's
/// block, then zeros, in blocks of 8 rows (the largest block, 3 rows at EP 1 and 6 at EP 2,
/// rounded up to 8); the combine of those rows gives the unpadded combine's output.
#[test]
fn padded_blocks_hold_the_blocks_rows_then_zeros() {
    for kind in [
        TokenDispatcherType::AllToAll,
        TokenDispatcherType::AllGather,
    ] {
        for ep in [1, 2] {
            run(ep, |ctx| {
                let state = ctx.parallel_state(ParallelSizes::default().with_ep(ep))?;
                let at = format!("{kind:?} EP {ep}");
                let plain = TokenDispatcher::new(state.ep(), EXPERTS, kind);
                let padded = plain.clone().with_block_padding(BlockPadding::Always);
                let device = Default::default();
                let experts = Tensor::<B, 2, Int>::from_data(
                    TensorData::new(vec![0i64, 1, 1, 3, 2, 1], [3, 2]),
                    &device,
                );
                let counts = || {
                    Tensor::<B, 1, Int>::from_data(
                        TensorData::new(vec![1i64, 3, 1, 1], [4]),
                        &device,
                    )
                };
                let tokens = Tensor::<B, 2>::from_data(
                    TensorData::new((1..=9).map(|v| v as f32).collect(), [3, HIDDEN]),
                    &device,
                );
                let weights = Tensor::<B, 2>::from_data(
                    TensorData::new(vec![0.25f32, 0.75, 0.5, 0.5, 0.125, 0.875], [3, 2]),
                    &device,
                );
                let p = plain.plan(experts.clone(), counts())?;
                let q = padded.plan(experts, counts())?;
                assert_eq!(p.padded_rows, None, "{at}: the CPU backend pads nothing");
                assert_eq!(q.padded_rows, Some(8), "{at}");
                assert_eq!(q.local_counts, p.local_counts);
                assert_eq!(q.expert_rows(), 8 * EXPERTS / ep);
                let a = plain.dispatch(&p, tokens.clone())?;
                let b = padded.dispatch(&q, tokens)?;
                assert_eq!(b.dims(), [q.expert_rows(), HIDDEN], "{at}");
                let (rows_a, rows_b) = (values(a.clone()), values(b.clone()));
                let mut start = 0;
                for (j, &count) in p.local_counts.iter().enumerate() {
                    let block = &rows_b[j * 8 * HIDDEN..(j + 1) * 8 * HIDDEN];
                    let (tokens, zeros) = block.split_at(count * HIDDEN);
                    assert_eq!(
                        tokens,
                        &rows_a[start * HIDDEN..(start + count) * HIDDEN],
                        "{at} expert {j}: the block's tokens"
                    );
                    assert!(
                        zeros.iter().all(|&v| v == 0.0),
                        "{at} expert {j}: padding {zeros:?}"
                    );
                    start += count;
                }
                assert!(rows_a[start * HIDDEN..].iter().all(|&v| v == 0.0));
                let want = plain.combine(&p, a, weights.clone())?;
                let got = padded.combine(&q, b, weights)?;
                assert_close(
                    &format!("{at}: combined"),
                    &values(got),
                    &values(want),
                    tolerance::F32,
                );
                Ok(())
            });
        }
    }
}
