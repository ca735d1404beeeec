//! Picking the next token from rows of logits, on the logits' device: greedy, or a seeded
//! draw after temperature, top-k and top-p. Only the picked ids leave the device.
//!
//! A draw is the Gumbel-max trick: the argmax of `logits / temperature - ln(e)` over the kept
//! tokens, with `e` an exponential number per token. The `e` of token `v` of prompt `row` at
//! `step` is `(z₀² + z₁²) / 2` (a chi-square of two degrees of freedom halved, which is
//! exponential), `z₀` and `z₁` the normal numbers at coordinates `[0 or 1, row, step, v]` of
//! the counter-based generator of the initial values ([`CounterNormalOps`]): a pure function
//! of the seed and those coordinates, drawn where the logits are. Every TP rank holds the
//! same gathered logits and draws the same numbers, so every rank picks the same token, and a
//! run is reproducible and the same at every TP size (up to the rounding of the logits).
//!
//! Top-k and top-p keep the tokens whose logit reaches a threshold, found by bisection
//! ([`threshold`]) instead of a sort: Burn's `sort` reads the tensor back to the host on
//! CubeCL backends, and its `topk` kernel unrolls `k`. Tokens tied at the threshold are all
//! kept.

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, DType, Int, Tensor};

use crate::backend::ModelBackend;
use crate::data::rng::SplitMix64;
use crate::error::ConfigError;

/// How the next token is chosen from the logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token (the lowest id among equal logits).
    Greedy,
    /// A draw from `softmax(logits / temperature)`, restricted to the `top_k` most likely
    /// tokens and then to the smallest set of most likely tokens whose probability reaches
    /// `top_p` (renormalised), with random numbers keyed by `seed`, prompt, step and token.
    Random {
        /// Divides the logits: below 1 sharpens, above 1 flattens. Must be positive.
        temperature: f64,
        /// Keep only the `k` most likely tokens (`k >= 1`); `None` keeps all.
        top_k: Option<usize>,
        /// Keep the most likely tokens up to this total probability (`0 < p <= 1`); `None`
        /// keeps all.
        top_p: Option<f64>,
        /// The seed of the draws.
        seed: u64,
    },
}

/// Halvings of a threshold's interval: from the logits' range down to below an f32 ulp of
/// typical logits (after which a step changes nothing).
const BISECTION_STEPS: usize = 40;

impl Sampling {
    /// Checks the parameters: a positive finite temperature, `top_k >= 1`, `0 < top_p <= 1`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let Sampling::Random {
            temperature,
            top_k,
            top_p,
            ..
        } = *self
        else {
            return Ok(());
        };
        if !(temperature.is_finite() && temperature > 0.0) {
            return Err(ConfigError::Invalid(format!(
                "sampling temperature {temperature} must be positive and finite (use \
                 Sampling::Greedy for temperature 0)"
            )));
        }
        if top_k == Some(0) {
            return Err(ConfigError::Invalid(
                "top_k = 0 keeps no token: use top_k >= 1, or None to keep all".into(),
            ));
        }
        if let Some(p) = top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(ConfigError::Invalid(format!(
                "top_p = {p} must be in (0, 1]"
            )));
        }
        Ok(())
    }

    /// The token picked from each row of `logits` (one column per vocabulary id), on their
    /// device: row `b` is prompt `first_row + b` at `step` (the tokens it has generated so
    /// far), which key its random numbers.
    ///
    /// # Shapes
    /// - logits: `[batch, vocab]` (the real vocabulary, gathered over TP)
    /// - output: `[batch]`
    pub fn pick<B: ModelBackend>(
        &self,
        logits: Tensor<B, 2>,
        first_row: usize,
        step: usize,
    ) -> Tensor<B, 1, Int> {
        let [batch, vocab] = logits.dims();
        let Sampling::Random {
            temperature,
            top_k,
            top_p,
            seed,
        } = *self
        else {
            // Burn's argmax returns the first of equal maxima on NdArray and CubeCL.
            return logits.argmax(1).reshape([batch]);
        };
        let scaled = logits.cast(DType::F32).div_scalar(temperature);
        let mut dropped: Option<Tensor<B, 2, Bool>> = None;
        if let Some(k) = top_k.filter(|&k| k < vocab) {
            let ones = scaled.ones_like();
            let target = Tensor::full([batch, 1], k as f32, (&scaled.device(), DType::F32));
            let cut = threshold(scaled.clone(), ones, target);
            dropped = Some(scaled.clone().lower(cut.expand([batch, vocab])));
        }
        if let Some(p) = top_p.filter(|&p| p < 1.0) {
            // Unnormalised probabilities of the kept tokens; the mass to reach is p of theirs.
            let kept = match &dropped {
                Some(dropped) => scaled.clone().mask_fill(dropped.clone(), f32::NEG_INFINITY),
                None => scaled.clone(),
            };
            let probs = softmax(kept, 1);
            let target = probs.clone().sum_dim(1).mul_scalar(p);
            let cut = threshold(scaled.clone(), probs, target);
            let below = scaled.clone().lower(cut.expand([batch, vocab]));
            dropped = Some(match dropped {
                Some(dropped) => dropped.bool_or(below),
                None => below,
            });
        }
        let noise = exponential_noise::<B>(seed, first_row, step, [batch, vocab], &scaled.device());
        let keys = scaled - noise.log();
        let keys = match dropped {
            Some(dropped) => keys.mask_fill(dropped, f32::NEG_INFINITY),
            None => keys,
        };
        keys.argmax(1).reshape([batch])
    }
}

