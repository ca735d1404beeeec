//! Vocabulary-parallel cross-entropy equals the plain one, values and gradients, with ignored
//! labels and a padded vocabulary.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full};
use burn_megatron::tensor_parallel::{VocabPartition, masked_mean, vocab_parallel_cross_entropy};

use crate::{AD, assert_close, data_values, run, tolerance};

const VOCAB: usize = 10;

/// `[2, 3, 12]` logits: 10 real entries and 2 of padding (which hold values, to show they
/// are ignored).
fn logits() -> Tensor<AD, 3> {
    init_full(
        [2, 3, 12],
        InitDistribution::Normal { std: 3.0 },
        5,
        &Default::default(),
    )
}

fn targets() -> Tensor<AD, 2, Int> {
    Tensor::from_data(
        TensorData::new(vec![3i64, -100, 9, 0, 7, -100], [2, 3]),
        &Default::default(),
    )
}

#[test]
fn equals_the_plain_cross_entropy_with_padding_and_ignored_labels() {
    // Single device: log-softmax over the real vocabulary only.
    let (ref_losses, ref_mean, ref_grad) = {
        let logits = logits().require_grad();
        let log_probs = log_softmax(logits.clone().narrow(2, 0, VOCAB), 2);
        let keep = targets().greater_equal_elem(0);
        let picked = log_probs
            .gather(2, targets().clamp_min(0).unsqueeze_dim::<3>(2))
            .squeeze_dim::<2>(2);
        let losses = picked.neg();
        let mean = masked_mean(losses.clone(), keep);
        let grad = logits.grad(&mean.backward()).unwrap();
        (
            data_values(&losses.into_data()),
            mean.into_scalar(),
            data_values(&grad.into_data()),
        )
    };
    for tp in [1, 2, 4] {
        let results = run(tp, |ctx| {
            let group = ctx.world();
            let vocab = VocabPartition::new(VOCAB, 3, tp, group.rank())?;
            assert_eq!(vocab.padded_size, 12);
            let range = vocab.range();
            let local = logits().narrow(2, range.start, range.len()).require_grad();
            let losses = vocab_parallel_cross_entropy(local.clone(), targets(), &vocab, group)?;
            let mean = masked_mean(losses.clone(), targets().greater_equal_elem(0));
            let grad = local.grad(&mean.clone().backward()).unwrap();
            let grad = group.all_gather(grad, 2)?;
            Ok((
                data_values(&losses.into_data()),
                mean.into_scalar(),
                data_values(&grad.into_data()),
            ))
        });
        for (losses, mean, grad) in results {
            // Ignored positions hold a meaningless value; compare the kept ones.
            for i in [0, 2, 3, 4] {
                assert_close(
                    &format!("TP={tp} loss of token {i}"),
                    &[losses[i]],
                    &[ref_losses[i]],
                    tolerance::F32,
                );
            }
            let (mean, ref_mean) = (mean as f64, ref_mean as f64);
            assert_close(
                &format!("TP={tp} mean"),
                &[mean],
                &[ref_mean],
                tolerance::F32_SAME_ORDER,
            );
            assert_close(
                &format!("TP={tp} gradient"),
                &grad,
                &ref_grad,
                tolerance::F32_SAME_ORDER,
            );
            // Padded entries and ignored tokens get no gradient.
            for (i, g) in grad.iter().enumerate() {
                let (token, entry) = (i / 12, i % 12);
                if entry >= VOCAB || token == 1 || token == 5 {
                    assert_eq!(*g, 0.0, "TP={tp}: entry {entry} of token {token}");
                }
            }
        }
    }
}
