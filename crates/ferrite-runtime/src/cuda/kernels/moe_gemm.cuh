// The routed experts' matrix products, for every weight type the device reads: appended to
// quant.cuh once per block type (compile.rs adds `MOE_KERNELS(<type>)` after the type's
// `QUANT_KERNELS`), once for bf16 weights (`MOE_KERNELS(bf16w)`, module `moe_bf16`) and once
// for FP8 rows (`MOE_KERNELS(e4m3_rows)`, module `moe_fp8`, the row type in moe_fp8.cuh).
//
// A layer's experts of one projection are one stacked allocation: expert e's `rows` rows of k
// values start at w + e * expert_bytes. The (token, expert) pairs of a step are grouped by
// expert (moe.cu's `moe_align`): offsets[e] .. offsets[e + 1] are expert e's rows in that
// order; src[r] is the token of row r. The input x is either the tokens' rows, read through
// src (the gate-up projection), or already one row per pair in expert order (src null: the
// down projection). Output y holds one row per pair, in expert order. Every kernel takes
// quant.cuh's `fmt` (the runtime part of the block layout: an MLX module's group size and scale
// type; 0 otherwise).
//
// Modes (quant.cuh's QG_*): QG_BF16 writes y[r, 0..n) = x_r · W_eᵀ (W_e has n rows); QG_SILU /
// QG_GELU take W_e as 2n rows (gate rows, then up rows, as the dense gate-up matrix) and write
// act(gate) * up, both rounded to bf16 first as the dense GEMV's epilogue does.
//
//   moe_gemv_m{1,2,4,8}  decode (at most M tokens): grid (ceil(n / QG_ROWS), or ceil(n / 2)
//                     gated; slots), block (_, s) takes active[s]'s rows (at most M: a token's
//                     route names an expert once) through quant.cuh's skinny GEMM, so only
//                     the chosen experts' weights are read, each once. Slots past the active
//                     experts (active[s] < 0) compute nothing. The down projection also sums
//                     each token's experts (`MoeSum`): no combine launch at decode.
//   moe_gemm          any number of rows: a tensor-core GEMM over tiles of MG_BM rows of one
//                     expert (tiles[e] .. tiles[e + 1] are expert e's, from moe_align) by MG_BN
//                     output columns (gated: MG_BN / 2 gate and as many up rows), mma.sync
//                     m16n8k16 in bf16 with f32 accumulation. Each K step of MG_BK values
//                     stages the activation tile and the weight tile in shared memory — the
//                     weights dequantized on the way (a * q + b, product and sum each
//                     rounded, then rounded to bf16: the dense path's scratch values) — with
//                     the next step's global loads held in registers meanwhile. Rows padded
//                     by 8 bf16 keep ldmatrix conflict-free.
//                     Grid (column tiles, an upper bound of the row tiles): blocks past
//                     tiles[E] exit.

// bf16 weights read as blocks: units of 8 values, value = a * q + b with a = 1, b = 0.
struct bf16w {
    enum { BYTES = 2, ELEMS = 1, MIN = 0, UNIT = 8 };
    FIXED_LAYOUT
    struct Raw { uint4 v; };
    static __device__ __forceinline__ void load(const u8* row, int u, Raw& r, int) { r.v = ((const uint4*)row)[u]; }
    static __device__ __forceinline__ void decode8(const Raw& r, int c, float* q, float& a, float& bb) {
        unpack8(r.v, q);
        a = 1.f;
        bb = 0.f;
    }
};

// Where expert e's rows are in the step: its first row (expert order) and row count.
__device__ __forceinline__ void expert_rows(const int* offsets, int e, int& first, int& count) {
    first = offsets[e];
    count = offsets[e + 1] - first;
}

