// Few-row (1..8) 4-bit weight-only GEMV on the tensor cores (kernels/qgemv_mma.py compiles it with NVRTC).
//
// Swap-AB: out^T[n, m] = W[n, k] x^T[k, m], one mma.m16n8k16 per 16 output columns x 16 channels: the 8 columns of
// the MMA's B operand are the (up to 8) input rows, so 1 row costs what 8 cost. The weights are repacked at load
// (kernels/qgemv_mma.py: to_mma_layout) so that one 16-byte load per lane holds its A fragments for 4 MMAs (64
// channels: one "chunk"), nibbles placed so that one lop3 makes a bf16x2 / f16x2 pair (OFF + q) exactly; for f16
// (10 mantissa bits) column n_hi's fragments take the high nibble of a byte in place, (OFF + 16 q), which saves two
// shifts per word (bf16's 7 mantissa bits cannot hold it). One paired add of -(OFF + zero) (-(OFF + 16 zero)) makes
// the MMA's A operand q - zero (16 (q - zero)) exactly: the products are exact, sums fp32, and a 16x column's scale
// is divided by 16 (a power of two: the result is the same). The group scale multiplies each unit's sum.
//
// Compile-time parameters (#define before this file): WARPS, UNIT (chunks per unit; a unit never crosses a group),
// DEPTH (units of a warp in flight: a ring of registers, all asked for before the wait on the previous kernel),
// MT (row tiles of 8 per block: a block takes 8 * MT rows, blockIdx.y the row block), CT (column tiles per block:
// each x fragment a warp loads serves CT tiles, so a block re-reads x for CT * 16 columns, not 16), IS_FP16,
// HAS_PERM, HAS_BIAS. csrc/mma_common.cuh comes before this file (to_f32, from_f32, mma).
#ifndef DEPTH
#define DEPTH 2
#endif
#ifndef CT
#define CT 1
#endif
#if IS_FP16
#define MAGIC 0x64006400u  // f16 1024.0 in each half: 1024 + q and 1024 + 16 q are exact
#define OFF 1024.0f
#define HI_MULT 16.0f      // column n_hi's nibbles used in place, 4 bits up
#else
#define MAGIC 0x43004300u  // bf16 128.0 in each half: 128 + q is exact
#define OFF 128.0f
#define HI_MULT 1.0f
#endif

__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 b, u32 c) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// a + b per half, rounded once: exact here ((OFF + q) - (OFF + zero) is an integer in [-15, 15], times HI_MULT)
__device__ __forceinline__ u32 add_pair(u32 a, u32 b) {
    u32 r;
#if IS_FP16
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#else
    asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
#endif
    return r;
}

// -(OFF + mult * zero) of a row, in both halves of a register (exact: zero is an integer below 16, mult 1 or 16).
__device__ __forceinline__ u32 neg_zero_pair(u16 zbits, float mult) {
    u16 h = from_f32(-(OFF + mult * to_f32(zbits)));
    return ((u32)h << 16) | h;
}

// One unit's weights (UNIT 16-byte words of the lane per column tile), and the scales and zeros of its group for
// the lane's two columns of each of the block's CT tiles.
struct Unit {
    uint4 w[CT][UNIT];
    u16 s_lo[CT], s_hi[CT], z_lo[CT], z_hi[CT];
};

// wbase: the block's first column tile (tile ct's words follow at ct * tile_words); n_lo: the lane's column of it
__device__ __forceinline__ void load_unit(Unit& un, const uint4* wbase, u64 tile_words, const u16* scales,
                                          const u16* zeros, int u, int group_shift, int N, int n_lo) {
#pragma unroll
    for (int ct = 0; ct < CT; ct++)
#pragma unroll
        for (int i = 0; i < UNIT; i++) un.w[ct][i] = __ldg(wbase + ct * tile_words + (u64)(u * UNIT + i) * 32);
    // the unit's group: chunks >> group_shift, or chunks / -group_shift where a group is not a power-of-two chunks
    const int c = u * UNIT;
    const u64 row = (u64)(group_shift >= 0 ? c >> group_shift : c / -group_shift) * N;
#pragma unroll
    for (int ct = 0; ct < CT; ct++) {
        const u64 n = row + n_lo + 16 * ct;
        un.s_lo[ct] = scales[n]; un.s_hi[ct] = scales[n + 8];
        un.z_lo[ct] = zeros[n]; un.z_hi[ct] = zeros[n + 8];
    }
}

