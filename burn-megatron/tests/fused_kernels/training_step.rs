//! One training step of a small GPT and a small Llama on wgpu against NdArray.

use burn::backend::wgpu::WgpuDevice;
use burn::tensor::{Int, Tensor, TensorData};
use burn_megatron::ModelBackend;
use burn_megatron_testing::{assert_close, paired, tolerance, values};

use crate::helpers::W;

/// One training step of a small GPT (tied embeddings, learned positions, LayerNorm, GeLU) and
/// a small Llama on wgpu, where the fused kernels run, equals the same step on NdArray, where
/// the Burn compositions run: loss and every gradient.
#[test]
fn a_training_step_on_wgpu_equals_ndarray() {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::backend::AutodiffBackend;
    use burn_megatron::pipeline_parallel::{Microbatch, forward_backward_no_pipelining};
    use burn_megatron::tensor_parallel::gather_full_grads;
    use burn_megatron::transformer::{
        Activation, Normalization, PositionEmbedding, TransformerConfig,
    };

    fn step<A>(config: &TransformerConfig, device: A::Device) -> (f64, Vec<(String, Vec<f64>)>)
    where
        A: AutodiffBackend + ModelBackend,
        A::InnerBackend: burn_megatron_dist::DistBackend,
    {
        burn_megatron_testing::run(1, |ctx| {
            let model = config.init_gpt::<A>(ctx.world(), &device)?;
            let ids = |seed: i64| {
                let v: Vec<i32> = (0..2 * 16).map(|i| ((i * 13 + seed) % 50) as i32).collect();
                Tensor::<A, 2, Int>::from_data(TensorData::new(v, [2, 16]), &device)
            };
            let (loss, grads) =
                forward_backward_no_pipelining(&model, &[Microbatch::new(ids(1), ids(2))])?;
            let grads = gather_full_grads::<A, _>(&model, &grads, ctx.world())?;
            let grads = grads
                .into_iter()
                .map(|(path, data)| (path, burn_megatron_testing::data_values(&data)))
                .collect();
            Ok((values(loss)[0], grads))
        })
        .remove(0)
    }
    let llama = TransformerConfig::new(64, 2, 8, 96, 50, 16)
        .with_num_query_groups(Some(4))
        .with_normalization(Normalization::RmsNorm)
        .with_activation(Activation::SwiGlu)
        .with_position_embedding(PositionEmbedding::Rope { base: 10_000.0 })
        .with_add_bias_linear(false)
        .with_tie_embeddings(false);
    let gpt = TransformerConfig::new(64, 2, 4, 256, 50, 16);
    // Dropout masks drawn by the kernels on wgpu and on the host on NdArray.
    let dropout = gpt
        .clone()
        .with_hidden_dropout(0.2)
        .with_attention_dropout(0.3);
    for (name, config) in [
        ("llama", llama),
        ("gpt", gpt),
        ("gpt with dropout", dropout),
    ] {
        let (loss, grads) = step::<Autodiff<W>>(&config, WgpuDevice::default());
        let (want_loss, want) = step::<Autodiff<NdArray>>(&config, Default::default());
        assert_close(
            &format!("{name} loss"),
            &[loss],
            &[want_loss],
            tolerance::F32,
        );
        assert!(!grads.is_empty(), "{name}: no gradients");
        for (path, got, want) in paired(name, &grads, &want) {
            assert_close(
                &format!("{name} {path}"),
                got,
                want,
                tolerance::F32_LONG_SUM,
            );
        }
    }
}
