//! The dropout masks' random bits against values computed independently (a Python
//! reimplementation of `lowbias32`), and the properties the masks rely on.

use std::collections::HashSet;

use burn_megatron_kernels::counter_rng::{
    drop_threshold, element_bits, mix, multiplier, stream_key,
};

#[test]
fn mix_matches_known_values() {
    assert_eq!(mix(0), 0);
    assert_eq!(mix(1), 0x6889_90c0);
    assert_eq!(mix(2), 0xd113_2181);
    assert_eq!(mix(0xdead_beef), 0xe628_c683);
    assert_eq!(mix(u32::MAX), 0x6768_824a);
}

#[test]
fn stream_keys_mix_both_halves_of_the_seed() {
    assert_eq!(stream_key(0), 0);
    assert_eq!(stream_key(1), 0x6889_90c0);
    assert_eq!(stream_key(0x1234_5678_9abc_def0), 0x399e_9951);
    // The high half counts: seeds equal in their low 32 bits get different keys.
    assert_ne!(stream_key(1), stream_key(1 | (1 << 32)));
    assert_eq!(stream_key(7), mix(7 ^ mix(0)));
}

#[test]
fn element_bits_match_known_values() {
    let key = stream_key(42);
    assert_eq!(element_bits(key, [0, 0, 0, 0]), 0x9072_f1de);
    assert_eq!(element_bits(key, [1, 2, 3, 4]), 0x4da9_e645);
    assert_eq!(element_bits(key, [0, 7, 11, 1023]), 0xd7ea_9a8a);
    // A pure function of (key, coordinates), usable in constants.
    const AT_ORIGIN: u32 = element_bits(0, [0, 0, 0, 0]);
    assert_eq!(AT_ORIGIN, 0);
}

#[test]
fn mix_is_a_bijection_on_a_range() {
    let outputs: HashSet<u32> = (0..1u32 << 16).map(mix).collect();
    assert_eq!(outputs.len(), 1 << 16);
}

#[test]
fn coordinates_along_each_axis_never_collide() {
    let key = stream_key(3);
    for axis in 0..4 {
        let bits: HashSet<u32> = (0..4096u32)
            .map(|i| {
                let mut c = [5, 6, 7, 8];
                c[axis] = i;
                element_bits(key, c)
            })
            .collect();
        assert_eq!(bits.len(), 4096, "axis {axis}");
    }
}

#[test]
fn thresholds_round_the_probability_times_two_to_the_32() {
    assert_eq!(drop_threshold(0.0), 0);
    assert_eq!(drop_threshold(0.1), 429_496_730);
    assert_eq!(drop_threshold(0.25), 1 << 30);
    // Just below 1, the threshold is kept within u32.
    assert_eq!(drop_threshold(1.0 - 1e-12), u32::MAX);
}

#[test]
#[should_panic(expected = "dropout probability must be in [0, 1)")]
fn a_probability_of_one_is_refused() {
    drop_threshold(1.0);
}

#[test]
fn multipliers_drop_below_the_threshold_and_scale_the_rest() {
    let threshold = drop_threshold(0.25);
    let scale = 1.0 / 0.75;
    assert_eq!(multiplier(threshold - 1, threshold, scale), 0.0);
    assert_eq!(multiplier(threshold, threshold, scale), scale);
    assert_eq!(multiplier(u32::MAX, threshold, scale), scale);
    // Probability 0 drops nothing.
    assert_eq!(multiplier(0, drop_threshold(0.0), 1.0), 1.0);
}
