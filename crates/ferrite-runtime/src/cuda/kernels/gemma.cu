// The kernels of q/k norms and of Gemma 4's extra blocks, f32 math on bf16 activations:
// - qkv_norm: RMSNorm of the q, k (and v) heads of a fused QKV row, in place (per head, or
//   over a whole projection when called with one head as wide);
// - per_layer_inputs: Gemma 4's per-layer inputs, layer-major.

// Per-head RMSNorm over a fused QKV row (`stride` values a token): heads [0, n_q) are
// normalized with wq, [n_q, n_q + n_k) with wk, the next n_v without a learned scale (a null
// weight is a unit one too). Grid (tokens, n_q + n_k + n_v), threads a multiple of 32.
extern "C" __global__ void qkv_norm(bf16_t* __restrict__ x, int stride, int n_q, int n_k, int head_dim,
                                    const float* __restrict__ wq, const float* __restrict__ wk, float eps) {
    pdl_entry();
    __shared__ float scratch[32];
    const int h = blockIdx.y;
    bf16_t* p = x + (size_t)blockIdx.x * stride + (size_t)h * head_dim;
    const float* w = h < n_q ? wq : h < n_q + n_k ? wk : nullptr;
    float ss = 0.f;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        const float v = bf2f(p[i]);
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)head_dim + eps);
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        const float v = bf2f(p[i]) * inv;
        p[i] = f2bf(w != nullptr ? v * w[i] : v);
    }
}

// Gemma 4's per-layer inputs: for token t and layer l, with p = proj[t, l * width ..] (the
// projection of the scaled embeddings, `layers * width` values a token) and e = table[ids[t],
// l * width ..]:  out[l][t] = (rmsnorm(p * proj_scale) * w + e * emb_scale) * sqrt(1/2).
// Layer-major output, so each layer reads its inputs as contiguous rows. Grid (tokens, layers).
extern "C" __global__ void per_layer_inputs(const bf16_t* __restrict__ proj, const bf16_t* __restrict__ table,
                                            const unsigned* __restrict__ ids, const float* __restrict__ w,
                                            bf16_t* __restrict__ out, int tokens, int width, int vocab,
                                            float proj_scale, float emb_scale, float eps) {
    pdl_entry();
    __shared__ float scratch[32];
    const int t = blockIdx.x, l = blockIdx.y, layers = gridDim.y;
    const size_t row = (size_t)layers * width;
    const bf16_t* p = proj + t * row + (size_t)l * width;
    const unsigned id = ids[t];
    const bf16_t* e = id < (unsigned)vocab ? table + id * row + (size_t)l * width : nullptr;
    float ss = 0.f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = bf2f(p[i]) * proj_scale;
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)width + eps);
    const float half = 0.70710678118654752f;
    bf16_t* o = out + ((size_t)l * tokens + t) * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const float emb = e != nullptr ? bf2f(e[i]) * emb_scale : 0.f;
        o[i] = f2bf((bf2f(p[i]) * proj_scale * inv * w[i] + emb) * half);
    }
}
