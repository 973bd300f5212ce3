// Paged decode attention for CPU tensors: kvlab's counterpart of the Triton kernel
// (kvlab/kernels/triton.py) and of vLLM's CPU attention kernels.
//
// Each row is one query token (a decode, or one token of a short chunk). Its keys and values
// are read straight from the paged cache [num_blocks, block_size, kv_heads, head_dim] through
// its block table;
// nothing is gathered into a workspace first. With a sliding window W > 0 a row at position
// i reads only positions i - W + 1 .. i (table entries before them are never touched). Per row: scores q.k for every cached position,
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
#include <array>
#include <cstring>
#include <vector>

// ---------------------------------------------------------------------------------------------
// Vectors of VL float lanes (GCC vector extensions: +, *, comparisons and ?: act lane by lane)
// and an inline exp on them, shared by the chunk op and SiLU.
namespace {
namespace vec {

#if defined(__AVX512F__)
constexpr int VL = 16;
#else
constexpr int VL = 8;
#endif
typedef float vf __attribute__((vector_size(VL * sizeof(float))));
typedef int vi __attribute__((vector_size(VL * sizeof(int))));
constexpr float MIN_EXP = -80.f;

inline vf splat(float x) { return vf{} + x; }

// e^x for x <= 0, lane by lane, inline: x = n ln2 + f with n = round(x / ln2), e^f by its
// Taylor series to f^7 (|f| <= ln2 / 2), times 2^n built in the exponent bits. -ffast-math
// merges the two parts of ln2, so the relative error is under 3e-7 (2-3 ulps) where the build
// has FMA (AVX2, AVX-512) and about 4e-6 without it. Lanes below -80 give exactly 0 (e^-80 is
// 1.8e-35). glibc's vector expf, which this replaces, is a call per vector and sends every
// lane far below its range (each masked score) down a slow scalar path.
inline vf exp_nonpositive(vf x) {
  const vi low = x < MIN_EXP;
  x = low ? splat(MIN_EXP) : x;
  const vi n = -__builtin_convertvector(0.5f - x * 1.44269504f, vi);   // round(x / ln2)
  const vf nf = __builtin_convertvector(n, vf);
  const vf f = (x - nf * 0.693359375f) + nf * 2.12194440e-4f;   // ln2 in two parts
  vf p = splat(1.f / 5040);
  p = p * f + 1.f / 720;
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const vf scale = (vf)((n + 127) << 23);
  return low ? splat(0.f) : p * scale;
}

}  // namespace vec

// Calls visit(t, row) for positions t = first .. len-1 of one request, row pointing at
// position t's [kv_heads, dim] entries in `cache`, walking the block table one block at a time
// from the block that holds `first`.
template <typename T, typename Visit>
void for_each_position(const T* cache, const int64_t* table, int64_t first, int64_t len,
                       int64_t block_size, int64_t token_stride, Visit visit) {
  for (int64_t n = first / block_size, t0 = n * block_size; t0 < len; t0 += block_size, ++n) {
    const T* block = cache + table[n] * block_size * token_stride;
    const int64_t count = std::min(block_size, len - t0);
    for (int64_t o = std::max<int64_t>(0, first - t0); o < count; ++o)
      visit(t0 + o, block + o * token_stride);
  }
}

// One row: the query at position len - 1 over positions first .. len - 1 (first = 0, or the
// start of its window).
template <typename T, int64_t DIM>
void attend_row(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t first, int64_t len, int64_t block_size, int64_t kv_heads, int64_t heads,
                int64_t runtime_dim, float scale, T* out, float* scores, float* acc, float* qf) {
  const int64_t dim = DIM ? DIM : runtime_dim;
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * dim;
  for (int64_t i = 0; i < heads * dim; ++i) qf[i] = static_cast<float>(q[i]) * scale;
  const int64_t end = len;   // the visitors see positions first .. end - 1,
  len -= first;              // the buffers hold the span: scores[h * len + t - first]

  // scores[h, t] = (scale * q_h) . k_t. The visitors capture by value: copies of the pointers
  // and sizes let the compiler keep them in registers (by reference it was 7% slower).
  for_each_position(k_cache, table, first, end, block_size, token_stride,
                    [=](int64_t t, const T* k) {
    for (int64_t j = 0, h = 0; j < kv_heads; ++j) {
      const T* kh = k + j * dim;
      for (int64_t g = 0; g < group; ++g, ++h) {
        const float* qh = qf + h * dim;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < dim; ++d) s += qh[d] * static_cast<float>(kh[d]);
        scores[h * len + t - first] = s;
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
  for_each_position(v_cache, table, first, end, block_size, token_stride,
                    [=](int64_t t, const T* v) {
    for (int64_t j = 0, h = 0; j < kv_heads; ++j) {
      const T* vh = v + j * dim;
      for (int64_t g = 0; g < group; ++g, ++h) {
        const float p = scores[h * len + t - first];
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
// width * block_size; window >= 0 (0: none). The caller (kvlab.kernels.cpu.decode_attention)
// checks all of it.
void decode_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                      torch::Tensor v_cache, torch::Tensor tables, torch::Tensor lens,
                      double scale, int64_t window) {
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
          attend_row<scalar_t, D>(qp + r * heads * dim, kp, vp, table + r * width,
                                  window ? std::max<int64_t>(0, len[r] - window) : 0, len[r],
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

// ---------------------------------------------------------------------------------------------
// Chunk attention: every token of a multi-token chunk (a fresh prompt, or a chunk behind a
// cached prefix) attends causally through its block table, one pass for the whole chunk
// (flash attention's online softmax; the role of vLLM's cpu_attention_with_kv_cache prefill).
//
// The layout puts query rows in the vector lanes: a tile holds ROWS rows (TQ consecutive
// positions x the G query heads of one KV head, position-major), stored transposed as
// qt[d][row]. Scores are st[j][row] = sum_d K_j[d] * qt[d][row] (K read as scalars straight
// from the paged cache: no gather), the softmax statistics m, l are per lane, and the output
// accumulates transposed as ot[d][row] += V_j[d] * p[j][row]. So every inner loop is an FMA of
// a broadcast cache value with a vector of rows, and a tile reads each key once for all of
// its rows. Masked scores are -1e30, not -inf (-ffast-math), and weigh exactly 0
// (exp_nonpositive) once a row has seen a visible key. Without a window key 0 is visible to
// every row, so that is the first key tile. With a sliding window W the keys start at the
// lowest row's window (lowest - W + 1) and keys before a row's own window are masked too; a
// row may then see no key of the first tiles: its maximum stays -1e30 and its masked scores
// weigh 1 until its first visible key, whose correction exp(-1e30 - s) is exactly 0 and wipes
// them (every row sees itself, so that key comes).
namespace chunk {

using namespace vec;
constexpr int RV = 4;            // row vectors per tile
constexpr int ROWS = RV * VL;    // rows per tile
constexpr int TK = 32;           // keys per key tile
constexpr int JB = 4;            // keys per score micro-block
constexpr int DB = 4;            // output dims per PV micro-block
constexpr float MASKED = -1e30f;

struct Buffers {   // one thread's scratch, reused across tiles
  std::vector<vf> qt, ot, st, m, l, pos;   // m, l, pos: per row (lane)
  Buffers(int64_t dim) : qt(dim * RV), ot(dim * RV), st(TK * RV), m(RV), l(RV), pos(RV) {}
};

template <typename T>
void tile(const T* q, int64_t q_row, T* out, int64_t out_row, const T* k_cache,
          const T* v_cache, const int64_t* table, int64_t block_size, int64_t kv_heads,
          int64_t g, int64_t head0, int64_t group, int64_t dim, int64_t first,
          int64_t positions, int64_t start, float scale, int64_t window, Buffers& b) {
  // rows r = i * group + e: token first + i, query head head0 + e (KV head g), position
  // start + first + i
  const int64_t rows = positions * group;
  float* qt = reinterpret_cast<float*>(b.qt.data());
  float* ot = reinterpret_cast<float*>(b.ot.data());
  float* pos = reinterpret_cast<float*>(b.pos.data());
  std::fill(qt, qt + dim * ROWS, 0.f);
  std::fill(ot, ot + dim * ROWS, 0.f);
  std::fill(b.m.begin(), b.m.end(), splat(MASKED));
  std::fill(b.l.begin(), b.l.end(), splat(0.f));
  for (int64_t r = 0; r < ROWS; ++r) {
    const int64_t i = r < rows ? r / group : positions - 1;
    pos[r] = static_cast<float>(start + first + i);
    if (r >= rows) continue;
    const T* qr = q + (first + i) * q_row + (head0 + r % group) * dim;
    for (int64_t d = 0; d < dim; ++d) qt[d * ROWS + r] = static_cast<float>(qr[d]) * scale;
  }
  const int64_t lowest = start + first, highest = start + first + positions - 1;
  const int64_t token_stride = kv_heads * dim;
  const T* kp[TK];
  const T* vp[TK];
  const int64_t keys_from = window ? std::max<int64_t>(0, lowest - window + 1) : 0;
  for (int64_t t0 = keys_from; t0 <= highest; t0 += TK) {
    const int64_t nk = std::min<int64_t>(TK, highest + 1 - t0);
    for (int64_t j = 0, n = t0 / block_size, o = t0 % block_size; j < nk; ++j) {
      const int64_t at = (table[n] * block_size + o) * token_stride + g * dim;
      kp[j] = k_cache + at;
      vp[j] = v_cache + at;
      if (++o == block_size) o = 0, ++n;
    }
    // scores
    for (int64_t j0 = 0; j0 < nk; j0 += JB) {
      vf acc[JB][RV] = {};
      const T* kj[JB];
      for (int jj = 0; jj < JB; ++jj) kj[jj] = kp[std::min<int64_t>(j0 + jj, nk - 1)];
      for (int64_t d = 0; d < dim; ++d) {
        const vf* qd = b.qt.data() + d * RV;
        for (int jj = 0; jj < JB; ++jj) {
          const vf kv = splat(static_cast<float>(kj[jj][d]));
          for (int v = 0; v < RV; ++v) acc[jj][v] += kv * qd[v];
        }
      }
      for (int jj = 0; jj < JB && j0 + jj < nk; ++jj)
        for (int v = 0; v < RV; ++v) b.st[(j0 + jj) * RV + v] = acc[jj][v];
    }
    // online softmax over this key tile, per row (lane); on the diagonal, keys after a row's
    // position score MASKED; at a window's edge, keys before a row's window too
    const bool diagonal = t0 + nk - 1 > lowest;
    const bool edge = window > 0 && t0 <= highest - window;
    const vf reach = splat(static_cast<float>(window));
    vf mt[RV], c[RV], sum[RV] = {};
    for (int v = 0; v < RV; ++v) mt[v] = b.m[v];
    for (int64_t j = 0; j < nk; ++j)
      for (int v = 0; v < RV; ++v) {
        vf& s = b.st[j * RV + v];
        const vf key = splat(static_cast<float>(t0 + j));
        if (diagonal) s = key > b.pos[v] ? splat(MASKED) : s;
        if (edge) s = key <= b.pos[v] - reach ? splat(MASKED) : s;
        mt[v] = s > mt[v] ? s : mt[v];
      }
    for (int v = 0; v < RV; ++v) c[v] = exp_nonpositive(b.m[v] - mt[v]), b.m[v] = mt[v];
    for (int64_t j = 0; j < nk; ++j)
      for (int v = 0; v < RV; ++v) {
        vf& s = b.st[j * RV + v];
        sum[v] += s = exp_nonpositive(s - mt[v]);
      }
    for (int v = 0; v < RV; ++v) b.l[v] = b.l[v] * c[v] + sum[v];
    // ot = ot * corr + V^T p
    for (int64_t d0 = 0; d0 < dim; d0 += DB) {
      vf acc[DB][RV];
      for (int dd = 0; dd < DB; ++dd)
        for (int v = 0; v < RV; ++v) acc[dd][v] = b.ot[(d0 + dd) * RV + v] * c[v];
      for (int64_t j = 0; j < nk; ++j) {
        const vf* p = b.st.data() + j * RV;
        const T* vj = vp[j] + d0;
        for (int dd = 0; dd < DB; ++dd) {
          const vf vv = splat(static_cast<float>(vj[dd]));
          for (int v = 0; v < RV; ++v) acc[dd][v] += vv * p[v];
        }
      }
      for (int dd = 0; dd < DB; ++dd)
        for (int v = 0; v < RV; ++v) b.ot[(d0 + dd) * RV + v] = acc[dd][v];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / reinterpret_cast<const float*>(b.l.data())[r];
    T* o = out + (first + r / group) * out_row + (head0 + r % group) * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(ot[d * ROWS + r] * inv);
  }
}

}  // namespace chunk

// out, q: [N, heads, dim], each row's heads contiguous (any row stride); k_cache, v_cache:
// [num_blocks, block_size, kv_heads, dim] contiguous, of q's dtype; tables: [B, W] int64 (any
// row stride).
// Chunk s (each s in `chunks`) owns rows query_start[s] .. query_start[s+1]-1 at positions
// start_pos[s] ... and its K/V are already in the cache; dim % 4 == 0; window >= 0 (0: none).
// Layouts and dtypes are checked here; indices (tables, offsets) by the caller
// (kvlab.kernels.cpu.chunk_attention).
void chunk_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                     torch::Tensor v_cache, torch::Tensor tables,
                     std::vector<int64_t> query_start, std::vector<int64_t> start_pos,
                     std::vector<int64_t> chunks, double scale, int64_t window) {
  const int64_t heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == dim && out.stride(2) == 1
              && out.stride(1) == dim && dim % chunk::DB == 0 && heads % kv_heads == 0
              && k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type()
              == q.scalar_type() && out.scalar_type() == q.scalar_type()
              && k_cache.is_contiguous() && v_cache.is_contiguous()
              && tables.scalar_type() == at::kLong && tables.stride(1) == 1,
              "chunk_attention: layouts or dtypes that do not fit");
  // a tile: `sub` query heads of one KV head (all of its group, or ROWS of them) x `per_tile`
  // positions; work items (chunk, first query head, first position), spread over threads
  const int64_t group = heads / kv_heads, sub = std::min<int64_t>(group, chunk::ROWS);
  const int64_t per_tile = chunk::ROWS / sub, width = tables.stride(0);
  const int64_t* table = tables.data_ptr<int64_t>();
  std::vector<std::array<int64_t, 4>> items;
  for (int64_t s : chunks) {
    // as few tiles as fit the chunk, equally full (a last tile of a few positions would pay
    // for a whole one)
    const int64_t n = query_start[s + 1] - query_start[s];
    if (n == 0) continue;
    const int64_t tiles = (n + per_tile - 1) / per_tile, step = (n + tiles - 1) / tiles;
    for (int64_t h = 0; h < heads; h += h % group + sub < group ? sub : group - h % group)
      for (int64_t i = 0; i < n; i += step) items.push_back({s, h, i, std::min(step, n - i)});
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "chunk_attention",
                                  [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      chunk::Buffers buffers(dim);
      for (int64_t w = begin; w < end; ++w) {
        const auto [s, h, i, n] = items[w];
        const int64_t lo = query_start[s];
        const int64_t heads_here = std::min(sub, group - h % group);
        chunk::tile<scalar_t>(qp + lo * q.stride(0), q.stride(0), op + lo * out.stride(0),
                              out.stride(0), kp, vp, table + s * width, block_size, kv_heads,
                              h / group, h, heads_here, dim, i, n, start_pos[s],
                              static_cast<float>(scale), window, buffers);
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------
// A decoder layer's small float32 ops, one pass over memory each (torch runs RMSNorm as five
// elementwise kernels, RoPE as six and a concatenation, SiLU-and-mul as two); the role vLLM's
// CPU build gives to inductor's fused kernels. Rows may have any stride; the last dim is dense.
// Each computes torch's formula in float32 (model.py's rms_norm and apply_rope).

// weight * (x * rsqrt(mean(x^2) + eps)) per row of x [N, h]; a new contiguous [N, h].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat
              && weight.is_contiguous() && weight.scalar_type() == at::kFloat
              && weight.numel() == x.size(1), "rms_norm: float32 x [N, h], weight [h]");
  const int64_t rows = x.size(0), h = x.size(1), stride = x.stride(0);
  auto out = torch::empty({rows, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * stride;
      float* o = op + r * h;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) o[i] = w[i] * (xr[i] * inv);
    }
  });
  return out;
}

// Rotates x [N, heads, D] in place by cos, sin [N, D/2] (half-split layout); returns x.
torch::Tensor rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == dim && dim % 2 == 0
              && x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat
              && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous()
              && cos.numel() == rows * half && sin.numel() == rows * half,
              "rope_: float32 x [N, H, D], cos and sin [N, D/2]");
  const int64_t stride = x.stride(0);
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * half;
      const float* s = sp + r * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* a = xp + r * stride + h * dim;
        float* b = a + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = a[i], x2 = b[i];
          a[i] = x1 * c[i] - x2 * s[i];
          b[i] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  });
  return x;
}

// silu(g) * u of gu = [g | u]: [N, 2I] -> a new contiguous [N, I]. The sigmoid is built from
// e^-|g| <= 1, so no gate overflows: under -ffast-math, g / (1 + e^-g) gave NaN below g = -88.
torch::Tensor silu_and_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1 && gu.size(1) % 2 == 0
              && gu.scalar_type() == at::kFloat, "silu_and_mul: float32 [N, 2I]");
  const int64_t rows = gu.size(0), inner = gu.size(1) / 2, stride = gu.stride(0);
  auto out = torch::empty({rows, inner}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gp + r * stride;
      const float* u = g + inner;
      float* o = op + r * inner;
      int64_t i = 0;
      for (; i + vec::VL <= inner; i += vec::VL) {   // sigmoid(x) from e = e^-|x| <= 1
        vec::vf x, y;
        std::memcpy(&x, g + i, sizeof x);
        std::memcpy(&y, u + i, sizeof y);
        const vec::vf e = vec::exp_nonpositive(x < 0 ? x : -x);
        const vec::vf sig = (x < 0 ? e : vec::splat(1.f)) / (1.f + e);
        const vec::vf z = x * sig * y;
        std::memcpy(o + i, &z, sizeof z);
      }
      for (; i < inner; ++i) {
        const float e = std::exp(-std::fabs(g[i]));
        o[i] = g[i] * ((g[i] < 0 ? e : 1.f) / (1.f + e)) * u[i];
      }
    }
  });
  return out;
}
