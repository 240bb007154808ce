// Decode attention on the CPU: one query token per sequence over its own cached positions, in one pass over K and
// one over V. Batched matmuls read a decode step's cache at about half of DRAM bandwidth (a [G, D] x [D, L] GEMM per
// sequence and kv head); here each (sequence, kv head) streams its rows once for all G query heads that share them.
// Each item runs on one thread in a fixed order, so a row's result never depends on the rows decoded beside it.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kRows = 4;  // cache rows per block: independent accumulators hide the FMA latency

float sum_lanes(const Vec& x) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, x);
}

// q [n, KV, G, D]; k_cache, v_cache [slots, KV, max_len, D] (slot i holds row i); lengths [n]: row i attends to
// positions 0 .. lengths[i] - 1. Returns softmax(q k^T * scale) v as [n, KV, G, D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor lengths,
                               double scale) {
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "decode_attention: shapes");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat && lengths.scalar_type() == at::kLong,
              "decode_attention: fp32 q and caches, int64 lengths");
  const int64_t n = q.size(0), kv = q.size(1), g = q.size(2), d = q.size(3), w = Vec::size();
  TORCH_CHECK(d % w == 0 && k_cache.size(3) == d && k_cache.size(1) == kv && k_cache.size(0) >= n,
              "decode_attention: head dim must be a multiple of ", w);
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "decode_attention: caches need a unit last stride");
  q = q.contiguous();
  lengths = lengths.contiguous();
  auto out = torch::empty_like(q);
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = k_cache.data_ptr<float>();
  const float* v_ptr = v_cache.data_ptr<float>();
  const int64_t* length_ptr = lengths.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const int64_t max_len = k_cache.size(2);
  for (int64_t b = 0; b < n; ++b)
    TORCH_CHECK(length_ptr[b] >= 1 && length_ptr[b] <= max_len, "decode_attention: length ", length_ptr[b],
                " outside 1..", max_len);
  const float scale_f = static_cast<float>(scale);
  at::parallel_for(0, n * kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> probs;  // [G, len] scores, then probabilities
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv, h = item % kv, len = length_ptr[b];
      probs.resize(g * len);
      const float* qb = q_ptr + item * g * d;
      const float* kb = k_ptr + b * ks0 + h * ks1;
      const float* vb = v_ptr + b * vs0 + h * vs1;
      int64_t l = 0;
      for (; l + kRows <= len; l += kRows) {
        const float* k0 = kb + l * ks2;
        for (int64_t j = 0; j < g; ++j) {
          Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
          for (int64_t e = 0; e < d; e += w) {
            const Vec qe = Vec::loadu(qb + j * d + e);
            a0 = at::vec::fmadd(qe, Vec::loadu(k0 + e), a0);
            a1 = at::vec::fmadd(qe, Vec::loadu(k0 + ks2 + e), a1);
            a2 = at::vec::fmadd(qe, Vec::loadu(k0 + 2 * ks2 + e), a2);
            a3 = at::vec::fmadd(qe, Vec::loadu(k0 + 3 * ks2 + e), a3);
          }
          float* s = probs.data() + j * len + l;
          s[0] = sum_lanes(a0) * scale_f;
          s[1] = sum_lanes(a1) * scale_f;
          s[2] = sum_lanes(a2) * scale_f;
          s[3] = sum_lanes(a3) * scale_f;
        }
      }
      for (; l < len; ++l) {
        for (int64_t j = 0; j < g; ++j) {
          Vec a(0.f);
          for (int64_t e = 0; e < d; e += w) a = at::vec::fmadd(Vec::loadu(qb + j * d + e), Vec::loadu(kb + l * ks2 + e), a);
          probs[j * len + l] = sum_lanes(a) * scale_f;
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        float* p = probs.data() + j * len;
        const float top = *std::max_element(p, p + len);
        const Vec top_v(top);
        int64_t i = 0;
        for (; i + w <= len; i += w) (Vec::loadu(p + i) - top_v).exp_u20().store(p + i);
        for (; i < len; ++i) p[i] = std::exp(p[i] - top);
        float total = 0.f;
        for (i = 0; i < len; ++i) total += p[i];
        const float inv = 1.f / total;
        for (i = 0; i < len; ++i) p[i] *= inv;
      }
      float* ob = out_ptr + item * g * d;
      std::fill(ob, ob + g * d, 0.f);
      for (l = 0; l + kRows <= len; l += kRows) {
        const float* v0 = vb + l * vs2;
        for (int64_t j = 0; j < g; ++j) {
          const float* p = probs.data() + j * len + l;
          const Vec p0(p[0]), p1(p[1]), p2(p[2]), p3(p[3]);
          for (int64_t e = 0; e < d; e += w) {
            Vec acc = Vec::loadu(ob + j * d + e);
            acc = at::vec::fmadd(p0, Vec::loadu(v0 + e), acc);
            acc = at::vec::fmadd(p1, Vec::loadu(v0 + vs2 + e), acc);
            acc = at::vec::fmadd(p2, Vec::loadu(v0 + 2 * vs2 + e), acc);
            acc = at::vec::fmadd(p3, Vec::loadu(v0 + 3 * vs2 + e), acc);
            acc.store(ob + j * d + e);
          }
        }
      }
      for (; l < len; ++l) {
        for (int64_t j = 0; j < g; ++j) {
          const Vec pj(probs[j * len + l]);
          for (int64_t e = 0; e < d; e += w)
            at::vec::fmadd(pj, Vec::loadu(vb + l * vs2 + e), Vec::loadu(ob + j * d + e)).store(ob + j * d + e);
        }
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "one-token attention over per-sequence KV caches (fp32, CPU)");
}
