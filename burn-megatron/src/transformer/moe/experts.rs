//! A rank's experts: MLPs whose weights are stacked along a leading expert dimension, all run
//! on their contiguous blocks of tokens by one grouped product per projection
//! ([`grouped_linear()`](crate::ops::grouped_linear()), Megatron's `GroupedMLP`).

use std::ops::Range;
use std::sync::Arc;

use burn::config::Config;
use burn::module::{Module, Param};
use burn::tensor::{Tensor, backend::Backend};

use crate::backend::ModelBackend;
use crate::init::{InitDistribution, init_slice, param_seed};
use crate::ops::CounterNormalOps;
use crate::ops::{
    BackwardHook, RowIndex, gelu, hooked_grouped_linear, linear, permute_rows, swiglu,
};
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
        experts: Range<usize>,
        seed: u64,
        prefix: &str,
        device: &B::Device,
    ) -> GroupedExperts<B> {
        self.init_sharded(experts, 0..self.ffn_hidden_size, seed, prefix, device)
    }

    /// [`init`](Self::init) for the columns `ffn` of each expert's hidden width (expert tensor
    /// parallelism: a TP rank's slice of `fc1` and `gate` along dimension 2, of `fc2` along
    /// dimension 1), the same values as those columns of the whole experts.
    pub fn init_sharded<B: CounterNormalOps>(
        &self,
        experts: Range<usize>,
        ffn: Range<usize>,
        seed: u64,
        prefix: &str,
        device: &B::Device,
    ) -> GroupedExperts<B> {
        let (h, f, e) = (self.hidden_size, self.ffn_hidden_size, self.num_experts);
        let dist = InitDistribution::Normal { std: self.init_std };
        let weight = |name: &str, full: [usize; 3], rows: Range<usize>, cols: Range<usize>| {
            Param::from_tensor(init_slice(
                full,
                [experts.clone(), rows, cols],
                dist,
                param_seed(seed, &format!("{prefix}.{name}")),
                device,
            ))
        };
        let up = |name: &str| weight(name, [e, h, f], 0..h, ffn.clone());
        GroupedExperts {
            fc1: up("fc1"),
            gate: (self.activation == Activation::SwiGlu).then(|| up("gate")),
            fc2: weight("fc2", [e, f, h], ffn.clone(), 0..h),
            activation: self.activation,
            backward_hook: None,
        }
    }
}

/// This rank's experts, `fc2(act(fc1(x)))` or `fc2(silu(gate(x)) · fc1(x))` each, without
/// biases (so a zero input gives a zero output).
///
/// Under expert tensor parallelism `ffn_hidden_size` below is this rank's slice of each
/// expert's width ([`GroupedExpertsConfig::init_sharded`]), and the output a partial sum.
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
    /// The model's backward hook, offered the weights' gradients
    /// ([`with_backward_hook`](Self::with_backward_hook)).
    #[module(skip)]
    backward_hook: Option<Arc<dyn BackwardHook>>,
}

/// Expert `j`'s matrix of a stacked weight. A stack of one (the shared expert) is reshaped
/// whole: a `narrow`'s gradient would fill a zero stack and copy the matrix's into it.
fn expert_matrix<B: Backend>(stacked: &Param<Tensor<B, 3>>, j: usize) -> Tensor<B, 2> {
    let [experts, rows, cols] = stacked.dims();
    match experts {
        1 => stacked.val().reshape([rows, cols]),
        _ => stacked.val().narrow(0, j, 1).reshape([rows, cols]),
    }
}

impl<B: Backend> GroupedExperts<B> {
    /// Experts held by this rank.
    pub fn num_local_experts(&self) -> usize {
        self.fc1.dims()[0]
    }

    /// The same experts (same parameters and ids) offering their weights' gradients to `hook`
    /// in the backward pass ([`BackwardHook::take_weight_gradient`]), or to none.
    pub fn with_backward_hook(self, hook: Option<Arc<dyn BackwardHook>>) -> Self {
        Self {
            backward_hook: hook,
            ..self
        }
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
    /// those of experts `0..j`, in one grouped product per projection.
    ///
    /// The last row is padding (zeros in, zeros out: the experts have no biases). It rides in
    /// the last expert's block, so no tensor is ever empty. Every expert's weights are in the
    /// graph whatever the routing, and an expert without tokens gets a zero gradient: an
    /// optimizer or a gradient reduction finds the same parameters on every rank.
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
        if let Some(rows) = B::padded_block_rows(counts) {
            return self.forward_padded(tokens, counts, rows);
        }
        let mut rows = counts.to_vec();
        *rows.last_mut().expect("at least one expert") += 1;
        self.products(tokens, &rows)
    }

