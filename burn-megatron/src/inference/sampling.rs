//! Picking the next token from a row of logits: greedy, or a seeded draw after temperature,
//! top-k and top-p.
//!
//! Sampling runs on the host, in f64, on the whole vocabulary's logits (gathered over TP):
//! every TP rank holds the same logits and the same random numbers, so every rank picks the
//! same token. The random number of a draw depends on the seed, the prompt's index in the
//! batch and the step only, so a run is reproducible and the same at every TP size (up to
//! the rounding of the logits).

use crate::data::rng::SplitMix64;
use crate::error::ConfigError;

/// How the next token is chosen from the logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token (the lowest id among equal logits).
    Greedy,
    /// A draw from `softmax(logits / temperature)`, restricted to the `top_k` most likely
    /// tokens and then to the smallest set of most likely tokens whose probability reaches
    /// `top_p` (renormalised), with a random number keyed by `seed`, prompt and step.
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

    /// The token picked from `logits` (one per vocabulary id) for prompt `row` at `step`.
    pub fn pick(&self, logits: &[f32], row: usize, step: usize) -> i64 {
        match *self {
            Sampling::Greedy => argmax(logits) as i64,
            Sampling::Random {
                temperature,
                top_k,
                top_p,
                seed,
            } => {
                let mut order: Vec<usize> = (0..logits.len()).collect();
                // Most likely first; equal logits by id, so that the order is deterministic.
                order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
                order.truncate(top_k.unwrap_or(order.len()).max(1));
                let top = logits[order[0]] as f64;
                let mut probs: Vec<f64> = order
                    .iter()
                    .map(|&i| ((logits[i] as f64 - top) / temperature).exp())
                    .collect();
                let sum: f64 = probs.iter().sum();
                probs.iter_mut().for_each(|p| *p /= sum);
                if let Some(p) = top_p {
                    let mut total = 0.0;
                    let keep = probs
                        .iter()
                        .position(|&q| {
                            total += q;
                            total >= p
                        })
                        .map_or(probs.len(), |i| i + 1);
                    probs.truncate(keep);
                    order.truncate(keep);
                }
                let sum: f64 = probs.iter().sum();
                let mut u = uniform(seed, row, step) * sum;
                for (&id, &q) in order.iter().zip(&probs) {
                    if u < q {
                        return id as i64;
                    }
                    u -= q;
                }
                *order.last().expect("at least one token is kept") as i64
            }
        }
    }
}

/// The index of the largest value (the first among equals).
fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best
}

/// A uniform number in `[0, 1)` for prompt `row` at `step` of a run seeded with `seed`.
fn uniform(seed: u64, row: usize, step: usize) -> f64 {
    let key = SplitMix64::new(seed).next_u64()
        ^ (row as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (step as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let mut rng = SplitMix64::new(key);
    (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
}
