// Weight-only int8 and int4 matrix products for the CPU (cpu_ops.py), with x in float32:
//   int8_linear: y = (x @ W.T) * scale, W int8, one float32 scale per output;
//   int4_linear: y = x @ (codes * scale + minimum).T, the codes 0 to 15 in groups of 32 inputs,
//   each group with a float16 scale and minimum (the GGUF's Q4_1 blocks).
//
// As llama.cpp does, x is first quantized in groups of 32 along each row (the GGUF's Q8_1): a
// scale d = max|x| / 127 and 32 integers q = round(x / d), with s = d * sum(q). A group's
// products are then integer multiply-adds, exact, and the float arithmetic is one multiply-add
// per group and output:
//   int4: y = sum over groups of (scale * d) * (codes . q) + sum over groups of minimum * s
//   int8: y = scale * sum over groups of d * (w . q)
// The weights are laid out (llama.py) in blocks of eight outputs, one output to a lane: for
// each group, vector k holds each output's four weights for inputs 4k to 4k + 3 (int4: vectors
// k and k + 4 share the bytes, low and high half), so that a multiply-add of a vector against
// those four inputs of x, broadcast, adds to each output's own lane, and eight of them make a
// group's dot products for eight outputs at once, with no sum across lanes.
// Every output is summed by the same operations whether the step has one row or three
// hundred, and by one thread, so a row's numbers are its own.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "lanes.h"

#if defined(TOKSTREAM_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TOKSTREAM_VNNI 1
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

