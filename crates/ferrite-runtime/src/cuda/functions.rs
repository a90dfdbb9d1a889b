//! The compiled kernels of one device, by name: modules loaded from the NVRTC images and the
//! functions the ops launch (the quantized kernels by GGUF block type).

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use super::compile::{Image, SOURCES};
use super::error::{CudaError, CudaResult};
use super::ops::deltanet::{delta_chunk_shared, DELTA_K_DIMS};
use crate::dtype::{DType, MlxScale};

/// Head dims the attention kernels are instantiated for, in the order of their arrays below.
pub(crate) const HEAD_DIMS: [usize; 6] = [16, 32, 64, 128, 256, 512];

/// KV cache formats the attention kernels read, by module suffix: bf16, int8, int4, fp8
/// (`kv_format.cuh`; `DeviceKv::format` is the index).
pub(crate) const KV_FORMATS: [&str; 4] = ["", "_int8", "_int4", "_fp8"];

pub(crate) struct Functions {
    pub embedding_bf16: CudaFunction,
    pub embedding_f32: CudaFunction,
    /// The norms (`norm.cu`).
    pub rms_norm: CudaFunction,
    pub layer_norm: CudaFunction,
    pub rms_norm_add: CudaFunction,
    pub layer_norm_add: CudaFunction,
    pub residual_add: CudaFunction,
    pub rope: CudaFunction,
    pub silu_mul: CudaFunction,
    pub gelu_tanh_mul: CudaFunction,
    pub silu_inplace: CudaFunction,
    pub gelu_tanh_inplace: CudaFunction,
    pub logit_epilogue: CudaFunction,
    /// The sigmoid gates of a gated attention output and of a shared expert (`activation.cu`).
    pub sigmoid_gate_mul: CudaFunction,
    pub add_sigmoid_scaled: CudaFunction,
    pub write_kv: CudaFunction,
    /// `write_kv_{int8,int4,fp8}`: the KV write into a quantized pool (format index − 1).
    pub write_kv_quant: [CudaFunction; 3],
    /// `convert_blocks_{int8,int4,fp8}`: bf16 blocks quantized into a quantized pool.
    pub convert_blocks: [CudaFunction; 3],
    pub fp8_calibrate: CudaFunction,
    pub fp8_calibrate_blocks: CudaFunction,
    pub copy_words: CudaFunction,
    /// Whole KV blocks between the pools and device staging (`kv_copy.rs`).
    pub kv_blocks_move: CudaFunction,
    /// `paged_decode_g{4,8}_hd*` of each KV format: decode attention taking 4 or 8 query
    /// heads a CTA.
    pub paged_decode: [[[CudaFunction; 6]; 2]; 4],
    pub prefill_attention: [[CudaFunction; 6]; 4],
    pub argmax_rows: CudaFunction,
    pub carry_picks: CudaFunction,
    pub sample_rows: CudaFunction,
    pub edit_logits: CudaFunction,
    pub top_logprobs_rows: CudaFunction,
    pub random_bf16: CudaFunction,
    /// `gemv_{bf16,f32}_m{1..=8}`: the skinny GEMM for m = index + 1 rows.
    pub gemv_bf16: [CudaFunction; 8],
    pub gemv_f32: [CudaFunction; 8],
    /// `gemv_{silu,gelu}_m{1..=8}`: the skinny GEMM over `act(gate) * up` formed on load.
    pub gemv_silu: [CudaFunction; 8],
    pub gemv_gelu: [CudaFunction; 8],
    /// The skinny GEMM over FP8 codes on the tensor cores (`gemv.cu`), m ≤ 8 rows a launch:
    /// `[streamed, staged][fp8_gemv_{bf16,f32,silu,gelu}, the same with _runs]` (how x and the
    /// weights are loaded; a scale a row, or a scale a row and run of columns), the outputs in
    /// `Fp8Gemv` order.
    pub fp8_gemv: [[[CudaFunction; 4]; 2]; 2],
    /// FP8 matrices' quantization, dequantization and random codes (`fp8.cu`).
    pub fp8_quantize_rows: CudaFunction,
    pub fp8_dequant_rows: CudaFunction,
    pub fp8_random: CudaFunction,
    pub fp8_add_bias: CudaFunction,
    /// The q/k norm and Gemma 4's kernels (`gemma.cu`).
    pub qkv_norm: CudaFunction,
    pub per_layer_inputs: CudaFunction,
    /// The routing of mixtures of experts (`moe.cu`).
    pub moe_route: CudaFunction,
    pub moe_align: CudaFunction,
    pub moe_route_small: CudaFunction,
    pub moe_combine: CudaFunction,
    /// The experts' products over bf16 weights (`moe_gemm.cuh`, module `moe_bf16`).
    pub moe_bf16: MoeFunctions,
    /// The experts' products over FP8 rows (`moe_fp8.cuh`, module `moe_fp8`).
    pub moe_fp8: MoeFunctions,
    /// Multi-LoRA's shrink and expand (`lora.cu`).
    pub lora_shrink: CudaFunction,
    pub lora_expand: CudaFunction,
    /// Gated DeltaNet (`deltanet.cu`); `delta_rule` (sequential) and `delta_chunk` (the chunked
    /// scan) by `DELTA_K_DIMS`.
    pub delta_conv: CudaFunction,
    pub delta_conv_state: CudaFunction,
    pub delta_qk_norm: CudaFunction,
    pub delta_gates: CudaFunction,
    pub delta_rule: [CudaFunction; 3],
    pub delta_chunk: [CudaFunction; 3],
    pub delta_out_norm: CudaFunction,
    /// The kernels of each block-type module, in `QUANT_MODULES` order.
    pub quant: Vec<QuantFunctions>,
}

