// Store a step's keys and values into the paged cache, layout [block][kv_head][slot][head_dim].
// slot_mapping[t] = block * block_size + slot of token t, or -1 to skip it (padding rows).
// k and v are rows of `kv_stride` values (views into a fused QKV buffer are fine).
// Grid-stride over tokens * n_kv_heads * head_dim.

extern "C" __global__ void write_kv(const bf16_t* __restrict__ k, const bf16_t* __restrict__ v, int kv_stride,
                                    const int* __restrict__ slot_mapping, bf16_t* __restrict__ k_cache,
                                    bf16_t* __restrict__ v_cache, int tokens, int n_kv_heads, int head_dim,
                                    int block_size) {
    pdl_entry();
    size_t width = (size_t)n_kv_heads * head_dim;
    size_t n = (size_t)tokens * width;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t t = i / width, r = i - t * width;
        int slot = slot_mapping[t];
        if (slot < 0) continue;
        size_t h = r / head_dim, d = r - h * head_dim;
        size_t block = slot / block_size, s = slot % block_size;
        size_t dst = ((block * n_kv_heads + h) * block_size + s) * head_dim + d;
        size_t src = t * kv_stride + r;
        k_cache[dst] = k[src];
        v_cache[dst] = v[src];
    }
}
