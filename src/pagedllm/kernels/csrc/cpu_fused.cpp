// pagedllm CPU kernels: a whole Llama-style decoder stack in one call, for CPU steps of a few tokens (decode).
//
// At batch 1 the per-layer kernels take a few microseconds each, and running them one by one from Python
// (norms, projections, rope, KV write, attention, views, allocations) costs more than the kernels. This op
// chains the same kernels (cpu_ops.cpp, gguf_ops.cpp) over every layer in C++, reusing one set of activation
// buffers for all layers, so a step is one call from Python. Numerics are those of the per-op path exactly.
//
// Two layer kinds (one per model): Llama's (input norm, attention, post-attention norm fused with the residual
// add, SiLU MLP) and Gemma's (models/gemma2.py: the attention and MLP outputs are normed before their residual
// add, a pre-feed-forward norm, a GeGLU MLP; Gemma's (1 + w) norm weights arrive as plain RMSNorm weights).
//
// Arguments (built once per model by models/cpu_decode.py):
//   layout: [num_layers, num_heads, num_kv_heads, head_dim, hidden, intermediate, has_qk_norm, gemma], then per
//           layer its sliding window (0: none), its KV-cache group and per projection (qkv, o, gate_up, down):
//           [num_parts, has_bias, type_0 .. type_{n-1}]
//   floats: per layer [input_norm_eps, post_attention_norm_eps, pre_ffn_norm_eps, post_ffn_norm_eps,
//           qk_norm_eps, attention_scale, attention_logit_soft_cap] (unused ones and no cap: 0), then the final
//           norm eps
//   weights: per layer [input_norm, post_attention_norm, (pre_ffn_norm, post_ffn_norm: gemma), cos_sin_cache,
//           k_cache, v_cache, (q_norm, k_norm)], then per projection its packed parts and its bias if any; at the
//           end the final norm's weight. Each layer has its own rope cache (Gemma 3's local layers rotate with
//           another base than its global ones).
//   slot_mappings, block_tables: one per KV-cache group (layers with different sliding windows read different
//           block tables: core/kv_cache_groups.py).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace pagedllm_export {
void rms_norm_op(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_op(at::Tensor& out, at::Tensor& residual_out, const at::Tensor& x, const at::Tensor& residual,
                     const at::Tensor& weight, double eps);
void silu_and_mul_op(at::Tensor& out, const at::Tensor& x);
void gelu_tanh_and_mul_op(at::Tensor& out, const at::Tensor& x);
void rotary_neox_op(const at::Tensor& positions, at::Tensor& query, at::Tensor& key, const at::Tensor& cos_sin);
void write_kv_op(const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
                 const at::Tensor& slot_mapping, int64_t num_tokens);
void paged_attention_op(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_table, const at::Tensor& query_start_loc,
                        const at::Tensor& seq_lens, double scale, int64_t window, double soft_cap);
void gguf_linear_op(at::Tensor& out, const at::Tensor& x, at::TensorList weights, at::IntArrayRef types,
                    const c10::optional<at::Tensor>& bias);
}  // namespace pagedllm_export

