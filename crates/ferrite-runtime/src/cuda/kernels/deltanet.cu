// Gated DeltaNet (linear attention) kernels, f32 throughout: the layer's input projections
// come in as f32 rows and its normed output leaves as bf16 for the output projection.
//
// A step's rows are a table of ROW_FIELDS ints each — [first token, tokens, read slot (-1:
// the zero state of a sequence's start), first write, end of writes] — over a list of writes,
// (n, slot) int pairs: the state after the row's first n tokens goes to slot (ascending n;
// `kv_state::state_rows`). `tok_row` gives each token's row. The host checks every slot and
// that no row writes a slot another row reads or writes, so a (row, channel) or (row, head,
// column) thread owns what it writes.
//
// - delta_conv: the causal depthwise conv + SiLU of every (token, channel), its inputs before
//   the row's first token from the read slot's window;
// - delta_conv_state: each write's window (the last kernel - 1 inputs after n tokens), one
//   thread per (row, channel) that reads the old window before writing any;
// - delta_qk_norm: L2 norm of each q and k head in place (q also scaled);
// - delta_gates: beta = sigmoid(b), g = neg_rate * softplus(a + dt_bias);
// - delta_rule_k{32,64,128}: the gated delta rule, sequential over a row's tokens, one warp
//   per (row, value head, 32 columns of v) with the state's columns in registers: the one-step
//   update of decode and the short rows of verify spans (rows below the host's chunk_min);
// - delta_chunk_k{32,64,128}: the same rule over the long rows (prefill) as a chunked scan;
// - delta_out_norm: per-head RMSNorm of the output times silu(z), to bf16.
//
// The chunked scan. Per value head the recurrence, S [k_dim][v_dim], a_t = exp(g_t), is
//   S_t = a_t S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - a_t S_{t-1}^T k_t),   o_t = S_t^T q_t.
// Split a row into chunks of DC = 32 tokens; in a chunk starting from state S0 let
// gam_i = g_0 + ... + g_i (chunk-local, so every factor below is exp of a difference <= 0:
// nothing overflows, a long-decayed state underflows to the zero it is). By induction
//   S_i = exp(gam_i) S0 + sum_{j<=i} exp(gam_i - gam_j) k_j d_j^T,
// and substituting it into d_i gives the UT (WY) form, a unit lower-triangular system:
//   (I + A) D = R,   A_ij = beta_i exp(gam_i - gam_j) k_i.k_j (j < i, else 0),
//                    R_i  = beta_i (v_i - exp(gam_i) S0^T k_i),
//   O_i = exp(gam_i) S0^T q_i + sum_{j<=i} exp(gam_i - gam_j) (q_i.k_j) d_j,
//   state after p tokens = exp(gam_{p-1}) S0 + sum_{j<p} exp(gam_{p-1} - gam_j) k_j d_j^T.
// The last line at p = the chunk's end is the next chunk's S0, and at any p a write names it
// is that write's snapshot, materialised mid-chunk without cutting the chunk. A partial last
// chunk is padded with k = q = v = g = beta = 0 tokens, which change nothing.
//
// One block of 256 threads per (long row, value head, 32 value columns), the chunks in turn,
// S0's column tile in shared memory; per chunk, four barriers apart:
//   1. load K, Q [DC][k_dim] (and the gates, gam by a per-thread prefix sum);
//   2. four 32x32 products over k_dim, 64 threads each in 4x4 register tiles, that end as
//      A (K K^T), P (Q K^T masked and decayed), R (from K S0 and v) and O (Q S0 decayed);
//   3. one warp solves (I + A) D = R by forward substitution, lane = value column (its column
//      of D in registers, two accumulators to halve the dependent chain);
//   4. O += P D to `out`, and each state point (writes inside the chunk, then its end), a
//      [k_dim][32] tile, k_dim/32 x 4 per thread.
// Precision: f32 everywhere (SIMT FMAs, no tensor cores: TF32's 10-bit mantissa would put
// about 1e-3 relative error into every product, and the state is carried through thousands
// of tokens). The chunk form regroups the sums, so it equals the sequential kernel to f32
// rounding, not bit for bit; an f32 emulation of these phases against an f64 scan (k_dim
// 32-128, 200-2048 tokens, random normalized keys, beta in [0, 1], decays down to exp(-2))
// gave output errors <= 1.2e-7 and state errors <= 1.9e-6 (states up to 1.8), no worse than
// the f32 sequential scan's own errors (<= 1.8e-6); this kernel's source run on CPU threads
// against delta_rule_k* (rows of 1 to 1,000 tokens, mid-chunk writes, decays down to exp(-20))
// stayed within 2.4e-6 on states and 5e-7 on outputs.
// Shared memory, floats: K, Q [DC][KMAX + 1] (the +1 spreads a column over the banks),
// S0 [KMAX][32], A, P [DC][DC + 1], R (then D), O [DC][32], gam, beta [DC]: 66,304 bytes at
// KMAX = 128, 41,728 at 64, 29,440 at 32 (`delta_chunk_shared`); with 128 registers a thread
// at KMAX = 128 (78-80 below it), two blocks share an SM.
//
// Predicted speed-up, a 2,048-token prefill of a Qwen3.5-4B-like layer (32 value heads, 16
// key heads, dims 128) on an H100 (132 SMs, ~1.7 GHz): both kernels run 32 x 4 = 128 blocks,
// one an SM, so each is one SM's latency. Sequential: a token is a dependent chain of a global
// q/k load (~600 cycles) and two 128-long FMA chains (m, then o: ~1,000 cycles): ~1,700
// cycles x 2,048 tokens ~ 3.5 M cycles ~ 2.0 ms. Chunked: 64 chunks; phase 2 is 128 k-steps
// of 8 shared loads and 16 FMAs per thread, bound by the SM's one shared-load warp-instruction
// a cycle: 8 warps x 128 x 8 ~ 8.2 K cycles; phase 4 ~ 2 K, the solve ~ 2.5 K (496 chained
// FMAs), loads and barriers ~ 2 K: ~15 K cycles a chunk ~ 1.0 M cycles ~ 0.55 ms, about 3.5x.
// Rows shorter than the host's chunk_min (16) keep the sequential kernel: a chunk costs about
// what 9 sequential tokens do, whatever its fill.

