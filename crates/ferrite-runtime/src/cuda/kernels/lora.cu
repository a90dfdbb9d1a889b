// Multi-LoRA, co-batched: after a projection's base GEMM has run over every token of a step,
// `out[t] += B · (A · x[t])` for each token t that runs through an adapter, with the adapter
// of each token chosen per token (`ops/lora.rs`). Two launches a projection, whatever the
// adapters in the step:
// - lora_shrink: s[p] = A · x[t] (rank values, f32) for the token t at position p of the step's
//   token order (tokens grouped by adapter, at most LORA_TG a group), as partial sums over
//   chunks of LORA_KC input values;
// - lora_expand: out[t] += B · s[p] (the partials summed in chunk order), rounded once to
//   bf16.
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
#define LORA_KC (LORA_THREADS * 8)  // input values a shrink work item covers

// Eight-wide dot product of two packed bf16 rows, accumulated in a fixed order.
__device__ __forceinline__ float lora_dot8(uint4 xr, const float* af, float acc) {
    float xf[8];
    unpack8(xr, xf);
#pragma unroll
    for (int i = 0; i < 8; i++) acc = fmaf(xf[i], af[i], acc);
    return acc;
}

// Halve N values across the lanes `o` apart: the lane with bit `o` set keeps the upper half,
// the other the lower, each summing its half with its partner's. Done for o = 16 .. 1 over 64
// values, lane l ends with the sums of values 2l and 2l + 1 over all 32 lanes: each value
// through warp_sum's pairs (a fixed tree whatever its index), at a sixth of the shuffles.
template <int N>
__device__ __forceinline__ void lora_fold(float* v, int o) {
    const bool hi = (threadIdx.x & o) != 0;
#pragma unroll
    for (int i = 0; i < N / 2; i++) {
        const float send = hi ? v[i] : v[i + N / 2];
        const float keep = hi ? v[i + N / 2] : v[i];
        v[i] = keep + __shfl_xor_sync(FULL_MASK, send, o);
    }
}

