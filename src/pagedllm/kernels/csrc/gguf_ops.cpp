// pagedllm CPU kernels for weights kept in their GGUF (llama.cpp) block formats, plus pagedllm's own
// per-channel int8 rows (W8A8). Built with cpu_ops.cpp into one extension (kernels/cpu_ops.py).
//
// Every supported format is decoded 64 weights ("a chunk") at a time into unsigned bytes q and, per 16
// weights, a scale a and an offset b, so that weight = a * q + b:
//   Q8_0 q = int8 ^ 0x80, b = -128 a;  Q4_0 b = -8 a;  Q5_0 b = -16 a;  Q4_1 / Q5_1 b = the block min;
//   Q4_K / Q5_K a = d * sc, b = -dmin * m (6-bit sub-block scales); Q6_K b = -32 a (16-weight scales).
// Activations are quantized per 32 values to 16-bit integers held as two int8 digits, x ~= dx (hi + lo / 256)
// with dx = amax / 127 (|x - dx (hi + lo / 256)| <= dx / 512: near-fp32 logits, so greedy decoding keeps the
// float model's choices where int8 alone flips near-ties), with dx * sum per 16 kept, so
//   sum_i w_i x_i ~= sum_g a_g dx_g dot16_g(q, x16) + b_g (dx_g sum16_g(x16)),       x16 = 256 hi + lo,
// integer dot products (AVX-512 VNNI: vpdpbusd of unsigned q by each signed digit, the hi one shifted by 8;
// AVX2 / portable: q times the int16 x16) and two float terms.
// Threads split the output rows; activation rows are processed in tiles that stay in L2 while the thread
// walks its weight rows, and each decoded weight chunk is multiplied by up to kRows activation rows.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGEDLLM_HAVE_VNNI512 1
#endif

namespace {

enum GgufType : int64_t {  // the ggml type ids, plus pagedllm's own per-channel int8 row
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kI8Row = 1000,  // [float32 scale][K int8]: weight = scale * int8
};

enum Impl : int64_t { kBest = 0, kAvx2 = 1, kPortable = 2 };

constexpr int64_t kChunk = 64;
constexpr int kRows = 4;        // activation rows per decoded weight chunk
constexpr int64_t kPrefetchRows = 8;  // AVX2 register path: weight rows prefetched ahead
constexpr int64_t kTile = 64;   // activation rows per L2 tile

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

struct Chunk {
  alignas(64) uint8_t q[64];
  float a[4], b[4];
};

typedef uint8_t v16u8 __attribute__((vector_size(16)));

inline v16u8 ld16(const uint8_t* p) {
  v16u8 v;
  std::memcpy(&v, p, 16);
  return v;
}
inline void st16(uint8_t* p, v16u8 v) { std::memcpy(p, &v, 16); }

// Bits of a 32-bit little-endian mask (Q5_0/Q5_1's fifth bits) spread to 16 bytes, one bit per byte, then
// shifted to bit 4.
inline v16u8 high_bits16(uint32_t mask) {
  v16u8 out;
  for (int i = 0; i < 16; ++i) out[i] = static_cast<uint8_t>(((mask >> i) & 1u) << 4);
  return out;
}

inline void scale_min_k4(const uint8_t* s, int j, float& sc, float& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

inline int64_t block_elems(int64_t type) {
  return (type == kQ4_K || type == kQ5_K || type == kQ6_K) ? 256 : 32;
}

constexpr int64_t block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

inline int64_t row_bytes(int64_t type, int64_t k) {
  if (type == kI8Row) return k + 4;
  return k / block_elems(type) * block_bytes(type);
}

// f(std::integral_constant<int64_t, T>{}) for the weight type T named by type; anything else is an error
// naming `what`.
template <class F>
inline void visit_type(int64_t type, const char* what, F&& f) {
  using std::integral_constant;
  switch (type) {
    case kQ4_0: return f(integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return f(integral_constant<int64_t, kQ5_0>{});
    case kQ5_1: return f(integral_constant<int64_t, kQ5_1>{});
    case kQ8_0: return f(integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return f(integral_constant<int64_t, kQ4_K>{});
    case kQ5_K: return f(integral_constant<int64_t, kQ5_K>{});
    case kQ6_K: return f(integral_constant<int64_t, kQ6_K>{});
    case kI8Row: return f(integral_constant<int64_t, kI8Row>{});
    default: break;
  }
  TORCH_CHECK(false, "gguf kernels: unsupported ", what, "type ", type);
}

// One 32-weight block of a 32-block type into q[0..32), its scale/offset into a[0..1], b[0..1].
template <int64_t T>
inline void decode_block32(const uint8_t* blk, uint8_t* q, float* a, float* b) {
  if constexpr (T == kQ8_0) {
    const float d = fp16(blk);
    st16(q, ld16(blk + 2) ^ 0x80);
    st16(q + 16, ld16(blk + 18) ^ 0x80);
    a[0] = a[1] = d;
    b[0] = b[1] = -128.f * d;
  } else if constexpr (T == kQ4_0 || T == kQ4_1) {
    const float d = fp16(blk);
    const float off = T == kQ4_0 ? -8.f * d : fp16(blk + 2);
    const v16u8 v = ld16(blk + (T == kQ4_0 ? 2 : 4));
    st16(q, v & 0xF);
    st16(q + 16, v >> 4);
    a[0] = a[1] = d;
    b[0] = b[1] = off;
  } else {  // Q5_0, Q5_1
    const float d = fp16(blk);
    const float off = T == kQ5_0 ? -16.f * d : fp16(blk + 2);
    const uint8_t* p = blk + (T == kQ5_0 ? 2 : 4);
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    const v16u8 v = ld16(p + 4);
    st16(q, (v & 0xF) | high_bits16(qh));
    st16(q + 16, (v >> 4) | high_bits16(qh >> 16));
    a[0] = a[1] = d;
    b[0] = b[1] = off;
  }
}

// Chunk c (weights [64c, 64c + 64)) of a row of type T with k weights; past k (a row of 32-blocks whose
// length is an odd multiple of 32) the chunk is zero-filled with a = b = 0.
template <int64_t T>
inline void decode_chunk(const uint8_t* row, int64_t c, int64_t k, Chunk& ch) {
  if constexpr (T == kQ8_0 || T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1) {
    constexpr int64_t bb = T == kQ8_0 ? 34 : T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ5_0 ? 22 : 24;
    decode_block32<T>(row + 2 * c * bb, ch.q, ch.a, ch.b);
    if (64 * c + 32 < k) {
      decode_block32<T>(row + (2 * c + 1) * bb, ch.q + 32, ch.a + 2, ch.b + 2);
    } else {
      std::memset(ch.q + 32, 0, 32);
      ch.a[2] = ch.a[3] = ch.b[2] = ch.b[3] = 0.f;
    }
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    const uint8_t* blk = row + (c / 4) * (T == kQ4_K ? 144 : 176);
    const int j = static_cast<int>(c % 4);
    const float d = fp16(blk), dmin = fp16(blk + 2);
    const uint8_t* qs = blk + (T == kQ4_K ? 16 : 48) + 32 * j;
    const v16u8 v0 = ld16(qs), v1 = ld16(qs + 16);
    v16u8 lo0 = v0 & 0xF, lo1 = v1 & 0xF, hi0 = v0 >> 4, hi1 = v1 >> 4;
    if constexpr (T == kQ5_K) {
      const uint8_t* qh = blk + 16;
      const v16u8 h0 = ld16(qh), h1 = ld16(qh + 16);
      lo0 |= ((h0 >> (2 * j)) & 1) << 4;
      lo1 |= ((h1 >> (2 * j)) & 1) << 4;
      hi0 |= ((h0 >> (2 * j + 1)) & 1) << 4;
      hi1 |= ((h1 >> (2 * j + 1)) & 1) << 4;
    }
    st16(ch.q, lo0);
    st16(ch.q + 16, lo1);
    st16(ch.q + 32, hi0);
    st16(ch.q + 48, hi1);
    float sc, m;
    scale_min_k4(blk + 4, 2 * j, sc, m);
    ch.a[0] = ch.a[1] = d * sc;
    ch.b[0] = ch.b[1] = -dmin * m;
    scale_min_k4(blk + 4, 2 * j + 1, sc, m);
    ch.a[2] = ch.a[3] = d * sc;
    ch.b[2] = ch.b[3] = -dmin * m;
  } else if constexpr (T == kQ6_K) {
    const uint8_t* blk = row + (c / 4) * 210;
    const int64_t cc = c % 4, h = cc / 2, n = cc % 2;
    const uint8_t* ql = blk + 64 * h;
    const uint8_t* qh = blk + 128 + 32 * h;
    const int sh = static_cast<int>(4 * n);
    for (int part = 0; part < 4; ++part) {  // 16 weights each
      const v16u8 l = ld16(ql + 16 * part);
      const v16u8 hb = ld16(qh + 16 * (part % 2));
      const v16u8 lo = n ? (l >> 4) : (l & 0xF);
      const v16u8 hi = (hb >> (sh + 2 * (part / 2))) & 3;
      st16(ch.q + 16 * part, lo | (hi << 4));
    }
    const float d = fp16(blk + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192) + 4 * cc;
    for (int g = 0; g < 4; ++g) {
      ch.a[g] = d * scales[g];
      ch.b[g] = -32.f * ch.a[g];
    }
  } else {  // kI8Row
    const float s = [&] { float f; std::memcpy(&f, row, 4); return f; }();
    const uint8_t* w = row + 4 + 64 * c;
    const int64_t n = std::min<int64_t>(64, k - 64 * c);
    for (int64_t i = 0; i < n; ++i) ch.q[i] = w[i] ^ 0x80;
    for (int64_t i = n; i < 64; ++i) ch.q[i] = 0;
    for (int g = 0; g < 4; ++g) {
      const bool live = 16 * g < n;
      ch.a[g] = live ? s : 0.f;
      ch.b[g] = live ? -128.f * s : 0.f;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Activations: per row, the 16-bit values x16 = 256 hi + lo (padded to a multiple of 64 with zeros) as int16
// and as its two int8 digits, the step (dx / 256) per 4 values ("lanes", what a 32-bit vpdpbusd lane covers)
// and step * sum(x16) per 16.

struct ActRows {
  std::vector<int8_t> hi, lo, hl;  // hl: per 32 values, their 32 hi digits then their 32 lo digits (tiled kernels)
  std::vector<int16_t> x16;
  std::vector<float> dx4, s16, st32, su32, su16;  // st32 / su32: the step and step * sum(x16) per 32 (tiled kernels)
  int64_t k64 = 0, s_stride = 0, nb32 = 0;  // s16 rows padded to a multiple of 16 floats (one zmm)
  // The AVX2 row layout's activations (quantize_rows_a2): x16 in the layout's order per 64 values, and per group of
  // 256 values the step and step * sum(x16) of its eight 32-blocks in the layout's scale order.
  std::vector<int16_t> xa;
  std::vector<float> sta, sua;
  int64_t a_stride = 0, g_stride = 0;
  const int16_t* xa_row(int64_t r) const { return xa.data() + r * a_stride; }
  const float* sta_row(int64_t r) const { return sta.data() + r * g_stride; }
  const float* sua_row(int64_t r) const { return sua.data() + r * g_stride; }
  const int8_t* xhi(int64_t r) const { return hi.data() + r * k64; }
  const int8_t* xlo(int64_t r) const { return lo.data() + r * k64; }
  const int8_t* xhl(int64_t r) const { return hl.data() + 2 * r * k64; }
  const int16_t* xw(int64_t r) const { return x16.data() + r * k64; }
  const float* dx(int64_t r) const { return dx4.data() + r * (k64 / 4); }
  const float* s(int64_t r) const { return s16.data() + r * s_stride; }
  const float* step32(int64_t r) const { return st32.data() + r * nb32; }
  const float* sum32(int64_t r) const { return su32.data() + r * nb32; }
  const float* sum16(int64_t r) const { return su16.data() + 2 * r * nb32; }
};

// Values [b0, b0 + 32) of a row of k, zero past k, as float32.
template <typename scalar_t>
inline void load_block32(const scalar_t* xr, int64_t b0, int64_t k, float* buf) {
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(32, k - b0));
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (n == 32) {
      std::memcpy(buf, xr + b0, 32 * sizeof(float));
      return;
    }
  }
  for (int i = 0; i < 32; ++i) buf[i] = i < n ? static_cast<float>(xr[b0 + i]) : 0.f;
}

// One block of 32 values: the digits hi[i], lo[i] with x ~= d (hi + lo / 256), d = amax / 127, and in half[h]
// the sum of x16 = 256 hi + lo over values [16 h, 16 h + 16); returns d.
inline float quantize_block32(const float* buf, int8_t* hi, int8_t* lo, int32_t* half) {
#if defined(PAGEDLLM_HAVE_VNNI512)
  const __m512 v0 = _mm512_loadu_ps(buf), v1 = _mm512_loadu_ps(buf + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float d = amax / 127.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  for (int h = 0; h < 2; ++h) {
    const __m512 v = _mm512_mul_ps(h ? v1 : v0, _mm512_set1_ps(id));  // in [-127, 127]
    const __m512 hr = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 lr = _mm512_min_ps(_mm512_set1_ps(127.f), _mm512_roundscale_ps(
        _mm512_mul_ps(_mm512_sub_ps(v, hr), _mm512_set1_ps(256.f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m512i hv = _mm512_cvtps_epi32(hr), lv = _mm512_cvtps_epi32(lr);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + 16 * h), _mm512_cvtepi32_epi8(hv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + 16 * h), _mm512_cvtepi32_epi8(lv));
    half[h] = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(hv, 8), lv));
  }
  return d;
#else
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(buf[i]));
  const float d = amax / 127.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  for (int h = 0; h < 2; ++h) {
    int32_t sum = 0;
    for (int i = 16 * h; i < 16 * h + 16; ++i) {
      const float v = buf[i] * id;  // in [-127, 127]
      const float hr = std::nearbyint(v);
      const float lr = std::min(127.f, std::nearbyint((v - hr) * 256.f));
      hi[i] = static_cast<int8_t>(hr);
      lo[i] = static_cast<int8_t>(lr);
      sum += 256 * static_cast<int32_t>(hr) + static_cast<int32_t>(lr);
    }
    half[h] = sum;
  }
  return d;
#endif
}

// The row kernels' activations (hi, lo, x16, dx4, s16).
template <typename scalar_t>
void quantize_rows(const scalar_t* x, int64_t xs, int64_t m, int64_t k, ActRows& act) {
  act.k64 = (k + 63) / 64 * 64;
  act.s_stride = (act.k64 / 16 + 15) / 16 * 16;
  act.hi.assign(m * act.k64, 0);
  act.lo.assign(m * act.k64, 0);
  act.x16.assign(m * act.k64, 0);
  act.dx4.assign(m * act.k64 / 4, 0.f);
  act.s16.assign(m * act.s_stride, 0.f);
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    float buf[32];
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * xs;
      int8_t* hi = act.hi.data() + r * act.k64;
      int8_t* lo = act.lo.data() + r * act.k64;
      int16_t* x16 = act.x16.data() + r * act.k64;
      float* dx4 = act.dx4.data() + r * (act.k64 / 4);
      float* s16 = act.s16.data() + r * act.s_stride;
      for (int64_t b0 = 0; b0 < k; b0 += 32) {
        load_block32(xr, b0, k, buf);
        int32_t half[2];
        const float step = quantize_block32(buf, hi + b0, lo + b0, half) / 256.f;
        for (int i = 0; i < 32; ++i) x16[b0 + i] = static_cast<int16_t>(256 * hi[b0 + i] + lo[b0 + i]);
        for (int i = 0; i < 8; ++i) dx4[b0 / 4 + i] = step;
        s16[b0 / 16] = step * static_cast<float>(half[0]);
        s16[b0 / 16 + 1] = step * static_cast<float>(half[1]);
      }
    }
  });
}

// The tiled kernels' activations (hl, st32, su32, su16): the same numbers, per 32 values the hi digits then
// the lo digits.
template <typename scalar_t>
void quantize_rows_tiled(const scalar_t* x, int64_t xs, int64_t m, int64_t k, ActRows& act) {
  act.k64 = (k + 63) / 64 * 64;
  act.nb32 = act.k64 / 32;
  act.hl.resize(2 * m * act.k64);
  act.st32.resize(m * act.nb32);
  act.su32.resize(m * act.nb32);
  act.su16.resize(2 * m * act.nb32);
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    float buf[32];
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * xs;
      int8_t* hl = act.hl.data() + 2 * r * act.k64;
      float* st = act.st32.data() + r * act.nb32;
      float* su = act.su32.data() + r * act.nb32;
      float* su16 = act.su16.data() + 2 * r * act.nb32;
      for (int64_t b0 = 0; b0 < act.k64; b0 += 32) {
        load_block32(xr, b0, k, buf);
        int32_t half[2];
        const float step = quantize_block32(buf, hl + 2 * b0, hl + 2 * b0 + 32, half) / 256.f;
        st[b0 / 32] = step;
        su[b0 / 32] = step * static_cast<float>(half[0] + half[1]);
        su16[b0 / 16] = step * static_cast<float>(half[0]);
        su16[b0 / 16 + 1] = step * static_cast<float>(half[1]);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------------------
// out[r, n] for activation rows [m0, m0 + R) and one decoded weight row, three implementations.

template <int R>
inline void dot_rows_portable(const Chunk* chunks, int64_t nchunks, const ActRows& act, int64_t m0, float* acc) {
  for (int r = 0; r < R; ++r) {
    const int16_t* xq = act.xw(m0 + r);
    const float* dx = act.dx(m0 + r);
    const float* s = act.s(m0 + r);
    float total = 0.f;
    for (int64_t c = 0; c < nchunks; ++c) {
      const Chunk& ch = chunks[c];
      for (int g = 0; g < 4; ++g) {
        int32_t isum = 0;
        for (int i = 0; i < 16; ++i) isum += static_cast<int32_t>(ch.q[16 * g + i]) * xq[64 * c + 16 * g + i];
        total += ch.a[g] * dx[16 * c + 4 * g] * static_cast<float>(isum) + ch.b[g] * s[4 * c + g];
      }
    }
    acc[r] = total;
  }
}

#if defined(__AVX2__)
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int R>
inline void dot_rows_avx2(const Chunk* chunks, int64_t nchunks, const ActRows& act, int64_t m0, float* out) {
  __m256 acc[R];
  __m128 accb[R];
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_setzero_ps();
    accb[r] = _mm_setzero_ps();
  }
  for (int64_t c = 0; c < nchunks; ++c) {
    const Chunk& ch = chunks[c];
    const __m128 b4 = _mm_loadu_ps(ch.b);
    __m256i w16[4];
    for (int g = 0; g < 4; ++g)
      w16[g] = _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(ch.q + 16 * g)));
    for (int r = 0; r < R; ++r) {
      const int16_t* xq = act.xw(m0 + r) + 64 * c;
      const float* dx = act.dx(m0 + r) + 16 * c;
      for (int g = 0; g < 4; ++g) {
        const __m256i x16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16 * g));
        const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(w16[g], x16));
        acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(ch.a[g] * dx[4 * g]), acc[r]);
      }
      accb[r] = _mm_fmadd_ps(b4, _mm_loadu_ps(act.s(m0 + r) + 4 * c), accb[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128 s = accb[r];
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    out[r] = hsum256(acc[r]) + _mm_cvtss_f32(s);
  }
}
#endif

