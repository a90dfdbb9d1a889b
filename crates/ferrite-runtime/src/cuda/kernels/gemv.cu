// Skinny GEMM for decode: y[m, n] = x[m, k] · W[n, k]ᵀ (+ bias[n]) for m ≤ 8, bf16 inputs, f32
// accumulation, bf16 or f32 output. It is bound by reading W once. One block computes
// GEMV_ROWS output features: its threads split the k dimension, each reading two 16-byte
// words of every one of the block's rows per step (2 * GEMV_ROWS loads in flight), reusing
// each weight word for all m rows of x (which stay in L1/L2); the threads' sums meet in
// shared memory. A row of 4096 values is one step, so a layer's GEMV costs about one memory
// round trip plus the streaming. Needs k % 8 == 0 and 16-byte aligned rows.
// Grid: ceil(n / GEMV_ROWS) blocks of GEMV_THREADS threads.
//
// The gated variants (`gemv_silu_m*`, `gemv_gelu_m*`) are a gated MLP's gate-up projection
// with its activation as the epilogue: W holds 2n rows (gate rows, then up rows) and
// y[m, n] = act(gate) * up. A block takes the gate and up rows of 2 outputs (its 4 rows),
// rounds both sums to bf16 as the plain GEMV stores them, and stores act(g) * u as
// `silu_mul` / `gelu_tanh_mul` would: the same bits as the two kernels, one launch, and no
// round trip of the gate-up output through memory. Grid: ceil(n / 2) blocks.

#define GEMV_THREADS 256
#define GEMV_ROWS 4

__device__ __forceinline__ void store_out(bf16_t* y, float v) { *y = f2bf(v); }
__device__ __forceinline__ void store_out(float* y, float v) { *y = v; }

#define ACT_NONE 0
#define ACT_SILU 1
#define ACT_GELU 2

template <int M, int ACT, typename Out>
__device__ __forceinline__ void gemv(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                     const bf16_t* __restrict__ bias, Out* __restrict__ y, int n, int k) {
    __shared__ float part[GEMV_THREADS / 32][M][GEMV_ROWS];
    // Plain: rows row0 .. row0 + 3. Gated: gate rows j0, j0 + 1 and up rows n + j0, n + j0 + 1.
    const int row0 = blockIdx.x * (ACT == ACT_NONE ? GEMV_ROWS : 2);
    const int k8 = k >> 3;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    const uint4* wr[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) {
        const int row = ACT == ACT_NONE ? min(row0 + r, n - 1) : (r < 2 ? 0 : n) + min(row0 + (r & 1), n - 1);
        wr[r] = (const uint4*)(w + (u64)row * k);
    }
    pdl_entry();
    float acc[M][GEMV_ROWS];
#pragma unroll
    for (int i = 0; i < M; i++)
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) acc[i][r] = 0.f;
    for (int c = threadIdx.x; c < k8; c += 2 * GEMV_THREADS) {
        const int c2 = c + GEMV_THREADS;
        const bool two = c2 < k8;
        uint4 wa[GEMV_ROWS], wb[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) {
            wa[r] = wr[r][c];
            wb[r] = two ? wr[r][c2] : zero;
        }
#pragma unroll
        for (int i = 0; i < M; i++) {
            const uint4* xi = (const uint4*)(x + (u64)i * k);
            float xa[8], xb[8];
            unpack8(xi[c], xa);
            unpack8(two ? xi[c2] : zero, xb);
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r++) {
                float fa[8], fb[8];
                unpack8(wa[r], fa);
                unpack8(wb[r], fb);
#pragma unroll
                for (int j = 0; j < 8; j++) acc[i][r] += fa[j] * xa[j] + fb[j] * xb[j];
            }
        }
    }
    const bool gated = ACT != ACT_NONE;
    skinny_gemm_end<M, GEMV_THREADS>(acc, part, row0, n, gated, ACT == ACT_GELU, [&](int i, int row, float v) {
        store_out(y + (u64)i * n + row, gated ? v : v + (bias != nullptr ? bf2f(bias[row]) : 0.f));
    });
}

