//! How many collectives a tensor-parallel MLP starts: SwiGLU's gate and up projections share
//! one entry into the tensor-parallel region, as GeLU's single `fc1` does.

use burn::optim::GradientsParams;
use burn::tensor::{Distribution, Tensor};
use burn_megatron::tensor_parallel::{
    SequenceParallelGrads, param_infos, sum_sequence_parallel_grads,
};
use burn_megatron::transformer::{Activation, ParallelMlp};
use burn_megatron_dist::ParallelSizes;

use crate::{AD, B, run};

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

/// Collectives one rank of TP 2 with sequence parallelism starts for one training step of a
/// small GPT (LayerNorm, biases) of `layers` layers: through the schedule
/// (`forward_backward_no_pipelining`), through a loop of one's own (`loss.backward()`), and
/// through that loop with the sums deferred (the model `with_sequence_parallel_grads(Deferred)`,
/// same parameter ids, and `sum_sequence_parallel_grads`), whose gradients must be the plain
/// loop's, bit for bit.
fn step_collectives(layers: usize) -> (u64, u64, u64) {
    use burn_megatron::pipeline_parallel::{Microbatch, forward_backward_no_pipelining};
    let config = burn_megatron::transformer::TransformerConfig::new(16, layers, 4, 32, 50, 8)
        .with_make_vocab_size_divisible_by(4)
        .with_init_std(0.1)
        .with_sequence_parallel(true);
    let counts = run(2, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(2))?;
        let model = config.init_gpt::<AD>(state.tp(), &Default::default())?;
        let (input, targets) = (crate::tokens(2, 8, 50, 1), crate::tokens(2, 8, 50, 2));
        let tp = state.tp();
        let before = tp.collectives_started();
        forward_backward_no_pipelining(&model, &[Microbatch::new(input.clone(), targets.clone())])?;
        let schedule = tp.collectives_started() - before;
        let before = tp.collectives_started();
        let loss = model.loss(model.try_forward(input.clone())?, targets.clone())?;
        let plain = GradientsParams::from_grads(loss.backward(), &model);
        let own_loop = tp.collectives_started() - before;

        let deferring = model
            .clone()
            .with_sequence_parallel_grads(SequenceParallelGrads::Deferred);
        let before = tp.collectives_started();
        let loss = deferring.loss(deferring.try_forward(input)?, targets)?;
        let mut grads = GradientsParams::from_grads(loss.backward(), &deferring);
        sum_sequence_parallel_grads(
            std::slice::from_ref(&deferring),
            std::slice::from_mut(&mut grads),
            tp,
        )?;
        let own_loop_deferred = tp.collectives_started() - before;
        for info in param_infos(&model) {
            let [a, b] = [&plain, &grads].map(|g| {
                let numel = info.shape.iter().product::<usize>();
                let grad = match info.shape.len() {
                    1 => g.get::<B, 1>(info.id).map(|t| t.reshape([numel])),
                    2 => g.get::<B, 2>(info.id).map(|t| t.reshape([numel])),
                    _ => unreachable!("the GPT's parameters are 1D or 2D"),
                };
                grad.expect("every parameter has a gradient")
                    .into_data()
                    .to_vec::<f32>()
                    .unwrap()
            });
            assert_eq!(a, b, "{}: deferred sum against f", info.path);
        }
        Ok((schedule, own_loop, own_loop_deferred))
    });
    assert_eq!(
        counts[0], counts[1],
        "both TP ranks start the same collectives"
    );
    counts[0]
}

/// Megatron's count: a layer's all-gather and reduce-scatter before and after attention and
/// the MLP, forward and backward (8). The gradients sequence parallelism leaves partial (two
/// LayerNorms' scale and shift, two row-parallel biases) are summed in one all-reduce per
/// step, after the backward pass, not one each per layer (which a loop of one's own still
/// does: *f* inside the backward pass, 6 more a layer).
#[test]
fn a_sequence_parallel_layer_starts_eight_collectives_a_step() {
    let (two, four) = (step_collectives(2), step_collectives(4));
    assert_eq!((four.0 - two.0) / 2, 8, "through the schedule");
    assert_eq!((four.1 - two.1) / 2, 14, "in a loop of one's own");
    assert_eq!((four.2 - two.2) / 2, 8, "in a loop of one's own, deferred");
}

/// The vocabulary-parallel loss crosses ranks twice (Megatron's three reductions, the two
/// sums in one all-reduce): the maximum, then the sum of exponentials with the target logit.
#[test]
fn the_vocabulary_parallel_loss_takes_two_all_reduces() {
    use burn_megatron::tensor_parallel::{VocabPartition, vocab_parallel_cross_entropy};
    let counts = run(2, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default().with_tp(2))?;
        let tp = state.tp();
        let vocab = VocabPartition::new(50, 4, 2, tp.rank()).expect("a valid partition");
        let logits = Tensor::<AD, 3>::random(
            [2, 8, vocab.local_size()],
            Distribution::Uniform(-1.0, 1.0),
            &Default::default(),
        );
        let before = tp.collectives_started();
        vocab_parallel_cross_entropy(logits, crate::tokens(2, 8, 50, 3), &vocab, tp)?;
        Ok(tp.collectives_started() - before)
    });
    assert_eq!(counts, [2, 2]);
}
