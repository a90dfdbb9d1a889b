// GGUF block-quantized weights on the device, read in their file layout: one module per block
// type (compile.rs appends `QUANT_KERNELS(<type>)` and the experts' `MOE_KERNELS(<type>)` of
// moe_gemm.cuh to this source), each with
//   qgemv_m{1..8}  the skinny GEMM of decode over quantized rows, dequantizing in registers;
//   dequant_rows   rows (all, or gathered by id) to bf16: the GEMM path's scratch, embeddings;
//   random_blocks  random blocks with sane scales (synthetic models).
//
// A row of k values is k / UNIT "units" of UNIT (32) consecutive values. A type's `load` reads
// the bytes of unit u into registers (at the alignment its block guarantees) and `decode8`
// turns the 8 values 8c .. 8c + 7 of the unit into small integers q (exact in f32) with the
// affine map of their half-unit: value = a * q + b, where a * q is exact and the one rounding
// of the sum is the same one ggml's (and our CPU's) `dequantize_row_*` makes, so `dequant_rows`
// is bit for bit the CPU dequantization (then rounded to bf16). (moe_gemm.cuh reads bf16 rows
// through the same interface: `bf16w`, units of 8 values.)
//
// Layouts (ggml's; quant/legacy.rs and quant/kquants.rs describe them):
//   q4_0  18 B / 32: d f16 | qs[16]            value j: (nibble - 8) * d, j < 16 low nibbles
//   q4_1  20 B / 32: d, m f16 | qs[16]         nibble * d + m
//   q5_0  22 B / 32: d | qh u32 | qs[16]       (nibble | qh bit j << 4) - 16, times d
//   q8_0  34 B / 32: d | qs i8[32]             q * d
//   q4_k 144 B / 256: d, dmin | scales[12] | qs[128]; sub-block s (a unit) reads nibble s % 2
//         of qs[32 (s / 2) ..][..32]; value (d * sc) * q - dmin * m, (sc, m) 6-bit packed
//   q5_k 176 B / 256: as q4_k plus qh[32] before qs: bit s of qh[l] is the fifth bit
//   q6_k 210 B / 256: ql[128] | qh[64] | scales i8[16] | d; unit (half h, plane p) holds values
//         128 h + 32 p + l: low 4 bits nibble p / 2 of ql[64 h + 32 (p % 2) + l], high 2 bits
//         bits 2p of qh[32 h + l]; value (d * scale[group]) * (q - 32), 16 values a group

typedef unsigned char u8;

__device__ __forceinline__ unsigned ld16(const u8* p) { return *(const unsigned short*)p; }
// A 32-bit word at a 2-byte-aligned address.
__device__ __forceinline__ unsigned ld32_a2(const u8* p) { return ld16(p) | (ld16(p + 2) << 16); }
__device__ __forceinline__ unsigned ld32(const u8* p) { return *(const unsigned*)p; }