// acc += one unit's product: its UNIT chunks against the lane's x of every row tile, the group scale applied once.
__device__ __forceinline__ void unit_product(float (&acc)[CT][MT][4], const Unit& un, int u,
                                             const u16* const (&xrow)[MT], const int* __restrict__ perm, int t) {
    u32 za[CT], zb[CT];
    float d[CT][MT][4];
#pragma unroll
    for (int ct = 0; ct < CT; ct++) {
        za[ct] = neg_zero_pair(un.z_lo[ct], 1.f);
        zb[ct] = neg_zero_pair(un.z_hi[ct], HI_MULT);
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++) d[ct][mt][e] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < UNIT; i++) {
        const int c = u * UNIT + i;
        // the lane's 16 channels [c * 64 + 16 t, +16) of its row of each row tile
        u32 xr[MT][8];
#if HAS_PERM
        const int* p = perm + c * 64 + 16 * t;
        int pk[16];
#pragma unroll
        for (int e = 0; e < 16; e++) pk[e] = __ldg(p + e);
#endif
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
#if HAS_PERM
#pragma unroll
            for (int e = 0; e < 8; e++)
                xr[mt][e] = (u32)__ldg(xrow[mt] + pk[2 * e]) | ((u32)__ldg(xrow[mt] + pk[2 * e + 1]) << 16);
#else
            const uint4* xv = (const uint4*)xrow[mt] + c * 8;  // xrow[mt] includes the lane's 16 t
            const uint4 v0 = __ldg(xv), v1 = __ldg(xv + 1);
            xr[mt][0] = v0.x; xr[mt][1] = v0.y; xr[mt][2] = v0.z; xr[mt][3] = v0.w;
            xr[mt][4] = v1.x; xr[mt][5] = v1.y; xr[mt][6] = v1.z; xr[mt][7] = v1.w;
#endif
        }
#pragma unroll
        for (int ct = 0; ct < CT; ct++) {
            const u32 words[4] = {un.w[ct][i].x, un.w[ct][i].y, un.w[ct][i].z, un.w[ct][i].w};
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const u32 w = words[j];
                // A: a0 / a2 column n_lo's (row g of the MMA) q - zero, a1 / a3 column n_hi's HI_MULT (q - zero)
                const u32 w8 = w >> 8;
                const u32 a0 = add_pair(lop3_and_or(w, 0x000F000Fu, MAGIC), za[ct]);
                const u32 a2 = add_pair(lop3_and_or(w8, 0x000F000Fu, MAGIC), za[ct]);
#if IS_FP16
                const u32 a1 = add_pair(lop3_and_or(w, 0x00F000F0u, MAGIC), zb[ct]);
                const u32 a3 = add_pair(lop3_and_or(w8, 0x00F000F0u, MAGIC), zb[ct]);
#else
                const u32 a1 = add_pair(lop3_and_or(w >> 4, 0x000F000Fu, MAGIC), zb[ct]);
                const u32 a3 = add_pair(lop3_and_or(w >> 12, 0x000F000Fu, MAGIC), zb[ct]);
#endif
#pragma unroll
                for (int mt = 0; mt < MT; mt++) mma(d[ct][mt], a0, a1, a2, a3, xr[mt][2 * j], xr[mt][2 * j + 1]);
            }
        }
    }
#pragma unroll
    for (int ct = 0; ct < CT; ct++) {
        const float sl = to_f32(un.s_lo[ct]), sh = to_f32(un.s_hi[ct]) * (1.0f / HI_MULT);
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            acc[ct][mt][0] += sl * d[ct][mt][0]; acc[ct][mt][1] += sl * d[ct][mt][1];
            acc[ct][mt][2] += sh * d[ct][mt][2]; acc[ct][mt][3] += sh * d[ct][mt][3];
        }
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
qgemv_mma(const uint4* __restrict__ qw, const u16* __restrict__ x, const u16* __restrict__ scales,
          const u16* __restrict__ zeros, const int* __restrict__ perm, const u16* __restrict__ bias,
          u16* __restrict__ out, int M, int N, int K, int stride_x, int stride_o, int group_shift) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nt = blockIdx.x * CT;  // the block's first column tile
    const int m0 = blockIdx.y * 8 * MT;
    const int chunks = K >> 6;
    const int units = chunks / UNIT;
    const int n_lo = nt * 16 + g;
    // this lane's 16-byte word group of chunk c: qw[(nt * chunks + c) * 32 + lane]; tile nt + ct's at ct * tile_words
    const u64 tile_words = (u64)chunks * 32;
    const uint4* wbase = qw + (u64)nt * tile_words + lane;

    // DEPTH units of this warp in flight (u = warp + d * WARPS in slot d), asked for before the previous kernel ends
    Unit buf[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH; d++)
        if (warp + d * WARPS < units)
            load_unit(buf[d], wbase, tile_words, scales, zeros, warp + d * WARPS, group_shift, N, n_lo);
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output
#endif
    float acc[CT][MT][4];
    // the lane's row of each row tile: a row past M reads row 0, and its MMA column (independent of the others) is
    // never stored
    const u16* xrow[MT];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int m = m0 + 8 * mt + g;
        xrow[mt] = x + (u64)(m < M ? m : 0) * stride_x + (HAS_PERM ? 0 : 16 * t);