#define GEMV_KERNELS(M)                                                                                  \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                           \
        gemv_bf16_m##M(const bf16_t* x, const bf16_t* w, const bf16_t* bias, bf16_t* y, int n, int k) { \
        gemv<M, ACT_NONE, bf16_t>(x, w, bias, y, n, k);                                                  \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                           \
        gemv_f32_m##M(const bf16_t* x, const bf16_t* w, const bf16_t* bias, float* y, int n, int k) {   \
        gemv<M, ACT_NONE, float>(x, w, bias, y, n, k);                                                   \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                           \
        gemv_silu_m##M(const bf16_t* x, const bf16_t* w, bf16_t* y, int n, int k) {                      \
        gemv<M, ACT_SILU, bf16_t>(x, w, nullptr, y, n, k);                                               \
    }                                                                                                    \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                           \
        gemv_gelu_m##M(const bf16_t* x, const bf16_t* w, bf16_t* y, int n, int k) {                      \
        gemv<M, ACT_GELU, bf16_t>(x, w, nullptr, y, n, k);                                               \
    }

GEMV_KERNELS(1)
GEMV_KERNELS(2)
GEMV_KERNELS(3)
GEMV_KERNELS(4)
GEMV_KERNELS(5)
GEMV_KERNELS(6)
GEMV_KERNELS(7)
GEMV_KERNELS(8)

// The skinny GEMM over an FP8 weight matrix (`ops::fp8`): W holds e4m3 codes, one byte a
// value, and `scales` one f32 per row and run of 16·cb16 columns (ncb a row), so
// w[r, c] = e4m3(W[r, c]) · scales[r · ncb + c / (16 · cb16)]. As `gemv`, with a 16-byte word
// holding 16 codes: each thread reads two words of each of the block's 4 rows a step, and a
// word's 16 products are summed before its scale multiplies them. The codes are widened two
// at a time into a bf16 pair by moving bits (value · 2^-120, exact: e4m3's 3 mantissa bits
// fit bf16's 7 and its exponents bf16's range, subnormals included), a handful of integer
// operations per code where the decode GEMV's budget is about one; the 2^120 goes back on
// the word's sum, exactly. Needs
// k % 16 == 0 and 16-byte aligned rows of W and x. The same variants, grids and epilogues
// as `gemv` (`fp8_gemv_{bf16,f32,silu,gelu}_m*`), the bias in the output's type.
__device__ __forceinline__ float e4m3_dot16(uint4 w, const float* x) {
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < 4; q++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            // Codes 2h and 2h + 1 of the word as the bf16 pair (value · 2^-120): each code's
            // exponent and mantissa bits moved under bf16's, its sign onto bf16's sign.
            const unsigned p = __byte_perm(words[q], 0u, h == 0 ? 0x4140u : 0x4342u);
            const unsigned b = ((p << 4) & 0x07f007f0u) | ((p << 8) & 0x80008000u);
            s += __uint_as_float(b << 16) * x[4 * q + 2 * h] + __uint_as_float(b & 0xffff0000u) * x[4 * q + 2 * h + 1];
        }
    }
    return s * 0x1p120f;
}

__device__ __forceinline__ float bias_value(const bf16_t* b, int row) { return bf2f(b[row]); }
__device__ __forceinline__ float bias_value(const float* b, int row) { return b[row]; }

