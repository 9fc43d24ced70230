// Attention for the compiled CPU step (cpu_ops.py): each row against its own
// sequence's keys, read through its block table, up to its own position.
//
// A row's result depends on that row alone: rows run independently, and every sum runs in an
// order fixed by the code (lanes.h), never by the number of rows, the threads or the padding of
// the table. Keys are scored eight at a time, a key to a lane, each one's products summed in
// eight lanes along the dimensions and then by the lanes' tree; the softmax and the weighted sum
// of the values run eight lanes wide. A KV head's keys and values come from memory once for the
// query heads that share them (the next heads read them from the core's cache).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "lanes.h"

namespace {

using lanes::LANES;
using lanes::Lanes;

struct Sizes {
  int64_t heads, kv_heads, dim, width, block, blocks;
};

// Where each position 0 to seen - 1 of a row is in the caches (the same offset in K and V), in
// elements, found once a row and KV head, block by block.
inline void place(const int64_t* table, int64_t seen, const Sizes& s, std::vector<int64_t>& places) {
  places.resize(seen);
  for (int64_t c = 0; c < seen; c += s.block) {
    const int64_t first = table[c / s.block] * s.block;
    for (int64_t i = 0; i < s.block && c + i < seen; ++i) places[c + i] = (first + i) * s.kv_heads * s.dim;
  }
}

// A position past its table, or a block past the cache, would read memory that is not the
// cache: checked for the blocks a row reads, before it reads them (a failed check fails the step).
inline void check_row(const int64_t* table, int64_t position, const Sizes& s) {
  TORCH_CHECK(position >= 0 && position < s.width * s.block, "a position outside its row's table");
  for (int64_t b = 0; b <= position / s.block; ++b) TORCH_CHECK(table[b] >= 0 && table[b] < s.blocks, "a block past the cache");
}

// One query head against eight keys: lane j is q . keys[j], each key's products summed in
// eight lanes along the head's dimensions, then by lanes' tree.
template <typename T>
inline Lanes scores_of(const float* q, const T* const keys[LANES], int64_t dim) {
  Lanes sums[LANES];
  for (auto& sum : sums) sum = lanes::zero();
  for (int64_t d = 0; d < dim; d += LANES) {
    const Lanes query = lanes::load(q + d);
    for (int64_t j = 0; j < LANES; ++j) sums[j] = lanes::fma(query, lanes::load(keys[j] + d), sums[j]);
  }
  return lanes::sum_each(sums);
}

// Each query head's scores for the positions 0 to seen - 1, eight keys at a time; the last
// eight repeat the last key where the row has fewer, so every score comes from the same code.
template <typename T>
void score(const float* q, const T* k, const int64_t* places, int64_t seen, float* scores, int64_t stride, const Sizes& s, float scale) {
  for (int64_t c = 0; c < seen; c += LANES) {
    const T* keys[LANES];
    for (int64_t j = 0; j < LANES; ++j) keys[j] = k + places[std::min(c + j, seen - 1)];
    for (int64_t h = 0; h < s.heads / s.kv_heads; ++h)
      lanes::store(scores + h * stride + c, lanes::mul(scores_of(q + h * s.dim, keys, s.dim), lanes::broadcast(scale)));
  }
}

// Scores to weights in place: e^(score - largest), the repeated tail's lanes zero, over their
// sum (lane j summing positions j, j + 8, ..., then the lanes' tree).
inline void soften(float* scores, int64_t seen) {
  Lanes top = lanes::load(scores);
  for (int64_t c = LANES; c < seen; c += LANES) top = lanes::larger(top, lanes::load(scores + c));
  const Lanes shift = lanes::broadcast(lanes::largest(top));
  Lanes sums = lanes::zero();
  for (int64_t c = 0; c < seen; c += LANES) {
    const Lanes weight = lanes::keep_first(lanes::exp(lanes::sub(lanes::load(scores + c), shift)), seen - c);
    lanes::store(scores + c, weight);
    sums = lanes::add(sums, weight);
  }
  const Lanes inverse = lanes::broadcast(1.0f / lanes::total(sums));
  for (int64_t c = 0; c < seen; c += LANES) lanes::store(scores + c, lanes::mul(lanes::load(scores + c), inverse));
}

// WIDE vectors of out: the weighted sum of the values' same dimensions, position by position.
template <int64_t WIDE, typename T>
inline void weigh_span(const float* weights, const T* v, const int64_t* places, int64_t seen, float* out) {
  Lanes sums[WIDE];
  for (auto& sum : sums) sum = lanes::zero();
  for (int64_t c = 0; c < seen; ++c) {
    const Lanes weight = lanes::broadcast(weights[c]);
    for (int64_t i = 0; i < WIDE; ++i) sums[i] = lanes::fma(weight, lanes::load(v + places[c] + i * LANES), sums[i]);
  }
  for (int64_t i = 0; i < WIDE; ++i) lanes::store(out + i * LANES, sums[i]);
}

// out (dim floats) = the weighted sum of the values, four vectors at a time: a count the
// compiler knows keeps the sums in registers (one it did not kept them in memory, 40% of the time).
template <typename T>
void weigh(const float* weights, const T* v, const int64_t* places, int64_t seen, float* out, const Sizes& s) {
  int64_t d = 0;
  for (; d + 4 * LANES <= s.dim; d += 4 * LANES) weigh_span<4>(weights, v + d, places, seen, out + d);
  for (; d < s.dim; d += LANES) weigh_span<1>(weights, v + d, places, seen, out + d);
}

// One row and one KV head: the `group` query heads that read it.
template <typename T>
void attend_one(const float* q, const T* k, const T* v, const int64_t* table, int64_t position, float* out, const Sizes& s,
                float scale, std::vector<float>& scores, std::vector<int64_t>& places) {
  const int64_t group = s.heads / s.kv_heads, seen = position + 1;
  const int64_t stride = (seen + LANES - 1) / LANES * LANES;
  scores.resize(group * stride);
  place(table, seen, s, places);
  score(q, k, places.data(), seen, scores.data(), stride, s, scale);
  for (int64_t h = 0; h < group; ++h) {
    soften(scores.data() + h * stride, seen);
    weigh(scores.data() + h * stride, v, places.data(), seen, out + h * s.dim, s);
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
    std::vector<float> scores;
    std::vector<int64_t> places;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i / s.kv_heads, g = i % s.kv_heads;
      const int64_t first = (n * s.heads + g * group) * s.dim;
      check_row(td + n * s.width, pd[n], s);
      attend_one(qd + first, kd + g * s.dim, vd + g * s.dim, td + n * s.width, pd[n], od + first, s, scale, scores, places);
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
  TORCH_CHECK(s.dim % LANES == 0, "a head's dimensions: a multiple of ", LANES);
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