#if defined(__AVX2__) && !defined(PAGEDLLM_HAVE_VNNI512)
// The best path of AVX2 machines for a few activation rows (decode steps): each 64-weight chunk is decoded
// straight into registers (four 16-weight groups of bytes, a scale and an offset per group), widened to int16
// and multiplied by the int16 activations x16 (vpmaddwd: exact integer sums), then scaled in float once per
// 32 weights (per 16 for Q6_K). Q8_0 stays signed (no offset term). The chunk path above stores each decoded
// chunk and loads it back, and spreads Q5's fifth bits one byte at a time.
struct RegChunk2 {
  __m128i q[4];
  alignas(16) float a_own[4], b_own[4];
  const float* a = a_own;  // the four groups' scales and offsets (the K-quants point into SuperScales)
  const float* b = b_own;
};

// A K-quant super-block's 16 group scales and offsets (per 16 weights), computed once for its four chunks.
struct SuperScales {
  alignas(16) float a[16], b[16];
};

constexpr bool is_kquant(int64_t t) { return t == kQ4_K || t == kQ5_K || t == kQ6_K; }

template <int64_t T>
inline void super_scales(const uint8_t* blk, SuperScales& s) {
  if constexpr (T == kQ4_K || T == kQ5_K) {
    const float d = fp16(blk), dmin = fp16(blk + 2);
    for (int sb = 0; sb < 8; ++sb) {
      float sc, mn;
      scale_min_k4(blk + 4, sb, sc, mn);
      s.a[2 * sb] = s.a[2 * sb + 1] = d * sc;
      s.b[2 * sb] = s.b[2 * sb + 1] = -dmin * mn;
    }
  } else if constexpr (T == kQ6_K) {
    const float d = fp16(blk + 208);
    const int8_t* scales = reinterpret_cast<const int8_t*>(blk + 192);
    for (int g = 0; g < 16; ++g) {
      s.a[g] = d * scales[g];
      s.b[g] = -32.f * s.a[g];
    }
  }
}

// Bit i of mask as 0x10 in byte i (Q5_0/Q5_1's fifth bits, 32 weights at a time): each byte picks its mask byte,
// then its own bit.
inline __m256i high_bits32(uint32_t mask) {
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(mask)),
                                            _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                             2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

inline void split256(__m256i v, __m128i* q) {
  q[0] = _mm256_castsi256_si128(v);
  q[1] = _mm256_extracti128_si256(v, 1);
}

inline __m128i low_nibbles(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(0x0F)); }
inline __m128i high_nibbles(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F)); }
inline __m128i load128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
// Bit `bit` of each byte moved to bit 4 (the 16-bit shift's carries from the next byte are masked away).
inline __m128i bit_to_4(__m128i v, int bit) {
  return _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(v, _mm_cvtsi32_si128(bit)), _mm_set1_epi8(1)), 4);
}

// Chunk c of a row; for the K-quants `sup` holds the chunk's super-block scales (super_scales).
template <int64_t T>
inline void decode_avx2(const uint8_t* row, int64_t c, int64_t k, const SuperScales& sup, RegChunk2& ch) {
  if constexpr (T == kQ8_0 || T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1) {
    constexpr int64_t bb = T == kQ8_0 ? 34 : T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ5_0 ? 22 : 24;
    for (int h = 0; h < 2; ++h) {
      if (h == 1 && 64 * c + 32 >= k) {  // a row of an odd number of 32-blocks: the last chunk's second half
        ch.q[2] = ch.q[3] = _mm_setzero_si128();
        ch.a_own[2] = ch.a_own[3] = ch.b_own[2] = ch.b_own[3] = 0.f;
        break;
      }
      const uint8_t* blk = row + (2 * c + h) * bb;
      const float d = fp16(blk);
      float off = 0.f;
      if constexpr (T == kQ8_0) {
        ch.q[2 * h] = load128(blk + 2);
        ch.q[2 * h + 1] = load128(blk + 18);
      } else if constexpr (T == kQ4_0 || T == kQ4_1) {
        const __m128i v = load128(blk + (T == kQ4_0 ? 2 : 4));
        ch.q[2 * h] = low_nibbles(v);
        ch.q[2 * h + 1] = high_nibbles(v);
        off = T == kQ4_0 ? -8.f * d : fp16(blk + 2);
      } else {
        const uint8_t* p = blk + (T == kQ5_0 ? 2 : 4);
        uint32_t qh;
        std::memcpy(&qh, p, 4);
        const __m128i v = load128(p + 4);
        const __m256i nibbles = _mm256_set_m128i(high_nibbles(v), low_nibbles(v));
        split256(_mm256_or_si256(nibbles, high_bits32(qh)), ch.q + 2 * h);
        off = T == kQ5_0 ? -16.f * d : fp16(blk + 2);
      }
      ch.a_own[2 * h] = ch.a_own[2 * h + 1] = d;
      ch.b_own[2 * h] = ch.b_own[2 * h + 1] = off;
    }
  } else if constexpr (T == kQ4_K || T == kQ5_K) {
    const uint8_t* blk = row + (c / 4) * (T == kQ4_K ? 144 : 176);
    const int j = static_cast<int>(c % 4);
    const uint8_t* qs = blk + (T == kQ4_K ? 16 : 48) + 32 * j;
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs));
    const __m256i nib = _mm256_set1_epi8(0x0F);
    split256(_mm256_and_si256(v, nib), ch.q);
    split256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib), ch.q + 2);
    if constexpr (T == kQ5_K) {
      const __m128i h0 = load128(blk + 16), h1 = load128(blk + 32);
      ch.q[0] = _mm_or_si128(ch.q[0], bit_to_4(h0, 2 * j));
      ch.q[1] = _mm_or_si128(ch.q[1], bit_to_4(h1, 2 * j));
      ch.q[2] = _mm_or_si128(ch.q[2], bit_to_4(h0, 2 * j + 1));
      ch.q[3] = _mm_or_si128(ch.q[3], bit_to_4(h1, 2 * j + 1));
    }
    ch.a = sup.a + 4 * j;
    ch.b = sup.b + 4 * j;
  } else if constexpr (T == kQ6_K) {
    const uint8_t* blk = row + (c / 4) * 210;
    const int64_t cc = c % 4, h = cc / 2, n = cc % 2;
    const uint8_t* ql = blk + 64 * h;
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
    const __m256i l01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
    const __m256i l23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
    const __m256i nib = _mm256_set1_epi8(0x0F), two_bits = _mm256_set1_epi8(0x30);
    // low 4 bits from ql's low or high nibbles, bits 4-5 from qh's bit pair 2n (weights 0-31) or 2n + 1 (32-63),
    // moved into place by 16-bit shifts whose carries from the next byte are masked away
    __m256i lo01, lo23, hi01, hi23;
    if (n) {
      lo01 = _mm256_and_si256(_mm256_srli_epi16(l01, 4), nib);
      lo23 = _mm256_and_si256(_mm256_srli_epi16(l23, 4), nib);
      hi01 = _mm256_and_si256(hb, two_bits);
      hi23 = _mm256_and_si256(_mm256_srli_epi16(hb, 2), two_bits);
    } else {
      lo01 = _mm256_and_si256(l01, nib);
      lo23 = _mm256_and_si256(l23, nib);
      hi01 = _mm256_and_si256(_mm256_slli_epi16(hb, 4), two_bits);
      hi23 = _mm256_and_si256(_mm256_slli_epi16(hb, 2), two_bits);
    }
    split256(_mm256_or_si256(lo01, hi01), ch.q);
    split256(_mm256_or_si256(lo23, hi23), ch.q + 2);
    ch.a = sup.a + 4 * cc;
    ch.b = sup.b + 4 * cc;
  } else {  // int8 rows: the chunk decoder, then into registers
    Chunk tmp;
    decode_chunk<T>(row, c, k, tmp);
    for (int g = 0; g < 4; ++g) {
      ch.q[g] = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp.q + 16 * g));
      ch.a_own[g] = tmp.a[g];
      ch.b_own[g] = tmp.b[g];
    }
  }
}

// out[r * os] for activation rows [m0, m0 + R) and one weight row; two accumulators per row (the chunk's
// halves) so consecutive FMAs do not wait on each other.
template <int64_t T, int R>
inline void dot_rows_avx2_reg(const uint8_t* row, int64_t k, const ActRows& act, int64_t m0, float* out,
                              int64_t os) {
  constexpr bool kSigned = T == kQ8_0;
  constexpr bool kPer16 = T == kQ6_K || T == kI8Row;  // scales (or a partial chunk) per 16 weights
  __m256 acc0[R], acc1[R];
  __m128 accb[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = acc1[r] = _mm256_setzero_ps();
    accb[r] = _mm_setzero_ps();
  }
  const int64_t nchunks = (k + 63) / 64;
  SuperScales sup;
  for (int64_t c = 0; c < nchunks; ++c) {
    if constexpr (is_kquant(T)) {
      if (c % 4 == 0) super_scales<T>(row + (c / 4) * block_bytes(T), sup);
    }
    RegChunk2 ch;
    decode_avx2<T>(row, c, k, sup, ch);
    __m256i w[4];
    for (int g = 0; g < 4; ++g) w[g] = kSigned ? _mm256_cvtepi8_epi16(ch.q[g]) : _mm256_cvtepu8_epi16(ch.q[g]);
    const __m128 b4 = _mm_loadu_ps(ch.b);
    for (int r = 0; r < R; ++r) {
      const int16_t* x = act.xw(m0 + r) + 64 * c;
      const float* dx = act.dx(m0 + r) + 16 * c;
      __m256i p[4];
      for (int g = 0; g < 4; ++g)
        p[g] = _mm256_madd_epi16(w[g], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * g)));
      if constexpr (kPer16) {
        acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[0]), _mm256_set1_ps(ch.a[0] * dx[0]), acc0[r]);
        acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[2]), _mm256_set1_ps(ch.a[2] * dx[8]), acc1[r]);
        acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[1]), _mm256_set1_ps(ch.a[1] * dx[4]), acc0[r]);
        acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[3]), _mm256_set1_ps(ch.a[3] * dx[12]), acc1[r]);
      } else {  // one scale per 32 weights (a and the activation step)
        acc0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p[0], p[1])), _mm256_set1_ps(ch.a[0] * dx[0]),
                                  acc0[r]);
        acc1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p[2], p[3])), _mm256_set1_ps(ch.a[2] * dx[8]),
                                  acc1[r]);
      }
      if constexpr (!kSigned) accb[r] = _mm_fmadd_ps(b4, _mm_loadu_ps(act.s(m0 + r) + 4 * c), accb[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128 sb = accb[r];
    sb = _mm_add_ps(sb, _mm_movehl_ps(sb, sb));
    sb = _mm_add_ss(sb, _mm_movehdup_ps(sb));
    out[r * os] = hsum256(_mm256_add_ps(acc0[r], acc1[r])) + _mm_cvtss_f32(sb);
  }
}

// out[r, n] for activation rows [0, m) and weight rows [n0, n1), kRows activation rows per decode.
template <int64_t T>
inline void gemm_avx2_reg(const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, int64_t k, const ActRows& act,
                          int64_t m, float* out, int64_t os) {
  for (int64_t r0 = 0; r0 < m; r0 += kRows) {
    const int64_t nr = std::min<int64_t>(kRows, m - r0);
    float* o = out + r0 * os;
    for (int64_t n = n0; n < n1; ++n) {
      if (n + kPrefetchRows < n1) {  // a row kPrefetchRows ahead, so the stream never waits on DRAM at a row start
        const char* ahead = reinterpret_cast<const char*>(w + (n + kPrefetchRows) * rb);
        for (int64_t off = 0; off < rb; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
      }
      switch (nr) {
        case 4: dot_rows_avx2_reg<T, 4>(w + n * rb, k, act, r0, o + n, os); break;
        case 3: dot_rows_avx2_reg<T, 3>(w + n * rb, k, act, r0, o + n, os); break;
        case 2: dot_rows_avx2_reg<T, 2>(w + n * rb, k, act, r0, o + n, os); break;
        default: dot_rows_avx2_reg<T, 1>(w + n * rb, k, act, r0, o + n, os); break;
      }
    }
  }
}
#endif

#if defined(PAGEDLLM_HAVE_VNNI512)
// Per 32-bit lane (4 weights): sum q * (256 hi + lo), the hi digit's products shifted into place.
inline __m512i dot64(__m512i q, __m512i xh, __m512i xl) {
  return _mm512_dpbusd_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xh), 8), q, xl);
}