template <int M, int ACT, typename Out>
__device__ __forceinline__ void fp8_gemv(const bf16_t* __restrict__ x, const unsigned char* __restrict__ w,
                                         const float* __restrict__ scales, int ncb, int cb16,
                                         const Out* __restrict__ bias, Out* __restrict__ y, int n, int k) {
    __shared__ float part[GEMV_THREADS / 32][M][GEMV_ROWS];
    const int row0 = blockIdx.x * (ACT == ACT_NONE ? GEMV_ROWS : 2);
    const int k16 = k >> 4;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    const uint4* wr[GEMV_ROWS];
    const float* sr[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) {
        const int row = ACT == ACT_NONE ? min(row0 + r, n - 1) : (r < 2 ? 0 : n) + min(row0 + (r & 1), n - 1);
        wr[r] = (const uint4*)(w + (u64)row * k);
        sr[r] = scales + (u64)row * ncb;
    }
    pdl_entry();
    float acc[M][GEMV_ROWS];
#pragma unroll
    for (int i = 0; i < M; i++)
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) acc[i][r] = 0.f;
    for (int c = threadIdx.x; c < k16; c += 2 * GEMV_THREADS) {
        const int c2 = c + GEMV_THREADS;
        const bool two = c2 < k16;
        uint4 wa[GEMV_ROWS], wb[GEMV_ROWS];
        float sa[GEMV_ROWS], sb[GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) {
            // One scale a row (ncb == 1, the per-channel matrices) needs no division.
            wa[r] = wr[r][c];
            sa[r] = sr[r][ncb == 1 ? 0 : c / cb16];
            wb[r] = two ? wr[r][c2] : zero;
            sb[r] = two ? sr[r][ncb == 1 ? 0 : c2 / cb16] : 0.f;
        }
#pragma unroll
        for (int i = 0; i < M; i++) {
            const uint4* xi = (const uint4*)(x + (u64)i * k);
            float xa[16], xb[16];
            unpack8(xi[2 * c], xa);
            unpack8(xi[2 * c + 1], xa + 8);
            unpack8(two ? xi[2 * c2] : zero, xb);
            unpack8(two ? xi[2 * c2 + 1] : zero, xb + 8);
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r++) acc[i][r] += e4m3_dot16(wa[r], xa) * sa[r] + e4m3_dot16(wb[r], xb) * sb[r];
        }
    }
    const bool gated = ACT != ACT_NONE;
    skinny_gemm_end<M, GEMV_THREADS>(acc, part, row0, n, gated, ACT == ACT_GELU, [&](int i, int row, float v) {
        store_out(y + (u64)i * n + row, gated ? v : v + (bias != nullptr ? bias_value(bias, row) : 0.f));
    });
}

#define FP8_GEMV_KERNELS(M)                                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                                        \
        fp8_gemv_bf16_m##M(const bf16_t* x, const unsigned char* w, const float* s, int ncb, int cb16,               \
                           const bf16_t* bias, bf16_t* y, int n, int k) {                                             \
        fp8_gemv<M, ACT_NONE, bf16_t>(x, w, s, ncb, cb16, bias, y, n, k);                                             \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                                        \
        fp8_gemv_f32_m##M(const bf16_t* x, const unsigned char* w, const float* s, int ncb, int cb16,                \
                          const float* bias, float* y, int n, int k) {                                                \
        fp8_gemv<M, ACT_NONE, float>(x, w, s, ncb, cb16, bias, y, n, k);                                              \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                                        \
        fp8_gemv_silu_m##M(const bf16_t* x, const unsigned char* w, const float* s, int ncb, int cb16, bf16_t* y,    \
                           int n, int k) {                                                                            \
        fp8_gemv<M, ACT_SILU, bf16_t>(x, w, s, ncb, cb16, (const bf16_t*)nullptr, y, n, k);                                          \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                                        \
        fp8_gemv_gelu_m##M(const bf16_t* x, const unsigned char* w, const float* s, int ncb, int cb16, bf16_t* y,    \
                           int n, int k) {                                                                            \
        fp8_gemv<M, ACT_GELU, bf16_t>(x, w, s, ncb, cb16, (const bf16_t*)nullptr, y, n, k);                                          \
    }

FP8_GEMV_KERNELS(1)
FP8_GEMV_KERNELS(2)
FP8_GEMV_KERNELS(3)
FP8_GEMV_KERNELS(4)
FP8_GEMV_KERNELS(5)
FP8_GEMV_KERNELS(6)
FP8_GEMV_KERNELS(7)
FP8_GEMV_KERNELS(8)
