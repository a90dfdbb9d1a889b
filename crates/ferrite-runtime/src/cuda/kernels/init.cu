// Random weights generated on the device (synthetic benchmark models): out[i] uniform in
// [-scale, scale), a pure function of (seed, i) through splitmix64 (common.cuh), so a model
// is the same on every run and no weights cross the bus. Grid-stride over n.

extern "C" __global__ void random_bf16(bf16_t* __restrict__ out, u64 n, u64 seed, float scale) {
    pdl_entry();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride) {
        const u64 r = splitmix64(seed ^ splitmix64(i));
        const float u = (float)(r >> 40) * (1.f / 16777216.f);  // [0, 1), 24 bits
        out[i] = f2bf((2.f * u - 1.f) * scale);
    }
}