    /// [`forward`](Self::forward) with every expert's block padded with zero rows to `rows`
    /// rows, so that the products run on blocks of one size (what the backend asks for:
    /// [`padded_block_rows`](crate::ops::GroupedLinearOps::padded_block_rows)). Row gathers
    /// ([`permute_rows`]), each the other's inverse, move the tokens into the padded blocks
    /// and back. A zero row gives a zero row (no biases) and adds nothing to the weights'
    /// gradients, so the result is the unpadded one's.
    ///
    /// # Shapes
    /// As [`forward`](Self::forward).
    ///
    /// # Panics
    /// If `rows` is 0 or below a count.
    pub fn forward_padded(
        &self,
        tokens: Tensor<B, 2>,
        counts: &[usize],
        rows: usize,
    ) -> Tensor<B, 2> {
        assert!(
            rows > 0 && counts.iter().all(|c| *c <= rows),
            "blocks of {rows} rows for counts {counts:?}"
        );
        let total: usize = counts.iter().sum();
        // The token row of each padded row, and the padded row of each token row (the last
        // row, the dispatcher's zero row, has none).
        let mut from_padded = vec![None; counts.len() * rows];
        let mut to_padded = vec![None; total + 1];
        let mut first = 0;
        for (e, &count) in counts.iter().enumerate() {
            for i in 0..count {
                from_padded[e * rows + i] = Some(first + i);
                to_padded[first + i] = Some(e * rows + i);
            }
            first += count;
        }
        let device = tokens.device();
        let gather = RowIndex::from_host(&from_padded, &device);
        let scatter = RowIndex::from_host(&to_padded, &device);
        let padded = permute_rows(tokens, &gather, &scatter);
        let out = self.products(padded, &vec![rows; counts.len()]);
        permute_rows(out, &scatter, &gather)
    }

    /// Every local expert on its block of `tokens` as a dispatcher lays them out
    /// ([`DispatchPlan::expert_blocks`]): expert `j` on `blocks[j]` rows after those of
    /// experts `0..j`, its tokens followed by zero rows (zeros in, zeros out), in one grouped
    /// product per projection. Blocks of one size run as one batched GEMM on our CUDA
    /// backend.
    ///
    /// # Shapes
    /// - tokens: `[Σ blocks, hidden_size]`
    /// - output: `[Σ blocks, hidden_size]`
    ///
    /// [`DispatchPlan::expert_blocks`]: super::DispatchPlan::expert_blocks
    pub fn forward_blocks(&self, tokens: Tensor<B, 2>, blocks: &[usize]) -> Tensor<B, 2> {
        assert_eq!(
            blocks.len(),
            self.num_local_experts(),
            "one block per expert"
        );
        assert_eq!(
            tokens.dims()[0],
            blocks.iter().sum::<usize>(),
            "tokens and blocks disagree"
        );
        self.products(tokens, blocks)
    }

    /// The one expert of a stack of one (the shared expert) on every token, by the same
    /// grouped products as [`forward`](Self::forward), so that its weights' gradients reach
    /// the backward hook ([`with_backward_hook`](Self::with_backward_hook)) as the routed
    /// experts' do.
    ///
    /// # Shapes
    /// - tokens: `[n, hidden_size]`, `n ≥ 1`
    /// - output: `[n, hidden_size]`
    pub fn forward_shared(&self, tokens: Tensor<B, 2>) -> Tensor<B, 2> {
        assert_eq!(self.num_local_experts(), 1, "a stack of one expert");
        let rows = [tokens.dims()[0]];
        self.products(tokens, &rows)
    }

    /// The MLP's grouped products, expert `j` on `rows[j]` rows after those of experts `0..j`.
    fn products(&self, tokens: Tensor<B, 2>, rows: &[usize]) -> Tensor<B, 2> {
        let hook = self.backward_hook.as_ref();
        let product = |x, w: &Param<Tensor<B, 3>>| hooked_grouped_linear(x, w.val(), rows, hook);
        let up = product(tokens.clone(), &self.fc1);
        let hidden = match (&self.gate, self.activation.gelu_form()) {
            (Some(gate), _) => swiglu(product(tokens, gate), up),
            (None, Some(form)) => gelu(up, form),
            (None, None) => unreachable!("SwiGLU experts have a gate"),
        };
        product(hidden, &self.fc2)
    }
}
