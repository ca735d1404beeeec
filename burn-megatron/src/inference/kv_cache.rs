//! The key/value cache of incremental decoding: each layer's keys and values of every token
//! seen so far, and where the batch's tokens sit (left padding, absolute positions, the mask).

use burn::tensor::{Bool, Tensor, TensorData, backend::Backend};

/// One layer's cached keys and values: this rank's key/value heads only (its query groups
/// under tensor parallelism), never the query heads they serve (GQA stores `groups`, not
/// `heads`, per token).
///
/// # Shapes
/// - keys, values: `[batch, local_groups, len, head_dim]`
#[derive(Debug, Clone)]
pub struct LayerKv<B: Backend> {
    keys: Option<Tensor<B, 4>>,
    values: Option<Tensor<B, 4>>,
}

impl<B: Backend> LayerKv<B> {
    fn empty() -> Self {
        Self {
            keys: None,
            values: None,
        }
    }

    /// Appends the new tokens' keys and values and returns the whole cache's.
    ///
    /// # Shapes
    /// - keys, values: `[batch, local_groups, new, head_dim]`
    /// - output: `[batch, local_groups, len + new, head_dim]` each
    pub fn append(&mut self, keys: Tensor<B, 4>, values: Tensor<B, 4>) -> [Tensor<B, 4>; 2] {
        let cat = |old: Option<Tensor<B, 4>>, new: Tensor<B, 4>| match old {
            Some(old) => Tensor::cat(vec![old, new], 2),
            None => new,
        };
        let keys = cat(self.keys.take(), keys);
        let values = cat(self.values.take(), values);
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        [keys, values]
    }

    /// The cached keys, `[batch, local_groups, len, head_dim]` (`None` before the prefill).
    pub fn keys(&self) -> Option<&Tensor<B, 4>> {
        self.keys.as_ref()
    }

    /// The cached values, `[batch, local_groups, len, head_dim]` (`None` before the prefill).
    pub fn values(&self) -> Option<&Tensor<B, 4>> {
        self.values.as_ref()
    }
}

/// The KV cache of a batch of sequences over a model's layers (on this TP rank: its heads).
///
/// The batch is padded on the left: row `b` starts with `pads[b]` padding columns, so that
/// every row's last token is in the last column and each decode step appends one column. A
/// padding column is never attended to by a real token and holds no position: the first real
/// token of every row is at position 0. The cache grows by concatenation (no preallocation).
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    layers: Vec<LayerKv<B>>,
    pads: Vec<usize>,
    len: usize,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `layers` layers and a batch whose row `b` has `pads[b]` padding
    /// columns on the left.
    pub fn new(layers: usize, pads: Vec<usize>) -> Self {
        Self {
            layers: (0..layers).map(|_| LayerKv::empty()).collect(),
            pads,
            len: 0,
        }
    }

    /// Columns cached so far (padding included).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows of the batch.
    pub fn batch(&self) -> usize {
        self.pads.len()
    }

    /// Padding columns on the left of each row.
    pub fn pads(&self) -> &[usize] {
        &self.pads
    }

    /// Layer `i`'s cache.
    pub fn layer(&self, i: usize) -> &LayerKv<B> {
        &self.layers[i]
    }

    pub(crate) fn layers_mut(&mut self) -> &mut [LayerKv<B>] {
        &mut self.layers
    }

    /// Records that `new` columns were appended to every layer.
    pub(crate) fn advance(&mut self, new: usize) {
        self.len += new;
    }

    /// The absolute positions of the next `new` columns, row-major `[batch, new]`: column `c`
    /// of row `b` is at position `c - pads[b]` (0 for padding), at most `max_position`.
    pub fn positions(&self, new: usize, max_position: usize) -> Vec<i64> {
        let mut positions = Vec::with_capacity(self.batch() * new);
        for &pad in &self.pads {
            for c in self.len..self.len + new {
                positions.push(c.saturating_sub(pad).min(max_position) as i64);
            }
        }
        positions
    }

    /// Which keys the next `new` columns must not attend to (`true`: masked): key column `j`
    /// for query column `c` when `j > c` (causal), or when `j` is padding (`j < pads[b]`)
    /// and not `c` itself. A padding query attends to itself alone, so that its row stays
    /// finite; no real token reads it.
    ///
    /// # Shapes
    /// - output: `[batch, 1, new, len + new]`
    pub fn mask(&self, new: usize, device: &B::Device) -> Tensor<B, 4, Bool> {
        let total = self.len + new;
        let mut mask = Vec::with_capacity(self.batch() * new * total);
        for &pad in &self.pads {
            for c in self.len..total {
                mask.extend((0..total).map(|j| j > c || (j < pad && j != c)));
            }
        }
        Tensor::from_data(TensorData::new(mask, [self.batch(), 1, new, total]), device)
    }
}