namespace {

using namespace pagedllm_export;

struct Cursor {
  at::TensorList weights;
  at::IntArrayRef layout;
  size_t w = 0, l = 0;
  int64_t next_int() {
    TORCH_CHECK(l < layout.size(), "decode_stack: layout too short");
    return layout[l++];
  }
  const at::Tensor& next_tensor() {
    TORCH_CHECK(w < weights.size(), "decode_stack: weights list too short");
    return weights[w++];
  }
};

// One packed projection: out = x @ W^T (+ bias), W's parts and types read at the cursor.
void projection(Cursor& cur, at::Tensor& out, const at::Tensor& x) {
  const int64_t parts = cur.next_int(), has_bias = cur.next_int();
  TORCH_CHECK(parts > 0 && cur.l + parts <= cur.layout.size() && cur.w + parts + has_bias <= cur.weights.size(),
              "decode_stack: bad projection entry");
  at::IntArrayRef types(cur.layout.data() + cur.l, parts);
  at::TensorList ws(cur.weights.data() + cur.w, parts);
  cur.l += parts;
  cur.w += parts;
  c10::optional<at::Tensor> bias;
  if (has_bias) bias = cur.next_tensor();
  gguf_linear_op(out, x, ws, types, bias);
}

void decode_stack(at::Tensor& out, const at::Tensor& hidden, const at::Tensor& positions, at::TensorList weights,
                  at::IntArrayRef layout, at::ArrayRef<double> floats, at::TensorList slot_mappings,
                  at::TensorList block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                  int64_t num_actual_tokens) {
  constexpr int64_t kHeader = 8, kFloats = 7;  // layout header entries, floats per layer
  TORCH_CHECK(!slot_mappings.empty() && slot_mappings.size() == block_tables.size(),
              "decode_stack: one slot mapping and one block table per KV-cache group");
  TORCH_CHECK(static_cast<int64_t>(layout.size()) >= kHeader && layout[0] >= 1, "decode_stack: layout too short");
  const int64_t num_layers = layout[0], hq = layout[1], hk = layout[2], d = layout[3], hidden_size = layout[4];
  const int64_t inter = layout[5], qk_norm = layout[6], gemma = layout[7];
  TORCH_CHECK(hidden.device().is_cpu() && hidden.scalar_type() == at::kFloat && hidden.dim() == 2 &&
                  hidden.is_contiguous() && hidden.size(1) == hidden_size && out.sizes() == hidden.sizes() &&
                  out.scalar_type() == at::kFloat && out.is_contiguous(),
              "decode_stack: hidden and out must be contiguous float32 [T, hidden]");
  TORCH_CHECK(static_cast<int64_t>(floats.size()) == kFloats * num_layers + 1,
              "decode_stack: floats has the wrong size");
  const int64_t t = hidden.size(0);
  TORCH_CHECK(num_actual_tokens >= 0 && num_actual_tokens <= t, "decode_stack: bad num_actual_tokens");
  if (t == 0) return;
  const int64_t q_size = hq * d, kv_size = hk * d, qkv_size = q_size + 2 * kv_size;
  const auto opts = hidden.options();
  at::Tensor res = at::empty({t, hidden_size}, opts), xn = at::empty({t, hidden_size}, opts);
  at::Tensor h = at::empty({t, hidden_size}, opts), qkv = at::empty({t, qkv_size}, opts);
  at::Tensor attn = at::empty({t, q_size}, opts), gu = at::empty({t, 2 * inter}, opts);
  at::Tensor act = at::empty({t, inter}, opts);
  // Views shared by every layer (the buffers are reused).
  at::Tensor q3 = qkv.as_strided({t, hq, d}, {qkv_size, d, 1}, 0);
  at::Tensor k3 = qkv.as_strided({t, hk, d}, {qkv_size, d, 1}, q_size);
  at::Tensor v3 = qkv.as_strided({t, hk, d}, {qkv_size, d, 1}, q_size + kv_size);
  at::Tensor attn3 = attn.view({t, hq, d});
  if (num_actual_tokens < t)  // padding rows: attention never writes them
    std::memset(attn.data_ptr<float>() + num_actual_tokens * q_size, 0,
                sizeof(float) * (t - num_actual_tokens) * q_size);
  std::memcpy(res.data_ptr<float>(), hidden.data_ptr<float>(), sizeof(float) * t * hidden_size);
  Cursor cur{weights, layout, 0, kHeader};
  for (int64_t i = 0; i < num_layers; ++i) {
    const double* f = floats.data() + kFloats * i;
    const int64_t window = cur.next_int();
    const int64_t group = cur.next_int();
    TORCH_CHECK(group >= 0 && group < static_cast<int64_t>(block_tables.size()), "decode_stack: bad KV-cache group");
    const at::Tensor& slot_mapping = slot_mappings[group];
    const at::Tensor& block_table = block_tables[group];
    const at::Tensor& in_norm = cur.next_tensor();
    const at::Tensor& post_norm = cur.next_tensor();
    const at::Tensor* ffn_norms[2] = {nullptr, nullptr};
    if (gemma) ffn_norms[0] = &cur.next_tensor(), ffn_norms[1] = &cur.next_tensor();
    const at::Tensor& cos_sin = cur.next_tensor();
    at::Tensor k_cache = cur.next_tensor(), v_cache = cur.next_tensor();
    // h holds the previous layer's output (its residual not yet added)
    if (i == 0) rms_norm_op(xn, res, in_norm, f[0]);
    else add_rms_norm_op(xn, res, h, res, in_norm, f[0]);
    const at::Tensor* qk_w[2] = {nullptr, nullptr};
    if (qk_norm) qk_w[0] = &cur.next_tensor(), qk_w[1] = &cur.next_tensor();
    projection(cur, qkv, xn);
    if (qk_norm) {  // per-head RMSNorm of q and k before rope (Qwen3, Gemma 3)
      rms_norm_op(q3, q3, *qk_w[0], f[4]);
      rms_norm_op(k3, k3, *qk_w[1], f[4]);
    }
    rotary_neox_op(positions, q3, k3, cos_sin);
    write_kv_op(k3, v3, k_cache, v_cache, slot_mapping, num_actual_tokens);
    paged_attention_op(attn3, q3, k_cache, v_cache, block_table, query_start_loc, seq_lens, f[5], window, f[6]);
    projection(cur, h, attn);
    if (gemma) {  // residual + post_attention_norm(attn), then the pre-feed-forward norm of that sum
      rms_norm_op(h, h, post_norm, f[1]);
      add_rms_norm_op(xn, res, h, res, *ffn_norms[0], f[2]);
    } else {
      add_rms_norm_op(xn, res, h, res, post_norm, f[1]);
    }
    projection(cur, gu, xn);
    if (gemma) gelu_tanh_and_mul_op(act, gu);
    else silu_and_mul_op(act, gu);
    projection(cur, h, act);
    if (gemma) rms_norm_op(h, h, *ffn_norms[1], f[3]);
  }
  const at::Tensor& final_norm = cur.next_tensor();
  TORCH_CHECK(cur.w == weights.size() && cur.l == layout.size(), "decode_stack: weights or layout too long");
  add_rms_norm_op(out, res, h, res, final_norm, floats[kFloats * num_layers]);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.def("decode_stack(Tensor(a!) out, Tensor hidden, Tensor positions, Tensor[] weights, int[] layout, "
        "float[] floats, Tensor[] slot_mappings, Tensor[] block_tables, Tensor query_start_loc, Tensor seq_lens, "
        "int num_actual_tokens) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) { m.impl("decode_stack", &decode_stack); }
