// Sampling on the device: argmax per row, and temperature / top-k / min-p / top-p sampling with
// one caller-supplied uniform number per row, plus the chosen token's log-probability.
//
// One block of SAMPLE_THREADS per row. The engine's CPU sampler sorts the candidates; here
// every cut is a radix select over order-preserving 32-bit keys of the logits (four passes of
// 8 bits, each a 256-bin histogram over the row), which finds the same token sets without a
// sort. Probability masses are summed as 2^-40 fixed point in 64-bit integers, so sums do not
// depend on the order the atomics land in: a row's result is deterministic. Rows are read as
// 16-byte words, several per thread in flight; lanes of a warp that land in the same histogram
// bin add their weights first (match + warp reduce), so a crowded bin costs one atomic per
// warp, not one per element.
//
// A sampled row reads its logits three times (argmax; log-sum-exp with a histogram of mass and
// count by distance from the max; a gather) and runs every select over the gathered rows in
// shared memory: the fewest highest logits that hold every token the row's cuts can keep
// (all with non-zero fixed-point mass, or the top_k, or top_p of the mass). The selects see
// the same keys, masses and ties in that top set as in the whole row, so they find the same
// cuts; a row whose set does not fit (a flat distribution without top-k/top-p) runs them
// over the whole row.
//
// The steps, as the CPU sampler does them: keep the top_k highest logits (0 = all); scale by
// 1/temperature and exponentiate relative to the max (the max gets e = 1); drop e < min_p;
// keep the shortest prefix (highest first) whose mass reaches top_p of the top-k mass; draw
// with the inverse CDF of the kept mass, highest first — all in the CPU's order, logits
// descending and equal logits by id ascending (a select that ends inside a run of equal logits
// finds the last id it needs with three more passes over ids). Non-finite logits are never
// candidates; a row with a +inf logit (a certainty), a row without a finite logit, and
// temperature 0 take the argmax (first on ties, NaN never wins). The host sends the
// temperatures below MIN_TEMPERATURE (ferrite_runtime::sampling) as 0; any other whose
// inverse overflows is greedy here too, so (v - max) / t is never 0 * inf = NaN.

#define SAMPLE_THREADS 1024
#define MASS_ONE 1099511627776.0f  // 2^40

__device__ __forceinline__ bool is_finite(float x) { return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u; }

__device__ __forceinline__ unsigned order_key(float x) {
    unsigned u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Calls f(i, v, valid) for every element of x[0..n); lanes past the end get valid = false.
// The trip counts are uniform across the block, so f may use warp-collective operations.
// Each thread keeps LOADS 16-byte loads in flight: one block walks a whole row in
// n / (4 · LOADS · blockDim) dependent round trips. The argmax kernel takes 8 (2 round trips
// for a 128k vocabulary); the sampling passes, whose bodies hold more registers, 2. A row
// that does not start on a 16-byte boundary (a vocabulary not a multiple of 4, in a batch)
// loads its quads as four words: every thread then sees the same elements in the same order
// wherever the row lies, so float sums over it do not depend on the batch.
template <int LOADS = 2, class F>
__device__ __forceinline__ void for_each(const float* __restrict__ x, int n, F f) {
    const int n4 = n / 4;
    const bool aligned = ((size_t)x & 15) == 0;
    const float4* x4 = (const float4*)x;
    const float4 none = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int base = 0; base < n4; base += LOADS * blockDim.x) {
        float4 a[LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; u++) {
            const int i = base + u * blockDim.x + threadIdx.x;
            a[u] = i >= n4 ? none : aligned ? x4[i] : make_float4(x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]);
        }
#pragma unroll
        for (int u = 0; u < LOADS; u++) {
            const int i = base + u * blockDim.x + threadIdx.x;
            f(4 * i, a[u].x, i < n4);
            f(4 * i + 1, a[u].y, i < n4);
            f(4 * i + 2, a[u].z, i < n4);
            f(4 * i + 3, a[u].w, i < n4);
        }
    }
    for (int base = 4 * n4; base < n; base += blockDim.x) {
        const int k = base + threadIdx.x;
        f(k, k < n ? x[k] : 0.f, k < n);
    }
}

