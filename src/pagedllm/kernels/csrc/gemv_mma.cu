// Few-row (2..32) bf16 / fp16 GEMV on the tensor cores, over the plain [N, K] weight (kernels/gemv_mma.py compiles
// it with NVRTC).
//
// Swap-AB, as csrc/qgemv_mma.cu: out^T[n, m] = W[n, k] x^T[k, m], one mma.m16n8k16 per 16 output columns x 16
// channels; the MMA's 8 B columns are 8 input rows, so 1 to 8 rows cost one pass over the weight (MT row tiles of 8
// per block for more). The weights are read straight from their row-major storage: per 64-channel chunk, lane
// (g, t) loads channels [8 t, 8 t + 8) and [32 + 8 t, 32 + 8 t + 8) of weight rows g and g + 8 of its column tile
// (four 16-byte loads; a warp's load covers 64 contiguous bytes of each of 8 rows) and the same channels of x.
// The MMA does not care which real channel a fragment slot holds as long as A and B agree: MMA j of a chunk takes
// the lane's channel pairs 2 j (fragment columns 2 t, 2 t + 1) and 2 j + 1 (columns 2 t + 8, 2 t + 9) of those 16.
// Products exact in fp32, sums fp32 (in another order than cuBLAS's: results differ from it in the last bits).
//
// Compile-time parameters (#define before this file): WARPS (they split K: every WARPS-th unit), UNIT (chunks per
// unit), DEPTH (units of a warp in flight, all asked for before the wait on the previous kernel), MT (row tiles of
// 8), CT (column tiles per block sharing each x fragment), GATED (CT is 2: the block's gate tile and its up tile,
// up_rows weight rows further; out = silu(gate) * up), IS_FP16, HAS_BIAS. csrc/mma_common.cuh comes before this
// file (to_f32, from_f32, round_trip, mma).
#ifndef DEPTH
#define DEPTH 2
#endif
#ifndef CT
#define CT 1
#endif
#ifndef GATED
#define GATED 0
#endif
// One unit of a lane's weights: per column tile and chunk, rows g and g + 8, channels [8 t, +8) and [32 + 8 t, +8).
struct Unit {
    uint4 lo[CT][UNIT][2], hi[CT][UNIT][2];
};

// wlane[ct]: the lane's row g of column tile ct at channel 8 t; row g + 8 is 8 * stride_w further.
__device__ __forceinline__ void load_unit(Unit& un, const u16* const (&wlane)[CT], u64 hi_off, int u) {
#pragma unroll
    for (int ct = 0; ct < CT; ct++)
#pragma unroll
        for (int i = 0; i < UNIT; i++) {
            const u16* p = wlane[ct] + (u64)(u * UNIT + i) * 64;
            un.lo[ct][i][0] = __ldg((const uint4*)p);
            un.lo[ct][i][1] = __ldg((const uint4*)(p + 32));
            un.hi[ct][i][0] = __ldg((const uint4*)(p + hi_off));
            un.hi[ct][i][1] = __ldg((const uint4*)(p + hi_off + 32));
        }
}

__device__ __forceinline__ u32 word(const uint4 (&v)[2], int pair) {
    const uint4 q = v[pair >> 2];
    const int e = pair & 3;
    return e == 0 ? q.x : e == 1 ? q.y : e == 2 ? q.z : q.w;
}

