// Weight-only GGUF block-quantized linear layers: y = x @ W.T with W kept in the GGUF's own
// blocks (Q4_0, Q4_1, Q8_0; 32 weights per block, one fp16 scale, Q4_1 also an fp16 min), so a
// decode step reads 4.5-8.5 bits per weight instead of 32.
//
// Each output row is dequantized block by block into a small per-thread buffer (in L1) with
// exactly the arithmetic of gguf-py's dequantize (d * q [+ m], no FMA: built with
// -ffp-contract=off), then dotted with every activation row. The vector ISA is chosen at run
// time by the caller (from /proc/cpuinfo, see engine/cpu.py): each path is compiled with its
// own target attribute, so one build serves any x86-64 and nothing is assumed.
//
// On AVX2 and AVX-512 VNNI the caller instead repacks the blocks once into 16-row panels
// (`repack_panels`) and multiplies with int8 activations (`quant_linear_panels`, llama.cpp's
// arithmetic; see "int8 activations" below). The float path stays for other CPUs and for
// callers that pin it (PDSERVE_QUANT_ISA).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define PDS_X86 1
#endif

namespace {

enum QType : int64_t { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2 };
// kAvx2Int8 and kAvx512Vnni are the int8-activation panel paths; for the float kernels they mean
// kAvx2 and kAvx512. kAvx512VnniAmx is kAvx512Vnni for decode-sized batches and, from
// kAmxRows rows on, bf16 weights through oneDNN's GEMM on the AMX tiles (see panels_to_bf16).
enum Isa : int64_t {
  kGeneric = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kAvx2Int8 = 4, kAvx512VnniAmx = 5
};
inline int64_t float_isa(int64_t isa) {
  return (isa == kAvx512Vnni || isa == kAvx512VnniAmx) ? kAvx512
                                                       : (isa == kAvx2Int8 ? kAvx2 : isa);
}
constexpr int64_t kBlock = 32;

int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
  }
  TORCH_CHECK(false, "unknown quant type ", qtype);
}

// Where a block's codes start (after d, and Q4_1's m).
inline int64_t codes_offset(int64_t qtype) { return qtype == kQ4_1 ? 4 : 2; }

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// ------------------------------------------------------------------ generic (any CPU)

void dequant_row_generic(const uint8_t* row, int64_t nb, int64_t qtype, float* out) {
  const int64_t bb = block_bytes(qtype);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bb;
    float* o = out + b * kBlock;
    const float d = half_at(blk);
    if (qtype == kQ4_0) {
      const uint8_t* qs = blk + 2;
      for (int j = 0; j < 16; ++j) {
        o[j] = d * static_cast<float>(static_cast<int>(qs[j] & 15) - 8);
        o[j + 16] = d * static_cast<float>(static_cast<int>(qs[j] >> 4) - 8);
      }
    } else if (qtype == kQ4_1) {
      const float m = half_at(blk + 2);
      const uint8_t* qs = blk + 4;
      for (int j = 0; j < 16; ++j) {
        o[j] = d * static_cast<float>(qs[j] & 15) + m;
        o[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
      }
    } else {
      const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
      for (int j = 0; j < 32; ++j) o[j] = d * static_cast<float>(qs[j]);
    }
  }
}

float dot_generic(const float* w, const float* x, int64_t k) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < k; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += w[i + l] * x[i + l];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

#ifdef PDS_X86
// ------------------------------------------------------------------ AVX2 + FMA + F16C

__attribute__((target("avx2,fma,f16c"))) void dequant_row_avx2(const uint8_t* row, int64_t nb,
                                                                int64_t qtype, float* out) {
  const int64_t bb = block_bytes(qtype);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bb;
    float* o = out + b * kBlock;
    const __m256 vd = _mm256_set1_ps(half_at(blk));
    if (qtype == kQ8_0) {
      const int8_t* qs = reinterpret_cast<const int8_t*>(blk + 2);
      for (int j = 0; j < 32; j += 8) {
        __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + j));
        _mm256_storeu_ps(o + j, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8))));
      }
      continue;
    }
    const uint8_t* qs = blk + codes_offset(qtype);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    __m128i lo = _mm_and_si128(q, low4);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
    if (qtype == kQ4_0) {
      lo = _mm_sub_epi8(lo, _mm_set1_epi8(8));
      hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int p = 0; p < 4; ++p) {
      __m256 qf = qtype == kQ4_1 ? _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p]))
                                 : _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[p]));
      __m256 w = _mm256_mul_ps(vd, qf);
      if (qtype == kQ4_1) w = _mm256_add_ps(w, _mm256_set1_ps(half_at(blk + 2)));
      _mm256_storeu_ps(o + 8 * p, w);
    }
  }
}