#define ROW_FIELDS 5
#define MAX_CONV_KERNEL 8

// x: [tokens] rows of x_stride values, the conv inputs at offset 0; w: [kernel][channels];
// window: the pool's windows, [slot][kernel - 1][channels]; out: [tokens, channels].
extern "C" __global__ void delta_conv(const float* __restrict__ x, int x_stride, const float* __restrict__ w,
                                      int channels, int kernel, const int* __restrict__ rows,
                                      const int* __restrict__ tok_row, const float* __restrict__ window,
                                      float* __restrict__ out, int tokens) {
    pdl_entry();
    const int keep = kernel - 1;
    const size_t per_slot = (size_t)keep * channels, n = (size_t)tokens * channels;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const int t = (int)(i / channels), c = (int)(i - (size_t)t * channels);
        const int* row = rows + (size_t)tok_row[t] * ROW_FIELDS;
        const int start = row[0], read = row[2], at = t - start;
        float acc = 0.f;
        for (int j = 0; j < kernel; j++) {
            const int p = at - keep + j;  // the input's index from the row's first token
            float v = 0.f;
            if (p >= 0)
                v = x[(size_t)(start + p) * x_stride + c];
            else if (read >= 0)
                v = window[(size_t)read * per_slot + (size_t)(keep + p) * channels + c];
            acc += w[(size_t)j * channels + c] * v;
        }
        out[i] = silu(acc);
    }
}