// Expert e's rows (first .. first + count) through the skinny GEMM as R rows (count <= R;
// the rows past count repeat the last one and are not stored).
template <typename T, int R>
__device__ __forceinline__ void moe_gemv_rows(const bf16_t* __restrict__ x, const int* __restrict__ src,
                                              const u8* __restrict__ we, bf16_t* __restrict__ y, int first,
                                              int count, int n, int k, int mode, int fmt, float* part) {
    const bf16_t* xr[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
        const int r = first + min(i, count - 1);
        xr[i] = x + (u64)(src != nullptr ? src[r] : r) * k;
    }
    const bool gated = mode >= QG_SILU;
    const int row0 = blockIdx.x * (gated ? 2 : QG_ROWS);
    float acc[R][QG_ROWS];
    qgemv_sums<T, R>(xr, we, n, k, gated, row0, fmt, acc);
    skinny_gemm_end<R, QG_THREADS>(acc, (float(*)[R][QG_ROWS])part, row0, n, gated, mode == QG_GELU,
                                   [&](int i, int row, float v) {
                                       if (i < count) y[(u64)(first + i) * n + row] = f2bf(v);
                                   });
}

// The weighted sum of a decode step's experts, fused into the down projection's skinny GEMM:
// out[t, row] = Σ_j weights[t, j] · y[pos[t, j], row] over each token's top_k pairs in
// ascending expert order, f32 accumulation (moe.cu's moe_combine, the same bits). out null:
// no sum.
struct MoeSum {
    bf16_t* out;
    const int* pos;
    const float* weights;
    int top_k, tokens;
    // One a column block (gridDim.x), zero between launches: the last of a column's slots to
    // finish sums its rows.
    int* counters;
};

// Slot blockIdx.y's expert over its rows, by the smallest of R = 1, 2, 4 or M (a power of two)
// rows that holds them: a kernel for M rows carries the smaller cases, so a step of few
// tokens keeps the register use (and occupancy) of few rows. With a sum (plain mode), every
// slot of a column block counts itself done, and the last sums the column's QG_ROWS rows
// for every token from the other slots' stores.
template <typename T, int M>
__device__ __forceinline__ void moe_gemv(const bf16_t* __restrict__ x, const int* __restrict__ src,
                                         const u8* __restrict__ w, u64 expert_bytes, bf16_t* __restrict__ y,
                                         const int* __restrict__ offsets, const int* __restrict__ active, int n, int k,
                                         int mode, int fmt, const MoeSum sum) {
    __shared__ float part[QG_THREADS / 32 * M * QG_ROWS];
    __shared__ int last;
    const int e = active[blockIdx.y];
    if (e >= 0) {
        int first, count;
        expert_rows(offsets, e, first, count);
        count = min(count, M);
        const u8* we = w + (u64)e * expert_bytes;
        if (M == 1 || count == 1) {
            moe_gemv_rows<T, 1>(x, src, we, y, first, count, n, k, mode, fmt, part);
        } else if (M == 2 || count == 2) {
            moe_gemv_rows<T, (M < 2 ? M : 2)>(x, src, we, y, first, count, n, k, mode, fmt, part);
        } else if (M == 4 || count <= 4) {
            moe_gemv_rows<T, (M < 4 ? M : 4)>(x, src, we, y, first, count, n, k, mode, fmt, part);
        } else {
            moe_gemv_rows<T, M>(x, src, we, y, first, count, n, k, mode, fmt, part);
        }
    }
    if (sum.out == nullptr) return;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(sum.counters + blockIdx.x, 1) == gridDim.y - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int row0 = blockIdx.x * QG_ROWS;
    for (int i = threadIdx.x; i < sum.tokens * QG_ROWS; i += QG_THREADS) {
        const int t = i / QG_ROWS, row = row0 + i % QG_ROWS;
        if (row >= n) continue;
        float acc = 0.f;
        for (int j = 0; j < sum.top_k; j++)
            acc += sum.weights[t * sum.top_k + j] * bf2f(__ldcg(y + (u64)sum.pos[t * sum.top_k + j] * n + row));
        sum.out[(u64)t * n + row] = f2bf(acc);
    }
    if (threadIdx.x == 0) sum.counters[blockIdx.x] = 0;
}

#define MG_THREADS 128
#define MG_BM 64
#define MG_BN 64
#define MG_BK 32
#define MG_LD (MG_BK + 8)

// One thread's share of a weight tile: the 16 values [16 half, 16 half + 16) of one row of a
// K step, loaded into registers by `load` and dequantized into shared memory by `store`.
template <typename T>
struct WeightStage {
    enum { N = T::UNIT >= 16 ? 1 : 16 / T::UNIT };
    typename T::Raw raw[N];
    // Each 8-value group lies inside the row.
    bool ok[2];
    // One unit (N == 1): the values are its chunks 2, 3 rather than 0, 1.
    bool upper;

