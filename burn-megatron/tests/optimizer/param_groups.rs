//! The weight-decay policy: biases and norms are exempt by default, and the split of the
//! gradients gives each group exactly its parameters' gradients.

use burn_megatron::optimizer::{ParamKind, WeightDecayPolicy};
use burn_megatron::pipeline_parallel::forward_backward_no_pipelining;
use burn_megatron_dist::ParallelSizes;

use crate::{AD, microbatches, run, tiny_gpt};

#[test]
fn biases_and_norms_are_exempt_by_default() {
    run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let model = tiny_gpt().init_gpt::<AD>(state.tp(), &Default::default())?;
        let groups = WeightDecayPolicy::default().groups(&model);
        let paths = |g: &[burn_megatron::tensor_parallel::ParamInfo]| -> Vec<String> {
            g.iter().map(|p| p.path.clone()).collect()
        };
        let (decay, exempt) = (paths(&groups.decay), paths(&groups.no_decay));
        for path in &exempt {
            let name = path.rsplit('.').next().unwrap();
            assert!(
                ["bias", "scale", "shift"].contains(&name),
                "{path} should decay"
            );
        }
        for path in &decay {
            assert!(
                path.ends_with("weight") || path == "position_embedding",
                "{path}"
            );
        }
        assert!(
            exempt.iter().any(|p| p == "block.final_norm.scale"),
            "{exempt:?}"
        );
        assert!(
            exempt.iter().any(|p| p.ends_with("mlp.fc2.bias")),
            "{exempt:?}"
        );
        assert!(decay.iter().any(|p| p == "embedding.weight"), "{decay:?}");
        assert!(decay.iter().any(|p| p == "position_embedding"), "{decay:?}");
        assert_eq!(decay.len() + exempt.len(), groups_total(&model));

        // Decaying biases and norms too leaves nothing exempt.
        let all = WeightDecayPolicy::new()
            .with_decay_biases(true)
            .with_decay_norms(true)
            .groups(&model);
        assert!(all.no_decay.is_empty());

        // The split moves exactly the exempt parameters' gradients.
        let (_, grads) = forward_backward_no_pipelining(&model, &microbatches(1, 50, 0))?;
        let total = grads.len();
        let (decay_grads, exempt_grads) = groups.split(&model, grads);
        assert_eq!(exempt_grads.len(), groups.no_decay.len());
        assert_eq!(decay_grads.len(), total - groups.no_decay.len());
        for p in &groups.no_decay {
            assert!(
                exempt_grads.get::<crate::B, 1>(p.id).is_some(),
                "{}",
                p.path
            );
        }
        Ok(())
    });
}

fn groups_total(model: &burn_megatron::models::GptModel<AD>) -> usize {
    burn_megatron::tensor_parallel::param_infos(model).len()
}

#[test]
fn kinds_follow_the_path_and_rank() {
    assert_eq!(
        ParamKind::of("block.layers.0.mlp.fc1.bias", &[32]),
        ParamKind::Bias
    );
    assert_eq!(
        ParamKind::of("block.final_norm.scale", &[16]),
        ParamKind::Norm
    );
    assert_eq!(
        ParamKind::of("block.layers.0.mlp.fc1.weight", &[16, 32]),
        ParamKind::Weight
    );
    assert_eq!(
        ParamKind::of("position_embedding", &[8, 16]),
        ParamKind::Weight
    );
}
