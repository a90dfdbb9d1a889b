// Store a step's keys and values into the paged cache, layout [block][kv_head][slot][head_dim].
// slot_mapping[t] = block * block_size + slot of token t, or -1 to skip it (padding rows).
// k and v are rows of `kv_stride` values (views into a fused QKV buffer are fine).
// Grid-stride over tokens * n_kv_heads * head_dim.
// Below: the same into quantized pools, the one-time conversion of bf16 blocks into quantized
// ones, and the fp8 scales' calibration (kv_format.cuh is prepended to this module).

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

// The same store into a quantized pool (kv_format.cuh): each thread quantizes 8 values of one
// token's K or V head, the lanes of an int8/int4 group together. Grid-stride over tokens × (K,
// V) × n_kv_heads × head_dim / 8 chunks, a warp's chunks together (the loop bound is uniform
// per warp, so every lane reaches the group's shuffles).
template <int F>
__device__ __forceinline__ void write_kv_q(const bf16_t* __restrict__ k, const bf16_t* __restrict__ v, int kv_stride,
                                           const int* __restrict__ slot_mapping, void* k_data, void* v_data,
                                           void* k_params, void* v_params, int tokens, int n_kv_heads, int head_dim,
                                           int block_size, int shift, const float* __restrict__ fp8_scales) {
    const int cpr = head_dim / 8;
    const size_t n = (size_t)tokens * 2 * n_kv_heads * cpr;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const int lane = threadIdx.x & 31;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i - lane < n; i += stride) {
        bool active = i < n;
        const size_t j = active ? i : 0;
        const int c = (int)(j % cpr);
        size_t r = j / cpr;
        const int h = (int)(r % n_kv_heads);
        r /= n_kv_heads;
        const int sel = (int)(r & 1);
        const size_t t = r >> 1;
        const int slot = slot_mapping[t];
        active = active && slot >= 0;
        const size_t block = active ? slot / block_size : 0, s = active ? slot % block_size : 0;
        const bf16_t* src = (sel ? v : k) + t * kv_stride + (size_t)h * head_dim + c * 8;
        float x[8];
#pragma unroll
        for (int e = 0; e < 8; e++) x[e] = active ? bf2f(src[e]) : 0.f;
        const u64 bh = (u64)block * n_kv_heads + h;
        const u64 o = (bh * block_size + s) * head_dim + c * 8;
        const float scale = F == KV_F8 ? fp8_scales[sel * n_kv_heads + h] : 0.f;
        kv_store8<F>(sel ? v_data : k_data, sel ? v_params : k_params, o, shift, x, active, scale, c == 0, bh);
    }
}

#define WRITE_KV_Q(NAME, F)                                                                                        \
    extern "C" __global__ void NAME(const bf16_t* k, const bf16_t* v, int kv_stride, const int* slot_mapping,       \
                                    void* k_data, void* v_data, void* k_params, void* v_params, int tokens,         \
                                    int n_kv_heads, int head_dim, int block_size, int shift,                       \
                                    const float* fp8_scales) {                                                     \
        pdl_entry();                                                                                                \
        write_kv_q<F>(k, v, kv_stride, slot_mapping, k_data, v_data, k_params, v_params, tokens, n_kv_heads,        \
                      head_dim, block_size, shift, fp8_scales);                                                     \
    }

WRITE_KV_Q(write_kv_int8, KV_I8)
WRITE_KV_Q(write_kv_int4, KV_I4)
WRITE_KV_Q(write_kv_fp8, KV_F8)

// Quantize whole bf16 blocks into a quantized pool: pairs[2 p] is a block of the bf16 pools
// (k_src, v_src), pairs[2 p + 1] the block of the quantized pools it becomes (the one-time
// conversion of a row's blocks when it turns quantized). Each chunk of 8 values is quantized
// as a write of the same values would store it. Grid-stride over pairs × (K, V) × n_kv_heads ×
// block_size × head_dim / 8 chunks.
template <int F>
__device__ __forceinline__ void convert_blocks(const bf16_t* __restrict__ k_src, const bf16_t* __restrict__ v_src,
                                               void* k_data, void* v_data, void* k_params, void* v_params,
                                               const int* __restrict__ pairs, int n_pairs, int n_kv_heads,
                                               int block_size, int head_dim, int shift,
                                               const float* __restrict__ fp8_scales) {
    const int cpr = head_dim / 8;
    const size_t n = (size_t)n_pairs * 2 * n_kv_heads * block_size * cpr;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    const int lane = threadIdx.x & 31;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i - lane < n; i += stride) {
        bool active = i < n;
        const size_t j = active ? i : 0;
        const int c = (int)(j % cpr);
        size_t r = j / cpr;
        const int s = (int)(r % block_size);
        r /= block_size;
        const int h = (int)(r % n_kv_heads);
        r /= n_kv_heads;
        const int sel = (int)(r & 1);
        const size_t p = r >> 1;
        const int from = pairs[2 * p], to = pairs[2 * p + 1];
        active = active && from >= 0 && to >= 0;
        const u64 row = ((u64)(active ? from : 0) * n_kv_heads + h) * block_size + s;
        const bf16_t* src = (sel ? v_src : k_src) + row * head_dim + c * 8;
        float x[8];
#pragma unroll
        for (int e = 0; e < 8; e++) x[e] = active ? bf2f(src[e]) : 0.f;
        const u64 bh = (u64)(active ? to : 0) * n_kv_heads + h;
        const u64 o = (bh * block_size + s) * head_dim + c * 8;
        const float scale = F == KV_F8 ? fp8_scales[sel * n_kv_heads + h] : 0.f;
        kv_store8<F>(sel ? v_data : k_data, sel ? v_params : k_params, o, shift, x, active, scale, c == 0 && s == 0,
                     bh);
    }
}

