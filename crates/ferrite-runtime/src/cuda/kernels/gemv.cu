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

// The skinny GEMM over an FP8 weight matrix (`ops::fp8`), on the tensor cores: W holds e4m3
// codes, one byte a value, and `scales` one f32 per row (ncb == 1) or per row and run of
// 16·cb16 columns (cb16 a multiple of 4: runs of 64 columns and up), so
// w[r, c] = e4m3(W[r, c]) · scales[r · ncb + c / (16 · cb16)].
//
// Widening a code to f32 costs a handful of integer operations where a decode GEMV's budget is
// about one a byte, so here the codes are widened two at a time into a bf16 pair (4 operations:
// a byte permute, a shift and two masks; value · 2^-120, exact: e4m3's 3 mantissa bits fit
// bf16's 7 and its exponents bf16's range, subnormals included) and multiplied by mma.sync
// m16n8k16 (bf16 in, f32 accumulate): a warp's tile is 16 weight rows (the A operand) by the
// m ≤ 8 rows of x (B, columns m.. zero). x is taken times 2^64 (exact) so that no product falls
// to an f32 subnormal; 2^56 goes back on each row's sum.
//
// The k order within a tile is ours to choose (a dot product does not care), so each lane reads
// whole 16-byte words: lane (g, t) (g = lane / 4, t = lane % 4) reads word 4c + t of rows g and
// g + 8 for the warp's chunk c (64 columns), and its A and B slots of the chunk's 4 mma steps
// are that word's codes 4s .. 4s + 3 and x's values at the same columns. The block's 8 warps
// take interleaved chunks (4 at a time, loads first) and meet in shared memory.
//
// Plain (`fp8_gemv_bf16`, `fp8_gemv_f32`): a block computes 16 output rows, grid ceil(n / 16).
// Gated (`fp8_gemv_silu`, `fp8_gemv_gelu`, W of 2n rows): a block's tile is the gate rows of 8
// outputs (A rows 0-7) and their up rows (8-15), so a lane holds both sums of its outputs;
// each is rounded to bf16 as the unfused path stores them before act(g) · u. Grid ceil(n / 8).
// Needs k % 16 == 0 and 16-byte aligned rows of W and x.
//
// Two ways to load, chosen by the launcher from the matrix's size (`ops::fp8`), as an isolated
// sweep on an H100 measured them (BENCHMARKS.md, "FP8 GEMV variants"):
// - streamed (`fp8_gemv_*`): weights read with `L1::no_allocate.L2::256B` (they are read once,
//   and a 256-byte L2 fetch suits a warp's four 16-byte words a row), x through registers:
//   the faster for the large matrices (gate-up 47.8 -> 45.0 us, down 26.6 -> 24.0);
// - staged (`fp8_gemv_*_staged`): weights plain, x copied into shared memory by `cp.async`,
//   so a lane's x loads hold no registers and never stall the weight loads behind them: the
//   faster for the small ones with few blocks (o 15.4 -> 10.0 us, q/k/v 15.2 -> 13.9).
// Both together measured slower than either alone.

#define FP8_WARPS 8
#define FP8_THREADS (32 * FP8_WARPS)
#define FP8_UNROLL 4

// Codes `sel` picks from `w` (two bytes into the high byte of each half) as a bf16 pair × 2^-120.
__device__ __forceinline__ unsigned e4m3x2_bf16(unsigned w, unsigned sel) {
    const unsigned v = __byte_perm(w, 0u, sel);
    return (v & 0x80008000u) | ((v >> 4) & 0x07f007f0u);
}

// A 16-byte weight word, read once: L1 skipped, L2 fetched 256 bytes at a time.
__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}

// A bf16 pair times 2^64 (exact).
__device__ __forceinline__ unsigned bf16x2_times_2p64(unsigned x) {
    unsigned r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(0x5f805f80u), "r"(0x80008000u));
    return r;
}

