// pagedllm CPU kernels: the fused ops of the CPU path (built once per machine by kernels/cpu_ops.py).
//
// Every op writes into tensors the caller allocated (no ATen allocation here, which keeps the build
// light), reads row-strided inputs (views of a fused qkv / gate_up output), computes in float32 whatever
// the storage dtype, and splits its work over ATen's intra-op threads. The pure-torch references these are
// tested against are the layers' `forward_native` methods and attention/torch_backend.py.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDLLM_AVX2_ATTENTION 1
#endif

namespace {

// Rows per thread chunk so each chunk has at least ~32k values of work: smaller inputs stay on the calling
// thread, where waking the pool would cost more than the work (and hurts most on a busy machine).
inline int64_t grain_rows(int64_t values_per_row) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, values_per_row));
}

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

inline void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  check_cpu(t, name);
  TORCH_CHECK(t.stride(-1) == 1, name, " must be contiguous in its last dimension");
}

// ---------------------------------------------------------------------------------------------------------
// 16-lane float vectors (GCC/Clang vector extensions: one AVX-512 register, two AVX2 ones, or four SSE ones,
// whatever -march=native offers) and a vector exp.

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
constexpr v16i kLane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename scalar_t>
inline v16f load16(const scalar_t* p) {
  float tmp[16];
  for (int i = 0; i < 16; ++i) tmp[i] = static_cast<float>(p[i]);
  return load16(tmp);
}

inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }

inline float hsum(v16f v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

inline float hmax(v16f v) {
  float s = v[0];
  for (int i = 1; i < 16; ++i) s = std::max(s, v[i]);
  return s;
}

// exp(x) for float lanes: Cody-Waite range reduction and a degree-6 polynomial (the Cephes expf
// coefficients), about 1 ulp; inputs are clamped to [-87, 88.37] (exp(-inf) -> ~1.6e-38, not 0).
inline v16f vexp(v16f x) {
  const v16f hi = v16f{} + 88.3762626647949f, lo = v16f{} - 87.0f;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  v16f fx = x * 1.44269504088896341f;
  fx = (fx + 12582912.f) - 12582912.f;  // round to nearest integer
  x = x - fx * 0.693359375f;
  x = x - fx * -2.12194440e-4f;
  const v16f z = x * x;
  v16f y = v16f{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  v16i n = __builtin_convertvector(fx, v16i);
  n = (n + 127) << 23;
  v16f pow2n;
  std::memcpy(&pow2n, &n, sizeof(pow2n));
  return y * pow2n;
}

inline v16f vabs(v16f x);

// tanh(x) for float lanes, ~1-2 ulp: the odd polynomial of Cephes' tanhf below |x| = 0.625, where
// 1 - 2 / (exp(2|x|) + 1) would cancel, that formula above (vexp's clamp gives exactly +-1 far out).
inline v16f vtanh(v16f x) {
  const v16f ax = vabs(x), z = x * x;
  v16f p = v16f{} - 5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const v16f small = p * z * x + x;
  v16f big = 1.f - 2.f / (vexp(ax + ax) + 1.f);
  big = x < v16f{} ? -big : big;
  return ax < v16f{} + 0.625f ? small : big;
}

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));

inline v16f bf16x16_to_float(const uint16_t* p) {
  v16u16 h;
  std::memcpy(&h, p, sizeof(h));
  const v16u32 wide = __builtin_convertvector(h, v16u32) << 16;
  v16f f;
  std::memcpy(&f, &wide, sizeof(f));
  return f;
}

inline v16f vabs(v16f x) {
  v16u32 bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits &= 0x7fffffffu;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline bool any_lane(v16i m) {
  for (int i = 0; i < 16; ++i)
    if (m[i]) return true;
  return false;
}

// ---------------------------------------------------------------------------------------------------------
// RMSNorm (HF numerics: normalize in float32, round to the storage dtype, then scale by the weight).

template <typename scalar_t>
inline void rms_norm_row(scalar_t* out, const float* x, const scalar_t* w, int64_t n, double eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) {
    const float normed = static_cast<float>(static_cast<scalar_t>(x[i] * r));
    out[i] = static_cast<scalar_t>(static_cast<float>(w[i]) * normed);
  }
}

// x, out: [rows, n] or [a, b, n] (e.g. per-head norms of a row-strided q view), last dim contiguous.
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_last_dim_contiguous(x, "x");
  check_last_dim_contiguous(out, "out");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && out.sizes() == x.sizes() && weight.is_contiguous() &&
                  weight.numel() == x.size(-1) && out.scalar_type() == x.scalar_type() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: bad shapes or dtypes");
  const int64_t inner = x.dim() == 3 ? x.size(1) : 1;
  const int64_t rows = x.size(0) * inner, n = x.size(-1);
  const int64_t xs0 = x.stride(0), xs1 = x.dim() == 3 ? x.stride(1) : 0;
  const int64_t os0 = out.stride(0), os1 = out.dim() == 3 ? out.stride(1) : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(n);
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* src = xp + (r / inner) * xs0 + (r % inner) * xs1;
        for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
        rms_norm_row<scalar_t>(op + (r / inner) * os0 + (r % inner) * os1, buf.data(), wp, n, eps);
      }
    });
  });
}