// hist[bin] += w (bin < 0: nothing), the whole warp at once: lanes sharing a bin sum their
// weights (w < 2^40, summed as 20-bit halves so 32 of them fit 32 bits) and one adds.
__device__ __forceinline__ void hist_add(unsigned long long* hist, int bin, unsigned long long w) {
    const unsigned peers = __match_any_sync(FULL_MASK, bin);
    const unsigned hi = __reduce_add_sync(peers, (unsigned)(w >> 20));
    const unsigned lo = __reduce_add_sync(peers, (unsigned)(w & 0xfffffu));
    if (bin >= 0 && (int)(threadIdx.x & 31) == __ffs(peers) - 1)
        atomicAdd(&hist[bin], ((unsigned long long)hi << 20) + lo);
}

// (value, index) of the row's argmax: the first index on ties; NaN never wins (index
// 0x7fffffff when every element is NaN).
template <int LOADS>
__device__ void row_argmax(const float* x, int n, float* s_v, int* s_i, float* best_v, int* best_i) {
    float bv = -FERRITE_INF;
    int bi = 0x7fffffff;
    for_each<LOADS>(x, n, [&](int i, float v, bool valid) {
        if (valid && (v > bv || (v == bv && i < bi))) {
            bv = v;
            bi = i;
        }
    });
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(FULL_MASK, bv, o);
        int oi = __shfl_xor_sync(FULL_MASK, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) {
        s_v[warp] = bv;
        s_i[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) {
            if (s_v[w] > bv || (s_v[w] == bv && s_i[w] < bi)) {
                bv = s_v[w];
                bi = s_i[w];
            }
        }
        s_v[0] = bv;
        s_i[0] = bi;
    }
    __syncthreads();
    *best_v = s_v[0];
    *best_i = s_i[0];  // 0x7fffffff when every element is NaN
}

// Grid (rows, parts): part p of a row takes a contiguous slice (a multiple of 4 values, so
// its 16-byte loads stay aligned), folds its best (value, index) into the row's 64-bit key
// with one atomicMax — order_key(value) above ~index, so a larger value wins and equal values
// go to the first index — and the last part to finish (a counter it then resets) turns the
// key into the index and clears it for the next call. A 128k-vocabulary row is read by
// several blocks at once instead of one (the B=1 decode step's last kernel).
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    argmax_rows(const float* __restrict__ logits, int vocab, int stride, unsigned long long* keys,
                unsigned* counters, unsigned* __restrict__ out) {
    pdl_entry();
    __shared__ float s_v[32];
    __shared__ int s_i[32];
    __shared__ bool s_last;
    const int per = ((vocab + gridDim.y - 1) / gridDim.y + 3) & ~3;
    const int lo = min(vocab, (int)blockIdx.y * per);
    const int n = min(per, vocab - lo);
    float v;
    int i;
    row_argmax<8>(logits + (u64)blockIdx.x * stride + lo, n, s_v, s_i, &v, &i);
    if (threadIdx.x == 0) {
        // -0 as +0, so a tie between them goes to the first index as in the comparisons.
        if (i != 0x7fffffff)
            atomicMax(keys + blockIdx.x, ((unsigned long long)order_key(v + 0.f) << 32) | (unsigned)~(lo + i));
        __threadfence();
        s_last = atomicAdd(counters + blockIdx.x, 1u) == gridDim.y - 1;
    }
    __syncthreads();
    if (s_last && threadIdx.x == 0) {
        const unsigned long long key = atomicExch(keys + blockIdx.x, 0ull);
        // Every element NaN: index 0, as the CPU's argmax.
        out[blockIdx.x] = key == 0 ? 0u : ~(unsigned)key;
        counters[blockIdx.x] = 0;
    }
}

// A row as the select passes see it: every element of x[0..n) with its index as id, or a
// gathered subset (values and ids) in shared memory. `visit` calls f(id, v, valid) with a
// trip count uniform across the block, lanes past the end with valid = false.
struct Dense {
    const float* x;
    int n;
    template <class F>
    __device__ __forceinline__ void visit(F f) const {
        for_each(x, n, f);
    }
};

struct Gathered {
    const float* v;
    const int* id;
    int n;
    template <class F>
    __device__ __forceinline__ void visit(F f) const {
        for (int base = 0; base < n; base += blockDim.x) {
            const int i = base + threadIdx.x;
            const bool ok = i < n;
            f(ok ? id[i] : 0, ok ? v[i] : 0.f, ok);
        }
    }
};

struct Select {
    unsigned long long hist[256];
    unsigned prefix;
    int bin;
    unsigned long long above;
    unsigned long long group;
    unsigned long long total;
};

