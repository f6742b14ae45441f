//! Rotary position embedding frequencies, with the scalings Hugging Face configs name.

use serde::{Deserialize, Serialize};

/// How the rotary frequencies are scaled (`rope_scaling` / `rope_parameters.rope_type`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, Default)]
pub enum RopeScaling {
    /// `rope_type: "default"`: `inv_freq[i] = theta^(-2i / D)`.
    #[default]
    Default,
    /// `rope_type: "linear"`: every frequency divided by `factor`.
    Linear {
        /// Position interpolation factor.
        factor: f64,
    },
    /// `rope_type: "llama3"`: low frequencies divided by `factor`, high ones kept, a smooth ramp
    /// between (Llama 3.1 / 3.2).
    Llama3 {
        /// Scaling factor of the low frequencies.
        factor: f64,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are scaled.
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are kept.
        high_freq_factor: f64,
        /// The context length the model was trained with.
        original_max_position_embeddings: f64,
    },
    /// `rope_type: "yarn"` (YaRN): frequencies of fewer than `beta_slow` turns over the original
    /// context divided by `factor`, those of more than `beta_fast` kept, a linear ramp over the
    /// dimensions between; cos and sin multiplied by `attention_factor`.
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// The context length the model was trained with.
        original_max_position_embeddings: f64,
        /// Turns over the original context above which a frequency is kept (32 by default).
        beta_fast: f64,
        /// Turns below which it is interpolated (1 by default).
        beta_slow: f64,
        /// The factor on cos and sin (by default `0.1 ln(factor) + 1`, or the ratio of the
        /// `mscale` and `mscale_all_dim` forms where the config gives both).
        attention_factor: f64,
        /// Whether the ramp's ends are rounded outwards to whole dimensions (`truncate`, true by
        /// default).
        truncate: bool,
    },
}

impl RopeScaling {
    /// Checks the parameters, saying which one is out of range.
    pub fn validate(&self) -> Result<(), String> {
        match self {
            RopeScaling::Default => Ok(()),
            RopeScaling::Linear { factor } if *factor > 0.0 => Ok(()),
            RopeScaling::Linear { factor } => Err(format!("rope factor must be > 0, got {factor}")),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                if *factor > 0.0
                    && *low_freq_factor > 0.0
                    && high_freq_factor > low_freq_factor
                    && *original_max_position_embeddings > 0.0
                {
                    Ok(())
                } else {
                    Err(format!("invalid llama3 rope scaling {self:?}"))
                }
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                ..
            } => {
                if *factor > 0.0
                    && *original_max_position_embeddings > 0.0
                    && *beta_fast > 0.0
                    && *beta_slow > 0.0
                    && attention_factor.is_finite()
                {
                    Ok(())
                } else {
                    Err(format!("invalid yarn rope scaling {self:?}"))
                }
            }
        }
    }

    /// YaRN's `attention_factor` where a config does not give one: `0.1 mscale ln(factor) + 1`
    /// (1 for factors up to 1), as a ratio of the `mscale` and `mscale_all_dim` forms where both
    /// are given.
    pub fn yarn_attention_factor(factor: f64, mscale: Option<f64>, all_dims: Option<f64>) -> f64 {
        let m = |scale: f64| {
            if factor <= 1.0 {
                1.0
            } else {
                0.1 * scale * factor.ln() + 1.0
            }
        };
        match (mscale, all_dims) {
            (Some(a), Some(b)) if a != 0.0 && b != 0.0 => m(a) / m(b),
            _ => m(1.0),
        }
    }

    /// `(sin, cos)` of `position * inv_freq`, times YaRN's attention factor (1 otherwise).
    pub fn sin_cos(&self, position: f64, inv_freq: f64) -> (f64, f64) {
        let (sin, cos) = (position * inv_freq).sin_cos();
        match self {
            RopeScaling::Yarn {
                attention_factor, ..
            } => (sin * attention_factor, cos * attention_factor),
            _ => (sin, cos),
        }
    }

    /// The `D / 2` inverse frequencies for head dim `head_dim` and base `theta`.
    pub fn inv_freq(&self, theta: f64, head_dim: usize) -> Vec<f64> {
        let base = (0..head_dim / 2).map(|i| (i, theta.powf(-((2 * i) as f64) / head_dim as f64)));
        match self {
            RopeScaling::Default => base.map(|(_, b)| b).collect(),
            RopeScaling::Linear { factor } => base.map(|(_, b)| b / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => base
                .map(|(_, b)| {
                    let wavelen = 2.0 * std::f64::consts::PI / b;
                    let low_wavelen = old / low_freq_factor;
                    let high_wavelen = old / high_freq_factor;
                    if wavelen > low_wavelen {
                        b / factor
                    } else if wavelen < high_wavelen {
                        b
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * b / factor + smooth * b
                    }
                })
                .collect(),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: old,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let (low, high) =
                    yarn_ramp(theta, head_dim, *old, (*beta_fast, *beta_slow), *truncate);
                base.map(|(i, b)| {
                    let t = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    b / factor * t + b * (1.0 - t)
                })
                .collect()
            }
        }
    }
}

