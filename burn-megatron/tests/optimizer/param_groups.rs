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

/// The groups with Burn's optimizers: SGD with weight decay steps the decayed group, SGD
/// without steps the exempt one. A weight moves by `-lr (g + wd · w)`, a bias or a norm by
/// `-lr g`.
#[test]
fn two_optimizers_apply_the_policy() {
    use burn::optim::decay::WeightDecayConfig;
    use burn::optim::{Optimizer, SgdConfig};
    use burn_megatron::tensor_parallel::gather_full_params;

    use crate::{assert_close, data_values, tolerance};

    let (lr, wd) = (0.1, 0.5);
    run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let model = tiny_gpt().init_gpt::<AD>(state.tp(), &Default::default())?;
        let groups = WeightDecayPolicy::default().groups(&model);
        let (_, grads) = forward_backward_no_pipelining(&model, &microbatches(1, 50, 0))?;
        let expected_grads: Vec<(String, Vec<f64>)> = groups
            .decay
            .iter()
            .chain(&groups.no_decay)
            .map(|p| (p.path.clone(), grad_values(&grads, p)))
            .collect();
        let before = gather_full_params(&model, state.tp())?;
        let (decay, exempt) = groups.split(&model, grads);
        let mut with_decay = SgdConfig::new()
            .with_weight_decay(Some(WeightDecayConfig::new(wd as f32)))
            .init();
        let mut without = SgdConfig::new().init();
        let model = with_decay.step(lr, model, decay);
        let model = without.step(lr, model, exempt);
        let after = gather_full_params(&model, state.tp())?;
        for ((path, old), (_, new)) in before.iter().zip(&after) {
            let grad = &expected_grads.iter().find(|(p, _)| p == path).unwrap().1;
            let decays = groups.decay.iter().any(|p| &p.path == path);
            let want: Vec<f64> = data_values(old)
                .iter()
                .zip(grad)
                .map(|(w, g)| w - lr * (g + if decays { wd * w } else { 0.0 }))
                .collect();
            assert_close(path, &data_values(new), &want, tolerance::F32);
        }
        Ok(())
    });
}

/// The gradient of parameter `p`, whatever its rank.
fn grad_values(
    grads: &burn::optim::GradientsParams,
    p: &burn_megatron::tensor_parallel::ParamInfo,
) -> Vec<f64> {
    use crate::values;
    match p.shape.len() {
        1 => values(grads.get::<crate::B, 1>(p.id).unwrap()),
        2 => values(grads.get::<crate::B, 2>(p.id).unwrap()),
        3 => values(grads.get::<crate::B, 3>(p.id).unwrap()),
        rank => panic!("{}: rank {rank}", p.path),
    }
}
