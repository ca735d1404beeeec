//! Generation over pipeline stages (`generate_pipelined`) against the whole model at TP 1:
//! the same tokens on every rank, at PP 2 × TP 1 and PP 2 × TP 2, greedy and sampled; a stage
//! given to `generate` is an error.

use burn_megatron::inference::{GenerationConfig, Sampling, generate, generate_pipelined};
use burn_megatron::pipeline_parallel::StageSplit;
use burn_megatron::transformer::TransformerConfig;
use burn_megatron::{ConfigError, Error};
use burn_megatron_dist::ParallelSizes;

use crate::{B, greedy, on_ranks, prompts, run, tokens};

fn sampled() -> GenerationConfig {
    GenerationConfig::greedy(9).with_sampling(Sampling::Random {
        temperature: 0.8,
        top_k: None,
        top_p: Some(0.9),
        seed: 5,
    })
}

/// `tokens` of every rank of PP = 2 × TP = `tp` for `generation`.
fn pipelined(
    config: &TransformerConfig,
    tp: usize,
    generation: &GenerationConfig,
) -> Vec<Vec<Vec<i64>>> {
    run(2 * tp, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(tp).with_pp(2))?;
        let stage = StageSplit::even(config.num_layers, 2)?.stage(state.pp_rank());
        let model = config.init_gpt_stage::<B>(state.tp(), &stage, &Default::default())?;
        Ok(tokens(&generate_pipelined(
            &model,
            state.pp(),
            &prompts(),
            generation,
        )?))
    })
}

#[test]
fn pipelined_generation_equals_the_whole_model() {
    for config in [crate::gpt(), crate::llama()] {
        for generation in [greedy(), sampled()] {
            let whole = on_ranks(&config, 1, |model| {
                Ok(tokens(&generate(model, &prompts(), &generation)?))
            })
            .remove(0);
            for tp in [1, 2] {
                for (rank, got) in pipelined(&config, tp, &generation).iter().enumerate() {
                    assert_eq!(got, &whole, "PP 2 x TP {tp} rank {rank}");
                }
            }
        }
    }
}

#[test]
fn a_stage_without_its_pipeline_is_an_error() {
    let config = crate::llama();
    let errors = run(2, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_pp(2))?;
        let stage = StageSplit::even(config.num_layers, 2)?.stage(state.pp_rank());
        let model = config.init_gpt_stage::<B>(state.tp(), &stage, &Default::default())?;
        Ok(generate(&model, &prompts(), &greedy()).expect_err("a stage alone is refused"))
    });
    for error in errors {
        assert!(
            matches!(&error, Error::Config(ConfigError::Invalid(m)) if m.contains("generate_pipelined")),
            "{error:?}"
        );
    }
}