    __device__ __forceinline__ void load(const u8* row, int k0, int half, int k, int fmt) {
        const int v0 = k0 + 16 * half;
        ok[0] = row != nullptr && v0 < k;
        ok[1] = row != nullptr && v0 + 8 < k;
        upper = v0 % T::UNIT != 0;
#pragma unroll
        for (int i = 0; i < N; i++)
            if (ok[N == 1 ? 0 : i]) T::load(row, v0 / T::UNIT + i, raw[i], fmt);
    }

    __device__ __forceinline__ void store(bf16_t* dst) const {
        uint4 out[2];
#pragma unroll
        for (int g = 0; g < 2; g++) {
            float v[8];
            if (ok[g]) {
                float q[8], a, b;
                // Chunk indices spelled out, so the raw words are indexed statically (registers).
                if (N != 1) T::decode8(raw[g], 0, q, a, b);
                else if (upper) T::decode8(raw[0], 2 + g, q, a, b);
                else T::decode8(raw[0], g, q, a, b);
#pragma unroll
                // Product then sum, each rounded: quant.cuh's dequant_rows (a fused multiply-add
                // would differ for MLX's f32 scales, where a * q is not exact).
                for (int j = 0; j < 8; j++) v[j] = __fadd_rn(__fmul_rn(a, q[j]), b);
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = 0.f;
            }
            out[g] = make_uint4(pack_bf2(v[0], v[1]), pack_bf2(v[2], v[3]), pack_bf2(v[4], v[5]), pack_bf2(v[6], v[7]));
        }
        ((uint4*)dst)[0] = out[0];
        ((uint4*)dst)[1] = out[1];
    }
};