#endif

#if defined(PAGEDLLM_HAVE_VNNI512)
// Few activation rows: the 32-block formats are decoded straight into registers (no Chunk round trip).
struct RegChunk {
  __m512i q;
  __m512 a;
  __m128 b;
};

template <int64_t T>
constexpr bool has_reg_decode() {
  return T == kQ8_0 || T == kQ4_0 || T == kQ4_1 || T == kQ5_0 || T == kQ5_1;
}

template <int64_t T>
inline RegChunk decode_reg(const uint8_t* row, int64_t c, bool two) {
  constexpr int64_t bb = T == kQ8_0 ? 34 : T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ5_0 ? 22 : 24;
  const uint8_t* p0 = row + 2 * c * bb;
  const uint8_t* p1 = p0 + bb;
  const float d0 = fp16(p0), d1 = two ? fp16(p1) : 0.f;
  RegChunk out;
  out.a = _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
  if constexpr (T == kQ8_0) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p0 + 2));
    const __m256i v1 = two ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p1 + 2)) : _mm256_set1_epi8(-128);
    out.q = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v0), v1, 1), _mm512_set1_epi8(-128));
    out.b = _mm_setr_ps(-128.f * d0, -128.f * d0, -128.f * d1, -128.f * d1);
  } else {
    constexpr int64_t qs_off = (T == kQ4_0) ? 2 : (T == kQ4_1) ? 4 : (T == kQ5_0) ? 6 : 8;
    const __m128i v0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + qs_off));
    const __m128i v1 = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + qs_off)) : _mm_setzero_si128();
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(v0), v1, 1);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // [lo0 lo1 hi0 hi1]
    q = _mm512_shuffle_i64x2(q, q, _MM_SHUFFLE(3, 1, 2, 0));         // [lo0 hi0 lo1 hi1]
    if constexpr (T == kQ5_0 || T == kQ5_1) {
      uint32_t h0, h1 = 0;
      std::memcpy(&h0, p0 + qs_off - 4, 4);
      if (two) std::memcpy(&h1, p1 + qs_off - 4, 4);
      const __mmask64 mask = static_cast<__mmask64>(h0) | (static_cast<__mmask64>(h1) << 32);
      q = _mm512_or_si512(q, _mm512_maskz_mov_epi8(mask, _mm512_set1_epi8(0x10)));
    }
    out.q = q;
    float b0, b1;
    if constexpr (T == kQ4_0) {
      b0 = -8.f * d0, b1 = -8.f * d1;
    } else if constexpr (T == kQ5_0) {
      b0 = -16.f * d0, b1 = -16.f * d1;
    } else {
      b0 = fp16(p0 + 2), b1 = two ? fp16(p1 + 2) : 0.f;
    }
    out.b = _mm_setr_ps(b0, b0, b1, b1);
  }
  return out;
}

// Activation rows [0, R) times weight rows [0, W) (rows[w] apart by rb bytes), each chunk decoded once into
// registers; W > 1 gives the few-row case independent accumulation chains.
template <int64_t T, int R, int W>
inline void dot_rows_reg(const uint8_t* row, int64_t rb, int64_t k, const ActRows& act, float* out, int64_t os) {
  __m512 acc[W][R];
  __m128 accb[W][R];
  for (int w = 0; w < W; ++w)
    for (int r = 0; r < R; ++r) {
      acc[w][r] = _mm512_setzero_ps();
      accb[w][r] = _mm_setzero_ps();
    }
  const int64_t nchunks = (k + 63) / 64;
  for (int64_t c = 0; c < nchunks; ++c) {
    const bool two = 64 * c + 32 < k;
    RegChunk ch[W];
    for (int w = 0; w < W; ++w) ch[w] = decode_reg<T>(row + w * rb, c, two);
    for (int r = 0; r < R; ++r) {
      const __m512i xh = _mm512_loadu_si512(act.xhi(r) + 64 * c), xl = _mm512_loadu_si512(act.xlo(r) + 64 * c);
      const __m512 dx = _mm512_loadu_ps(act.dx(r) + 16 * c);
      const __m128 sx = _mm_loadu_ps(act.s(r) + 4 * c);
      for (int w = 0; w < W; ++w) {
        const __m512i d = dot64(ch[w].q, xh, xl);
        acc[w][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ch[w].a, dx), acc[w][r]);
        accb[w][r] = _mm_fmadd_ps(ch[w].b, sx, accb[w][r]);
      }
    }
  }
  for (int w = 0; w < W; ++w)
    for (int r = 0; r < R; ++r) {
      __m128 s = accb[w][r];
      s = _mm_add_ps(s, _mm_movehl_ps(s, s));
      s = _mm_add_ss(s, _mm_movehdup_ps(s));
      out[r * os + w] = _mm512_reduce_add_ps(acc[w][r]) + _mm_cvtss_f32(s);
    }
}

// out[r, n] for all m <= kRows activation rows and weight rows [n0, n1).
template <int64_t T, int R>
inline void gemm_reg(const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, int64_t k, const ActRows& act,
                     float* out, int64_t os) {
  constexpr int W = R == 1 ? 4 : R == 2 ? 2 : 1;
  int64_t n = n0;
  for (; n + W <= n1; n += W) dot_rows_reg<T, R, W>(w + n * rb, rb, k, act, out + n, os);
  for (; n < n1; ++n) dot_rows_reg<T, R, 1>(w + n * rb, rb, k, act, out + n, os);
}
#endif

template <int R>
inline void dot_rows(int64_t impl, const Chunk* chunks, int64_t nchunks, const ActRows& act, int64_t m0,
                     float* out) {
#if defined(PAGEDLLM_HAVE_VNNI512)
#endif
#if defined(__AVX2__)
  if (impl != kPortable) return dot_rows_avx2<R>(chunks, nchunks, act, m0, out);
#endif
  dot_rows_portable<R>(chunks, nchunks, act, m0, out);
}

struct Part {  // one weight matrix writing output columns [col, col + rows)
  const uint8_t* w;
  int64_t type, rows, col, rb;
};

#if defined(PAGEDLLM_HAVE_VNNI512)
// Many activation rows: W weight rows decoded once per tile into (q, per-lane scales, offsets), then
// multiplied by R activation rows at a time; the offsets' term is one short vector dot per output.
struct DecodedRow {
  std::vector<uint8_t> q;
  std::vector<float> a16, b;
  void resize(int64_t nchunks, int64_t nb) {
    q.resize(nchunks * 64);
    a16.resize(nchunks * 16);
    b.assign(nb, 0.f);
  }
};

template <int64_t T>
inline void decode_row(const uint8_t* row, int64_t k, int64_t nchunks, DecodedRow& d) {
  if constexpr (has_reg_decode<T>()) {
    for (int64_t c = 0; c < nchunks; ++c) {
      const RegChunk ch = decode_reg<T>(row, c, 64 * c + 32 < k);
      _mm512_storeu_si512(d.q.data() + 64 * c, ch.q);
      _mm512_storeu_ps(d.a16.data() + 16 * c, ch.a);
      _mm_storeu_ps(d.b.data() + 4 * c, ch.b);
    }
    return;
  }
  Chunk ch;
  for (int64_t c = 0; c < nchunks; ++c) {
    decode_chunk<T>(row, c, k, ch);
    std::memcpy(d.q.data() + 64 * c, ch.q, 64);
    for (int l = 0; l < 16; ++l) d.a16[16 * c + l] = ch.a[l / 4];
    for (int g = 0; g < 4; ++g) d.b[4 * c + g] = ch.b[g];
  }
}

template <int W, int R>
inline void dot_many(const DecodedRow* rows, int64_t nchunks, int64_t nb, const ActRows& act, int64_t m0, float* out,
                     int64_t os) {
  __m512 acc[W][R];
  for (int w = 0; w < W; ++w)
    for (int r = 0; r < R; ++r) acc[w][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < nchunks; ++c) {
    __m512i q[W];
    __m512 a[W];
    for (int w = 0; w < W; ++w) {
      q[w] = _mm512_loadu_si512(rows[w].q.data() + 64 * c);
      a[w] = _mm512_loadu_ps(rows[w].a16.data() + 16 * c);
    }
    for (int r = 0; r < R; ++r) {
      const __m512i xh = _mm512_loadu_si512(act.xhi(m0 + r) + 64 * c);
      const __m512i xl = _mm512_loadu_si512(act.xlo(m0 + r) + 64 * c);
      const __m512 dx = _mm512_loadu_ps(act.dx(m0 + r) + 16 * c);
      for (int w = 0; w < W; ++w) {
        const __m512i d = dot64(q[w], xh, xl);
        acc[w][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(a[w], dx), acc[w][r]);
      }
    }
  }
  for (int64_t j = 0; j < nb; j += 16)
    for (int r = 0; r < R; ++r) {
      const __m512 sx = _mm512_loadu_ps(act.s(m0 + r) + j);
      for (int w = 0; w < W; ++w) acc[w][r] = _mm512_fmadd_ps(_mm512_loadu_ps(rows[w].b.data() + j), sx, acc[w][r]);
    }
  for (int w = 0; w < W; ++w)
    for (int r = 0; r < R; ++r) out[r * os + w] = _mm512_reduce_add_ps(acc[w][r]);
}

template <int W>
inline void dot_many_rows(const DecodedRow* rows, int64_t nchunks, int64_t nb, const ActRows& act, int64_t m0,
                          int64_t nr, float* out, int64_t os) {
  switch (nr) {
    case 4: return dot_many<W, 4>(rows, nchunks, nb, act, m0, out, os);
    case 3: return dot_many<W, 3>(rows, nchunks, nb, act, m0, out, os);
    case 2: return dot_many<W, 2>(rows, nchunks, nb, act, m0, out, os);
    default: return dot_many<W, 1>(rows, nchunks, nb, act, m0, out, os);
  }
}

template <int64_t T>
void gemm_many(const Part& part, int64_t n0, int64_t n1, int64_t k, const ActRows& act, int64_t m, float* out,
               int64_t os) {
  const int64_t nchunks = (k + 63) / 64, nb = act.s_stride;
  DecodedRow rows[2];
  for (auto& r : rows) r.resize(nchunks, nb);
  for (int64_t t0 = 0; t0 < m; t0 += kTile) {
    const int64_t t1 = std::min(m, t0 + kTile);
    for (int64_t n = n0; n < n1; n += 2) {
      const int w = n + 1 < n1 ? 2 : 1;
      for (int i = 0; i < w; ++i) decode_row<T>(part.w + (n + i) * part.rb, k, nchunks, rows[i]);
      for (int64_t r = t0; r < t1; r += kRows) {
        const int64_t nr = std::min<int64_t>(kRows, t1 - r);
        if (w == 2) dot_many_rows<2>(rows, nchunks, nb, act, r, nr, out + r * os + n, os);
        else dot_many_rows<1>(rows, nchunks, nb, act, r, nr, out + r * os + n, os);
      }
    }
  }
}
#endif


// Output rows [n0, n1) of `part`, for all activation rows.
template <int64_t T>
void gemm_part(const Part& part, int64_t n0, int64_t n1, int64_t k, const ActRows& act, int64_t m, float* out,
               int64_t os, const float* bias, int64_t impl, std::vector<Chunk>& chunks) {
  const int64_t nchunks = (k + 63) / 64;
#if defined(PAGEDLLM_HAVE_VNNI512)
  if constexpr (has_reg_decode<T>()) {
    if (impl == kBest && m <= kRows) {
      float* o = out + part.col;
      switch (m) {
        case 4: gemm_reg<T, 4>(part.w, part.rb, n0, n1, k, act, o, os); break;
        case 3: gemm_reg<T, 3>(part.w, part.rb, n0, n1, k, act, o, os); break;
        case 2: gemm_reg<T, 2>(part.w, part.rb, n0, n1, k, act, o, os); break;
        default: gemm_reg<T, 1>(part.w, part.rb, n0, n1, k, act, o, os); break;
      }
      if (bias)
        for (int64_t i = 0; i < m; ++i)
          for (int64_t n = n0; n < n1; ++n) o[i * os + n] += bias[part.col + n];
      return;
    }
  }
#endif
#if defined(__AVX2__) && !defined(PAGEDLLM_HAVE_VNNI512)
  if (impl == kBest) {
    float* o = out + part.col;
    gemm_avx2_reg<T>(part.w, part.rb, n0, n1, k, act, m, o, os);
    if (bias)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t n = n0; n < n1; ++n) o[i * os + n] += bias[part.col + n];
    return;
  }
#endif
#if defined(PAGEDLLM_HAVE_VNNI512)
  if (impl == kBest) {
    float* o = out + part.col;
    gemm_many<T>(part, n0, n1, k, act, m, o, os);
    if (bias)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t n = n0; n < n1; ++n) o[i * os + n] += bias[part.col + n];
    return;
  }
#endif
  chunks.resize(nchunks);
  for (int64_t t0 = 0; t0 < m; t0 += kTile) {
    const int64_t t1 = std::min(m, t0 + kTile);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = part.w + n * part.rb;
      for (int64_t c = 0; c < nchunks; ++c) decode_chunk<T>(row, c, k, chunks[c]);
      const float bv = bias ? bias[part.col + n] : 0.f;
      float res[kRows];
      for (int64_t r = t0; r < t1; r += kRows) {
        const int64_t nr = std::min<int64_t>(kRows, t1 - r);
        switch (nr) {
          case 4: dot_rows<4>(impl, chunks.data(), nchunks, act, r, res); break;
          case 3: dot_rows<3>(impl, chunks.data(), nchunks, act, r, res); break;
          case 2: dot_rows<2>(impl, chunks.data(), nchunks, act, r, res); break;
          default: dot_rows<1>(impl, chunks.data(), nchunks, act, r, res); break;
        }
        for (int64_t i = 0; i < nr; ++i) out[(r + i) * os + part.col + n] = res[i] + bv;
      }
    }
  }
}

#if defined(PAGEDLLM_HAVE_VNNI512)
// Two or more activation rows (from kFloatMinRows): the integer product costs two vpdpbusd, a shift and a
// float rescale per 64 weights and row, and it grows with every row; here each 64-weight chunk is dequantized
// once to float32 in registers and multiplied by up to 8 float32 activation rows (4 FMAs per row), which is
// also exact in the activations. x: rows of k64 floats, zero past k.
// The 16 weights [16 h, 16 h + 16) of a 32-weight block as float32.
template <int64_t T>
inline __m512 block32_f32(const uint8_t* blk, int h) {
  const float d = fp16(blk);
  if constexpr (T == kQ8_0) {
    const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * h)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(d));
  } else {
    constexpr int64_t qs_off = (T == kQ4_0) ? 2 : (T == kQ4_1) ? 4 : (T == kQ5_0) ? 6 : 8;
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + qs_off));
    __m128i q = _mm_and_si128(h ? _mm_srli_epi16(v, 4) : v, _mm_set1_epi8(0x0F));
    if constexpr (T == kQ5_0 || T == kQ5_1) {
      uint32_t qh;
      std::memcpy(&qh, blk + qs_off - 4, 4);
      q = _mm_or_si128(q, _mm_maskz_mov_epi8(static_cast<__mmask16>(qh >> (16 * h)), _mm_set1_epi8(0x10)));
    }
    const float off = T == kQ4_0 ? -8.f * d : T == kQ5_0 ? -16.f * d : fp16(blk + 2);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), _mm512_set1_ps(d), _mm512_set1_ps(off));
  }
}

