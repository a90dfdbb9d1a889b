// The KV cache formats: how 8 consecutive values of a pool are loaded, dequantized and
// quantized (prepended to kv_write.cu and, with KV_FMT defined, to the attention kernels).
//
// A pool holds the values [block][kv_head][slot][head_dim], addressed by value offset `o`:
//   KV_BF16  bf16 values (no parameters).
//   KV_I8    one code byte a value; per group of 2^shift consecutive values of a token's
//            head an f16 (scale, bias) pair, x = scale * code + bias (kv_quant.rs: the same
//            layout and the same quantizer as the CPU's pools).
//   KV_I4    as KV_I8 with two codes a byte (value 2j in the low nibble of byte j).
//   KV_F8    one e4m3 byte a value; per (block, kv head) the f32 scale its codes were
//            written with, x = scale * e4m3(code). Every block of a layer is written with the
//            layer's scale of that head (`fp8_scales`, fixed once the first write calibrated
//            it); a block carries it, so its bytes mean the same in any pool (host and SSD
//            tiers, another process).
// The parameter of 8 values is one 32-bit word: the group's (scale, bias) f16 pair, scale
// in the low half, or the fp8 scale.

#define KV_BF16 0
#define KV_I8 1
#define KV_I4 2
#define KV_F8 3

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// f32 to f16, round to nearest even (as the `half` crate).
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// The raw bits of 8 values.
template <int F>
struct KvRaw {
    typedef uint4 T;
};
template <>
struct KvRaw<KV_I8> {
    typedef uint2 T;
};
template <>
struct KvRaw<KV_I4> {
    typedef unsigned T;
};
template <>
struct KvRaw<KV_F8> {
    typedef uint2 T;
};

template <int F>
__device__ __forceinline__ typename KvRaw<F>::T kv_zero8();
template <>
__device__ __forceinline__ uint4 kv_zero8<KV_BF16>() {
    return make_uint4(0, 0, 0, 0);
}
template <>
__device__ __forceinline__ uint2 kv_zero8<KV_I8>() {
    return make_uint2(0, 0);
}
template <>
__device__ __forceinline__ unsigned kv_zero8<KV_I4>() {
    return 0u;
}
template <>
__device__ __forceinline__ uint2 kv_zero8<KV_F8>() {
    return make_uint2(0, 0);
}

// The 8 values at value offset `o` (a multiple of 8).
template <int F>
__device__ __forceinline__ typename KvRaw<F>::T kv_load8(const void* data, u64 o) {
    if constexpr (F == KV_BF16) return *(const uint4*)((const bf16_t*)data + o);
    else if constexpr (F == KV_I4) return *(const unsigned*)((const unsigned char*)data + o / 2);
    else return *(const uint2*)((const unsigned char*)data + o);
}

// The parameter word of the values at `o`: their group's (scale, bias) (int8/int4, groups of
// 2^shift values), or the scale of (block, kv head) `bh` (fp8); nothing for bf16.
template <int F>
__device__ __forceinline__ unsigned kv_param(const void* params, u64 o, int shift, u64 bh) {
    if constexpr (F == KV_BF16) return 0u;
    else if constexpr (F == KV_F8) return ((const unsigned*)params)[bh];
    else return ((const unsigned*)params)[o >> shift];
}

// A byte or nibble (< 2^23) as f32, exactly: its bits under the exponent of 2^23, minus 2^23.
__device__ __forceinline__ float small_uint_to_f(unsigned bits) {
    return __uint_as_float(0x4B000000u | bits) - 8388608.f;
}

// Dequantize 8 values with their parameter word into f[0..8] (f32).
template <int F>
__device__ __forceinline__ void kv_unpack8(typename KvRaw<F>::T r, unsigned param, float* f) {
    if constexpr (F == KV_BF16) {
        unpack8(r, f);
    } else if constexpr (F == KV_F8) {
        // Scales are at most 2^7 (fp8_calibrate), so scale * 2^120 stays finite.
        const float s = __uint_as_float(param) * 0x1p120f;
        const unsigned w[2] = {r.x, r.y};
#pragma unroll
        for (int i = 0; i < 8; i++) f[i] = e4m3_bits_to_f((w[i >> 2] >> (8 * (i & 3))) & 0xffu) * s;
    } else {
        const float s = h2f((unsigned short)(param & 0xffffu)), b = h2f((unsigned short)(param >> 16));
        if constexpr (F == KV_I8) {
            const unsigned w[2] = {r.x, r.y};
#pragma unroll
            for (int i = 0; i < 8; i++) f[i] = fmaf(small_uint_to_f((w[i >> 2] >> (8 * (i & 3))) & 0xffu), s, b);
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) f[i] = fmaf(small_uint_to_f((r >> (4 * i)) & 0xfu), s, b);
        }
    }
}