// A cut of the candidates in the CPU sampler's order (logit descending, ties by id ascending):
// (key, id) is kept when key > cut.key, or key == cut.key and id <= cut.id.
struct Cut {
    unsigned key;
    int id;
};

#define NO_ID 0x7fffffff

__device__ __forceinline__ bool kept(unsigned key, int id, Cut c) { return key > c.key || (key == c.key && id <= c.id); }

__device__ __forceinline__ float key_value(unsigned key) {
    return __uint_as_float((key & 0x80000000u) ? (key ^ 0x80000000u) : ~key);
}

__device__ __forceinline__ unsigned long long mass_of(float v, float mr, float inv_t) {
    return (unsigned long long)(expf((v - mr) * inv_t) * MASS_ONE);
}

// Candidate filter shared by every pass: finite, inside `cut`, e >= min_e.
__device__ __forceinline__ bool candidate(float v, int id, float mr, float inv_t, Cut cut, float min_e, unsigned* key,
                                          float* e) {
    if (!is_finite(v)) return false;
    *key = order_key(v);
    if (!kept(*key, id, cut)) return false;
    *e = expf((v - mr) * inv_t);
    return *e >= min_e;
}

// Inclusive prefix sum over the lanes of a warp.
__device__ __forceinline__ unsigned long long warp_scan(unsigned long long v) {
    const int lane = threadIdx.x & 31;
    for (int o = 1; o < 32; o <<= 1) {
        const unsigned long long t = __shfl_up_sync(FULL_MASK, v, o);
        if (lane >= o) v += t;
    }
    return v;
}

// Pick bin of a radix pass (warp 0): the highest bin (`descending`) or the lowest whose
// weight, added to `before`, reaches `target`. Lane l takes scan positions 8l..8l+7 (bin
// 255 - i descending, i ascending); a scan of the lanes' sums finds the lane the target falls
// in, and that lane walks its eight bins.
__device__ __forceinline__ void pick_bin(Select* s, unsigned prefix, int shift, unsigned long long before,
                                         unsigned long long target, bool descending) {
    const int lane = threadIdx.x & 31;
    unsigned long long w[8], sum = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int i = 8 * lane + j;
        w[j] = s->hist[descending ? 255 - i : i];
        sum += w[j];
    }
    const unsigned long long incl = warp_scan(sum);
    const unsigned crossing = __ballot_sync(FULL_MASK, before + incl >= target);
    if (crossing == 0) {
        if (lane == 0) s->bin = -1;
        return;
    }
    if (lane != __ffs(crossing) - 1) return;
    unsigned long long cum = before + incl - sum;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        if (cum + w[j] >= target) {
            const int b = descending ? 255 - (8 * lane + j) : 8 * lane + j;
            s->bin = b;
            s->prefix = prefix | ((unsigned)b << shift);
            s->above = cum;
            s->group = w[j];
            return;
        }
        cum += w[j];
    }
}

