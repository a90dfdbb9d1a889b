// Shared by every ferrite kernel module (prepended to each source before NVRTC compiles it).
//
// No headers: NVRTC compiles these without the CUDA toolkit's include directory, so bf16 is a
// plain 16-bit integer converted by bit operations (round to nearest even, as the `half`
// crate does), and the few constants we need are spelled out.

typedef unsigned short bf16_t;
typedef unsigned long long u64;

#define FERRITE_INF __int_as_float(0x7f800000)
#define FULL_MASK 0xffffffffu

// Programmatic dependent launch (sm_90 and up, where the host allows it on every launch): a
// kernel may start while the kernel ahead of it in the stream still runs. Every kernel calls
// `pdl_entry` first: it lets the kernel behind it start likewise (once each of its blocks has
// called it), then blocks until the kernel ahead has finished and its writes are visible — so
// no kernel touches memory early; what overlaps is the next kernel's launch with this one's
// tail.
__device__ __forceinline__ void pdl_entry() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ float bf2f(bf16_t v) { return __uint_as_float(((unsigned)v) << 16); }

__device__ __forceinline__ bf16_t f2bf(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// Two bf16 packed in one 32-bit word: `lo` in the low half (the lower index).
__device__ __forceinline__ unsigned pack_bf2(float lo, float hi) {
    return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 floats; the fixed reduction order makes the result deterministic.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : 0.f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : -FERRITE_INF;
    return warp_max(v);
}

// The splitmix64 finalizer: random weights as a pure function of (seed, index) (init.cu,
// quant.cuh).
__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Eight bf16 (one 16-byte load) to f32.
__device__ __forceinline__ void unpack8(uint4 raw, float* f) {
    unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

// RoPE of the pair (a, b) ("rotate half": dims i and i + half) at angle pos * freq, cos and
// sin scaled by `scaling`, rounded to bf16 (rope.cu, and the decode attention that rotates its
// own queries and keys). Rounded operations, so every kernel gets the same bits.
__device__ __forceinline__ void rope_pair(float a, float b, float pos, float freq, float scaling, bf16_t* ra,
                                          bf16_t* rb) {
    float s, c;
    sincosf(__fmul_rn(pos, freq), &s, &c);
    c = __fmul_rn(c, scaling);
    s = __fmul_rn(s, scaling);
    *ra = f2bf(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
    *rb = f2bf(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
}

// The gated activations' nonlinearities (activation.cu, and gemv.cu's fused input).
__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

__device__ __forceinline__ float gelu_tanh(float g) {
    const float k = 0.7978845608f;  // sqrt(2 / pi)
    return 0.5f * g * (1.f + tanhf(k * (g + 0.044715f * g * g * g)));
}

// The end of a skinny-GEMM block (gemv.cu, quant.cuh) of THREADS threads holding partial sums
// `acc[i][r]` of M activation rows × 4 weight rows: the warps' sums meet in `part` (shared,
// [THREADS / 32][M][4]) and are added in a fixed order. Plain (`gated` false): weight rows
// row0 .. row0 + 3, each sum handed to `store(i, row, sum)`. Gated: rows 0-1 are the
// gate rows and 2-3 the up rows of outputs row0, row0 + 1; both sums are rounded to bf16 as a
// plain GEMV would store them and `store(i, row, act(g) * u)` gets the product (`silu`
// or `gelu_tanh` by `gelu`). Rows at or past `n` are not stored.
template <int M, int THREADS, class Store>
__device__ __forceinline__ void skinny_gemm_end(float (&acc)[M][4], float (*part)[M][4], int row0, int n, bool gated,
                                                bool gelu, Store store) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < M; i++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const float v = warp_sum(acc[i][r]);
            if (lane == 0) part[warp][i][r] = v;
        }
    __syncthreads();
    if (gated) {
        if (threadIdx.x < M * 2) {
            const int i = threadIdx.x / 2, q = threadIdx.x % 2, row = row0 + q;
            float g = 0.f, u = 0.f;
#pragma unroll
            for (int p = 0; p < THREADS / 32; p++) {
                g += part[p][i][q];
                u += part[p][i][q + 2];
            }
            g = bf2f(f2bf(g));
            u = bf2f(f2bf(u));
            if (row < n) store(i, row, (gelu ? gelu_tanh(g) : silu(g)) * u);
        }
        return;
    }
    if (threadIdx.x < M * 4) {
        const int i = threadIdx.x / 4, r = threadIdx.x % 4, row = row0 + r;
        float v = 0.f;
#pragma unroll
        for (int p = 0; p < THREADS / 32; p++) v += part[p][i][r];
        if (row < n) store(i, row, v);
    }
}

// FP8 e4m3 codes (the fp8 KV cache, FP8 weights).
// The largest e4m3 magnitude.
#define FP8_MAX 448.f

// An e4m3 byte as f32 times 2^-120: sign and the 7 exponent-mantissa bits moved to the top of
// an f32 (e4m3 subnormals land on f32 subnormals, zero on zero).
__device__ __forceinline__ float e4m3_bits_to_f(unsigned b) {
    return __uint_as_float(((b & 0x7fu) << 20) | ((b & 0x80u) << 24));
}

// x (already divided by the scale) as an e4m3 byte, round to nearest even, saturating at
// ±448. sm_89 and up (the host refuses an fp8 cache or FP8 weights below).
__device__ __forceinline__ unsigned e4m3_pair(float lo, float hi) {
#if __CUDA_ARCH__ >= 890
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
#else
    __trap();
    return 0u;
#endif
}

// Tensor-core fragments (prefill_attention.cu, the experts' GEMM in moe_gemm.cuh):
// D += A·B for one m16n8k16 tile, bf16 in, f32 accumulate.
__device__ __forceinline__ void mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Four 8x8 b16 matrices: lane l names row l % 8 of matrix l / 8; each lane gets, of matrix
// i, the elements (row l / 4, columns 2 (l % 4) and 2 (l % 4) + 1) in r[i].
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const bf16_t* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}

// Four 8x8 b16 matrices, transposed: lane l names row l % 8 of matrix l / 8; each lane gets,
// of matrix i, the elements (rows 2 (l % 4) and 2 (l % 4) + 1, column l / 4) in r[i].
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const bf16_t* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
}
