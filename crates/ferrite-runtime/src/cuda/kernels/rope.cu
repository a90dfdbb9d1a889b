// Rotary embedding, Hugging Face "rotate half" layout, in place.
// Each token's row (of `stride` values) starts with `n_heads` heads of `head_dim` values: the
// query heads, or, in a fused QKV row, the query heads followed by the key heads, rotated in
// one launch. The first 2 * half dims of each head rotate in pairs (i, i + half) by
// position * inv_freq[i]; cos and sin are scaled by `scaling`. Grid: one block per token.

extern "C" __global__ void rope(bf16_t* __restrict__ x, const unsigned* __restrict__ positions,
                                const float* __restrict__ inv_freq, int n_heads, int head_dim, int half, float scaling,
                                int stride) {
    extern __shared__ float trig[];  // [half] cos, then [half] sin
    float* cs = trig;
    float* sn = trig + half;
    const int t = blockIdx.x;
    const float pos = (float)positions[t];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        cs[i] = c * scaling;
        sn[i] = s * scaling;
    }
    __syncthreads();
    bf16_t* row = x + (size_t)t * stride;
    for (int idx = threadIdx.x; idx < n_heads * half; idx += blockDim.x) {
        const int h = idx / half, i = idx - h * half;
        bf16_t* p = row + h * head_dim;
        const float a = bf2f(p[i]), b = bf2f(p[i + half]);
        p[i] = f2bf(a * cs[i] - b * sn[i]);
        p[i + half] = f2bf(b * cs[i] + a * sn[i]);
    }
}