__attribute__((target("avx2,fma"))) float dot_avx2(const float* w, const float* x, int64_t k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
  }
  __m256 a = _mm256_add_ps(a0, a1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ------------------------------------------------------------------ AVX-512 (F + BW)

// half_at with the F16C instruction (the same value: both are exact IEEE conversions).
__attribute__((target("f16c"))) inline float half_at_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// `ahead`: bytes past each block to prefetch (0: none), for a caller streaming rows.
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void dequant_row_avx512(
    const uint8_t* row, int64_t nb, int64_t qtype, float* out, int64_t ahead = 0) {
  const int64_t bb = block_bytes(qtype);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = row + b * bb;
    if (ahead) _mm_prefetch(reinterpret_cast<const char*>(blk + ahead), _MM_HINT_T0);
    float* o = out + b * kBlock;
    const __m512 vd = _mm512_set1_ps(half_at_f16c(blk));
    if (qtype == kQ8_0) {
      const __m128i* qs = reinterpret_cast<const __m128i*>(blk + 2);
      _mm512_storeu_ps(o, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(
                                                _mm512_cvtepi8_epi32(_mm_loadu_si128(qs)))));
      _mm512_storeu_ps(o + 16, _mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                     _mm_loadu_si128(qs + 1)))));
      continue;
    }
    const uint8_t* qs = blk + codes_offset(qtype);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i lo = _mm_and_si128(q, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
    __m512 wl, wh;
    if (qtype == kQ4_1) {
      const __m512 vm = _mm512_set1_ps(half_at_f16c(blk + 2));
      wl = _mm512_add_ps(_mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo))), vm);
      wh = _mm512_add_ps(_mm512_mul_ps(vd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi))), vm);
    } else {
      const __m512i eight = _mm512_set1_epi32(8);
      wl = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(
                                 _mm512_sub_epi32(_mm512_cvtepu8_epi32(lo), eight)));
      wh = _mm512_mul_ps(vd, _mm512_cvtepi32_ps(
                                 _mm512_sub_epi32(_mm512_cvtepu8_epi32(hi), eight)));
    }
    _mm512_storeu_ps(o, wl);
    _mm512_storeu_ps(o + 16, wh);
  }
}

__attribute__((target("avx512f,avx512bw,avx2,fma"))) float dot_avx512(const float* w,
                                                                      const float* x,
                                                                      int64_t k) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 32) {
    a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

// M=1, fused: no buffer round trip. sum_j (d q_j + m) x_j = d * sum_j q_j x_j + m * sum_j x_j
// (Q4_0: m = -8 d), with the per-block sums of x precomputed once per call (xsum). Same
// weights, other rounding. R rows at a time (rows row, row + bpr, ...): each block of x is
// loaded once for R rows, R accumulators hide the FMA latency, and the same place R rows on
// (the next group) is prefetched: one row at a time, a decode step streamed its weights from
// memory at ~3.5 GB/s of the ~23 GB/s the same machine reads (each row's chain of dependent
// FMAs left the loads waiting). Each row's arithmetic is the same as with R = 1.
template <int R>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void gemv_q4_avx512(
    const uint8_t* row, int64_t bpr, int64_t nb, int64_t qtype, const float* x,
    const float* xsum, float* out) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const int64_t bb = block_bytes(qtype), qoff = codes_offset(qtype);
  __m512 acc[R];
  float macc[R];
  for (int j = 0; j < R; ++j) {
    acc[j] = _mm512_setzero_ps();
    macc[j] = 0.f;
  }
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 xl = _mm512_loadu_ps(x + b * kBlock), xh = _mm512_loadu_ps(x + b * kBlock + 16);
    for (int j = 0; j < R; ++j) {
      const uint8_t* blk = row + j * bpr + b * bb;
      _mm_prefetch(reinterpret_cast<const char*>(blk + R * bpr), _MM_HINT_T0);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + qoff));
      const __m512 ql = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, low4)));
      const __m512 qh =
          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), low4)));
      const __m512 t = _mm512_fmadd_ps(qh, xh, _mm512_mul_ps(ql, xl));
      const float d = half_at_f16c(blk);
      acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(d), t, acc[j]);
      macc[j] += (qtype == kQ4_1 ? half_at_f16c(blk + 2) : -8.f * d) * xsum[b];
    }
  }
  for (int j = 0; j < R; ++j) out[j] = _mm512_reduce_add_ps(acc[j]) + macc[j];
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx2,fma,f16c"))) void gemv_q8_0_avx512(
    const uint8_t* row, int64_t bpr, int64_t nb, const float* x, float* out) {
  __m512 acc[R];
  for (int j = 0; j < R; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 xl = _mm512_loadu_ps(x + b * kBlock), xh = _mm512_loadu_ps(x + b * kBlock + 16);
    for (int j = 0; j < R; ++j) {
      const uint8_t* blk = row + j * bpr + b * 34;
      _mm_prefetch(reinterpret_cast<const char*>(blk + R * bpr), _MM_HINT_T0);
      const __m128i* qs = reinterpret_cast<const __m128i*>(blk + 2);
      const __m512 ql = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs)));
      const __m512 qh = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(qs + 1)));
      const __m512 t = _mm512_fmadd_ps(qh, xh, _mm512_mul_ps(ql, xl));
      acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(half_at_f16c(blk)), t, acc[j]);
    }
  }
  for (int j = 0; j < R; ++j) out[j] = _mm512_reduce_add_ps(acc[j]);
}

