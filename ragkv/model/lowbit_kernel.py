"""The low-bit matmul kernel: GGUF-style blocks dequantized into float32 registers, float32 activations.

One C++ source, built once per machine with ``torch.utils.cpp_extension.load_inline`` into ragkv's
cache (``$RAGKV_CACHE_DIR/kernels/<hash>/``; the hash covers the source, the flags, torch's version
and the CPU's vector extensions), loaded from there afterwards. Written with GCC vector extensions,
so the same source compiles to AVX-512, AVX2 or plain SSE code for whatever ``-march=native`` is.
Threads are torch's own (``at::parallel_for``), so the kernel shares torch's thread pool.

:func:`kernel` returns the loaded module, or None when it cannot be built (no compiler, no
headers, ``RAGKV_LOWBIT_KERNEL=0``): callers then keep float32 weights (:mod:`ragkv.model.lowbit`).

Block formats (one row of a weight is ``nb`` blocks, each its float32 scale ``s`` and offset ``m``
followed by the integers ``q``; a weight value is ``s * q + m``, computed as one fused multiply-add):

* ``u4``: 32 values, ``q`` 4-bit (byte ``j`` holds ``q[j]`` low and ``q[j + 16]`` high), 24 bytes;
* ``i8g16``: 16 values, ``q`` int8, 24 bytes; ``i8g32``: 32 values, ``q`` int8, 40 bytes;
* ``u4h``, ``i8g16h``, ``i8g32h``: the same with ``s`` and ``m`` in float16 (4 bytes instead of 8), used
  where every block's scale and offset are exact in float16 (the file's own Q4_0, Q4_1, Q5_0, Q5_1
  and Q8_0 scales are float16; the K-quants' products ``d * sc`` are not): 20, 20 and 36 bytes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading

log = logging.getLogger("ragkv.model")

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <cstdint>
#include <cmath>

typedef float v16f __attribute__((vector_size(64)));

static inline v16f ld(const float* p) { v16f v; std::memcpy(&v, p, 64); return v; }
static inline float hsum(v16f v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

// 16 integers as float32: the low (shift 0) or high (shift 4) nibbles of 16 bytes, or 16 int8
#if defined(__AVX512F__)
#include <immintrin.h>
static inline v16f nibbles(const uint8_t* p, int shift) {
  __m128i q = _mm_loadu_si128((const __m128i*)p);
  if (shift) q = _mm_srli_epi16(q, 4);
  q = _mm_and_si128(q, _mm_set1_epi8(15));
  return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q));
}
static inline v16f int8s(const uint8_t* p) {
  return (v16f)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline v16f join(__m256 a, __m256 b) { v16f v; std::memcpy(&v, &a, 32); std::memcpy((char*)&v + 32, &b, 32); return v; }
static inline v16f nibbles(const uint8_t* p, int shift) {
  __m128i q = _mm_loadu_si128((const __m128i*)p);
  if (shift) q = _mm_srli_epi16(q, 4);
  q = _mm_and_si128(q, _mm_set1_epi8(15));
  return join(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))));
}
static inline v16f int8s(const uint8_t* p) {
  __m128i q = _mm_loadu_si128((const __m128i*)p);
  return join(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))));
}
#else
static inline v16f nibbles(const uint8_t* p, int shift) {
  v16f v; for (int i = 0; i < 16; ++i) v[i] = (float)((p[i] >> shift) & 15); return v;
}
static inline v16f int8s(const uint8_t* p) {
  v16f v; for (int i = 0; i < 16; ++i) v[i] = (float)(int8_t)p[i]; return v;
}
#endif

// one block's weights as float32 vectors: W[0..VPB) of 16 values each
// a block's scale and offset: float32 (H = 0, 8 bytes) or float16 (H = 1, 4 bytes; exact in float32)
template <int H> static inline void scale_offset(const uint8_t* b, float& s, float& m) {
  if (H) { _Float16 a, c; std::memcpy(&a, b, 2); std::memcpy(&c, b + 2, 2); s = (float)a; m = (float)c; }
  else { std::memcpy(&s, b, 4); std::memcpy(&m, b + 4, 4); }
}
template <int H> struct U4 {
  static constexpr int HEAD = H ? 4 : 8, VALS = 32, BYTES = HEAD + 16, VPB = 2;
  static inline void get(const uint8_t* b, v16f* w) {
    float s, m; scale_offset<H>(b, s, m);
    w[0] = nibbles(b + HEAD, 0) * s + m;
    w[1] = nibbles(b + HEAD, 4) * s + m;
  }
};
template <int G, int H> struct I8 {
  static constexpr int HEAD = H ? 4 : 8, VALS = G, BYTES = HEAD + G, VPB = G / 16;
  static inline void get(const uint8_t* b, v16f* w) {
    float s, m; scale_offset<H>(b, s, m);
    for (int i = 0; i < VPB; ++i) w[i] = int8s(b + HEAD + 16 * i) * s + m;
  }
};

// rows [n0, n1) of y[r, n] = sum_k x[r, k] W[n, k] for TB activation rows, NR weight rows at a time
template <class F, int TB, int NR>
static void rows(const float* x, int64_t K, const uint8_t* W, int64_t n0, int64_t n1, float* y,
                 int64_t N) {
  const int64_t nb = K / F::VALS, stride = nb * F::BYTES;
  for (int64_t n = n0; n < n1; n += NR) {
    v16f acc[NR][TB][F::VPB];
    for (int j = 0; j < NR; ++j)
      for (int r = 0; r < TB; ++r)
        for (int i = 0; i < F::VPB; ++i) acc[j][r][i] = v16f{};
    for (int64_t b = 0; b < nb; ++b) {
      v16f w[NR][F::VPB];
      for (int j = 0; j < NR; ++j) F::get(W + (n + j) * stride + b * F::BYTES, w[j]);
      for (int r = 0; r < TB; ++r)
        for (int i = 0; i < F::VPB; ++i) {
          v16f xv = ld(x + r * K + b * F::VALS + 16 * i);
          for (int j = 0; j < NR; ++j) acc[j][r][i] += w[j][i] * xv;
        }
    }
    for (int j = 0; j < NR; ++j)
      for (int r = 0; r < TB; ++r) {
        v16f a = acc[j][r][0];
        for (int i = 1; i < F::VPB; ++i) a += acc[j][r][i];
        y[r * N + n + j] = hsum(a);
      }
  }
}

template <class F>
static void mm(const float* x, int64_t B, int64_t K, const uint8_t* W, int64_t N, float* y) {
  // NR weight rows at a time keep independent accumulator chains in flight; N is split among threads
  const int64_t grain = std::max<int64_t>(16, (N / 64) & ~int64_t(3));
  at::parallel_for(0, N / 4, grain / 4, [&](int64_t a, int64_t e) {
    int64_t n0 = a * 4, n1 = e * 4;
    int64_t r = 0;
    for (; r + 4 <= B; r += 4) rows<F, 4, 2>(x + r * K, K, W, n0, n1, y + r * N, N);
    for (; r + 2 <= B; r += 2) rows<F, 2, 4>(x + r * K, K, W, n0, n1, y + r * N, N);
    for (; r < B; ++r) rows<F, 1, 4>(x + r * K, K, W, n0, n1, y + r * N, N);
  });
  for (int64_t n = (N / 4) * 4; n < N; ++n)  // a tail of fewer than 4 rows
    for (int64_t r = 0; r < B; ++r) rows<F, 1, 1>(x + r * K, K, W, n, n + 1, y + r * N, N);
}

// formats: 0 u4, 1 i8g16, 2 i8g32 (float32 scale/offset); 3 u4h, 4 i8g16h, 5 i8g32h (float16)
static void mm_any(const float* xp, int64_t B, int64_t K, const uint8_t* wp, int64_t N, float* yp, int64_t fmt) {
  switch (fmt) {
    case 0: mm<U4<0>>(xp, B, K, wp, N, yp); break;
    case 1: mm<I8<16, 0>>(xp, B, K, wp, N, yp); break;
    case 2: mm<I8<32, 0>>(xp, B, K, wp, N, yp); break;
    case 3: mm<U4<1>>(xp, B, K, wp, N, yp); break;
    case 4: mm<I8<16, 1>>(xp, B, K, wp, N, yp); break;
    case 5: mm<I8<32, 1>>(xp, B, K, wp, N, yp); break;
    default: TORCH_CHECK(false, "unknown block format");
  }
}

static int64_t group(int64_t fmt) { return fmt % 3 == 1 ? 16 : 32; }
static int64_t row_bytes(int64_t K, int64_t fmt) {
  const int64_t head = fmt >= 3 ? 4 : 8, body = fmt % 3 == 0 ? 16 : group(fmt);
  return K / group(fmt) * (head + body);
}

static void check_w(const torch::Tensor& w, int64_t N, int64_t K, int64_t fmt) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2 && w.size(0) == N &&
              K % group(fmt) == 0 && w.size(1) == row_bytes(K, fmt), "bad packed weight");
}

// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * g  (RMSNorm of each row, float32)
static void rms_rows(const float* x, int64_t B, int64_t D, const float* g, double eps, float* out) {
  for (int64_t r = 0; r < B; ++r) {
    const float* xr = x + r * D;
    float ss = 0.f;
    for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
    float inv = 1.f / std::sqrt(ss / (float)D + (float)eps);
    for (int64_t i = 0; i < D; ++i) out[r * D + i] = g[i] * (xr[i] * inv);
  }
}

// q/k/v of decode rows: RMSNorm, then the packed projection (+ bias)
torch::Tensor decode_qkv(torch::Tensor h, torch::Tensor norm_w, double eps, torch::Tensor w, int64_t N,
                         int64_t fmt, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(h.dtype() == torch::kFloat32 && h.dim() == 2, "h must be float32 [B, D]");
  h = h.contiguous();
  const int64_t B = h.size(0), D = h.size(1);
  check_w(w, N, D, fmt);
  auto x = torch::empty_like(h);
  rms_rows(h.data_ptr<float>(), B, D, norm_w.contiguous().data_ptr<float>(), eps, x.data_ptr<float>());
  auto y = torch::empty({B, N}, h.options());
  mm_any(x.data_ptr<float>(), B, D, w.data_ptr<uint8_t>(), N, y.data_ptr<float>(), fmt);
  if (bias.has_value()) y += *bias;
  return y;
}

// the rest of a decode layer: h + o(attn), then + down(silu(gate) * up) of its RMSNorm
torch::Tensor decode_finish(torch::Tensor h, torch::Tensor attn, torch::Tensor o_w, int64_t o_fmt,
                            c10::optional<torch::Tensor> o_b, torch::Tensor norm_w, double eps,
                            torch::Tensor gu_w, int64_t gu_fmt, torch::Tensor down_w, int64_t down_fmt,
                            int64_t I) {
  TORCH_CHECK(h.dtype() == torch::kFloat32 && h.dim() == 2, "h must be float32 [B, D]");
  h = h.contiguous();
  attn = attn.reshape({h.size(0), -1}).contiguous();
  const int64_t B = h.size(0), D = h.size(1), A = attn.size(1);
  check_w(o_w, D, A, o_fmt);
  check_w(gu_w, 2 * I, D, gu_fmt);
  check_w(down_w, D, I, down_fmt);
  auto h2 = torch::empty_like(h);
  mm_any(attn.data_ptr<float>(), B, A, o_w.data_ptr<uint8_t>(), D, h2.data_ptr<float>(), o_fmt);
  if (o_b.has_value()) h2 += *o_b;
  h2 += h;
  auto x = torch::empty_like(h);
  rms_rows(h2.data_ptr<float>(), B, D, norm_w.contiguous().data_ptr<float>(), eps, x.data_ptr<float>());
  auto gu = torch::empty({B, 2 * I}, h.options());
  mm_any(x.data_ptr<float>(), B, D, gu_w.data_ptr<uint8_t>(), 2 * I, gu.data_ptr<float>(), gu_fmt);
  auto y = torch::empty({B, I}, h.options());
  float* g = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t r = 0; r < B; ++r)
    for (int64_t i = 0; i < I; ++i) {
      float a = g[r * 2 * I + i], u = g[r * 2 * I + I + i];
      yp[r * I + i] = a / (1.f + std::exp(-a)) * u;
    }
  auto out = torch::empty_like(h);
  mm_any(yp, B, I, down_w.data_ptr<uint8_t>(), D, out.data_ptr<float>(), down_fmt);
  out += h2;
  return out;
}

// RoPE of decode rows, x * cos + rotate_half(x) * sin, rounded as torch rounds it (no fused multiply-add)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
// RoPE of one row of H heads (rotate-half), rounded as torch rounds x * cos + rotate_half(x) * sin
static void rope_one(const float* a, const float* c, const float* s, int64_t H, int64_t D, float* o) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < H; ++h, a += D, o += D) {
    for (int64_t i = 0; i < half; ++i) { float t1 = a[i] * c[i], t2 = (-a[i + half]) * s[i]; o[i] = t1 + t2; }
    for (int64_t i = half; i < D; ++i) { float t1 = a[i] * c[i], t2 = a[i - half] * s[i]; o[i] = t1 + t2; }
  }
}

torch::Tensor rope_rows(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 3 && cos.dtype() == torch::kFloat32, "float32 [n, H, D]");
  x = x.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t n = x.size(0), H = x.size(1), D = x.size(2);
  TORCH_CHECK(cos.numel() == n * D && sin.numel() == n * D, "cos/sin must be [n, 1, D]");
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) rope_one(xp + r * H * D, cp + r * D, sp + r * D, H, D, op + r * H * D);
  return out;
}
#pragma GCC pop_options

// exp of 16 floats: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial; within
// 2 ulp of std::exp over [-87.3, 88.4], inputs clamped to that range)
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
static inline float hsum_tree(v16f v) {  // pairwise: 16 -> 8 -> 4 -> 2 -> 1
  v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
static inline v16f vexp(v16f x) {
  const v16f hi = v16f{} + 88.3762626647949f, lo = v16f{} - 87.3365447504f;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  v16f fx = x * 1.44269504088896341f + 0.5f;
  v16f fl = __builtin_convertvector(__builtin_convertvector(fx, v16i), v16f);
  fl = fl > fx ? fl - 1.f : fl;  // floor
  x = x - fl * 0.693359375f;
  x = x - fl * -2.12194440e-4f;
  v16f z = x * x;
  v16f y = v16f{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.f;
  v16i e = (__builtin_convertvector(fl, v16i) + 127) << 23;
  v16f p2;
  std::memcpy(&p2, &e, 64);
  return y * p2;
}


// g query rows q [g, D] (rotated) over n K/V rows (row t at krow(t), vrow(t)): scores in row order (each K
// row read once for the g queries), softmax with a vectorized exp, then the V rows weighted in row order
// (each read once). The single-sequence and the paged step share it: the same bits for the same rows.
template <class KR, class VR>
static void attend_rows(const float* q, int64_t g, int64_t D, int64_t n, double scale, KR krow, VR vrow, float* out) {
  const int64_t VD = D / 16, np = (n + 15) / 16 * 16;
  std::vector<float> S(g * np);
  for (int64_t t = 0; t < n; ++t) {
    const float* kp = krow(t);
    v16f kt[8];
    for (int64_t i = 0; i < VD; ++i) kt[i] = ld(kp + 16 * i);
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = q + j * D;
      v16f a = ld(qj) * kt[0];
      for (int64_t i = 1; i < VD; ++i) a += ld(qj + 16 * i) * kt[i];
      S[j * np + t] = hsum_tree(a) * (float)scale;
    }
  }
  std::vector<float> inv(g);
  for (int64_t j = 0; j < g; ++j) {
    float* Sj = S.data() + j * np;
    float m = Sj[0];
    for (int64_t t = 1; t < n; ++t) m = std::max(m, Sj[t]);
    for (int64_t t = n; t < np; ++t) Sj[t] = m;  // padding, zeroed after exp
    v16f sum = v16f{};
    for (int64_t t = 0; t < np; t += 16) {
      v16f e = vexp(ld(Sj + t) - m);
      std::memcpy(Sj + t, &e, 64);
    }
    for (int64_t t = n; t < np; ++t) Sj[t] = 0.f;
    for (int64_t t = 0; t < np; t += 16) sum += ld(Sj + t);
    inv[j] = 1.f / hsum_tree(sum);
  }
  std::vector<v16f> acc(g * VD, v16f{});
  for (int64_t t = 0; t < n; ++t) {
    const float* vp = vrow(t);
    v16f vt[8];
    for (int64_t i = 0; i < VD; ++i) vt[i] = ld(vp + 16 * i);
    for (int64_t j = 0; j < g; ++j) {
      const float w = S[j * np + t];
      for (int64_t i = 0; i < VD; ++i) acc[j * VD + i] += vt[i] * w;
    }
  }
  for (int64_t j = 0; j < g; ++j)
    for (int64_t i = 0; i < VD; ++i) { v16f r = acc[j * VD + i] * inv[j]; std::memcpy(out + j * D + 16 * i, &r, 64); }
}

// The engine's batched decode over paged KV: q [B, Hq, D] (rotated, the row at position lengths[b] - 1, already
// written) over each sequence's rows 0..lengths[b]-1, found through its block table tables [B, NB] in the pools
// k, v [blocks, block_size, Hkv, D]. Returns [B, Hq, D]; (sequence, KV head) pairs split among torch's threads.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kp, torch::Tensor vp, torch::Tensor tables,
                                     torch::Tensor lengths, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && kp.dtype() == torch::kFloat32 && vp.dtype() == torch::kFloat32 &&
              kp.is_contiguous() && vp.is_contiguous() && kp.dim() == 4 && kp.sizes() == vp.sizes(),
              "paged_decode_attention: float32 contiguous pools [blocks, block_size, Hkv, D]");
  q = q.contiguous();
  tables = tables.to(torch::kLong).contiguous();
  lengths = lengths.to(torch::kLong).contiguous();
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2), bs = kp.size(1), Hkv = kp.size(2), NB = tables.size(1);
  TORCH_CHECK(D % 16 == 0 && D <= 128 && kp.size(3) == D && Hq % Hkv == 0 && tables.size(0) == B &&
              lengths.numel() == B, "paged_decode_attention: shapes");
  const int64_t g = Hq / Hkv, nblocks = kp.size(0);
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= NB * bs, "paged_decode_attention: a length beyond its table");
    for (int64_t i = 0; i < (len[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(tab[b * NB + i] >= 0 && tab[b * NB + i] < nblocks, "paged_decode_attention: a block out of range");
  }
  auto out = torch::empty({B, Hq, D}, q.options());
  const float* K = kp.data_ptr<float>();
  const float* V = vp.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t a, int64_t e) {
    for (int64_t bh = a; bh < e; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv;
      const int64_t* tb = tab + b * NB;
      auto at = [&](const float* P, int64_t t) { return P + ((tb[t / bs] * bs + t % bs) * Hkv + h) * D; };
      attend_rows(qp + (b * Hq + h * g) * D, g, D, len[b], scale, [&](int64_t t) { return at(K, t); },
                  [&](int64_t t) { return at(V, t); }, op + (b * Hq + h * g) * D);
    }
  });
  return out;
}

// One decode row's attention step for a layer: RoPE of its q [1, Hq, D] and k [1, Hkv, D], k and v written to
// row `row` of the layer's head-major cache kc, vc [Hkv, cap, D], then each query head's attention over rows
// 0..row of its KV head (its group's query heads read each K and V row once). Returns [1, Hq, D].
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor kc, torch::Tensor vc, int64_t row, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32 &&
              kc.dtype() == torch::kFloat32 && vc.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32,
              "decode_attention: float32 only");
  TORCH_CHECK(kc.dim() == 3 && kc.sizes() == vc.sizes() && kc.strides() == vc.strides() && kc.stride(2) == 1 &&
              kc.stride(1) == kc.size(2), "cache [Hkv, cap, D] with contiguous rows");
  q = q.contiguous(); k = k.contiguous(); v = v.contiguous(); cos = cos.contiguous(); sin = sin.contiguous();
  const int64_t Hkv = kc.size(0), cap = kc.size(1), D = kc.size(2), Hs = kc.stride(0), Hq = q.numel() / D, g = Hq / Hkv,
                n = row + 1;
  TORCH_CHECK(D % 16 == 0, "head dim must be a multiple of 16");
  TORCH_CHECK(k.numel() == Hkv * D && v.numel() == Hkv * D && Hq % Hkv == 0 && row < cap && cos.numel() == D,
              "decode_attention: shapes");
  auto out = torch::empty({1, Hq, D}, q.options());
  std::vector<float> qr(Hq * D), kr(Hkv * D);
  rope_one(q.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), Hq, D, qr.data());
  rope_one(k.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), Hkv, D, kr.data());
  float* K = kc.data_ptr<float>();
  float* V = vc.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  for (int64_t h = 0; h < Hkv; ++h) {
    std::memcpy(K + h * Hs + row * D, kr.data() + h * D, D * 4);
    std::memcpy(V + h * Hs + row * D, vp + h * D, D * 4);
  }
  float* op = out.data_ptr<float>();
  TORCH_CHECK(D / 16 <= 8, "head dim at most 128");
  auto head = [&](int64_t h) {
    const float* Kh = K + h * Hs;
    const float* Vh = V + h * Hs;
    attend_rows(qr.data() + h * g * D, g, D, n, scale, [&](int64_t t) { return Kh + t * D; },
                [&](int64_t t) { return Vh + t * D; }, op + h * g * D);
  };
  if (n * Hq < 8192) {
    for (int64_t h = 0; h < Hkv; ++h) head(h);  // a short prompt: one thread is faster than waking others
  } else {
    at::parallel_for(0, Hkv, 1, [&](int64_t a, int64_t e) { for (int64_t h = a; h < e; ++h) head(h); });
  }
  return out;
}

// how many of torch's threads take part in a parallel loop of n items (1 when built without OpenMP)
int64_t parallel_threads(int64_t n) {
  std::vector<int> seen(at::get_num_threads() + 1, 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  int64_t used = 0;
  for (int v : seen) used += v;
  return used;
}

torch::Tensor lowbit_mm(torch::Tensor x, torch::Tensor w, int64_t N, int64_t K, int64_t fmt) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == K, "x must be float32 [B, K]");
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.is_contiguous() && w.size(0) == N, "w must be packed uint8 [N, bytes]");
  x = x.contiguous();
  const int64_t B = x.size(0);
  auto y = torch::empty({B, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  check_w(w, N, K, fmt);
  mm_any(xp, B, K, wp, N, yp, fmt);
  return y;
}
"""

