//! Philox-4x32-10 (Salmon et al., SC'11) and the dropout mask that every kiln backend shares.
//!
//! For an element at coordinates `(plane, row, col)` of the dropout input (`col` the last index,
//! `row` the second to last, `plane` the row-major flattening of the leading indices, all logical
//! sizes), the counter is `(col >> 2, row, plane, stream)`, the key is the seed's two halves, and the
//! element is kept when word `col & 3` of the Philox output is `>= threshold(p)`.

const ROUND_MUL_0: u32 = 0xD251_1F53;
const ROUND_MUL_1: u32 = 0xCD9E_8D57;
const WEYL_0: u32 = 0x9E37_79B9;
const WEYL_1: u32 = 0xBB67_AE85;

/// Philox-4x32 with 10 rounds: four 32-bit counter words and a two-word key to four random words.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let mut c = counter;
    let mut k = key;
    for round in 0..10 {
        if round > 0 {
            k[0] = k[0].wrapping_add(WEYL_0);
            k[1] = k[1].wrapping_add(WEYL_1);
        }
        let p0 = u64::from(c[0]) * u64::from(ROUND_MUL_0);
        let p1 = u64::from(c[2]) * u64::from(ROUND_MUL_1);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// The keep threshold for drop probability `p`: `min(round(p * 2^32), 2^32 - 1)`.
pub fn dropout_threshold(p: f64) -> u32 {
    let t = (p * 4_294_967_296.0).round();
    if t >= 4_294_967_295.0 {
        u32::MAX
    } else if t <= 0.0 {
        0
    } else {
        t as u32
    }
}

/// The scale of kept elements for drop probability `p`: `1 / (1 - p)`, computed once in f32.
/// With [`dropout_threshold`], the one definition every backend applies to the op's own f64 `p`.
pub fn dropout_scale(p: f64) -> f32 {
    1.0f32 / (1.0f32 - p as f32)
}

/// The Philox key of a 64-bit seed: (low word, high word).
pub fn seed_key(seed: i64) -> [u32; 2] {
    let s = seed as u64;
    [s as u32, (s >> 32) as u32]
}

/// Whether the element at `(plane, row, col)` survives dropout with threshold `threshold`.
pub fn dropout_keep(
    key: [u32; 2],
    stream: u32,
    plane: u32,
    row: u32,
    col: u32,
    threshold: u32,
) -> bool {
    let words = philox4x32_10([col >> 2, row, plane, stream], key);
    words[(col & 3) as usize] >= threshold
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random123's known-answer vectors, as DESIGN.md section 2 reproduces them.
    #[test]
    fn known_answer_vectors() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn threshold_saturates() {
        assert_eq!(dropout_threshold(0.0), 0);
        assert_eq!(dropout_threshold(0.5), 1 << 31);
        assert_eq!(dropout_threshold(0.999_999_999_99), u32::MAX);
    }

    #[test]
    fn seed_key_splits_low_and_high() {
        assert_eq!(seed_key(0x1234_5678_9abc_def0), [0x9abc_def0, 0x1234_5678]);
        assert_eq!(seed_key(-1), [u32::MAX, u32::MAX]);
    }

    #[test]
    fn keep_rate_matches_p() {
        let key = seed_key(42);
        let t = dropout_threshold(0.3);
        let mut kept = 0;
        let n = 64 * 64;
        for row in 0..64 {
            for col in 0..64 {
                kept += dropout_keep(key, 0, 0, row, col, t) as u32;
            }
        }
        let rate = f64::from(kept) / f64::from(n);
        assert!((rate - 0.7).abs() < 0.03, "keep rate {rate}");
    }
}
