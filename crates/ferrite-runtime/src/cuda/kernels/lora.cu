// Multi-LoRA, co-batched: after a projection's base GEMM has run over every token of a step,
// `out[t] += B · (A · x[t])` for each token t that runs through an adapter, with the adapter
// of each token chosen per token (`ops/lora.rs`). Two launches a projection, whatever the
// adapters in the step:
// - lora_shrink: s[p] = A · x[t] (rank values, f32) for the token t at position p of the step's
//   token order (tokens grouped by adapter, at most LORA_TG a group);
// - lora_expand: out[t] += B · s[p], rounded once to bf16.
// A fused projection (q/k/v, gate/up) is up to LORA_SLICES slices: consecutive targets of one
// layer whose outputs sit side by side in `out`; grid dimension y of the shrink is the slice.
//
// The adapters' matrices are found through a device table, never through kernel arguments, so
// a CUDA graph captured before an adapter was attached reads it correctly afterwards: entry
// ((slot * layers + layer) * 7 + target) * 2 holds A's address ([rank, in] bf16), the next one
// B's ([out, rank] bf16, the adapter's scale folded in); 0 where the adapter leaves the
// projection alone. The step's grouping is device memory (`meta`) written before every step:
//   meta[0..4) = {n_groups, n_items, where items start, where order starts}
//   groups     = {slot, first position, token count, rank} per group, from meta[4]
//   items      = {group, first rank row} per shrink work item (LORA_RB rank rows each)
//   order      = the step's adapted tokens, grouped
// Blocks loop over groups or items with a grid stride, so a grid fixed at capture covers any
// grouping. Each token's sums run in one fixed order (its own accumulators, the same thread
// layout for a given width, a fixed tree across lanes and warps), so its result never depends
// on which other tokens or adapters share the step.

#define LORA_TG 8       // tokens a group holds at most
#define LORA_RB 8       // rank rows one shrink item computes
#define LORA_SLICES 3   // slices of a fused projection at most
#define LORA_MAXR 64    // the largest rank
#define LORA_THREADS 256

// Eight-wide dot product of two packed bf16 rows, accumulated in a fixed order.
__device__ __forceinline__ float lora_dot8(uint4 xr, const float* af, float acc) {
    float xf[8];
    unpack8(xr, xf);
#pragma unroll
    for (int i = 0; i < 8; i++) acc = fmaf(xf[i], af[i], acc);
    return acc;
}

// Grid (any, slices), LORA_THREADS threads. x: [tokens, in] bf16, read 16 bytes at a time when
// `wide` (x and `in` 16-byte aligned); s: [positions][LORA_SLICES][LORA_MAXR] f32. `entry` is
// the table index of (layer, first target)'s A in slot 0; a slot's entries are `slot_stride`
// apart.
extern "C" __global__ void __launch_bounds__(LORA_THREADS, 2)
    lora_shrink(const bf16_t* __restrict__ x, int in, int wide, const unsigned* __restrict__ meta,
                const u64* __restrict__ table, int slot_stride, int entry, float* __restrict__ s) {
    pdl_entry();
    const uint4* groups = (const uint4*)(meta + 4);
    const uint2* items = (const uint2*)(meta + meta[2]);
    const unsigned* order = meta + meta[3];
    __shared__ float part[LORA_THREADS / 32][LORA_TG * LORA_RB];
    const int slice = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned n_items = meta[1];
    for (unsigned it = blockIdx.x; it < n_items; it += gridDim.x) {
        const uint2 item = items[it];
        const uint4 g = groups[item.x];  // slot, first position, count, rank
        const bf16_t* a = (const bf16_t*)table[(size_t)g.x * slot_stride + entry + 2 * slice];
        if (a == nullptr) continue;  // the same for the whole block
        const int r0 = (int)item.y, rows = min(LORA_RB, (int)g.w - r0), count = (int)g.z;
        const bf16_t* xt[LORA_TG];
#pragma unroll
        for (int j = 0; j < LORA_TG; j++) xt[j] = x + (size_t)order[g.y + min(j, count - 1)] * in;
        float acc[LORA_TG][LORA_RB];
#pragma unroll
        for (int j = 0; j < LORA_TG; j++)
#pragma unroll
            for (int r = 0; r < LORA_RB; r++) acc[j][r] = 0.f;
        if (wide) {
            for (int k = threadIdx.x * 8; k < in; k += LORA_THREADS * 8) {
                uint4 xr[LORA_TG];
#pragma unroll
                for (int j = 0; j < LORA_TG; j++) xr[j] = *(const uint4*)(xt[j] + k);
#pragma unroll
                for (int r = 0; r < LORA_RB; r++) {
                    if (r < rows) {
                        float af[8];
                        unpack8(*(const uint4*)(a + (size_t)(r0 + r) * in + k), af);
#pragma unroll
                        for (int j = 0; j < LORA_TG; j++) acc[j][r] = lora_dot8(xr[j], af, acc[j][r]);
                    }
                }
            }
        } else {
            for (int k = threadIdx.x; k < in; k += LORA_THREADS) {
                float xf[LORA_TG];
#pragma unroll
                for (int j = 0; j < LORA_TG; j++) xf[j] = bf2f(xt[j][k]);
#pragma unroll
                for (int r = 0; r < LORA_RB; r++) {
                    if (r < rows) {
                        const float av = bf2f(a[(size_t)(r0 + r) * in + k]);
#pragma unroll
                        for (int j = 0; j < LORA_TG; j++) acc[j][r] = fmaf(xf[j], av, acc[j][r]);
                    }
                }
            }
        }
        // Lanes, then warps in order: one fixed tree per (token, rank row).
#pragma unroll
        for (int j = 0; j < LORA_TG; j++)
#pragma unroll
            for (int r = 0; r < LORA_RB; r++) {
                if (j < count && r < rows) {
                    const float v = warp_sum(acc[j][r]);
                    if (lane == 0) part[warp][j * LORA_RB + r] = v;
                }
            }
        __syncthreads();
        if (threadIdx.x < LORA_TG * LORA_RB) {
            const int j = threadIdx.x / LORA_RB, r = threadIdx.x % LORA_RB;
            if (j < count && r < rows) {
                float v = 0.f;
#pragma unroll
                for (int w = 0; w < LORA_THREADS / 32; w++) v += part[w][threadIdx.x];
                s[((size_t)(g.y + j) * LORA_SLICES + slice) * LORA_MAXR + r0 + r] = v;
            }
        }
        __syncthreads();
    }
}

