// Shared by csrc/gemv_mma.cu and csrc/qgemv_mma.cu (kernels/qgemv_mma.py: cuda_source prepends it, after the
// kernel's #defines): the 16-bit float conversions of the activation dtype (IS_FP16: f16, else bf16),
// mma.m16n8k16 with fp32 accumulators, and the RMSNorm a kernel may compute before its product (NORM: norm_rows).
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

__device__ __forceinline__ float to_f32(u16 h) {
#if IS_FP16
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    return __uint_as_float(((u32)h) << 16);
#endif
}

__device__ __forceinline__ u16 from_f32(float f) {
    u16 h;
#if IS_FP16
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}

__device__ __forceinline__ float round_trip(float f) { return to_f32(from_f32(f)); }

__device__ __forceinline__ void mma(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if IS_FP16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// NORM (the kernels' x is an RMSNorm's input, normalized by each block into shared memory first: norm_rows), with
// HAS_RES (a residual added first), NORM_K (K) and NORM_ROWS (rows per block that hold x: at most 8 * MT).
#ifndef NORM
#define NORM 0
#endif
#ifndef HAS_RES
#define HAS_RES 0
#endif
#if NORM
// Each row padded by 64 bytes: a warp's fragment loads (rows g, 16 or 32 bytes at 8 t / 16 t) then fall on other
// banks for rows g and g + 1.
#define XS_STRIDE (NORM_K + 32)
#define XS_BYTES (NORM_ROWS * XS_STRIDE * 2)
// the block's shared memory: the normalized rows, then (after the products) the reduction's partial sums
#define RED_BYTES (WARPS * CT * MT * 4 * 32 * 4)
#define SMEM_BYTES (XS_BYTES > RED_BYTES ? XS_BYTES : RED_BYTES)
#endif

// x's 16 bytes / 2 bytes at p: from global memory, or (NORM) from the block's normalized rows in shared memory.
__device__ __forceinline__ uint4 load_x(const u16* p) {
#if NORM
    return *(const uint4*)p;
#else
    return __ldg((const uint4*)p);
#endif
}

__device__ __forceinline__ u16 load_x1(const u16* p) {
#if NORM
    return *p;
#else
    return __ldg(p);
#endif
}

#if NORM
__device__ __forceinline__ u32 pack2(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }

// Eight 16-bit values of a uint4 through f, each result rounded to the activation dtype.
template <typename F>
__device__ __forceinline__ uint4 map8(uint4 a, uint4 b, F f) {
    const u32 av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
    u32 r[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        r[i] = pack2(from_f32(f(to_f32((u16)(av[i] & 0xffff)), to_f32((u16)(bv[i] & 0xffff)))),
                     from_f32(f(to_f32((u16)(av[i] >> 16)), to_f32((u16)(bv[i] >> 16)))));
    return make_uint4(r[0], r[1], r[2], r[3]);
}

__device__ __forceinline__ float sum_squares(uint4 a) {
    const u32 av[4] = {a.x, a.y, a.z, a.w};
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float lo = to_f32((u16)(av[i] & 0xffff)), hi = to_f32((u16)(av[i] >> 16));
        s += lo * lo + hi * hi;
    }
    return s;
}

// The block's rows m0.. (at most NORM_ROWS) of the RMSNorm before this product, into smem (returned as rows), with
// kernels/norm.py's numbers: h = x (+ res) rounded, rstd = rsqrt(mean(h^2) + eps), y = round(round(h * rstd) * w).
// Each warp takes whole rows (its lanes 8 channels at a time, the squares summed across lanes); the blocks of
// column 0 also store h (new_res) and y (normed), the norm's outputs.
__device__ __forceinline__ u16 (*norm_rows(unsigned char* smem, const u16* __restrict__ x,
                                            const u16* __restrict__ res, const u16* __restrict__ nw,
                                            u16* __restrict__ normed, u16* __restrict__ new_res, int m0, int M,
                                            int stride_x, int stride_r, int stride_n, double eps_d, int warp,
                                            int lane))[XS_STRIDE] {
    u16 (*xs)[XS_STRIDE] = reinterpret_cast<u16 (*)[XS_STRIDE]>(smem);
    const int rows = min(NORM_ROWS, M - m0);
    const float eps = (float)eps_d;
    const bool store = blockIdx.x == 0;
    for (int r = warp; r < rows; r += WARPS) {
        const u64 m = (u64)(m0 + r);
        float ss = 0.f;
        for (int v = lane; v < NORM_K / 8; v += 32) {
            uint4 h = __ldg((const uint4*)(x + m * stride_x + 8 * v));
#if HAS_RES
            h = map8(h, __ldg((const uint4*)(res + m * stride_r + 8 * v)), [](float a, float b) { return a + b; });
            if (store) *(uint4*)(new_res + m * stride_r + 8 * v) = h;
#endif
            ss += sum_squares(h);
            *(uint4*)(&xs[r][8 * v]) = h;
        }
#pragma unroll
        for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        const float rstd = rsqrtf(ss / NORM_K + eps);
        for (int v = lane; v < NORM_K / 8; v += 32) {  // (the same lane wrote these channels above)
            const uint4 y = map8(*(const uint4*)(&xs[r][8 * v]), __ldg((const uint4*)(nw + 8 * v)),
                                 [rstd](float h, float w) { return round_trip(h * rstd) * w; });
            *(uint4*)(&xs[r][8 * v]) = y;
            if (store) *(uint4*)(normed + m * stride_n + 8 * v) = y;
        }
    }
    __syncthreads();
    return xs;
}
#endif
