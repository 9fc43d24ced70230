// Attention for the compiled CPU step (cpu_ops.py): each row against its own
// sequence's keys, read through its block table, up to its own position.
//
// A row's result depends on that row alone: rows run independently, and every sum runs in an
// order fixed by the code (eight lanes, then the lanes in turn), never by the number of rows,
// the threads or the padding of the table. The keys of a KV head are read once for the query
// heads that share it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int LANES = 8;

inline float as_float(float x) { return x; }
inline float as_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float as_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline void widen(const T* from, float* to, int64_t size) {
  for (int64_t d = 0; d < size; ++d) to[d] = as_float(from[d]);
}

// Lane j sums elements j, j + 8, ...; the lanes are then added in order: the same order on
// every call, which the compiler can still run eight at a time.
inline float dot(const float* a, const float* b, int64_t size) {
  float lanes[LANES] = {0};
  int64_t d = 0;
  for (; d + LANES <= size; d += LANES)
    for (int j = 0; j < LANES; ++j) lanes[j] += a[d + j] * b[d + j];
  for (int j = 0; d < size; ++d, ++j) lanes[j] += a[d] * b[d];
  float total = 0;
  for (int j = 0; j < LANES; ++j) total += lanes[j];
  return total;
}

struct Sizes {
  int64_t heads, kv_heads, dim, width, block, blocks;
};

template <typename T>
inline const T* at_position(const T* cache, const int64_t* table, int64_t c, const Sizes& s) {
  return cache + (table[c / s.block] * s.block + c % s.block) * s.kv_heads * s.dim;
}

// A position past its table, or a block past the cache, would read memory that is not the
// cache: checked for the blocks a row reads, before it reads them (a failed check fails the step).
inline void check_row(const int64_t* table, int64_t position, const Sizes& s) {
  TORCH_CHECK(position >= 0 && position < s.width * s.block, "a position outside its row's table");
  for (int64_t b = 0; b <= position / s.block; ++b) TORCH_CHECK(table[b] >= 0 && table[b] < s.blocks, "a block past the cache");
}

// One row and one KV head: the `group` query heads that read it.
template <typename T>
void attend_one(const float* q, const T* k, const T* v, const int64_t* table, int64_t position, float* out, const Sizes& s,
                float scale, std::vector<float>& scores, std::vector<float>& row) {
  const int64_t group = s.heads / s.kv_heads, seen = position + 1, dim = s.dim;
  scores.resize(group * seen);
  row.resize(dim);
  for (int64_t c = 0; c < seen; ++c) {
    widen(at_position(k, table, c, s), row.data(), dim);
    for (int64_t h = 0; h < group; ++h) scores[h * seen + c] = dot(q + h * dim, row.data(), dim) * scale;
  }
  for (int64_t h = 0; h < group; ++h) {
    float* score = scores.data() + h * seen;
    float top = -std::numeric_limits<float>::infinity(), total = 0;
    for (int64_t c = 0; c < seen; ++c) top = std::max(top, score[c]);
    for (int64_t c = 0; c < seen; ++c) total += (score[c] = std::exp(score[c] - top));
    for (int64_t c = 0; c < seen; ++c) score[c] /= total;
    std::fill(out + h * dim, out + (h + 1) * dim, 0.0f);
  }
  for (int64_t c = 0; c < seen; ++c) {
    widen(at_position(v, table, c, s), row.data(), dim);
    for (int64_t h = 0; h < group; ++h) {
      const float weight = scores[h * seen + c];
      float* target = out + h * dim;
      for (int64_t d = 0; d < dim; ++d) target[d] += weight * row[d];
    }
  }
}

template <typename T>
void attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables,
                 const at::Tensor& positions, at::Tensor& out, const Sizes& s) {
  const int64_t rows = q.size(0), group = s.heads / s.kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.dim));
  const float* qd = q.data_ptr<float>();
  const T* kd = k.data_ptr<T>();
  const T* vd = v.data_ptr<T>();
  const int64_t* td = tables.data_ptr<int64_t>();
  const int64_t* pd = positions.data_ptr<int64_t>();
  float* od = out.data_ptr<float>();
  at::parallel_for(0, rows * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, row;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / s.kv_heads, g = i % s.kv_heads;
      const int64_t first = (n * s.heads + g * group) * s.dim;
      check_row(td + n * s.width, pd[n], s);
      attend_one(qd + first, kd + g * s.dim, vd + g * s.dim, td + n * s.width, pd[n], od + first, s, scale, scores, row);
    }
  });
}

// q: [N, Hq, D] float32; caches: [slots, Hkv, D]; tables: [N, W] and positions: [N] int64
// -> [N, Hq * D] float32.
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& tables, const at::Tensor& positions, int64_t block_size) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3, "q: [rows, heads, dim] float32");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.dim() == 3, "caches: [slots, kv heads, dim], one dtype");
  TORCH_CHECK(tables.scalar_type() == at::kLong && positions.scalar_type() == at::kLong, "tables and positions: int64");
  const auto qc = q.contiguous(), kc = k_cache.contiguous(), vc = v_cache.contiguous();
  const auto tc = tables.contiguous(), pc = positions.contiguous();
  const Sizes s{q.size(1), k_cache.size(1), q.size(2), tables.size(1), block_size, k_cache.size(0) / block_size};
  TORCH_CHECK(s.heads % s.kv_heads == 0 && k_cache.size(2) == s.dim, "heads and dims of q and the caches disagree");
  TORCH_CHECK(positions.numel() == q.size(0) && tables.size(0) == q.size(0), "one position and one table for each row");
  auto out = at::empty({q.size(0), s.heads * s.dim}, q.options());
  switch (k_cache.scalar_type()) {
    case at::kFloat: attend_rows<float>(qc, kc, vc, tc, pc, out, s); break;
    case at::kBFloat16: attend_rows<c10::BFloat16>(qc, kc, vc, tc, pc, out, s); break;
    case at::kHalf: attend_rows<c10::Half>(qc, kc, vc, tc, pc, out, s); break;
    default: TORCH_CHECK(false, "a KV cache of ", k_cache.scalar_type(), " is not supported");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokstream, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor positions, int block_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokstream, CPU, m) { m.impl("paged_attention", &paged_attention); }
