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
