// Shared by csrc/gemv_mma.cu and csrc/qgemv_mma.cu (kernels/qgemv_mma.py: cuda_source prepends it, after the
// kernel's #defines): the 16-bit float conversions of the activation dtype (IS_FP16: f16, else bf16) and
// mma.m16n8k16 with fp32 accumulators.
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
