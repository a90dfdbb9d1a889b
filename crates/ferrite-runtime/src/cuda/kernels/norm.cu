// RMSNorm over rows of `d` values: out = x / sqrt(mean(x²) + eps) * (offset + w), f32 math.
// With `residual` non-null the row is first `residual += x` (stored as bf16) and the stored sum
// is normalized: the fused residual add of a pre-norm block. Grid: one block per row.

// A row of up to NORM_VALS values a thread stays in registers (with its weights) between the
// sum of squares and the scaling: one memory round trip instead of two.
#define NORM_VALS 8

extern "C" __global__ void rms_norm(const bf16_t* __restrict__ x, bf16_t* __restrict__ residual,
                                    const float* __restrict__ w, bf16_t* __restrict__ out, int d, float eps,
                                    float offset) {
    pdl_entry();
    __shared__ float scratch[32];
    size_t row = blockIdx.x;
    const bf16_t* xr = x + row * d;
    bf16_t* orow = out + row * d;
    float ss = 0.f;
    if (d <= NORM_VALS * (int)blockDim.x) {
        float v[NORM_VALS], wv[NORM_VALS];
#pragma unroll
        for (int j = 0; j < NORM_VALS; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < d) {
                float a = bf2f(xr[i]);
                if (residual != nullptr) {
                    const bf16_t sum = f2bf(a + bf2f(residual[row * d + i]));
                    residual[row * d + i] = sum;
                    a = bf2f(sum);
                }
                v[j] = a;
                wv[j] = w[i];
                ss += a * a;
            }
        }
        const float inv = rsqrtf(block_sum(ss, scratch) / (float)d + eps);
#pragma unroll
        for (int j = 0; j < NORM_VALS; j++) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < d) orow[i] = f2bf(v[j] * inv * (offset + wv[j]));
        }
        return;
    }
    if (residual != nullptr) {
        bf16_t* rr = residual + row * d;
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            bf16_t s = f2bf(bf2f(xr[i]) + bf2f(rr[i]));
            rr[i] = s;
            float v = bf2f(s);
            ss += v * v;
        }
        float inv = rsqrtf(block_sum(ss, scratch) / (float)d + eps);
        for (int i = threadIdx.x; i < d; i += blockDim.x) orow[i] = f2bf(bf2f(rr[i]) * inv * (offset + w[i]));
    } else {
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            float v = bf2f(xr[i]);
            ss += v * v;
        }
        float inv = rsqrtf(block_sum(ss, scratch) / (float)d + eps);
        for (int i = threadIdx.x; i < d; i += blockDim.x) orow[i] = f2bf(bf2f(xr[i]) * inv * (offset + w[i]));
    }
}