// Grid (ceil(channels / blockDim.x), rows).
extern "C" __global__ void delta_conv_state(const float* __restrict__ x, int x_stride, int channels, int kernel,
                                            const int* __restrict__ rows, const int* __restrict__ writes,
                                            float* __restrict__ window) {
    pdl_entry();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= channels) return;
    const int* row = rows + (size_t)blockIdx.y * ROW_FIELDS;
    const int start = row[0], read = row[2], first = row[3], end = row[4];
    const int keep = kernel - 1;
    const size_t per_slot = (size_t)keep * channels;
    // The window the row continues (all of it read before any write: a row may write its read slot).
    float old[MAX_CONV_KERNEL - 1];
#pragma unroll
    for (int i = 0; i < MAX_CONV_KERNEL - 1; i++)
        old[i] = (i < keep && read >= 0) ? window[(size_t)read * per_slot + (size_t)i * channels + c] : 0.f;
    for (int k = first; k < end; k++) {
        const int upto = writes[2 * k], slot = writes[2 * k + 1];
        float* dst = window + (size_t)slot * per_slot + c;
#pragma unroll
        for (int i = 0; i < MAX_CONV_KERNEL - 1; i++) {
            if (i >= keep) break;
            // Input upto + i of the old window followed by the row's inputs.
            const int e = upto + i;
            float v = 0.f;
#pragma unroll
            for (int o = 0; o < MAX_CONV_KERNEL - 1; o++)
                if (o == e) v = old[o];
            if (e >= keep) v = x[(size_t)(start + e - keep) * x_stride + c];
            dst[(size_t)i * channels] = v;
        }
    }
}

// x: [tokens] rows of `stride` values holding k_heads q heads, then k_heads k heads, of k_dim
// each. Grid (tokens, 2 * k_heads), one warp.
extern "C" __global__ void delta_qk_norm(float* __restrict__ x, int stride, int k_heads, int k_dim, float q_scale,
                                         float eps) {
    pdl_entry();
    float* p = x + (size_t)blockIdx.x * stride + (size_t)blockIdx.y * k_dim;
    float ss = 0.f;
    for (int i = threadIdx.x; i < k_dim; i += 32) ss += p[i] * p[i];
    ss = warp_sum(ss);
    const float inv = ((int)blockIdx.y < k_heads ? q_scale : 1.f) / sqrtf(ss + eps);
    for (int i = threadIdx.x; i < k_dim; i += 32) p[i] *= inv;
}

// proj: [tokens] rows of `stride` values with b at b_off and a at a_off (v_heads each);
// beta, g: [tokens, v_heads].
extern "C" __global__ void delta_gates(const float* __restrict__ proj, int stride, int b_off, int a_off,
                                       const float* __restrict__ neg_rate, const float* __restrict__ dt_bias,
                                       int v_heads, int tokens, float* __restrict__ beta, float* __restrict__ g) {
    pdl_entry();
    const size_t n = (size_t)tokens * v_heads;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t t = i / v_heads;
        const int h = (int)(i - t * v_heads);
        const float b = proj[t * stride + b_off + h], a = proj[t * stride + a_off + h] + dt_bias[h];
        beta[i] = 1.f / (1.f + expf(-b));
        g[i] = neg_rate[h] * (a > 20.f ? a : log1pf(expf(a)));
    }
}