// Grid (any, ceil((n0 + n1 + n2) / LORA_THREADS)), LORA_THREADS threads: one output column a
// thread, for every token of a group. out: rows of `stride` bf16, slice i's columns after
// slice i - 1's (n_i of them; 0 for a slice the projection lacks).
extern "C" __global__ void __launch_bounds__(LORA_THREADS)
    lora_expand(bf16_t* __restrict__ out, int stride, int n0, int n1, int n2, const unsigned* __restrict__ meta,
                const u64* __restrict__ table, int slot_stride, int entry, const float* __restrict__ s) {
    pdl_entry();
    const uint4* groups = (const uint4*)(meta + 4);
    const unsigned* order = meta + meta[3];
    __shared__ float sv[LORA_TG * LORA_SLICES * LORA_MAXR];
    const int col = blockIdx.y * LORA_THREADS + threadIdx.x;
    const int slice = col < n0 ? 0 : col < n0 + n1 ? 1 : 2;
    const int within = col - (slice == 0 ? 0 : slice == 1 ? n0 : n0 + n1);
    const bool live = col < n0 + n1 + n2;
    const unsigned n_groups = meta[0];
    for (unsigned gi = blockIdx.x; gi < n_groups; gi += gridDim.x) {
        const uint4 g = groups[gi];  // slot, first position, count, rank
        const int count = (int)g.z, rank = (int)g.w;
        __syncthreads();  // the last group's values are read
        const float* sg = s + (size_t)g.y * LORA_SLICES * LORA_MAXR;
        for (int i = threadIdx.x; i < count * LORA_SLICES * LORA_MAXR; i += LORA_THREADS) sv[i] = sg[i];
        __syncthreads();
        if (!live) continue;
        const bf16_t* b = (const bf16_t*)table[(size_t)g.x * slot_stride + entry + 2 * slice + 1];
        if (b == nullptr) continue;
        b += (size_t)within * rank;
        float acc[LORA_TG];
#pragma unroll
        for (int j = 0; j < LORA_TG; j++) acc[j] = 0.f;
        const float* sj = sv + slice * LORA_MAXR;
        if ((rank & 7) == 0) {
            for (int r = 0; r < rank; r += 8) {
                float bf[8];
                unpack8(*(const uint4*)(b + r), bf);
#pragma unroll
                for (int j = 0; j < LORA_TG; j++) {
                    float v = acc[j];
#pragma unroll
                    for (int i = 0; i < 8; i++) v = fmaf(bf[i], sj[j * LORA_SLICES * LORA_MAXR + r + i], v);
                    acc[j] = v;
                }
            }
        } else {
            for (int r = 0; r < rank; r++) {
                const float bv = bf2f(b[r]);
#pragma unroll
                for (int j = 0; j < LORA_TG; j++) acc[j] = fmaf(bv, sj[j * LORA_SLICES * LORA_MAXR + r], acc[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < LORA_TG; j++) {
            if (j < count) {
                bf16_t* o = out + (size_t)order[g.y + j] * stride + col;
                *o = f2bf(bf2f(*o) + acc[j]);
            }
        }
    }
}