// The shortest prefix, in the CPU's order, of the candidates (inside `cut`, e >= min_e) whose
// weight — count, or fixed-point mass — reaches `target` (>= 1): the cut at its last member.
// `cut` itself when all candidates weigh less. Four radix passes find the last member's key;
// when that key is shared (tied logits) and only some of the tied tokens are needed, or
// `exact_id` asks for the last member's id, three more passes over the ids of the tied tokens
// find the last one needed.
template <class Row>
__device__ Cut select_cut(const Row& row, float mr, float inv_t, Cut cut, float min_e, bool by_mass,
                          unsigned long long target, bool exact_id, Select* s) {
    unsigned prefix = 0;
    unsigned long long above = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x) s->hist[b] = 0;
        __syncthreads();
        const unsigned hi_mask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
        row.visit([&](int i, float v, bool valid) {
            unsigned key;
            float e;
            int bin = -1;
            unsigned long long w = 0;
            if (valid && candidate(v, i, mr, inv_t, cut, min_e, &key, &e) && (key & hi_mask) == (prefix & hi_mask)) {
                bin = (key >> shift) & 255u;
                w = by_mass ? (unsigned long long)(e * MASS_ONE) : 1ull;
            }
            hist_add(s->hist, bin, w);
        });
        __syncthreads();
        if (threadIdx.x < 32) pick_bin(s, prefix, shift, above, target, true);
        __syncthreads();
        if (s->bin < 0) return cut;
        prefix = s->prefix;
        above = s->above;
    }
    const unsigned k = prefix;
    // Tied tokens at key k all weigh `unit`; `need` of them, in id order, reach the target.
    const unsigned long long unit = by_mass ? mass_of(key_value(k), mr, inv_t) : 1ull;
    const unsigned long long members = s->group / unit;
    const unsigned long long need = (target - above + unit - 1) / unit;
    if (need >= members && !exact_id) return Cut{k, k == cut.key ? cut.id : NO_ID};
    unsigned id = 0;
    unsigned long long before = 0;
    for (int shift = 16; shift >= 0; shift -= 8) {  // ids < 2^24
        for (int b = threadIdx.x; b < 256; b += blockDim.x) s->hist[b] = 0;
        __syncthreads();
        row.visit([&](int i, float v, bool valid) {
            unsigned key;
            float e;
            int bin = -1;
            if (valid && candidate(v, i, mr, inv_t, cut, min_e, &key, &e) && key == k &&
                ((unsigned)i >> (shift + 8)) == (id >> (shift + 8)))
                bin = ((unsigned)i >> shift) & 255u;
            hist_add(s->hist, bin, 1ull);
        });
        __syncthreads();
        if (threadIdx.x < 32) pick_bin(s, id, shift, before, need < members ? need : members, false);
        __syncthreads();
        if (s->bin < 0) return Cut{k, k == cut.key ? cut.id : NO_ID};  // unreachable: the group has `members`
        id = s->prefix;
        before = s->above;
    }
    return Cut{k, (int)id};
}

// Mass of the candidates inside `cut` with e >= min_e.
template <class Row>
__device__ unsigned long long kept_mass(const Row& row, float mr, float inv_t, Cut cut, float min_e, Select* s) {
    if (threadIdx.x == 0) s->total = 0;
    __syncthreads();
    unsigned long long local = 0;
    row.visit([&](int i, float v, bool valid) {
        unsigned key;
        float e;
        if (valid && candidate(v, i, mr, inv_t, cut, min_e, &key, &e)) local += (unsigned long long)(e * MASS_ONE);
    });
    atomicAdd(&s->total, local);
    __syncthreads();
    return s->total;
}

// The row's largest finite logit (`*max`, -inf when none) and log Σ e^logit over its finite
// logits, for the whole block.
__device__ float row_log_sum_exp(const float* x, int vocab, float* s_v, float* max) {
    float mr = -FERRITE_INF;
    for_each(x, vocab, [&](int, float v, bool valid) {
        if (valid && is_finite(v)) mr = fmaxf(mr, v);
    });
    mr = block_max(mr, s_v);
    float z = 0.f;
    if (mr != -FERRITE_INF) for_each(x, vocab, [&](int, float v, bool valid) {
            if (valid && is_finite(v)) z += expf(v - mr);
        });
    z = block_sum(z, s_v);
    *max = mr;
    return mr + logf(z);
}

// The cuts of one sampled row over `row` (the whole row or its gathered top set), the draw
// last; `zk` is the mass top_p measures against when top_k keeps everything (the whole row's).
template <class Row>
__device__ int draw_token(const Row& row, float mr, float inv_t, int k, float p, float min_e, float u,
                          unsigned long long zk, Select* s) {
    Cut cut = Cut{0u, NO_ID};
    if (k > 0) cut = select_cut(row, mr, inv_t, cut, 0.f, false, (unsigned long long)k, false, s);
    if (p < 1.f) {
        if (k > 0) zk = kept_mass(row, mr, inv_t, cut, 0.f, s);
        const unsigned long long want = (unsigned long long)ceil((double)p * (double)zk);
        cut = select_cut(row, mr, inv_t, cut, min_e, true, want < 1 ? 1 : want, false, s);
    }
    const unsigned long long total = kept_mass(row, mr, inv_t, cut, min_e, s);
    const unsigned long long draw = (unsigned long long)((double)u * (double)total) + 1ull;
    const Cut d = select_cut(row, mr, inv_t, cut, min_e, true, draw > total ? total : draw, true, s);
    return d.id != NO_ID && total > 0 ? d.id : -1;
}

// Room for a sampled row's gathered top set in shared memory.
#define GATHER_MAX (4 * SAMPLE_THREADS)
// Buckets of distance from the max, (max - v) / T in eighths: 255 holds 31.875 and beyond
// (a token past 27.73 has no fixed-point mass).
#define DIST_BUCKETS 256

