// Activations, f32 math, bf16 in and out:
// - gated: out = act(gate) * up. gate and up are rows of `in_stride` values (separate
//   buffers, or the two halves of a fused gate_up GEMM output); out is [tokens, inter]
//   contiguous. (The skinny GEMM of gemv.cu applies the same activations as its epilogue,
//   `gemv_silu_m*` / `gemv_gelu_m*`.)
// - plain, in place: x = act(x) (an ungated MLP: starcoder2's `c_fc` output);
// - logit_epilogue, on f32 logits in place: x = x * scale (granite's 1 / logits_scaling),
//   then cap * tanh(x / cap) when cap > 0 (Gemma 2+'s final softcap).
// Grid-stride loops.

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

#define PLAIN(NAME, ACT)                                                                               \
    extern "C" __global__ void NAME(bf16_t* __restrict__ x, u64 n) {                                   \
        pdl_entry();                                                                                   \
        for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) \
            x[i] = f2bf(ACT(bf2f(x[i])));                                                              \
    }

PLAIN(silu_inplace, silu)
PLAIN(gelu_tanh_inplace, gelu_tanh)

extern "C" __global__ void logit_epilogue(float* __restrict__ x, u64 n, float scale, float cap) {
    pdl_entry();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float v = x[i] * scale;
        x[i] = cap > 0.f ? cap * tanhf(v / cap) : v;
    }
}

// Sigmoid gates (Qwen3-Next, Qwen3.5):
// - sigmoid_gate_mul: x[t, i] *= sigmoid(gate[t * gate_stride + i]) over [tokens, width] (the
//   gated attention output, its gates in the fused QKV rows);
// - add_sigmoid_scaled: out[t, i] += sigmoid(logit[t]) * y[t, i] over [tokens, width] (the
//   shared expert joining the routed experts' sum).
extern "C" __global__ void sigmoid_gate_mul(bf16_t* __restrict__ x, const bf16_t* __restrict__ gate, int gate_stride,
                                            int width, int tokens) {
    pdl_entry();
    const size_t n = (size_t)tokens * width;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / width, j = i - t * width;
        x[i] = f2bf(bf2f(x[i]) / (1.f + expf(-bf2f(gate[t * gate_stride + j]))));
    }
}

extern "C" __global__ void add_sigmoid_scaled(bf16_t* __restrict__ out, const bf16_t* __restrict__ y,
                                              const float* __restrict__ logit, int width, int tokens) {
    pdl_entry();
    const size_t n = (size_t)tokens * width;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float s = 1.f / (1.f + expf(-logit[i / width]));
        out[i] = f2bf(bf2f(out[i]) + s * bf2f(y[i]));
    }
}
