// Routing of a mixture of experts on the device, so a MoE step needs no host round trip:
// - moe_route: each token's softmax over its router logits, its top-k experts, their weights
//   (renormalized over the chosen ones when asked, times a per-expert scale when given);
// - moe_align: the step's (token, expert) pairs grouped by expert — offsets, GEMM tiles and
//   the active experts, the token of each grouped row and the grouped row of each pair;
// - moe_route_small: both in one block, for the few tokens of a decode step;
// - moe_combine: each token's weighted sum of its experts' outputs.
// The experts' products between align and combine are moe_gemm.cuh's.

#define MR_WARPS 4
#define MA_THREADS 256
#define MA_PER 8

// Token `row`'s route, by one warp (`p`: E floats of shared memory it owns): p_e =
// softmax(row)_e, the k largest (equal values: the lower expert first, as the CPU's stable
// sort), w = p / Σ chosen p when `renormalize`, times scale[e] when scale is given. ids[0 .. k]
// and weights[0 .. k] get the chosen experts in ascending expert order (the order their
// outputs are summed in). A NaN probability counts as 0, so a token always gets k distinct
// experts. Needs k <= 32 and k <= E.
__device__ __forceinline__ void route_token(const float* __restrict__ row, float* p, int E, int k, int renormalize,
                                            const float* __restrict__ scale, int* __restrict__ ids,
                                            float* __restrict__ weights) {
    const int lane = threadIdx.x & 31;
    float mx = -FERRITE_INF;
    for (int e = lane; e < E; e += 32) {
        const float v = row[e];
        p[e] = v;
        mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    float sum = 0.f;
    for (int e = lane; e < E; e += 32) {
        float ex = expf(p[e] - mx);
        if (!(ex >= 0.f)) ex = 0.f;
        p[e] = ex;
        sum += ex;
    }
    sum = warp_sum(sum);
    __syncwarp();
    // Lane j < k ends up holding the j-th choice; a chosen expert's value becomes -1.
    int mine = 0;
    float mine_v = 0.f;
    for (int j = 0; j < k; j++) {
        float bv = -2.f;
        int be = E;
        for (int e = lane; e < E; e += 32) {
            const float v = p[e];
            if (v > bv) {
                bv = v;
                be = e;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, bv, o);
            const int oe = __shfl_xor_sync(FULL_MASK, be, o);
            if (ov > bv || (ov == bv && oe < be)) {
                bv = ov;
                be = oe;
            }
        }
        if (lane == j) {
            mine = be;
            mine_v = bv;
        }
        if (lane == (be & 31)) p[be] = -1.f;
        __syncwarp();
    }
    const float prob = mine_v / sum;
    const float chosen = warp_sum(lane < k ? prob : 0.f);
    float w = renormalize ? prob / chosen : prob;
    if (scale != nullptr && lane < k) w *= scale[mine];
    int rank = 0;
    for (int j = 0; j < k; j++) rank += __shfl_sync(FULL_MASK, mine, j) < mine;
    if (lane < k) {
        ids[rank] = mine;
        weights[rank] = w;
    }
}

// Each token's route (route_token; a warp per token, MR_WARPS tokens a block, dynamic shared
// memory of MR_WARPS * E floats) into ids[t * k ..] and weights[t * k ..].
extern "C" __global__ void moe_route(const float* __restrict__ logits, int tokens, int E, int k, int renormalize,
                                     const float* __restrict__ scale, int* __restrict__ ids,
                                     float* __restrict__ weights) {
    pdl_entry();
    extern __shared__ float probs[];
    const int warp = threadIdx.x >> 5;
    const int t = blockIdx.x * MR_WARPS + warp;
    if (t >= tokens) return;
    route_token(logits + (u64)t * E, probs + warp * E, E, k, renormalize, scale, ids + (u64)t * k,
                weights + (u64)t * k);
}

// Sum of `v` over the block (MA_THREADS threads); every thread gets it. `scratch` holds 32.
__device__ __forceinline__ int block_sum_int(int v, int* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < MA_THREADS / 32 ? scratch[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Exclusive prefix sum of `v` over the block's threads in order (MA_THREADS); `total` gets
// the whole sum. `scratch` holds 32.
__device__ __forceinline__ int block_scan_int(int v, int* scratch, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += u;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    int before = 0;
    total = 0;
    for (int w = 0; w < MA_THREADS / 32; w++) {
        const int n = scratch[w];
        if (w < warp) before += n;
        total += n;
    }
    return before + incl - v;
}

// The `pairs` = tokens * top_k pairs of `ids` (moe_route's) grouped by expert. Block e (grid
// E, MA_THREADS threads, dynamic shared memory of E ints) counts every expert's pairs, then
// writes offsets[e] (the pairs of experts before e; offsets[E] = pairs), tiles[e] (their
// tiles of bm rows; tiles[E] = all tiles), active[s] = e when e is the s-th expert with pairs
// (the slots past the last active one -1), and, for its own pairs p in order (so by token),
// rows[r] = p / top_k (the token of grouped row r) and pos[p] = r. No atomics outside
// shared memory, so the grouping is the same on every run.
extern "C" __global__ void moe_align(const int* __restrict__ ids, int pairs, int top_k, int E, int bm,
                                     int* __restrict__ offsets, int* __restrict__ tiles, int* __restrict__ active,
                                     int* __restrict__ rows, int* __restrict__ pos) {
    pdl_entry();
    extern __shared__ int hist[];
    __shared__ int scratch[32];
    const int e = blockIdx.x, tid = threadIdx.x;
    for (int i = tid; i < E; i += MA_THREADS) hist[i] = 0;
    __syncthreads();
    for (int p = tid; p < pairs; p += MA_THREADS) atomicAdd(&hist[ids[p]], 1);
    __syncthreads();
    int before = 0, tiles_before = 0, active_before = 0, active_all = 0;
    for (int i = tid; i < E; i += MA_THREADS) {
        const int c = hist[i];
        if (i < e) {
            before += c;
            tiles_before += (c + bm - 1) / bm;
            active_before += c > 0;
        }
        active_all += c > 0;
    }
    before = block_sum_int(before, scratch);
    tiles_before = block_sum_int(tiles_before, scratch);
    active_before = block_sum_int(active_before, scratch);
    active_all = block_sum_int(active_all, scratch);
    const int count = hist[e];
    if (tid == 0) {
        offsets[e] = before;
        tiles[e] = tiles_before;
        if (e == E - 1) {
            offsets[E] = before + count;
            tiles[E] = tiles_before + (count + bm - 1) / bm;
        }
        if (count > 0) active[active_before] = e;
        if (e >= active_all) active[e] = -1;
    }
    if (count == 0) return;
    // Expert e's pairs in pair order: each thread takes MA_PER consecutive pairs of a chunk.
    int base = before;
    for (int s = 0; s < pairs; s += MA_THREADS * MA_PER) {
        const int p0 = s + tid * MA_PER;
        int c = 0;
        for (int j = 0; j < MA_PER; j++) c += p0 + j < pairs && ids[p0 + j] == e;
        int total;
        int at = base + block_scan_int(c, scratch, total);
        for (int j = 0; j < MA_PER; j++) {
            const int p = p0 + j;
            if (p < pairs && ids[p] == e) {
                rows[at] = p / top_k;
                pos[p] = at;
                at++;
            }
        }
        base += total;
    }
}

// moe_route then moe_align, in one block of MA_THREADS threads, for a step of at most
// MS_TOKENS tokens (dynamic shared memory of MS_TOKENS * E floats): warp t routes token t
// (route_token), then the block counts the pairs per expert, scans the counts, tiles and
// active experts over runs of consecutive experts (a run a thread), and places each pair
// after its expert's earlier pairs. The same outputs as the two kernels.
#define MS_TOKENS (MA_THREADS / 32)
extern "C" __global__ void __launch_bounds__(MA_THREADS)
    moe_route_small(const float* __restrict__ logits, int tokens, int E, int k, int renormalize,
                    const float* __restrict__ scale, int bm, int* __restrict__ ids, float* __restrict__ weights,
                    int* __restrict__ offsets, int* __restrict__ tiles, int* __restrict__ active,
                    int* __restrict__ rows, int* __restrict__ pos) {
    pdl_entry();
    extern __shared__ float probs[];
    __shared__ int sid[MS_TOKENS * 32];
    __shared__ float sw[MS_TOKENS * 32];
    __shared__ int scratch[32];
    const int tid = threadIdx.x, warp = tid >> 5, pairs = tokens * k;
    if (warp < tokens) route_token(logits + (u64)warp * E, probs + warp * E, E, k, renormalize, scale, sid + warp * k,
                                   sw + warp * k);
    __syncthreads();
    int* hist = (int*)probs;  // the probabilities are spent
    for (int e = tid; e < E; e += MA_THREADS) hist[e] = 0;
    if (tid < pairs) {
        ids[tid] = sid[tid];
        weights[tid] = sw[tid];
    }
    __syncthreads();
    if (tid < pairs) atomicAdd(&hist[sid[tid]], 1);
    __syncthreads();
    const int per = (E + MA_THREADS - 1) / MA_THREADS, e0 = min(E, tid * per), e1 = min(E, e0 + per);
    int c = 0, tl = 0, a = 0;
    for (int e = e0; e < e1; e++) {
        const int n = hist[e];
        c += n;
        tl += (n + bm - 1) / bm;
        a += n > 0;
    }
    int pairs_all, tiles_all, active_all;
    int c_at = block_scan_int(c, scratch, pairs_all);
    int tl_at = block_scan_int(tl, scratch, tiles_all);
    int a_at = block_scan_int(a, scratch, active_all);
    for (int e = e0; e < e1; e++) {
        const int n = hist[e];
        offsets[e] = c_at;
        tiles[e] = tl_at;
        if (n > 0) active[a_at++] = e;
        hist[e] = c_at;  // now expert e's first grouped row
        c_at += n;
        tl_at += (n + bm - 1) / bm;
    }
    for (int e = active_all + tid; e < E; e += MA_THREADS) active[e] = -1;
    if (tid == 0) {
        offsets[E] = pairs_all;
        tiles[E] = tiles_all;
    }
    __syncthreads();
    if (tid < pairs) {
        const int e = sid[tid];
        int r = hist[e];
        for (int q = 0; q < tid; q++) r += sid[q] == e;
        rows[r] = tid / k;
        pos[tid] = r;
    }
}

// out[t] = sum_j weight[t, j] * y[pos[t, j]] over a token's top_k routed experts (its pairs
// in ascending expert order, the order the CPU sums them), f32 accumulation. Grid: one block
// per token.
extern "C" __global__ void moe_combine(bf16_t* __restrict__ out, const bf16_t* __restrict__ y,
                                       const int* __restrict__ pos, const float* __restrict__ weight, int top_k,
                                       int d) {
    pdl_entry();
    const int t = blockIdx.x;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float acc = 0.f;
        for (int j = 0; j < top_k; j++) acc += weight[t * top_k + j] * bf2f(y[(size_t)pos[t * top_k + j] * d + i]);
        out[(size_t)t * d + i] = f2bf(acc);
    }
}