__device__ __forceinline__ int dist_bucket(float v, float mr, float inv_t) {
    const float d = (mr - v) * inv_t * 8.f;
    return d < (float)(DIST_BUCKETS - 1) ? (int)d : DIST_BUCKETS - 1;
}

struct Gather {
    unsigned long long mass[DIST_BUCKETS];
    unsigned long long count[DIST_BUCKETS];
    unsigned long long total;
    int last;  // the last bucket of the top set; -1: it does not fit
    int n;
    float v[GATHER_MAX];
    int id[GATHER_MAX];
};

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(const float* __restrict__ logits, int vocab, int stride, const float* __restrict__ temperature,
                const int* __restrict__ top_k, const float* __restrict__ top_p, const float* __restrict__ min_p,
                const float* __restrict__ uniform, unsigned* __restrict__ tokens, float* __restrict__ logprobs) {
    pdl_entry();
    __shared__ float s_v[32];
    __shared__ int s_i[32];
    __shared__ Select s;
    __shared__ Gather g;
    const int row = blockIdx.x;
    const float* x = logits + (u64)row * stride;

    float amax_v;
    int amax;
    row_argmax<4>(x, vocab, s_v, s_i, &amax_v, &amax);
    if (amax == 0x7fffffff) amax = 0;  // every logit NaN: index 0, as the CPU's argmax
    int token = amax;
    const float t = temperature[row];
    const float inv_t = 1.f / t;
    const int k = top_k[row];
    const float p = top_p[row];
    float lse;
    // A finite argmax is the largest finite logit: no +inf (a certainty), some finite one.
    if (!(t > 0.f && is_finite(inv_t) && is_finite(amax_v))) {
        float mr;
        lse = row_log_sum_exp(x, vocab, s_v, &mr);
    } else {
        const float mr = amax_v;
        for (int b = threadIdx.x; b < DIST_BUCKETS; b += blockDim.x) g.mass[b] = g.count[b] = 0;
        __syncthreads();
        float z = 0.f;
        for_each(x, vocab, [&](int, float v, bool valid) {
            const bool f = valid && is_finite(v);
            if (f) z += expf(v - mr);
            const int b = f ? dist_bucket(v, mr, inv_t) : -1;
            hist_add(g.mass, b, f ? mass_of(v, mr, inv_t) : 0ull);
            hist_add(g.count, b, 1ull);
        });
        lse = mr + logf(block_sum(z, s_v));
        if (threadIdx.x < 32) {
            // The first bucket whose top set holds every token a cut can keep: all the mass,
            // or the top_k (top_p then cuts inside them), or top_p of the mass. Lane l takes
            // buckets 8l..8l+7; scans of the lanes' sums find the lane it falls in.
            const int lane = threadIdx.x;
            unsigned long long m[8], c[8], msum = 0, csum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                m[j] = g.mass[8 * lane + j];
                c[j] = g.count[8 * lane + j];
                msum += m[j];
                csum += c[j];
            }
            const unsigned long long mincl = warp_scan(msum), cincl = warp_scan(csum);
            const unsigned long long total = __shfl_sync(FULL_MASK, mincl, 31);
            const unsigned long long want = (unsigned long long)ceil((double)p * (double)total);
            auto holds = [&](unsigned long long mass, unsigned long long count) {
                return mass == total || (k > 0 && count >= (unsigned long long)k) || (k <= 0 && p < 1.f && mass >= want);
            };
            // Every token's bucket is at most 255, so the last lane holds all the mass.
            const unsigned at = __ballot_sync(FULL_MASK, holds(mincl, cincl));
            if (lane == __ffs(at) - 1) {
                unsigned long long mass = mincl - msum, count = cincl - csum;
                int last = 8 * lane + 7;
                for (int j = 0; j < 8; j++) {
                    mass += m[j];
                    count += c[j];
                    if (holds(mass, count)) {
                        last = 8 * lane + j;
                        break;
                    }
                }
                g.total = total;
                g.last = count <= GATHER_MAX ? last : -1;
                g.n = 0;
            }
        }
        __syncthreads();
        const int last = g.last;
        if (last >= 0) {
            for_each(x, vocab, [&](int i, float v, bool valid) {
                if (valid && is_finite(v) && dist_bucket(v, mr, inv_t) <= last) {
                    const int at = atomicAdd(&g.n, 1);
                    g.v[at] = v;
                    g.id[at] = i;
                }
            });
            __syncthreads();
        }
        const int d = last >= 0 ? draw_token(Gathered{g.v, g.id, g.n}, mr, inv_t, k, p, min_p[row], uniform[row], g.total, &s)
                                : draw_token(Dense{x, vocab}, mr, inv_t, k, p, min_p[row], uniform[row], g.total, &s);
        if (d >= 0) token = d;
    }
    if (threadIdx.x == 0) {
        tokens[row] = (unsigned)token;
        logprobs[row] = x[token] - lse;
    }
}