__device__ __forceinline__ float half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short float_to_half(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float f16_at(const u8* p) { return half_to_float((unsigned short)ld16(p)); }

// The small unsigned integer q (< 2^23) minus `off`, exactly, without an int-to-float convert:
// the bits 0x4B000000 | q are the float 2^23 + q.
__device__ __forceinline__ float small_int(unsigned q, float off) {
    return __int_as_float(0x4B000000 | q) - (8388608.f + off);
}

// Byte j (0..7) of the 8 bytes in words w0 (bytes 0..3) and w1 (4..7).
__device__ __forceinline__ unsigned byte_of(unsigned w0, unsigned w1, int j) {
    return ((j < 4 ? w0 : w1) >> (8 * (j & 3))) & 0xff;
}

// --- the 32-value blocks ---

struct q4_0 {
    enum { BYTES = 18, ELEMS = 32, MIN = 0, UNIT = 32 };
    struct Raw { unsigned qs[4]; float d; };
    static __device__ __forceinline__ void load(const u8* row, int u, Raw& r) {
        const u8* b = row + (u64)u * BYTES;
        r.d = f16_at(b);
#pragma unroll
        for (int i = 0; i < 4; i++) r.qs[i] = ld32_a2(b + 2 + 4 * i);
    }
    static __device__ __forceinline__ void decode8(const Raw& r, int c, float* q, float& a, float& bb) {
        const int w = 2 * (c & 1), shift = c < 2 ? 0 : 4;
#pragma unroll
        for (int j = 0; j < 8; j++) q[j] = small_int((byte_of(r.qs[w], r.qs[w + 1], j) >> shift) & 15, 8.f);
        a = r.d;
        bb = 0.f;
    }
    static __device__ __forceinline__ void set_scales(u8* b, float amp) {
        *(unsigned short*)b = float_to_half(amp / 8.f);
    }
};

struct q4_1 {
    enum { BYTES = 20, ELEMS = 32, MIN = 1, UNIT = 32 };
    struct Raw { unsigned qs[4]; float d, m; };
    static __device__ __forceinline__ void load(const u8* row, int u, Raw& r) {
        const u8* b = row + (u64)u * BYTES;
        const unsigned dm = ld32(b);
        r.d = half_to_float(dm & 0xffff);
        r.m = half_to_float(dm >> 16);
#pragma unroll
        for (int i = 0; i < 4; i++) r.qs[i] = ld32(b + 4 + 4 * i);
    }
    static __device__ __forceinline__ void decode8(const Raw& r, int c, float* q, float& a, float& bb) {
        const int w = 2 * (c & 1), shift = c < 2 ? 0 : 4;
#pragma unroll
        for (int j = 0; j < 8; j++) q[j] = small_int((byte_of(r.qs[w], r.qs[w + 1], j) >> shift) & 15, 0.f);
        a = r.d;
        bb = r.m;
    }
    static __device__ __forceinline__ void set_scales(u8* b, float amp) {
        *(unsigned short*)b = float_to_half(2.f * amp / 15.f);
        *(unsigned short*)(b + 2) = float_to_half(-amp);
    }
};

struct q5_0 {
    enum { BYTES = 22, ELEMS = 32, MIN = 0, UNIT = 32 };
    struct Raw { unsigned qs[4]; unsigned qh; float d; };
    static __device__ __forceinline__ void load(const u8* row, int u, Raw& r) {
        const u8* b = row + (u64)u * BYTES;
        r.d = f16_at(b);
        r.qh = ld32_a2(b + 2);
#pragma unroll
        for (int i = 0; i < 4; i++) r.qs[i] = ld32_a2(b + 6 + 4 * i);
    }
    static __device__ __forceinline__ void decode8(const Raw& r, int c, float* q, float& a, float& bb) {
        const int w = 2 * (c & 1), shift = c < 2 ? 0 : 4;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const unsigned hi = (r.qh >> (8 * c + j)) & 1;
            q[j] = small_int(((byte_of(r.qs[w], r.qs[w + 1], j) >> shift) & 15) | (hi << 4), 16.f);
        }
        a = r.d;
        bb = 0.f;
    }
    static __device__ __forceinline__ void set_scales(u8* b, float amp) {
        *(unsigned short*)b = float_to_half(amp / 16.f);
    }
};

struct q8_0 {
    enum { BYTES = 34, ELEMS = 32, MIN = 0, UNIT = 32 };
    struct Raw { unsigned qs[8]; float d; };
    static __device__ __forceinline__ void load(const u8* row, int u, Raw& r) {
        const u8* b = row + (u64)u * BYTES;
        r.d = f16_at(b);
#pragma unroll
        for (int i = 0; i < 8; i++) r.qs[i] = ld32_a2(b + 2 + 4 * i);
    }
    static __device__ __forceinline__ void decode8(const Raw& r, int c, float* q, float& a, float& bb) {
        // A signed byte s is the unsigned (s ^ 0x80) = s + 128.
#pragma unroll
        for (int j = 0; j < 8; j++) q[j] = small_int(byte_of(r.qs[2 * c], r.qs[2 * c + 1], j) ^ 0x80, 128.f);
        a = r.d;
        bb = 0.f;
    }
    static __device__ __forceinline__ void set_scales(u8* b, float amp) {
        *(unsigned short*)b = float_to_half(amp / 127.f);
    }
};

// --- the 256-value super-blocks ---

// Scale and min of sub-block j (0..7) from the 12 packed bytes of Q4_K/Q5_K (three words).
__device__ __forceinline__ void scale_min_k4(const unsigned* s, int j, unsigned& sc, unsigned& m) {
    auto byte = [&](int i) { return (s[i >> 2] >> (8 * (i & 3))) & 0xff; };
    if (j < 4) {
        sc = byte(j) & 63;
        m = byte(j + 4) & 63;
    } else {
        sc = (byte(j + 4) & 15) | ((byte(j - 4) >> 6) << 4);
        m = (byte(j + 4) >> 4) | ((byte(j) >> 6) << 4);
    }
}

