//! The key/value cache of incremental decoding: each layer's keys and values of every token
//! seen so far, and where the batch's tokens sit (left padding, absolute positions, the mask).

use burn::tensor::{Bool, DType, Tensor, TensorData, backend::Backend};

use crate::error::ConfigError;
use crate::ops::rope::rotation_table;

/// One layer's cached keys and values: this rank's key/value heads only (its query groups
/// under tensor parallelism), never the query heads they serve (GQA stores `groups`, not
/// `heads`, per token).
///
/// Two buffers of `capacity` columns are allocated at the first write and written in place
/// (`slice_assign`) after that: a step writes its new columns, not the whole cache.
///
/// # Shapes
/// - the buffers: `[batch, local_groups, capacity, head_dim]`, the first `len` columns used
#[derive(Debug, Clone)]
pub struct LayerKv<B: Backend> {
    keys: Option<Tensor<B, 4>>,
    values: Option<Tensor<B, 4>>,
    len: usize,
}

impl<B: Backend> LayerKv<B> {
    fn empty() -> Self {
        Self {
            keys: None,
            values: None,
            len: 0,
        }
    }

    /// Writes the new tokens' keys and values at column `len` (allocating buffers of
    /// `capacity` columns at the first write; the caller checks that they fit) and returns
    /// the used columns of both buffers, views that share them.
    ///
    /// # Shapes
    /// - keys, values: `[batch, local_groups, new, head_dim]`
    /// - output: `[batch, local_groups, len + new, head_dim]` each
    pub(crate) fn write(
        &mut self,
        capacity: usize,
        keys: Tensor<B, 4>,
        values: Tensor<B, 4>,
    ) -> [Tensor<B, 4>; 2] {
        let [batch, groups, new, head_dim] = keys.dims();
        let at = self.len;
        let slot = [0..batch, 0..groups, at..at + new, 0..head_dim];
        let write = |buffer: Option<Tensor<B, 4>>, new: Tensor<B, 4>| {
            let buffer = buffer.unwrap_or_else(|| {
                Tensor::zeros(
                    [batch, groups, capacity, head_dim],
                    (&new.device(), new.dtype()),
                )
            });
            // The cache holds the only reference here (the last step's views are gone), so
            // backends that can write in place do.
            buffer.slice_assign(slot.clone(), new)
        };
        let keys = write(self.keys.take(), keys);
        let values = write(self.values.take(), values);
        self.len = at + new;
        let used = [keys.clone(), values.clone()].map(|t| t.narrow(2, 0, at + new));
        self.keys = Some(keys);
        self.values = Some(values);
        used
    }

    /// Both whole buffers (keys, values), taken out for a step that writes its column on the
    /// device ([`DecodeAttentionOps::decode_attention`](crate::ops::DecodeAttentionOps::decode_attention)),
    /// which gives them back with [`put`](Self::put); `None` before the prefill.
    ///
    /// # Shapes
    /// - output: `[batch, local_groups, capacity, head_dim]` each
    pub(crate) fn take(&mut self) -> Option<[Tensor<B, 4>; 2]> {
        Some([self.keys.take()?, self.values.take()?])
    }

    /// Gives back the buffers [`take`](Self::take) took, with the step's column written. The
    /// caller advances the length ([`KvCache::advance_all`]).
    pub(crate) fn put(&mut self, [keys, values]: [Tensor<B, 4>; 2]) {
        self.keys = Some(keys);
        self.values = Some(values);
    }

    /// The device addresses of both buffers, where the backend tells them (see
    /// [`BackendInfo::float_address`](crate::backend::BackendInfo::float_address)).
    pub(crate) fn addresses(&self) -> [Option<u64>; 2]
    where
        B: crate::backend::BackendInfo,
    {
        [&self.keys, &self.values].map(|buffer| {
            buffer
                .as_ref()
                .and_then(|b| B::float_address(&b.clone().into_primitive().tensor()))
        })
    }

    /// The cached keys, `[batch, local_groups, len, head_dim]` (`None` before the prefill).
    pub fn keys(&self) -> Option<Tensor<B, 4>> {
        self.keys.as_ref().map(|k| k.clone().narrow(2, 0, self.len))
    }