// The gated delta rule per (row, value head h, columns 32 z .. 32 z + 31 of v): lane j keeps
// column j of the head's [k_dim][v_dim] state, so every product over k is its own loop and
// only q and k (shared by the lanes) pass through shared memory. Per token:
//   S *= exp(g);  m = S^T k;  d = beta (v - m);  S += k d^T;  o = S^T q
// in the CPU scan's order. q, k: rows of qk_stride values (key head kh at kh * k_dim); v:
// rows of v_stride (value head h at h * v_dim); out: [tokens, v_heads * v_dim]; ssm: the
// pool's states, [slot][v_heads][k_dim][v_dim]. Value head h reads key head h % k_heads when
// `tiled`, else h / (v_heads / k_heads). Rows of chunk_min tokens or more are left to
// delta_chunk. Grid (rows, v_heads, ceil(v_dim / 32)), one warp.
template <int KMAX>
__device__ __forceinline__ void delta_rule(const float* __restrict__ q, const float* __restrict__ k, int qk_stride,
                                           const float* __restrict__ v, int v_stride, const float* __restrict__ g,
                                           const float* __restrict__ beta, int k_heads, int v_heads, int k_dim,
                                           int v_dim, int tiled, const int* __restrict__ rows,
                                           const int* __restrict__ writes, int chunk_min,
                                           float* __restrict__ ssm, float* __restrict__ out) {
    pdl_entry();
    __shared__ float qs[KMAX], ks[KMAX];
    const int h = blockIdx.y, lane = threadIdx.x, j = blockIdx.z * 32 + lane;
    const bool active = j < v_dim;
    const int* row = rows + (size_t)blockIdx.x * ROW_FIELDS;
    const int start = row[0], len = row[1], read = row[2], end = row[4];
    if (len >= chunk_min) return;  // delta_chunk's row
    const int kh = tiled ? h % k_heads : h / (v_heads / k_heads);
    const size_t per_head = (size_t)k_dim * v_dim, per_slot = per_head * v_heads;
    float s[KMAX];
    const float* src = ssm + (size_t)(read >= 0 ? read : 0) * per_slot + h * per_head;
#pragma unroll
    for (int i = 0; i < KMAX; i++) s[i] = (read >= 0 && active && i < k_dim) ? src[(size_t)i * v_dim + j] : 0.f;
    int w = row[3];
    for (int n = 0; n < len; n++) {
        const size_t t = start + n;
        __syncwarp();
        for (int i = lane; i < k_dim; i += 32) {
            qs[i] = q[t * qk_stride + kh * k_dim + i];
            ks[i] = k[t * qk_stride + kh * k_dim + i];
        }
        __syncwarp();
        const float decay = expf(g[t * v_heads + h]), b = beta[t * v_heads + h];
        float m = 0.f;
#pragma unroll
        for (int i = 0; i < KMAX; i++)
            if (i < k_dim) {
                s[i] *= decay;
                m += ks[i] * s[i];
            }
        const float d = b * ((active ? v[t * v_stride + h * v_dim + j] : 0.f) - m);
        float o = 0.f;
#pragma unroll
        for (int i = 0; i < KMAX; i++)
            if (i < k_dim) {
                s[i] += ks[i] * d;
                o += qs[i] * s[i];
            }
        if (active) out[(t * v_heads + h) * v_dim + j] = o;
        for (; w < end && writes[2 * w] == n + 1; w++) {
            float* dst = ssm + (size_t)writes[2 * w + 1] * per_slot + h * per_head;
            if (active)
#pragma unroll
                for (int i = 0; i < KMAX; i++)
                    if (i < k_dim) dst[(size_t)i * v_dim + j] = s[i];
        }
    }
}

#define DELTA_RULE(KMAX)                                                                                          \
    extern "C" __global__ void __launch_bounds__(32) delta_rule_k##KMAX(                                         \
        const float* __restrict__ q, const float* __restrict__ k, int qk_stride, const float* __restrict__ v,    \
        int v_stride, const float* __restrict__ g, const float* __restrict__ beta, int k_heads, int v_heads,     \
        int k_dim, int v_dim, int tiled, const int* __restrict__ rows, const int* __restrict__ writes,           \
        int chunk_min, float* __restrict__ ssm, float* __restrict__ out) {                                       \
        delta_rule<KMAX>(q, k, qk_stride, v, v_stride, g, beta, k_heads, v_heads, k_dim, v_dim, tiled, rows,     \
                         writes, chunk_min, ssm, out);                                                           \
    }