FUNCTIONS = [
    "lowbit_mm",
    "decode_qkv",
    "decode_finish",
    "rope_rows",
    "decode_attention",
    "paged_decode_attention",
    "parallel_threads",
]
#: -fopenmp: at::parallel_for is OpenMP pragmas in torch's headers, so without it the kernel runs on one
#: thread whatever torch's thread count (it did until 2026-11-29: the decode step never used the second core)
CFLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-Wno-psabi", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
#: the kernel's block formats by name, as ``lowbit_mm``'s ``fmt`` argument
FORMATS = {"u4": 0, "i8g16": 1, "i8g32": 2, "u4h": 3, "i8g16h": 4, "i8g32h": 5}

_lock = threading.Lock()
_state: dict = {}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return " ".join(sorted(x for x in line.split() if x.startswith(("avx", "fma", "f16c"))))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_id() -> str:
    """What the built library depends on: the source, the flags, torch's version, the CPU's vector units."""
    import torch

    h = hashlib.sha256(
        "\0".join([SOURCE, " ".join(CFLAGS + LDFLAGS), torch.__version__, _cpu_flags()]).encode()
    )
    return h.hexdigest()[:16]


def kernel():
    """The built kernel module (built on first use, then loaded from the cache), or None if unavailable."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        _state["module"] = mod = _build()
        return mod


def kernel_error() -> str | None:
    """Why :func:`kernel` returned None (None while it has not been tried or when it loaded)."""
    return _state.get("error")


def _build():
    if os.environ.get("RAGKV_LOWBIT_KERNEL", "1").lower() in ("0", "false", "no", "off"):
        _state["error"] = "disabled by RAGKV_LOWBIT_KERNEL=0"
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        from ragkv.model.gguf import cache_root

        bid = build_id()
        d = cache_root() / "kernels" / bid
        d.mkdir(parents=True, exist_ok=True)
        return load_inline(
            name=f"ragkv_lowbit_{bid}",
            cpp_sources=[SOURCE],
            functions=FUNCTIONS,
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            build_directory=str(d),
            verbose=False,
        )
    except Exception as e:  # no compiler, no headers, a failed build: decode keeps float32 weights
        _state["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e}"
        log.warning("low-bit decode kernel unavailable (%s); decode uses float32 weights", _state["error"])
        return None


def reset() -> None:
    """Forget the loaded (or failed) kernel so the next :func:`kernel` tries again (tests)."""
    with _lock:
        _state.clear()