// Grid (any, slices), LORA_THREADS threads. x: [tokens, in] bf16, read 16 bytes at a time when
// `wide` (x and `in` 16-byte aligned). A work item is (shrink item, chunk of LORA_KC input
// values): each thread loads its 8 values of every token and rank row at once, so an item is
// one round of loads, and the items of a step's few tokens spread over the GPU. s:
// [positions][kcap][LORA_SLICES][LORA_MAXR] f32, chunk c's partial sums at [.][c]; lora_expand
// sums the `chunks` partials in order. `entry` is the table index of (layer, first target)'s A
// in slot 0; a slot's entries are `slot_stride` apart.
extern "C" __global__ void __launch_bounds__(LORA_THREADS, 1)
    lora_shrink(const bf16_t* __restrict__ x, int in, int wide, const unsigned* __restrict__ meta,
                const u64* __restrict__ table, int slot_stride, int entry, float* __restrict__ s, int chunks,
                int kcap) {
    pdl_entry();
    const uint4* groups = (const uint4*)(meta + 4);
    const uint2* items = (const uint2*)(meta + meta[2]);
    const unsigned* order = meta + meta[3];
    __shared__ float part[LORA_THREADS / 32][LORA_TG * LORA_RB];
    const int slice = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned n_work = meta[1] * (unsigned)chunks;
    for (unsigned it = blockIdx.x; it < n_work; it += gridDim.x) {
        const unsigned chunk = it % (unsigned)chunks;
        const uint2 item = items[it / (unsigned)chunks];
        const uint4 g = groups[item.x];  // slot, first position, count, rank
        const bf16_t* a = (const bf16_t*)table[(size_t)g.x * slot_stride + entry + 2 * slice];
        if (a == nullptr) continue;  // the same for the whole block
        const int r0 = (int)item.y, rows = min(LORA_RB, (int)g.w - r0), count = (int)g.z;
        const bf16_t* xt[LORA_TG];
#pragma unroll
        for (int j = 0; j < LORA_TG; j++) xt[j] = x + (size_t)order[g.y + min(j, count - 1)] * in;
        const bf16_t* ar[LORA_RB];
#pragma unroll
        for (int r = 0; r < LORA_RB; r++) ar[r] = a + (size_t)(r0 + min(r, rows - 1)) * in;
        float acc[LORA_TG * LORA_RB];
#pragma unroll
        for (int i = 0; i < LORA_TG * LORA_RB; i++) acc[i] = 0.f;
        const int k0 = (int)chunk * LORA_KC;
        if (wide) {
            const int k = k0 + threadIdx.x * 8;
            if (k < in) {
                uint4 xr[LORA_TG], av[LORA_RB];
#pragma unroll
                for (int j = 0; j < LORA_TG; j++) xr[j] = *(const uint4*)(xt[j] + k);
#pragma unroll
                for (int r = 0; r < LORA_RB; r++) av[r] = *(const uint4*)(ar[r] + k);
#pragma unroll
                for (int r = 0; r < LORA_RB; r++) {
                    float af[8];
                    unpack8(av[r], af);
#pragma unroll
                    for (int j = 0; j < LORA_TG; j++) acc[j * LORA_RB + r] = lora_dot8(xr[j], af, acc[j * LORA_RB + r]);
                }
            }
        } else {
            for (int k = k0 + threadIdx.x; k < min(in, k0 + LORA_KC); k += LORA_THREADS) {
                float xf[LORA_TG];
#pragma unroll
                for (int j = 0; j < LORA_TG; j++) xf[j] = bf2f(xt[j][k]);
#pragma unroll
                for (int r = 0; r < LORA_RB; r++) {
                    const float av = bf2f(ar[r][k]);
#pragma unroll
                    for (int j = 0; j < LORA_TG; j++) acc[j * LORA_RB + r] = fmaf(xf[j], av, acc[j * LORA_RB + r]);
                }
            }
        }
        // Lanes (one fixed tree per value), then warps in order.
        lora_fold<64>(acc, 16);
        lora_fold<32>(acc, 8);
        lora_fold<16>(acc, 4);
        lora_fold<8>(acc, 2);
        lora_fold<4>(acc, 1);
        part[warp][2 * lane] = acc[0];
        part[warp][2 * lane + 1] = acc[1];
        __syncthreads();
        if (threadIdx.x < LORA_TG * LORA_RB) {
            const int j = threadIdx.x / LORA_RB, r = threadIdx.x % LORA_RB;
            if (j < count && r < rows) {
                float v = 0.f;
#pragma unroll
                for (int w = 0; w < LORA_THREADS / 32; w++) v += part[w][threadIdx.x];
                s[(((size_t)(g.y + j) * kcap + chunk) * LORA_SLICES + slice) * LORA_MAXR + r0 + r] = v;
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
                const u64* __restrict__ table, int slot_stride, int entry, const float* __restrict__ s, int chunks,
                int kcap) {
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
        // This thread's B row and its column of the tokens' outputs, loaded while the block
        // gathers the rank values below (the loads' latencies overlap).
        const bf16_t* b = live ? (const bf16_t*)table[(size_t)g.x * slot_stride + entry + 2 * slice + 1] : nullptr;
        const bool wide = (rank & 7) == 0;
        uint4 bw[LORA_MAXR / 8];
        float base[LORA_TG];
        bf16_t* o[LORA_TG];
        if (b != nullptr) {
            b += (size_t)within * rank;
#pragma unroll
            for (int q = 0; q < LORA_MAXR / 8; q++)
                if (wide && q * 8 < rank) bw[q] = *(const uint4*)(b + q * 8);
#pragma unroll
            for (int j = 0; j < LORA_TG; j++) {
                o[j] = out + (size_t)order[g.y + min(j, count - 1)] * stride + col;
                base[j] = bf2f(*o[j]);
            }
        }
        __syncthreads();  // the last group's values are read
        // The rank values of the group's tokens: the shrink's chunk partials summed in order.
        for (int i = threadIdx.x; i < count * LORA_SLICES * rank; i += LORA_THREADS) {
            const int jl = i / rank, r = i - jl * rank;  // jl: token j, slice l
            const float* p = s + (((size_t)g.y + jl / LORA_SLICES) * kcap * LORA_SLICES + jl % LORA_SLICES) * LORA_MAXR + r;
            float v = 0.f;
            for (int c = 0; c < chunks; c++) v += p[(size_t)c * LORA_SLICES * LORA_MAXR];
            sv[jl * LORA_MAXR + r] = v;
        }
        __syncthreads();
        if (b == nullptr) continue;
        float acc[LORA_TG];
#pragma unroll
        for (int j = 0; j < LORA_TG; j++) acc[j] = 0.f;
        const float* sj = sv + slice * LORA_MAXR;
        if (wide) {
#pragma unroll
            for (int q = 0; q < LORA_MAXR / 8; q++) {
                if (q * 8 < rank) {
                    float bf[8];
                    unpack8(bw[q], bf);
#pragma unroll
                    for (int j = 0; j < LORA_TG; j++) {
                        float v = acc[j];
#pragma unroll
                        for (int i = 0; i < 8; i++) v = fmaf(bf[i], sj[j * LORA_SLICES * LORA_MAXR + q * 8 + i], v);
                        acc[j] = v;
                    }
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
        for (int j = 0; j < LORA_TG; j++)
            if (j < count) *o[j] = f2bf(base[j] + acc[j]);
    }
}