// A small batch (2..kSmallM rows of x) against `rows` dequantized weight rows w (row j at
// w + j * k): y[i][j] = w_j . x_i, written at out[i * ldo + j]. Full 4 x 4 tiles keep 16
// accumulators in registers, so each load of w or x feeds four FMAs (one row of w against
// one row of x at a time loaded two floats per FMA: the load ports, not the FMAs, set the pace).
__attribute__((target("avx512f,avx512bw,avx2,fma"))) void tile_4x4_avx512(
    const float* w, const float* x, int64_t k, float* out, int64_t ldo) {
  __m512 acc[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += 16) {
    __m512 wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = _mm512_loadu_ps(w + j * k + c);
    for (int i = 0; i < 4; ++i) {
      const __m512 xv = _mm512_loadu_ps(x + i * k + c);
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_fmadd_ps(wv[j], xv, acc[i][j]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) out[i * ldo + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// ------------------------------------------------------------------ AVX-512 VNNI: int8 activations
//
// llama.cpp's arithmetic for these formats: each row of x is quantized per block of 32 to int8
// (qx = round(x / dx), dx = max|x| / 127, and sx = dx * sum(qx)), and each block's dot is an
// integer dot of the weight codes with qx (VPDPBUSD: 64 u8 x s8 products per instruction, four
// times the fp32 FMA's), scaled once per block:
//   w . x = sum_b  dw_b * dx_b * (u_b . qx_b)  +  c_b * sx_b
// with u the codes as unsigned bytes and c the offset that makes them so: Q4_1 u = q, c = m;
// Q4_0 u = q, c = -8 d; Q8_0 u = q + 128, c = -128 d. The integer parts are exact, so this
// differs from the float path only by the activations' 8-bit rounding (agreement measured in
// bench/quality.py). One code path for every batch size, prefill included, over weights
// repacked once at load into 16-row panels (below). A first version kept the GGUF's row order
// and scaled each (row of x, row of w) pair's VPDPBUSD result per block: four vector operations
// per 64 products, no faster than the fp32 tiles on Zen 4 (measured while choosing, not recorded).

// x [m, k] -> qx [m, k] int8, dx and sx [m, k / 32].
__attribute__((target("avx512f,avx512bw,avx512vl"))) void quantize_rows_avx512(
    const float* x, int64_t m, int64_t k, int8_t* qx, float* dx, float* sx) {
  const int64_t nb = k / kBlock;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      int8_t* q = qx + (i * nb + b) * kBlock;
      const float* xb = x + i * k + b * kBlock;
      const __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      const __m512 vid = _mm512_set1_ps(id);
      const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, vid));  // nearest, ties to even
      const __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, vid));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(ql));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qh));
      dx[i * nb + b] = d;
      sx[i * nb + b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh)));
    }
  }
}

// quantize_rows_avx512 with AVX2: the same arithmetic (RNE conversion, saturating packs).
__attribute__((target("avx2,fma"))) void quantize_rows_avx2(const float* x, int64_t m, int64_t k,
                                                            int8_t* qx, float* dx, float* sx) {
  const int64_t nb = k / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + i * k + b * kBlock;
      __m256 v[4];
      __m256 mx = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xb + 8 * j);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      const float d = _mm_cvtss_f32(h) / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      __m256i q[4];
      __m256i total = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(id)));
        total = _mm256_add_epi32(total, q[j]);
      }
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                           _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + (i * nb + b) * kBlock),
                          _mm256_permutevar8x32_epi32(p, order));
      __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      t = _mm_hadd_epi32(t, t);
      t = _mm_hadd_epi32(t, t);
      dx[i * nb + b] = d;
      sx[i * nb + b] = d * static_cast<float>(_mm_cvtsi128_si32(t));
    }
  }
}


// Rows [begin, end) of a single-row GEMV, kRows at a time, then one by one.
constexpr int kRows = 4;

template <typename Group, typename One>
void gemv_rows(int64_t begin, int64_t end, Group group, One one) {
  int64_t r = begin;
  for (; r + kRows <= end; r += kRows) group(r);
  for (; r < end; ++r) one(r);
}
#endif

void dequant_row(const uint8_t* row, int64_t nb, int64_t qtype, float* out, int64_t isa) {
#ifdef PDS_X86
  if (isa == kAvx512) return dequant_row_avx512(row, nb, qtype, out);
  if (isa == kAvx2) return dequant_row_avx2(row, nb, qtype, out);
#endif
  dequant_row_generic(row, nb, qtype, out);
}

float dot(const float* w, const float* x, int64_t k, int64_t isa) {
#ifdef PDS_X86
  if (isa == kAvx512) return dot_avx512(w, x, k);
  if (isa == kAvx2) return dot_avx2(w, x, k);
#endif
  return dot_generic(w, x, k);
}

