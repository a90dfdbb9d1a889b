// FP8 (e4m3) weight matrices beside their skinny GEMM (gemv.cu's `fp8_gemv_*`): a matrix is
// its codes W[rows, k] (one byte each) and one f32 scale per row and run of `cb` columns
// (`ncb` a row), w[r, c] = e4m3(W[r, c]) · scales[r · ncb + c / cb].
//
// - fp8_quantize_rows: rows of bf16 values to codes with one scale a row, max|x| / 448 (1 for
//   an all-zero row), each code e4m3(x / scale) rounded to nearest even: the per-token
//   quantization of activations before cuBLASLt's FP8 GEMM, and the per-channel quantization
//   of a bf16 weight (`--quantization fp8`), a dense matrix's or an expert matrix's rows (row
//   r's codes at codes + r · code_ld bytes, its scale at scales[r · scale_ld]: moe_fp8.cuh's
//   rows interleave them). A block per row; codes 2-byte pairs.
// - fp8_dequant_rows: rows to bf16 times `mul`, optionally gathered by `ids` (an id ≥ rows
//   gives zeros): an embedding lookup, and the dequantize-then-GEMM path of matrices whose
//   scales change along a row. A block per output row.
// - fp8_add_bias: y[t, j] += bias[j] over bf16 rows of n (the bias of cuBLASLt's FP8 GEMM,
//   which takes no bias epilogue with scaled inputs); grid-stride.
// - fp8_random: codes of uniform values in [-448, 448) and one scale a row, amp / 448, so the
//   weights lie in [-amp, amp] (synthetic models), rows strided as fp8_quantize_rows writes
//   them; grid-stride over code pairs.

#define F8_THREADS 256

extern "C" __global__ void __launch_bounds__(F8_THREADS)
    fp8_quantize_rows(const bf16_t* __restrict__ x, unsigned char* __restrict__ codes, float* __restrict__ scales,
                      int k, u64 code_ld, u64 scale_ld) {
    __shared__ float scratch[32];
    pdl_entry();
    const bf16_t* xr = x + (u64)blockIdx.x * k;
    float amax = 0.f;
    for (int c = threadIdx.x; c < k; c += F8_THREADS) amax = fmaxf(amax, fabsf(bf2f(xr[c])));
    amax = block_max(amax, scratch);
    const float s = amax > 0.f ? __fdiv_rn(amax, FP8_MAX) : 1.f;
    unsigned short* out = (unsigned short*)(codes + (u64)blockIdx.x * code_ld);
    for (int c = threadIdx.x; 2 * c < k; c += F8_THREADS)
        out[c] = (unsigned short)e4m3_pair(__fdiv_rn(bf2f(xr[2 * c]), s), __fdiv_rn(bf2f(xr[2 * c + 1]), s));
    if (threadIdx.x == 0) scales[(u64)blockIdx.x * scale_ld] = s;
}

extern "C" __global__ void __launch_bounds__(F8_THREADS)
    fp8_dequant_rows(const unsigned char* __restrict__ codes, const float* __restrict__ scales, int ncb, int cb,
                     const unsigned* __restrict__ ids, bf16_t* __restrict__ out, int k, int rows, float mul) {
    pdl_entry();
    const unsigned src = ids != nullptr ? ids[blockIdx.x] : blockIdx.x;
    bf16_t* o = out + (u64)blockIdx.x * k;
    if (src >= (unsigned)rows) {
        for (int c = threadIdx.x; c < k; c += F8_THREADS) o[c] = 0;
        return;
    }
    const unsigned char* w = codes + (u64)src * k;
    const float* s = scales + (u64)src * ncb;
    for (int c = threadIdx.x; c < k; c += F8_THREADS)
        o[c] = f2bf(e4m3_bits_to_f(w[c]) * 0x1p120f * s[c / cb] * mul);
}

extern "C" __global__ void fp8_random(unsigned char* __restrict__ codes, float* __restrict__ scales, int rows, int k,
                                      u64 code_ld, u64 scale_ld, u64 seed, float amp) {
    pdl_entry();
    const u64 half_k = (u64)k / 2, pairs = (u64)rows * half_k, stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < pairs; i += stride) {
        const u64 r = splitmix64(seed ^ splitmix64(i));
        const float a = (float)(r >> 40) * (1.f / 16777216.f), b = (float)(r & 0xffffffu) * (1.f / 16777216.f);
        const u64 row = i / half_k, pair = i - row * half_k;
        unsigned short* out = (unsigned short*)(codes + row * code_ld);
        out[pair] = (unsigned short)e4m3_pair((2.f * a - 1.f) * FP8_MAX, (2.f * b - 1.f) * FP8_MAX);
    }
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (u64)rows; i += stride)
        scales[i * scale_ld] = amp / FP8_MAX;
}

extern "C" __global__ void fp8_add_bias(bf16_t* __restrict__ y, const bf16_t* __restrict__ bias, int n, u64 total) {
    pdl_entry();
    const u64 stride = (u64)gridDim.x * blockDim.x;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += stride)
        y[i] = f2bf(bf2f(y[i]) + bf2f(bias[i % n]));
}
