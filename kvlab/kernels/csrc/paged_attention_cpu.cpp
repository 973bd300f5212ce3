// Paged decode attention for CPU tensors: kvlab's counterpart of the Triton kernel
// (kvlab/kernels/triton.py) and of vLLM's CPU attention kernels.
//
// Each row is one query token (a decode, or one token of a short chunk). Its keys and values
// are read straight from the paged cache [num_blocks, block_size, kv_heads, head_dim] through
// its block table;
// nothing is gathered into a workspace first. Per row: scores q.k for every cached position,
// a softmax in float32, then the probability-weighted sum of V. Query head h uses KV head
// h / (heads / kv_heads) (grouped-query attention). Rows are independent: at::parallel_for
// spreads them over torch's threads.
//
// Built by kvlab/kernels/cpu.py with -ffast-math, which lets the compiler vectorise
// exp() (glibc's vector math) and the dot-product reductions. That is safe here because no
// value is infinite or NaN on a well-formed input: the running maximum starts from the first
// score, and only positions 0 .. len-1 are ever touched (no -inf mask).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <vector>

namespace {

// Calls visit(t, row) for positions t = 0 .. len-1 of one request, row pointing at position t's
// [kv_heads, dim] entries in `cache`, walking the block table one block at a time.
template <typename T, typename Visit>
void for_each_position(const T* cache, const int64_t* table, int64_t len, int64_t block_size,
                       int64_t token_stride, Visit visit) {
  for (int64_t t0 = 0, n = 0; t0 < len; t0 += block_size, ++n) {
    const T* block = cache + table[n] * block_size * token_stride;
    const int64_t count = std::min(block_size, len - t0);
    for (int64_t o = 0; o < count; ++o) visit(t0 + o, block + o * token_stride);
  }
}

template <typename T, int64_t DIM>
void attend_row(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t len, int64_t block_size, int64_t kv_heads, int64_t heads,
                int64_t runtime_dim, float scale, T* out, float* scores, float* acc, float* qf) {
  const int64_t dim = DIM ? DIM : runtime_dim;
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * dim;
  for (int64_t i = 0; i < heads * dim; ++i) qf[i] = static_cast<float>(q[i]) * scale;

  // scores[h, t] = (scale * q_h) . k_t. The visitors capture by value: copies of the pointers
  // and sizes let the compiler keep them in registers (by reference it was 7% slower).
  for_each_position(k_cache, table, len, block_size, token_stride, [=](int64_t t, const T* k) {
    for (int64_t j = 0, h = 0; j < kv_heads; ++j) {
      const T* kh = k + j * dim;
      for (int64_t g = 0; g < group; ++g, ++h) {
        const float* qh = qf + h * dim;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < dim; ++d) s += qh[d] * static_cast<float>(kh[d]);
        scores[h * len + t] = s;
      }
    }
  });
  // softmax over t, per head
  for (int64_t h = 0; h < heads; ++h) {
    float* s = scores + h * len;
    float m = s[0];
    for (int64_t t = 1; t < len; ++t) m = std::max(m, s[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = std::exp(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  }
  // acc[h] = sum_t p[h, t] * v_t
  std::fill(acc, acc + heads * dim, 0.f);
  for_each_position(v_cache, table, len, block_size, token_stride, [=](int64_t t, const T* v) {
    for (int64_t j = 0, h = 0; j < kv_heads; ++j) {
      const T* vh = v + j * dim;
      for (int64_t g = 0; g < group; ++g, ++h) {
        const float p = scores[h * len + t];
        float* a = acc + h * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += p * static_cast<float>(vh[d]);
      }
    }
  });
  for (int64_t i = 0; i < heads * dim; ++i) out[i] = static_cast<T>(acc[i]);
}

}  // namespace

// out, q: [rows, heads, dim] contiguous; k_cache, v_cache: [num_blocks, block_size, kv_heads,
// dim] contiguous; tables: [rows, width] int64; lens: [rows] int64, 1 <= lens[r] <=
// width * block_size. The caller (kvlab.kernels.cpu.decode_attention) checks all of it.
void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor tables, torch::Tensor lens,
                      double scale) {
  const int64_t rows = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t width = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t longest = rows ? *std::max_element(len, len + rows) : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention",
                                  [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(heads * longest), acc(heads * dim), qf(heads * dim);
      auto row = [&](auto dim_tag) {
        constexpr int64_t D = decltype(dim_tag)::value;
        for (int64_t r = begin; r < end; ++r)
          attend_row<scalar_t, D>(qp + r * heads * dim, kp, vp, table + r * width, len[r],
                                  block_size, kv_heads, heads, dim, static_cast<float>(scale),
                                  op + r * heads * dim, scores.data(), acc.data(), qf.data());
      };
      // common head sizes get a compile-time width (fully unrolled dot products)
      switch (dim) {
        case 32: row(std::integral_constant<int64_t, 32>{}); break;
        case 64: row(std::integral_constant<int64_t, 64>{}); break;
        case 128: row(std::integral_constant<int64_t, 128>{}); break;
        default: row(std::integral_constant<int64_t, 0>{});
      }
    });
  });
}