template <int64_t T, int R>
inline void dot_rows_f32(const uint8_t* row, int64_t k, const float* x, int64_t xs, float* out, int64_t os) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  if constexpr (has_reg_decode<T>()) {
    constexpr int64_t bb = T == kQ8_0 ? 34 : T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ5_0 ? 22 : 24;
    for (int64_t b = 0; b < k / 32; ++b) {
      for (int h = 0; h < 2; ++h) {
        const __m512 w = block32_f32<T>(row + b * bb, h);
        for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * xs + 32 * b + 16 * h), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * os] = _mm512_reduce_add_ps(acc[r]);
    return;
  }
  const int64_t nchunks = (k + 63) / 64;
  Chunk ch;
  for (int64_t c = 0; c < nchunks; ++c) {
    decode_chunk<T>(row, c, k, ch);
    for (int g = 0; g < 4; ++g) {
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(ch.q + 16 * g))));
      const __m512 w = _mm512_fmadd_ps(q, _mm512_set1_ps(ch.a[g]), _mm512_set1_ps(ch.b[g]));
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + r * xs + 64 * c + 16 * g), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r * os] = _mm512_reduce_add_ps(acc[r]);
}

template <int64_t T>
void gemm_f32(const Part& part, int64_t n0, int64_t n1, int64_t k, const float* x, int64_t xs, int64_t m,
              float* out, int64_t os) {
  for (int64_t r0 = 0; r0 < m; r0 += 8) {
    const int64_t nr = std::min<int64_t>(8, m - r0);
    const float* xr = x + r0 * xs;
    float* o = out + r0 * os + part.col;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = part.w + n * part.rb;
      switch (nr) {
        case 8: dot_rows_f32<T, 8>(row, k, xr, xs, o + n, os); break;
        case 7: dot_rows_f32<T, 7>(row, k, xr, xs, o + n, os); break;
        case 6: dot_rows_f32<T, 6>(row, k, xr, xs, o + n, os); break;
        case 5: dot_rows_f32<T, 5>(row, k, xr, xs, o + n, os); break;
        case 4: dot_rows_f32<T, 4>(row, k, xr, xs, o + n, os); break;
        case 3: dot_rows_f32<T, 3>(row, k, xr, xs, o + n, os); break;
        case 2: dot_rows_f32<T, 2>(row, k, xr, xs, o + n, os); break;
        default: dot_rows_f32<T, 1>(row, k, xr, xs, o + n, os); break;
      }
    }
  }
}

void gemm_f32_dispatch(const Part& part, int64_t n0, int64_t n1, int64_t k, const float* x, int64_t xs, int64_t m,
                       float* out, int64_t os) {
  visit_type(part.type, "", [&](auto t) { gemm_f32<decltype(t)::value>(part, n0, n1, k, x, xs, m, out, os); });
}
#endif

void gemm_dispatch(const Part& part, int64_t n0, int64_t n1, int64_t k, const ActRows& act, int64_t m,
                   float* out, int64_t os, const float* bias, int64_t impl, std::vector<Chunk>& chunks) {
  visit_type(part.type, "", [&](auto t) {
    gemm_part<decltype(t)::value>(part, n0, n1, k, act, m, out, os, bias, impl, chunks);
  });
}

// ---------------------------------------------------------------------------------------------------------
// Tiled layouts (repacked at load by gguf_tile): the weights of 16 output rows ("a group") interleaved so that
// one zmm holds 4 consecutive weights of each of the 16 rows, one 32-bit lane per row. Activations are then
// broadcast (4 int8 digits per vpdpbusd) and each instruction feeds 16 outputs with no horizontal sums, so a
// weight block decoded once serves up to 8 activation rows from registers: from one row (decode) to thousands
// (prefill) this beats both the per-row kernels above and oneDNN's fp32 product.
// Type id kTiled + T for T in {Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K}; tensor [rows / 16, group bytes].
// Per group, per 32-weight (sub-)block, one tile of quants:
//   4-bit: 4 x 64 B, vector v lane j byte p = q[j][4v + p] | q[j][4v + 16 + p] << 4 (quads v and v + 4);
//   5-bit: the same plus 8 x 8 B masks, bit 4j + p of mask u = bit 4 of q[j][4u + p];
//   8-bit: 8 x 64 B, vector u lane j byte p = q[j][4u + p] (Q8_0: int8 ^ 0x80);
// and the 16 rows' scales, weight = d q + off:
//   32-block types: after the quants d[16] fp16 and, for Q4_1 / Q5_1, m[16] fp16 (off = m, else -c d), so a
//     group holds exactly its 16 rows' bytes;
//   Q4_K / Q5_K: per 256-weight super-block a header d[16], dmin[16] fp16, then 8 tiles, each followed by
//     sc[16], mn[16] (the 6-bit sub-block scales as bytes): d = d sc, off = -dmin mn (2-3% over the file);
//   Q6_K (6-bit: the 4-bit vectors plus masks of bit 4 and of bit 5): per super-block a header d[16] fp16,
//     then 8 tiles, each followed by the int8 scales of its two halves, sc[16] for weights 0-15 and sc[16]
//     for 16-31: d = d sc, off = -32 d per half; the halves are the quads of qa and qb, so the kernel keeps
//     one integer sum per half (exactly the file's size);
//   int8 rows (kI8Row, K a multiple of 32): a header of the 16 rows' fp32 scales, then 8-bit tiles
//     (int8 ^ 0x80) with no per-tile scales: d = scale, off = -128 d (exactly the rows' bytes).
constexpr int64_t kTiled = 2000;
// The tiled kernel's helpers pass __m512 values: forced inline, however many types and row counts this file
// instantiates them for (GCC's inlining budget is per file).
#define PAGEDLLM_ALWAYS_INLINE inline __attribute__((always_inline))

inline bool tileable(int64_t t) {
  return t == kQ4_0 || t == kQ4_1 || t == kQ5_0 || t == kQ5_1 || t == kQ8_0 || t == kQ4_K || t == kQ5_K ||
         t == kQ6_K || t == kI8Row;
}
inline bool is_tiled(int64_t t) { return t > kTiled && tileable(t - kTiled); }

template <int64_t T>
constexpr bool kquant() { return T == kQ4_K || T == kQ5_K || T == kQ6_K; }
template <int64_t T>
constexpr bool split_halves() { return T == kQ6_K; }  // a scale per 16 weights
template <int64_t T>
constexpr int qbits() {
  return (T == kQ8_0 || T == kI8Row) ? 8 : T == kQ6_K ? 6 : (T == kQ5_0 || T == kQ5_1 || T == kQ5_K) ? 5 : 4;
}
template <int64_t T>
constexpr bool tile_has_min() { return T == kQ4_1 || T == kQ5_1; }
template <int64_t T>
constexpr int64_t tile_qbytes() { return qbits<T>() == 8 ? 512 : qbits<T>() == 6 ? 384 : qbits<T>() == 5 ? 320 : 256; }
// Where bit b (4 or 5) of a 5/6-bit tile's quants starts: 8 masks of 8 bytes after the 4-bit vectors.
constexpr int64_t bit_plane(int b) { return 256 + 64 * (b - 4); }
// Bytes from one tile to the next (K-quants: within a super-block).
template <int64_t T>
constexpr int64_t tile_stride() {
  return tile_qbytes<T>() + (T == kI8Row ? 0 : kquant<T>() ? 32 : tile_has_min<T>() ? 64 : 32);
}
template <int64_t T>
constexpr int64_t superblock_header() { return T == kQ6_K ? 32 : 64; }
template <int64_t T>
constexpr int64_t superblock_bytes() { return superblock_header<T>() + 8 * tile_stride<T>(); }
template <int64_t T>
constexpr float tile_offset_c() {
  return T == kQ4_0 ? 8.f : T == kQ5_0 ? 16.f : (T == kQ8_0 || T == kI8Row) ? 128.f : 0.f;
}

inline int64_t tiled_group_bytes(int64_t type, int64_t k) {
  const int64_t base = type - kTiled;
  if (base == kQ4_K) return k / 256 * (64 + 8 * (256 + 32));
  if (base == kQ5_K) return k / 256 * (64 + 8 * (320 + 32));
  if (base == kQ6_K) return k / 256 * (32 + 8 * (384 + 32));
  return 16 * row_bytes(base, k);
}
inline int64_t tiled_block_elems(int64_t type) { return block_elems(type - kTiled); }

template <int64_t T>
PAGEDLLM_ALWAYS_INLINE const uint8_t* tile_ptr(const uint8_t* grp, int64_t blk) {
  if constexpr (T == kI8Row) return grp + 64 + blk * tile_stride<T>();
  if constexpr (kquant<T>())
    return grp + (blk / 8) * superblock_bytes<T>() + superblock_header<T>() + (blk % 8) * tile_stride<T>();
  else return grp + blk * tile_stride<T>();
}

// The unsigned quant of weight kk of row j in a tile.
template <int64_t T>
inline int tile_q(const uint8_t* t, int j, int kk) {
  const int u = kk / 4, p = kk % 4;
  if constexpr (qbits<T>() == 8) {
    return t[64 * u + 4 * j + p];
  } else {
    const uint8_t byte = t[64 * (u % 4) + 4 * j + p];
    int q = u < 4 ? (byte & 0xF) : (byte >> 4);
    for (int b = 4; b < qbits<T>(); ++b) {  // bits 4 (and 5) from their mask planes
      uint64_t mask;
      std::memcpy(&mask, t + bit_plane(b) + 8 * u, 8);
      q |= static_cast<int>((mask >> (4 * j + p)) & 1u) << b;
    }
    return q;
  }
}

// Row j's scale and offset in block blk (what the scalar paths use; the vector kernel computes the same).
template <int64_t T>
inline void tile_scale(const uint8_t* grp, int64_t blk, int j, float& d, float& off, int half = 0) {
  const uint8_t* t = tile_ptr<T>(grp, blk);
  if constexpr (T == kI8Row) {
    std::memcpy(&d, grp + 4 * j, 4);
    off = -128.f * d;
  } else if constexpr (T == kQ6_K) {
    const uint8_t* head = grp + (blk / 8) * superblock_bytes<T>();
    const int8_t* sc = reinterpret_cast<const int8_t*>(t + tile_qbytes<T>()) + 16 * half;
    d = fp16(head + 2 * j) * static_cast<float>(sc[j]);
    off = -32.f * d;
  } else if constexpr (kquant<T>()) {
    const uint8_t* head = grp + (blk / 8) * superblock_bytes<T>();
    const uint8_t* s = t + tile_qbytes<T>();
    d = fp16(head + 2 * j) * static_cast<float>(s[j]);
    off = -(fp16(head + 32 + 2 * j) * static_cast<float>(s[16 + j]));
  } else {
    d = fp16(t + tile_qbytes<T>() + 2 * j);
    if constexpr (tile_has_min<T>()) off = fp16(t + tile_qbytes<T>() + 32 + 2 * j);
    else off = -tile_offset_c<T>() * d;
  }
}

// One tile's quants from q[16][32] (unsigned, < 2^qbits).
template <int64_t T>
inline void pack_tile(const uint8_t (*q)[32], uint8_t* t) {
  std::memset(t, 0, tile_qbytes<T>());
  for (int j = 0; j < 16; ++j)
    for (int kk = 0; kk < 32; ++kk) {
      const int u = kk / 4, p = kk % 4, v = q[j][kk];
      if constexpr (qbits<T>() == 8) {
        t[64 * u + 4 * j + p] = static_cast<uint8_t>(v);
      } else {
        t[64 * (u % 4) + 4 * j + p] |= static_cast<uint8_t>((v & 0xF) << (u < 4 ? 0 : 4));
        for (int b = 4; b < qbits<T>(); ++b)
          if ((v >> b) & 1) t[bit_plane(b) + 8 * u + (4 * j + p) / 8] |= static_cast<uint8_t>(1u << ((4 * j + p) % 8));
      }
    }
}

template <int64_t T>
void tile_group(const uint8_t* src, int64_t rb, int64_t k, uint8_t* dst) {
  uint8_t q[16][32];
  if constexpr (T == kI8Row) {
    for (int j = 0; j < 16; ++j) std::memcpy(dst + 4 * j, src + j * rb, 4);  // the rows' scales
    for (int64_t blk = 0; blk < k / 32; ++blk) {
      for (int j = 0; j < 16; ++j)
        for (int kk = 0; kk < 32; ++kk) q[j][kk] = src[j * rb + 4 + 32 * blk + kk] ^ 0x80;
      pack_tile<T>(q, dst + 64 + blk * tile_stride<T>());
    }
  } else if constexpr (T == kQ6_K) {
    Chunk ch;
    for (int64_t sb = 0; sb < k / 256; ++sb) {
      uint8_t* head = dst + sb * superblock_bytes<T>();
      for (int j = 0; j < 16; ++j) std::memcpy(head + 2 * j, src + j * rb + sb * 210 + 208, 2);  // d
      for (int sub = 0; sub < 8; ++sub) {
        uint8_t* t = head + superblock_header<T>() + sub * tile_stride<T>();
        for (int j = 0; j < 16; ++j) {
          decode_chunk<T>(src + j * rb, sb * 4 + sub / 2, k, ch);
          std::memcpy(q[j], ch.q + 32 * (sub % 2), 32);
          const int8_t* scales = reinterpret_cast<const int8_t*>(src + j * rb + sb * 210 + 192);
          t[tile_qbytes<T>() + j] = static_cast<uint8_t>(scales[2 * sub]);
          t[tile_qbytes<T>() + 16 + j] = static_cast<uint8_t>(scales[2 * sub + 1]);
        }
        pack_tile<T>(q, t);
      }
    }
  } else if constexpr (kquant<T>()) {
    constexpr int64_t bb = T == kQ4_K ? 144 : 176;
    Chunk ch;
    for (int64_t sb = 0; sb < k / 256; ++sb) {
      uint8_t* head = dst + sb * superblock_bytes<T>();
      for (int j = 0; j < 16; ++j) {
        std::memcpy(head + 2 * j, src + j * rb + sb * bb, 2);       // d
        std::memcpy(head + 32 + 2 * j, src + j * rb + sb * bb + 2, 2);  // dmin
      }
      for (int sub = 0; sub < 8; ++sub) {
        uint8_t* t = head + 64 + sub * tile_stride<T>();
        for (int j = 0; j < 16; ++j) {
          decode_chunk<T>(src + j * rb, sb * 4 + sub / 2, k, ch);
          std::memcpy(q[j], ch.q + 32 * (sub % 2), 32);
          float sc, mn;
          scale_min_k4(src + j * rb + sb * bb + 4, sub, sc, mn);
          t[tile_qbytes<T>() + j] = static_cast<uint8_t>(sc);
          t[tile_qbytes<T>() + 16 + j] = static_cast<uint8_t>(mn);
        }
        pack_tile<T>(q, t);
      }
    }
  } else {
    constexpr int64_t bb = T == kQ8_0 ? 34 : T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ5_0 ? 22 : 24;
    constexpr int64_t QB = tile_qbytes<T>();
    float a[2], b[2];
    for (int64_t blk = 0; blk < k / 32; ++blk) {
      uint8_t* t = dst + blk * tile_stride<T>();
      for (int j = 0; j < 16; ++j) {
        const uint8_t* s = src + j * rb + blk * bb;
        decode_block32<T>(s, q[j], a, b);
        std::memcpy(t + QB + 2 * j, s, 2);                                            // d, as stored
        if constexpr (tile_has_min<T>()) std::memcpy(t + QB + 32 + 2 * j, s + 2, 2);  // m
      }
      pack_tile<T>(q, t);
    }
  }
}

template <int64_t T>
void dequant_tiled_row(const uint8_t* grp, int j, int64_t k, float* out) {
  for (int64_t blk = 0; blk < k / 32; ++blk) {
    const uint8_t* t = tile_ptr<T>(grp, blk);
    float d, off;
    for (int kk = 0; kk < 32; ++kk) {
      if (kk % 16 == 0 && (kk == 0 || split_halves<T>())) tile_scale<T>(grp, blk, j, d, off, kk / 16);
      out[32 * blk + kk] = std::fma(d, static_cast<float>(tile_q<T>(t, j, kk)), off);
    }
  }
}

