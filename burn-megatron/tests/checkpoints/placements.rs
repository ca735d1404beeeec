//! Every parameter's placement is declared by its layer.

use burn_megatron::tensor_parallel::{ParamPlacement, try_param_infos};
use burn_megatron_dist::{ParallelSizes, Placement};

use crate::{AD, run, tiny_gpt, tiny_llama};

#[test]
fn every_parameter_is_declared_by_its_layer() {
    run(2, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(2))?;
        for config in [
            tiny_gpt(),
            tiny_llama(),
            tiny_gpt().with_tie_embeddings(false),
        ] {
            let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
            for info in try_param_infos(&model)? {
                let p = info.placement;
                let expected = match info.path.rsplit('.').take(2).collect::<Vec<_>>()[..] {
                    ["weight", "qkv" | "fc1" | "gate"] | ["bias", "qkv" | "fc1" | "gate"] => {
                        Placement::Shard(info.shape.len() - 1)
                    }
                    ["weight", "output" | "fc2"] if info.path.contains("block") => {
                        Placement::Shard(0)
                    }
                    ["weight", "embedding" | "output"] => Placement::Shard(0),
                    _ => Placement::Replicate,
                };
                assert_eq!(p.placement, expected, "{}", info.path);
                if p.placement != Placement::Replicate {
                    assert_eq!((p.rank, p.parts), (state.tp().rank(), 2), "{}", info.path);
                }
                if info.path == "embedding.weight" || info.path == "output.weight" {
                    // 50 tokens padded to 56 over TP = 2.
                    assert_eq!(p.padding, 6);
                    assert_eq!(info.global_shape(), vec![50, 16]);
                    assert_eq!(p.local_range(28), ctx.rank() * 28..(ctx.rank() + 1) * 28);
                }
            }
        }
        assert!(ParamPlacement::replicated().is_replicated());
        Ok(())
    });
}
