// Eight float32 lanes, for the CPU operators (paged_attention.cpp, quantized_linear.cpp): AVX2
// where the compiler targets it, else plain C++ that computes the same sums in the same order.
// Every reduction across lanes is one fixed tree, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), so
// a value's sum never depends on what shares a vector with it.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define TOKSTREAM_AVX2 1
#endif

namespace lanes {

constexpr int64_t LANES = 8;

#ifdef TOKSTREAM_AVX2

using Lanes = __m256;

inline Lanes zero() { return _mm256_setzero_ps(); }
inline Lanes broadcast(float v) { return _mm256_set1_ps(v); }
inline Lanes fma(Lanes a, Lanes b, Lanes c) { return _mm256_fmadd_ps(a, b, c); }
inline Lanes add(Lanes a, Lanes b) { return _mm256_add_ps(a, b); }
inline Lanes sub(Lanes a, Lanes b) { return _mm256_sub_ps(a, b); }
inline Lanes mul(Lanes a, Lanes b) { return _mm256_mul_ps(a, b); }
inline Lanes larger(Lanes a, Lanes b) { return _mm256_max_ps(a, b); }
inline Lanes load(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline Lanes load(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline void store(float* p, Lanes v) { _mm256_storeu_ps(p, v); }
inline float first(Lanes v) { return _mm256_cvtss_f32(v); }

// Lane j of the result: the tree sum of v[j]'s lanes (hadd adds neighbours, then pairs, then halves).
inline Lanes sum_each(const Lanes v[8]) {
  const Lanes a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const Lanes b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// The lanes before `count` as they are, the others zero.
inline Lanes keep_first(Lanes v, int64_t count) {
  const Lanes index = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_and_ps(v, _mm256_cmp_ps(index, _mm256_set1_ps(static_cast<float>(count)), _CMP_LT_OQ));
}

// e^x lane by lane, as Cephes' expf: x = n ln 2 + r, e^r by its polynomial, 2^n in the exponent.
inline Lanes exp(Lanes x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const Lanes n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const Lanes r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  Lanes p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

#else

struct Lanes {
  float v[8];
};

template <typename F>
inline Lanes each(F f) {
  Lanes out;
  for (int j = 0; j < 8; ++j) out.v[j] = f(j);
  return out;
}
inline Lanes zero() { return Lanes{}; }
inline Lanes broadcast(float x) { return each([&](int) { return x; }); }
inline Lanes fma(Lanes a, Lanes b, Lanes c) { return each([&](int j) { return std::fma(a.v[j], b.v[j], c.v[j]); }); }
inline Lanes add(Lanes a, Lanes b) { return each([&](int j) { return a.v[j] + b.v[j]; }); }
inline Lanes sub(Lanes a, Lanes b) { return each([&](int j) { return a.v[j] - b.v[j]; }); }
inline Lanes mul(Lanes a, Lanes b) { return each([&](int j) { return a.v[j] * b.v[j]; }); }
inline Lanes larger(Lanes a, Lanes b) { return each([&](int j) { return std::max(a.v[j], b.v[j]); }); }
template <typename T>
inline Lanes load(const T* p) { return each([&](int j) { return static_cast<float>(p[j]); }); }
inline void store(float* p, Lanes v) { std::memcpy(p, v.v, sizeof v.v); }
inline float first(Lanes v) { return v.v[0]; }
inline float tree(const float* v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }
inline Lanes sum_each(const Lanes v[8]) { return each([&](int j) { return tree(v[j].v); }); }
inline Lanes keep_first(Lanes v, int64_t count) { return each([&](int j) { return j < count ? v.v[j] : 0.0f; }); }
inline Lanes exp(Lanes x) { return each([&](int j) { return std::exp(x.v[j]); }); }

#endif

// The tree sum of v's lanes, and their largest.
inline float total(Lanes v) {
  const Lanes same[8] = {v, v, v, v, v, v, v, v};
  return first(sum_each(same));
}
inline float largest(Lanes v) {
  float out[8];
  store(out, v);
  return *std::max_element(out, out + 8);
}

}  // namespace lanes