// The code of x for an int8/int4 group of (scale s, bias b, inv = 1/s or 0): the CPU
// quantizer's arithmetic (kv_quant.rs), rounding half away from zero, so the codes agree.
__device__ __forceinline__ unsigned affine_code(float x, float b, float inv, float max_code) {
    return (unsigned)fminf(fmaxf(roundf(__fmul_rn(__fsub_rn(x, b), inv)), 0.f), max_code);
}


// Quantize and store 8 values `x` at value offset `o` of a pool (lanes of one warp, all 32
// calling; `active` false for lanes with nothing to store). The lanes of an int8/int4 group
// (2^shift / 8 of them) are consecutive and aligned, their offsets consecutive: they find
// the group's range together, and the group's first lane stores its parameters. fp8 values
// are divided by `fp8_scale` (the layer's scale of their head) and the row's first chunk
// (`first`) stores it as the scale of (block, kv head) `bh`.
template <int F>
__device__ __forceinline__ void kv_store8(void* data, void* params, u64 o, int shift, const float* x, bool active,
                                          float fp8_scale, bool first, u64 bh) {
    if constexpr (F == KV_BF16) {
        if (active) {
            bf16_t* d = (bf16_t*)data + o;
#pragma unroll
            for (int i = 0; i < 8; i++) d[i] = f2bf(x[i]);
        }
    } else if constexpr (F == KV_F8) {
        if (!active) return;
        const float inv = 1.f / fp8_scale;
        unsigned w[2] = {0u, 0u};
#pragma unroll
        for (int i = 0; i < 8; i += 2)
            w[i >> 2] |= e4m3_pair(__fmul_rn(x[i], inv), __fmul_rn(x[i + 1], inv)) << (8 * (i & 3));
        *(uint2*)((unsigned char*)data + o) = make_uint2(w[0], w[1]);
        if (first) ((float*)params)[bh] = fp8_scale;
    } else {
        constexpr float max_code = F == KV_I8 ? 255.f : 15.f;
        float lo = FERRITE_INF, hi = -FERRITE_INF;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            lo = fminf(lo, x[i]);
            hi = fmaxf(hi, x[i]);
        }
        const int lanes = (1 << shift) >> 3;
        for (int m = 1; m < lanes; m <<= 1) {
            lo = fminf(lo, __shfl_xor_sync(FULL_MASK, lo, m));
            hi = fmaxf(hi, __shfl_xor_sync(FULL_MASK, hi, m));
        }
        if (!active) return;
        const unsigned short sh = f2h(__fdiv_rn(__fsub_rn(hi, lo), max_code)), bh16 = f2h(lo);
        const float s = h2f(sh), b = h2f(bh16);
        const float inv = s > 0.f ? __frcp_rn(s) : 0.f;
        if constexpr (F == KV_I8) {
            unsigned w[2] = {0u, 0u};
#pragma unroll
            for (int i = 0; i < 8; i++) w[i >> 2] |= affine_code(x[i], b, inv, max_code) << (8 * (i & 3));
            *(uint2*)((unsigned char*)data + o) = make_uint2(w[0], w[1]);
        } else {
            unsigned w = 0u;
#pragma unroll
            for (int i = 0; i < 8; i++) w |= affine_code(x[i], b, inv, max_code) << (4 * i);
            *(unsigned*)((unsigned char*)data + o / 2) = w;
        }
        if ((o & ((1ull << shift) - 1)) == 0) ((unsigned*)params)[o >> shift] = (unsigned)sh | ((unsigned)bh16 << 16);
    }
}