// Portable: the same integer sums and float formula as the vector kernel, one output at a time.
template <int64_t T>
void tiled_rows_portable(const uint8_t* grp, int64_t k, const ActRows& act, int64_t m0, int64_t nr, float* out,
                         int64_t os) {
  for (int64_t r = 0; r < nr; ++r) {
    const int8_t* x = act.xhl(m0 + r);
    for (int j = 0; j < 16; ++j) {
      float acc = 0.f;
      for (int64_t blk = 0; blk < k / 32; ++blk) {
        const uint8_t* t = tile_ptr<T>(grp, blk);
        constexpr int halves = split_halves<T>() ? 2 : 1;
        int32_t hi[2] = {0, 0}, lo[2] = {0, 0};
        for (int kk = 0; kk < 32; ++kk) {
          const int q = tile_q<T>(t, j, kk), h = halves == 2 ? kk / 16 : 0;
          hi[h] += q * x[64 * blk + kk];
          lo[h] += q * x[64 * blk + 32 + kk];
        }
        for (int h = 0; h < halves; ++h) {
          float d, off;
          tile_scale<T>(grp, blk, j, d, off, h);
          const float tot = static_cast<float>(hi[h] * 256 + lo[h]);
          acc = std::fma(tot, d * act.step32(m0 + r)[blk], acc);
        }
        for (int h = 0; h < halves; ++h) {
          float d, off;
          tile_scale<T>(grp, blk, j, d, off, h);
          acc = std::fma(off, halves == 2 ? act.sum16(m0 + r)[2 * blk + h] : act.sum32(m0 + r)[blk], acc);
        }
      }
      out[r * os + j] = acc;
    }
  }
}

#if defined(PAGEDLLM_HAVE_VNNI512)
PAGEDLLM_ALWAYS_INLINE __m512i bcast32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The tile's quads v and v + 4 as unsigned bytes.
template <int64_t T>
PAGEDLLM_ALWAYS_INLINE void tile_quads(const uint8_t* t, int v, __m512i& qa, __m512i& qb) {
  if constexpr (qbits<T>() == 8) {
    qa = _mm512_loadu_si512(t + 64 * v);
    qb = _mm512_loadu_si512(t + 64 * (v + 4));
  } else {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i n = _mm512_loadu_si512(t + 64 * v);
    qa = _mm512_and_si512(n, m4);
    qb = _mm512_and_si512(_mm512_srli_epi16(n, 4), m4);
    for (int b = 4; b < qbits<T>(); ++b) {  // bits 4 (and 5) from their mask planes
      uint64_t ma, mb;
      std::memcpy(&ma, t + bit_plane(b) + 8 * v, 8);
      std::memcpy(&mb, t + bit_plane(b) + 8 * (v + 4), 8);
      const __m512i bit = _mm512_set1_epi8(static_cast<char>(1 << b));
      qa = _mm512_or_si512(qa, _mm512_maskz_mov_epi8(static_cast<__mmask64>(ma), bit));
      qb = _mm512_or_si512(qb, _mm512_maskz_mov_epi8(static_cast<__mmask64>(mb), bit));
    }
  }
}

PAGEDLLM_ALWAYS_INLINE __m512 load_fp16x16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
PAGEDLLM_ALWAYS_INLINE __m512 load_u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
PAGEDLLM_ALWAYS_INLINE __m512 negate(__m512 v) {
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
}

// The 16 rows' scales and offsets of block blk, as tile_scale computes them.
template <int64_t T>
PAGEDLLM_ALWAYS_INLINE void tile_scale_vec(const uint8_t* grp, int64_t blk, __m512& d, __m512& off, int half = 0) {
  const uint8_t* t = tile_ptr<T>(grp, blk);
  if constexpr (T == kI8Row) {
    d = _mm512_loadu_ps(grp);
    off = _mm512_mul_ps(_mm512_set1_ps(-128.f), d);
  } else if constexpr (T == kQ6_K) {
    const uint8_t* head = grp + (blk / 8) * superblock_bytes<T>();
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(t + tile_qbytes<T>() + 16 * half))));
    d = _mm512_mul_ps(load_fp16x16(head), sc);
    off = _mm512_mul_ps(_mm512_set1_ps(-32.f), d);
  } else if constexpr (kquant<T>()) {
    const uint8_t* head = grp + (blk / 8) * superblock_bytes<T>();
    const uint8_t* s = t + tile_qbytes<T>();
    d = _mm512_mul_ps(load_fp16x16(head), load_u8x16(s));
    off = negate(_mm512_mul_ps(load_fp16x16(head + 32), load_u8x16(s + 16)));
  } else {
    d = load_fp16x16(t + tile_qbytes<T>());
    if constexpr (tile_has_min<T>()) off = load_fp16x16(t + tile_qbytes<T>() + 32);
    else off = _mm512_mul_ps(_mm512_set1_ps(-tile_offset_c<T>()), d);
  }
}

// Activation rows [m0, m0 + R) times W consecutive groups (gb bytes apart): out[r, 16 w + j]. Q6_K (scales per
// 16 weights) keeps one integer sum per half block (H = 2): qa holds the first half's quads, qb the second's.
template <int64_t T, int R, int W>
PAGEDLLM_ALWAYS_INLINE void tiled_rows(const uint8_t* grp, int64_t gb, int64_t k, const ActRows& act, int64_t m0,
                                       float* out, int64_t os) {
  constexpr int H = split_halves<T>() ? 2 : 1;
  __m512 acc[W][R];
  for (int w = 0; w < W; ++w)
    for (int r = 0; r < R; ++r) acc[w][r] = _mm512_setzero_ps();
  for (int64_t blk = 0; blk < k / 32; ++blk) {
    __m512i hi[W][R][H], lo[W][R][H];
    for (int w = 0; w < W; ++w)
      for (int r = 0; r < R; ++r)
        for (int h = 0; h < H; ++h) hi[w][r][h] = lo[w][r][h] = _mm512_setzero_si512();
    for (int v = 0; v < 4; ++v) {
      for (int w = 0; w < W; ++w) {
        __m512i qa, qb;
        tile_quads<T>(tile_ptr<T>(grp + w * gb, blk), v, qa, qb);
        for (int r = 0; r < R; ++r) {
          const int8_t* xh = act.xhl(m0 + r) + 64 * blk + 4 * v;
          const int8_t* xl = xh + 32;
          hi[w][r][0] = _mm512_dpbusd_epi32(hi[w][r][0], qa, bcast32(xh));
          lo[w][r][0] = _mm512_dpbusd_epi32(lo[w][r][0], qa, bcast32(xl));
          hi[w][r][H - 1] = _mm512_dpbusd_epi32(hi[w][r][H - 1], qb, bcast32(xh + 16));
          lo[w][r][H - 1] = _mm512_dpbusd_epi32(lo[w][r][H - 1], qb, bcast32(xl + 16));
        }
      }
    }
    for (int w = 0; w < W; ++w) {
      __m512 d[H], off[H];
      for (int h = 0; h < H; ++h) tile_scale_vec<T>(grp + w * gb, blk, d[h], off[h], h);
      for (int r = 0; r < R; ++r) {
        const __m512 step = _mm512_set1_ps(act.step32(m0 + r)[blk]);
        for (int h = 0; h < H; ++h) {  // the order of tiled_rows_portable's sums
          const __m512i tot = _mm512_add_epi32(_mm512_slli_epi32(hi[w][r][h], 8), lo[w][r][h]);
          acc[w][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot), _mm512_mul_ps(d[h], step), acc[w][r]);
        }
        for (int h = 0; h < H; ++h) {
          const float sx = H == 2 ? act.sum16(m0 + r)[2 * blk + h] : act.sum32(m0 + r)[blk];
          acc[w][r] = _mm512_fmadd_ps(off[h], _mm512_set1_ps(sx), acc[w][r]);
        }
      }
    }
  }
  for (int w = 0; w < W; ++w)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * os + 16 * w, acc[w][r]);
}

// Up to 8 rows (4 for Q6_K's doubled sums) against one group.
template <int64_t T>
inline void tiled_rows_n(int64_t nr, const uint8_t* grp, int64_t gb, int64_t k, const ActRows& act, int64_t m0,
                         float* out, int64_t os) {
  if constexpr (!split_halves<T>()) {
    switch (nr) {
      case 8: return tiled_rows<T, 8, 1>(grp, gb, k, act, m0, out, os);
      case 7: return tiled_rows<T, 7, 1>(grp, gb, k, act, m0, out, os);
      case 6: return tiled_rows<T, 6, 1>(grp, gb, k, act, m0, out, os);
      case 5: return tiled_rows<T, 5, 1>(grp, gb, k, act, m0, out, os);
      default: break;
    }
  }
  switch (nr) {
    case 4: return tiled_rows<T, 4, 1>(grp, gb, k, act, m0, out, os);
    case 3: return tiled_rows<T, 3, 1>(grp, gb, k, act, m0, out, os);
    case 2: return tiled_rows<T, 2, 1>(grp, gb, k, act, m0, out, os);
    default: return tiled_rows<T, 1, 1>(grp, gb, k, act, m0, out, os);
  }
}

template <int64_t T>
void tiled_part_vnni(const Part& p, int64_t g0, int64_t g1, int64_t k, const ActRows& act, int64_t m, float* out,
                     int64_t os) {
  constexpr int64_t kRowTile = split_halves<T>() ? 4 : 8;
  float* o = out + p.col;
  const int64_t gb = p.rb;
  for (int64_t t0 = 0; t0 < m; t0 += kTile) {
    const int64_t t1 = std::min(m, t0 + kTile), nr = t1 - t0;
    int64_t g = g0;
    if (nr <= 2) {  // few rows: several groups at once for independent accumulation chains
      for (; g + 4 <= g1 && nr == 1; g += 4) tiled_rows<T, 1, 4>(p.w + g * gb, gb, k, act, t0, o + t0 * os + 16 * g, os);
      for (; g + 2 <= g1; g += 2) {
        if (nr == 1) tiled_rows<T, 1, 2>(p.w + g * gb, gb, k, act, t0, o + t0 * os + 16 * g, os);
        else tiled_rows<T, 2, 2>(p.w + g * gb, gb, k, act, t0, o + t0 * os + 16 * g, os);
      }
    }
    // Row tiles outside: a tile's activation rows stay in L1 while the groups' weights stream from L2.
    const int64_t gs = g;
    for (int64_t r = t0; r < t1; r += kRowTile)
      for (g = gs; g < g1; ++g)
        tiled_rows_n<T>(std::min(kRowTile, t1 - r), p.w + g * gb, gb, k, act, r, o + r * os + 16 * g, os);
  }
}
#endif

template <int64_t T>
void tiled_part(const Part& p, int64_t g0, int64_t g1, int64_t k, const ActRows& act, int64_t m, float* out,
                int64_t os, int64_t impl) {
#if defined(PAGEDLLM_HAVE_VNNI512)
  if (impl == kBest) return tiled_part_vnni<T>(p, g0, g1, k, act, m, out, os);
#endif
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t r = 0; r < m; r += kTile)
      tiled_rows_portable<T>(p.w + g * p.rb, k, act, r, std::min<int64_t>(kTile, m - r), out + r * os + p.col + 16 * g,
                             os);
}

void tiled_dispatch(const Part& p, int64_t g0, int64_t g1, int64_t k, const ActRows& act, int64_t m, float* out,
                    int64_t os, int64_t impl) {
  visit_type(p.type - kTiled, "tiled ", [&](auto t) {
    tiled_part<decltype(t)::value>(p, g0, g1, k, act, m, out, os, impl);
  });
}

// ---------------------------------------------------------------------------------------------------------
// The AVX2 row layout (repacked at load by gguf_a2pack, for machines whose best path is AVX2): each weight row
// keeps its own bytes, regrouped so that the int16 products need no shuffles. Per row, the 32-blocks are taken
// two at a time ("a chunk", 64 weights) and four chunks at a time ("a group", 256 weights):
//   per chunk, 4-bit types (Q4_0, Q4_1: the two blocks' 16 quant bytes as in the file; Q4_K: its two
//     sub-blocks' nibbles regrouped the same way): 32 B whose 16-bit word t holds, nibble i = 0..3, the weight
//     idx(i, t) of the chunk; Q8_0: 64 B, two vectors whose word t holds, byte i & 1 of vector i >> 1, the weight
//     idx(i, t) (the same order, so one activation layout serves every type);
//   per group, after its chunks, the blocks' scales (a2_scale_bytes): fp16 d (then Q4_1's fp16 m) per block;
//     Q4_K: its super-block's d and dmin, its 6-bit sub-block scales and mins as bytes. The kernel takes them
//     in the order in which two rounds of vphaddd leave the blocks' sums (kA2Order: 0, 2, 4, 6, 1, 3, 5, 7).
// idx(i, t) = 32 (b >> 4) + (b & 15) + 16 (i & 1), b = 2 t + (i >> 1): every 32-bit lane of a vpmaddwd product
// sums weights of one block (lanes 0-3 the chunk's first block, 4-7 its second), so each group needs one
// float rescale of its eight block sums. A chunk costs one load, four masks or shifts and four vpmaddwd of the
// int16 activations (stored in the same order) per activation row: the 16-bit activations' precision (see the
// top of this file) at a third of the instructions of the row kernels above.
constexpr int64_t kA2 = 3000;
inline bool a2able(int64_t t) { return t == kQ4_0 || t == kQ4_1 || t == kQ8_0 || t == kQ4_K || t == kQ6_K; }
inline bool is_a2(int64_t t) { return t > kA2 && a2able(t - kA2); }
constexpr int64_t kA2Rows = 4;  // activation rows per pass over a weight row
constexpr int kA2Order[8] = {0, 2, 4, 6, 1, 3, 5, 7};
inline int a2_order_pos(int64_t block) { return static_cast<int>((block >> 1) + 4 * (block & 1)); }  // in kA2Order
inline int a2_idx(int i, int t) {
  const int b = 2 * t + (i >> 1);
  return 32 * (b >> 4) + (b & 15) + 16 * (i & 1);
}
template <int64_t T>
constexpr int64_t a2_chunk_bytes() { return T == kQ8_0 ? 64 : 32; }
template <int64_t T>
constexpr int64_t a2_halves() { return T == kQ4_1 ? 2 : 1; }  // fp16 d, and m for Q4_1
// A group of nbt blocks keeps nbt rounded up to even fp16 values of d (then of m): a row's last group (fewer
// than 8 blocks) no more than its blocks', so that a row takes the file's bytes (odd block counts aside: their
// last chunk and scale are padded with zeros).
inline int64_t a2_slots(int64_t nbt) { return nbt + (nbt & 1); }
// Q4_K (K a multiple of 256: every group one super-block): d, dmin (fp16), then the eight 6-bit sub-block
// scales and mins as bytes in kA2Order (sc[8], mn[8]): 148 bytes per 256 weights for the file's 144.
// Q6_K: the chunks hold its low 4 bits; after them two 32 B planes of the high 2 bits (plane u, word t, bits
// 2 j: chunk 2 u + j / 4's weight idx(j % 4, t)), its sixteen int8 scales (per 16 weights) in kA2Units order, d:
// the file's 210 bytes.
template <int64_t T>
inline int64_t a2_scale_bytes(int64_t nbt) {
  return T == kQ4_K ? 20 : T == kQ6_K ? 82 : 2 * a2_slots(nbt) * a2_halves<T>();
}
// Q6_K's 16-weight units (2 block + half) in the order in which the kernel's vphaddd rounds leave their sums.
constexpr int kA2Units[16] = {0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15};
// The slot in kA2Order of each of those units' block (unit >> 1): where its activation step is.
constexpr int kA2UnitSteps[16] = {0, 0, 1, 1, 4, 4, 5, 5, 2, 2, 3, 3, 6, 6, 7, 7};
// The quant of vector i lane t of a chunk (at q), as the kernels see it: Q8_0 signed, 4-bit types unsigned.
template <int64_t T>
inline int a2_q_at(const uint8_t* q, int i, int t) {
  if constexpr (T == kQ8_0) return static_cast<int8_t>(q[32 * (i >> 1) + 2 * t + (i & 1)]);
  return (q[2 * t + (i >> 1)] >> (4 * (i & 1))) & 0x0F;
}
// Q6_K: the weight q - 32 of chunk c's vector i lane t in a super-block's bytes grp.
inline int a2_q6k_at(const uint8_t* grp, int c, int i, int t) {
  const int bit = 2 * (4 * (c & 1) + i);
  const int hi = (grp[128 + 32 * (c >> 1) + 2 * t + bit / 8] >> (bit % 8)) & 3;
  return (a2_q_at<kQ4_0>(grp + 32 * c, i, t) | hi << 4) - 32;
}
// A group's fp16 d (h = 0) and m (h = 1) in block order, zero for missing blocks.
template <int64_t T>
inline void a2_group_scales(const uint8_t* sc, int64_t nbt, uint16_t (*out)[8]) {
  std::memset(out, 0, 16 * a2_halves<T>());
  for (int h = 0; h < a2_halves<T>(); ++h) std::memcpy(out[h], sc + 2 * a2_slots(nbt) * h, 2 * nbt);
}
inline int64_t a2_chunks(int64_t k) { return (k / 32 + 1) / 2; }
inline int64_t a2_groups(int64_t k) { return (a2_chunks(k) + 3) / 4; }
inline int64_t a2_row_bytes(int64_t type, int64_t k) {
  const int64_t base = type - kA2, nb = k / 32, halves = base == kQ4_1 ? 2 : 1;
  if (base == kQ4_K) return k / 256 * 148;
  if (base == kQ6_K) return k / 256 * 210;
  return a2_chunks(k) * (base == kQ8_0 ? 64 : 32) + (nb / 8 * 16 + 2 * a2_slots(nb % 8)) * halves;
}