// The rows' logit edits (ferrite_runtime::sampling::LogitEdit::apply): six words an edit —
// row, token, bias, repetition, subtract (f32 bits), ban. Rounded operations (no contraction
// into FMAs), so the result is the CPU's, bit for bit.
extern "C" __global__ void edit_logits(float* __restrict__ logits, int stride, const unsigned* __restrict__ edits,
                                       int n_edits) {
    pdl_entry();
    for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < n_edits; e += gridDim.x * blockDim.x) {
        const unsigned* w = edits + 6 * (u64)e;
        float* p = logits + (u64)w[0] * stride + w[1];
        if (w[5]) {
            *p = -FERRITE_INF;
            continue;
        }
        float l = __fadd_rn(*p, __uint_as_float(w[2]));
        const float r = __uint_as_float(w[3]);
        if (r != 1.f) l = l > 0.f ? __fdiv_rn(l, r) : __fmul_rn(l, r);
        *p = __fsub_rn(l, __uint_as_float(w[4]));
    }
}

#define TOP_MAX 32

// The n_top (<= TOP_MAX) most likely finite logits of each row, most likely first (equal
// logits by id), as ids and log-probabilities; slots past the row's finite logits get id
// 0xffffffff and -inf. A radix select finds the n_top-th in the CPU's order, then the kept
// tokens are gathered and sorted by one thread.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    top_logprobs_rows(const float* __restrict__ logits, int vocab, int stride, int n_top, unsigned* __restrict__ ids,
                      float* __restrict__ lps) {
    pdl_entry();
    __shared__ float s_v[32];
    __shared__ Select s;
    __shared__ int s_n;
    __shared__ int c_id[TOP_MAX];
    __shared__ float c_v[TOP_MAX];
    const int row = blockIdx.x;
    const float* x = logits + (u64)row * stride;
    float mr;
    const float lse = row_log_sum_exp(x, vocab, s_v, &mr);
    if (threadIdx.x == 0) s_n = 0;
    const Cut cut = select_cut(Dense{x, vocab}, mr, 1.f, Cut{0u, NO_ID}, 0.f, false, (unsigned long long)n_top, true, &s);
    for_each(x, vocab, [&](int i, float v, bool valid) {
        if (valid && is_finite(v) && kept(order_key(v), i, cut)) {
            const int at = atomicAdd(&s_n, 1);
            if (at < TOP_MAX) {
                c_id[at] = i;
                c_v[at] = v;
            }
        }
    });
    __syncthreads();
    if (threadIdx.x == 0) {
        const int n = min(s_n, n_top);
        for (int a = 1; a < n; a++) {  // insertion sort: logit descending, id ascending
            const int id = c_id[a];
            const float v = c_v[a];
            int b = a - 1;
            while (b >= 0 && (c_v[b] < v || (c_v[b] == v && c_id[b] > id))) {
                c_id[b + 1] = c_id[b];
                c_v[b + 1] = c_v[b];
                b--;
            }
            c_id[b + 1] = id;
            c_v[b + 1] = v;
        }
        for (int a = 0; a < n_top; a++) {
            ids[(u64)row * n_top + a] = a < n ? (unsigned)c_id[a] : 0xffffffffu;
            lps[(u64)row * n_top + a] = a < n ? c_v[a] - lse : -FERRITE_INF;
        }
    }
}

// A step's token ids taken from the picks of the step queued before it, still on the device
// (the host has not read them yet): ids[pairs[2i]] = picks[pairs[2i + 1]] for n pairs.
extern "C" __global__ void carry_picks(const unsigned int* __restrict__ picks, const unsigned int* __restrict__ pairs,
                                       unsigned int* __restrict__ ids, int n) {
    pdl_entry();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) ids[pairs[2 * i]] = picks[pairs[2 * i + 1]];
}
