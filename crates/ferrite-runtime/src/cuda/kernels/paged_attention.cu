// Paged decode attention: one query token per row, all query heads of a KV head together
// (GQA: each key and value is read once for the whole group), flash-decoding split-K.
//
// Grid (n_kv_heads, rows, max_splits), DEC_THREADS threads. Row r's query sits at position
// context_lens[r] - 1 and sees keys [lo, ctx) (lo = ctx - window for sliding layers). The
// visible keys are cut into partitions of `partition` keys; CTA `split` takes one:
//   1. scores: TG lanes read one key with 16-byte loads (TG = HD/8, at most a warp: a
//      512-wide key takes two loads a lane), dot it against every query head of the group
//      (kept in shared memory as f32) and reduce over the TG lanes;
//   2. softmax per head over the partition (one warp per head), scores become probabilities;
//   3. values: warps take runs of keys, each lane owns HD/32 output dims (one dim on the first
//      HD lanes when HD < 32); the warps' sums meet in shared memory.
// Both passes over the cache keep DEC_UNROLL loads per lane in flight (decode is bound by
// memory latency, not arithmetic), and the partition's block ids are staged in shared memory
// so a key's address costs no dependent global load.
// With one partition the row's output is written directly (bf16); otherwise each partition
// writes its normalized f32 output and (max, sum) to the workspace and `paged_decode_reduce`
// merges them. Cache layout: [block][kv_head][slot][head_dim] bf16; block tables are int32
// [rows][bt_stride]; a negative entry (a released block) reads as zeros.

#define DEC_WARPS 4
#define DEC_THREADS (DEC_WARPS * 32)
// Query heads per register chunk in the value phase (fewer for the widest heads, whose
// accumulators take HD/32 registers each).
#define GCH(HD) ((HD) > 256 ? 4 : 8)
#define DEC_UNROLL 4  // keys whose loads each lane (group) issues before using them
// Keys each warp loads at once in the value phase: more for narrow heads (fewer registers a
// key), so a short partition takes fewer dependent round trips.
#define V_UNROLL(HD) ((HD) <= 128 ? 8 : (HD) <= 256 ? 4 : 2)

template <int N>
__device__ __forceinline__ void load_bf16(const bf16_t* p, float* f);
template <>
__device__ __forceinline__ void load_bf16<1>(const bf16_t* p, float* f) {
    f[0] = bf2f(*p);
}
template <>
__device__ __forceinline__ void load_bf16<2>(const bf16_t* p, float* f) {
    unsigned w = *(const unsigned*)p;
    f[0] = __uint_as_float(w << 16);
    f[1] = __uint_as_float(w & 0xffff0000u);
}
template <>
__device__ __forceinline__ void load_bf16<4>(const bf16_t* p, float* f) {
    uint2 w = *(const uint2*)p;
    f[0] = __uint_as_float(w.x << 16);
    f[1] = __uint_as_float(w.x & 0xffff0000u);
    f[2] = __uint_as_float(w.y << 16);
    f[3] = __uint_as_float(w.y & 0xffff0000u);
}
template <>
__device__ __forceinline__ void load_bf16<8>(const bf16_t* p, float* f) {
    unpack8(*(const uint4*)p, f);
}
template <>
__device__ __forceinline__ void load_bf16<16>(const bf16_t* p, float* f) {
    unpack8(*(const uint4*)p, f);
    unpack8(*(const uint4*)(p + 8), f + 8);
}

