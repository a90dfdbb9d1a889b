// Random weights generated on the device (synthetic benchmark models): out[i] uniform in
// [-scale, scale), a pure function of (seed, i) through the splitmix64 finalizer, so a model
// is the same on every run and no weights cross the bus. Grid-stride over n.

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

extern "C" __global__ void random_bf16(bf16_t* __restrict__ out, u64 n, u64 seed, float scale) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride) {
        const u64 r = splitmix64(seed ^ splitmix64(i));
        const float u = (float)(r >> 40) * (1.f / 16777216.f);  // [0, 1), 24 bits
        out[i] = f2bf((2.f * u - 1.f) * scale);
    }
}
