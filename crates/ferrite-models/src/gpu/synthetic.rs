//! Synthetic models for benchmarks: the `config.json` of real checkpoints, to be filled with
//! random weights on the device (`DecoderWeights::random`), so a benchmark of a real shape
//! needs no files. Every family the plan knows reads them like a checkpoint's config.

use serde_json::{json, Value};

/// The shapes `--synthetic` knows, by name.
pub const SYNTHETIC_MODELS: [&str; 9] = [
    "llama-3.1-8b",
    "llama-3.2-1b",
    "qwen2.5-1.5b",
    "smollm2-135m",
    "gemma-4-e4b",
    "qwen3-30b-a3b",
    "gemma-4-26b-a4b",
    "qwen3-4b",
    "qwen3.5-4b",
];

/// Llama 3's RoPE parameters with `factor`.
fn llama3_rope(factor: f64) -> Value {
    json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192, "rope_theta": 500_000.0})
}

/// The `config.json` of synthetic model `name` (one of `SYNTHETIC_MODELS`).
///
/// `gemma-4-e4b` is the text decoder of Gemma 4 E4B: transformers 5.17's `Gemma4TextConfig`
/// defaults (head_dim 256, global head_dim 512, window 512, every 6th layer global and the
/// last forced global, proportional RoPE θ 1e6 on a quarter of the global dims, default RoPE
/// θ 1e4 on sliding layers, per-layer inputs of 256 over a 262,144 vocabulary, tied
/// embeddings) with the E4B checkpoint's sizes: hidden 2560, MLP 10240, 42 layers, 8 query
/// and 2 KV heads, the last 18 layers KV-shared, final logit softcap 30.
///
/// `qwen3-30b-a3b` is Qwen3-30B-A3B's published config.json: 48 layers, hidden 2048, 32 query
/// and 4 KV heads of 128, 128 experts of width 768 with 8 per token (renormalized) on every
/// layer, vocabulary 151,936, RoPE θ 1e6, untied head (30.5 B parameters, 3.3 B active).
/// `gemma-4-26b-a4b` is Gemma 4 26B-A4B's text config: 30 layers, hidden 2816, 16 query heads,
/// 8 KV heads of 256 on the sliding layers (window 1024) and 2 of 512 on every 6th (global,
/// keys used as values), a GeGLU MLP of 2112 beside 128 experts of width 704, 8 per token,
/// the rest `Gemma4TextConfig`'s defaults as for E4B, no per-layer inputs or shared KV
/// (25.2 B parameters, 3.8 B active).
///
/// `qwen3.5-4b` is the hybrid of Qwen3.5-4B's text config as we know it (no hub here to check
/// it against): 32 layers, hidden 2560, MLP 9216, every 4th layer gated full attention (16
/// query and 4 KV heads of 256, RoPE θ 1e7 on a quarter of the dims), the other 24 gated
/// DeltaNet (16 key and 32 value heads of 128, conv kernel 4), vocabulary 248,320, tied
/// embeddings (4.2 B parameters). `qwen3-4b` is Qwen3-4B's published config, the dense model of
/// about its size to set it beside: 36 layers, hidden 2560, MLP 9728, 32 query and 8 KV heads
/// of 128 with q/k norms, vocabulary 151,936, tied embeddings (4.0 B parameters).
pub fn synthetic_config(name: &str) -> Option<Value> {
    #[allow(clippy::too_many_arguments)]
    let llama = |vocab: usize,
                 hidden: usize,
                 inter: usize,
                 layers: usize,
                 heads: usize,
                 kv: usize,
                 rope: Value,
                 max_pos: usize,
                 tie: bool| {
        json!({
            "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_parameters": rope,
            "max_position_embeddings": max_pos, "tie_word_embeddings": tie,
        })
    };
    let plain = |theta: f64| json!({"rope_type": "default", "rope_theta": theta});
    match name {
        "llama-3.1-8b" => Some(llama(128_256, 4096, 14_336, 32, 32, 8, llama3_rope(8.0), 131_072, false)),
        "llama-3.2-1b" => Some(llama(128_256, 2048, 8192, 16, 32, 8, llama3_rope(32.0), 131_072, true)),
        "qwen2.5-1.5b" => {
            let mut j = llama(151_936, 1536, 8960, 28, 12, 2, plain(1_000_000.0), 32_768, true);
            j["model_type"] = json!("qwen2");
            j["rms_norm_eps"] = json!(1e-6);
            Some(j)
        }
        "smollm2-135m" => Some(llama(49_152, 576, 1536, 30, 9, 3, plain(100_000.0), 8192, true)),
        "gemma-4-e4b" => Some(json!({
            "model_type": "gemma4_text", "vocab_size": 262_144, "hidden_size": 2560, "intermediate_size": 10_240,
            "num_hidden_layers": 42, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
            "global_head_dim": 512, "sliding_window": 512, "num_kv_shared_layers": 18,
            "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": true, "final_logit_softcapping": 30.0, "bos_token_id": 2, "eos_token_id": 1,
        })),
        "qwen3-30b-a3b" => Some(json!({
            "model_type": "qwen3_moe", "vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 6144,
            "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "rope_parameters": plain(1_000_000.0), "max_position_embeddings": 40_960,
            "tie_word_embeddings": false, "bos_token_id": 151_643, "eos_token_id": 151_645,
        })),
        "gemma-4-26b-a4b" => Some(json!({
            "model_type": "gemma4_text", "vocab_size": 262_144, "hidden_size": 2816, "intermediate_size": 2112,
            "num_hidden_layers": 30, "num_attention_heads": 16, "num_key_value_heads": 8,
            "num_global_key_value_heads": 2, "head_dim": 256, "global_head_dim": 512, "attention_k_eq_v": true,
            "sliding_window": 1024, "enable_moe_block": true, "num_experts": 128, "top_k_experts": 8,
            "moe_intermediate_size": 704, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 262_144, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": true, "final_logit_softcapping": 30.0, "bos_token_id": 2, "eos_token_id": 1,
        })),
        "qwen3-4b" => {
            let mut j = llama(151_936, 2560, 9728, 36, 32, 8, plain(1_000_000.0), 40_960, true);
            j["model_type"] = json!("qwen3");
            j["head_dim"] = json!(128);
            j["rms_norm_eps"] = json!(1e-6);
            Some(j)
        }
        "qwen3.5-4b" => {
            let full = |i: usize| if i % 4 == 3 { "full_attention" } else { "linear_attention" };
            Some(json!({
                "model_type": "qwen3_5_text", "vocab_size": 248_320, "hidden_size": 2560, "intermediate_size": 9216,
                "num_hidden_layers": 32, "layer_types": (0..32).map(full).collect::<Vec<_>>(),
                "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
                "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                "linear_num_key_heads": 16, "linear_num_value_heads": 32, "hidden_act": "silu",
                "rms_norm_eps": 1e-6, "partial_rotary_factor": 0.25,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
                "max_position_embeddings": 262_144, "tie_word_embeddings": true,
            }))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ConfigSource, ModelConfig};
    use crate::plan::DecoderPlan;

    fn plan_of(json: &Value) -> (ModelConfig, DecoderPlan) {
        let path = std::path::Path::new("config.json");
        let mut cfg = ModelConfig::from_hf_json(path, json).expect("config");
        let plan = (cfg.arch.plan)(&mut cfg, &ConfigSource::Hf { path, json }).expect("plan");
        (cfg, plan)
    }

    #[test]
    fn gemma_4_e4b_shared_layers_take_proportionally_less_device_kv() {
        let json = synthetic_config("gemma-4-e4b").expect("e4b");
        let mut unshared = json.clone();
        unshared["num_kv_shared_layers"] = json!(0);
        let bytes = |j: &Value| -> usize { plan_of(j).1.layout.block_bytes(1).iter().sum() };
        let (with, without) = (bytes(&json), bytes(&unshared));
        // 42 layers, every 6th global (7): sliding K+V 2 heads x 256, global 2 heads x 512, bf16.
        let (sliding, global) = (2 * 2 * 256 * 2, 2 * 2 * 512 * 2);
        assert_eq!(without, 35 * sliding + 7 * global);
        // The last 18 layers (15 sliding, 3 global) own no KV.
        assert_eq!(with, 20 * sliding + 4 * global);
    }

    #[test]
    fn every_synthetic_name_has_a_cuda_ready_plan() {
        for name in SYNTHETIC_MODELS {
            let (_, plan) = plan_of(&synthetic_config(name).expect(name));
            assert_eq!(super::super::decoder::unsupported(&plan), None, "{name}");
        }
        assert!(synthetic_config("llama-9000").is_none());
        // Llama-3.1-8B has 8.03 B parameters.
        let (cfg, plan) = plan_of(&synthetic_config("llama-3.1-8b").expect("8b"));
        let (d, v) = (cfg.hidden_size, cfg.vocab_size);
        let per_layer: usize = plan
            .layers
            .iter()
            .map(|l| {
                let p = &l.attn.params;
                (p.n_heads + 2 * p.n_kv_heads) * p.head_dim * d
                    + d * p.n_heads * p.head_dim
                    + 3 * l.ffn.intermediate * d
            })
            .sum();
        let params = per_layer + 2 * v * d;
        assert!((8_000_000_000..8_100_000_000).contains(&params), "{params}");
    }

    /// (total, active) parameters of a plan: attention, dense MLPs, routers and experts (all,
    /// or `top_k` of them), the embedding and an untied head.
    fn parameters(cfg: &ModelConfig, plan: &DecoderPlan) -> (usize, usize) {
        let d = cfg.hidden_size;
        let (mut total, mut active) = (0, 0);
        for l in &plan.layers {
            let p = &l.attn.params;
            let kv = if l.attn.k_eq_v { 1 } else { 2 };
            let attn = (p.n_heads + kv * p.n_kv_heads) * p.head_dim * d + d * p.n_heads * p.head_dim;
            let dense = if l.ffn.dense() { 3 * l.ffn.intermediate * d } else { 0 };
            let (all, used) = l.ffn.moe.as_ref().map_or((0, 0), |m| {
                let expert = 3 * m.shape.intermediate * d;
                (m.shape.num_experts * (expert + d), m.shape.top_k * expert + m.shape.num_experts * d)
            });
            total += attn + dense + all;
            active += attn + dense + used;
        }
        let embeddings = if cfg.tie_word_embeddings { 1 } else { 2 } * cfg.vocab_size * d;
        (total + embeddings, active + embeddings)
    }

    #[test]
    fn moe_shapes_have_their_published_sizes() {
        // Qwen3-30B-A3B: 30.5 B parameters, 3.3 B active; Gemma 4 26B-A4B: 25.2 B, 3.8 B.
        let cases = [("qwen3-30b-a3b", 30.5e9, 3.3e9, 48, 0), ("gemma-4-26b-a4b", 25.2e9, 3.8e9, 30, 2112)];
        for (name, total, active, layers, dense) in cases {
            let (cfg, plan) = plan_of(&synthetic_config(name).expect(name));
            let (t, a) = parameters(&cfg, &plan);
            assert!((t as f64 / total - 1.0).abs() < 0.01, "{name}: {t} parameters");
            assert!((a as f64 / active - 1.0).abs() < 0.03, "{name}: {a} active");
            assert_eq!(plan.layers.iter().filter(|l| l.ffn.moe.is_some()).count(), layers, "{name}");
            let widths: Vec<usize> = plan.layers.iter().filter(|l| l.ffn.dense()).map(|l| l.ffn.intermediate).collect();
            assert!(widths.iter().all(|&w| w == dense) && widths.len() == if dense > 0 { layers } else { 0 }, "{name}");
        }
    }

    #[test]
    fn four_b_shapes_have_their_sizes() {
        // Qwen3-4B: 4.02 B parameters, 36 full-attention layers with q/k norms.
        let (cfg, plan) = plan_of(&synthetic_config("qwen3-4b").expect("qwen3-4b"));
        let (t, _) = parameters(&cfg, &plan);
        assert!((t as f64 / 4.02e9 - 1.0).abs() < 0.01, "qwen3-4b: {t} parameters");
        assert!(plan.layers.iter().all(|l| l.attn.linear.is_none() && l.attn.qk_norm.is_some()));
        // Qwen3.5-4B: every 4th layer full (gated) attention, the other 24 DeltaNet.
        let (_, plan) = plan_of(&synthetic_config("qwen3.5-4b").expect("qwen3.5-4b"));
        let linear: Vec<bool> = plan.layers.iter().map(|l| l.attn.linear.is_some()).collect();
        assert_eq!(linear, (0..32).map(|i| i % 4 != 3).collect::<Vec<_>>());
        assert!(plan.layers.iter().filter(|l| l.attn.linear.is_none()).all(|l| l.attn.output_gate));
    }
}
