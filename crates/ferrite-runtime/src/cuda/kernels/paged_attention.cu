// Paged decode attention: one query token per row, the query heads of a KV head together
// (GQA: each key and value is read once for up to GC heads), flash-decoding split-K with the
// merge in the same launch.
//
// Grid (n_kv_heads * chunks, rows, max_splits), DEC_THREADS threads; chunk c of KV head g
// takes query heads g * group + [c * GC, c * GC + GC) (chunks = ceil(group / GC)). Row r's
// query sits at position context_lens[r] - 1 and sees keys [lo, ctx) (lo = ctx - window for
// sliding layers), cut into partitions of `partition` keys; CTA `split` takes one. Each warp
// walks its share of the partition DEC_UNROLL(GC) keys per lane group at a time: TG lanes read
// one key and its value with 16-byte loads, KW of them a lane (TG = HD/8 up to 256-wide heads,
// a whole warp with two loads a lane for 512; the K and V loads of a round are all
// in flight together), dot the key against every query head (kept in shared memory as f32),
// and fold the value into a running output with an online softmax, so a partition costs one
// dependent round trip per round and nothing is staged through shared memory but the
// partition's block ids. The warps' (max, sum, output) meet in shared memory.
// With one partition the CTA writes the row's output (bf16). Otherwise it writes its
// normalized f32 output and (max, sum) to the workspace, and the last CTA of the (row, head
// chunk) to finish — counted on an atomic counter it then resets — merges the partitions.
// With `inv_freq` non-null the queries are unrotated: each CTA rotates its query heads (RoPE,
// `half` pairs, as rope.cu), and the CTA(s) holding a row's last partition rotate the step's
// new key (at `k_offset` in the query row, its value head n_kv_heads heads on) and store key
// and value into the cache before reading it — every head chunk's last CTA stores the same
// bits — so a decode step needs no RoPE launch. With `q_norm` / `k_norm` non-null too, the
// query heads and the new key are first RMSNormed per head with those weights (qkv_norm's
// bits; Qwen3's q/k norms), so the step needs no norm launch either.
// Cache layout: [block][kv_head][slot][head_dim] in the format KV_FMT (kv_format.cuh, one
// module per format: bf16, or int8 / int4 / fp8 codes dequantized as they are loaded, with
// their parameters in k_params / v_params; a quantized cache stores the new key and value
// through the quantizer, an fp8 one with the layer's `fp8_scales`); block tables are int32
// [rows][bt_stride]; a negative entry (a released block) reads as zeros.

#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * 32)
// Keys each lane group loads per round: fewer when more heads share the registers. (The same
// for every format: a quantized cache's loads are half or a quarter of bf16's bytes, but
// twice the keys a round spills registers under these launch bounds.)
#define DEC_UNROLL(GC) ((GC) <= 4 ? 4 : 2)

// RMSNorm of one head of HD f32 values (bf16 values) in place by one warp, times w, each
// result rounded to bf16: gemma.cu's qkv_norm, bit for bit — its block of T threads (HD rounded
// up to a warp, at most 256) summing squares in thread order, each warp's butterfly, then the
// warps' sums — replayed warp by warp.
template <int HD>
__device__ __forceinline__ void head_rms_norm(float* h, const float* __restrict__ w, float eps) {
    constexpr int T = HD < 32 ? 32 : HD > 256 ? 256 : HD;
    const int lane = threadIdx.x & 31;
    float mine = 0.f;  // lane l < T / 32: warp l's sum
#pragma unroll
    for (int wp = 0; wp < T / 32; wp++) {
        float ss = 0.f;
        for (int i = wp * 32 + lane; i < HD; i += T) ss += h[i] * h[i];
        ss = warp_sum(ss);
        if (lane == wp) mine = ss;
    }
    const float inv = rsqrtf(warp_sum(lane < T / 32 ? mine : 0.f) / (float)HD + eps);
    for (int i = lane; i < HD; i += 32) h[i] = bf2f(f2bf(h[i] * inv * w[i]));
    __syncwarp();
}

