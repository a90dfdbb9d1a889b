// Gated activations: out = act(gate) * up, f32 math, bf16 in and out. gate and up are rows of
// `in_stride` values (separate buffers, or the two halves of a fused gate_up GEMM output);
// out is [tokens, inter] contiguous. Grid-stride over tokens * inter. (The skinny GEMM of
// gemv.cu applies the same activations as its epilogue, `gemv_silu_m*` / `gemv_gelu_m*`.)

#define GATED(NAME, ACT)                                                                               \
    extern "C" __global__ void NAME(const bf16_t* __restrict__ gate, const bf16_t* __restrict__ up,     \
                                    bf16_t* __restrict__ out, int tokens, int inter, int in_stride) { pdl_entry();  \
        size_t n = (size_t)tokens * inter;                                                             \
        for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;                          \
             i += (size_t)gridDim.x * blockDim.x) {                                                    \
            size_t t = i / inter, j = i - t * inter;                                                   \
            size_t at = t * in_stride + j;                                                             \
            out[i] = f2bf(ACT(bf2f(gate[at])) * bf2f(up[at]));                                        \
        }                                                                                              \
    }

GATED(silu_mul, silu)
GATED(gelu_tanh_mul, gelu_tanh)
