//! RoPE frequency schedules from a config: default, linear, dynamic (NTK), llama3, yarn and
//! proportional, following Hugging Face's `modeling_rope_utils` so logits match transformers.
//!
//! `RopeScaling::rope_for(seq_len)` gives the runtime's `Rope` (inverse frequencies plus the
//! cos/sin scaling). Only `dynamic` depends on `seq_len` (the row's last position + 1).

use ferrite_runtime::cpu::Rope;

#[derive(Debug, Clone, PartialEq)]
pub enum RopeKind {
    Default,
    Linear {
        factor: f64,
    },
    /// NTK-aware scaling that grows the base once a sequence passes `max_position_embeddings`.
    Dynamic {
        factor: f64,
        max_position_embeddings: usize,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// Per-frequency divisors, as llama.cpp stores llama3 scaling (`rope_freqs.weight`).
    FreqFactors {
        factors: Vec<f64>,
    },
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: Option<f64>,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        truncate: bool,
    },
    /// Phi-3's long RoPE: each frequency divided by a factor of its own, `short` while the
    /// forward's last position + 1 is within `original_max_position_embeddings`, `long` past
    /// it; cos and sin scaled by `attention_factor` at every length.
    LongRope {
        short: Vec<f64>,
        long: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
    /// Gemma 4's global layers: the first `rope_angles` frequency pairs of a full-width
    /// schedule (exponent over the whole head_dim), the rest zero (not rotated), all / `factor`.
    Proportional {
        factor: f64,
        rope_angles: usize,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeScaling {
    pub theta: f64,
    /// Number of dims per head the schedule covers (head_dim × partial_rotary_factor; the
    /// whole head_dim for `Proportional`, whose tail frequencies are zero).
    pub rotary_dim: usize,
    pub kind: RopeKind,
}

impl RopeScaling {
    /// Whether the frequencies depend on the sequence length.
    pub fn is_dynamic(&self) -> bool {
        matches!(self.kind, RopeKind::Dynamic { .. } | RopeKind::LongRope { .. })
    }

    /// The shortest length whose frequencies are those of `seq_len`: rows whose keys are
    /// equal rotate alike (`rope_for(key)` gives them), so a step needs one table per key.
    pub fn schedule_key(&self, seq_len: usize) -> usize {
        match &self.kind {
            RopeKind::Dynamic { max_position_embeddings, .. } => seq_len.max(*max_position_embeddings),
            RopeKind::LongRope { original_max_position_embeddings: orig, .. } if seq_len > *orig => orig + 1,
            _ => 0,
        }
    }

    pub fn rope_for(&self, seq_len: usize) -> Rope {
        let dim = self.rotary_dim;
        let base_freqs =
            |base: f64| -> Vec<f64> { (0..dim / 2).map(|i| 1.0 / base.powf((2 * i) as f64 / dim as f64)).collect() };
        let (inv, scaling) = match &self.kind {
            RopeKind::Default => (base_freqs(self.theta), 1.0),
            RopeKind::Linear { factor } => (base_freqs(self.theta).iter().map(|f| f / factor).collect(), 1.0),
            RopeKind::Dynamic { factor, max_position_embeddings } => {
                let max = *max_position_embeddings as f64;
                let seq = (seq_len as f64).max(max);
                let base = self.theta * ((factor * seq / max) - (factor - 1.0)).powf(dim as f64 / (dim as f64 - 2.0));
                (base_freqs(base), 1.0)
            }
            RopeKind::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let old = *original_max_position_embeddings as f64;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                let inv = base_freqs(self.theta)
                    .into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                (inv, 1.0)
            }
            RopeKind::FreqFactors { factors } => {
                (base_freqs(self.theta).iter().zip(factors).map(|(f, d)| f / d).collect(), 1.0)
            }
            RopeKind::Yarn { .. } => self.yarn(),
            RopeKind::LongRope { short, long, original_max_position_embeddings, attention_factor } => {
                let ext = if seq_len > *original_max_position_embeddings { long } else { short };
                (base_freqs(self.theta).iter().zip(ext).map(|(f, e)| f / e).collect(), *attention_factor)
            }
            RopeKind::Proportional { factor, rope_angles } => {
                let inv = base_freqs(self.theta)
                    .into_iter()
                    .enumerate()
                    .map(|(i, f)| if i < *rope_angles { f / factor } else { 0.0 })
                    .collect();
                (inv, 1.0)
            }
        };
        Rope::new(inv.into_iter().map(|f| f as f32).collect(), scaling as f32)
    }

    fn yarn(&self) -> (Vec<f64>, f64) {
        let RopeKind::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            mscale,
            mscale_all_dim,
            truncate,
        } = &self.kind
        else {
            unreachable!("yarn() is only called for RopeKind::Yarn")
        };
        let dim = self.rotary_dim as f64;
        let get_mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
        let attention = attention_factor.unwrap_or_else(|| match (mscale, mscale_all_dim) {
            (Some(m), Some(a)) if *m != 0.0 && *a != 0.0 => get_mscale(*factor, *m) / get_mscale(*factor, *a),
            _ => get_mscale(*factor, 1.0),
        });
        let omax = *original_max_position_embeddings as f64;
        let correction_dim =
            |rot: f64| (dim * (omax / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * self.theta.ln());
        let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
        if *truncate {
            low = low.floor();
            high = high.ceil();
        }
        let low = low.max(0.0);
        let mut high = high.min(dim - 1.0);
        if low == high {
            high += 0.001;
        }
        let half = self.rotary_dim / 2;
        let inv = (0..half)
            .map(|i| {
                let pos_freq = self.theta.powf((2 * i) as f64 / dim);
                let extrapolation = 1.0 / pos_freq;
                let interpolation = 1.0 / (factor * pos_freq);
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let extrapolation_factor = 1.0 - ramp;
                interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
            })
            .collect();
        (inv, attention)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proportional_rotates_the_first_pairs_of_a_full_width_schedule() {
        let rope = RopeScaling {
            theta: 10000.0,
            rotary_dim: 16,
            kind: RopeKind::Proportional { factor: 2.0, rope_angles: 2 },
        };
        let r = rope.rope_for(0);
        let want = [0.5, 0.5 * 10000f64.powf(-2.0 / 16.0), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        assert_eq!(r.inv_freq.len(), 8);
        for (g, w) in r.inv_freq.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-7, "{:?}", r.inv_freq);
        }
    }

    /// Lengths of one key get the frequencies (and scaling) of that key: what lets a step
    /// upload one table per key.
    #[test]
    fn schedule_keys_group_lengths_of_equal_frequencies() {
        let long = RopeScaling {
            theta: 10000.0,
            rotary_dim: 4,
            kind: RopeKind::LongRope {
                short: vec![1.0, 2.0],
                long: vec![3.0, 4.0],
                original_max_position_embeddings: 32,
                attention_factor: 1.2,
            },
        };
        let dynamic =
            RopeScaling { kind: RopeKind::Dynamic { factor: 2.0, max_position_embeddings: 32 }, ..long.clone() };
        let fixed = RopeScaling { kind: RopeKind::Default, ..long.clone() };
        for s in [&long, &dynamic, &fixed] {
            for len in [0, 1, 31, 32, 33, 40, 1000] {
                let (a, b) = (s.rope_for(len), s.rope_for(s.schedule_key(len)));
                assert_eq!(a.inv_freq, b.inv_freq, "{:?} len {len}", s.kind);
                assert_eq!(a.attention_scaling, b.attention_scaling);
            }
        }
        assert_eq!((long.schedule_key(32), long.schedule_key(33), long.schedule_key(500)), (0, 33, 33));
        assert_eq!((dynamic.schedule_key(5), dynamic.schedule_key(40)), (32, 40));
        assert_ne!(long.rope_for(32).inv_freq, long.rope_for(33).inv_freq);
    }
}