/// YaRN's ramp over the `head_dim / 2` frequencies: from the dimension whose frequency turns
/// `beta_fast` times over the original context `old` (kept below it) to the one that turns
/// `beta_slow` times (interpolated above it), rounded outwards where `truncate`.
fn yarn_ramp(
    theta: f64,
    head_dim: usize,
    old: f64,
    (beta_fast, beta_slow): (f64, f64),
    truncate: bool,
) -> (f64, f64) {
    let dim = head_dim as f64;
    let at =
        |turns: f64| dim * (old / (turns * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
    let (mut low, mut high) = (at(beta_fast), at(beta_slow));
    if truncate {
        (low, high) = (low.floor(), high.ceil());
    }
    let (low, high) = (low.max(0.0), high.min(dim - 1.0));
    (low, if low == high { high + 0.001 } else { high })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies_follow_theta() {
        let f = RopeScaling::Default.inv_freq(10000.0, 8);
        assert_eq!(f.len(), 4);
        assert!((f[0] - 1.0).abs() < 1e-15);
        assert!((f[1] - 10000f64.powf(-0.25)).abs() < 1e-15);
    }

    #[test]
    fn llama3_scales_only_low_frequencies() {
        let s = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let base = RopeScaling::Default.inv_freq(500000.0, 64);
        let scaled = s.inv_freq(500000.0, 64);
        assert_eq!(scaled[0], base[0], "the highest frequency is kept");
        let last = base.len() - 1;
        assert!(
            (scaled[last] - base[last] / 8.0).abs() < 1e-18,
            "the lowest is divided"
        );
    }

    /// transformers' `_compute_yarn_parameters` (5.25) for head dim 16, theta 10000, factor 4
    /// over an original context of 64: with the defaults, then without truncation and with both
    /// `mscale` forms. A frequency differs from the defaults' where the ramp's ends move.
    #[test]
    fn yarn_follows_transformers() {
        let yarn = |truncate, attention_factor| RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 64.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor,
            truncate,
        };
        let cases = [
            (
                yarn(true, RopeScaling::yarn_attention_factor(4.0, None, None)),
                [
                    1.0,
                    0.237_170_815,
                    0.049_999_997,
                    0.007_905_694_6,
                    0.002_5,
                    7.905_694_6e-4,
                ],
                1.138_629_436_111_989,
            ),
            (
                yarn(
                    false,
                    RopeScaling::yarn_attention_factor(4.0, Some(1.2), Some(0.8)),
                ),
                [
                    1.0,
                    0.198_583_528,
                    0.025_595_250,
                    0.007_905_694_6,
                    0.002_5,
                    7.905_694_6e-4,
                ],
                1.049_915_921_593_933_8,
            ),
        ];
        for (scaling, want, factor) in cases {
            scaling.validate().unwrap();
            let got = scaling.inv_freq(10000.0, 16);
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() < 1e-6 * w, "{got:?} against {want:?}");
            }
            let (sin, cos) = scaling.sin_cos(3.0, 0.5);
            assert!((sin - 1.5f64.sin() * factor).abs() < 1e-12);
            assert!((cos - 1.5f64.cos() * factor).abs() < 1e-12);
        }
        assert_eq!(RopeScaling::Default.sin_cos(3.0, 0.5), 1.5f64.sin_cos());
    }
}