template <int HD, int GC, int F>
__device__ __forceinline__ void paged_decode(bf16_t* __restrict__ out, int out_stride, float* __restrict__ part_out,
                                             float* __restrict__ part_ml, int* __restrict__ counters,
                                             const bf16_t* __restrict__ q, int q_stride, void* k_cache,
                                             void* v_cache, void* k_params, void* v_params, int shift,
                                             const float* __restrict__ fp8_scales,
                                             const int* __restrict__ block_tables, int bt_stride,
                                             const int* __restrict__ context_lens, int n_heads, int n_kv_heads,
                                             int block_size, float scale, float softcap, int window, int partition,
                                             int max_splits, const float* __restrict__ inv_freq, int half,
                                             float rope_scaling, int k_offset, const float* __restrict__ q_norm,
                                             const float* __restrict__ k_norm, float norm_eps) {
    constexpr int KW = HD > 256 ? HD / 256 : 1;  // 16-byte words a lane loads per key
    constexpr int E = 8 * KW;                    // dims a lane owns
    constexpr int TG = HD / E;                   // lanes per key
    constexpr int KPW = 32 / TG;                 // keys a warp loads at once
    constexpr int U = DEC_UNROLL(GC);
    // Dynamic shared memory only: the launch opts into the device's whole per-block budget.
    extern __shared__ float smem[];
    const int group = n_heads / n_kv_heads;
    const int chunks = (group + GC - 1) / GC;
    const int g = blockIdx.x / chunks, c = blockIdx.x - g * chunks;
    const int row = blockIdx.y, split = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head0 = g * group + c * GC;
    const int gh = min(GC, group - c * GC);
    const int ctx = context_lens[row];
    const int lo = window > 0 ? max(0, ctx - window) : 0;
    const int n_vis = ctx - lo;
    const int n_split = (n_vis + partition - 1) / partition;
    bf16_t* orow = out + (u64)row * out_stride + head0 * HD;
    if (n_vis <= 0) {  // a padding row: zeros, from split 0
        if (split == 0)
            for (int i = threadIdx.x; i < gh * HD; i += blockDim.x) orow[i] = 0;
        return;
    }
    if (split >= n_split) return;
    const int k0 = lo + split * partition;
    const int n = min(partition, ctx - k0);
    const int first_block = k0 / block_size;
    const int n_blocks = (k0 + n - 1) / block_size - first_block + 1;
    float* q_s = smem;                        // [GC][HD]
    float* w_o = q_s + GC * HD;               // [DEC_WARPS][GC][HD]
    float* w_ml = w_o + DEC_WARPS * GC * HD;  // [DEC_WARPS][GC][2]
    int* s_last = (int*)(w_ml + DEC_WARPS * GC * 2);  // this CTA merges the partitions
    int* blocks = s_last + 1;
    const bf16_t* qrow = q + (u64)row * q_stride + head0 * HD;
    const float pos = (float)(ctx - 1);
    // The query heads as f32 (bf16 values), normed (q_norm) and rotated (inv_freq) in place.
    for (int i = threadIdx.x; i < GC * HD; i += blockDim.x) q_s[i] = i / HD < gh ? bf2f(qrow[i]) : 0.f;
    if (q_norm != nullptr) {
        __syncthreads();
        for (int a = warp; a < gh; a += DEC_WARPS) head_rms_norm<HD>(q_s + a * HD, q_norm, norm_eps);
    }
    if (inv_freq != nullptr) {
        __syncthreads();
        for (int i = threadIdx.x; i < gh * half; i += blockDim.x) {
            const int a = i / half, j = i - a * half;
            float* h = q_s + a * HD;
            bf16_t ra, rb;
            rope_pair(h[j], h[j + half], pos, inv_freq[j], rope_scaling, &ra, &rb);
            h[j] = bf2f(ra);
            h[j + half] = bf2f(rb);
        }
    }
    const int* table = block_tables + (u64)row * bt_stride;
    for (int i = threadIdx.x; i < n_blocks; i += blockDim.x) blocks[i] = table[first_block + i];
    __syncthreads();
    if (inv_freq != nullptr && split == n_split - 1) {
        // The new key (rotated) and value into the cache, before this CTA reads them.
        const int block = blocks[(ctx - 1) / block_size - first_block];
        const u64 bh = (u64)block * n_kv_heads + g;
        const u64 at = (bh * block_size + (ctx - 1) % block_size) * HD;
        const bf16_t* krow = q + (u64)row * q_stride + k_offset + g * HD;
        const bf16_t* vrow = krow + n_kv_heads * HD;
        // The key as f32 (normed by k_norm) in the warps' output space, free until the merge.
        float* k_s = w_o;
        for (int d = threadIdx.x; d < HD; d += blockDim.x) k_s[d] = bf2f(krow[d]);
        if (k_norm != nullptr) {
            __syncthreads();
            if (warp == 0) head_rms_norm<HD>(k_s, k_norm, norm_eps);
        }
        __syncthreads();
        // Key dim d, rotated.
        auto key = [&](int d) {
            bf16_t kv = f2bf(k_s[d]);
            if (d < 2 * half) {
                const int j = d < half ? d : d - half;
                bf16_t ra, rb;
                rope_pair(k_s[j], k_s[j + half], pos, inv_freq[j], rope_scaling, &ra, &rb);
                kv = d < half ? ra : rb;
            }
            return kv;
        };
        if constexpr (F == KV_BF16) {
            if (block >= 0) {
                for (int d = threadIdx.x; d < HD; d += blockDim.x) {
                    ((bf16_t*)k_cache)[at + d] = key(d);
                    ((bf16_t*)v_cache)[at + d] = vrow[d];
                }
            }
        } else if (block >= 0) {
            // Thread i quantizes chunk i of 8 values: the key's HD / 8 chunks, then the value's
            // (2 · HD / 8 <= DEC_THREADS); the lanes of a group are consecutive.
            constexpr int CPR = HD / 8;
            const bool active = threadIdx.x < 2 * CPR;
            const int sel = active && threadIdx.x >= CPR ? 1 : 0;
            const int ch = active ? threadIdx.x - sel * CPR : 0;
            float x[8];
#pragma unroll
            for (int e = 0; e < 8; e++) x[e] = bf2f(sel ? vrow[ch * 8 + e] : key(ch * 8 + e));
            const float scale = F == KV_F8 ? fp8_scales[sel * n_kv_heads + g] : 0.f;
            kv_store8<F>(sel ? v_cache : k_cache, sel ? v_params : k_params, at + ch * 8, shift, x, active, scale,
                         ch == 0, bh);
        }
        __syncthreads();
    }

    const int kslot = lane / TG, part = lane % TG;
    float m[GC], l[GC], acc[GC][E];
#pragma unroll
    for (int a = 0; a < GC; a++) {
        m[a] = -FERRITE_INF;
        l[a] = 0.f;
#pragma unroll
        for (int i = 0; i < E; i++) acc[a][i] = 0.f;
    }
    // The loop bound is uniform per warp, so every lane reaches the shuffles; key jb of a
    // round is always visible, so each round's maximum is finite.
    for (int jb = warp * KPW * U; jb < n; jb += DEC_WARPS * KPW * U) {
        typename KvRaw<F>::T kr[U][KW], vr[U][KW];
        unsigned kp[U][KW], vp[U][KW];  // dequantization parameters (none for bf16)
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int j = jb + u * KPW + kslot;
            long long at = -1, bh = 0;
            if (j < n) {
                const int pos = k0 + j;
                const int block = blocks[pos / block_size - first_block];
                bh = (long long)block * n_kv_heads + g;
                if (block >= 0) at = (bh * block_size + pos % block_size) * HD + part * E;
            }
#pragma unroll
            for (int w = 0; w < KW; w++) {
                kr[u][w] = at >= 0 ? kv_load8<F>(k_cache, at + 8 * w) : kv_zero8<F>();
                vr[u][w] = at >= 0 ? kv_load8<F>(v_cache, at + 8 * w) : kv_zero8<F>();
                kp[u][w] = at >= 0 ? kv_param<F>(k_params, at + 8 * w, shift, bh) : 0u;
                vp[u][w] = at >= 0 ? kv_param<F>(v_params, at + 8 * w, shift, bh) : 0u;
            }
        }
        float s[U][GC];
#pragma unroll
        for (int u = 0; u < U; u++) {
            float kf[E];
#pragma unroll
            for (int w = 0; w < KW; w++) kv_unpack8<F>(kr[u][w], kp[u][w], kf + 8 * w);
            const bool valid = jb + u * KPW + kslot < n;
#pragma unroll
            for (int a = 0; a < GC; a++) {
                const float* qh = q_s + a * HD + part * E;
                float d = 0.f;
#pragma unroll
                for (int i = 0; i < E; i++) d += kf[i] * qh[i];
#pragma unroll
                for (int o = TG / 2; o > 0; o >>= 1) d += __shfl_xor_sync(FULL_MASK, d, o);
                d *= scale;
                if (softcap > 0.f) d = softcap * tanhf(d / softcap);
                s[u][a] = valid ? d : -FERRITE_INF;
            }
        }
#pragma unroll
        for (int a = 0; a < GC; a++) {
            float mx = s[0][a];
#pragma unroll
            for (int u = 1; u < U; u++) mx = fmaxf(mx, s[u][a]);
#pragma unroll
            for (int o = TG; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, o));
            const float mn = fmaxf(m[a], mx);
            const float keep = __expf(m[a] - mn);  // 0 on the first round (m = -inf)
            m[a] = mn;
            l[a] *= keep;
#pragma unroll
            for (int i = 0; i < E; i++) acc[a][i] *= keep;
#pragma unroll
            for (int u = 0; u < U; u++) {
                float vf[E];
#pragma unroll
                for (int w = 0; w < KW; w++) kv_unpack8<F>(vr[u][w], vp[u][w], vf + 8 * w);
                const float p = __expf(s[u][a] - mn);
                l[a] += p;
#pragma unroll
                for (int i = 0; i < E; i++) acc[a][i] += p * vf[i];
            }
        }
    }
    // Sum over the warp's key slots; lanes 0..TG-1 then hold dims part*E.. of every head.
