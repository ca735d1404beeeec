//! Switch Transformer's input jitter (`--moe-input-jitter-eps`): the router's input times
//! factors uniform in `(1 − ε, 1 + ε)`, in training, drawn from the tokens' place in the
//! global batch so that every layout and recomputation draws the same.

use burn::tensor::Tensor;

use crate::backend::ModelBackend;

/// Where a forward pass's tokens sit in the global batch, for Switch Transformer's input
/// jitter ([`RouterSettings::input_jitter_eps`](super::RouterSettings::input_jitter_eps)):
/// the draw's seed and the global position of each of the rank's sequence positions. The
/// factors are drawn from the global coordinates `[sequence, position, feature]` (as
/// dropout's masks are, [`DropoutSite`](crate::tensor_parallel::DropoutSite)), so every TP
/// rank of a token draws the same ones, a layout that splits the sequence (SP, CP) draws
/// those of one device, and a recomputed forward pass draws them again. The transformer
/// layer gives each call its own seed (the model's seed, the forward pass, the layer).
#[derive(Debug, Clone, PartialEq)]
pub struct JitterSite {
    /// The stream's seed.
    pub seed: u64,
    /// The global position of each local sequence position, in order.
    pub positions: Vec<usize>,
    /// The global sequence length.
    pub sequence_length: usize,
}

impl JitterSite {
    /// A site whose `seq` positions are the whole sequence.
    pub fn whole_sequence(seed: u64, seq: usize) -> Self {
        Self {
            seed,
            positions: (0..seq).collect(),
            sequence_length: seq,
        }
    }

    /// The jitter factors of `batch` sequences of this site's positions, `hidden` features
    /// each: `1 + ε erf(z / √2)` with `z` the standard normal of each element's global
    /// coordinates ([`CounterNormalOps`](crate::ops::CounterNormalOps)), which is uniform in
    /// `(1 − ε, 1 + ε)`; without gradient, in the device's default float dtype.
    ///
    /// # Shapes
    /// - output: `[batch · positions, hidden]`, batch-major
    pub fn factors<B: ModelBackend>(
        &self,
        eps: f64,
        batch: usize,
        hidden: usize,
        device: &B::Device,
    ) -> Tensor<B, 2> {
        let full = [batch, self.sequence_length, hidden];
        // `z / √2` drawn directly (the draw's standard deviation), one draw per run of
        // consecutive positions (one for the whole sequence).
        let mut runs = Vec::new();
        let mut start = 0;
        while start < self.positions.len() {
            let first = self.positions[start];
            let mut end = start + 1;
            while end < self.positions.len() && self.positions[end] == first + (end - start) {
                end += 1;
            }
            let ranges = [0..batch, first..first + end - start, 0..hidden];
            let std = std::f64::consts::FRAC_1_SQRT_2;
            runs.push(B::counter_normal(full, ranges, std, self.seed, device));
            start = end;
        }
        let normals = match runs.len() {
            1 => runs.remove(0),
            _ => Tensor::cat(runs, 1),
        };
        normals
            .reshape([batch * self.positions.len(), hidden])
            .erf()
            .mul_scalar(eps)
            .add_scalar(1.0)
    }
}