/// Exponential numbers (rate 1) for rows `first_row..first_row + batch` at `step`, one per
/// token, drawn on the device as `(z₀² + z₁²) / 2` from [`CounterNormalOps`] normals
/// (see the [module docs](self)); f32, never 0.
///
/// # Shapes
/// - output: `[batch, vocab]`
///
/// [`CounterNormalOps`]: crate::ops::CounterNormalOps
fn exponential_noise<B: ModelBackend>(
    seed: u64,
    first_row: usize,
    step: usize,
    [batch, vocab]: [usize; 2],
    device: &B::Device,
) -> Tensor<B, 2> {
    // Its own stream: a sampling seed equal to a model's seed draws other numbers than its
    // initial values.
    let stream = SplitMix64::new(seed ^ 0x5341_4d50_4c45).next_u64();
    let z = B::counter_normal(
        [2, first_row + batch, step + 1, vocab],
        [0..2, first_row..first_row + batch, step..step + 1, 0..vocab],
        1.0,
        stream,
        device,
    )
    .cast(DType::F32);
    (z.clone() * z)
        .sum_dim(0)
        .mul_scalar(0.5)
        .reshape([batch, vocab])
        .clamp_min(f32::MIN_POSITIVE)
}

/// The largest threshold `t` per row with `sum(weights where values >= t) >= target`, by
/// bisection between the row's smallest and largest value ([`BISECTION_STEPS`] halvings; the
/// largest value itself when it alone reaches the target). Top-k is it with weights 1 and
/// target `k`, top-p with the probabilities and target `p`. Each halving is one masked sum
/// over the row, on the device; nothing is read back.
///
/// # Shapes
/// - values, weights: `[batch, vocab]` (weights non-negative)
/// - target: `[batch, 1]`, at most the row's total weight
/// - output: `[batch, 1]`
fn threshold<B: ModelBackend>(
    values: Tensor<B, 2>,
    weights: Tensor<B, 2>,
    target: Tensor<B, 2>,
) -> Tensor<B, 2> {
    let [batch, vocab] = values.dims();
    let reaches = |t: Tensor<B, 2>| {
        let below = values.clone().lower(t.expand([batch, vocab]));
        weights
            .clone()
            .mask_fill(below, 0.0)
            .sum_dim(1)
            .greater_equal(target.clone())
    };
    let mut lo = values.clone().min_dim(1);
    let mut hi = values.clone().max_dim(1);
    let top = hi.clone();
    for _ in 0..BISECTION_STEPS {
        let mid = (lo.clone() + hi.clone()).mul_scalar(0.5);
        let ok = reaches(mid.clone());
        lo = lo.mask_where(ok.clone(), mid.clone());
        hi = mid.mask_where(ok, hi);
    }
    lo.mask_where(reaches(top.clone()), top)
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    type B = NdArray<f32>;

    fn values(rows: &[&[f32]]) -> Tensor<B, 2> {
        let vocab = rows[0].len();
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_data(
            TensorData::new(flat, [rows.len(), vocab]),
            &Default::default(),
        )
    }

    /// The threshold of top-k is the k-th largest value; of top-p, the value of the last
    /// token the mass needs; of a target the largest value alone reaches, that value.
    #[test]
    fn thresholds_are_the_values_that_reach_the_target() {
        let v = values(&[&[0.5, -1.0, 3.0, 2.0, 2.0, 0.25]]);
        let ones = v.ones_like();
        for (k, want) in [(1.0, 3.0), (2.0, 2.0), (3.0, 2.0), (4.0, 0.5), (6.0, -1.0)] {
            let target = Tensor::full([1, 1], k, &Default::default());
            let t = threshold(v.clone(), ones.clone(), target).into_scalar();
            assert_eq!(t, want, "k = {k}");
        }
        let probs = values(&[&[0.1, 0.4, 0.2, 0.3]]);
        for (p, want) in [(0.3, 0.4), (0.5, 0.3), (0.7, 0.3), (0.8, 0.2), (1.0, 0.1)] {
            let target = Tensor::full([1, 1], p, &Default::default());
            let t = threshold(probs.clone(), probs.clone(), target).into_scalar();
            assert_eq!(t, want, "p = {p}");
        }
    }

    /// The exponential numbers have mean 1 and `P(e > 1) = 1/e`, and depend on the seed.
    #[test]
    fn the_noise_is_exponential() {
        let e = exponential_noise::<B>(3, 0, 0, [64, 1000], &Default::default());
        let v = e.clone().into_data().to_vec::<f32>().unwrap();
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let above = v.iter().filter(|&&x| x > 1.0).count() as f64 / v.len() as f64;
        assert!((mean - 1.0).abs() < 0.02, "mean {mean}");
        assert!((above - (-1.0f64).exp()).abs() < 0.01, "P(e > 1) = {above}");
        let other = exponential_noise::<B>(4, 0, 0, [64, 1000], &Default::default());
        assert_ne!(other.into_data(), e.into_data());
    }
}