#pragma unroll
    for (int a = 0; a < GC; a++) {
#pragma unroll
        for (int o = TG; o < 32; o <<= 1) {
            l[a] += __shfl_xor_sync(FULL_MASK, l[a], o);
#pragma unroll
            for (int i = 0; i < E; i++) acc[a][i] += __shfl_xor_sync(FULL_MASK, acc[a][i], o);
        }
        if (lane < TG) {
#pragma unroll
            for (int i = 0; i < E; i++) w_o[(warp * GC + a) * HD + part * E + i] = acc[a][i];
        }
        if (lane == 0) {
            w_ml[2 * (warp * GC + a)] = m[a];
            w_ml[2 * (warp * GC + a) + 1] = l[a];
        }
    }
    __syncthreads();
    // Merge the warps (a warp that saw no key has m = -inf and weighs nothing).
    for (int idx = threadIdx.x; idx < gh * HD; idx += blockDim.x) {
        const int a = idx / HD, d = idx - a * HD;
        float mx = -FERRITE_INF;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) mx = fmaxf(mx, w_ml[2 * (w * GC + a)]);
        float total = 0.f, o = 0.f;
#pragma unroll
        for (int w = 0; w < DEC_WARPS; w++) {
            const float mw = w_ml[2 * (w * GC + a)];
            const float x = mw == -FERRITE_INF ? 0.f : __expf(mw - mx);
            total += x * w_ml[2 * (w * GC + a) + 1];
            o += x * w_o[(w * GC + a) * HD + d];
        }
        o /= total;
        if (n_split == 1) {
            orow[idx] = f2bf(o);
        } else {
            const u64 at = ((u64)row * n_heads + head0 + a) * max_splits + split;
            part_out[at * HD + d] = o;
            if (d == 0) {
                part_ml[2 * at] = mx;
                part_ml[2 * at + 1] = total;
            }
        }
    }
    if (n_split == 1) return;
    // The last partition to finish merges them all, in two rounds of independent loads: the
    // partitions' (max, sum) into shared memory, each partition's weight l·exp(m − M) there,
    // then every output dim sums its weighted partial outputs.
    __threadfence();
    __syncthreads();
    int* counter = counters + (u64)row * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) *s_last = atomicAdd(counter, 1) == n_split - 1;
    __syncthreads();
    if (!*s_last) return;
    __threadfence();
    float* wt = (float*)(blocks + partition / block_size + 2);  // [2][GC][max_splits]: m, then l
    float* inv_total = wt + 2 * GC * max_splits;                // [GC]
    for (int idx = threadIdx.x; idx < gh * n_split; idx += blockDim.x) {
        const int a = idx / n_split, sp = idx - a * n_split;
        const u64 at = ((u64)row * n_heads + head0 + a) * max_splits + sp;
        wt[a * max_splits + sp] = __ldcg(part_ml + 2 * at);
        wt[(a + GC) * max_splits + sp] = __ldcg(part_ml + 2 * at + 1);
    }
    __syncthreads();
    if (threadIdx.x < gh) {
        const int a = threadIdx.x;
        float* m = wt + a * max_splits;
        const float* l = wt + (a + GC) * max_splits;
        float mx = -FERRITE_INF, total = 0.f;
        for (int sp = 0; sp < n_split; sp++) mx = fmaxf(mx, m[sp]);
        for (int sp = 0; sp < n_split; sp++) {
            m[sp] = l[sp] * __expf(m[sp] - mx);
            total += m[sp];
        }
        inv_total[a] = 1.f / total;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < gh * HD; idx += blockDim.x) {
        const int a = idx / HD, d = idx - a * HD;
        const u64 base = ((u64)row * n_heads + head0 + a) * max_splits;
        const float* w = wt + a * max_splits;
        float o = 0.f;
#pragma unroll 8
        for (int sp = 0; sp < n_split; sp++) o += w[sp] * __ldcg(part_out + (base + sp) * HD + d);
        orow[idx] = f2bf(o * inv_total[a]);
    }
    if (threadIdx.x == 0) *counter = 0;
}