namespace {

using lanes::add;
using lanes::broadcast;
using lanes::fma;
using lanes::Lanes;
using lanes::mul;
using lanes::store;
using lanes::zero;

constexpr int64_t BLOCK = 8;   // outputs laid out together, one to a lane
constexpr int64_t GROUP = 32;  // inputs that share a scale of x (and for int4 of the weights)
constexpr int64_t TILE = 4;    // rows of x taken against a block's group while it is unpacked

#ifdef TOKSTREAM_AVX2

using Ints = __m256i;  // eight int32, or 32 bytes

inline Ints zero_ints() { return _mm256_setzero_si256(); }
inline Lanes to_float(Ints v) { return _mm256_cvtepi32_ps(v); }
inline Ints add_ints(Ints a, Ints b) { return _mm256_add_epi32(a, b); }
inline Ints load_bytes(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Ints low_halves(Ints v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline Ints high_halves(Ints v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline Ints four_bytes(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
// sums + (unsigned a . signed b), four bytes to a lane
inline Ints dot_add(Ints sums, Ints a, Ints b) {
#ifdef TOKSTREAM_VNNI
  return _mm256_dpbusd_epi32(sums, a, b);
#else
  return _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
#endif
}
// sums + (signed w . signed b): |w| against b with w's sign
inline Ints dot_add_signed(Ints sums, Ints w, Ints b) { return dot_add(sums, _mm256_sign_epi8(w, w), _mm256_sign_epi8(b, w)); }

#else

struct Ints {
  int32_t v[8];
  int8_t b[32];  // as bytes (the weights' vectors; four_bytes)
};
inline Ints zero_ints() { return Ints{}; }
inline Ints add_ints(Ints a, Ints b) {
  for (int j = 0; j < 8; ++j) a.v[j] += b.v[j];
  return a;
}
inline Lanes to_float(Ints v) {
  Lanes out;
  for (int j = 0; j < 8; ++j) out.v[j] = static_cast<float>(v.v[j]);
  return out;
}
inline Ints load_bytes(const void* p) {
  Ints out{};
  std::memcpy(out.b, p, 32);
  return out;
}
inline Ints low_halves(Ints v) {
  for (auto& b : v.b) b = static_cast<int8_t>(static_cast<uint8_t>(b) & 0x0F);
  return v;
}
inline Ints high_halves(Ints v) {
  for (auto& b : v.b) b = static_cast<int8_t>(static_cast<uint8_t>(b) >> 4);
  return v;
}
inline Ints four_bytes(const void* p) {
  Ints out{};
  for (int j = 0; j < 8; ++j) std::memcpy(out.b + 4 * j, p, 4);
  return out;
}
inline Ints dot_add(Ints sums, Ints a, Ints b) {
  for (int j = 0; j < 8; ++j)
    for (int t = 0; t < 4; ++t) sums.v[j] += static_cast<uint8_t>(a.b[4 * j + t]) * b.b[4 * j + t];
  return sums;
}
inline Ints dot_add_signed(Ints sums, Ints w, Ints b) {
  for (int j = 0; j < 8; ++j)
    for (int t = 0; t < 4; ++t) sums.v[j] += w.b[4 * j + t] * b.b[4 * j + t];
  return sums;
}

#endif

// A group's dot products for a block's eight outputs, dot(sums, k) adding vector k's: in two
// chains, since each multiply-add waits for the one before it in its chain (one chain left the
// units idle: two took x0.84 to x0.96 of its time for int4, x0.92 to x0.98 for int8, by
// bench/operators_ab.py in BENCHMARKS.md); the sums are integers, so their order changes nothing.
template <typename Dot>
inline Ints two_chains(Dot dot) {
  Ints even = zero_ints(), odd = zero_ints();
  for (int k = 0; k < 8; k += 2) {
    even = dot(even, k);
    odd = dot(odd, k + 1);
  }
  return add_ints(even, odd);
}

// x quantized in groups of 32 along each row: q [rows, in], d and s [rows, in / 32].
struct Activations {
  std::vector<int8_t> q;
  std::vector<uint8_t> shifted;  // q + 128, where the weights ask for it (int8 with VNNI: int8_dots)
  std::vector<float> d, s;
  int64_t groups;
};

Activations quantize(const float* x, int64_t rows, int64_t in, bool shifted) {
  const int64_t groups = in / GROUP;
  Activations a{std::vector<int8_t>(rows * in), std::vector<uint8_t>(shifted ? rows * in : 0), std::vector<float>(rows * groups),
                std::vector<float>(rows * groups), groups};
  at::parallel_for(0, rows * groups, 256, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const float* v = x + g * GROUP;
      float largest = 0;
      for (int64_t i = 0; i < GROUP; ++i) largest = std::max(largest, std::abs(v[i]));
      const float d = largest / 127, inverse = d > 0 ? 1 / d : 0;
      int32_t sum = 0;
      for (int64_t i = 0; i < GROUP; ++i) {
        const auto q = static_cast<int8_t>(std::nearbyint(v[i] * inverse));
        a.q[g * GROUP + i] = q;
        if (shifted) a.shifted[g * GROUP + i] = static_cast<uint8_t>(q + 128);
        sum += q;
      }
      a.d[g] = d;
      a.s[g] = d * static_cast<float>(sum);
    }
  });
  return a;
}

// A block's group of int4 weights: 128 bytes, vectors k and k + 4 in the halves of vector k's bytes.
struct Int4Weights {
  const uint8_t* codes;
  const c10::Half* scales;
  const c10::Half* minimums;
  static constexpr int64_t BYTES = 128;
  static constexpr bool SHIFTED = false;

  // ROWS rows of x against block b of outputs: their outputs' lanes.
  template <int64_t ROWS>
  void block(const Activations& x, const int64_t* rows, int64_t b, Lanes out[ROWS]) const {
    Lanes sums[ROWS], mins[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) sums[r] = mins[r] = zero();
    for (int64_t g = 0; g < x.groups; ++g) {
      const int64_t at = b * x.groups + g;
      Ints w[8];
      for (int k = 0; k < 4; ++k) {
        const Ints both = load_bytes(codes + at * BYTES + 32 * k);
        w[k] = low_halves(both), w[k + 4] = high_halves(both);
      }
      const Lanes scale = lanes::load(scales + at * BLOCK), minimum = lanes::load(minimums + at * BLOCK);
      for (int64_t r = 0; r < ROWS; ++r) {
        const int64_t xg = rows[r] * x.groups + g;
        const int8_t* q = x.q.data() + xg * GROUP;
        const Ints dots = two_chains([&](Ints acc, int k) { return dot_add(acc, w[k], four_bytes(q + 4 * k)); });
        sums[r] = fma(to_float(dots), mul(scale, broadcast(x.d[xg])), sums[r]);
        mins[r] = fma(minimum, broadcast(x.s[xg]), mins[r]);
      }
    }
    for (int64_t r = 0; r < ROWS; ++r) out[r] = add(sums[r], mins[r]);
  }
};

#ifdef TOKSTREAM_VNNI
// A group's q . w for eight outputs as (q + 128) . w - 128 * sum(w): VNNI multiplies unsigned
// bytes by signed ones, and q + 128 is never negative, where |w| against q with w's sign took
// two more instructions for each multiply-add. The integers are the same.
inline Ints int8_offset(const Ints w[8]) {
  Ints sums = zero_ints();
  for (int k = 0; k < 8; ++k) sums = dot_add(sums, _mm256_set1_epi8(1), w[k]);
  return _mm256_slli_epi32(sums, 7);
}
inline Ints int8_dots(const Activations& x, int64_t xg, const Ints w[8], Ints offset) {
  const uint8_t* u = x.shifted.data() + xg * GROUP;
  const Ints dots = two_chains([&](Ints acc, int k) { return dot_add(acc, four_bytes(u + 4 * k), w[k]); });
  return _mm256_sub_epi32(dots, offset);
}
#else
inline Ints int8_offset(const Ints*) { return zero_ints(); }
inline Ints int8_dots(const Activations& x, int64_t xg, const Ints w[8], Ints) {
  const int8_t* q = x.q.data() + xg * GROUP;
  return two_chains([&](Ints acc, int k) { return dot_add_signed(acc, w[k], four_bytes(q + 4 * k)); });
}
#endif

// A block's group of int8 weights: 256 bytes, vector k for inputs 4k to 4k + 3.
struct Int8Weights {
  const int8_t* codes;
  const float* scales;
  static constexpr int64_t BYTES = 256;
  static constexpr bool SHIFTED = VNNI;

  template <int64_t ROWS>
  void block(const Activations& x, const int64_t* rows, int64_t b, Lanes out[ROWS]) const {
    Lanes sums[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) sums[r] = zero();
    for (int64_t g = 0; g < x.groups; ++g) {
      const int8_t* block = codes + (b * x.groups + g) * BYTES;
      Ints w[8];
      for (int k = 0; k < 8; ++k) w[k] = load_bytes(block + 32 * k);
      const Ints offset = int8_offset(w);
      for (int64_t r = 0; r < ROWS; ++r) {
        const int64_t xg = rows[r] * x.groups + g;
        sums[r] = fma(to_float(int8_dots(x, xg, w, offset)), broadcast(x.d[xg]), sums[r]);
      }
    }
    const Lanes scale = lanes::load(scales + b * BLOCK);
    for (int64_t r = 0; r < ROWS; ++r) out[r] = mul(sums[r], scale);
  }
};

template <int64_t ROWS, typename Weights>
inline void tile(const Activations& x, int64_t first, const Weights& w, int64_t b, float* y, int64_t out) {
  int64_t rows[ROWS];
  for (int64_t r = 0; r < ROWS; ++r) rows[r] = first + r;
  Lanes lanes[ROWS];
  w.template block<ROWS>(x, rows, b, lanes);
  for (int64_t r = 0; r < ROWS; ++r) store(y + (first + r) * out + b * BLOCK, lanes[r]);
}

template <typename Weights>
void product(const float* x, int64_t rows, int64_t in, const Weights& weights, int64_t out, float* y) {
  const Activations q = quantize(x, rows, in, Weights::SHIFTED);
  // Enough blocks to a task that the threads' start-up is small against them.
  const int64_t grain = std::max<int64_t>(1, 32768 / (in * std::max<int64_t>(rows, 1)));
  at::parallel_for(0, out / BLOCK, grain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      int64_t r = 0;
      for (; r + TILE <= rows; r += TILE) tile<TILE>(q, r, weights, b, y, out);
      for (; r < rows; ++r) tile<1>(q, r, weights, b, y, out);
    }
  });
}

void check_x(const at::Tensor& x, int64_t in) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "x: [rows, in] float32");
  TORCH_CHECK(x.size(1) == in, "x has ", x.size(1), " inputs, the weights ", in);
}