    /// The cached values, `[batch, local_groups, len, head_dim]` (`None` before the prefill).
    pub fn values(&self) -> Option<Tensor<B, 4>> {
        self.values
            .as_ref()
            .map(|v| v.clone().narrow(2, 0, self.len))
    }

    /// Columns the buffers hold (`None` before the prefill): the cache's capacity.
    pub fn allocated(&self) -> Option<usize> {
        self.keys.as_ref().map(|k| k.dims()[2])
    }
}

/// The KV cache of a batch of sequences over a model's layers (on this TP rank: its heads),
/// with room for a fixed number of columns.
///
/// The batch is padded on the left: row `b` starts with `pads[b]` padding columns, so that
/// every row's last token is in the last column and each decode step writes one column. A
/// padding column is never attended to by a real token and holds no position: the first real
/// token of every row is at position 0. Padding counts towards the capacity: a batch of a
/// 1-token and a 7-token prompt generating 9 tokens needs `7 + 9 - 1` columns.
///
/// With RoPE it also keeps the model's cosines and sines for positions `0..capacity` (at
/// most the model's maximum), built once on the device, from which every step gathers the
/// rows of its positions.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    layers: Vec<LayerKv<B>>,
    pads: Vec<usize>,
    len: usize,
    capacity: Option<usize>,
    rope: Option<[Tensor<B, 2>; 2]>,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `layers` layers and a batch whose row `b` has `pads[b]` padding
    /// columns on the left, with room for the model's maximum sequence length of columns
    /// (fixed at the first forward pass). [`with_capacity`](Self::with_capacity) sets it.
    pub fn new(layers: usize, pads: Vec<usize>) -> Self {
        Self {
            layers: (0..layers).map(|_| LayerKv::empty()).collect(),
            pads,
            len: 0,
            capacity: None,
            rope: None,
        }
    }

    /// The same with room for `capacity` columns (padding included): the longest prompt plus
    /// the new tokens fed back, what [`generate`](super::generate) allocates.
    pub fn with_capacity(layers: usize, pads: Vec<usize>, capacity: usize) -> Self {
        Self {
            capacity: Some(capacity),
            ..Self::new(layers, pads)
        }
    }

    /// The most columns the cache can hold (`None`: the model's maximum, not known before
    /// the first forward pass).
    pub fn capacity(&self) -> Option<usize> {
        self.capacity
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

    /// Fixes the capacity (the model's `max_sequence_length` if none was given) and checks
    /// that `new` more columns fit: the capacity.
    pub(crate) fn reserve(
        &mut self,
        new: usize,
        max_sequence_length: usize,
    ) -> Result<usize, ConfigError> {
        let capacity = *self.capacity.get_or_insert(max_sequence_length);
        if self.len + new > capacity {
            return Err(ConfigError::Invalid(format!(
                "the KV cache has room for {capacity} columns and holds {}: {new} more do not \
                 fit; create it with KvCache::with_capacity(layers, pads, longest prompt + \
                 new tokens)",
                self.len
            )));
        }
        Ok(capacity)
    }

    /// The cosines and sines of RoPE for positions `0..rows` (each pair's angle in both
    /// halves, the "rotate half" layout), f32 on `device`: built from
    /// [`rotation_table`]'s f64 angles at the first call and kept for the cache's life.
    ///
    /// # Shapes
    /// - output: `[rows, head_dim]` each
    pub(crate) fn rope_table(
        &mut self,
        rows: usize,
        head_dim: usize,
        base: f64,
        device: &B::Device,
    ) -> [Tensor<B, 2>; 2] {
        self.rope
            .get_or_insert_with(|| {
                rotation_table(rows, head_dim, base).map(|values| {
                    let half = Tensor::<B, 2>::from_data(
                        TensorData::new(values, [rows, head_dim / 2]),
                        (device, DType::F32),
                    );
                    Tensor::cat(vec![half.clone(), half], 1)
                })
            })
            .clone()
    }

    /// Records that `new` columns were written to every layer.
    pub(crate) fn advance(&mut self, new: usize) {
        self.len += new;
    }

    /// Records that one column was written to every layer between [`LayerKv::take`] and [`LayerKv::put`] (whose
    /// layers do not count their columns themselves).
    pub(crate) fn advance_all(&mut self) {
        self.len += 1;
        for layer in &mut self.layers {
            layer.len += 1;
        }
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
