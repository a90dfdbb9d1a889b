// Skinny GEMM for decode: y[m, n] = x[m, k] · W[n, k]ᵀ (+ bias[n]) for m ≤ 8, bf16 inputs, f32
// accumulation, bf16 or f32 output. It is bound by reading W once, so every warp streams
// GEMV_ROWS rows of W with 16-byte loads, GEMV_UNROLL loads per row in flight, and reuses each
// weight word for all m rows of x (which stay in L1/L2). Needs k % 8 == 0 and 16-byte
// aligned rows. Grid: ceil(n / (GEMV_WARPS * GEMV_ROWS)) blocks of GEMV_WARPS warps.

#define GEMV_WARPS 8
#define GEMV_ROWS 2
#define GEMV_UNROLL 4

template <int M, typename Out>
__device__ __forceinline__ void gemv(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                     const bf16_t* __restrict__ bias, Out* __restrict__ y, int n, int k);

__device__ __forceinline__ void store_out(bf16_t* y, float v) { *y = f2bf(v); }
__device__ __forceinline__ void store_out(float* y, float v) { *y = v; }

template <int M, typename Out>
__device__ __forceinline__ void gemv(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                                     const bf16_t* __restrict__ bias, Out* __restrict__ y, int n, int k) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_ROWS;
    if (row0 >= n) return;
    const int k8 = k >> 3;
    const uint4* wr[GEMV_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_ROWS; r++) wr[r] = (const uint4*)(w + (u64)min(row0 + r, n - 1) * k);
    float acc[M][GEMV_ROWS];
#pragma unroll
    for (int i = 0; i < M; i++)
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) acc[i][r] = 0.f;
    for (int base = 0; base < k8; base += 32 * GEMV_UNROLL) {
        uint4 wv[GEMV_UNROLL][GEMV_ROWS];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            const int c = base + u * 32 + lane;
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r++) wv[u][r] = c < k8 ? wr[r][c] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            const int c = base + u * 32 + lane;
            if (c >= k8) break;
            float wf[GEMV_ROWS][8];
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; r++) unpack8(wv[u][r], wf[r]);
#pragma unroll
            for (int i = 0; i < M; i++) {
                float xf[8];
                unpack8(((const uint4*)(x + (u64)i * k))[c], xf);
#pragma unroll
                for (int r = 0; r < GEMV_ROWS; r++)
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[i][r] += wf[r][j] * xf[j];
            }
        }
    }
#pragma unroll
    for (int i = 0; i < M; i++)
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; r++) {
            const float v = warp_sum(acc[i][r]);
            const int row = row0 + r;
            if (lane == 0 && row < n) store_out(y + (u64)i * n + row, v + (bias != nullptr ? bf2f(bias[row]) : 0.f));
        }
}

#define GEMV_KERNELS(M)                                                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                         \
        gemv_bf16_m##M(const bf16_t* x, const bf16_t* w, const bf16_t* bias, bf16_t* y, int n, int k) {  \
        gemv<M, bf16_t>(x, w, bias, y, n, k);                                                             \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                         \
        gemv_f32_m##M(const bf16_t* x, const bf16_t* w, const bf16_t* bias, float* y, int n, int k) {    \
        gemv<M, float>(x, w, bias, y, n, k);                                                              \
    }

GEMV_KERNELS(1)
GEMV_KERNELS(2)
GEMV_KERNELS(3)
GEMV_KERNELS(4)
GEMV_KERNELS(5)
GEMV_KERNELS(6)
GEMV_KERNELS(7)
GEMV_KERNELS(8)