void check_blocks(const torch::Tensor& blocks, int64_t qtype, int64_t k) {
  TORCH_CHECK(blocks.dtype() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be a contiguous uint8 [out_features, bytes] tensor");
  TORCH_CHECK(k % kBlock == 0, "in_features must be a multiple of 32");
  TORCH_CHECK(blocks.size(1) == k / kBlock * block_bytes(qtype),
              "blocks hold ", blocks.size(1), " bytes per row, expected ",
              k / kBlock * block_bytes(qtype));
}

// Rows of work per parallel task: enough that a task amortizes its buffer.
constexpr int64_t kGrain = 16;

}  // namespace

// Panels: sixteen weight rows interleaved so that lane r of a VPDPBUSD result is row r. Per block
// of 32 inputs, `panel_code_bytes` of codes (chunk q of 64 bytes holds bytes 4q..4q+3 of each
// row's codes, row r at 4r; Q4 chunks hold the packed nibbles, whose low halves are inputs
// 4q..4q+3 and high halves 16+4q..16+4q+3; Q8_0 chunks the eight quads of q + 128), then the
// sixteen rows' fp16 d and (Q4_1) fp16 m as the GGUF stores them: the same bytes as the GGUF's
// blocks (Q8_0: 36 per block against 34). Built once at load from the GGUF blocks (the same bits, rearranged, as
// llama.cpp repacks its CPU weights), so a block of x is broadcast four bytes at a time against
// sixteen rows and the float work per block is one scale per sixteen rows, not per row.
constexpr int64_t kPanel = 16;
constexpr int64_t panel_code_bytes(int64_t qtype) { return qtype == kQ8_0 ? 512 : 256; }
constexpr int64_t panel_block_bytes(int64_t qtype) { return panel_code_bytes(qtype) + 64; }

// The one mapping between row r's GGUF block and its place in a panel's block, either way.
void move_block(int64_t qtype, int64_t r, const uint8_t* from, uint8_t* to, bool to_panel) {
  const int64_t code = panel_code_bytes(qtype), qoff = codes_offset(qtype);
  const auto move = [&](int64_t gguf_at, int64_t panel_at, int64_t n, uint8_t flip) {
    const uint8_t* s = from + (to_panel ? gguf_at : panel_at);
    uint8_t* d = to + (to_panel ? panel_at : gguf_at);
    for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint8_t>(s[i] ^ flip);
  };
  move(0, code + 2 * r, 2, 0);                           // d
  if (qtype == kQ4_1) move(2, code + 32 + 2 * r, 2, 0);  // m
  const uint8_t flip = qtype == kQ8_0 ? 0x80 : 0;        // Q8_0's codes as unsigned bytes
  for (int64_t q = 0; q < code / 64; ++q) move(qoff + 4 * q, q * 64 + 4 * r, 4, flip);
}

// f(row, b) for block b of every row of an n-row layer, a panel's rows per task.
template <typename F>
void each_row_block(int64_t n, int64_t nb, const F& f) {
  at::parallel_for(0, n, kPanel, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      for (int64_t b = 0; b < nb; ++b) f(row, b);
  });
}

torch::Tensor repack_panels(const torch::Tensor& blocks, int64_t qtype, int64_t k) {
  check_blocks(blocks, qtype, k);
  const int64_t n = blocks.size(0), nb = k / kBlock, bpr = blocks.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel, pbb = panel_block_bytes(qtype);
  auto out = torch::zeros({panels, nb * pbb}, torch::kUInt8);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  each_row_block(n, nb, [&](int64_t row, int64_t b) {
    move_block(qtype, row % kPanel, src + row * bpr + b * block_bytes(qtype),
               dst + (row / kPanel * nb + b) * pbb, true);
  });
  return out;
}

// The GGUF blocks back from their panels, byte for byte (the panels are all a layer keeps).
torch::Tensor panels_to_blocks(const torch::Tensor& panels, int64_t qtype, int64_t n,
                               int64_t k) {
  const int64_t nb = k / kBlock, pbb = panel_block_bytes(qtype), bb = block_bytes(qtype);
  TORCH_CHECK(k % kBlock == 0 && panels.dtype() == torch::kUInt8 && panels.is_contiguous() &&
                  panels.size(0) == (n + kPanel - 1) / kPanel && panels.size(1) == nb * pbb,
              "panels do not match n and k");
  auto out = torch::empty({n, nb * bb}, torch::kUInt8);
  const uint8_t* src = panels.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  each_row_block(n, nb, [&](int64_t row, int64_t b) {
    move_block(qtype, row % kPanel, src + (row / kPanel * nb + b) * pbb,
               dst + row * nb * bb + b * bb, false);
  });
  return out;
}