// residual_out = x + residual (in the storage dtype); out = rms_norm(residual_out).
void add_rms_norm(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x, const at::Tensor& residual,
                  const at::Tensor& weight, double eps) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &residual_out, &x, &residual}) check_last_dim_contiguous(*t, "add_rms_norm input");
  TORCH_CHECK(x.dim() == 2 && residual.sizes() == x.sizes() && out.sizes() == x.sizes() &&
                  residual_out.sizes() == x.sizes() && weight.is_contiguous() && weight.numel() == x.size(1),
              "add_rms_norm: bad shapes");
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    scalar_t* rop = residual_out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), rs = residual.stride(0), os = out.stride(0), ros = residual_out.stride(0);
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(n);
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < n; ++i) {
          const scalar_t sum = static_cast<scalar_t>(static_cast<float>(xp[r * xs + i]) +
                                                     static_cast<float>(rp[r * rs + i]));
          rop[r * ros + i] = sum;
          buf[i] = static_cast<float>(sum);
        }
        rms_norm_row<scalar_t>(op + r * os, buf.data(), wp, n, eps);
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------------------
// out[t, i] = silu(x[t, i]) * x[t, d + i] for x = [gate | up] of width 2d.

inline void silu_and_mul_row(float* o, const float* g, int64_t d) {
  const float* u = g + d;
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const v16f gv = load16(g + i);
    store16(o + i, gv / (1.f + vexp(-gv)) * load16(u + i));
  }
  for (; i < d; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

template <typename scalar_t>
inline void silu_and_mul_row(scalar_t* o, const scalar_t* g, int64_t d) {
  const scalar_t* u = g + d;
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const v16f gv = load16(g + i);
    const v16f act = gv / (1.f + vexp(-gv));
    float tmp[16];
    store16(tmp, act);
    for (int j = 0; j < 16; ++j) {
      const float a = static_cast<float>(static_cast<scalar_t>(tmp[j]));
      o[i + j] = static_cast<scalar_t>(a * static_cast<float>(u[i + j]));
    }
  }
  for (; i < d; ++i) {
    const float gv = static_cast<float>(g[i]);
    const float act = static_cast<float>(static_cast<scalar_t>(gv / (1.f + std::exp(-gv))));
    o[i] = static_cast<scalar_t>(act * static_cast<float>(u[i]));
  }
}

// out[t, :] = act(x[t, :d]) * x[t, d:] for a gated activation, its row function given per scalar type.
template <typename RowFn>
void gated_and_mul(at::Tensor& out, const at::Tensor& x, const char* name, RowFn row_fn) {
  check_last_dim_contiguous(x, "x");
  check_last_dim_contiguous(out, "out");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) && x.size(1) == 2 * out.size(1) &&
                  out.scalar_type() == x.scalar_type(),
              name, ": bad shapes or dtypes");
  const int64_t rows = x.size(0), d = out.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gated_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, grain_rows(3 * d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) row_fn(op + r * os, xp + r * xs, d);
    });
  });
}

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  gated_and_mul(out, x, "silu_and_mul",
                [](auto* o, const auto* g, int64_t d) { silu_and_mul_row(o, g, d); });
}

// ---------------------------------------------------------------------------------------------------------
// out[t, i] = gelu_tanh(x[t, i]) * x[t, d + i] (Gemma's GeGLU). gelu_tanh(g) = 0.5 g (1 + tanh(u)) with
// u = sqrt(2 / pi) (g + 0.044715 g^3), computed as g * sigmoid(2u) = g / (1 + exp(-2u)): the same function
// without tanh's cancellation near -1, and vexp's clamping gives the right limits (0 and g) for large |g|.

constexpr float kGeluTanhTwoC = 2.f * 0.7978845608028654f;  // 2 sqrt(2 / pi)

inline v16f gelu_tanh16(v16f g) { return g / (1.f + vexp(-(kGeluTanhTwoC * (g + 0.044715f * g * g * g)))); }

inline float gelu_tanh1(float g) {
  float lanes[16] = {g};
  float out[16];
  store16(out, gelu_tanh16(load16(lanes)));  // the vector formula, so a tail element rounds like the others
  return out[0];
}

template <typename scalar_t>
inline void gelu_tanh_and_mul_row(scalar_t* o, const scalar_t* g, int64_t d) {
  const scalar_t* u = g + d;
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    const v16f act = gelu_tanh16(load16(g + i));
    if constexpr (std::is_same_v<scalar_t, float>) {
      store16(o + i, act * load16(u + i));
    } else {
      float tmp[16];
      store16(tmp, act);
      for (int j = 0; j < 16; ++j) {
        const float a = static_cast<float>(static_cast<scalar_t>(tmp[j]));
        o[i + j] = static_cast<scalar_t>(a * static_cast<float>(u[i + j]));
      }
    }
  }
  for (; i < d; ++i) {
    const float a = static_cast<float>(static_cast<scalar_t>(gelu_tanh1(static_cast<float>(g[i]))));
    o[i] = static_cast<scalar_t>(a * static_cast<float>(u[i]));
  }
}

