//! Prompts generation cannot take, and invalid sampling parameters: each a typed error with a
//! message, on every rank, before any work.

use burn_megatron::inference::{GenerationConfig, Sampling, generate};
use burn_megatron::{ConfigError, Error, IdKind, InputError};

use crate::{greedy, on_ranks};

fn error_of(prompts: Vec<Vec<i64>>, config: GenerationConfig) -> Vec<Error> {
    on_ranks(&crate::llama(), 2, move |model| {
        Ok(generate(model, &prompts, &config).expect_err("the input must be refused"))
    })
}

#[test]
fn an_empty_prompt_is_an_error() {
    for error in error_of(vec![vec![1, 2], vec![]], greedy()) {
        assert!(
            matches!(error, Error::Input(InputError::EmptyPrompt { index: 1 })),
            "{error:?}"
        );
        assert!(error.to_string().contains("prompt 1 is empty"), "{error}");
    }
}

#[test]
fn a_prompt_longer_than_the_maximum_is_an_error() {
    for error in error_of(vec![vec![1; 13]], greedy()) {
        assert!(
            matches!(
                error,
                Error::Input(InputError::SequenceTooLong { len: 13, max: 12 })
            ),
            "{error:?}"
        );
    }
}

#[test]
fn a_token_outside_the_vocabulary_is_an_error() {
    for bad in [50, 1000, -1] {
        for error in error_of(vec![vec![1, 2], vec![3, bad, 4]], greedy()) {
            assert!(
                matches!(
                    error,
                    Error::Input(InputError::IdOutOfRange { kind: IdKind::Token, id, vocab_size: 50 })
                        if id == bad
                ),
                "{bad}: {error:?}"
            );
        }
    }
}

#[test]
fn invalid_sampling_parameters_are_errors() {
    let sampling = |temperature, top_k, top_p| {
        greedy().with_sampling(Sampling::Random {
            temperature,
            top_k,
            top_p,
            seed: 0,
        })
    };
    for config in [
        sampling(0.0, None, None),
        sampling(1.0, Some(0), None),
        sampling(1.0, None, Some(0.0)),
        sampling(1.0, None, Some(1.5)),
    ] {
        let error = error_of(vec![vec![1]], config.clone()).remove(0);
        assert!(
            matches!(error, Error::Config(ConfigError::Invalid(_))),
            "{config:?}: {error:?}"
        );
    }
}
