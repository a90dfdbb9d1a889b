// Variable-length causal attention over the paged KV cache (prefill chunks, verify rows, any
// row with several query tokens; decode rows work too), flash-attention style on tensor cores.
//
// Grid (n_tiles, n_heads), PF_THREADS threads. tiles[2 t] = row, tiles[2 t + 1] = the tile's
// first query index within the row; a tile is BM query tokens of one row and one query head.
// Row r's query tokens are q rows [query_start[r], query_start[r + 1]); the last one sits at
// position context_lens[r] - 1. Each warp owns 16 query rows. Per BN-key tile of the visible
// range: K and V are gathered from the cache blocks into shared memory, S = Q·Kᵀ and
// O += P·V run as mma.sync m16n8k16 (bf16 in, f32 accumulate), with the online softmax in
// registers between them (the S accumulators become P's A fragments without leaving them);
// every other fragment comes out of shared memory by ldmatrix (V's transposed). Shared rows
// are padded by 8 bf16, which makes those loads conflict-free.
// The cache is in the format KV_FMT (kv_format.cuh, one module per format): a quantized
// cache's codes are dequantized as they are gathered, 8 values a load, into the same bf16
// tiles.

#define PF_WARPS 4
#define PF_THREADS (PF_WARPS * 32)
#define BM (PF_WARPS * 16)
#define BN 64