void gelu_tanh_and_mul(at::Tensor& out, const at::Tensor& x) {
  gated_and_mul(out, x, "gelu_tanh_and_mul",
                [](auto* o, const auto* g, int64_t d) { gelu_tanh_and_mul_row(o, g, d); });
}

// ---------------------------------------------------------------------------------------------------------
// Rotary embedding, neox layout (the two halves of the rotary part of each head rotate together), in place
// on query [T, Hq, D] and key [T, Hk, D] (row-strided views allowed). cos_sin_cache: [max_pos, rot] float32
// (cos half | sin half).

template <typename scalar_t>
inline void rotate_heads(scalar_t* base, int64_t num_heads, int64_t head_stride, const float* cos_p,
                         const float* sin_p, int64_t half) {
  for (int64_t h = 0; h < num_heads; ++h) {
    scalar_t* x = base + h * head_stride;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = static_cast<float>(x[i]);
      const float x2 = static_cast<float>(x[i + half]);
      x[i] = static_cast<scalar_t>(x1 * cos_p[i] - x2 * sin_p[i]);
      x[i + half] = static_cast<scalar_t>(x2 * cos_p[i] + x1 * sin_p[i]);
    }
  }
}

void rotary_neox(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos_sin_cache) {
  check_last_dim_contiguous(query, "query");
  check_last_dim_contiguous(key, "key");
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && key.size(0) == query.size(0) &&
                  positions.numel() == query.size(0) && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous() && cos_sin_cache.scalar_type() == at::kFloat &&
                  cos_sin_cache.is_contiguous() && key.scalar_type() == query.scalar_type(),
              "rotary_neox: bad shapes or dtypes");
  const int64_t tokens = query.size(0), rot = cos_sin_cache.size(1), half = rot / 2;
  TORCH_CHECK(rot <= query.size(2) && rot <= key.size(2), "rotary_neox: rotary dim larger than the head");
  const int64_t max_pos = cos_sin_cache.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cache = cos_sin_cache.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "rotary_neox", [&] {
    scalar_t* qp = query.data_ptr<scalar_t>();
    scalar_t* kp = key.data_ptr<scalar_t>();
    const int64_t qs0 = query.stride(0), qs1 = query.stride(1), ks0 = key.stride(0), ks1 = key.stride(1);
    const int64_t hq = query.size(1), hk = key.size(1);
    at::parallel_for(0, tokens, grain_rows(2 * (hq + hk) * half), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p = pos[t];
        TORCH_CHECK(p >= 0 && p < max_pos, "rotary_neox: position ", p, " outside the cos/sin cache");
        const float* c = cache + p * rot;
        rotate_heads<scalar_t>(qp + t * qs0, hq, qs1, c, c + half, half);
        rotate_heads<scalar_t>(kp + t * ks0, hk, ks1, c, c + half, half);
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------------------
// Paged KV cache, CPU layout. The pool is allocated as [num_blocks, block_size, Hk, D] per K and V like on
// every device, but the CPU backend stores each block head-major and K transposed:
//   K: [num_blocks, Hk, D, block_size]   (for one head and one dim, the block's keys are contiguous, so a
//                                         query row's scores for 16 keys are 16-lane FMAs, no reductions)
//   V: [num_blocks, Hk, block_size, D]
// write_kv puts token t's K/V ([Hk, D] each) at slot slot_mapping[t] = block * block_size + offset; negative
// slots (padding) are skipped.

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping, int64_t num_tokens) {
  check_last_dim_contiguous(key, "key");
  check_last_dim_contiguous(value, "value");
  check_cpu(k_cache, "k_cache");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(3) && k_cache.size(3) == v_cache.size(2) && key.dim() == 3 &&
                  key.sizes() == value.sizes() && key.size(1) == k_cache.size(1) && key.size(2) == k_cache.size(2) &&
                  slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() >= num_tokens &&
                  num_tokens >= 0 && num_tokens <= key.size(0) &&
                  key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv: expects k_cache [blocks, Hk, D, block_size] and v_cache [blocks, Hk, block_size, D]");
  const int64_t num_blocks = k_cache.size(0), heads = k_cache.size(1), d = k_cache.size(2);
  const int64_t block_size = k_cache.size(3);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "write_kv", [&] {
    const scalar_t* kp = key.data_ptr<scalar_t>();
    const scalar_t* vp = value.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int64_t ks0 = key.stride(0), ks1 = key.stride(1), vs0 = value.stride(0), vs1 = value.stride(1);
    const int64_t per_block = heads * d * block_size;
    at::parallel_for(0, num_tokens, grain_rows(2 * heads * d), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const int64_t blk = slot / block_size, off = slot % block_size;
        TORCH_CHECK(blk < num_blocks, "write_kv: slot ", slot, " outside the cache");
        for (int64_t h = 0; h < heads; ++h) {
          const scalar_t* ksrc = kp + t * ks0 + h * ks1;
          scalar_t* kdst = kc + blk * per_block + h * d * block_size + off;
          for (int64_t e = 0; e < d; ++e) kdst[e * block_size] = ksrc[e];
          const scalar_t* vsrc = vp + t * vs0 + h * vs1;
          std::copy(vsrc, vsrc + d, vc + blk * per_block + (h * block_size + off) * d);
        }
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------------------
// Paged attention over a flattened mixed batch (decodes, prefill chunks, prefix hits alike).
//
// Request r owns query tokens [qsl[r], qsl[r+1]); they are the last query_len of its seq_lens[r] tokens, whose
// K/V are already in the cache at block_table[r, :]. Query token i of the chunk attends causally to the first
// (seq_len - query_len + i + 1) tokens; with a sliding window (window > 0) only to the last `window` of them
// (transformers' mask: key k is seen from position p when p - window < k <= p), and blocks wholly before the
// window are never read (they may have been freed and handed to another request). Work items are (request, kv head, tile of up to kTile query tokens):
// each K/V block read serves all tile x group query rows. Items are handed out dynamically, heaviest first, so
// long prefill tiles and short decodes balance over the threads. Softmax is the online (streaming) form over
// chunks of 16 keys: 16 scores per FMA from the transposed K, vector exp, then P @ V into the accumulator.
// With soft_cap > 0 (Gemma 2's attn_logit_softcapping) each scaled score s becomes cap * tanh(s / cap) first.

constexpr int64_t kTile = 16;

struct Item {
  int64_t req, head_begin, head_end, q_begin, q_end, cost;  // kv heads [head_begin, head_end)
};

#if defined(PAGEDLLM_AVX2_ATTENTION)
// AVX2 machines without AVX-512, float32 KV: the two loops below in ymm halves. GCC lowers the 16-lane vector
// type's scalar broadcasts and accumulators there through the stack (spills on every FMA); written with
// intrinsics the decode attention runs several times faster (docs/benchmarks.md, Gemma 3 270M).
template <int R>
inline void qk16_avx2(const float* q, int64_t d, const float* kt, int64_t block_size, v16f* out,
                      const float* prefetch_kt) {
  __m256 lo[R], hi[R];  // one accumulator pair per row: 2R independent FMA chains
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  for (int64_t e = 0; e < d; ++e) {
    if (prefetch_kt != nullptr) __builtin_prefetch(prefetch_kt + e * block_size);
    const __m256 k0 = _mm256_loadu_ps(kt + e * block_size), k1 = _mm256_loadu_ps(kt + e * block_size + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 qe = _mm256_broadcast_ss(q + r * d + e);
      lo[r] = _mm256_fmadd_ps(qe, k0, lo[r]);
      hi[r] = _mm256_fmadd_ps(qe, k1, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float tmp[16];
    _mm256_store_ps(tmp, lo[r]);
    _mm256_store_ps(tmp + 8, hi[r]);
    std::memcpy(&out[r], tmp, sizeof(tmp));
  }
}

inline void pv_accumulate_avx2(float* a, float alpha, const float* p, int64_t n, const float* v, int64_t d) {
  const __m256 al = _mm256_set1_ps(alpha);
  int64_t e = 0;
  for (; e + 64 <= d; e += 64) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_mul_ps(_mm256_loadu_ps(a + e + 8 * i), al);
    for (int64_t j = 0; j < n; ++j) {
      const __m256 pj = _mm256_broadcast_ss(p + j);
      const float* vr = v + j * d + e;
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * i), acc[i]);
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(a + e + 8 * i, acc[i]);
  }
  for (; e + 8 <= d; e += 8) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a + e), al);
    for (int64_t j = 0; j < n; ++j) acc = _mm256_fmadd_ps(_mm256_broadcast_ss(p + j), _mm256_loadu_ps(v + j * d + e), acc);
    _mm256_storeu_ps(a + e, acc);
  }
  for (; e < d; ++e) {
    float a0 = a[e] * alpha;
    for (int64_t j = 0; j < n; ++j) a0 += p[j] * v[j * d + e];
    a[e] = a0;
  }
}
#endif

// Scores of R query rows (R <= 4) against 16 keys of a transposed K block: K loaded once per dim, two
// accumulators per row so the FMA chains overlap instead of waiting on each other's latency.
template <int R, typename scalar_t>
inline void qk16(const float* q, int64_t d, const scalar_t* kt, int64_t block_size, v16f* out,
                 const scalar_t* prefetch_kt) {
#if defined(PAGEDLLM_AVX2_ATTENTION)
  if constexpr (std::is_same_v<scalar_t, float>) return qk16_avx2<R>(q, d, kt, block_size, out, prefetch_kt);
#endif
  v16f a[R], b[R];
  for (int r = 0; r < R; ++r) a[r] = b[r] = v16f{};
  int64_t e = 0;
  for (; e + 2 <= d; e += 2) {
    if (prefetch_kt != nullptr) {  // the same rows of the next block, one line per dim, spread over the loop
      __builtin_prefetch(prefetch_kt + e * block_size);
      __builtin_prefetch(prefetch_kt + (e + 1) * block_size);
    }
    const v16f k0 = load16(kt + e * block_size), k1 = load16(kt + (e + 1) * block_size);
    for (int r = 0; r < R; ++r) {
      a[r] += q[r * d + e] * k0;
      b[r] += q[r * d + e + 1] * k1;
    }
  }
  for (; e < d; ++e) {
    const v16f k0 = load16(kt + e * block_size);
    for (int r = 0; r < R; ++r) a[r] += q[r * d + e] * k0;
  }
  for (int r = 0; r < R; ++r) out[r] = a[r] + b[r];
}

// a[0:d] = a * alpha + sum_j p[j] * v[j, 0:d] for j < n (v rows d apart), four independent chains per 64 dims.
template <typename scalar_t>
inline void pv_accumulate(float* a, float alpha, const float* p, int64_t n, const scalar_t* v, int64_t d,
                          const scalar_t* prefetch_v) {
  if (prefetch_v != nullptr) {  // the next block's rows for this head
    const char* pv = reinterpret_cast<const char*>(prefetch_v);
    const int64_t bytes = n * d * static_cast<int64_t>(sizeof(scalar_t));
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(pv + off);
  }
#if defined(PAGEDLLM_AVX2_ATTENTION)
  if constexpr (std::is_same_v<scalar_t, float>) return pv_accumulate_avx2(a, alpha, p, n, v, d);
#endif
  int64_t e = 0;
  for (; e + 64 <= d; e += 64) {
    v16f a0 = load16(a + e) * alpha, a1 = load16(a + e + 16) * alpha;
    v16f a2 = load16(a + e + 32) * alpha, a3 = load16(a + e + 48) * alpha;
    for (int64_t j = 0; j < n; ++j) {
      const scalar_t* vr = v + j * d + e;
      const float pj = p[j];
      a0 += pj * load16(vr);
      a1 += pj * load16(vr + 16);
      a2 += pj * load16(vr + 32);
      a3 += pj * load16(vr + 48);
    }
    store16(a + e, a0);
    store16(a + e + 16, a1);
    store16(a + e + 32, a2);
    store16(a + e + 48, a3);
  }
  for (; e + 16 <= d; e += 16) {
    v16f a0 = load16(a + e) * alpha;
    for (int64_t j = 0; j < n; ++j) a0 += p[j] * load16(v + j * d + e);
    store16(a + e, a0);
  }
  for (; e < d; ++e) {
    float a0 = a[e] * alpha;
    for (int64_t j = 0; j < n; ++j) a0 += p[j] * static_cast<float>(v[j * d + e]);
    a[e] = a0;
  }
}

template <typename scalar_t>
void attend_item(const Item& it, scalar_t* out, int64_t os0, int64_t os1, const scalar_t* q, int64_t qs0,
                 int64_t qs1, const scalar_t* kc, const scalar_t* vc, const int32_t* bt, int64_t bts0,
                 const int32_t* qsl, const int32_t* seq_lens, int64_t heads, int64_t group, int64_t d,
                 int64_t block_size, int64_t num_blocks, float scale, int64_t window, float soft_cap,
                 std::vector<float>& work) {
  const int64_t nq = it.q_end - it.q_begin, nh = it.head_end - it.head_begin;
  const int64_t per_head = nq * group, rows = per_head * nh;  // row r = hh * per_head + i * group + g
  const int64_t q_start = qsl[it.req], q_len = qsl[it.req + 1] - q_start;
  const int64_t ctx_before = static_cast<int64_t>(seq_lens[it.req]) - q_len;
  // Keys visible to query token q_begin + i: first_visible + i.
  const int64_t first_visible = ctx_before + (it.q_begin - q_start) + 1;
  const int64_t max_keys = first_visible + nq - 1;
  // With a window, query token q_begin + i sees keys [first_visible + i - window, first_visible + i).
  const int64_t min_key = window > 0 ? std::max<int64_t>(0, first_visible - window) : 0;
  work.resize(rows * d * 2 + rows * 2 + 16);
  float* qbuf = work.data();
  float* acc = qbuf + rows * d;
  float* m = acc + rows * d;
  float* l = m + rows;
  for (int64_t hh = 0; hh < nh; ++hh) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = q + (it.q_begin + i) * qs0 + ((it.head_begin + hh) * group + g) * qs1;
        float* dst = qbuf + (hh * per_head + i * group + g) * d;
        for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<float>(src[e]) * scale;
      }
    }
  }
  std::fill(acc, acc + rows * d, 0.f);
  std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
  std::fill(l, l + rows, 0.f);
  const int32_t* table = bt + it.req * bts0;
  const int64_t per_block = heads * d * block_size;
  const int64_t head_span = d * block_size;  // one head's K (or V) in a block
  for (int64_t kb = min_key / block_size; kb * block_size < max_keys; ++kb) {
    const int64_t blk = table[kb];
    TORCH_CHECK(blk >= 0 && blk < num_blocks, "paged_attention: block id ", blk, " outside the cache");
    const int64_t n = std::min(block_size, max_keys - kb * block_size);
    // The next block lives elsewhere in the pool, out of the hardware prefetcher's sight: its lines are
    // requested while this block is computed (spread over the loops, so the miss queue never overflows).
    const int64_t next_blk = (kb + 1) * block_size < max_keys ? table[kb + 1] : -1;
    const bool has_next = next_blk >= 0 && next_blk < num_blocks;
    for (int64_t hh = 0; hh < nh; ++hh) {
      const scalar_t* kt = kc + blk * per_block + (it.head_begin + hh) * head_span;  // [D, block_size]
      const scalar_t* vb = vc + blk * per_block + (it.head_begin + hh) * head_span;  // [block_size, D]
      const scalar_t* next_kt = has_next ? kc + next_blk * per_block + (it.head_begin + hh) * head_span : nullptr;
      const scalar_t* next_vb = has_next ? vc + next_blk * per_block + (it.head_begin + hh) * head_span : nullptr;
      for (int64_t c0 = 0; c0 < n; c0 += 16) {
        const int64_t cn = std::min<int64_t>(16, n - c0);
        const int64_t key0 = kb * block_size + c0;  // position of this chunk's first key
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t visible = std::min(cn, first_visible + i - key0);
          // lanes before `skip` lie before this query's window
          const int64_t skip = window > 0 ? std::max<int64_t>(0, first_visible + i - window - key0) : 0;
          if (visible <= skip) continue;
          const v16i live = (kLane < static_cast<int>(visible)) & (kLane >= static_cast<int>(skip));
          for (int64_t g0 = 0; g0 < group; g0 += 4) {
            const int64_t rows_here = std::min<int64_t>(4, group - g0);
            const int64_t r0 = hh * per_head + i * group + g0;
            v16f s[4];
            if (cn == 16) {
              const float* q0 = qbuf + r0 * d;
              const scalar_t* k0 = kt + c0;
              // Prefetch once per (head, chunk): on the first query row group of the first query token.
              const scalar_t* pf_k = (i == 0 && g0 == 0 && next_kt != nullptr) ? next_kt + c0 : nullptr;
              switch (rows_here) {
                case 4: qk16<4>(q0, d, k0, block_size, s, pf_k); break;
                case 3: qk16<3>(q0, d, k0, block_size, s, pf_k); break;
                case 2: qk16<2>(q0, d, k0, block_size, s, pf_k); break;
                default: qk16<1>(q0, d, k0, block_size, s, pf_k); break;
              }
            } else {
              for (int64_t rr = 0; rr < rows_here; ++rr) {
                const float* qr = qbuf + (r0 + rr) * d;
                float tmp[16] = {};
                for (int64_t e = 0; e < d; ++e) {
                  const scalar_t* krow = kt + e * block_size + c0;
                  for (int64_t j = 0; j < cn; ++j) tmp[j] += qr[e] * static_cast<float>(krow[j]);
                }
                std::memcpy(&s[rr], tmp, sizeof(tmp));
              }
            }
            for (int64_t rr = 0; rr < rows_here; ++rr) {
              const int64_t r = r0 + rr;
              if (soft_cap > 0.f) s[rr] = vtanh(s[rr] / soft_cap) * soft_cap;  // Gemma 2: cap * tanh(s / cap)
              const v16f sr = live ? s[rr] : v16f{} - std::numeric_limits<float>::infinity();
              const float new_m = std::max(m[r], hmax(sr));
              v16f p = vexp(sr - new_m);
              p = live ? p : v16f{};
              const float alpha = std::exp(m[r] - new_m);  // 0 while m is -inf
              m[r] = new_m;
              l[r] = l[r] * alpha + hsum(p);
              float pj[16];
              std::memcpy(pj, &p, sizeof(pj));
              const scalar_t* pf_v = (i == 0 && g0 == 0 && rr == 0 && next_vb != nullptr) ? next_vb + c0 * d : nullptr;
              pv_accumulate<scalar_t>(acc + r * d, alpha, pj + skip, visible - skip, vb + (c0 + skip) * d, d, pf_v);
            }
          }
        }
      }
    }
  }
  for (int64_t hh = 0; hh < nh; ++hh) {
    for (int64_t i = 0; i < nq; ++i) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = hh * per_head + i * group + g;
        const float inv = 1.f / l[r];
        scalar_t* dst = out + (it.q_begin + i) * os0 + ((it.head_begin + hh) * group + g) * os1;
        for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<scalar_t>(acc[r * d + e] * inv);
      }
    }
  }
}