// acc += one unit's product against the lane's x of every row tile.
__device__ __forceinline__ void unit_product(float (&acc)[CT][MT][4], const Unit& un, int u,
                                             const u16* const (&xrow)[MT]) {
#pragma unroll
    for (int i = 0; i < UNIT; i++) {
        const int c = u * UNIT + i;
        uint4 xv[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            xv[mt][0] = __ldg((const uint4*)(xrow[mt] + c * 64));
            xv[mt][1] = __ldg((const uint4*)(xrow[mt] + c * 64 + 32));
        }
#pragma unroll
        for (int ct = 0; ct < CT; ct++)
#pragma unroll
            for (int j = 0; j < 4; j++) {
                // A: rows g (a0, a2) and g + 8 (a1, a3), fragment columns 2 t.. (a0, a1) and 2 t + 8.. (a2, a3)
                const u32 a0 = word(un.lo[ct][i], 2 * j), a2 = word(un.lo[ct][i], 2 * j + 1);
                const u32 a1 = word(un.hi[ct][i], 2 * j), a3 = word(un.hi[ct][i], 2 * j + 1);
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
                    mma(acc[ct][mt], a0, a1, a2, a3, word(xv[mt], 2 * j), word(xv[mt], 2 * j + 1));
            }
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
gemv_mma(const u16* __restrict__ w, const u16* __restrict__ x, const u16* __restrict__ bias,
         u16* __restrict__ out, int M, int N, int K, int stride_w, int stride_x, int stride_o, int up_rows) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    // the block's first output column; GATED: the gate's (its up column is up_rows weight rows further)
    const int n0 = blockIdx.x * (GATED ? 16 : 16 * CT);
    const int m0 = blockIdx.y * 8 * MT;
    const int units = (K >> 6) / UNIT;
    const u64 hi_off = (u64)8 * stride_w;
    const u16* wlane[CT];
#pragma unroll
    for (int ct = 0; ct < CT; ct++)
        wlane[ct] = w + (u64)(n0 + g) * stride_w + 8 * t + (u64)ct * (GATED ? up_rows : 16) * stride_w;

    Unit buf[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH; d++)
        if (warp + d * WARPS < units) load_unit(buf[d], wlane, hi_off, warp + d * WARPS);
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");  // x is the previous kernel's output
#endif
    float acc[CT][MT][4];
    // the lane's row of each row tile (a row past M reads row 0; its MMA column is never stored)
    const u16* xrow[MT];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const int m = m0 + 8 * mt + g;
        xrow[mt] = x + (u64)(m < M ? m : 0) * stride_x + 8 * t;
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
                unit_product(acc, buf[d], u, xrow);
                if (u + DEPTH * WARPS < units) load_unit(buf[d], wlane, hi_off, u + DEPTH * WARPS);
            }
        }
    }
    // the warps' partial sums added in warp order (deterministic)
    __shared__ float red[WARPS][CT * MT * 4][32];
#pragma unroll
    for (int ct = 0; ct < CT; ct++)
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++) red[warp][(ct * MT + mt) * 4 + e][lane] = acc[ct][mt][e];
    __syncthreads();
    // c0: (column g, row 2 t), c1: (g, 2 t + 1), c2: (g + 8, 2 t), c3: (g + 8, 2 t + 1) of entry idx / 4's column tile
    // idx / (4 MT) and row tile idx / 4 % MT
#if GATED
    for (int idx = warp; idx < MT * 4; idx += WARPS) {
        float gate = red[0][idx][lane], up = red[0][MT * 4 + idx][lane];
#pragma unroll
        for (int w2 = 1; w2 < WARPS; w2++) {
            gate += red[w2][idx][lane];
            up += red[w2][MT * 4 + idx][lane];
        }
        const int e = idx & 3;
        const int n = n0 + g + ((e < 2) ? 0 : 8);
        const int m = m0 + 8 * (idx >> 2) + 2 * t + (e & 1);
        if (m < M) {
#if HAS_BIAS
            gate += to_f32(bias[n]);
            up += to_f32(bias[N + n]);
#endif
            // as a linear layer and then silu_and_mul in the activation dtype: gate and up rounded, the activation
            // rounded, the product rounded
            gate = round_trip(gate);
            const float act = round_trip(gate / (1.0f + expf(-gate)));
            out[(u64)m * stride_o + n] = from_f32(act * round_trip(up));
        }
    }
#else
    for (int idx = warp; idx < CT * MT * 4; idx += WARPS) {
        float v = red[0][idx][lane];
#pragma unroll
        for (int w2 = 1; w2 < WARPS; w2++) v += red[w2][idx][lane];
        const int e = idx & 3;
        const int n = n0 + 16 * (idx / (4 * MT)) + g + ((e < 2) ? 0 : 8);
        const int m = m0 + 8 * ((idx >> 2) % MT) + 2 * t + (e & 1);
        if (m < M) {
#if HAS_BIAS
            v += to_f32(bias[n]);
#endif
            out[(u64)m * stride_o + n] = from_f32(v);
        }
    }
#endif
}