__device__ __forceinline__ float bias_value(const bf16_t* b, int row) { return bf2f(b[row]); }
__device__ __forceinline__ float bias_value(const float* b, int row) { return b[row]; }

template <int ACT, bool RUNS, bool STAGED, typename Out>
__device__ __forceinline__ void fp8_gemv(const bf16_t* __restrict__ x, const unsigned char* __restrict__ w,
                                         const float* __restrict__ scales, int ncb, int cb16,
                                         const Out* __restrict__ bias, Out* __restrict__ y, int m, int n, int k) {
    __shared__ float part[FP8_WARPS][16][8];
    // Staged: each lane's x words of the chunks in flight.
    __shared__ uint4 xs_stage[STAGED ? FP8_WARPS : 1][STAGED ? FP8_UNROLL : 1][32][2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool gated = ACT != ACT_NONE;
    // The tile's rows g and g + 8: plain, rows row0 + g and row0 + g + 8; gated, the gate and
    // up rows of output row0 + g.
    const int row0 = blockIdx.x * (gated ? 8 : 16);
    const int ra = min(row0 + g, n - 1);
    const int rb = gated ? n + min(row0 + g, n - 1) : min(row0 + g + 8, n - 1);
    const uint4* wa = (const uint4*)(w + (u64)ra * k);
    const uint4* wb = (const uint4*)(w + (u64)rb * k);
    const uint4* xr = (const uint4*)(x + (u64)min(g, m - 1) * k);
    const int k16 = k >> 4, chunks = (k16 + 3) >> 2;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    pdl_entry();
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int c0 = warp; c0 < chunks; c0 += FP8_WARPS * FP8_UNROLL) {
        uint4 la[FP8_UNROLL], lb[FP8_UNROLL], lx[STAGED ? 1 : FP8_UNROLL][2];
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; u++) {
            const int word = 4 * (c0 + u * FP8_WARPS) + t;
            const bool in = word < k16;
            la[u] = in ? (STAGED ? wa[word] : ldg_stream(wa + word)) : zero;
            lb[u] = in ? (STAGED ? wb[word] : ldg_stream(wb + word)) : zero;
        }
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; u++) {
            const int word = 4 * (c0 + u * FP8_WARPS) + t;
            const bool in = word < k16 && g < m;
            if (STAGED) {
                if (in) {
                    cp_async16(&xs_stage[warp][u][lane][0], xr + 2 * word);
                    cp_async16(&xs_stage[warp][u][lane][1], xr + 2 * word + 1);
                }
            } else {
                lx[u][0] = in ? xr[2 * word] : zero;
                lx[u][1] = in ? xr[2 * word + 1] : zero;
            }
        }
        if (STAGED) asm volatile("cp.async.wait_all;" ::: "memory");