#ifdef PDS_X86
// ------------------------------------------------------------------ AMX: prefill through bf16
//
// On a CPU with AMX a prompt-sized batch is faster as a bf16 GEMM on the tile unit than as int8
// dot products on the vector unit, even after expanding the weights for every call: the
// layer's panels -> bf16 [n, k] (d * q [+ m] in float32, as `dequantize`, then rounded to
// nearest even), x rounded to bf16, and oneDNN's GEMM (at::linear): float32 sums, the output
// rounded to bf16 (ATen has no bf16 x bf16 -> float32 GEMM on CPU), then the bias in float32.
// The expanded weights live only for the call (a layer's are 0.6-3.5 MB here: they stay in
// cache between the expansion and the GEMM), so the format keeps its memory. The activations'
// rounding differs from the int8 path's (8 significant bits against 7 per block); agreement is
// measured in bench/quality.py.
// From here the tiles won on a Sapphire Rapids (a whole prompt's prefill, q4_1: 1.07x at 128
// tokens, 1.25x at 200, 1.55x at 512, docs/bench/prefill_amx_52ccd54_spr.json; with 64 as the
// threshold, 0.8x at 64: expanding the weights costs ~0.3 ms a layer).
constexpr int64_t kAmxRows = 128;

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
inline void put_bf16(at::BFloat16* o, __m512 f) {  // 16 floats, rounded to nearest even
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(f));
}

// One panel's block b (16 rows x 32 inputs) into out (row r at out + r * k), rows < `rows`.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,f16c")))
void panel_block_bf16(int64_t qtype, const uint8_t* pb, int64_t rows, at::BFloat16* out,
                      int64_t k) {
  const int64_t code = panel_code_bytes(qtype);
  const auto quad = [&](int64_t q, int64_t r) {
    int32_t v;
    std::memcpy(&v, pb + q * 64 + 4 * r, 4);
    return v;
  };
  for (int64_t r = 0; r < rows; ++r) {
    at::BFloat16* o = out + r * k;
    const __m512 d = _mm512_set1_ps(half_at(pb + code + 2 * r));
    if (qtype == kQ8_0) {
      const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
      for (int64_t h = 0; h < 2; ++h) {
        const __m128i c = _mm_xor_si128(
            _mm_set_epi32(quad(4 * h + 3, r), quad(4 * h + 2, r), quad(4 * h + 1, r),
                          quad(4 * h, r)), flip);
        put_bf16(o + 16 * h, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c))));
      }
      continue;
    }
    const __m128i c = _mm_set_epi32(quad(3, r), quad(2, r), quad(1, r), quad(0, r));
    const __m128i nib = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(c, nib), hi = _mm_and_si128(_mm_srli_epi16(c, 4), nib);
    __m512 wl = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
    __m512 wh = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
    if (qtype == kQ4_1) {  // d * q + m, two roundings as gguf-py's
      const __m512 m = _mm512_set1_ps(half_at(pb + code + 32 + 2 * r));
      wl = _mm512_add_ps(_mm512_mul_ps(d, wl), m);
      wh = _mm512_add_ps(_mm512_mul_ps(d, wh), m);
    } else {  // Q4_0: d * (q - 8)
      const __m512 eight = _mm512_set1_ps(8.0f);
      wl = _mm512_mul_ps(d, _mm512_sub_ps(wl, eight));
      wh = _mm512_mul_ps(d, _mm512_sub_ps(wh, eight));
    }
    put_bf16(o, wl);
    put_bf16(o + 16, wh);
  }
}

// The weights of n rows as bf16 [n, k] (each the float32 weight `dequantize` gives, rounded
// to nearest even). Needs avx512_bf16 (every CPU with AMX has it; the caller checks).
torch::Tensor panels_to_bf16(const torch::Tensor& panels, int64_t qtype, int64_t n, int64_t k) {
  const int64_t nb = k / kBlock, pbb = panel_block_bytes(qtype);
  TORCH_CHECK(k % kBlock == 0 && panels.dtype() == torch::kUInt8 && panels.is_contiguous() &&
                  panels.size(0) == (n + kPanel - 1) / kPanel && panels.size(1) == nb * pbb,
              "panels do not match n and k");
  auto out = torch::empty({n, k}, torch::kBFloat16);
  const uint8_t* pp = panels.data_ptr<uint8_t>();
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, panels.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t rows = std::min<int64_t>(kPanel, n - p * kPanel);
      for (int64_t b = 0; b < nb; ++b)
        panel_block_bf16(qtype, pp + (p * nb + b) * pbb, rows, op + p * kPanel * k + b * kBlock,
                         k);
    }
  });
  return out;
}

