//! The experts with every block padded with zero rows to one size
//! ([`GroupedExperts::forward_padded`], what our CUDA backend runs for many small experts, as
//! one strided-batched GEMM a product) against the blocks as they are: the output, the tokens'
//! gradient and every weight's, SwiGLU and GeLU experts, experts without tokens, a block that
//! fills the padded size; and the rule that picks the size.

use burn::tensor::Tensor;
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::ops::grouped_linear::{PADDED_ROWS_MULTIPLE, padded_block_rows};
use burn_megatron::transformer::Activation;
use burn_megatron::transformer::moe::{GroupedExperts, GroupedExpertsConfig};
use burn_megatron_testing::assert_near_zero;

use crate::{AD, B, assert_close, tolerance, values};

const HIDDEN: usize = 6;

fn experts(activation: Activation, count: usize) -> GroupedExperts<AD> {
    GroupedExpertsConfig::new(HIDDEN, 5, count)
        .with_activation(activation)
        .with_init_std(0.5)
        .init(0..count, 7, "experts", &Default::default())
}

/// `[output, tokens' gradient (the real rows), fc1's, gate's (if any), fc2's]` of
/// `Σ probe ∘ experts(tokens)`, the blocks padded to `padded` rows or as they are. The tokens
/// end with the dispatcher's zero row.
fn run(experts: &GroupedExperts<AD>, counts: &[usize], padded: Option<usize>) -> Vec<Vec<f64>> {
    let total: usize = counts.iter().sum();
    let device = Default::default();
    let normal = |shape: [usize; 2], seed| {
        init_full::<B, 2>(shape, InitDistribution::Normal { std: 1.0 }, seed, &device)
    };
    let rows = Tensor::cat(
        vec![
            normal([total, HIDDEN], 1),
            Tensor::zeros([1, HIDDEN], &device),
        ],
        0,
    );
    let tokens = Tensor::<AD, 2>::from_inner(rows).require_grad();
    let probe = Tensor::<AD, 2>::from_inner(normal([total + 1, HIDDEN], 2));
    let y = match padded {
        Some(rows) => experts.forward_padded(tokens.clone(), counts, rows),
        None => experts.forward(tokens.clone(), counts),
    };
    let grads = (y.clone() * probe).sum().backward();
    let dx = tokens.grad(&grads).expect("the tokens have a gradient");
    let mut out = vec![values(y.inner()), values(dx.narrow(0, 0, total))];
    let weights = [
        Some(&experts.fc1),
        experts.gate.as_ref(),
        Some(&experts.fc2),
    ];
    for weight in weights.into_iter().flatten() {
        out.push(values(weight.grad(&grads).expect("a weight's gradient")));
    }
    out
}

#[test]
fn padded_blocks_give_the_unpadded_experts() {
    let cases: [(&[usize], usize); 4] = [
        (&[3, 5, 2, 4], 8),
        (&[0, 5, 0, 4], 8),
        (&[3, 0, 1, 6, 2], 16),
        (&[8, 8, 8], 8),
    ];
    for activation in [Activation::SwiGlu, Activation::Gelu] {
        for (counts, rows) in cases {
            let layer = experts(activation, counts.len());
            let want = run(&layer, counts, None);
            let got = run(&layer, counts, Some(rows));
            let names = [
                "y",
                "dx",
                "d first weight",
                "d second weight",
                "d third weight",
            ];
            for (name, (got, want)) in names.iter().zip(got.iter().zip(&want)) {
                assert_close(
                    &format!("{name} ({activation:?}, counts {counts:?}, rows {rows})"),
                    got,
                    want,
                    tolerance::F32,
                );
            }
            let total: usize = counts.iter().sum();
            let last_row = &got[0][total * HIDDEN..];
            assert_near_zero("the zero row's output", last_row, 0.0);
            // An expert without tokens: a zero gradient, as unpadded.
            let per_expert = HIDDEN * 5;
            for (e, _) in counts.iter().enumerate().filter(|(_, c)| **c == 0) {
                let dw = &got[2][e * per_expert..(e + 1) * per_expert];
                assert_near_zero(&format!("dw[{e}] (counts {counts:?})"), dw, 0.0);
            }
        }
    }
}

#[test]
#[should_panic(expected = "blocks of 4 rows for counts [3, 5]")]
fn blocks_smaller_than_a_count_are_refused() {
    let layer = experts(Activation::SwiGlu, 2);
    run(&layer, &[3, 5], Some(4));
}

#[test]
fn the_padded_size_is_the_largest_count_rounded_up_where_it_costs_little() {
    assert_eq!(PADDED_ROWS_MULTIPLE, 8);
    // 64 experts of about 192 rows: 200 rows each, 1.04 times the rows.
    let even: Vec<usize> = (0..64).map(|e| 185 + e % 10).collect();
    assert_eq!(padded_block_rows(&even, 2.0), Some(200));
    // One expert with 4 times the mean: 4 × 64 × 192 rows would be padded.
    let mut skewed = vec![192; 64];
    skewed[0] = 768;
    assert_eq!(padded_block_rows(&skewed, 2.0), None);
    assert_eq!(padded_block_rows(&skewed, 4.0), Some(768));
    // Exactly a multiple: no rounding; a single row: one multiple.
    assert_eq!(padded_block_rows(&[16, 16], 1.0), Some(16));
    assert_eq!(padded_block_rows(&[1, 0], 16.0), Some(8));
    // Nothing to pad: fewer than two experts, or no rows.
    assert_eq!(padded_block_rows(&[100], 10.0), None);
    assert_eq!(padded_block_rows(&[0, 0], 10.0), None);
    assert_eq!(padded_block_rows(&[], 10.0), None);
}