/// The quantized kernels' modules (`quant_<suffix>`): one per GGUF block type they read, one
/// per MLX code width (`quant_module` maps a dtype to its module).
pub(crate) const QUANT_MODULES: [&str; 9] = ["q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k", "mlx4", "mlx8"];

/// GGUF block types the quantized kernels read.
pub(crate) const GGUF_QUANT_TYPES: [DType; 7] =
    [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q8_0, DType::Q4K, DType::Q5K, DType::Q6K];

/// The index in `QUANT_MODULES` of the kernels that read `dtype`, and the `fmt` argument they
/// take for it (quant.cuh: 0 for GGUF types; an MLX format's log2(group / 32) and scale type).
pub(crate) fn quant_module(dtype: DType) -> Option<(usize, i32)> {
    match dtype {
        DType::Mlx(f) => {
            let lg = f.group().trailing_zeros() as i32 - 5;
            let scale = match f.scale() {
                MlxScale::Bf16 => 0,
                MlxScale::F16 => 1,
                MlxScale::F32 => 2,
            };
            let module = if f.bits() == 4 { "mlx4" } else { "mlx8" };
            Some((QUANT_MODULES.iter().position(|&m| m == module)?, lg | scale << 2))
        }
        d => GGUF_QUANT_TYPES.iter().position(|&t| t == d).map(|i| (i, 0)),
    }
}

/// One block type's kernels (`kernels/quant.cuh`).
pub(crate) struct QuantFunctions {
    /// `qgemv_m{1..=8}`: the quantized skinny GEMM for m = index + 1 rows.
    pub gemv: [CudaFunction; 8],
    pub dequant_rows: CudaFunction,
    pub random_blocks: CudaFunction,
    /// The experts' products over this type's blocks.
    pub moe: MoeFunctions,
}

/// The routed experts' products over one weight type (`kernels/moe_gemm.cuh`).
pub(crate) struct MoeFunctions {
    /// `moe_gemv_m{1,2,4,8}`: decode over the chosen experts, for steps of up to 1, 2, 4, 8
    /// tokens.
    pub gemv: [CudaFunction; 4],
    /// The grouped tensor-core GEMM.
    pub gemm: CudaFunction,
}

/// Most tokens each `MoeFunctions::gemv` kernel takes, in order.
pub(crate) const MOE_GEMV_TOKENS: [usize; 4] = [1, 2, 4, 8];