// Requests whose query chunk has skip_query_len or more tokens (when > 0) are left to the caller: for long
// prefill chunks a gather + torch's flash-attention kernel is faster than this one.
void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_table, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                     double scale, int64_t skip_query_len, int64_t window, double soft_cap) {
  check_last_dim_contiguous(out, "out");
  check_last_dim_contiguous(query, "query");
  check_cpu(k_cache, "k_cache");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&block_table, &query_start_loc, &seq_lens}) {
    check_cpu(*t, "attention metadata");
    TORCH_CHECK(t->scalar_type() == at::kInt, "paged_attention: metadata must be int32");
  }
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && k_cache.dim() == 4 && v_cache.dim() == 4 &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(0) == v_cache.size(0) &&
                  k_cache.size(1) == v_cache.size(1) && k_cache.size(2) == v_cache.size(3) &&
                  k_cache.size(3) == v_cache.size(2) && k_cache.size(2) == query.size(2) &&
                  query.size(1) % k_cache.size(1) == 0 && block_table.stride(1) == 1 &&
                  query_start_loc.is_contiguous() && seq_lens.is_contiguous() &&
                  query_start_loc.numel() == seq_lens.numel() + 1 && block_table.size(0) >= seq_lens.numel() &&
                  k_cache.scalar_type() == query.scalar_type() && v_cache.scalar_type() == query.scalar_type() &&
                  out.scalar_type() == query.scalar_type(),
              "paged_attention: expects k_cache [blocks, Hk, D, block_size], v_cache [blocks, Hk, block_size, D] "
              "and int32 metadata");
  const int64_t num_reqs = seq_lens.numel();
  const int64_t kv_heads = k_cache.size(1), d = k_cache.size(2), block_size = k_cache.size(3);
  const int64_t group = query.size(1) / kv_heads, max_blocks = block_table.size(1);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0 (0: no sliding window)");
  TORCH_CHECK(soft_cap >= 0, "paged_attention: soft_cap must be >= 0 (0: no soft-capping)");
  std::vector<Item> items;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t q_begin = qsl[r], q_end = qsl[r + 1], q_len = q_end - q_begin;
    TORCH_CHECK(q_len >= 0 && q_end <= query.size(0) && lens[r] >= q_len &&
                    (lens[r] + block_size - 1) / block_size <= max_blocks,
                "paged_attention: inconsistent metadata for request ", r);
    if (skip_query_len > 0 && q_len >= skip_query_len) continue;
    if (q_len == 1) {
      // A decode: one item over all kv heads, so each block is read as one contiguous span per K and V.
      const int64_t keys = window > 0 ? std::min<int64_t>(lens[r], window) : lens[r];
      items.push_back({r, 0, kv_heads, q_begin, q_end, keys * kv_heads});
      continue;
    }
    for (int64_t t = q_begin; t < q_end; t += kTile) {
      const int64_t t_end = std::min(q_end, t + kTile);
      int64_t keys = lens[r] - q_len + (t_end - q_begin);
      if (window > 0) keys = std::min<int64_t>(keys, window + (t_end - t));
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({r, h, h + 1, t, t_end, keys * (t_end - t)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  int64_t total_cost = 0;
  for (const Item& it : items) total_cost += it.cost;
  // Tiny batches (a short decode, a small model) run on the calling thread: waking the pool costs more.
  const int64_t workers = total_cost * group * d < 65536
                              ? 1
                              : std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t* qp = query.data_ptr<scalar_t>();
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const int32_t* bt = block_table.data_ptr<int32_t>();
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      std::vector<float> work;
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        attend_item<scalar_t>(items[i], op, out.stride(0), out.stride(1), qp, query.stride(0), query.stride(1), kc,
                              vc, bt, block_table.stride(0), qsl, lens, kv_heads, group, d,
                              block_size, k_cache.size(0), static_cast<float>(scale), window,
                              static_cast<float>(soft_cap), work);
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------------------
// Exact greedy token from a bf16 screen of the LM head. approx[r, t] = bf16(x_r . w_t) computed from bf16-rounded
// x and w; its distance to the real-number logit z is at most B_t = c * |x_r| * |w_t| + out_err * |approx[r, t]|
// (input and weight rounding, fp32 accumulation, output rounding). The real argmax m then has
// approx_m + B_m >= z_m >= max_t (approx_t - B_t), so it is among the candidates passing that test; their logits
// are recomputed from the fp32 weights (double accumulation) and the largest wins (lowest id on ties).
// out[r] = -1 when a row has more than max_candidates (the caller then computes that row's full logits).

void greedy_screen(at::Tensor& out, const at::Tensor& approx, const at::Tensor& x, const at::Tensor& weight,
                   const at::Tensor& w_norms, int64_t vocab, double c, double out_err, int64_t max_candidates) {
  TORCH_CHECK(approx.scalar_type() == at::kBFloat16 && approx.dim() == 2 && approx.stride(1) == 1 &&
                  x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() &&
                  weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.size(1) == x.size(1) &&
                  w_norms.scalar_type() == at::kFloat && w_norms.is_contiguous() &&
                  out.scalar_type() == at::kLong && out.numel() == x.size(0) && approx.size(0) == x.size(0) &&
                  vocab <= approx.size(1) && vocab <= weight.size(0) && vocab <= w_norms.numel(),
              "greedy_screen: bad shapes or dtypes");
  const int64_t rows = x.size(0), h = x.size(1), as0 = approx.stride(0);
  const c10::BFloat16* ap = approx.data_ptr<c10::BFloat16>();
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* wn = w_norms.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> cand;
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * h;
      double sq = 0.0;
      for (int64_t i = 0; i < h; ++i) sq += static_cast<double>(xr[i]) * xr[i];
      const float cx = static_cast<float>(c * std::sqrt(sq) * (1.0 + 1e-6));
      const float oe = static_cast<float>(out_err);
      const uint16_t* ar = reinterpret_cast<const uint16_t*>(ap + r * as0);
      // Pass 1: thr = max_t (a_t - B_t); pass 2: the candidates, a_t + B_t >= thr. 16 lanes at a time.
      const v16f cxv = v16f{} + cx, oev = v16f{} + oe;
      v16f lo_max = v16f{} - std::numeric_limits<float>::infinity();
      int64_t t = 0;
      for (; t + 16 <= vocab; t += 16) {
        const v16f a = bf16x16_to_float(ar + t);
        const v16f lo = a - (cxv * load16(wn + t) + oev * vabs(a));
        lo_max = lo > lo_max ? lo : lo_max;
      }
      float thr = hmax(lo_max);
      for (; t < vocab; ++t) {
        const float a = bf16_bits_to_float(ar[t]);
        thr = std::max(thr, a - (cx * wn[t] + oe * std::fabs(a)));
      }
      cand.clear();
      bool overflow = false;
      const auto take = [&](int64_t id) {  // sets overflow instead of exceeding max_candidates
        overflow = static_cast<int64_t>(cand.size()) >= max_candidates;
        if (!overflow) cand.push_back(id);
      };
      const v16f thrv = v16f{} + thr;
      for (t = 0; t + 16 <= vocab && !overflow; t += 16) {
        const v16f a = bf16x16_to_float(ar + t);
        const v16i hit = (a + (cxv * load16(wn + t) + oev * vabs(a))) >= thrv;
        if (!any_lane(hit)) continue;
        for (int j = 0; j < 16 && !overflow; ++j) {
          if (hit[j]) take(t + j);
        }
      }
      for (; t < vocab && !overflow; ++t) {
        const float a = bf16_bits_to_float(ar[t]);
        if (a + (cx * wn[t] + oe * std::fabs(a)) >= thr) take(t);
      }
      if (overflow || cand.empty()) {  // empty only with NaN logits: let the full path decide
        op[r] = -1;
        continue;
      }
      int64_t best = cand[0];
      double best_v = -std::numeric_limits<double>::infinity();
      for (const int64_t t : cand) {
        const float* wt = wp + t * h;
        double v = 0.0;
        for (int64_t i = 0; i < h; ++i) v += static_cast<double>(xr[i]) * wt[i];
        if (v > best_v) {  // strict: the lowest id wins ties, as torch.argmax does
          best_v = v;
          best = t;
        }
      }
      op[r] = best;
    }
  });
}

}  // namespace

