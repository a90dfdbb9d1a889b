//! BERT (`bert`, HF `BertModel`): the encoder of sentence-transformers' MiniLM and bge-small
//! class embedders. Word + absolute position + token-type embeddings summed and LayerNormed;
//! post-LN layers (`x = LN(x + attn(x))`, `x = LN(x + mlp(x))`) of bidirectional attention
//! without RoPE and a plain MLP with the exact GELU, biases on every projection; no final norm
//! and no LM head: the plan only embeds. Tensor names are `BertModel`'s (`embeddings.*`,
//! `encoder.layer.N.*`), as sentence-transformers saves them.

use serde_json::Value;

use crate::config::{get_f64, get_usize, ConfigSource, ModelConfig};
use crate::error::Result;
use crate::plan::{DecoderPlan, EncoderInput, InputKind, LayerNames, MlpNames, NormKind, QkvNames};

pub fn plan(cfg: &mut ModelConfig, src: &ConfigSource) -> Result<DecoderPlan> {
    let ConfigSource::Hf { json, .. } = src else {
        return Err(src.error("bert is read from Hugging Face directories only"));
    };
    let flag = |key: &str| json.get(key).and_then(Value::as_bool) == Some(true);
    for key in ["is_decoder", "add_cross_attention"] {
        if flag(key) {
            return Err(src.error(format!("{key} = true is not supported (ferrite runs BERT as an encoder)")));
        }
    }
    match json.get("position_embedding_type").and_then(Value::as_str) {
        None | Some("absolute") => {}
        Some(other) => {
            return Err(src.error(format!("position_embedding_type '{other}' is not supported (absolute)")));
        }
    }
    let eps = get_f64(json, "layer_norm_eps").unwrap_or(1e-12);
    if !(eps.is_finite() && eps > 0.0 && eps < 1.0) {
        return Err(src.error(format!("layer_norm_eps is {eps} (expected a number in (0, 1))")));
    }
    let types = get_usize(json, "type_vocab_size").unwrap_or(2);
    if types == 0 {
        return Err(src.error("type_vocab_size is 0 (expected at least 1)"));
    }
    cfg.rms_norm_eps = eps as f32;
    cfg.qkv_bias = true;
    cfg.qk_norm = false;
    // `BertModel` has no LM head: a bidirectional plan never makes logits (`Decoder::step`
    // refuses), and the word embedding stands in for the head it never uses.
    cfg.tie_word_embeddings = true;
    let mut plan = super::llama::base(cfg);
    for (i, l) in plan.layers.iter_mut().enumerate() {
        let p = |s: &str| format!("encoder.layer.{i}.{s}");
        l.attn.rope.rotary_dim = 0;
        l.attn.params.causal = false;
        l.attn.o_bias = true;
        l.ffn.bias = true;
        l.names = LayerNames {
            input_norm: None,
            pre_ffn_norm: None,
            attn_residual_norm: Some(p("attention.output.LayerNorm")),
            ffn_residual_norm: Some(p("output.LayerNorm")),
            qkv: QkvNames::Separate {
                q: p("attention.self.query"),
                k: p("attention.self.key"),
                v: p("attention.self.value"),
            },
            o: p("attention.output.dense"),
            mlp: MlpNames::Plain { up: p("intermediate.dense"), down: p("output.dense") },
            ..LayerNames::llama(i)
        };
    }
    plan.input = InputKind::Encoder(EncoderInput {
        words: "embeddings.word_embeddings".into(),
        positions: "embeddings.position_embeddings".into(),
        max_positions: cfg.max_position_embeddings,
        token_types: "embeddings.token_type_embeddings".into(),
        types,
        norm: "embeddings.LayerNorm".into(),
    });
    plan.norm = NormKind::Layer;
    plan.final_norm = None;
    Ok(plan)
}