// y[i][16 rows] for MI rows of x against one panel. Two integer accumulators per row of x halve
// the chain of dependent VPDPBUSDs (the one-row decode case is latency-bound otherwise).
template <int MI, int64_t QT>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c"))) void panel_tile(
    const uint8_t* panel, int64_t nb, const int8_t* qx, const float* dx, const float* sx,
    int64_t ld, int64_t lds, float* out, int64_t ldo, int64_t rows) {
  constexpr bool Q8 = QT == kQ8_0;
  constexpr int64_t code = panel_code_bytes(QT), pbb = panel_block_bytes(QT);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1);
  __m512 facc[MI];
  for (int i = 0; i < MI; ++i) facc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * pbb;
    for (int64_t line = 0; line < pbb; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk + 4 * pbb + line), _MM_HINT_T0);
    __m512i w[8];
    if constexpr (Q8) {
      for (int q = 0; q < 8; ++q) w[q] = _mm512_load_si512(blk + 64 * q);
    } else {
      for (int q = 0; q < 4; ++q) {
        const __m512i v = _mm512_load_si512(blk + 64 * q);
        w[q] = _mm512_and_si512(v, low4);
        w[q + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(blk + code)));
    const __m512 cw =  // the offset c that makes the codes unsigned (see above)
        QT == kQ4_1 ? _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(blk + code + 32)))
                    : _mm512_mul_ps(dw, _mm512_set1_ps(Q8 ? -128.f : -8.f));
    for (int i = 0; i < MI; ++i) {
      const int32_t* xq = reinterpret_cast<const int32_t*>(qx + i * ld + b * kBlock);
      __m512i a0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(xq[0]));
      __m512i a1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(xq[1]));
      a0 = _mm512_dpbusd_epi32(a0, w[2], _mm512_set1_epi32(xq[2]));
      a1 = _mm512_dpbusd_epi32(a1, w[3], _mm512_set1_epi32(xq[3]));
      a0 = _mm512_dpbusd_epi32(a0, w[4], _mm512_set1_epi32(xq[4]));
      a1 = _mm512_dpbusd_epi32(a1, w[5], _mm512_set1_epi32(xq[5]));
      a0 = _mm512_dpbusd_epi32(a0, w[6], _mm512_set1_epi32(xq[6]));
      a1 = _mm512_dpbusd_epi32(a1, w[7], _mm512_set1_epi32(xq[7]));
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(a0, a1));
      facc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(dw, _mm512_set1_ps(dx[i * lds + b])), facc[i]);
      facc[i] = _mm512_fmadd_ps(cw, _mm512_set1_ps(sx[i * lds + b]), facc[i]);
    }
  }
  for (int i = 0; i < MI; ++i) _mm512_mask_storeu_ps(out + i * ldo, mask, facc[i]);
}

// The same panels with AVX2 (no VNNI): each 16-row panel as two halves of eight rows, the byte
// products by VPMADDUBSW (u8 x s8 -> pairs summed to int16) and VPMADDWD. Q4 codes (<= 15)
// times |qx| <= 127 cannot saturate int16, even summed over a block's eight quads; Q8_0 codes
// go in as |q| against qx carrying q's sign (llama.cpp's trick: 128 * 127 * 2 fits), so its sum
// is the signed one and needs no offset term.
template <int MI, int64_t QT>
__attribute__((target("avx2,fma,f16c"))) void panel_tile_avx2(
    const uint8_t* panel, int64_t nb, const int8_t* qx, const float* dx, const float* sx,
    int64_t ld, int64_t lds, float* out, int64_t ldo, int64_t rows) {
  constexpr bool Q8 = QT == kQ8_0;
  constexpr int64_t code = panel_code_bytes(QT), pbb = panel_block_bytes(QT);
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t half = 0; half < 2 && 8 * half < rows; ++half) {
    __m256 facc[MI];
    for (int i = 0; i < MI; ++i) facc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = panel + b * pbb + 32 * half;
      __m256i w[8];
      if constexpr (Q8) {  // back to signed q
        for (int q = 0; q < 8; ++q)
          w[q] = _mm256_xor_si256(
              _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + 64 * q)), flip);
      } else {
        for (int q = 0; q < 4; ++q) {
          const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + 64 * q));
          w[q] = _mm256_and_si256(v, low4);
          w[q + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
      }
      const uint8_t* scales = panel + b * pbb + code + 16 * half;
      const __m256 dw = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(scales)));
      const __m256 cw =
          QT == kQ4_1 ? _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(scales + 32)))
                      : _mm256_mul_ps(dw, _mm256_set1_ps(-8.f));
      for (int i = 0; i < MI; ++i) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(qx + i * ld + b * kBlock);
        __m256i acc;
        if constexpr (Q8) {
          acc = _mm256_setzero_si256();
          for (int q = 0; q < 8; ++q) {
            const __m256i xb = _mm256_set1_epi32(xq[q]);
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(
                _mm256_abs_epi8(w[q]), _mm256_sign_epi8(xb, w[q])), ones));
          }
        } else {
          __m256i s16 = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(xq[0]));
          for (int q = 1; q < 8; ++q)
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[q], _mm256_set1_epi32(xq[q])));
          acc = _mm256_madd_epi16(s16, ones);
        }
        facc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc),
                                  _mm256_mul_ps(dw, _mm256_set1_ps(dx[i * lds + b])), facc[i]);
        if constexpr (!Q8) facc[i] = _mm256_fmadd_ps(cw, _mm256_set1_ps(sx[i * lds + b]), facc[i]);
      }
    }
    const int64_t n8 = std::min<int64_t>(8, rows - 8 * half);
    for (int i = 0; i < MI; ++i) {
      alignas(32) float t[8];
      _mm256_store_ps(t, facc[i]);
      std::memcpy(out + i * ldo + 8 * half, t, n8 * sizeof(float));
    }
  }
}

