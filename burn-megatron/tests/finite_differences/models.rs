//! The gradient of the mean loss with respect to every parameter tensor of a tiny GPT and a
//! tiny Llama (TP = 1, no dropout), against central differences of the loss, for each
//! activation recomputation (whose backwards are written by hand).
//!
//! Probing every element would be slow: each tensor is probed at a few elements spread over
//! it. The parameters are first moved off their initial values (norm scales of one, biases of
//! zero), where some wrong backwards would still give the right number. The input covers
//! every token of the vocabulary and every position, so no sampled gradient is zero by
//! construction.

use std::collections::HashMap;

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_megatron::init::{InitDistribution, init_full, param_seed};
use burn_megatron::models::GptModel;
use burn_megatron::pipeline_parallel::{Microbatch, forward_backward_no_pipelining};
use burn_megatron::tensor_parallel::gather_full_grads;
use burn_megatron::transformer::{Activation, Recompute, TransformerConfig};
use burn_megatron_dist::{ParallelSizes, ProcessGroup};
use burn_megatron_testing::models::llama;
use burn_megatron_testing::{relative_difference, run, tolerance};

use crate::{AD, B, STEP, device};

/// Elements probed per parameter tensor.
const SAMPLES: usize = 6;

/// A tiny GPT: LayerNorm, GeLU in `activation`'s form, learned positions, biases, tied
/// embeddings; no vocabulary padding.
fn tiny_gpt(activation: Activation) -> TransformerConfig {
    TransformerConfig::new(12, 2, 3, 20, 13, 7)
        .with_activation(activation)
        .with_make_vocab_size_divisible_by(1)
        .with_init_std(0.2)
}

/// A tiny Llama: RMSNorm, SwiGLU, RoPE, grouped-query attention (4 heads in 2 groups), no
/// biases, untied output layer; no vocabulary padding.
fn tiny_llama() -> TransformerConfig {
    llama(TransformerConfig::new(16, 2, 4, 20, 13, 7).with_num_query_groups(Some(2)))
        .with_make_vocab_size_divisible_by(1)
        .with_init_std(0.2)
}

/// `[2, seq]` token ids `(stride · i + offset) mod vocab`: with a stride prime to the vocabulary
/// and at least `vocab` tokens, every id occurs.
fn token_ids(config: &TransformerConfig, stride: i64, offset: i64) -> Vec<i64> {
    let (vocab, seq) = (config.vocab_size as i64, config.max_sequence_length);
    (0..2 * seq as i64)
        .map(|i| (stride * i + offset) % vocab)
        .collect()
}

/// Inputs covering the vocabulary, and targets with one ignored position.
fn batch<Be: burn::tensor::backend::Backend>(
    config: &TransformerConfig,
    device: &Be::Device,
) -> (Tensor<Be, 2, Int>, Tensor<Be, 2, Int>) {
    let shape = [2, config.max_sequence_length];
    let mut targets = token_ids(config, 5, 2);
    targets[3] = -100;
    (
        Tensor::from_data(TensorData::new(token_ids(config, 3, 1), shape), device),
        Tensor::from_data(TensorData::new(targets, shape), device),
    )
}

/// Tracks the path (`"block.layers.0.mlp.fc1.bias"`) of the parameter being visited.
#[derive(Default)]
struct Path(Vec<String>);

impl Path {
    fn enter(&mut self, name: &str) {
        self.0.push(name.to_string());
    }
    fn exit(&mut self) {
        self.0.pop();
    }
    fn current(&self) -> String {
        self.0.join(".")
    }
}

/// Adds `N(0, 0.1²)` noise, seeded by the parameter's path, to every parameter.
struct Jitter(Path);

impl ModuleMapper<AD> for Jitter {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.0.enter(name);
    }
    fn exit_module(&mut self, _: &str, _: &str) {
        self.0.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<AD, D>>) -> Param<Tensor<AD, D>> {
        let seed = param_seed(17, &self.0.current());
        param.map(|value| {
            let noise = init_full::<B, D>(
                value.dims(),
                InitDistribution::Normal { std: 0.1 },
                seed,
                &device(),
            );
            Tensor::from_inner(value.inner() + noise).require_grad()
        })
    }
}

/// Every float parameter's path, id and values, checking that each is f64.
fn parameters(model: &GptModel<B>) -> Vec<(String, ParamId, Vec<f64>)> {
    struct Collect(Path, Vec<(String, ParamId, Vec<f64>)>);
    impl ModuleVisitor<B> for Collect {
        fn enter_module(&mut self, name: &str, _: &str) {
            self.0.enter(name);
        }
        fn exit_module(&mut self, _: &str, _: &str) {
            self.0.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let value = param.val();
            let path = self.0.current();
            assert_eq!(value.dtype(), DType::F64, "parameter {path}");
            let values = value.into_data().to_vec::<f64>().expect("f64 data");
            self.1.push((path, param.id, values));
        }
    }
    let mut collect = Collect(Path::default(), Vec::new());
    model.visit(&mut collect);
    collect.1
}

/// Adds `delta` to element `index` (row-major) of parameter `id`.
struct Perturb {
    id: ParamId,
    index: usize,
    delta: f64,
}

impl ModuleMapper<B> for Perturb {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if param.id != self.id {
            return param;
        }
        param.map(|value| {
            let shape = value.dims();
            let mut values = value.into_data().to_vec::<f64>().expect("f64 data");
            values[self.index] += self.delta;
            Tensor::from_data(TensorData::new(values, shape), &device())
        })
    }
}

