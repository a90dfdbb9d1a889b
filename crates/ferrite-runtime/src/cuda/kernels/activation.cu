// Gated activations: out = act(gate) * up, f32 math, bf16 in and out. gate and up are rows of
// `in_stride` values (separate buffers, or the two halves of a fused gate_up GEMM output);
// out is [tokens, inter] contiguous. Grid-stride over tokens * inter.

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

__device__ __forceinline__ float gelu_tanh(float g) {
    const float k = 0.7978845608f;  // sqrt(2 / pi)
    return 0.5f * g * (1.f + tanhf(k * (g + 0.044715f * g * g * g)));
}

#define GATED(NAME, ACT)                                                                               \
    extern "C" __global__ void NAME(const bf16_t* __restrict__ gate, const bf16_t* __restrict__ up,     \
                                    bf16_t* __restrict__ out, int tokens, int inter, int in_stride) {  \
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