template <int64_t QT, bool Vnni>
void panel_rows(int mi, const uint8_t* panel, int64_t nb, const int8_t* qx, const float* dx,
                const float* sx, int64_t ld, int64_t lds, float* out, int64_t ldo,
                int64_t rows) {
  const auto tile = [&](auto vnni_tile, auto avx2_tile) {
    if constexpr (Vnni) vnni_tile(panel, nb, qx, dx, sx, ld, lds, out, ldo, rows);
    else avx2_tile(panel, nb, qx, dx, sx, ld, lds, out, ldo, rows);
  };
  switch (mi) {
    case 4: return tile(panel_tile<4, QT>, panel_tile_avx2<4, QT>);
    case 3: return tile(panel_tile<3, QT>, panel_tile_avx2<3, QT>);
    case 2: return tile(panel_tile<2, QT>, panel_tile_avx2<2, QT>);
    default: return tile(panel_tile<1, QT>, panel_tile_avx2<1, QT>);
  }
}
#endif

// y [M, N] = x @ W.T (+ bias) with W as `repack_panels` laid it out, int8 activations.
torch::Tensor quant_linear_panels(const torch::Tensor& x, const torch::Tensor& panels,
                                  int64_t qtype, int64_t n, int64_t isa,
                                  const c10::optional<torch::Tensor>& bias) {
#ifdef PDS_X86
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  const auto xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), nb = k / kBlock;
  TORCH_CHECK(k % kBlock == 0 && panels.dtype() == torch::kUInt8 && panels.is_contiguous() &&
                  panels.size(0) == (n + kPanel - 1) / kPanel &&
                  panels.size(1) == nb * panel_block_bytes(qtype),
              "panels do not match x and n");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(panels.data_ptr()) % 64 == 0, "panels not aligned");
  TORCH_CHECK(isa == kAvx512Vnni || isa == kAvx2Int8 || isa == kAvx512VnniAmx,
              "panels run on avx512vnni, avx512vnni_amx or avx2_int8");
  if (isa == kAvx512VnniAmx && m >= kAmxRows) {
    auto y = at::linear(xc.to(torch::kBFloat16), panels_to_bf16(panels, qtype, n, k))
                 .to(torch::kFloat32);
    if (bias.has_value()) y.add_(bias->to(torch::kFloat32));
    return y;
  }
  const bool vnni = isa != kAvx2Int8;
  auto y = torch::empty({m, n}, torch::kFloat32);
  std::vector<int8_t> qx(m * k);
  std::vector<float> dx(m * nb), sx(m * nb);
  const float* xp = xc.data_ptr<float>();
  at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
    (vnni ? quantize_rows_avx512 : quantize_rows_avx2)(
        xp + begin * k, end - begin, k, qx.data() + begin * k, dx.data() + begin * nb,
        sx.data() + begin * nb);
  });
  torch::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value()) {
    bc = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bc.numel() == n, "bias must have out_features elements");
    bp = bc.data_ptr<float>();
  }
  const uint8_t* pp = panels.data_ptr<uint8_t>();
  const int64_t pstride = panels.size(1);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t r = p * kPanel, rows = std::min<int64_t>(kPanel, n - r);
      const auto rows_fn =
          vnni ? (qtype == kQ8_0   ? panel_rows<kQ8_0, true>
                  : qtype == kQ4_1 ? panel_rows<kQ4_1, true>
                                   : panel_rows<kQ4_0, true>)
               : (qtype == kQ8_0   ? panel_rows<kQ8_0, false>
                  : qtype == kQ4_1 ? panel_rows<kQ4_1, false>
                                   : panel_rows<kQ4_0, false>);
      for (int64_t i = 0; i < m; i += 4) {
        const int mi = static_cast<int>(std::min<int64_t>(4, m - i));
        rows_fn(mi, pp + p * pstride, nb, qx.data() + i * k, dx.data() + i * nb,
                sx.data() + i * nb, k, nb, yp + i * n + r, n, rows);
      }
      if (bp)
        for (int64_t a = 0; a < m; ++a)
          for (int64_t j = 0; j < rows; ++j) yp[a * n + r + j] += bp[r + j];
    }
  });
  return y;
#else
  TORCH_CHECK(false, "panels need an x86-64 CPU (AVX2 or AVX-512 VNNI)");
#endif
}

// [N, K] float32: the weights exactly as gguf-py's dequantize gives them.
torch::Tensor dequantize(const torch::Tensor& blocks, int64_t qtype, int64_t k, int64_t isa) {
  isa = float_isa(isa);
  check_blocks(blocks, qtype, k);
  const int64_t n = blocks.size(0), nb = k / kBlock, bpr = blocks.size(1);
  auto out = torch::empty({n, k}, torch::kFloat32);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) dequant_row(src + r * bpr, nb, qtype, dst + r * k, isa);
  });
  return out;
}

// y[M, N] = x[M, K] @ W.T (+ bias), W in blocks. Meant for small M (decode); the caller sends
// large M through `dequantize` and a float GEMM.
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& blocks, int64_t qtype,
                           int64_t isa, const c10::optional<torch::Tensor>& bias) {
  isa = float_isa(isa);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  const auto xc = x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1);
  check_blocks(blocks, qtype, k);
  const int64_t n = blocks.size(0), nb = k / kBlock, bpr = blocks.size(1);
  auto y = torch::empty({m, n}, torch::kFloat32);
  const float* xp = xc.data_ptr<float>();
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const float* bp = nullptr;
  torch::Tensor bc;
  if (bias.has_value()) {
    bc = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bc.numel() == n, "bias must have out_features elements");
    bp = bc.data_ptr<float>();
  }