impl Functions {
    /// Load `images` (one per `SOURCES` entry, same order) into `ctx`; attention kernels may
    /// use up to `max_shared` bytes of dynamic shared memory.
    pub fn load(ctx: &Arc<CudaContext>, images: Vec<Image>, max_shared: usize) -> CudaResult<Functions> {
        let modules: Vec<(&str, Arc<CudaModule>)> = SOURCES
            .iter()
            .zip(images)
            .map(|(src, image)| {
                let ptx = match image {
                    Image::Cubin(bytes) => Ptx::from_binary(bytes),
                    Image::Ptx(text) => Ptx::from_src(text),
                };
                Ok((src.name, ctx.load_module(ptx)?))
            })
            .collect::<CudaResult<_>>()?;
        let get = |module: &str, name: &str| -> CudaResult<CudaFunction> {
            let (_, m) = modules
                .iter()
                .find(|(n, _)| *n == module)
                .ok_or_else(|| CudaError::Nvrtc(format!("kernel module {module} is missing")))?;
            Ok(m.load_function(name)?)
        };
        let per_head_dim = |module: &str, prefix: &str| -> CudaResult<[CudaFunction; 6]> {
            let fns = HEAD_DIMS
                .map(|hd| get(module, &format!("{prefix}_hd{hd}")))
                .into_iter()
                .collect::<CudaResult<Vec<_>>>()?;
            let fns: [CudaFunction; 6] =
                fns.try_into().map_err(|_| CudaError::Nvrtc(format!("{prefix}: expected 6 kernels")))?;
            for f in &fns {
                let attr = CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
                f.set_attribute(attr, max_shared as i32)?;
            }
            Ok(fns)
        };
        let per_rows_in = |module: &str, prefix: &str| -> CudaResult<[CudaFunction; 8]> {
            let fns = (1..=8).map(|m| get(module, &format!("{prefix}_m{m}"))).collect::<CudaResult<Vec<_>>>()?;
            fns.try_into().map_err(|_| CudaError::Nvrtc(format!("{prefix}: expected 8 kernels")))
        };
        let per_rows = |prefix: &str| per_rows_in("gemv", prefix);
        let moe = |module: &str| -> CudaResult<MoeFunctions> {
            let gemv = MOE_GEMV_TOKENS.map(|m| get(module, &format!("moe_gemv_m{m}")));
            let [a, b, c, d] = gemv;
            Ok(MoeFunctions { gemv: [a?, b?, c?, d?], gemm: get(module, "moe_gemm")? })
        };
        fn per_format<T>(f: &dyn Fn(&str) -> CudaResult<T>) -> CudaResult<[T; 4]> {
            let [a, b, c, d] = KV_FORMATS;
            Ok([f(a)?, f(b)?, f(c)?, f(d)?])
        }
        let quant = QUANT_MODULES
            .iter()
            .map(|suffix| {
                let module = format!("quant_{suffix}");
                Ok(QuantFunctions {
                    gemv: per_rows_in(&module, "qgemv")?,
                    dequant_rows: get(&module, "dequant_rows")?,
                    random_blocks: get(&module, "random_blocks")?,
                    moe: moe(&module)?,
                })
            })
            .collect::<CudaResult<Vec<_>>>()?;
        Ok(Functions {
            embedding_bf16: get("embedding", "embedding_bf16")?,
            embedding_f32: get("embedding", "embedding_f32")?,
            rms_norm: get("norm", "rms_norm")?,
            layer_norm: get("norm", "layer_norm")?,
            rms_norm_add: get("norm", "rms_norm_add")?,
            layer_norm_add: get("norm", "layer_norm_add")?,
            residual_add: get("norm", "residual_add")?,
            rope: get("rope", "rope")?,
            silu_mul: get("activation", "silu_mul")?,
            gelu_tanh_mul: get("activation", "gelu_tanh_mul")?,
            silu_inplace: get("activation", "silu_inplace")?,
            gelu_tanh_inplace: get("activation", "gelu_tanh_inplace")?,
            logit_epilogue: get("activation", "logit_epilogue")?,
            sigmoid_gate_mul: get("activation", "sigmoid_gate_mul")?,
            add_sigmoid_scaled: get("activation", "add_sigmoid_scaled")?,
            write_kv: get("kv_write", "write_kv")?,
            write_kv_quant: [
                get("kv_write", "write_kv_int8")?,
                get("kv_write", "write_kv_int4")?,
                get("kv_write", "write_kv_fp8")?,
            ],
            convert_blocks: [
                get("kv_write", "convert_blocks_int8")?,
                get("kv_write", "convert_blocks_int4")?,
                get("kv_write", "convert_blocks_fp8")?,
            ],
            fp8_calibrate: get("kv_write", "fp8_calibrate")?,
            fp8_calibrate_blocks: get("kv_write", "fp8_calibrate_blocks")?,
            copy_words: get("copy", "copy_words")?,
            kv_blocks_move: get("copy", "kv_blocks_move")?,
            paged_decode: per_format(&|fmt| {
                let module = format!("paged_attention{fmt}");
                Ok([per_head_dim(&module, "paged_decode_g4")?, per_head_dim(&module, "paged_decode_g8")?])
            })?,
            prefill_attention: per_format(&|fmt| {
                per_head_dim(&format!("prefill_attention{fmt}"), "prefill_attention")
            })?,
            argmax_rows: get("sampling", "argmax_rows")?,
            carry_picks: get("sampling", "carry_picks")?,
            sample_rows: get("sampling", "sample_rows")?,
            edit_logits: get("sampling", "edit_logits")?,
            top_logprobs_rows: get("sampling", "top_logprobs_rows")?,
            random_bf16: get("init", "random_bf16")?,
            gemv_bf16: per_rows("gemv_bf16")?,
            gemv_f32: per_rows("gemv_f32")?,
            gemv_silu: per_rows("gemv_silu")?,
            gemv_gelu: per_rows("gemv_gelu")?,
            fp8_gemv: {
                let set = |suffix: &str| -> CudaResult<[CudaFunction; 4]> {
                    let f = |out: &str| get("gemv", &format!("fp8_gemv_{out}{suffix}"));
                    Ok([f("bf16")?, f("f32")?, f("silu")?, f("gelu")?])
                };
                [[set("")?, set("_runs")?], [set("_staged")?, set("_runs_staged")?]]
            },
            fp8_quantize_rows: get("fp8", "fp8_quantize_rows")?,
            fp8_dequant_rows: get("fp8", "fp8_dequant_rows")?,
            fp8_random: get("fp8", "fp8_random")?,
            fp8_add_bias: get("fp8", "fp8_add_bias")?,
            qkv_norm: get("gemma", "qkv_norm")?,
            per_layer_inputs: get("gemma", "per_layer_inputs")?,
            moe_route: get("moe", "moe_route")?,
            moe_align: get("moe", "moe_align")?,
            moe_route_small: get("moe", "moe_route_small")?,
            moe_combine: get("moe", "moe_combine")?,
            moe_bf16: moe("moe_bf16")?,
            moe_fp8: moe("moe_fp8")?,
            lora_shrink: get("lora", "lora_shrink")?,
            lora_expand: get("lora", "lora_expand")?,
            delta_conv: get("deltanet", "delta_conv")?,
            delta_conv_state: get("deltanet", "delta_conv_state")?,
            delta_qk_norm: get("deltanet", "delta_qk_norm")?,
            delta_gates: get("deltanet", "delta_gates")?,
            delta_rule: {
                let [a, b, c] = DELTA_K_DIMS.map(|k| get("deltanet", &format!("delta_rule_k{k}")));
                [a?, b?, c?]
            },
            delta_chunk: {
                let [a, b, c] = DELTA_K_DIMS.map(|k| {
                    let f = get("deltanet", &format!("delta_chunk_k{k}"))?;
                    // Where the device has less, `ops::delta_rule` leaves the rows to `delta_rule`.
                    let shared = delta_chunk_shared(k).min(max_shared);
                    f.set_attribute(
                        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        shared as i32,
                    )?;
                    Ok::<_, CudaError>(f)
                });
                [a?, b?, c?]
            },
            delta_out_norm: get("deltanet", "delta_out_norm")?,
            quant,
        })
    }
}