#pragma unroll
        for (int u = 0; u < FP8_UNROLL; u++) {
            const int c = c0 + u * FP8_WARPS;
            if (c >= chunks) break;
            const unsigned wa4[4] = {la[u].x, la[u].y, la[u].z, la[u].w};
            const unsigned wb4[4] = {lb[u].x, lb[u].y, lb[u].z, lb[u].w};
            uint4 x0, x1;
            if (STAGED) {
                // A lane reads back only the words it copied (no barrier needed).
                const bool in = 4 * c + t < k16 && g < m;
                x0 = in ? xs_stage[warp][u][lane][0] : zero;
                x1 = in ? xs_stage[warp][u][lane][1] : zero;
            } else {
                x0 = lx[u][0];
                x1 = lx[u][1];
            }
            const unsigned xs[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
            float part_acc[4] = {0.f, 0.f, 0.f, 0.f};
            float* d = RUNS ? part_acc : acc;
#pragma unroll
            for (int s = 0; s < 4; s++)
                mma_bf16(d, e4m3x2_bf16(wa4[s], 0x1404u), e4m3x2_bf16(wb4[s], 0x1404u), e4m3x2_bf16(wa4[s], 0x3424u),
                         e4m3x2_bf16(wb4[s], 0x3424u), bf16x2_times_2p64(xs[2 * s]), bf16x2_times_2p64(xs[2 * s + 1]));
            if (RUNS) {
                const int run = 4 * c / cb16;
                const float sa = scales[(u64)ra * ncb + run], sb = scales[(u64)rb * ncb + run];
                acc[0] += part_acc[0] * sa;
                acc[1] += part_acc[1] * sa;
                acc[2] += part_acc[2] * sb;
                acc[3] += part_acc[3] * sb;
            }
        }
    }
    // Lane (g, t) holds rows g and g + 8 of x rows 2t and 2t + 1.
    part[warp][g][2 * t] = acc[0];
    part[warp][g][2 * t + 1] = acc[1];
    part[warp][g + 8][2 * t] = acc[2];
    part[warp][g + 8][2 * t + 1] = acc[3];
    __syncthreads();
    // A row's sum, back to scale: 2^-120 · 2^64 undone, times the row's scale.
    auto sum = [&](int r, int i, int row) {
        float v = 0.f;
#pragma unroll
        for (int p = 0; p < FP8_WARPS; p++) v += part[p][r][i];
        return v * 0x1p56f * (RUNS ? 1.f : scales[row]);
    };
    if (gated) {
        const int q = threadIdx.x & 7, i = threadIdx.x >> 3, j = row0 + q;
        if (i < m && j < n) {
            const float gv = bf2f(f2bf(sum(q, i, j))), uv = bf2f(f2bf(sum(q + 8, i, n + j)));
            store_out(y + (u64)i * n + j, (ACT == ACT_GELU ? gelu_tanh(gv) : silu(gv)) * uv);
        }
        return;
    }
    const int r = threadIdx.x & 15, i = threadIdx.x >> 4, row = row0 + r;
    if (i < m && row < n)
        store_out(y + (u64)i * n + row, sum(r, i, row) + (bias != nullptr ? bias_value(bias, row) : 0.f));
}

#define FP8_GEMV_KERNELS(RUNS, STAGED, SUFFIX)                                                                              \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS)                                                       \
        fp8_gemv_bf16##SUFFIX(const bf16_t* x, const unsigned char* w, const float* s, int ncb, int cb16,           \
                              const bf16_t* bias, bf16_t* y, int m, int n, int k) {                                 \
        fp8_gemv<ACT_NONE, RUNS, STAGED, bf16_t>(x, w, s, ncb, cb16, bias, y, m, n, k);                                     \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS)                                                       \
        fp8_gemv_f32##SUFFIX(const bf16_t* x, const unsigned char* w, const float* s, int ncb, int cb16,            \
                             const float* bias, float* y, int m, int n, int k) {                                    \
        fp8_gemv<ACT_NONE, RUNS, STAGED, float>(x, w, s, ncb, cb16, bias, y, m, n, k);                                      \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS)                                                       \
        fp8_gemv_silu##SUFFIX(const bf16_t* x, const unsigned char* w, const float* s, int ncb, int cb16,           \
                              bf16_t* y, int m, int n, int k) {                                                     \
        fp8_gemv<ACT_SILU, RUNS, STAGED, bf16_t>(x, w, s, ncb, cb16, (const bf16_t*)nullptr, y, m, n, k);                   \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS)                                                       \
        fp8_gemv_gelu##SUFFIX(const bf16_t* x, const unsigned char* w, const float* s, int ncb, int cb16,           \
                              bf16_t* y, int m, int n, int k) {                                                     \
        fp8_gemv<ACT_GELU, RUNS, STAGED, bf16_t>(x, w, s, ncb, cb16, (const bf16_t*)nullptr, y, m, n, k);                   \
    }

// A scale a row, and a scale a row and run of columns; streamed and staged.
FP8_GEMV_KERNELS(false, false, )
FP8_GEMV_KERNELS(true, false, _runs)
FP8_GEMV_KERNELS(false, true, _staged)
FP8_GEMV_KERNELS(true, true, _runs_staged)
