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

// Whole KV blocks between the pools and a staging buffer in device memory (`kv_copy.rs`): the
// block copies to and from host memory move one contiguous run of bytes per block over the
// bus and scatter or gather it here, instead of one small copy per layer pool. A block of a KV
// group is `n_regions` regions (each layer's K and V pool parts, in the order of a whole
// block's bytes); region r of pool block b starts at `base + b * stride`, `len` bytes, at
// `offset` in the block's staged bytes. One CTA moves one region of one block.
struct KvRegion {
    u64 base, stride, len, offset;
};

#define KV_MOVE_MAX_BLOCKS 256
struct KvMoveBlocks {
    unsigned int id[KV_MOVE_MAX_BLOCKS];
};

extern "C" __global__ void kv_blocks_move(const KvRegion* __restrict__ regions, u64 stage, u64 block_bytes,
                                          KvMoveBlocks blocks, int to_pool) {
    const KvRegion r = regions[blockIdx.x];
    unsigned char* pool = (unsigned char*)(r.base + (u64)blocks.id[blockIdx.y] * r.stride);
    unsigned char* staged = (unsigned char*)(stage + (u64)blockIdx.y * block_bytes + r.offset);
    const unsigned char* src = to_pool ? staged : pool;
    unsigned char* dst = to_pool ? pool : staged;
    if ((((u64)src | (u64)dst | r.len) & 15) == 0) {
        const uint4* s = (const uint4*)src;
        uint4* d = (uint4*)dst;
        for (u64 i = threadIdx.x; i < r.len / 16; i += blockDim.x) d[i] = s[i];
    } else {
        for (u64 i = threadIdx.x; i < r.len; i += blockDim.x) dst[i] = src[i];
    }
}
