//! A rank's experts: MLPs whose weights are stacked along a leading expert dimension, each
//! run once on its contiguous block of tokens (Megatron's `SequentialMLP`; the grouped GEMM
//! of `GroupedMLP` is what this becomes on the GPU).

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{Tensor, backend::Backend};

use crate::backend::ModelBackend;
use crate::init::{InitDistribution, init_slice, param_seed};
use crate::ops::CounterNormalOps;
use crate::ops::{gelu, linear, swiglu};
use crate::transformer::Activation;

/// Configuration of [`GroupedExperts`].
#[derive(Config, Debug)]
pub struct GroupedExpertsConfig {
    /// Width of the tokens.
    pub hidden_size: usize,
    /// Hidden width of each expert's MLP.
    pub ffn_hidden_size: usize,
    /// Experts over all expert-parallel ranks.
    pub num_experts: usize,
    /// The MLP's activation: GeLU (two projections) or SwiGLU (three).
    #[config(default = "Activation::SwiGlu")]
    pub activation: Activation,
    /// Standard deviation of the normal initialisation of every weight.
    #[config(default = 0.02)]
    pub init_std: f64,
}

impl GroupedExpertsConfig {
    /// The experts `experts` (a range of the global indices) of the layer. Each weight is the
    /// slice of a full `[num_experts, ..]` tensor drawn from `seed` and the weight's `name`
    /// under `prefix`, so the values do not depend on how the experts are split.
    pub fn init<B: CounterNormalOps>(
        &self,
        experts: std::ops::Range<usize>,
        seed: u64,
        prefix: &str,
        device: &B::Device,
    ) -> GroupedExperts<B> {
        let (h, f, e) = (self.hidden_size, self.ffn_hidden_size, self.num_experts);
        let dist = InitDistribution::Normal { std: self.init_std };
        let weight = |name: &str, rows: usize, cols: usize| {
            Param::from_tensor(init_slice(
                [e, rows, cols],
                [experts.clone(), 0..rows, 0..cols],
                dist,
                param_seed(seed, &format!("{prefix}.{name}")),
                device,
            ))
        };
        GroupedExperts {
            fc1: weight("fc1", h, f),
            gate: (self.activation == Activation::SwiGlu).then(|| weight("gate", h, f)),
            fc2: weight("fc2", f, h),
            activation: self.activation,
        }
    }
}

/// This rank's experts, `fc2(act(fc1(x)))` or `fc2(silu(gate(x)) · fc1(x))` each, without
/// biases (so a zero input gives a zero output).
#[derive(Module, Debug)]
pub struct GroupedExperts<B: Backend> {
    /// `[local_experts, hidden_size, ffn_hidden_size]`: the up projections, this rank's slice
    /// of the layer's `[num_experts, ..]` tensor, drawn from `N(0, init_std²)`.
    pub fc1: Param<Tensor<B, 3>>,
    /// `[local_experts, hidden_size, ffn_hidden_size]`: SwiGLU's gate projections (`None`
    /// for GeLU), drawn from `N(0, init_std²)`.
    pub gate: Option<Param<Tensor<B, 3>>>,
    /// `[local_experts, ffn_hidden_size, hidden_size]`: the down projections, drawn from
    /// `N(0, init_std²)`.
    pub fc2: Param<Tensor<B, 3>>,
    #[module(skip)]
    activation: Activation,
}

/// Expert `j`'s matrix of a stacked weight.
fn expert_matrix<B: Backend>(stacked: &Param<Tensor<B, 3>>, j: usize) -> Tensor<B, 2> {
    let [_, rows, cols] = stacked.dims();
    stacked.val().narrow(0, j, 1).reshape([rows, cols])
}

impl<B: Backend> GroupedExperts<B> {
    /// Experts held by this rank.
    pub fn num_local_experts(&self) -> usize {
        self.fc1.dims()[0]
    }
}

impl<B: ModelBackend> GroupedExperts<B> {
    /// Local expert `j` on a block of tokens.
    ///
    /// # Shapes
    /// - tokens: `[n, hidden_size]`, `n ≥ 1`
    /// - output: `[n, hidden_size]`
    pub fn forward_expert(&self, j: usize, tokens: Tensor<B, 2>) -> Tensor<B, 2> {
        let up = linear(tokens.clone(), expert_matrix(&self.fc1, j), None);
        let hidden = match (&self.gate, self.activation.gelu_form()) {
            (Some(gate), _) => swiglu(linear(tokens, expert_matrix(gate, j), None), up),
            (None, Some(form)) => gelu(up, form),
            (None, None) => unreachable!("SwiGLU experts have a gate"),
        };
        linear(hidden, expert_matrix(&self.fc2, j), None)
    }

    /// Every local expert on its block of `tokens`: expert `j` takes `counts[j]` rows, after
    /// those of experts `0..j`, in one product per projection.
    ///
    /// The last row is padding (zeros in, zeros out). An expert with no tokens runs on it,
    /// and its (zero) output is what the last output row holds: so every expert's weights are
    /// in the graph and get a gradient, zero if it had no tokens, and an optimizer or a
    /// gradient reduction finds the same parameters on every rank, whatever the routing.
    ///
    /// # Shapes
    /// - tokens: `[Σ counts + 1, hidden_size]`, the last row zero
    /// - output: `[Σ counts + 1, hidden_size]`, the last row zero
    pub fn forward(&self, tokens: Tensor<B, 2>, counts: &[usize]) -> Tensor<B, 2> {
        assert_eq!(
            counts.len(),
            self.num_local_experts(),
            "one count per expert"
        );
        let total: usize = counts.iter().sum();
        assert_eq!(tokens.dims()[0], total + 1, "tokens and counts disagree");
        let padding = tokens.clone().narrow(0, total, 1);
        let mut blocks = Vec::with_capacity(counts.len() + 1);
        let mut idle: Option<Tensor<B, 2>> = None;
        let mut start = 0;
        for (j, &count) in counts.iter().enumerate() {
            if count > 0 {
                let block = tokens.clone().narrow(0, start, count);
                blocks.push(self.forward_expert(j, block));
                start += count;
            } else {
                let zero = self.forward_expert(j, padding.clone());
                idle = Some(match idle {
                    Some(sum) => sum + zero,
                    None => zero,
                });
            }
        }
        blocks.push(idle.unwrap_or(padding));
        Tensor::cat(blocks, 0)
    }
}
