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
        }
    }

    /// The `D / 2` inverse frequencies for head dim `head_dim` and base `theta`.
    pub fn inv_freq(&self, theta: f64, head_dim: usize) -> Vec<f64> {
        let half = head_dim / 2;
        (0..half)
            .map(|i| {
                let base = theta.powf(-((2 * i) as f64) / head_dim as f64);
                match self {
                    RopeScaling::Default => base,
                    RopeScaling::Linear { factor } => base / factor,
                    RopeScaling::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position_embeddings: old,
                    } => {
                        let wavelen = 2.0 * std::f64::consts::PI / base;
                        let low_wavelen = old / low_freq_factor;
                        let high_wavelen = old / high_freq_factor;
                        if wavelen > low_wavelen {
                            base / factor
                        } else if wavelen < high_wavelen {
                            base
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * base / factor + smooth * base
                        }
                    }
                }
            })
            .collect()
    }
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
}
