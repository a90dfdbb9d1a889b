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
//   per (row, value head, 32 columns of v) with the state's columns in registers;
// - delta_out_norm: per-head RMSNorm of the output times silu(z), to bf16.

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
// `tiled`, else h / (v_heads / k_heads). Grid (rows, v_heads, ceil(v_dim / 32)), one warp.
template <int KMAX>
__device__ __forceinline__ void delta_rule(const float* __restrict__ q, const float* __restrict__ k, int qk_stride,
                                           const float* __restrict__ v, int v_stride, const float* __restrict__ g,
                                           const float* __restrict__ beta, int k_heads, int v_heads, int k_dim,
                                           int v_dim, int tiled, const int* __restrict__ rows,
                                           const int* __restrict__ writes, float* __restrict__ ssm,
                                           float* __restrict__ out) {
    pdl_entry();
    __shared__ float qs[KMAX], ks[KMAX];
    const int h = blockIdx.y, lane = threadIdx.x, j = blockIdx.z * 32 + lane;
    const bool active = j < v_dim;
    const int* row = rows + (size_t)blockIdx.x * ROW_FIELDS;
    const int start = row[0], len = row[1], read = row[2], end = row[4];
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
        float* __restrict__ ssm, float* __restrict__ out) {                                                      \
        delta_rule<KMAX>(q, k, qk_stride, v, v_stride, g, beta, k_heads, v_heads, k_dim, v_dim, tiled, rows,     \
                         writes, ssm, out);                                                                      \
    }

DELTA_RULE(32)
DELTA_RULE(64)
DELTA_RULE(128)

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