#ifdef PDS_X86
  if (m == 1 && qtype == kQ8_0 && isa == kAvx512) {
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      gemv_rows(
          begin, end, [&](int64_t r) { gemv_q8_0_avx512<kRows>(src + r * bpr, bpr, nb, xp, yp + r); },
          [&](int64_t r) { gemv_q8_0_avx512<1>(src + r * bpr, bpr, nb, xp, yp + r); });
      for (int64_t r = begin; r < end; ++r) yp[r] += bp ? bp[r] : 0.f;
    });
    return y;
  }
  if (m == 1 && isa == kAvx512) {  // Q4_0, Q4_1
    std::vector<float> xsum(nb);
    for (int64_t b = 0; b < nb; ++b) {
      float s = 0.f;
      for (int64_t j = 0; j < kBlock; ++j) s += xp[b * kBlock + j];
      xsum[b] = s;
    }
    const float* xs = xsum.data();
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      gemv_rows(
          begin, end,
          [&](int64_t r) { gemv_q4_avx512<kRows>(src + r * bpr, bpr, nb, qtype, xp, xs, yp + r); },
          [&](int64_t r) { gemv_q4_avx512<1>(src + r * bpr, bpr, nb, qtype, xp, xs, yp + r); });
      for (int64_t r = begin; r < end; ++r) yp[r] += bp ? bp[r] : 0.f;
    });
    return y;
  }
  if (isa == kAvx512) {  // small batches: four weight rows at a time against four of x
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      std::vector<float> w(4 * k);
      for (int64_t r = begin; r < end; r += 4) {
        const int64_t rows = std::min<int64_t>(4, end - r);
        for (int64_t j = 0; j < rows; ++j)  // prefetching the next four rows
          dequant_row_avx512(src + (r + j) * bpr, nb, qtype, w.data() + j * k, 4 * bpr);
        for (int64_t i = 0; i < m; i += 4) {
          if (rows == 4 && i + 4 <= m) {
            tile_4x4_avx512(w.data(), xp + i * k, k, yp + i * n + r, n);
            continue;
          }
          for (int64_t a = i; a < std::min<int64_t>(i + 4, m); ++a)
            for (int64_t j = 0; j < rows; ++j)
              yp[a * n + r + j] = dot(w.data() + j * k, xp + a * k, k, isa);
        }
        if (bp)
          for (int64_t a = 0; a < m; ++a)
            for (int64_t j = 0; j < rows; ++j) yp[a * n + r + j] += bp[r + j];
      }
    });
    return y;
  }
#endif
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> w(k);
    for (int64_t r = begin; r < end; ++r) {
      dequant_row(src + r * bpr, nb, qtype, w.data(), isa);
      const float b = bp ? bp[r] : 0.f;
      for (int64_t i = 0; i < m; ++i) yp[i * n + r] = dot(w.data(), xp + i * k, k, isa) + b;
    }
  });
  return y;
}

// Every op releases the GIL while it runs, as cpu_ops.cpp's and torch's own do: a worker's
// event loop (streaming, gRPC, heartbeats) runs in another thread of the same process, and a
// prefill chunk's GEMM holding the GIL stalled it for the whole call.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  using release = py::call_guard<py::gil_scoped_release>;
  mod.def("dequantize", &dequantize, "GGUF blocks -> float32 weights", release());
  mod.def("quant_linear", &quant_linear, "x @ W.T (+ bias) with W in GGUF blocks", release());
  mod.def("repack_panels", &repack_panels, "GGUF blocks -> 16-row panels for quant_linear_panels",
          release());
  mod.def("panels_to_blocks", &panels_to_blocks, "16-row panels -> the GGUF blocks they hold",
          release());
#ifdef PDS_X86
  mod.def("panels_to_bf16", &panels_to_bf16, "16-row panels -> bf16 weights [n, k]", release());
  mod.def("amx_rows", [] { return kAmxRows; }, "avx512vnni_amx: rows from which the AMX path runs");
#endif
  mod.def("quant_linear_panels", &quant_linear_panels,
          "x @ W.T (+ bias) with W in panels, int8 activations (AVX-512 VNNI)", release());
  // quant_linear_panels for cpu_ops.cpp's DecodeStack, which calls it from C++: the name
  // states the signature (cpu_ops.cpp's QuantFn) and is checked there.
  mod.def("linear_panels_capsule", [] {
    using Fn = torch::Tensor (*)(const torch::Tensor&, const torch::Tensor&, int64_t, int64_t,
                                 int64_t, const c10::optional<torch::Tensor>&);
    const Fn fn = &quant_linear_panels;
    return py::capsule(reinterpret_cast<void*>(fn), "pdserve.quant_linear_panels");
  });
}
