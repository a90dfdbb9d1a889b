// Device-to-device copy in 16-byte words (the bandwidth ceiling's kernel; also a plain copy).
// Grid-stride over `words`, four independent loads in flight per thread before the stores.

extern "C" __global__ void copy_words(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t words) {
    pdl_entry();
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < words; i += 4 * stride) {
        uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
        dst[i] = a;
        dst[i + stride] = b;
        dst[i + 2 * stride] = c;
        dst[i + 3 * stride] = d;
    }
    for (; i < words; i += stride) dst[i] = src[i];
}
