//! The CUDA op set: plain functions over device buffers, one per CPU op they mirror.

pub mod attention;
pub mod deltanet;
pub mod elementwise;
pub mod fp8;
pub mod gemma;
pub mod kv_pool;
pub mod lora;
pub mod matrix;
pub mod moe;
pub mod norm;
pub mod quant;
pub mod sampling;

pub use attention::{attention, decode_attention_rope, AttentionMeta, DecodePlan, DecodeScratch, QkNorms};
pub use deltanet::{
    delta_conv, delta_gates, delta_out_norm, delta_qk_norm, delta_rule, DeviceStatePool, StateTable,
    DELTA_CHUNK_MIN_TOKENS, DELTA_MAX_CONV_KERNEL, DELTA_MAX_K_DIM,
};
pub use elementwise::{
    activation, add_sigmoid_scaled, copy, embedding, gated_activation, linear, linear_gated, random_uniform, rope,
    rope_per_token, scale_softcap, sigmoid_gate_mul, GatedActivation, RopeShape, TableElement,
};
pub use fp8::{fp8_embedding, fp8_linear, fp8_linear_gated, Fp8Matrix};
pub use gemma::{per_layer_inputs, qkv_norm, PerLayerShape, QkvHeads};
pub use kv_pool::{convert_blocks, write_kv, DeviceKv, DevicePool};
pub use lora::{lora_add, LoraMatrices, LoraStep, LoraTable, LORA_MAX_RANK, LORA_TARGETS};
pub use matrix::Matrix;
pub use moe::{
    moe_down, moe_linear, moe_route, ExpertMatrix, ExpertProduct, ExpertSum, MoeRoute, MOE_MAX_EXPERTS, MOE_MAX_TOP_K,
};
pub use norm::{norm, norm_add, residual_add, rms_norm, rms_norm_add, NormWeights};
pub use quant::{dequantize, quant_embedding, quant_linear, quant_linear_gated, QuantMatrix};
pub use sampling::{
    argmax, carry_picks, pick, sample, ArgmaxScratch, RowSampling, SampledDev, SamplingParamsDev, MAX_TOP,
};