// Q4_K and Q5_K: one sub-block of 32 values is a unit; Q4_K has no fifth bit.
template <bool FIVE>
struct qk45 {
    enum { BYTES = FIVE ? 176 : 144, ELEMS = 256, MIN = 1, UNIT = 32 };
    struct Raw { unsigned qs[8]; unsigned qh[FIVE ? 8 : 1]; float a, b; int s; };
    static __device__ __forceinline__ void load(const u8* row, int u, Raw& r) {
        const u8* b = row + (u64)(u >> 3) * BYTES;
        r.s = u & 7;
        const unsigned dd = ld32(b);
        const unsigned scales[3] = {ld32(b + 4), ld32(b + 8), ld32(b + 12)};
        unsigned sc, m;
        scale_min_k4(scales, r.s, sc, m);
        r.a = half_to_float(dd & 0xffff) * (float)sc;
        r.b = -(half_to_float(dd >> 16) * (float)m);
        // Super-blocks are 16-byte aligned (144 and 176 are multiples of 16), as are qs and qh.
        const uint4* qs = (const uint4*)(b + (FIVE ? 48 : 16) + 32 * (r.s >> 1));
        const uint4 q0 = qs[0], q1 = qs[1];
        r.qs[0] = q0.x; r.qs[1] = q0.y; r.qs[2] = q0.z; r.qs[3] = q0.w;
        r.qs[4] = q1.x; r.qs[5] = q1.y; r.qs[6] = q1.z; r.qs[7] = q1.w;
        if (FIVE) {
            const uint4* qh = (const uint4*)(b + 16);
            const uint4 h0 = qh[0], h1 = qh[1];
            r.qh[0] = h0.x; r.qh[1] = h0.y; r.qh[2] = h0.z; r.qh[3] = h0.w;
            r.qh[4] = h1.x; r.qh[5] = h1.y; r.qh[6] = h1.z; r.qh[7] = h1.w;
        }
    }
    static __device__ __forceinline__ void decode8(const Raw& r, int c, float* q, float& a, float& bb) {
        const int shift = 4 * (r.s & 1);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            unsigned v = (byte_of(r.qs[2 * c], r.qs[2 * c + 1], j) >> shift) & 15;
            if (FIVE) v |= ((byte_of(r.qh[2 * c], r.qh[2 * c + 1], j) >> r.s) & 1) << 4;
            q[j] = small_int(v, 0.f);
        }
        a = r.a;
        bb = r.b;
    }
    static __device__ __forceinline__ void set_scales(u8* b, float amp) {
        *(unsigned short*)b = float_to_half(2.f * amp / ((FIVE ? 31.f : 15.f) * 63.f));
        *(unsigned short*)(b + 2) = float_to_half(amp / 63.f);
    }
};
typedef qk45<false> q4_k;
typedef qk45<true> q5_k;

struct q6_k {
    enum { BYTES = 210, ELEMS = 256, MIN = 0, UNIT = 32 };
    struct Raw { unsigned ql[8]; unsigned qh[8]; float a0, a1; int p; };
    static __device__ __forceinline__ void load(const u8* row, int u, Raw& r) {
        const u8* b = row + (u64)(u >> 3) * BYTES;
        const int h = (u >> 2) & 1, p = u & 3, g = 8 * h + 2 * p;
        r.p = p;
        const float d = f16_at(b + 208);
        const unsigned sc = ld16(b + 192 + g);  // scales g and g + 1 (g even: 2-byte aligned)
        r.a0 = d * (float)(signed char)(sc & 0xff);
        r.a1 = d * (float)(signed char)(sc >> 8);
        const u8* ql = b + 64 * h + 32 * (p & 1);
        const u8* qh = b + 128 + 32 * h;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            r.ql[i] = ld32_a2(ql + 4 * i);
            r.qh[i] = ld32_a2(qh + 4 * i);
        }
    }
    static __device__ __forceinline__ void decode8(const Raw& r, int c, float* q, float& a, float& bb) {
        const int lo_shift = 4 * (r.p >> 1), hi_shift = 2 * r.p;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const unsigned lo = (byte_of(r.ql[2 * c], r.ql[2 * c + 1], j) >> lo_shift) & 15;
            const unsigned hi = (byte_of(r.qh[2 * c], r.qh[2 * c + 1], j) >> hi_shift) & 3;
            q[j] = small_int(lo | (hi << 4), 32.f);
        }
        a = c < 2 ? r.a0 : r.a1;
        bb = 0.f;
    }
    static __device__ __forceinline__ void set_scales(u8* b, float amp) {
        *(unsigned short*)(b + 208) = float_to_half(amp / (32.f * 128.f));
    }
};