// A group's float scale and offset per block in block order: weight = d[b] q + m[b].
template <int64_t T>
inline void a2_group_floats(const uint8_t* sc, int64_t nbt, float* d, float* m) {
  if constexpr (T == kQ4_K) {
    const float dd = fp16(sc), dmin = fp16(sc + 2);
    for (int s = 0; s < 8; ++s) {
      d[kA2Order[s]] = dd * static_cast<float>(sc[4 + s]);
      m[kA2Order[s]] = -dmin * static_cast<float>(sc[12 + s]);
    }
  } else {
    uint16_t h16[2][8];
    a2_group_scales<T>(sc, nbt, h16);
    for (int j = 0; j < 8; ++j) {
      d[j] = fp16(reinterpret_cast<const uint8_t*>(&h16[0][j]));
      m[j] = T == kQ4_1 ? fp16(reinterpret_cast<const uint8_t*>(&h16[1][j])) : T == kQ4_0 ? -8.f * d[j] : 0.f;
    }
  }
}

// a2_idx as tables: the weight at chunk position 16 i + t, and its inverse.
struct A2Inverse {
  int pos[64], weight[64];
  A2Inverse() {
    for (int i = 0; i < 4; ++i)
      for (int t = 0; t < 16; ++t) {
        pos[a2_idx(i, t)] = 16 * i + t;
        weight[16 * i + t] = a2_idx(i, t);
      }
  }
};
const A2Inverse kA2Inverse;

// A chunk's 64 4-bit values q (weight order) into its 32 layout bytes: nibble i of word t holds q[a2_idx(i, t)],
// which is the file's Q4_0 byte order (byte j of a block: weights j and j + 16).
inline void a2_pack_nibbles(const uint8_t* q, uint8_t* out) {
  for (int b = 0; b < 2; ++b)
    for (int j = 0; j < 16; ++j) out[16 * b + j] = static_cast<uint8_t>(q[32 * b + j] | q[32 * b + j + 16] << 4);
}

// One row of type T (k weights, the file's blocks) into the layout.
template <int64_t T>
void a2_pack_row(const uint8_t* src, int64_t k, uint8_t* dst) {
  if constexpr (T == kQ6_K) {
    for (int64_t g = 0; g < k / 256; ++g) {
      std::memset(dst, 0, 210);
      for (int c = 0; c < 4; ++c) {
        Chunk ch;
        decode_chunk<kQ6_K>(src, 4 * g + c, k, ch);  // the 6-bit values, weight order
        // the low nibbles as Q4_0's (a2_pack_nibbles), the high 2 bits at bit 2 (4 (c & 1) + i) of the plane's
        // word t
        uint8_t lo[64];
        for (int l = 0; l < 64; ++l) lo[l] = ch.q[l] & 0x0F;
        a2_pack_nibbles(lo, dst + 32 * c);
        for (int i = 0; i < 4; ++i) {
          const int bit = 2 * (4 * (c & 1) + i);
          uint8_t* plane = dst + 128 + 32 * (c >> 1) + bit / 8;
          for (int t = 0; t < 16; ++t)
            plane[2 * t] |= static_cast<uint8_t>((ch.q[kA2Inverse.weight[16 * i + t]] >> 4) << (bit % 8));
        }
      }
      const uint8_t* blk = src + g * 210;
      for (int u = 0; u < 16; ++u) dst[192 + u] = blk[192 + kA2Units[u]];
      std::memcpy(dst + 208, blk + 208, 2);
      dst += 210;
    }
    return;
  }
  if constexpr (T == kQ4_K) {
    for (int64_t g = 0; g < k / 256; ++g) {
      const uint8_t* blk = src + g * 144;
      for (int c = 0; c < 4; ++c) {  // sub-blocks 2c, 2c + 1: the low and high nibbles of qs[32 c, 32 c + 32)
        uint8_t q[64];
        for (int l = 0; l < 32; ++l) {
          q[l] = blk[16 + 32 * c + l] & 0x0F;
          q[32 + l] = blk[16 + 32 * c + l] >> 4;
        }
        a2_pack_nibbles(q, dst + 32 * c);
      }
      uint8_t* hdr = dst + 128;
      std::memcpy(hdr, blk, 4);
      for (int s = 0; s < 8; ++s) {
        float sc, mn;
        scale_min_k4(blk + 4, kA2Order[s], sc, mn);
        hdr[4 + s] = static_cast<uint8_t>(sc);
        hdr[12 + s] = static_cast<uint8_t>(mn);
      }
      dst += 148;
    }
    return;
  }
  constexpr int64_t bb = block_bytes(T), cb = a2_chunk_bytes<T>();
  const int64_t nb = k / 32, nch = a2_chunks(k);
  for (int64_t g = 0; g * 4 < nch; ++g) {
    const int64_t nc = std::min<int64_t>(4, nch - 4 * g);
    for (int64_t c = 4 * g; c < 4 * g + nc; ++c) {
      const bool two = 2 * c + 1 < nb;
      if constexpr (T == kQ8_0) {  // byte e of vector v's word t: weight a2_idx(2 v + e, t)
        const uint8_t* qa = src + 2 * c * bb + 2;
        const uint8_t* qb = two ? qa + bb : nullptr;
        for (int v = 0; v < 2; ++v)
          for (int t = 0; t < 16; ++t)
            for (int e = 0; e < 2; ++e) {
              const uint8_t* q = t < 8 ? qa : qb;
              dst[32 * v + 2 * t + e] = q ? q[((2 * t + v) & 15) + 16 * e] : 0;
            }
      } else {  // the 4-bit file blocks' quant bytes are already in this order: word t = bytes 2 t, 2 t + 1
        const int64_t qs = T == kQ4_1 ? 4 : 2;
        std::memcpy(dst, src + 2 * c * bb + qs, 16);
        if (two) std::memcpy(dst + 16, src + (2 * c + 1) * bb + qs, 16);
        else std::memset(dst + 16, 0, 16);
      }
      dst += cb;
    }
    const int64_t nbt = std::min<int64_t>(8, nb - 8 * g);
    std::memset(dst, 0, a2_scale_bytes<T>(nbt));
    for (int64_t j = 0; j < nbt; ++j)
      for (int h = 0; h < a2_halves<T>(); ++h)
        std::memcpy(dst + 2 * (a2_slots(nbt) * h + j), src + (8 * g + j) * bb + 2 * h, 2);
    dst += a2_scale_bytes<T>(nbt);
  }
}


#if defined(__AVX2__)
// A chunk's four int16 weight vectors (vector i lane t: the weight a2_idx(i, t)).
template <int64_t T>
inline __attribute__((always_inline)) void a2_weights(const uint8_t* q, __m256i* w) {
  if constexpr (T == kQ8_0) {
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
    w[0] = _mm256_srai_epi16(_mm256_slli_epi16(v0, 8), 8);
    w[1] = _mm256_srai_epi16(v0, 8);
    w[2] = _mm256_srai_epi16(_mm256_slli_epi16(v1, 8), 8);
    w[3] = _mm256_srai_epi16(v1, 8);
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i nib = _mm256_set1_epi16(0x000F);
    w[0] = _mm256_and_si256(v, nib);
    w[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(v, 8), nib);
    w[3] = _mm256_srli_epi16(v, 12);
  }
}

// Q6_K's high 2 bits of the weights idx(j % 4, t) of a plane's word t, at bit 4 (C: the chunk, I: idx's i).
template <int C, int I>
PAGEDLLM_ALWAYS_INLINE __m256i a2_q6k_high(__m256i plane) {
  constexpr int bit = 2 * (4 * (C & 1) + I);
  const __m256i two = _mm256_set1_epi16(0x0030);
  if constexpr (bit >= 4) return _mm256_and_si256(_mm256_srli_epi16(plane, bit - 4), two);
  else return _mm256_and_si256(_mm256_slli_epi16(plane, 4 - bit), two);
}

// Q6_K chunk C of a super-block's four: its weights q - 32 as int16 (vector i lane t: the weight a2_idx(i, t)).
template <int C>
inline __attribute__((always_inline)) void a2_q6k_weights(const uint8_t* grp, __m256i plane, __m256i* w) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 32 * C));
  const __m256i nib = _mm256_set1_epi16(0x000F), k32 = _mm256_set1_epi16(32);
  w[0] = _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(v, nib), a2_q6k_high<C, 0>(plane)), k32);
  w[1] = _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nib), a2_q6k_high<C, 1>(plane)),
                          k32);
  w[2] = _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 8), nib), a2_q6k_high<C, 2>(plane)),
                          k32);
  w[3] = _mm256_sub_epi16(_mm256_or_si256(_mm256_srli_epi16(v, 12), a2_q6k_high<C, 3>(plane)), k32);
}

// A chunk's weights (a2_weights' vectors) to float32 in weight order, scale[2 h + e] q + offset[2 h + e] for block
// h (h < blocks) and its half e: weights 0-15 of a block are vectors 0 and 2 interleaved, 16-31 vectors 1 and 3
// (lanes 0-7 of each vector the chunk's first block, 8-15 its second).
inline void a2_store_chunk(const __m256i* wv, int blocks, const float* scale, const float* offset, float* out) {
  for (int h = 0; h < blocks; ++h)
    for (int e = 0; e < 2; ++e) {
      const __m256 dv = _mm256_set1_ps(scale[2 * h + e]), mv = _mm256_set1_ps(offset[2 * h + e]);
      const __m128i ia = h ? _mm256_extracti128_si256(wv[e], 1) : _mm256_castsi256_si128(wv[e]);
      const __m128i ib = h ? _mm256_extracti128_si256(wv[e + 2], 1) : _mm256_castsi256_si128(wv[e + 2]);
      const __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(ia)), dv, mv);
      const __m256 b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(ib)), dv, mv);
      const __m256 lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);
      float* o = out + 32 * h + 16 * e;
      _mm256_storeu_ps(o, _mm256_permute2f128_ps(lo, hi, 0x20));
      _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
}
#endif

// One row of the layout back to float32 (exactly the file's values).
template <int64_t T>
void a2_dequant_row(const uint8_t* row, int64_t k, float* out) {
  if constexpr (T == kQ6_K) {
    for (int64_t g = 0; g < k / 256; ++g, row += 210) {
      float a[16];  // per 16 weights
      const float d = fp16(row + 208);
      for (int u = 0; u < 16; ++u) a[kA2Units[u]] = d * static_cast<float>(static_cast<int8_t>(row[192 + u]));
#if defined(__AVX2__)
      const float zero[4] = {0.f, 0.f, 0.f, 0.f};
      const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 128));
      const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 160));
      __m256i wv[4];
      a2_q6k_weights<0>(row, p0, wv);
      a2_store_chunk(wv, 2, a, zero, out + 256 * g);
      a2_q6k_weights<1>(row, p0, wv);
      a2_store_chunk(wv, 2, a + 4, zero, out + 256 * g + 64);
      a2_q6k_weights<2>(row, p1, wv);
      a2_store_chunk(wv, 2, a + 8, zero, out + 256 * g + 128);
      a2_q6k_weights<3>(row, p1, wv);
      a2_store_chunk(wv, 2, a + 12, zero, out + 256 * g + 192);
      continue;
#endif
      for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 4; ++i)
          for (int t = 0; t < 16; ++t) {
            const int l = a2_idx(i, t);
            out[256 * g + 64 * c + l] = a[(64 * c + l) / 16] * static_cast<float>(a2_q6k_at(row, c, i, t));
          }
    }
    return;
  }
  constexpr int64_t cb = a2_chunk_bytes<T>();
  const int64_t nb = k / 32, nch = a2_chunks(k);
  for (int64_t g = 0; g * 4 < nch; ++g) {
    const int64_t nc = std::min<int64_t>(4, nch - 4 * g);
    const int64_t nbt = std::min<int64_t>(8, nb - 8 * g);
    float d[8], m[8];
    a2_group_floats<T>(row + nc * cb, nbt, d, m);
    for (int64_t c = 0; c < nc; ++c) {
      const uint8_t* q = row + c * cb;
      const int64_t w0 = 64 * (4 * g + c);
#if defined(__AVX2__)
      __m256i wv[4];
      a2_weights<T>(q, wv);
      const float scale[4] = {d[2 * c], d[2 * c], d[2 * c + 1], d[2 * c + 1]};
      const float offset[4] = {m[2 * c], m[2 * c], m[2 * c + 1], m[2 * c + 1]};
      a2_store_chunk(wv, 64 * c + 32 < 32 * (nb - 8 * g) ? 2 : 1, scale, offset, out + w0);
      continue;
#endif
      float v[64];  // chunk order
      for (int i = 0; i < 4; ++i)
        for (int t = 0; t < 16; ++t)
          v[16 * i + t] = static_cast<float>(a2_q_at<T>(q, i, t));
      const int64_t n = std::min<int64_t>(64, 32 * nb - w0);
      for (int64_t l = 0; l < n; ++l) out[w0 + l] = d[2 * c + l / 32] * v[kA2Inverse.pos[l]] + m[2 * c + l / 32];
    }
    row += nc * cb + a2_scale_bytes<T>(nbt);
  }
}