#pragma unroll
        for (int ct = 0; ct < CT; ct++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[ct][mt][e] = 0.f;
    }
    for (int u0 = warp; u0 < units; u0 += DEPTH * WARPS) {
#pragma unroll
        for (int d = 0; d < DEPTH; d++) {
            const int u = u0 + d * WARPS;
            if (u < units) {
                unit_product(acc, buf[d], u, xrow, perm, t);
                // the slot just used takes the unit DEPTH steps ahead: DEPTH - 1 stay in flight meanwhile
                if (u + DEPTH * WARPS < units)
                    load_unit(buf[d], wbase, tile_words, scales, zeros, u + DEPTH * WARPS, group_shift, N, n_lo);
            }
        }
    }
    // the warps' partial sums (each warp took every WARPS-th unit) added in warp order: deterministic
    __shared__ float red[WARPS][CT * MT * 4][32];
#pragma unroll
    for (int ct = 0; ct < CT; ct++)
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++) red[warp][(ct * MT + mt) * 4 + e][lane] = acc[ct][mt][e];
    __syncthreads();
    // warp w finishes entries w, w + WARPS, ... of the 4 * MT * CT per lane
    for (int idx = warp; idx < CT * MT * 4; idx += WARPS) {
        float v = red[0][idx][lane];
#pragma unroll
        for (int w2 = 1; w2 < WARPS; w2++) v += red[w2][idx][lane];
        // c0: (column n_lo, row 2t), c1: (n_lo, 2t + 1), c2: (n_hi, 2t), c3: (n_hi, 2t + 1) of entry idx / 4's
        // column tile idx / (4 MT) and row tile idx / 4 % MT
        const int e = idx & 3;
        const int n = n_lo + 16 * (idx / (4 * MT)) + ((e < 2) ? 0 : 8);
        const int m = m0 + 8 * ((idx >> 2) % MT) + 2 * t + (e & 1);
        if (m < M) {
#if HAS_BIAS
            v += to_f32(bias[n]);
#endif
            out[(u64)m * stride_o + n] = from_f32(v);
        }
    }
}

// The dense weight [N, K] (layout-channel order, the activation dtype) of an mma-layout layer: the path for many
// rows (dequantize once, then one cuBLAS GEMM). One warp per (column tile, chunk): each lane writes 16
// consecutive channels of its two rows (g, g + 8) as two 32-byte runs.
extern "C" __global__ void __launch_bounds__(128)
dequant_mma(const uint4* __restrict__ qw, const u16* __restrict__ scales, const u16* __restrict__ zeros,
            u16* __restrict__ out, int N, int K, int group_chunks) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int chunks = K >> 6;
    const int id = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (id >= (N >> 4) * chunks) return;
    const int nt = id / chunks, c = id % chunks;
    const uint4 w4 = __ldg(qw + (u64)id * 32 + lane);
    const u32 words[4] = {w4.x, w4.y, w4.z, w4.w};
    const int grp = c / group_chunks;
#pragma unroll
    for (int h = 0; h < 2; h++) {  // row g (nibbles 0, 4, 2, 6 of each word), row g + 8 (1, 5, 3, 7)
        const int n = nt * 16 + g + 8 * h;
        const float s = to_f32(scales[(u64)grp * N + n]), z = to_f32(zeros[(u64)grp * N + n]);
        u32 packed[8];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const u32 ww = words[j] >> (4 * h);  // row g + 8's nibbles sit one position (4 bits) higher
            const float v0 = ((float)((ww >> 0) & 15) - z) * s;   // k + 0: nibble 0 (h = 1: nibble 1)
            const float v1 = ((float)((ww >> 16) & 15) - z) * s;  // k + 1: nibble 4 (5)
            const float v2 = ((float)((ww >> 8) & 15) - z) * s;   // k + 2: nibble 2 (3)
            const float v3 = ((float)((ww >> 24) & 15) - z) * s;  // k + 3: nibble 6 (7)
            packed[2 * j] = (u32)from_f32(v0) | ((u32)from_f32(v1) << 16);
            packed[2 * j + 1] = (u32)from_f32(v2) | ((u32)from_f32(v3) << 16);
        }
        uint4* dst = (uint4*)(out + (u64)n * K + c * 64 + 16 * t);
        dst[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        dst[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    }
}