// Eight heads a CTA hold more accumulators: three CTAs an SM instead of four, so they don't
// spill; 512-wide heads (twice the accumulators a lane) two.
#define DECODE(HD, GC)                                                                                              \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS, (HD) > 256 ? 2 : (GC) <= 4 ? 4 : 3)                 \
        paged_decode_g##GC##_hd##HD(                                                                               \
        bf16_t* out, int out_stride, float* part_out, float* part_ml, int* counters, const bf16_t* q,              \
        int q_stride, void* k_cache, void* v_cache, void* k_params, void* v_params, int shift,                     \
        const float* fp8_scales, const int* block_tables, int bt_stride, const int* context_lens, int n_heads,      \
        int n_kv_heads, int block_size, float scale, float softcap, int window, int partition, int max_splits,     \
        const float* inv_freq, int half, float rope_scaling, int k_offset, const float* q_norm,                     \
        const float* k_norm, float norm_eps) {                                                                      \
        pdl_entry();                                                                                                \
        paged_decode<HD, GC, KV_FMT>(out, out_stride, part_out, part_ml, counters, q, q_stride, k_cache, v_cache,          \
                             k_params, v_params, shift, fp8_scales, block_tables, bt_stride, context_lens,         \
                             n_heads, n_kv_heads, block_size, scale, softcap, window, partition, max_splits,       \
                             inv_freq, half, rope_scaling, k_offset, q_norm, k_norm, norm_eps);                    \
    }

DECODE(16, 4)
DECODE(32, 4)
DECODE(64, 4)
DECODE(128, 4)
DECODE(256, 4)
DECODE(512, 4)
DECODE(16, 8)
DECODE(32, 8)
DECODE(64, 8)
DECODE(128, 8)
DECODE(256, 8)
DECODE(512, 8)