template <int HD>
__device__ __forceinline__ void paged_decode(bf16_t* __restrict__ out, int out_stride, float* __restrict__ part_out,
                                             float* __restrict__ part_ml, const bf16_t* __restrict__ q, int q_stride,
                                             const bf16_t* __restrict__ k_cache, const bf16_t* __restrict__ v_cache,
                                             const int* __restrict__ block_tables, int bt_stride,
                                             const int* __restrict__ context_lens, int n_heads, int n_kv_heads,
                                             int block_size, float scale, float softcap, int window, int partition,
                                             int max_splits) {
    // Key words (8 values) a lane reads per key, lanes per key, keys per warp, output dims
    // per lane (lanes past HD own none when HD < 32).
    constexpr int KW = HD > 256 ? HD / 256 : 1;
    constexpr int TG = HD / (8 * KW);
    constexpr int KPW = 32 / TG;
    constexpr int DPL = HD >= 32 ? HD / 32 : 1;
    constexpr int GC = GCH(HD);
    extern __shared__ float smem[];
    const int group = n_heads / n_kv_heads;
    const int gch = min(group, GC);
    const int g = blockIdx.x, row = blockIdx.y, split = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head0 = g * group;
    const int ctx = context_lens[row];
    const int lo = window > 0 ? max(0, ctx - window) : 0;
    const int n_vis = ctx - lo;
    const int n_split = (n_vis + partition - 1) / partition;
    if (n_vis <= 0) {  // a padding row: zeros, from split 0
        if (split == 0)
            for (int i = threadIdx.x; i < group * HD; i += blockDim.x) out[(u64)row * out_stride + head0 * HD + i] = 0;
        return;
    }
    if (split >= n_split) return;
    const int k0 = lo + split * partition;
    const int n = min(partition, ctx - k0);
    const int first_block = k0 / block_size;
    const int n_blocks = (k0 + n - 1) / block_size - first_block + 1;
    float* q_s = smem;                       // [group][HD]
    float* sc = q_s + group * HD;            // [group][partition]
    float* red = sc + group * partition;     // [DEC_WARPS][gch][HD]
    float* ml = red + DEC_WARPS * gch * HD;  // [group][2]
    int* blocks = (int*)(ml + 2 * group);    // the partition's block ids
    const bf16_t* qrow = q + (u64)row * q_stride + head0 * HD;
    for (int i = threadIdx.x; i < group * HD; i += blockDim.x) q_s[i] = bf2f(qrow[i]);
    const int* table = block_tables + (u64)row * bt_stride;
    for (int i = threadIdx.x; i < n_blocks; i += blockDim.x) blocks[i] = table[first_block + i];
    __syncthreads();
    // Cache offset of the partition's j-th key for KV head g, or -1 in a released block.
    auto key_at = [&](int j) -> long long {
        int pos = k0 + j;
        int block = blocks[pos / block_size - first_block];
        if (block < 0) return -1;
        return (((long long)block * n_kv_heads + g) * block_size + pos % block_size) * HD;
    };

    // 1. Scores, DEC_UNROLL keys per lane group in flight. The loop bound is uniform per warp,
    //    so every lane reaches the shuffles.
    const int kslot = lane / TG, part = lane % TG;
    for (int jb = warp * KPW * DEC_UNROLL; jb < n; jb += DEC_WARPS * KPW * DEC_UNROLL) {
        uint4 raw[DEC_UNROLL][KW];
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; u++) {
            const int j = jb + u * KPW + kslot;
            long long at = j < n ? key_at(j) : -1;
#pragma unroll
            for (int w = 0; w < KW; w++)
                raw[u][w] = at >= 0 ? *(const uint4*)(k_cache + at + (part * KW + w) * 8) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; u++) {
            const int j = jb + u * KPW + kslot;
            float kf[8 * KW];
#pragma unroll
            for (int w = 0; w < KW; w++) unpack8(raw[u][w], kf + 8 * w);
            for (int h = 0; h < group; h++) {
                const float* qh = q_s + h * HD + part * 8 * KW;
                float d = 0.f;
#pragma unroll
                for (int i = 0; i < 8 * KW; i++) d += kf[i] * qh[i];
#pragma unroll
                for (int o = TG / 2; o > 0; o >>= 1) d += __shfl_xor_sync(FULL_MASK, d, o);
                if (part == 0 && j < n) {
                    float s = d * scale;
                    if (softcap > 0.f) s = softcap * tanhf(s / softcap);
                    sc[h * partition + j] = s;
                }
            }
        }
    }
    __syncthreads();

    // 2. Softmax over the partition, one warp per head.
    for (int h = warp; h < group; h += DEC_WARPS) {
        float* s = sc + h * partition;
        float m = -FERRITE_INF;
        for (int j = lane; j < n; j += 32) m = fmaxf(m, s[j]);
        m = warp_max(m);
        float l = 0.f;
        for (int j = lane; j < n; j += 32) {
            float p = __expf(s[j] - m);
            s[j] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            ml[2 * h] = m;
            ml[2 * h + 1] = l;
        }
    }
    __syncthreads();

    // 3. Values, GC heads at a time, V_UNROLL keys per warp in flight.
    const bool owner = lane * DPL < HD;
    for (int h0 = 0; h0 < group; h0 += GC) {
        const int gh = min(GC, group - h0);
        float acc[GC][DPL];
#pragma unroll
        for (int a = 0; a < GC; a++)
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[a][i] = 0.f;
        constexpr int VU = V_UNROLL(HD);
        for (int jb = warp * VU; jb < n; jb += DEC_WARPS * VU) {
            float vf[VU][DPL];
#pragma unroll
            for (int u = 0; u < VU; u++) {
                long long at = jb + u < n && owner ? key_at(jb + u) : -1;
                if (at >= 0) {
                    load_bf16<DPL>(v_cache + at + lane * DPL, vf[u]);
                } else {
#pragma unroll
                    for (int i = 0; i < DPL; i++) vf[u][i] = 0.f;
                }
            }
#pragma unroll
            for (int u = 0; u < VU; u++) {
                if (jb + u >= n) break;
#pragma unroll
                for (int a = 0; a < GC; a++) {
                    if (a < gh) {
                        float p = sc[(h0 + a) * partition + jb + u];
#pragma unroll
                        for (int i = 0; i < DPL; i++) acc[a][i] += p * vf[u][i];
                    }
                }
            }
        }
#pragma unroll
        for (int a = 0; a < GC; a++)
            if (a < gh && owner)
#pragma unroll
                for (int i = 0; i < DPL; i++) red[(warp * gch + a) * HD + lane * DPL + i] = acc[a][i];
        __syncthreads();
        for (int idx = threadIdx.x; idx < gh * HD; idx += blockDim.x) {
            const int a = idx / HD, d = idx - a * HD, h = h0 + a;
            float o = 0.f;
#pragma unroll
            for (int w = 0; w < DEC_WARPS; w++) o += red[(w * gch + a) * HD + d];
            o /= ml[2 * h + 1];
            if (n_split == 1)
                out[(u64)row * out_stride + (head0 + h) * HD + d] = f2bf(o);
            else
                part_out[(((u64)row * n_heads + head0 + h) * max_splits + split) * HD + d] = o;
        }
        __syncthreads();
    }
    if (n_split > 1) {
        for (int h = threadIdx.x; h < group; h += blockDim.x) {
            u64 at = ((u64)row * n_heads + head0 + h) * max_splits + split;
            part_ml[2 * at] = ml[2 * h];
            part_ml[2 * at + 1] = ml[2 * h + 1];
        }
    }
}