// The layout's activations: per row x16 (the same integers as quantize_rows) in idx order per chunk, and per
// group the eight blocks' step and step * sum(x16) in kA2Order.
template <typename scalar_t>
void quantize_rows_a2(const scalar_t* x, int64_t xs, int64_t m, int64_t k, ActRows& act) {
  const int64_t nch = a2_chunks(k), ng = a2_groups(k), nb = k / 32;
  act.a_stride = 64 * nch;
  act.g_stride = 8 * ng;
  act.xa.assign(m * act.a_stride, 0);
  act.sta.assign(m * act.g_stride, 0.f);
  act.sua.assign(m * act.g_stride, 0.f);
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    float buf[32];
    int8_t hi[64], lo[64];
    int16_t x16[64];
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * xs;
      int16_t* xa = act.xa.data() + r * act.a_stride;
      float* st = act.sta.data() + r * act.g_stride;
      float* su = act.sua.data() + r * act.g_stride;
      for (int64_t c = 0; c < nch; ++c) {
        for (int h = 0; h < 2; ++h) {
          const int64_t b = 2 * c + h;
          if (b >= nb) {
            for (int i = 32 * h; i < 32 * h + 32; ++i) x16[i] = 0;
            continue;
          }
          load_block32(xr, 32 * b, k, buf);
          int32_t half[2];
          const float step = quantize_block32(buf, hi + 32 * h, lo + 32 * h, half) / 256.f;
          for (int i = 32 * h; i < 32 * h + 32; ++i) x16[i] = static_cast<int16_t>(256 * hi[i] + lo[i]);
          const int64_t slot = 8 * (b / 8) + a2_order_pos(b % 8);
          st[slot] = step;
          su[slot] = step * static_cast<float>(half[0] + half[1]);
        }
        for (int i = 0; i < 64; ++i) xa[64 * c + kA2Inverse.pos[i]] = x16[i];
      }
    }
  });
}

// out[r * os] for activation rows [0, m) and weight rows [n0, n1) of the layout, rb bytes apart: the AVX2
// kernel's float operations lane by lane (the same bits wherever FMA rounds once, as std::fma does).
template <int64_t T>
void a2_rows_portable(const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, int64_t k, const ActRows& act,
                      int64_t m, float* out, int64_t os) {
  constexpr int64_t cb = a2_chunk_bytes<T>();
  const int64_t nch = a2_chunks(k), nb = k / 32;
  if constexpr (T == kQ6_K) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t r = 0; r < m; ++r) {
        const uint8_t* row = w + n * rb;
        float acc[8] = {};
        for (int64_t g = 0; g < k / 256; ++g, row += 210) {
          int32_t units[16] = {};  // 2 block + half
          for (int c = 0; c < 4; ++c)
            for (int i = 0; i < 4; ++i)
              for (int t = 0; t < 16; ++t)
                units[(64 * c + a2_idx(i, t)) / 16] +=
                    a2_q6k_at(row, c, i, t) * act.xa_row(r)[256 * g + 64 * c + 16 * i + t];
          const float d = fp16(row + 208);
          const float* st = act.sta_row(r) + 8 * g;
          for (int v = 0; v < 2; ++v)
            for (int l = 0; l < 8; ++l) {
              const float a = d * static_cast<float>(static_cast<int8_t>(row[192 + 8 * v + l]));
              acc[l] = std::fma(static_cast<float>(units[kA2Units[8 * v + l]]), a * st[kA2UnitSteps[8 * v + l]],
                                acc[l]);
            }
        }
        const float h0 = acc[0] + acc[4], h1 = acc[1] + acc[5], h2 = acc[2] + acc[6], h3 = acc[3] + acc[7];
        out[r * os + n] = (h0 + h2) + (h1 + h3);
      }
    return;
  }
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < m; ++r) {
      const uint8_t* row = w + n * rb;
      const int16_t* xa = act.xa_row(r);
      float acc[8] = {}, accm[8] = {};
      for (int64_t g = 0; g * 4 < nch; ++g) {
        const int64_t nc = std::min<int64_t>(4, nch - 4 * g), nbt = std::min<int64_t>(8, nb - 8 * g);
        float dj[8], mj[8];
        a2_group_floats<T>(row + nc * cb, nbt, dj, mj);
        int32_t sums[8] = {};  // block order
        for (int64_t c = 0; c < nc; ++c)
          for (int i = 0; i < 4; ++i)
            for (int t = 0; t < 16; ++t) {
              sums[2 * c + a2_idx(i, t) / 32] += a2_q_at<T>(row + c * cb, i, t) * xa[64 * (4 * g + c) + 16 * i + t];
            }
        for (int s = 0; s < 8; ++s) {  // lane s: block kA2Order[s]
          const int j = kA2Order[s];
          acc[s] = std::fma(static_cast<float>(sums[j]), dj[j] * act.sta_row(r)[8 * g + s], acc[s]);
          const float mn = T == kQ4_0 ? dj[j] : mj[j];  // Q4_0: the offset -8 d is applied at the end
          if constexpr (T != kQ8_0) accm[s] = std::fma(mn, act.sua_row(r)[8 * g + s], accm[s]);
        }
        row += nc * cb + a2_scale_bytes<T>(nbt);
      }
      float v[8];
      for (int s = 0; s < 8; ++s) v[s] = acc[s] + (T == kQ4_0 ? accm[s] * -8.f : accm[s]);
      const float h0 = v[0] + v[4], h1 = v[1] + v[5], h2 = v[2] + v[6], h3 = v[3] + v[7];
      out[r * os + n] = (h0 + h2) + (h1 + h3);
    }
}

#if defined(__AVX2__)
// A chunk's weight vectors times one activation row's four at x: the products of the blocks' first 16 weights
// (vectors 0 and 2) and of their second 16 (vectors 1 and 3), summed per 32-bit lane.
PAGEDLLM_ALWAYS_INLINE void a2_madd(const __m256i* w, const int16_t* x, __m256i& first, __m256i& second) {
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
  first = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256(xv)),
                           _mm256_madd_epi16(w[2], _mm256_loadu_si256(xv + 2)));
  second = _mm256_add_epi32(_mm256_madd_epi16(w[1], _mm256_loadu_si256(xv + 1)),
                            _mm256_madd_epi16(w[3], _mm256_loadu_si256(xv + 3)));
}

// The int32 block sums of one chunk (lanes 0-3 its first block, 4-7 its second) for activation rows x[0..R).
template <int64_t T, int R>
PAGEDLLM_ALWAYS_INLINE void a2_chunk(const uint8_t* q, const int16_t* const* x, int64_t off, __m256i* p) {
  __m256i w[4];
  a2_weights<T>(q, w);
  for (int r = 0; r < R; ++r) {
    __m256i first, second;
    a2_madd(w, x[r] + off, first, second);
    p[r] = _mm256_add_epi32(first, second);
  }
}

// A group's block scales d and offsets mn (Q4_0: d, the offset -8 d applied at the end; Q8_0: none) in kA2Order.
template <int64_t T>
PAGEDLLM_ALWAYS_INLINE void a2_group_vectors(const uint8_t* sc, int64_t nbt, __m256& d, __m256& mn) {
  if constexpr (T == kQ4_K) {  // d sc and -dmin mn, the bytes already in kA2Order
    const __m128i* bytes = reinterpret_cast<const __m128i*>(sc + 4);
    const __m256 sc8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(bytes)));
    const __m256 mn8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(sc + 12))));
    d = _mm256_mul_ps(_mm256_set1_ps(fp16(sc)), sc8);
    mn = _mm256_mul_ps(_mm256_set1_ps(-fp16(sc + 2)), mn8);
    return;
  }
  __m128i d16, m16 = _mm_setzero_si128();
  if (nbt == 8) {
    d16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
    if constexpr (T == kQ4_1) m16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16));
  } else {  // a row's last group: only its (even) number of scales, read through a mask
    const __m128i live = _mm_cmpgt_epi32(_mm_set1_epi32(static_cast<int>(a2_slots(nbt) / 2)),
                                         _mm_setr_epi32(0, 1, 2, 3));
    d16 = _mm_maskload_epi32(reinterpret_cast<const int*>(sc), live);
    if constexpr (T == kQ4_1) m16 = _mm_maskload_epi32(reinterpret_cast<const int*>(sc + 2 * a2_slots(nbt)), live);
  }
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // block order to kA2Order
  d = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(d16), order);
  mn = T == kQ4_1 ? _mm256_permutevar8x32_ps(_mm256_cvtph_ps(m16), order) : d;
}

// One Q6_K chunk: per activation row, the sums of its four 16-weight units as a vphaddd of the halves' products
// (lanes 0-1 unit 4 C, 2-3 unit 4 C + 1, 4-5 unit 4 C + 2, 6-7 unit 4 C + 3, each lane a partial sum).
template <int R, int C>
PAGEDLLM_ALWAYS_INLINE void a2_q6k_chunk(const uint8_t* grp, __m256i plane, const int16_t* const* x, int64_t off,
                                         __m256i* a) {
  __m256i w[4];
  a2_q6k_weights<C>(grp, plane, w);
  for (int r = 0; r < R; ++r) {
    __m256i first, second;
    a2_madd(w, x[r] + off + 64 * C, first, second);
    a[r] = _mm256_hadd_epi32(first, second);
  }
}

// acc[r] += one Q6_K super-block's products (K-quant scales per 16 weights: two rescales of 8 unit sums).
template <int R>
PAGEDLLM_ALWAYS_INLINE void a2_q6k_group(const uint8_t* grp, const int16_t* const* x, int64_t off,
                                         const float* const* st, __m256* acc) {
  const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 128));
  const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 160));
  __m256i a0[R], a1[R], a2[R], a3[R];
  a2_q6k_chunk<R, 0>(grp, p0, x, off, a0);
  a2_q6k_chunk<R, 1>(grp, p0, x, off, a1);
  a2_q6k_chunk<R, 2>(grp, p1, x, off, a2);
  a2_q6k_chunk<R, 3>(grp, p1, x, off, a3);
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(grp + 192));
  const __m256 d = _mm256_set1_ps(fp16(grp + 208));
  const __m256 s01 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
  const __m256 s23 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc))));
  const __m256i steps01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kA2UnitSteps));
  const __m256i steps23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kA2UnitSteps + 8));
  for (int r = 0; r < R; ++r) {
    const __m256 stp = _mm256_loadu_ps(st[r]);
    const __m256 b01 = _mm256_cvtepi32_ps(_mm256_hadd_epi32(a0[r], a1[r]));
    const __m256 b23 = _mm256_cvtepi32_ps(_mm256_hadd_epi32(a2[r], a3[r]));
    acc[r] = _mm256_fmadd_ps(b01, _mm256_mul_ps(s01, _mm256_permutevar8x32_ps(stp, steps01)), acc[r]);
    acc[r] = _mm256_fmadd_ps(b23, _mm256_mul_ps(s23, _mm256_permutevar8x32_ps(stp, steps23)), acc[r]);
  }
}

// out[r * os] for activation rows [m0, m0 + R) and one weight row of the layout.
template <int64_t T, int R>
inline void a2_dot_rows(const uint8_t* row, int64_t k, const ActRows& act, int64_t m0, float* out, int64_t os) {
  constexpr int64_t cb = a2_chunk_bytes<T>();
  const int64_t nch = a2_chunks(k), nb = k / 32;
  const int16_t* x[R];
  const float *st[R], *su[R];
  __m256 acc[R], accm[R];
  for (int r = 0; r < R; ++r) {
    x[r] = act.xa_row(m0 + r);
    st[r] = act.sta_row(m0 + r);
    su[r] = act.sua_row(m0 + r);
    acc[r] = accm[r] = _mm256_setzero_ps();
  }
  if constexpr (T == kQ6_K) {
    for (int64_t g = 0; g < k / 256; ++g) {
      const float* stg[R];
      for (int r = 0; r < R; ++r) stg[r] = st[r] + 8 * g;
      a2_q6k_group<R>(row + 210 * g, x, 256 * g, stg, acc);
    }
    for (int r = 0; r < R; ++r) out[r * os] = hsum256(acc[r]);
    return;
  }
  for (int64_t g = 0; 4 * g < nch; ++g) {
    const int64_t nc = std::min<int64_t>(4, nch - 4 * g);
    __m256i h[2][R];
    for (int pair = 0; pair < 2; ++pair) {
      __m256i pa[R], pb[R];
      for (int e = 0; e < 2; ++e) {
        __m256i* p = e ? pb : pa;
        const int64_t c = 2 * pair + e;
        if (c < nc) a2_chunk<T, R>(row + c * cb, x, 64 * (4 * g + c), p);
        else
          for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_si256();
      }
      for (int r = 0; r < R; ++r) h[pair][r] = _mm256_hadd_epi32(pa[r], pb[r]);
    }
    const int64_t nbt = std::min<int64_t>(8, nb - 8 * g);
    __m256 d, mn;
    a2_group_vectors<T>(row + nc * cb, nbt, d, mn);
    for (int r = 0; r < R; ++r) {
      const __m256 sums = _mm256_cvtepi32_ps(_mm256_hadd_epi32(h[0][r], h[1][r]));
      acc[r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(d, _mm256_loadu_ps(st[r] + 8 * g)), acc[r]);
      if constexpr (T != kQ8_0) accm[r] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(su[r] + 8 * g), accm[r]);
    }
    row += nc * cb + a2_scale_bytes<T>(nbt);
  }
  for (int r = 0; r < R; ++r) {
    const __m256 offs = T == kQ4_0 ? _mm256_mul_ps(accm[r], _mm256_set1_ps(-8.f)) : accm[r];
    out[r * os] = hsum256(_mm256_add_ps(acc[r], offs));
  }
}

