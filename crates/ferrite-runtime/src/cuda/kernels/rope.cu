// Rotary embedding, Hugging Face "rotate half" layout, in place.
// Each token's row (of `stride` values) starts with `n_heads` heads of `head_dim` values: the
// query heads, or, in a fused QKV row, the query heads followed by the key heads, rotated in
// one launch. The first 2 * half dims of each head rotate in pairs (i, i + half) by
// position * inv_freq[i]; cos and sin are scaled by `scaling`.
// With `slot_mapping` non-null the last `n_kv_heads` of the heads are keys whose value heads
// follow them in the row (fused QKV), and each key head (rotated) and its value head are also
// stored into the paged cache as `write_kv` stores them: slot_mapping[t] = block * block_size
// + slot, negative to skip the token; layout [block][kv_head][slot][head_dim]. The RoPE and
// the KV write of a step are then one launch.
// With `table_of` non-null, `inv_freq` holds several tables of `half` frequencies and token t
// rotates by table table_of[t] (a schedule that depends on each row's length: dynamic NTK,
// long RoPE; the host writes one table per distinct schedule of the step).
// Grid (tokens, n_heads), one thread per pair: every pair is one load-rotate-store, so a
// decode step's RoPE costs one memory round trip however many heads it has.

extern "C" __global__ void rope(bf16_t* __restrict__ x, const unsigned* __restrict__ positions,
                                const float* __restrict__ inv_freq, int n_heads, int head_dim, int half, float scaling,
                                int stride, const int* __restrict__ slot_mapping, int n_kv_heads,
                                bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache, int block_size,
                                const int* __restrict__ table_of) {
    pdl_entry();
    const int t = blockIdx.x, h = blockIdx.y;
    const float* freq = table_of != nullptr ? inv_freq + (size_t)table_of[t] * half : inv_freq;
    const float pos = (float)positions[t];
    bf16_t* p = x + (size_t)t * stride + (size_t)h * head_dim;
    const int kv_head = h - (n_heads - n_kv_heads);
    const int slot = slot_mapping != nullptr && kv_head >= 0 ? slot_mapping[t] : -1;
    bf16_t* kc = nullptr;
    bf16_t* vc = nullptr;
    if (slot >= 0) {
        const size_t block = slot / block_size, s = slot % block_size;
        const size_t at = ((block * n_kv_heads + kv_head) * block_size + s) * head_dim;
        kc = k_cache + at;
        vc = v_cache + at;
    }
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        bf16_t ra, rb;
        rope_pair(bf2f(p[i]), bf2f(p[i + half]), pos, freq[i], scaling, &ra, &rb);
        p[i] = ra;
        p[i + half] = rb;
        if (kc != nullptr) {
            kc[i] = ra;
            kc[i + half] = rb;
        }
    }
    if (kc != nullptr) {
        // The key's unrotated tail (partial rotary) and the value head, n_kv_heads heads on.
        for (int i = 2 * half + threadIdx.x; i < head_dim; i += blockDim.x) kc[i] = p[i];
        const bf16_t* v = p + (size_t)n_kv_heads * head_dim;
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) vc[i] = v[i];
    }
}
