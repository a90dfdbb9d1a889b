// Embedding gather: one table row per token id, scaled, written as bf16 activations.
// Grid: one block per token. An id outside the vocabulary writes zeros (the host checks ids
// before they reach the device; this only keeps a bad id from reading out of bounds).

extern "C" __global__ void embedding_bf16(const bf16_t* __restrict__ table, const unsigned* __restrict__ ids,
                                          bf16_t* __restrict__ out, int dim, int vocab, float scale) {
    pdl_entry();
    int t = blockIdx.x;
    unsigned id = ids[t];
    bf16_t* dst = out + (size_t)t * dim;
    if (id >= (unsigned)vocab) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = 0;
        return;
    }
    const bf16_t* src = table + (size_t)id * dim;
    if (scale == 1.f) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = src[i];
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = f2bf(bf2f(src[i]) * scale);
    }
}

extern "C" __global__ void embedding_f32(const float* __restrict__ table, const unsigned* __restrict__ ids,
                                         bf16_t* __restrict__ out, int dim, int vocab, float scale) {
    pdl_entry();
    int t = blockIdx.x;
    unsigned id = ids[t];
    bf16_t* dst = out + (size_t)t * dim;
    if (id >= (unsigned)vocab) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = 0;
        return;
    }
    const float* src = table + (size_t)id * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = f2bf(src[i] * scale);
}