// --- kernels ---

#define QG_THREADS 128
#define QG_ROWS 4
// Output modes of qgemv: plain bf16 (+ bf16 bias), plain f32 (+ f32 bias), and the gated
// MLP's act(gate) * up (bf16) as gemv.cu's `gemv_silu` / `gemv_gelu` compute it.
#define QG_BF16 0
#define QG_F32 1
#define QG_SILU 2
#define QG_GELU 3

// Bytes of a row of k values of weight type T.
template <typename T>
__device__ __forceinline__ u64 row_bytes_of(int k) {
    return (u64)(k / T::ELEMS) * T::BYTES;
}

// This thread's part of the skinny GEMM over one block's QG_ROWS weight rows of W (rows of
// weight type T): acc[i][r] = the thread's share of xr[i] · W[row r] for the M activation
// rows xr. Plain: rows row0 .. row0 + 3
// (clamped to n - 1); gated: the gate rows row0, row0 + 1 and their up rows n below. The
// threads split the units of k (T::UNIT values each), each loading its unit of all QG_ROWS
// rows first (the loads in flight together), then, 8 values at a time, reading x once for all
// rows. Needs k % T::UNIT == 0 and 16-byte aligned x rows.
template <typename T, int M>
__device__ __forceinline__ void qgemv_sums(const bf16_t* const (&xr)[M], const u8* __restrict__ w, int n, int k,
                                           bool gated, int row0, float (&acc)[M][QG_ROWS]) {
    const u64 row_bytes = row_bytes_of<T>(k);
    const int units = k / T::UNIT;
    const u8* wr[QG_ROWS];
#pragma unroll
    for (int r = 0; r < QG_ROWS; r++) {
        const int row = gated ? (r < 2 ? 0 : n) + min(row0 + (r & 1), n - 1) : min(row0 + r, n - 1);
        wr[r] = w + (u64)row * row_bytes;
    }
#pragma unroll
    for (int i = 0; i < M; i++)
#pragma unroll
        for (int r = 0; r < QG_ROWS; r++) acc[i][r] = 0.f;
    for (int u = threadIdx.x; u < units; u += QG_THREADS) {
        typename T::Raw raw[QG_ROWS];
#pragma unroll
        for (int r = 0; r < QG_ROWS; r++) T::load(wr[r], u, raw[r]);
#pragma unroll
        for (int c = 0; c < T::UNIT / 8; c++) {
            float xv[M][8], xs[M];
#pragma unroll
            for (int i = 0; i < M; i++) {
                xs[i] = 0.f;
                unpack8(((const uint4*)(xr[i] + T::UNIT * u))[c], xv[i]);
                if (T::MIN)
#pragma unroll
                    for (int j = 0; j < 8; j++) xs[i] += xv[i][j];
            }
#pragma unroll
            for (int r = 0; r < QG_ROWS; r++) {
                float q[8], a, b;
                T::decode8(raw[r], c, q, a, b);
#pragma unroll
                for (int i = 0; i < M; i++) {
                    float s = 0.f;
#pragma unroll
                    for (int j = 0; j < 8; j++) s += q[j] * xv[i][j];
                    acc[i][r] += a * s;
                    if (T::MIN) acc[i][r] += b * xs[i];
                }
            }
        }
    }
}

// y[i, row] (at y + i * ldy + row) = x[i, :] · W[row, :] for i < M, W's rows quantized as T
// (`qgemv_sums`), the block's sums met by `skinny_gemm_end`. A block computes QG_ROWS rows
// (gated: the gate and up rows of 2 outputs). Needs k % 32 == 0 (whole blocks) and 16-byte
// aligned x rows. Grid: ceil(n / QG_ROWS) blocks (gated: ceil(n / 2)) of QG_THREADS threads.
template <typename T, int M>
__device__ __forceinline__ void qgemv(const bf16_t* __restrict__ x, const u8* __restrict__ w, const void* bias,
                                      void* y, int n, int k, int ldy, int mode) {
    __shared__ float part[QG_THREADS / 32][M][QG_ROWS];
    const bool gated = mode >= QG_SILU;
    const int row0 = blockIdx.x * (gated ? 2 : QG_ROWS);
    const bf16_t* xr[M];
#pragma unroll
    for (int i = 0; i < M; i++) xr[i] = x + (u64)i * k;
    float acc[M][QG_ROWS];
    qgemv_sums<T, M>(xr, w, n, k, gated, row0, acc);
    skinny_gemm_end<M, QG_THREADS>(acc, part, row0, n, gated, mode == QG_GELU, [&](int i, int row, float v) {
        const u64 at = (u64)i * ldy + row;
        if (gated) {
            ((bf16_t*)y)[at] = f2bf(v);
        } else if (mode == QG_F32) {
            ((float*)y)[at] = v + (bias != nullptr ? ((const float*)bias)[row] : 0.f);
        } else {
            ((bf16_t*)y)[at] = f2bf(v + (bias != nullptr ? bf2f(((const bf16_t*)bias)[row]) : 0.f));
        }
    });
}