/// Index of `head_dim` in `HEAD_DIMS`, or why it has no attention kernel.
pub(crate) fn head_dim_index(head_dim: usize) -> CudaResult<usize> {
    HEAD_DIMS
        .iter()
        .position(|&d| d == head_dim)
        .ok_or_else(|| CudaError::Unsupported(format!("attention with head_dim {head_dim} (have {HEAD_DIMS:?})")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::MlxFormat;

    /// Every MLX format goes to its code width's module with `fmt` = log2(group / 32) and the
    /// scale type (quant.cuh's `mlx`); the GGUF types to their own modules with 0.
    #[test]
    fn every_quantized_dtype_has_its_module() {
        for f in MlxFormat::all() {
            let (i, fmt) = quant_module(DType::Mlx(f)).expect("MLX module");
            assert_eq!(QUANT_MODULES[i], format!("mlx{}", f.bits()));
            assert_eq!(32 << (fmt & 3), f.group());
            assert_eq!(fmt >> 2, MlxScale::ALL.iter().position(|&s| s == f.scale()).unwrap() as i32);
        }
        for (i, t) in GGUF_QUANT_TYPES.iter().enumerate() {
            assert_eq!(quant_module(*t), Some((i, 0)));
        }
        assert_eq!(quant_module(DType::Q2K), None);
        assert_eq!(
            super::super::compile::SOURCES.iter().filter(|s| s.name.starts_with("quant_")).count(),
            QUANT_MODULES.len()
        );
    }
}
