// Rotary embedding, Hugging Face "rotate half" layout, in place.
// Each token's row (of `stride` values) starts with `n_heads` heads of `head_dim` values: the
// query heads, or, in a fused QKV row, the query heads followed by the key heads, rotated in
// one launch. The first 2 * half dims of each head rotate in pairs (i, i + half) by
// position * inv_freq[i]; cos and sin are scaled by `scaling`.
// Grid (tokens, n_heads), one thread per pair: every pair is one load-rotate-store, so a
// decode step's RoPE costs one memory round trip however many heads it has.

extern "C" __global__ void rope(bf16_t* __restrict__ x, const unsigned* __restrict__ positions,
                                const float* __restrict__ inv_freq, int n_heads, int head_dim, int half, float scaling,
                                int stride) {
    const int t = blockIdx.x, h = blockIdx.y;
    const float pos = (float)positions[t];
    bf16_t* p = x + (size_t)t * stride + (size_t)h * head_dim;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        c *= scaling;
        s *= scaling;
        const float a = bf2f(p[i]), b = bf2f(p[i + half]);
        p[i] = f2bf(a * c - b * s);
        p[i + half] = f2bf(b * c + a * s);
    }
}
