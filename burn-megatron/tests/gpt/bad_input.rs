//! Invalid input is an error with a message, never a plausible number: token and target ids
//! outside the vocabulary, and a collective that fails inside the backward pass.

use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::{Error, IdKind, InputError};
use burn_megatron_dist::ParallelSizes;

use crate::{AD, run, tokens};

/// `[1, 8]` ids: valid ones with `bad` at position 5.
fn ids_with(bad: i64, vocab: usize) -> Tensor<AD, 2, Int> {
    let mut ids: Vec<i64> = (0..8).map(|i| (i * 7 % vocab) as i64).collect();
    ids[5] = bad;
    Tensor::from_data(TensorData::new(ids, [1, 8]), &Default::default())
}

/// Runs a forward pass and the loss at TP = `tp` and returns rank 0's error.
fn error_of(tp: usize, input: i64, target: i64) -> Error {
    let config = crate::small_gpt();
    let vocab = config.vocab_size;
    run(tp, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp))?;
        let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let outcome = model
            .try_forward(ids_with(input, vocab))
            .and_then(|logits| model.loss(logits, ids_with(target, vocab)));
        Ok(outcome.expect_err("invalid ids must be refused"))
    })
    .remove(0)
}

#[test]
fn token_ids_outside_the_vocabulary_are_errors() {
    let vocab = crate::small_gpt().vocab_size as i64;
    for tp in [1, 2] {
        // The vocabulary size itself reads a padding row; past the padded size, and negative
        // ids, read a zero embedding. Each gave a plausible loss before.
        for bad in [vocab, vocab + 3, 1000, -1, -100] {
            let error = error_of(tp, bad, 1);
            assert!(
                matches!(
                    error,
                    Error::Input(InputError::IdOutOfRange { kind: IdKind::Token, id, vocab_size: 50 }) if id == bad
                ),
                "TP={tp} token {bad}: {error:?}"
            );
            let message = error.to_string();
            assert_eq!(
                message,
                format!(
                    "token id {bad} is outside the vocabulary of 50 tokens: \
                     token ids must be in 0..50"
                ),
                "TP={tp}"
            );
        }
    }
}

#[test]
fn target_ids_outside_the_vocabulary_are_errors() {
    let vocab = crate::small_gpt().vocab_size as i64;
    for tp in [1, 2] {
        // A target of the vocabulary size gave an infinite loss with finite gradients.
        for bad in [vocab, vocab + 1, 1000] {
            let error = error_of(tp, 1, bad);
            assert!(
                matches!(
                    error,
                    Error::Input(InputError::IdOutOfRange { kind: IdKind::Target, id, vocab_size: 50 }) if id == bad
                ),
                "TP={tp} target {bad}: {error:?}"
            );
            assert!(
                error.to_string().starts_with(&format!(
                    "target id {bad} is outside the vocabulary of 50 tokens: \
                     target ids must be below 50"
                )),
                "TP={tp}: {error}"
            );
        }
    }
}

/// Negative targets still mean "ignore this position": the loss equals the mean over the
/// other positions, and is finite.
#[test]
fn negative_targets_are_ignored_not_refused() {
    let config = crate::small_gpt();
    let vocab = config.vocab_size;
    let losses = run(1, |ctx| {
        let model = config.init_gpt::<AD>(ctx.world(), &Default::default())?;
        let input = tokens(1, 8, vocab, 3);
        let targets = tokens(1, 8, vocab, 4);
        let logits = model.try_forward(input.clone())?;
        let per_token: Vec<f32> = model
            .token_losses(logits.clone(), targets.clone())?
            .into_data()
            .to_vec()
            .expect("f32 losses");
        let ignored = targets.slice_assign(
            [0..1, 5..6],
            Tensor::from_data(TensorData::new(vec![-100i64], [1, 1]), &Default::default()),
        );
        let loss = model.loss(logits, ignored)?.into_scalar();
        let kept: f32 = per_token
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 5)
            .map(|(_, l)| l)
            .sum::<f32>()
            / 7.0;
        Ok((loss as f64, kept as f64))
    });
    let (loss, kept) = losses[0];
    burn_megatron_testing::assert_close(
        "loss with an ignored target",
        &[loss],
        &[kept],
        burn_megatron_testing::tolerance::F32,
    );
}

/// A collective that fails inside the backward pass (here: the peer stopped after the
/// forward pass) is recorded on its group, and `backward_failure` returns it as an error:
/// no panic.
#[test]
fn a_collective_that_fails_in_backward_is_an_error() {
    let config = crate::small_gpt();
    let vocab = config.vocab_size;
    let failure = burn_megatron_dist::launch(
        burn_megatron_dist::LaunchConfig::new(2).with_timeout(std::time::Duration::from_secs(30)),
        |ctx| {
            let state = ctx.parallel_state(ParallelSizes::default().with_tp(2))?;
            let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
            let (input, targets) = (tokens(2, 8, vocab, 1), tokens(2, 8, vocab, 2));
            if ctx.rank() == 1 {
                let logits = model.try_forward(input)?;
                model.loss(logits, targets)?;
                return Err::<(), Box<dyn std::error::Error + Send + Sync>>(
                    "rank 1 stops before its backward pass".into(),
                );
            }
            let loss = model.loss(model.try_forward(input)?, targets)?;
            let _ = loss.backward();
            state.tp().backward_failure()?;
            Ok(())
        },
    )
    .expect_err("rank 0's backward pass cannot complete");
    let (rank, message) = &failure.failures[0];
    assert_eq!(*rank, 0, "{:?}", failure.failures);
    assert!(!message.contains("panicked"), "rank 0 panicked: {message}");
    assert!(
        message.contains("rank 1 failed: rank 1 stops before its backward pass"),
        "rank 0: {message}"
    );
}