DELTA_RULE(32)
DELTA_RULE(64)
DELTA_RULE(128)

#define DC 32           // tokens a chunk (delta_chunk)
#define DBV 32          // value columns a delta_chunk block
#define DC_THREADS 256  // threads a delta_chunk block

// acc[a][b] += sum over t < n of X[a * xr + t * xc] * (scale(t) * Y[t * yr + b * yc]): a register
// tile of a product of shared-memory matrices, any of them read transposed by its strides.
template <int RM, int RN, class Scale>
__device__ __forceinline__ void tile_mm(float (&acc)[RM][RN], const float* X, int xr, int xc, const float* Y, int yr,
                                        int yc, int n, Scale scale) {
    for (int t = 0; t < n; t++) {
        const float f = scale(t);
        float x[RM], y[RN];
#pragma unroll
        for (int a = 0; a < RM; a++) x[a] = X[a * xr + t * xc];
#pragma unroll
        for (int b = 0; b < RN; b++) y[b] = f * Y[t * yr + b * yc];
#pragma unroll
        for (int a = 0; a < RM; a++)
#pragma unroll
            for (int b = 0; b < RN; b++) acc[a][b] = fmaf(x[a], y[b], acc[a][b]);
    }
}

// The gated delta rule over the rows `chunked` lists, as the chunked scan of the header; the
// arguments as delta_rule's. Grid (listed rows, v_heads, ceil(v_dim / DBV)), DC_THREADS threads,
// delta_chunk_shared(KMAX) bytes of dynamic shared memory.
template <int KMAX>
__device__ __forceinline__ void delta_chunk(const float* __restrict__ q, const float* __restrict__ k, int qk_stride,
                                            const float* __restrict__ v, int v_stride, const float* __restrict__ g,
                                            const float* __restrict__ beta, int k_heads, int v_heads, int k_dim,
                                            int v_dim, int tiled, const int* __restrict__ rows,
                                            const int* __restrict__ writes, const int* __restrict__ chunked,
                                            float* __restrict__ ssm, float* __restrict__ out) {
    pdl_entry();
    constexpr int KS = KMAX + 1, PS = DC + 1, RM = KMAX / 32;
    extern __shared__ float smem[];
    float* Ks = smem;             // [DC][KS]
    float* Qs = Ks + DC * KS;     // [DC][KS]
    float* S = Qs + DC * KS;      // [KMAX][DBV]: S0's column tile
    float* A = S + KMAX * DBV;    // [DC][PS]
    float* P = A + DC * PS;       // [DC][PS]
    float* R = P + DC * PS;       // [DC][DBV]: R, then D
    float* O = R + DC * DBV;      // [DC][DBV]
    float* gam = O + DC * DBV;    // [DC]
    float* bet = gam + DC;        // [DC]
    const int tid = threadIdx.x, h = blockIdx.y, col0 = blockIdx.z * DBV;
    const int* row = rows + (size_t)chunked[blockIdx.x] * ROW_FIELDS;
    const int start = row[0], len = row[1], read = row[2], end = row[4];
    const int kh = tiled ? h % k_heads : h / (v_heads / k_heads);
    const size_t per_head = (size_t)k_dim * v_dim, per_slot = per_head * v_heads;
    float* head = ssm + h * per_head + col0;  // this block's columns of head h, slot 0
    for (int e = tid; e < KMAX * DBV; e += DC_THREADS) {
        const int kk = e / DBV, c = e - kk * DBV;
        S[e] = (read >= 0 && kk < k_dim && col0 + c < v_dim) ? head[read * per_slot + (size_t)kk * v_dim + c] : 0.f;
    }
    const auto one = [](int) { return 1.f; };
    int w = row[3];
    for (int base = 0; base < len; base += DC) {
        const int cnt = min(DC, len - base);
        const size_t t0 = (size_t)start + base;
        // 1. The chunk's keys and queries (zeros past its tokens and past k_dim), its gates.
        for (int e = tid; e < DC * KMAX; e += DC_THREADS) {
            const int i = e / KMAX, kk = e - i * KMAX;
            const bool in = i < cnt && kk < k_dim;
            const size_t at = (t0 + i) * qk_stride + (size_t)kh * k_dim + kk;
            Ks[i * KS + kk] = in ? k[at] : 0.f;
            Qs[i * KS + kk] = in ? q[at] : 0.f;
        }
        if (tid < DC) {
            float acc = 0.f;
            for (int l = 0; l <= tid && l < cnt; l++) acc += g[(t0 + l) * v_heads + h];
            gam[tid] = acc;
            bet[tid] = tid < cnt ? beta[(t0 + tid) * v_heads + h] : 0.f;
        }
        __syncthreads();
        // 2. K K^T, Q K^T, K S0, Q S0 (product tid / 64), each a 4x4 tile of a thread.
        {
            const int p = tid >> 6, i0 = ((tid >> 3) & 7) * 4, j0 = (tid & 7) * 4;
            const bool by_keys = p < 2;  // against K^T, else against S0
            float acc[4][4] = {};
            tile_mm<4, 4>(acc, ((p & 1) ? Qs : Ks) + i0 * KS, KS, 1, by_keys ? Ks + j0 * KS : S + j0,
                          by_keys ? 1 : DBV, by_keys ? KS : 1, k_dim, one);
#pragma unroll
            for (int a = 0; a < 4; a++)
#pragma unroll
                for (int b = 0; b < 4; b++) {
                    const int i = i0 + a, j = j0 + b;
                    const float x = acc[a][b];
                    if (p == 0) {
                        A[i * PS + j] = j < i ? bet[i] * expf(gam[i] - gam[j]) * x : 0.f;
                    } else if (p == 1) {
                        P[i * PS + j] = j <= i ? expf(gam[i] - gam[j]) * x : 0.f;
                    } else if (p == 2) {
                        const float vv = (i < cnt && col0 + j < v_dim) ? v[(t0 + i) * v_stride + h * v_dim + col0 + j]
                                                                       : 0.f;
                        R[i * DBV + j] = bet[i] * (vv - expf(gam[i]) * x);
                    } else {
                        O[i * DBV + j] = expf(gam[i]) * x;
                    }
                }
        }
        __syncthreads();
        // 3. (I + A) D = R by forward substitution, one lane a column; D replaces R.
        if (tid < DBV) {
            float d[DC];
#pragma unroll
            for (int i = 0; i < DC; i++) {
                float a0 = R[i * DBV + tid], a1 = 0.f;
#pragma unroll
                for (int j = 0; j + 1 < i; j += 2) {
                    a0 = fmaf(-A[i * PS + j], d[j], a0);
                    a1 = fmaf(-A[i * PS + j + 1], d[j + 1], a1);
                }
                if (i & 1) a0 = fmaf(-A[i * PS + i - 1], d[i - 1], a0);
                d[i] = a0 + a1;
                R[i * DBV + tid] = d[i];
            }
        }
        __syncthreads();
        // 4a. O += P D: row tid / 8, columns 4 (tid % 8) .. + 3.
        {
            const int i = tid >> 3, c0 = (tid & 7) * 4;
            float acc[1][4];
#pragma unroll
            for (int b = 0; b < 4; b++) acc[0][b] = O[i * DBV + c0 + b];
            tile_mm<1, 4>(acc, P + i * PS, 0, 1, R + c0, DBV, 1, i + 1, one);
            if (i < cnt)
#pragma unroll
                for (int b = 0; b < 4; b++)
                    if (col0 + c0 + b < v_dim) out[((t0 + i) * v_heads + h) * v_dim + col0 + c0 + b] = acc[0][b];
        }
        // 4b. The state after p tokens at each write inside the chunk, then at its end (the next
        // S0): rows r0 .. r0 + RM - 1, columns c0 .. c0 + 3 of the tile, each thread its own.
        {
            const int r0 = (tid >> 3) * RM, c0 = (tid & 7) * 4;
            float s0[RM][4];
#pragma unroll
            for (int a = 0; a < RM; a++)
#pragma unroll
                for (int b = 0; b < 4; b++) s0[a][b] = S[(r0 + a) * DBV + c0 + b];
            for (;;) {
                const int p = (w < end && writes[2 * w] <= base + cnt) ? writes[2 * w] - base : cnt;
                const float gp = gam[p - 1], decay = expf(gp);
                float acc[RM][4];
#pragma unroll
                for (int a = 0; a < RM; a++)
#pragma unroll
                    for (int b = 0; b < 4; b++) acc[a][b] = decay * s0[a][b];
                tile_mm<RM, 4>(acc, Ks + r0, 1, KS, R + c0, DBV, 1, p, [&](int j) { return expf(gp - gam[j]); });
                for (; w < end && writes[2 * w] == base + p; w++) {
                    float* dst = head + (size_t)writes[2 * w + 1] * per_slot;
#pragma unroll
                    for (int a = 0; a < RM; a++)
#pragma unroll
                        for (int b = 0; b < 4; b++)
                            if (r0 + a < k_dim && col0 + c0 + b < v_dim)
                                dst[(size_t)(r0 + a) * v_dim + c0 + b] = acc[a][b];
                }
                if (p == cnt) {
#pragma unroll
                    for (int a = 0; a < RM; a++)
#pragma unroll
                        for (int b = 0; b < 4; b++) S[(r0 + a) * DBV + c0 + b] = acc[a][b];
                    break;
                }
            }
        }
        __syncthreads();
    }
}