#define DECODE(HD)                                                                                                  \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS, 4) paged_decode_hd##HD(                               \
        bf16_t* out, int out_stride, float* part_out, float* part_ml, const bf16_t* q, int q_stride,               \
        const bf16_t* k_cache, const bf16_t* v_cache, const int* block_tables, int bt_stride,                      \
        const int* context_lens, int n_heads, int n_kv_heads, int block_size, float scale, float softcap,          \
        int window, int partition, int max_splits) {                                                                \
        paged_decode<HD>(out, out_stride, part_out, part_ml, q, q_stride, k_cache, v_cache, block_tables, bt_stride, \
                         context_lens, n_heads, n_kv_heads, block_size, scale, softcap, window, partition,          \
                         max_splits);                                                                               \
    }

DECODE(16)
DECODE(32)
DECODE(64)
DECODE(128)
DECODE(256)
DECODE(512)

// Merge the partitions of each (row, head) in one pass: an online softmax over the
// partitions' (max, sum) rescales the running output as each partition's normalized output
// is added. Grid (n_heads, rows), a thread per output dim; rows with one partition were
// finished by the main kernel.
extern "C" __global__ void paged_decode_reduce(bf16_t* __restrict__ out, int out_stride,
                                               const float* __restrict__ part_out, const float* __restrict__ part_ml,
                                               const int* __restrict__ context_lens, int n_heads, int head_dim,
                                               int window, int partition, int max_splits) {
    const int h = blockIdx.x, row = blockIdx.y;
    const int ctx = context_lens[row];
    const int lo = window > 0 ? max(0, ctx - window) : 0;
    const int n_split = (ctx - lo + partition - 1) / partition;
    if (n_split <= 1) return;
    const u64 base = ((u64)row * n_heads + h) * max_splits;
    const float* ml = part_ml + 2 * base;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float m = -FERRITE_INF, total = 0.f, o = 0.f;
#pragma unroll 4
        for (int s = 0; s < n_split; s++) {
            const float ms = ml[2 * s], ls = ml[2 * s + 1], os = part_out[(base + s) * head_dim + d];
            const float mn = fmaxf(m, ms);
            const float keep = __expf(m - mn), w = ls * __expf(ms - mn);
            total = total * keep + w;
            o = o * keep + w * os;
            m = mn;
        }
        out[(u64)row * out_stride + h * head_dim + d] = f2bf(o / total);
    }
}
