// FP8 (e4m3) routed experts: the row type `e4m3_rows` through which moe_gemm.cuh's kernels
// (`MOE_KERNELS(e4m3_rows)`, module `moe_fp8`) read a stacked FP8 expert matrix. Appended
// after quant.cuh and moe_gemm.cuh; sm_89 and up (the host refuses FP8 experts below).
//
// A row of k values (k % 16 == 0) is its scale runs, then its codes: ceil(k / run) f32 scales,
// zero-padded to whole 16-byte words, then k e4m3 codes; value c is e4m3(code c) · scale[c /
// run]. The run is a power of two of at least 16 values (a row with one scale: a run of at
// least k). `fmt` says both: bits 0-4 log2(run / 16), bits 5 and up the scale words (16 bytes
// each) ahead of the codes; ops/moe.rs (`Fp8Rows`) lays the rows out and computes it.
//
// A unit is 16 values: one 16-byte load of codes and the unit's scale. decode8 widens the
// codes exactly (e4m3 → f16 by the hardware conversion, → f32) with a = the scale and b = 0, so
// a dequantized value is the single rounding of e4m3 · scale, the CPU's dequantization.

// Two e4m3 codes (the low byte first) as f32, exactly.
__device__ __forceinline__ void e4m3x2_to_f32(unsigned pair, float& lo, float& hi) {
#if __CUDA_ARCH__ >= 890
    unsigned h2;
    const unsigned short p = (unsigned short)pair;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(p));
    lo = half_to_float((unsigned short)(h2 & 0xffffu));
    hi = half_to_float((unsigned short)(h2 >> 16));
#else
    __trap();
    lo = hi = 0.f;
#endif
}

struct e4m3_rows {
    enum { MIN = 0, UNIT = 16 };
    struct Raw { uint4 v; float s; };
    static __device__ __forceinline__ u64 row_bytes(int k, int fmt) { return (u64)(16 * (fmt >> 5)) + (u64)k; }
    static __device__ __forceinline__ void load(const u8* row, int u, Raw& r, int fmt) {
        r.s = ((const float*)row)[u >> (fmt & 31)];
        r.v = ((const uint4*)(row + 16 * (fmt >> 5)))[u];
    }
    static __device__ __forceinline__ void decode8(const Raw& r, int c, float* q, float& a, float& bb) {
        const unsigned w0 = c == 0 ? r.v.x : r.v.z, w1 = c == 0 ? r.v.y : r.v.w;
        e4m3x2_to_f32(w0 & 0xffffu, q[0], q[1]);
        e4m3x2_to_f32(w0 >> 16, q[2], q[3]);
        e4m3x2_to_f32(w1 & 0xffffu, q[4], q[5]);
        e4m3x2_to_f32(w1 >> 16, q[6], q[7]);
        a = r.s;
        bb = 0.f;
    }
};