#define DELTA_CHUNK(KMAX)                                                                                         \
    extern "C" __global__ void __launch_bounds__(DC_THREADS) delta_chunk_k##KMAX(                                \
        const float* __restrict__ q, const float* __restrict__ k, int qk_stride, const float* __restrict__ v,    \
        int v_stride, const float* __restrict__ g, const float* __restrict__ beta, int k_heads, int v_heads,     \
        int k_dim, int v_dim, int tiled, const int* __restrict__ rows, const int* __restrict__ writes,           \
        const int* __restrict__ chunked, float* __restrict__ ssm, float* __restrict__ out) {                     \
        delta_chunk<KMAX>(q, k, qk_stride, v, v_stride, g, beta, k_heads, v_heads, k_dim, v_dim, tiled, rows,    \
                          writes, chunked, ssm, out);                                                            \
    }

DELTA_CHUNK(32)
DELTA_CHUNK(64)
DELTA_CHUNK(128)

// o: [tokens, v_heads * v_dim]; z: rows of z_stride values (head h at h * v_dim); w: [v_dim];
// out = bf16(silu(z) * rmsnorm(o) * w) per head. Grid (tokens, v_heads), one warp.
extern "C" __global__ void delta_out_norm(const float* __restrict__ o, const float* __restrict__ z, int z_stride,
                                          const float* __restrict__ w, int v_heads, int v_dim, float eps,
                                          bf16_t* __restrict__ out) {
    pdl_entry();
    const size_t t = blockIdx.x, at = (t * v_heads + blockIdx.y) * v_dim;
    const float* p = o + at;
    float ss = 0.f;
    for (int i = threadIdx.x; i < v_dim; i += 32) ss += p[i] * p[i];
    const float inv = 1.f / sqrtf(warp_sum(ss) / (float)v_dim + eps);
    const float* zr = z + t * z_stride + (size_t)blockIdx.y * v_dim;
    for (int i = threadIdx.x; i < v_dim; i += 32) out[at + i] = f2bf(silu(zr[i]) * (p[i] * (inv * w[i])));
}