#define CONVERT_BLOCKS(NAME, F)                                                                                    \
    extern "C" __global__ void NAME(const bf16_t* k_src, const bf16_t* v_src, void* k_data, void* v_data,          \
                                    void* k_params, void* v_params, const int* pairs, int n_pairs, int n_kv_heads, \
                                    int block_size, int head_dim, int shift, const float* fp8_scales) {            \
        pdl_entry();                                                                                                \
        convert_blocks<F>(k_src, v_src, k_data, v_data, k_params, v_params, pairs, n_pairs, n_kv_heads, block_size, \
                          head_dim, shift, fp8_scales);                                                             \
    }

CONVERT_BLOCKS(convert_blocks_int8, KV_I8)
CONVERT_BLOCKS(convert_blocks_int4, KV_I4)
CONVERT_BLOCKS(convert_blocks_fp8, KV_F8)

// Headroom of an fp8 scale over the calibration's largest magnitude: that magnitude maps to
// 448 / 8 = 56, so values up to 8x anything the calibration saw are represented, and the ones
// below 1/3584 of it lose precision (e4m3 subnormals). Beyond 448 · scale a value saturates.
#define FP8_HEADROOM 8.f

// The fp8 scale of one head from its largest magnitude `amax` (1 when it saw nothing but
// zeros), kept within [2^-20, 2^7] (kv_unpack8 multiplies it by 2^120).
__device__ __forceinline__ float fp8_scale_of(float amax) {
    const float s = amax > 0.f ? amax * (FP8_HEADROOM / FP8_MAX) : 1.f;
    return fminf(fmaxf(s, 0x1p-20f), 0x1p7f);
}

// Calibrate an fp8 pool's scales from the keys and values about to be written (the first
// write to the pool): scales[h] (K heads, then V heads) = the head's largest magnitude over
// the step's stored tokens (keys times `k_factor`: keys the decode kernel rotates after this
// reads them may grow by sqrt(2) · the RoPE scaling) with headroom; a scale already set stays.
// Grid (2 · n_kv_heads), 256 threads.
extern "C" __global__ void fp8_calibrate(const bf16_t* __restrict__ k, const bf16_t* __restrict__ v, int kv_stride,
                                         const int* __restrict__ slot_mapping, int tokens, int n_kv_heads,
                                         int head_dim, float k_factor, float* scales) {
    pdl_entry();
    __shared__ float scratch[32];
    const int sel = blockIdx.x / n_kv_heads, h = blockIdx.x - sel * n_kv_heads;
    const bf16_t* src = sel ? v : k;
    float amax = 0.f;
    for (int i = threadIdx.x; i < tokens * head_dim; i += blockDim.x) {
        const int t = i / head_dim, d = i - t * head_dim;
        if (slot_mapping[t] >= 0) amax = fmaxf(amax, fabsf(bf2f(src[(size_t)t * kv_stride + (size_t)h * head_dim + d])));
    }
    amax = block_max(amax, scratch);
    if (threadIdx.x == 0 && scales[blockIdx.x] == 0.f) scales[blockIdx.x] = fp8_scale_of(amax * (sel ? 1.f : k_factor));
}

// `fp8_calibrate` over whole bf16 blocks about to be converted (`convert_blocks` pairs).
extern "C" __global__ void fp8_calibrate_blocks(const bf16_t* __restrict__ k_src, const bf16_t* __restrict__ v_src,
                                                const int* __restrict__ pairs, int n_pairs, int n_kv_heads,
                                                int block_size, int head_dim, float* scales) {
    pdl_entry();
    __shared__ float scratch[32];
    const int sel = blockIdx.x / n_kv_heads, h = blockIdx.x - sel * n_kv_heads;
    const bf16_t* src = sel ? v_src : k_src;
    const int per = block_size * head_dim;
    float amax = 0.f;
    for (size_t i = threadIdx.x; i < (size_t)n_pairs * per; i += blockDim.x) {
        const int from = pairs[2 * (i / per)];
        if (from >= 0) amax = fmaxf(amax, fabsf(bf2f(src[((size_t)from * n_kv_heads + h) * per + i % per])));
    }
    amax = block_max(amax, scratch);
    if (threadIdx.x == 0 && scales[blockIdx.x] == 0.f) scales[blockIdx.x] = fp8_scale_of(amax);
}