template <typename T>
__device__ __forceinline__ void moe_gemm_impl(const bf16_t* __restrict__ x, const int* __restrict__ src,
                                         const u8* __restrict__ w, u64 expert_bytes, bf16_t* __restrict__ y,
                                         const int* __restrict__ offsets, const int* __restrict__ tiles, int E, int n,
                                         int k, int mode, int fmt) {
    __shared__ __align__(16) bf16_t As[2][MG_BM * MG_LD];
    __shared__ __align__(16) bf16_t Bs[2][MG_BN * MG_LD];
    const int tile = blockIdx.y;
    if (tile >= tiles[E]) return;
    // The expert this tile belongs to: the last e with tiles[e] <= tile (tiles[e + 1] > tile).
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tiles[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    const int e = lo;
    int first, count;
    expert_rows(offsets, e, first, count);
    first += (tile - tiles[e]) * MG_BM;
    const int rows = min(MG_BM, count - (tile - tiles[e]) * MG_BM);
    const bool gated = mode >= QG_SILU;
    const int n0 = blockIdx.x * (gated ? MG_BN / 2 : MG_BN);
    const u64 rb = T::row_bytes(k, fmt);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const uint4 zero = make_uint4(0, 0, 0, 0);

    // Activation loads: 16-byte words tid and tid + MG_THREADS of the MG_BM x MG_BK tile.
    const bf16_t* a_src[2];
    int a_at[2], a_col[2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        const int idx = tid + j * MG_THREADS, r = idx >> 2;
        a_col[j] = 8 * (idx & 3);
        a_at[j] = r * MG_LD + a_col[j];
        a_src[j] = r < rows ? x + (u64)(src != nullptr ? src[first + r] : first + r) * k : nullptr;
    }
    // Weight loads: half `tid & 1` of tile row `tid >> 1` (gated: gate rows, then up rows).
    const int b_row = tid >> 1, b_half = tid & 1;
    const int out_col = n0 + (gated ? (b_row & (MG_BN / 2 - 1)) : b_row);
    const int w_row = gated && b_row >= MG_BN / 2 ? n + out_col : out_col;
    const u8* b_src = out_col < n ? w + (u64)e * expert_bytes + (u64)w_row * rb : nullptr;

    uint4 a_reg[2];
    WeightStage<T> b_reg;
    auto load = [&](int k0) {
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int col = k0 + a_col[j];
            a_reg[j] = a_src[j] != nullptr && col < k ? *(const uint4*)(a_src[j] + col) : zero;
        }
        b_reg.load(b_src, k0, b_half, k, fmt);
    };
    auto store = [&](int buf) {
#pragma unroll
        for (int j = 0; j < 2; j++) *(uint4*)(As[buf] + a_at[j]) = a_reg[j];
        b_reg.store(Bs[buf] + b_row * MG_LD + 16 * b_half);
    };

    float acc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    // ldmatrix lanes: A matrices (rows 0-7 | 8-15 of the warp's 16) x (k 0-7 | 8-15); B
    // matrices (k 0-7 | 8-15) x (columns 0-7 | 8-15 of a pair of n-tiles).
    const int mq = lane >> 3;
    const int a_lane = (warp * 16 + (mq & 1) * 8 + (lane & 7)) * MG_LD + (mq >> 1) * 8;
    const int b_lane = ((mq >> 1) * 8 + (lane & 7)) * MG_LD + (mq & 1) * 8;
    const bool busy = warp * 16 < rows;
    const int steps = (k + MG_BK - 1) / MG_BK;
    load(0);
    store(0);
    __syncthreads();
    for (int s = 0; s < steps; s++) {
        if (s + 1 < steps) load((s + 1) * MG_BK);
        if (busy) {
            const bf16_t* A = As[s & 1];
            const bf16_t* B = Bs[s & 1];
#pragma unroll
            for (int kk = 0; kk < MG_BK / 16; kk++) {
                unsigned a[4];
                ldmatrix_x4(a, A + a_lane + kk * 16);
#pragma unroll
                for (int nt = 0; nt < 8; nt += 2) {
                    unsigned b[4];
                    ldmatrix_x4(b, B + b_lane + nt * 8 * MG_LD + kk * 16);
                    mma_bf16(acc[nt], a[0], a[1], a[2], a[3], b[0], b[1]);
                    mma_bf16(acc[nt + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
                }
            }
        }
        if (s + 1 < steps) store((s + 1) & 1);
        __syncthreads();
    }

    // Accumulator (nt, i): row g (i < 2) or g + 8, column nt * 8 + 2 * tig + (i & 1).
    const int g = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int r = warp * 16 + g + 8 * h;
        if (r >= rows) continue;
        bf16_t* yr = y + (u64)(first + r) * n;
        if (gated) {
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const int col = n0 + nt * 8 + 2 * tig + q;
                    if (col >= n) continue;
                    const float gv = bf2f(f2bf(acc[nt][2 * h + q])), uv = bf2f(f2bf(acc[nt + 4][2 * h + q]));
                    yr[col] = f2bf((mode == QG_GELU ? gelu_tanh(gv) : silu(gv)) * uv);
                }
        } else {
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const int col = n0 + nt * 8 + 2 * tig + q;
                    if (col < n) yr[col] = f2bf(acc[nt][2 * h + q]);
                }
        }
    }
}

#define MOE_GEMV_KERNEL(T, M)                                                                                \
    extern "C" __global__ void __launch_bounds__(QG_THREADS)                                                 \
        moe_gemv_m##M(const bf16_t* x, const int* src, const u8* w, u64 expert_bytes, bf16_t* y,            \
                      const int* offsets, const int* active, int n, int k, int mode, int fmt, MoeSum sum) {  \
        pdl_entry();                                                                                         \
        moe_gemv<T, M>(x, src, w, expert_bytes, y, offsets, active, n, k, mode, fmt, sum);                   \
    }

#define MOE_KERNELS(T)                                                                                       \
    MOE_GEMV_KERNEL(T, 1)                                                                                    \
    MOE_GEMV_KERNEL(T, 2)                                                                                    \
    MOE_GEMV_KERNEL(T, 4)                                                                                    \
    MOE_GEMV_KERNEL(T, 8)                                                                                    \
    extern "C" __global__ void __launch_bounds__(MG_THREADS)                                                 \
        moe_gemm(const bf16_t* x, const int* src, const u8* w, u64 expert_bytes, bf16_t* y, const int* offsets, \
                 const int* tiles, int E, int n, int k, int mode, int fmt) {                                 \
        pdl_entry();                                                                                         \
        moe_gemm_impl<T>(x, src, w, expert_bytes, y, offsets, tiles, E, n, k, mode, fmt);                    \
    }
