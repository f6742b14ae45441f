//! The integer weights temperature sampling draws from. A weight is defined through IEEE f32
//! operations only (subtract, divide, multiply, floor, fused multiply-add, exact scaling by a
//! power of two, truncation), each exactly rounded wherever it runs, so the runtime's reference,
//! the generated CPU sampler and a GPU sampler compute the same bits; masses are integer sums,
//! whose order does not matter, and comparisons of masses are exact. Every sampler therefore
//! picks the same token, however it splits the work.
//!
//! With `m` the row's largest logit and `t` the temperature, logit `x` weighs
//! `floor(2^(y + 30))` for `y = (x - m) / t * log2(e)` (f32 operations, in that order), where
//! `2^y` is `2^floor(y)` times a degree-7 polynomial in `y - floor(y)`; a logit whose `y` is
//! below -30 (relative probability under 1e-9) or not a number weighs 0. The largest logit weighs
//! exactly 2^30, so a row of up to 2^33 logits sums below 2^63.

/// `2^f` for `f` in `[0, 1]`: the Taylor coefficients of `e^(f ln 2)`, highest power first, for
/// Horner's rule with fused multiply-adds (relative error below 2e-6).
pub const EXP2: [f32; 8] = [
    1.525_273_4e-5,
    1.540_353e-4,
    1.333_355_8e-3,
    9.618_129e-3,
    5.550_411e-2,
    0.240_226_5,
    std::f32::consts::LN_2,
    1.0,
];

/// The lowest `y` that weighs anything, and the largest weight's exponent.
pub const SCALE: i32 = 30;

/// The weight of logit `x` in a row whose largest logit is `m`, at temperature `t` (> 0).
pub fn weight(x: f32, m: f32, t: f32) -> u32 {
    let y = (x - m) / t * std::f32::consts::LOG2_E;
    // Below the floor, or NaN.
    if y.is_nan() || y < -(SCALE as f32) {
        return 0;
    }
    let n = y.floor();
    let f = y - n;
    let p = EXP2[1..].iter().fold(EXP2[0], |p, c| p.mul_add(f, *c));
    // p is in [1, 2] and n in [-30, 0]: the scaling is exact, the product at most 2^31.
    (p * power_of_two(n as i32 + SCALE)) as u32
}

/// `2^k` for `k` in `[-126, 127]`, built from its exponent bits.
pub fn power_of_two(k: i32) -> f32 {
    f32::from_bits(((k + 127) as u32) << 23)
}

/// `x`'s bits mapped so that unsigned order is float order (negative values' bits flipped, the
/// sign bit of others set; -0 just below +0), NaN to 0, below every number: the keys thresholds
/// compare, so that a threshold is a logit's key and a NaN is kept only when every logit is.
pub fn ordered_key(x: f32) -> u32 {
    if x.is_nan() {
        return 0;
    }
    let bits = x.to_bits();
    let flip = if bits >> 31 == 1 { u32::MAX } else { 1 << 31 };
    bits ^ flip
}

/// `top_p` as the integer `P` the kept mass is compared against: a mass `w` reaches `top_p` of
/// `z` when `w * 2^32 >= P * z` (exact in 128 bits).
pub fn top_p_fixed(top_p: f32) -> u64 {
    (top_p * power_of_two(32)) as u64
}

/// Whether `mass` reaches `top_p` (as [`top_p_fixed`] gives it) of `total`.
pub fn reaches(mass: u64, p: u64, total: u64) -> bool {
    (u128::from(mass) << 32) >= u128::from(p) * u128::from(total)
}

/// The draw's target in a kept mass of `z`: `floor(word * z / 2^32)` for the step's uniform
/// 32-bit `word`, so that the token is the first kept index whose running mass exceeds it.
pub fn target(word: u32, z: u64) -> u64 {
    ((u128::from(word) * u128::from(z)) >> 32) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_logit_weighs_two_to_the_thirty() {
        for (m, t) in [(3.5f32, 0.7f32), (-2.0, 1.0), (0.0, 1.3), (1e4, 0.01)] {
            assert_eq!(weight(m, m, t), 1 << SCALE);
        }
    }

    #[test]
    fn weights_follow_two_to_the_y() {
        for i in 0..2000 {
            let x = -(i as f32) * 0.01;
            let w = f64::from(weight(x, 0.0, 1.0));
            let want = f64::from(x).exp() * 2f64.powi(SCALE);
            // The polynomial's error and the truncation.
            assert!(
                (w - want).abs() <= want * 2e-6 + 1.0,
                "x {x}: {w} against {want}"
            );
        }
    }

    #[test]
    fn weights_do_not_increase_as_logits_fall() {
        let mut last = u32::MAX;
        for i in 0..100_000 {
            let w = weight(-(i as f32) * 2e-4, 0.0, 0.9);
            assert!(w <= last, "step {i}");
            last = w;
        }
    }

    #[test]
    fn far_tails_and_non_numbers_weigh_nothing() {
        assert_eq!(weight(-21.0, 0.0, 1.0), 0, "y = -30.3");
        assert!(weight(-20.0, 0.0, 1.0) > 0, "y = -28.9");
        assert_eq!(weight(f32::NAN, 0.0, 1.0), 0);
        assert_eq!(weight(f32::NEG_INFINITY, 0.0, 1.0), 0);
        assert_eq!(weight(0.0, f32::INFINITY, 1.0), 0);
    }

    #[test]
    fn keys_follow_float_order() {
        let xs = [
            f32::NEG_INFINITY,
            -3.5,
            -1e-30,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::INFINITY,
        ];
        for pair in xs.windows(2) {
            assert!(ordered_key(pair[0]) <= ordered_key(pair[1]), "{pair:?}");
        }
        assert!(ordered_key(-0.0) < ordered_key(0.0));
        assert_eq!(ordered_key(f32::NAN), 0);
        assert_eq!(ordered_key(-f32::NAN), 0);
        assert!(ordered_key(f32::NEG_INFINITY) > 0);
    }

    #[test]
    fn masses_compare_exactly() {
        let p = top_p_fixed(0.5);
        assert_eq!(p, 1 << 31);
        assert!(reaches(50, p, 100) && !reaches(49, p, 100));
        let total = (1u64 << 47) + 3;
        assert!(reaches(total, top_p_fixed(1.0), total));
        assert!(!reaches(total - 1, top_p_fixed(1.0), total));
        assert_eq!(target(0, total), 0);
        assert!(target(u32::MAX, total) < total);
        assert_eq!(target(u32::MAX, 10), 9);
        assert_eq!(target(1 << 31, 10), 5);
    }
}
