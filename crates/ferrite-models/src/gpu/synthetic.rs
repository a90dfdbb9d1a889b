//! Synthetic models for benchmarks: the configs of real llama-family and Gemma checkpoints,
//! to be filled with random weights on the device (`LlamaWeights::random`,
//! `GemmaWeights::random`), so a benchmark of a real shape needs no files.

use crate::config::{Activation, Architecture, ModelConfig};
use crate::rope_scaling::{RopeKind, RopeScaling};

/// The shapes `--synthetic` knows, by name.
pub const SYNTHETIC_MODELS: [&str; 4] = ["llama-3.1-8b", "llama-3.2-1b", "qwen2.5-1.5b", "smollm2-135m"];

/// The Gemma shapes `--synthetic` knows (their configs are HF `config.json` values).
pub const SYNTHETIC_GEMMA: [&str; 1] = ["gemma-4-e4b"];

/// The `config.json` of synthetic Gemma model `name` (one of `SYNTHETIC_GEMMA`).
///
/// `gemma-4-e4b` is the text decoder of Gemma 4 E4B: transformers 5.17's `Gemma4TextConfig`
/// defaults (head_dim 256, global head_dim 512, window 512, every 6th layer global and the
/// last forced global, proportional RoPE θ 1e6 on a quarter of the global dims, default RoPE
/// θ 1e4 on sliding layers, per-layer inputs of 256 over a 262,144 vocabulary, tied
/// embeddings) with the E4B checkpoint's sizes: hidden 2560, MLP 10240, 42 layers, 8 query
/// and 2 KV heads, the last 18 layers KV-shared, final logit softcap 30.
pub fn synthetic_gemma(name: &str) -> Option<serde_json::Value> {
    match name {
        "gemma-4-e4b" => Some(serde_json::json!({
            "model_type": "gemma4_text", "vocab_size": 262_144, "hidden_size": 2560, "intermediate_size": 10_240,
            "num_hidden_layers": 42, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
            "global_head_dim": 512, "sliding_window": 512, "num_kv_shared_layers": 18,
            "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262_144,
            "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": true, "final_logit_softcapping": 30.0, "bos_token_id": 2, "eos_token_id": 1,
        })),
        _ => None,
    }
}

/// Llama 3's RoPE schedule with `factor`.
fn llama3_rope(head_dim: usize, factor: f64) -> RopeScaling {
    RopeScaling {
        theta: 500_000.0,
        rotary_dim: head_dim,
        kind: RopeKind::Llama3 {
            factor,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        },
    }
}

/// The config of synthetic model `name` (one of `SYNTHETIC_MODELS`), as its HF config.json has it.
pub fn synthetic_config(name: &str) -> Option<ModelConfig> {
    let llama = |vocab, hidden, inter, layers, heads, kv_heads, head_dim, rope, max_pos, tie| ModelConfig {
        arch: Architecture::Llama,
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        rms_norm_eps: 1e-5,
        rope,
        max_position_embeddings: max_pos,
        hidden_act: Activation::Silu,
        tie_word_embeddings: tie,
        qkv_bias: false,
        qk_norm: false,
        sliding_window: None,
        bos_token_id: None,
        eos_token_ids: vec![],
    };
    let plain = |theta: f64, head_dim| RopeScaling { theta, rotary_dim: head_dim, kind: RopeKind::Default };
    match name {
        "llama-3.1-8b" => Some(llama(128_256, 4096, 14_336, 32, 32, 8, 128, llama3_rope(128, 8.0), 131_072, false)),
        "llama-3.2-1b" => Some(llama(128_256, 2048, 8192, 16, 32, 8, 64, llama3_rope(64, 32.0), 131_072, true)),
        "qwen2.5-1.5b" => Some(ModelConfig {
            arch: Architecture::Qwen2,
            qkv_bias: true,
            rms_norm_eps: 1e-6,
            ..llama(151_936, 1536, 8960, 28, 12, 2, 128, plain(1_000_000.0, 128), 32_768, true)
        }),
        "smollm2-135m" => Some(llama(49_152, 576, 1536, 30, 9, 3, 64, plain(100_000.0, 64), 8192, true)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// bf16 KV bytes per token of the device pool `GpuGemma` allocates for `json`.
    fn gemma_kv_bytes_per_token(json: &serde_json::Value) -> usize {
        let path = std::path::Path::new("config.json");
        let mut cfg = ModelConfig::from_hf_json(path, json).expect("config");
        let plan = crate::gemma_plan::plan(&mut cfg, &crate::config::ConfigSource::Hf { path, json }).expect("plan");
        assert_eq!(super::super::gemma::gemma_unsupported(&plan), None);
        plan.layout.block_bytes_of(1, 2).iter().sum()
    }

    #[test]
    fn gemma_4_e4b_shared_layers_take_proportionally_less_device_kv() {
        let json = synthetic_gemma("gemma-4-e4b").expect("e4b");
        let mut unshared = json.clone();
        unshared["num_kv_shared_layers"] = serde_json::json!(0);
        let (with, without) = (gemma_kv_bytes_per_token(&json), gemma_kv_bytes_per_token(&unshared));
        // 42 layers, every 6th global (7): sliding K+V 2 heads x 256, global 2 heads x 512, bf16.
        let (sliding, global) = (2 * 2 * 256 * 2, 2 * 2 * 512 * 2);
        assert_eq!(without, 35 * sliding + 7 * global);
        // The last 18 layers (15 sliding, 3 global) own no KV.
        assert_eq!(with, 20 * sliding + 4 * global);
        println!("gemma-4-e4b KV bytes per token: {with} with shared layers, {without} without");
        assert!(synthetic_config("gemma-4-e4b").is_none() && synthetic_gemma("llama-3.1-8b").is_none());
    }

    #[test]
    fn every_synthetic_name_has_a_cuda_ready_config() {
        for name in SYNTHETIC_MODELS {
            let cfg = synthetic_config(name).expect(name);
            assert_eq!(cfg.num_heads * cfg.head_dim % cfg.num_kv_heads, 0, "{name}");
            assert_eq!(super::super::llama::unsupported(&cfg), None, "{name}");
        }
        assert!(synthetic_config("llama-9000").is_none());
        // Llama-3.1-8B has 8.03 B parameters.
        let p = super::super::weights::weight_bytes(&synthetic_config("llama-3.1-8b").expect("8b")) / 2;
        assert!((8_000_000_000..8_100_000_000).contains(&p), "{p}");
    }
}