/// `SAMPLES` distinct indices spread over `0..n` (a golden-ratio sequence, so that they do
/// not line up with rows or columns), or all of them.
fn sample_indices(n: usize) -> Vec<usize> {
    let golden = (5f64.sqrt() - 1.0) / 2.0;
    let mut indices: Vec<usize> = (0..SAMPLES.min(n))
        .map(|j| (((j as f64 + 0.5) * golden).fract() * n as f64) as usize)
        .collect();
    indices.sort_unstable();
    indices.dedup();
    indices
}

/// The mean loss of `model` on the batch.
fn loss(model: &GptModel<B>, config: &TransformerConfig) -> f64 {
    let (tokens, targets) = batch::<B>(config, &device());
    let logits = model.try_forward(tokens).expect("TP = 1 forward");
    model
        .loss(logits, targets)
        .expect("TP = 1 loss")
        .into_scalar()
}

/// Central differences of the loss at the sampled elements of every parameter:
/// `(path, [(index, estimate)])`.
fn finite_differences(
    model: &GptModel<B>,
    config: &TransformerConfig,
) -> Vec<(String, Vec<(usize, f64)>)> {
    parameters(model)
        .into_iter()
        .map(|(path, id, values)| {
            let estimates = sample_indices(values.len())
                .into_iter()
                .map(|index| {
                    let shifted = |delta| {
                        let model = model.clone().map(&mut Perturb { id, index, delta });
                        loss(&model, config)
                    };
                    (index, (shifted(STEP) - shifted(-STEP)) / (2.0 * STEP))
                })
                .collect();
            (path, estimates)
        })
        .collect()
}

/// The analytic gradient per parameter path of `model`, from the training step
/// [`forward_backward_no_pipelining`].
fn analytic(
    model: &GptModel<AD>,
    config: &TransformerConfig,
    tp: &ProcessGroup,
) -> HashMap<String, Vec<f64>> {
    let (tokens, targets) = batch::<AD>(config, &device());
    let (_, grads) = forward_backward_no_pipelining(model, &[Microbatch::new(tokens, targets)])
        .expect("TP = 1 step");
    gather_full_grads::<AD, _>(model, &grads, tp)
        .expect("TP = 1 gradients")
        .into_iter()
        .map(|(path, data)| (path, data.to_vec::<f64>().expect("f64 gradient")))
        .collect()
}

/// Checks `config`'s analytic gradients (TP = 1), under every recomputation, against central
/// differences; prints the worst relative difference of each.
fn check_model(name: &str, config: TransformerConfig) {
    let tolerance = tolerance::FINITE_DIFFERENCE_F64;
    let per_recompute = run(1, |ctx| {
        let state = ctx.parallel_state(ParallelSizes::default())?;
        let init = |recompute| {
            let config = config.clone().with_recompute(recompute);
            let model = config.init_gpt::<AD>(state.tp(), &device())?;
            Ok::<_, burn_megatron::ConfigError>(model.map(&mut Jitter(Path::default())))
        };
        let estimates = finite_differences(&init(Recompute::None)?.valid(), &config);
        let mut out = Vec::new();
        for recompute in [Recompute::None, Recompute::Selective, Recompute::Full] {
            let grads = analytic(&init(recompute)?, &config, state.tp());
            assert_eq!(grads.len(), estimates.len(), "{name}: parameter count");
            let mut results = Vec::new();
            for (path, samples) in &estimates {
                let grad = grads
                    .get(path)
                    .unwrap_or_else(|| panic!("{name}: no gradient for {path}"));
                let got: Vec<f64> = samples.iter().map(|&(i, _)| grad[i]).collect();
                let want: Vec<f64> = samples.iter().map(|&(_, fd)| fd).collect();
                let label = format!("{name} recompute={recompute:?} {path}");
                results.push((relative_difference(&label, &got, &want), path.clone()));
            }
            out.push((recompute, results));
        }
        Ok::<_, Box<dyn std::error::Error + Send + Sync>>(out)
    })
    .remove(0);
    let mut failures = Vec::new();
    for (recompute, results) in per_recompute {
        let (worst, path) = results
            .iter()
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .expect("the model has parameters");
        eprintln!("{name} recompute={recompute:?}: worst relative difference {worst:.2e} ({path})");
        failures.extend(
            results
                .iter()
                .filter(|(d, _)| *d > tolerance)
                .map(|(d, path)| format!("{name} recompute={recompute:?} {path}: {d:.2e}")),
        );
    }
    assert!(
        failures.is_empty(),
        "gradients off from finite differences by more than {tolerance:.0e}:\n{}",
        failures.join("\n")
    );
}

#[test]
fn gpt_with_exact_gelu_matches_finite_differences() {
    check_model("GPT (erf GeLU)", tiny_gpt(Activation::Gelu));
}

#[test]
fn gpt_with_tanh_gelu_matches_finite_differences() {
    check_model("GPT (tanh GeLU)", tiny_gpt(Activation::GeluTanh));
}

/// LayerNorm, biases and SwiGLU: the gate's and up projection's biases go through the
/// bias-SwiGLU op.
#[test]
fn gpt_with_bias_swiglu_matches_finite_differences() {
    check_model("GPT (bias-SwiGLU)", tiny_gpt(Activation::SwiGlu));
}

#[test]
fn llama_matches_finite_differences() {
    check_model("Llama", tiny_llama());
}

/// QK-norm: the queries' and keys' per-head RMSNorm (and its weights) before RoPE, with heads
/// wider than hidden / heads (6 against 4, `kv_channels`, as Qwen3's).
#[test]
fn llama_with_qk_norm_matches_finite_differences() {
    let config = tiny_llama()
        .with_qk_layernorm(true)
        .with_kv_channels(Some(6));
    check_model("Llama (QK-norm, wide heads)", config);
}