template <int HD, int F>
__device__ __forceinline__ void prefill(bf16_t* __restrict__ out, int out_stride, const bf16_t* __restrict__ q,
                                        int q_stride, const void* __restrict__ k_cache,
                                        const void* __restrict__ v_cache, const void* __restrict__ k_params,
                                        const void* __restrict__ v_params, int shift,
                                        const int* __restrict__ block_tables,
                                        int bt_stride, const int* __restrict__ query_start,
                                        const int* __restrict__ context_lens, const int* __restrict__ tiles,
                                        int n_heads, int n_kv_heads, int block_size, float scale, float softcap,
                                        int window) {
    constexpr int LD = HD + 8;
    constexpr int NT = HD / 8;
    constexpr int CH = HD / 8;  // 16-byte chunks per row
    extern __shared__ uint4 smem_raw[];
    bf16_t* Qs = (bf16_t*)smem_raw;
    bf16_t* Ks = Qs + BM * LD;
    bf16_t* Vs = Ks + BN * LD;
    const int row = tiles[2 * blockIdx.x], t0 = tiles[2 * blockIdx.x + 1];
    const int h = blockIdx.y, g = h / (n_heads / n_kv_heads);
    const int qs0 = query_start[row], qlen = query_start[row + 1] - qs0;
    const int first = context_lens[row] - qlen;  // position of the row's first query token
    const int nq = min(BM, qlen - t0);
    const int* table = block_tables + (u64)row * bt_stride;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
    const uint4 zero = make_uint4(0, 0, 0, 0);

    for (int idx = tid; idx < BM * CH; idx += PF_THREADS) {
        int r = idx / CH, c = idx - r * CH;
        uint4 v = zero;
        if (r < nq) v = *(const uint4*)(q + (u64)(qs0 + t0 + r) * q_stride + h * HD + c * 8);
        *(uint4*)(Qs + r * LD + c * 8) = v;
    }
    const int p_first = first + t0;
    const int kv_end = p_first + nq;  // one past the tile's last query position
    const int kv_begin = window > 0 ? max(0, p_first + 1 - window) : 0;
    const int r0 = warp * 16 + gid, r1 = r0 + 8;
    const int pos0 = p_first + r0, pos1 = p_first + r1;
    const bool ok0 = r0 < nq, ok1 = r1 < nq;
    const bool active = warp * 16 < nq;
    float m0 = -FERRITE_INF, m1 = -FERRITE_INF, l0 = 0.f, l1 = 0.f;
    float o[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; nt++) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;

    for (int kb = kv_begin; kb < kv_end; kb += BN) {
        __syncthreads();  // Q is stored; the previous K and V tiles are consumed
        for (int idx = tid; idx < BN * CH; idx += PF_THREADS) {
            int j = idx / CH, c = idx - j * CH;
            int pos = kb + j;
            uint4 kv = zero, vv = zero;
            if (pos < kv_end) {
                int block = table[pos / block_size];
                if (block >= 0) {
                    const u64 bh = (u64)block * n_kv_heads + g;
                    const u64 at = (bh * block_size + pos % block_size) * HD + c * 8;
                    if constexpr (F == KV_BF16) {
                        kv = kv_load8<F>(k_cache, at);
                        vv = kv_load8<F>(v_cache, at);
                    } else {
                        const typename KvRaw<F>::T kr = kv_load8<F>(k_cache, at), vr = kv_load8<F>(v_cache, at);
                        const unsigned kp = kv_param<F>(k_params, at, shift, bh);
                        const unsigned vp = kv_param<F>(v_params, at, shift, bh);
                        float f[8];
                        kv_unpack8<F>(kr, kp, f);
                        kv = make_uint4(pack_bf2(f[0], f[1]), pack_bf2(f[2], f[3]), pack_bf2(f[4], f[5]),
                                        pack_bf2(f[6], f[7]));
                        kv_unpack8<F>(vr, vp, f);
                        vv = make_uint4(pack_bf2(f[0], f[1]), pack_bf2(f[2], f[3]), pack_bf2(f[4], f[5]),
                                        pack_bf2(f[6], f[7]));
                    }
                }
            }
            *(uint4*)(Ks + j * LD + c * 8) = kv;
            *(uint4*)(Vs + j * LD + c * 8) = vv;
        }
        __syncthreads();
        if (!active) continue;

        float s[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        // Q's A fragment: matrices (rows 0-7 | 8-15 of the warp's 16) x (dims 0-7 | 8-15).
        // K's B fragments for key tiles nt, nt + 1: matrices (dims 0-7 | 8-15) x (tile nt | nt + 1).
        const int mq = lane >> 3;
        const bf16_t* qrow = Qs + (warp * 16 + (mq & 1) * 8 + (lane & 7)) * LD + (mq >> 1) * 8;
        const bf16_t* krow = Ks + ((mq >> 1) * 8 + (lane & 7)) * LD + (mq & 1) * 8;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            unsigned a[4];
            ldmatrix_x4(a, qrow + kk * 16);
#pragma unroll
            for (int nt = 0; nt < 8; nt += 2) {
                unsigned b[4];
                ldmatrix_x4(b, krow + nt * 8 * LD + kk * 16);
                mma_bf16(s[nt], a[0], a[1], a[2], a[3], b[0], b[1]);
                mma_bf16(s[nt + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
            }
        }

        float mx0 = -FERRITE_INF, mx1 = -FERRITE_INF;
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int col = kb + nt * 8 + tig * 2 + (e & 1);
                const int pos = e < 2 ? pos0 : pos1;
                const bool ok = e < 2 ? ok0 : ok1;
                float x = s[nt][e] * scale;
                if (softcap > 0.f) x = softcap * tanhf(x / softcap);
                const bool vis = ok && col <= pos && (window <= 0 || col > pos - window);
                x = vis ? x : -FERRITE_INF;
                s[nt][e] = x;
                if (e < 2)
                    mx0 = fmaxf(mx0, x);
                else
                    mx1 = fmaxf(mx1, x);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        // A row that has seen no visible key yet keeps base 0, so exp(-inf - 0) = 0, not NaN.
        const float b0 = mn0 == -FERRITE_INF ? 0.f : mn0, b1 = mn1 == -FERRITE_INF ? 0.f : mn1;
        const float al0 = __expf(m0 - b0), al1 = __expf(m1 - b1);
        m0 = mn0;
        m1 = mn1;
        l0 *= al0;
        l1 *= al1;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) {
            o[nt][0] *= al0;
            o[nt][1] *= al0;
            o[nt][2] *= al1;
            o[nt][3] *= al1;
        }
#pragma unroll
        for (int nt = 0; nt < 8; nt++) {
            s[nt][0] = __expf(s[nt][0] - b0);
            s[nt][1] = __expf(s[nt][1] - b0);
            s[nt][2] = __expf(s[nt][2] - b1);
            s[nt][3] = __expf(s[nt][3] - b1);
            l0 += s[nt][0] + s[nt][1];
            l1 += s[nt][2] + s[nt][3];
        }

#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            const unsigned a0 = pack_bf2(s[2 * kk][0], s[2 * kk][1]);
            const unsigned a1 = pack_bf2(s[2 * kk][2], s[2 * kk][3]);
            const unsigned a2 = pack_bf2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            const unsigned a3 = pack_bf2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            // V's B fragments for n-tiles nt, nt + 1: matrices (keys 0-7 | 8-15) x (tile nt | nt + 1).
            const int m = lane >> 3;
            const bf16_t* vrow = Vs + (kk * 16 + (m & 1) * 8 + (lane & 7)) * LD + (m >> 1) * 8;
#pragma unroll
            for (int nt = 0; nt < NT; nt += 2) {
                unsigned b[4];
                ldmatrix_x4_trans(b, vrow + nt * 8);
                mma_bf16(o[nt], a0, a1, a2, a3, b[0], b[1]);
                mma_bf16(o[nt + 1], a0, a1, a2, a3, b[2], b[3]);
            }
        }
    }

    l0 += __shfl_xor_sync(FULL_MASK, l0, 1);
    l0 += __shfl_xor_sync(FULL_MASK, l0, 2);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 1);
    l1 += __shfl_xor_sync(FULL_MASK, l1, 2);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    if (ok0) {
        bf16_t* dst = out + (u64)(qs0 + t0 + r0) * out_stride + h * HD + tig * 2;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) *(unsigned*)(dst + nt * 8) = pack_bf2(o[nt][0] * inv0, o[nt][1] * inv0);
    }
    if (ok1) {
        bf16_t* dst = out + (u64)(qs0 + t0 + r1) * out_stride + h * HD + tig * 2;
#pragma unroll
        for (int nt = 0; nt < NT; nt++) *(unsigned*)(dst + nt * 8) = pack_bf2(o[nt][2] * inv1, o[nt][3] * inv1);
    }
}

#define PREFILL(HD)                                                                                                 \
    extern "C" __global__ void __launch_bounds__(PF_THREADS) prefill_attention_hd##HD(                             \
        bf16_t* out, int out_stride, const bf16_t* q, int q_stride, const void* k_cache, const void* v_cache,      \
        const void* k_params, const void* v_params, int shift, const int* block_tables, int bt_stride,             \
        const int* query_start, const int* context_lens, const int* tiles, int n_heads, int n_kv_heads,            \
        int block_size, float scale, float softcap, int window) {                                                  \
        pdl_entry();                                                                                                \
        prefill<HD, KV_FMT>(out, out_stride, q, q_stride, k_cache, v_cache, k_params, v_params, shift, block_tables,        \
                    bt_stride, query_start, context_lens, tiles, n_heads, n_kv_heads, block_size, scale, softcap,   \
                    window);                                                                                        \
    }

PREFILL(16)
PREFILL(32)
PREFILL(64)
PREFILL(128)
PREFILL(256)
PREFILL(512)