// The ops above, callable from the other files of this extension (cpu_fused.cpp chains them per layer).
namespace pagedllm_export {
void rms_norm_op(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  ::rms_norm(out, x, weight, eps);
}
void add_rms_norm_op(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x, const at::Tensor& residual,
                     const at::Tensor& weight, double eps) {
  ::add_rms_norm(out, residual_out, x, residual, weight, eps);
}
void silu_and_mul_op(at::Tensor& out, const at::Tensor& x) { ::silu_and_mul(out, x); }
void gelu_tanh_and_mul_op(at::Tensor& out, const at::Tensor& x) { ::gelu_tanh_and_mul(out, x); }
void rotary_neox_op(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos_sin) {
  ::rotary_neox(positions, query, key, cos_sin);
}
void write_kv_op(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                 const at::Tensor& slot_mapping, int64_t num_tokens) {
  ::write_kv(key, value, k_cache, v_cache, slot_mapping, num_tokens);
}
void paged_attention_op(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& query_start_loc,
                        const at::Tensor& seq_lens, double scale, int64_t window, double soft_cap) {
  ::paged_attention(out, query, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, 0, window,
                    soft_cap);
}
}  // namespace pagedllm_export

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("add_rms_norm(Tensor(a!) out, Tensor(b!) residual_out, Tensor x, Tensor residual, Tensor weight, "
        "float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("rotary_neox(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache) -> ()");
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "int num_tokens) -> ()");
  m.def("greedy_screen(Tensor(a!) out, Tensor approx, Tensor x, Tensor weight, Tensor w_norms, int vocab, "
        "float c, float out_err, int max_candidates) -> ()");
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, int skip_query_len=0, int window=0, "
        "float soft_cap=0.) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("gelu_tanh_and_mul", &gelu_tanh_and_mul);
  m.impl("rotary_neox", &rotary_neox);
  m.impl("write_kv", &write_kv);
  m.impl("paged_attention", &paged_attention);
  m.impl("greedy_screen", &greedy_screen);
}
