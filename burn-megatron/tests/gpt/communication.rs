//! How many collectives a tensor-parallel MLP starts: SwiGLU's gate and up projections share
//! one entry into the tensor-parallel region, as GeLU's single `fc1` does.

use burn::tensor::{Distribution, Tensor};
use burn_megatron::transformer::{Activation, ParallelMlp};
use burn_megatron_dist::ParallelSizes;

use crate::{AD, run};

/// The collectives one forward and one backward pass of layer 0's MLP start on TP 2, for
/// `activation`, with and without sequence parallelism: `[(forward, backward)]`.
fn mlp_collectives(activation: Activation, sequence_parallel: bool) -> (u64, u64) {
    let config = crate::small_llama()
        .with_activation(activation)
        .with_sequence_parallel(sequence_parallel);
    let counts = run(2, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(2))?;
        let mlp = ParallelMlp::<AD>::new(&config, 0, state.tp(), &Default::default())
            .expect("a valid MLP");
        let seq = match sequence_parallel {
            true => config.max_sequence_length / 2,
            false => config.max_sequence_length,
        };
        let x = Tensor::<AD, 3>::random(
            [2, seq, config.hidden_size],
            Distribution::Uniform(-1.0, 1.0),
            &Default::default(),
        )
        .require_grad();
        let tp = state.tp();
        let before = tp.collectives_started();
        let y = mlp.try_forward(x.clone())?;
        let forward = tp.collectives_started() - before;
        let grads = y.sum().backward();
        assert!(x.grad(&grads).is_some(), "the input has a gradient");
        let backward = tp.collectives_started() - before - forward;
        Ok((forward, backward))
    });
    assert_eq!(
        counts[0], counts[1],
        "both TP ranks start the same collectives"
    );
    counts[0]
}

#[test]
fn a_swiglu_mlp_communicates_as_much_as_a_gelu_mlp() {
    for sequence_parallel in [false, true] {
        let gelu = mlp_collectives(Activation::Gelu, sequence_parallel);
        let swiglu = mlp_collectives(Activation::SwiGlu, sequence_parallel);
        // Without SP: the output's all-reduce forward, the input's all-reduce backward.
        // With SP: all-gather and reduce-scatter forward, the reverse backward.
        let want = match sequence_parallel {
            false => (1, 1),
            true => (2, 2),
        };
        assert_eq!(
            gelu, want,
            "GeLU MLP, sequence parallel {sequence_parallel}"
        );
        assert_eq!(
            swiglu, want,
            "SwiGLU MLP, sequence parallel {sequence_parallel}"
        );
    }
}
