//! The random bits of the dropout masks: a hash of a stream key and an element's coordinates
//! in the global tensor, in 32-bit integer arithmetic only.
//!
//! A mask element is a pure function of `(key, coordinates)`, so the mask a rank draws for its
//! block of a tensor is the block of the mask one device draws for the whole tensor, and a
//! backward pass (or a recomputed forward) redraws it instead of storing it. Only 32-bit
//! operations are used, so the GPU kernel (`fused::dropout`) computes the very bits this plain
//! Rust does: it runs on runtimes without 64-bit integers (WGSL), and tests compare the two
//! bit for bit.

/// A 32-bit mixing function with full avalanche (Chris Wellons' `lowbias32` constants).
pub const fn mix(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// The 32-bit key of a 64-bit stream seed.
pub const fn stream_key(seed: u64) -> u32 {
    mix(seed as u32 ^ mix((seed >> 32) as u32))
}

/// The bits of the element at `coordinates` (global, outermost first) of stream `key`. Each
/// step `mix(h ^ c)` is a bijection of `c` for a fixed prefix, so distinct coordinates along
/// any one axis never collide.
pub const fn element_bits(key: u32, coordinates: [u32; 4]) -> u32 {
    let mut h = key;
    let mut d = 0;
    while d < 4 {
        h = mix(h ^ coordinates[d]);
        d += 1;
    }
    h
}

/// The second stream key of a normal draw: Box-Muller takes two uniforms per element, from
/// the element's bits under two keys.
pub const fn second_key(key: u32) -> u32 {
    mix(key ^ 0x5bd1_e995)
}

/// A uniform number in (0, 1) from 32 random bits: the top 24 as an odd multiple of 2⁻²⁴,
/// exact in f32 (never 0 or 1) so the host and every kernel read the same number.
pub fn unit(bits: u32) -> f32 {
    ((bits >> 8) | 1) as f32 * (1.0 / 16_777_216.0)
}

/// A standard normal number (Box-Muller, in f32) of the element at `coordinates` of the
/// stream `key`: what a parameter is initialised from. A kernel computing it differs from
/// this only by its `ln`, `sqrt` and `cos` (a few ulps); the uniforms are bit-equal.
pub fn standard_normal(key: u32, coordinates: [u32; 4]) -> f32 {
    let u1 = unit(element_bits(key, coordinates));
    let u2 = unit(element_bits(second_key(key), coordinates));
    (-2.0 * u1.ln()).sqrt() * (core::f32::consts::TAU * u2).cos()
}

/// Dropping an element with probability `prob` drops it when its bits are below this
/// threshold: `round(prob · 2³²)`, kept within `u32`.
pub fn drop_threshold(prob: f64) -> u32 {
    assert!(
        (0.0..1.0).contains(&prob),
        "dropout probability must be in [0, 1), got {prob}"
    );
    (prob * 4_294_967_296.0).round().min(u32::MAX as f64) as u32
}

/// The multiplier of an element: 0 when dropped, `1 / (1 - prob)` when kept.
pub fn multiplier(bits: u32, threshold: u32, scale: f32) -> f32 {
    if bits < threshold { 0.0 } else { scale }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dropped_fraction_is_the_probability() {
        for prob in [0.1, 0.5, 0.9] {
            let threshold = drop_threshold(prob);
            let key = stream_key(0x1234_5678_9abc_def0);
            let n = 1 << 18;
            let dropped = (0..n)
                .filter(|&i: &u32| {
                    element_bits(key, [0, i >> 12, (i >> 6) & 63, i & 63]) < threshold
                })
                .count();
            let fraction = dropped as f64 / n as f64;
            // Binomial standard deviation at n = 2^18 is below 1e-3.
            assert!(
                (fraction - prob).abs() < 5e-3,
                "prob {prob}: dropped {fraction}"
            );
        }
    }

    #[test]
    fn neighbours_and_streams_are_uncorrelated() {
        // Agreement of the keep decisions (prob 0.5) of neighbours along each axis, and of
        // two streams: 0.5 when independent.
        let threshold = drop_threshold(0.5);
        let (a, b) = (stream_key(1), stream_key(2));
        let kept = |key, c: [u32; 4]| element_bits(key, c) >= threshold;
        let n = 1u32 << 16;
        let mut agree = [0usize; 5];
        for i in 0..n {
            let c = [i >> 12, (i >> 8) & 15, (i >> 4) & 15, i & 15];
            for axis in 0..4 {
                let mut next = c;
                next[axis] += 1;
                agree[axis] += (kept(a, c) == kept(a, next)) as usize;
            }
            agree[4] += (kept(a, c) == kept(b, c)) as usize;
        }
        for (what, count) in agree.iter().enumerate() {
            let fraction = *count as f64 / n as f64;
            assert!(
                (fraction - 0.5).abs() < 0.01,
                "pair {what}: agreement {fraction}"
            );
        }
    }

    #[test]
    fn thresholds_cover_the_range() {
        assert_eq!(drop_threshold(0.0), 0);
        assert_eq!(drop_threshold(0.5), 1 << 31);
        assert_eq!(multiplier(0, 1, 2.0), 0.0);
        assert_eq!(multiplier(1, 1, 2.0), 2.0);
    }
}
