// RMSNorm over rows of `d` values: out = x / sqrt(mean(x²) + eps) * (offset + w), f32 math.
// With `residual` non-null the row is first `residual += x` (stored as bf16) and the stored sum
// is normalized: the fused residual add of a pre-norm block. Grid: one block per row.

extern "C" __global__ void rms_norm(const bf16_t* __restrict__ x, bf16_t* __restrict__ residual,
                                    const float* __restrict__ w, bf16_t* __restrict__ out, int d, float eps,
                                    float offset) {
    __shared__ float scratch[32];
    size_t row = blockIdx.x;
    const bf16_t* xr = x + row * d;
    bf16_t* orow = out + row * d;
    float ss = 0.f;
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