// x: [rows, in] float32; weight: [out / 8, in / 32, 256] int8 (never -128), laid out as above;
// scale: [out] float32 -> [rows, out] float32.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 3 && weight.size(2) == Int8Weights::BYTES, "weight: [out / 8, in / 32, 256] int8");
  const int64_t out = weight.size(0) * BLOCK, in = weight.size(1) * GROUP;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == out, "scale: [out] float32");
  check_x(x, in);
  const auto xc = x.contiguous(), wc = weight.contiguous(), sc = scale.contiguous();
  auto y = at::empty({x.size(0), out}, x.options());
  product(xc.data_ptr<float>(), x.size(0), in, Int8Weights{wc.data_ptr<int8_t>(), sc.data_ptr<float>()}, out, y.data_ptr<float>());
  return y;
}

// x: [rows, in] float32; codes: [out / 8, in / 32, 128] uint8, laid out as above; scales,
// minimums: [out / 8, in / 32, 8] float16.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& minimums) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 3 && codes.size(2) == Int4Weights::BYTES, "codes: [out / 8, in / 32, 128] uint8");
  const int64_t out = codes.size(0) * BLOCK, in = codes.size(1) * GROUP;
  const auto groups = std::vector<int64_t>{codes.size(0), codes.size(1), BLOCK};
  TORCH_CHECK(scales.scalar_type() == at::kHalf && minimums.scalar_type() == at::kHalf, "scales and minimums: float16");
  TORCH_CHECK(scales.sizes() == groups && minimums.sizes() == groups, "scales and minimums: [out / 8, in / 32, 8]");
  check_x(x, in);
  const auto xc = x.contiguous(), cc = codes.contiguous(), sc = scales.contiguous(), mc = minimums.contiguous();
  auto y = at::empty({x.size(0), out}, x.options());
  const Int4Weights weights{cc.data_ptr<uint8_t>(), sc.data_ptr<c10::Half>(), mc.data_ptr<c10::Half>()};
  product(xc.data_ptr<float>(), x.size(0), in, weights, out, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokstream, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor minimums) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokstream, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}