template <int64_t T>
void a2_rows_avx2(const uint8_t* w, int64_t rb, int64_t n0, int64_t n1, int64_t k, const ActRows& act, int64_t m,
                  float* out, int64_t os) {
  for (int64_t r0 = 0; r0 < m; r0 += kA2Rows) {
    const int64_t nr = std::min<int64_t>(kA2Rows, m - r0);
    float* o = out + r0 * os;
    for (int64_t n = n0; n < n1; ++n) {
      if (n + kPrefetchRows < n1) {  // as gemm_avx2_reg: a row ahead, so the stream never waits at a row start
        const char* ahead = reinterpret_cast<const char*>(w + (n + kPrefetchRows) * rb);
        for (int64_t off = 0; off < rb; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
      }
      const uint8_t* row = w + n * rb;
      switch (nr) {
        case 4: a2_dot_rows<T, 4>(row, k, act, r0, o + n, os); break;
        case 3: a2_dot_rows<T, 3>(row, k, act, r0, o + n, os); break;
        case 2: a2_dot_rows<T, 2>(row, k, act, r0, o + n, os); break;
        default: a2_dot_rows<T, 1>(row, k, act, r0, o + n, os); break;
      }
    }
  }
}
#endif

template <class F>
inline void visit_a2(int64_t type, F&& f) {
  using std::integral_constant;
  switch (type - kA2) {
    case kQ4_0: return f(integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return f(integral_constant<int64_t, kQ4_1>{});
    case kQ8_0: return f(integral_constant<int64_t, kQ8_0>{});
    case kQ4_K: return f(integral_constant<int64_t, kQ4_K>{});
    case kQ6_K: return f(integral_constant<int64_t, kQ6_K>{});
    default: break;
  }
  TORCH_CHECK(false, "gguf kernels: type ", type, " has no AVX2 row layout");
}

// Output rows [n0, n1) of an AVX2-row-layout part for all m activation rows, written at out (column 0 = n0's).
void a2_dispatch(const Part& p, int64_t n0, int64_t n1, int64_t k, const ActRows& act, int64_t m, float* out,
                 int64_t os, int64_t impl) {
  visit_a2(p.type, [&](auto t) {
    constexpr int64_t T = decltype(t)::value;
#if defined(__AVX2__)
    if (impl != kPortable) return a2_rows_avx2<T>(p.w, p.rb, n0, n1, k, act, m, out, os);
#endif
    a2_rows_portable<T>(p.w, p.rb, n0, n1, k, act, m, out, os);
  });
}

void check_type(int64_t type, int64_t k) {
  if (is_a2(type)) {
    const int64_t be = block_elems(type - kA2);
    TORCH_CHECK(k > 0 && k % be == 0, "gguf kernels: K=", k, " is not a multiple of the block size ", be, " of type ",
                type);
    return;
  }
  if (is_tiled(type)) {
    TORCH_CHECK(k > 0 && k % tiled_block_elems(type) == 0, "gguf kernels: K=", k,
                " is not a multiple of the block size ", tiled_block_elems(type), " of type ", type);
    return;
  }
  TORCH_CHECK(type == kI8Row || block_bytes(type) > 0, "gguf kernels: unsupported weight type ", type);
  TORCH_CHECK(k > 0 && (type == kI8Row || k % block_elems(type) == 0), "gguf kernels: K=", k, " is not a multiple of the block size ",
              block_elems(type), " of type ", type);
}

// f(x's elements) as float, BFloat16 or Half pointer: the activation dtypes the kernels take.
template <class F>
void with_x_rows(const at::Tensor& x, F&& f) {
  switch (x.scalar_type()) {
    case at::kFloat: return f(x.data_ptr<float>());
    case at::kBFloat16: return f(x.data_ptr<c10::BFloat16>());
    case at::kHalf: return f(x.data_ptr<c10::Half>());
    default: TORCH_CHECK(false, "gguf_linear: x must be float32, bfloat16 or float16");
  }
}

thread_local ActRows tls_act;
thread_local std::vector<float> tls_xf;
// From this many activation rows the float32 path (dequantize once, FMAs) beats the integer one.
constexpr int64_t kFloatMinRows = 2;

// out [M, sum(rows)] float32 = x [M, K] @ W^T (+ bias), W given as parts (uint8 [rows_i, row_bytes_i]) of
// GGUF types types[i], their outputs side by side. impl: 0 best available, 1 AVX2, 2 portable C++.
void gguf_linear(at::Tensor& out, const at::Tensor& x, at::TensorList weights, at::IntArrayRef types,
                 const c10::optional<at::Tensor>& bias, int64_t impl) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "gguf_linear: x must be a 2-D CPU "
              "tensor contiguous in its last dimension");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.stride(1) == 1 && out.size(0) == x.size(0),
              "gguf_linear: out must be float32 [M, N]");
  TORCH_CHECK(weights.size() == types.size() && !weights.empty(), "gguf_linear: one type per weight part");
  const int64_t m = x.size(0), k = x.size(1);
  std::vector<Part> parts;
  int64_t total = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    check_type(types[i], k);
    const bool tiled = is_tiled(types[i]);
    const int64_t rb = tiled ? tiled_group_bytes(types[i], k) : is_a2(types[i]) ? a2_row_bytes(types[i], k)
                                                                                 : row_bytes(types[i], k);
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) == rb,
                "gguf_linear: weight part ", i, " must be contiguous uint8 [", tiled ? "rows / 16" : "rows", ", ", rb,
                "]");
    const int64_t rows = tiled ? 16 * w.size(0) : w.size(0);
    parts.push_back({w.data_ptr<uint8_t>(), types[i], rows, total, w.size(1)});
    total += rows;
  }
  TORCH_CHECK(out.size(1) == total, "gguf_linear: out has ", out.size(1), " columns, the weights ", total);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == total,
                "gguf_linear: bias must be float32 [N]");
    bp = bias->data_ptr<float>();
  }
  if (m == 0) return;
  float* op = out.data_ptr<float>();
  const int64_t os = out.stride(0);
  bool any_tiled = false, any_plain = false, any_a2 = false;
  for (const Part& p : parts) (is_tiled(p.type) ? any_tiled : is_a2(p.type) ? any_a2 : any_plain) = true;
  bool use_f32 = false;
  const float* xp = nullptr;
  const int64_t k64 = (k + 63) / 64 * 64;
#if defined(PAGEDLLM_HAVE_VNNI512)
  use_f32 = impl == kBest && m >= kFloatMinRows && any_plain;
  if (use_f32) {
    std::vector<float>& xf = tls_xf;  // the rows as float32, each padded with zeros to k64
    xf.assign(m * k64, 0.f);
    with_x_rows(x, [&](const auto* xr) {
      for (int64_t r = 0; r < m; ++r) {
        float* dst = xf.data() + r * k64;
        const auto* src = xr + r * x.stride(0);
        for (int64_t i = 0; i < k; ++i) dst[i] = static_cast<float>(src[i]);
      }
    });
    xp = xf.data();
  }
#endif
  ActRows& act = tls_act;
  if (any_tiled) with_x_rows(x, [&](const auto* xr) { quantize_rows_tiled(xr, x.stride(0), m, k, act); });
  if (any_a2) with_x_rows(x, [&](const auto* xr) { quantize_rows_a2(xr, x.stride(0), m, k, act); });
  if (any_plain && !use_f32) with_x_rows(x, [&](const auto* xr) { quantize_rows(xr, x.stride(0), m, k, act); });
  // ~64k multiply-adds per thread chunk at least: small products stay on the calling thread.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, k * m));
  auto rows = [&](int64_t begin, int64_t end) {
    std::vector<Chunk> chunks;
    for (const Part& p : parts) {
      if (is_tiled(p.type)) {  // the groups whose first column lies in [begin, end)
        const int64_t groups = p.rows / 16;
        const int64_t g0 = std::min(groups, begin <= p.col ? 0 : (begin - p.col + 15) / 16);
        const int64_t g1 = std::min(groups, end <= p.col ? 0 : (end - p.col + 15) / 16);
        if (g0 >= g1) continue;
        tiled_dispatch(p, g0, g1, k, act, m, op, os, impl);
        if (bp)
          for (int64_t i = 0; i < m; ++i)
            for (int64_t n = p.col + 16 * g0; n < p.col + 16 * g1; ++n) op[i * os + n] += bp[n];
        continue;
      }
      const int64_t lo = std::max(begin, p.col), hi = std::min(end, p.col + p.rows);
      if (lo >= hi) continue;
      if (is_a2(p.type)) {
        a2_dispatch(p, lo - p.col, hi - p.col, k, act, m, op + p.col, os, impl);
        if (bp)
          for (int64_t i = 0; i < m; ++i)
            for (int64_t n = lo; n < hi; ++n) op[i * os + n] += bp[n];
        continue;
      }
#if defined(PAGEDLLM_HAVE_VNNI512)
      if (use_f32) {
        gemm_f32_dispatch(p, lo - p.col, hi - p.col, k, xp, k64, m, op, os);
        if (bp)
          for (int64_t i = 0; i < m; ++i)
            for (int64_t n = lo; n < hi; ++n) op[i * os + n] += bp[n];
        continue;
      }
#endif
      gemm_dispatch(p, lo - p.col, hi - p.col, k, act, m, op, os, bp, impl, chunks);
    }
  };
  // Threads take pieces of about an eighth of their share from a shared counter instead of one fixed share
  // each: on a shared machine a thread descheduled mid-product no longer holds up the step while the other
  // idles. Each output is computed the same way whichever thread takes its rows.
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || total <= grain || at::in_parallel_region()) {
    rows(0, total);
    return;
  }
  const int64_t piece = std::max(grain, (total + 8 * threads - 1) / (8 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(piece); b < total; b = next.fetch_add(piece)) rows(b, std::min(total, b + piece));
  });
}

template <int64_t T>
void dequant_row(const uint8_t* row, int64_t k, float* out) {
#if defined(PAGEDLLM_HAVE_VNNI512)
  if constexpr (has_reg_decode<T>()) {
    for (int64_t c = 0; c * 64 < k; ++c) {
      const bool two = 64 * c + 32 < k;
      const RegChunk ch = decode_reg<T>(row, c, two);
      alignas(64) float a[16], b[4];
      alignas(64) uint8_t q[64];
      _mm512_store_ps(a, ch.a);
      _mm_store_ps(b, ch.b);
      _mm512_store_si512(q, ch.q);
      for (int g = 0; g < (two ? 4 : 2); ++g) {
        const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q + 16 * g))));
        _mm512_storeu_ps(out + 64 * c + 16 * g, _mm512_fmadd_ps(v, _mm512_set1_ps(a[4 * g]), _mm512_set1_ps(b[g])));
      }
    }
    return;
  }
#endif
  Chunk ch;
  for (int64_t c = 0; c * 64 < k; ++c) {
    decode_chunk<T>(row, c, k, ch);
    const int64_t n = std::min<int64_t>(64, k - 64 * c);
    for (int64_t i = 0; i < n; ++i) out[64 * c + i] = ch.a[i / 16] * ch.q[i] + ch.b[i / 16];
  }
}

void dequant_row_dispatch(int64_t type, const uint8_t* row, int64_t k, float* out) {
  visit_type(type, "", [&](auto t) { dequant_row<decltype(t)::value>(row, k, out); });
}

void dequant_tiled_dispatch(int64_t type, const uint8_t* grp, int j, int64_t k, float* out) {
  visit_type(type - kTiled, "tiled ", [&](auto t) { dequant_tiled_row<decltype(t)::value>(grp, j, k, out); });
}

// The tiled layout (type kTiled + type) of w (uint8 [rows, row_bytes], rows a multiple of 16): the same bytes,
// rearranged; kTiled + type's rows come back from gguf_dequantize_rows exactly as type's.
at::Tensor gguf_tile(const at::Tensor& w, int64_t type) {
  TORCH_CHECK(tileable(type), "gguf_tile: type ", type, " has no tiled layout");
  const bool i8 = type == kI8Row;
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(0) % 16 == 0 &&
                  (i8 ? w.size(1) > 4 && (w.size(1) - 4) % 32 == 0 : w.size(1) % block_bytes(type) == 0),
              "gguf_tile: w must be contiguous uint8 [rows, row_bytes] with rows a multiple of 16",
              i8 ? " and K a multiple of 32" : "");
  const int64_t rb = w.size(1), groups = w.size(0) / 16;
  const int64_t k = i8 ? rb - 4 : rb / block_bytes(type) * block_elems(type);
  const int64_t gb = tiled_group_bytes(kTiled + type, k);
  at::Tensor out = at::empty({groups, gb}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* s = src + g * 16 * rb;
      uint8_t* d = dst + g * gb;
      visit_type(type, "", [&](auto t) { tile_group<decltype(t)::value>(s, rb, k, d); });
    }
  });
  return out;
}

// The AVX2 row layout (type kA2 + type) of w (uint8 [rows, row_bytes] of Q4_0, Q4_1, Q8_0, Q4_K or Q6_K): the
// same values, rearranged per row; kA2 + type's rows come back from gguf_dequantize_rows exactly as type's.
at::Tensor gguf_a2pack(const at::Tensor& w, int64_t type) {
  TORCH_CHECK(a2able(type), "gguf_a2pack: type ", type, " has no AVX2 row layout");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) > 0 &&
                  w.size(1) % block_bytes(type) == 0,
              "gguf_a2pack: w must be contiguous uint8 [rows, row_bytes]");
  const int64_t rb = w.size(1), rows = w.size(0), k = rb / block_bytes(type) * block_elems(type);
  const int64_t ob = a2_row_bytes(kA2 + type, k);
  at::Tensor out = at::empty({rows, ob}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      visit_a2(kA2 + type, [&](auto t) { a2_pack_row<decltype(t)::value>(src + r * rb, k, dst + r * ob); });
  });
  return out;
}

// out [len(ids), K] float32 = dequantized rows ids of w (uint8 [V, row_bytes]); ids < 0 or >= V is an error.
// ids = None: every row (out [V, K]).
void gguf_dequantize_rows(at::Tensor& out, const at::Tensor& w, int64_t type, const c10::optional<at::Tensor>& ids) {
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.is_contiguous(),
              "gguf_dequantize_rows: out must be contiguous float32 [rows, K]");
  const int64_t k = out.size(1);
  check_type(type, k);
  const bool tiled = is_tiled(type), a2 = is_a2(type);
  const int64_t want = tiled ? tiled_group_bytes(type, k) : a2 ? a2_row_bytes(type, k) : row_bytes(type, k);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) == want,
              "gguf_dequantize_rows: w must be contiguous uint8 [", tiled ? "V / 16" : "V", ", ", want, "]");
  const int64_t vocab = tiled ? 16 * w.size(0) : w.size(0);
  const int64_t* idp = nullptr;
  if (ids.has_value() && ids->defined()) {
    TORCH_CHECK(ids->scalar_type() == at::kLong && ids->is_contiguous() && ids->numel() == out.size(0),
                "gguf_dequantize_rows: ids must be contiguous int64 with one id per output row");
    idp = ids->data_ptr<int64_t>();
  } else {
    TORCH_CHECK(out.size(0) == vocab, "gguf_dequantize_rows: out must have one row per weight row");
  }
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t rb = w.size(1);
  at::parallel_for(0, out.size(0), std::max<int64_t>(1, 65536 / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t src = idp ? idp[r] : r;
      TORCH_CHECK(src >= 0 && src < vocab, "gguf_dequantize_rows: row id ", src, " out of range [0, ", vocab, ")");
      if (tiled) dequant_tiled_dispatch(type, wp + (src / 16) * rb, static_cast<int>(src % 16), k, op + r * k);
      else if (a2) visit_a2(type, [&](auto t) { a2_dequant_row<decltype(t)::value>(wp + src * rb, k, op + r * k); });
      else dequant_row_dispatch(type, wp + src * rb, k, op + r * k);
    }
  });
}

// Q5_0 rows [rows, nb * 22] as Q8_0 rows [rows, nb * 34] holding the same values: each block keeps its fp16
// scale d and its 5-bit quants q become the int8 q - 16 (d * (q - 16) either way). On AVX2 machines the Q8_0
// kernel reads them at about half of Q5_0's cost (no fifth-bit expansion, no offset term), for 55% more bytes.
at::Tensor gguf_q5_0_to_q8_0(const at::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous() && w.size(1) % 22 == 0,
              "gguf_q5_0_to_q8_0: w must be contiguous uint8 [rows, blocks * 22]");
  const int64_t nb = w.size(1) / 22, rows = w.size(0);
  at::Tensor out = at::empty({rows, nb * 34}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, rows * nb, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* b = src + i * 22;
      uint8_t* o = dst + i * 34;
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      o[0] = b[0];
      o[1] = b[1];
      for (int j = 0; j < 16; ++j) {
        const int lo = (b[6 + j] & 0x0F) | (((qh >> j) & 1) << 4);
        const int hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        o[2 + j] = static_cast<uint8_t>(static_cast<int8_t>(lo - 16));
        o[18 + j] = static_cast<uint8_t>(static_cast<int8_t>(hi - 16));
      }
    }
  });
  return out;
}

// The implementations this build has: 2 = AVX-512 VNNI, 1 = AVX2, 0 = portable only.
int64_t gguf_best_impl() {
#if defined(PAGEDLLM_HAVE_VNNI512)
  return 2;
#elif defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

}  // namespace

namespace pagedllm_export {  // for cpu_fused.cpp
void gguf_linear_op(at::Tensor& out, const at::Tensor& x, at::TensorList weights, at::IntArrayRef types,
                    const c10::optional<at::Tensor>& bias) {
  ::gguf_linear(out, x, weights, types, bias, kBest);
}
}  // namespace pagedllm_export

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("gguf_linear(Tensor(a!) out, Tensor x, Tensor[] weights, int[] types, Tensor? bias, int impl=0) -> ()");
  m.def("gguf_dequantize_rows(Tensor(a!) out, Tensor w, int type, Tensor? ids) -> ()");
  m.def("gguf_best_impl", &gguf_best_impl);
  m.def("gguf_tile(Tensor w, int type) -> Tensor");
  m.def("gguf_a2pack(Tensor w, int type) -> Tensor");
  m.def("gguf_q5_0_to_q8_0(Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize_rows", &gguf_dequantize_rows);
  m.impl("gguf_tile", &gguf_tile);
  m.impl("gguf_a2pack", &gguf_a2pack);
  m.impl("gguf_q5_0_to_q8_0", &gguf_q5_0_to_q8_0);
}