// out[t, :] = bf16(dequantized row src(t) * scale) for t < rows, src(t) = ids[t] (an embedding
// gather; an id ≥ vocab gives a zero row) or t when ids is null (a whole matrix, the GEMM
// path's scratch). Grid: rows blocks of QG_THREADS threads.
template <typename T>
__device__ __forceinline__ void dequant_rows_impl(const u8* __restrict__ w, const unsigned* __restrict__ ids,
                                             bf16_t* __restrict__ out, int k, int vocab, float scale) {
    const int t = blockIdx.x;
    const unsigned src = ids != nullptr ? ids[t] : (unsigned)t;
    uint4* o = (uint4*)(out + (u64)t * k);
    const u8* row = w + (u64)src * row_bytes_of<T>(k);
    for (int u = threadIdx.x; u < (k >> 5); u += QG_THREADS) {
        typename T::Raw raw;
        if (src < (unsigned)vocab) T::load(row, u, raw);
#pragma unroll
        for (int c = 0; c < 4; c++) {
            float q[8], a, b, v[8];
            if (src < (unsigned)vocab) {
                T::decode8(raw, c, q, a, b);
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = fmaf(a, q[j], b) * scale;
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = 0.f;
            }
            o[4 * u + c] = make_uint4(pack_bf2(v[0], v[1]), pack_bf2(v[2], v[3]), pack_bf2(v[4], v[5]),
                                      pack_bf2(v[6], v[7]));
        }
    }
}

// Random blocks: every byte from splitmix64 of (seed, byte index), then the type's f16 scales
// set so values lie roughly in [-amp, amp]. One thread a block, grid-stride.
template <typename T>
__device__ __forceinline__ void random_blocks_impl(u8* __restrict__ w, u64 blocks, u64 seed, float amp) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < blocks; i += stride) {
        u8* b = w + i * T::BYTES;
        u64 r = 0;
        for (int j = 0; j < T::BYTES; j++) {
            if ((j & 7) == 0) r = splitmix64(seed ^ splitmix64(i * T::BYTES + j));
            b[j] = (u8)(r >> (8 * (j & 7)));
        }
        T::set_scales(b, amp);
    }
}

#define QGEMV_KERNEL(T, M)                                                                                  \
    extern "C" __global__ void __launch_bounds__(QG_THREADS)                                                \
        qgemv_m##M(const bf16_t* x, const u8* w, const void* bias, void* y, int n, int k, int ldy, int mode) { pdl_entry(); \
        qgemv<T, M>(x, w, bias, y, n, k, ldy, mode);                                                        \
    }

#define QUANT_KERNELS(T)                                                                                    \
    QGEMV_KERNEL(T, 1)                                                                                      \
    QGEMV_KERNEL(T, 2)                                                                                      \
    QGEMV_KERNEL(T, 3)                                                                                      \
    QGEMV_KERNEL(T, 4)                                                                                      \
    QGEMV_KERNEL(T, 5)                                                                                      \
    QGEMV_KERNEL(T, 6)                                                                                      \
    QGEMV_KERNEL(T, 7)                                                                                      \
    QGEMV_KERNEL(T, 8)                                                                                      \
    extern "C" __global__ void __launch_bounds__(QG_THREADS)                                                \
        dequant_rows(const u8* w, const unsigned* ids, bf16_t* out, int k, int vocab, float scale) { pdl_entry();      \
        dequant_rows_impl<T>(w, ids, out, k, vocab, scale);                                                      \
    }                                                                                                       \
    extern "C" __global__ void random_blocks(u8* w, u64 blocks, u64 seed, float amp) { pdl_entry();                     \
        random_blocks_impl<T>(w, blocks, seed, amp);                                                             \
    }
