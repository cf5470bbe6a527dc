// Fused float32 CPU kernels for the decode path (see engine/kernels/__init__.py).
//
// Each replaces a run of small ATen ops whose dispatch cost, not arithmetic, dominated a
// decode step. The arithmetic is the reference's, op for op: no FMA contraction (the build
// passes -ffp-contract=off), the same rsqrt-then-multiply order as transformers' RMSNorm, and
// rotate-half RoPE; only summation orders differ (as between any two GEMM libraries).
#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <ATen/Parallel.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

#include <unistd.h>

namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // independent lanes: vectorizes without -ffast-math
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Every context length fits its table and every block id it reaches is in the pool (a
// decode attention reads the pool through them); returns the longest context.
int64_t check_tables(const int64_t* tp, const int64_t* lp, int64_t b, int64_t max_blocks,
                     int64_t bs, int64_t num_blocks) {
  int64_t longest = 0;
  for (int64_t s = 0; s < b; ++s) {
    TORCH_CHECK(lp[s] >= 1 && lp[s] <= max_blocks * bs, "context length out of range");
    for (int64_t j = 0; j < (lp[s] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[s * max_blocks + j] >= 0 && tp[s * max_blocks + j] < num_blocks,
                  "block id out of range");
    longest = std::max(longest, lp[s]);
  }
  return longest;
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.device().is_cpu(), name,
              " must be a float32 CPU tensor");
}

}  // namespace

// out = weight * (x * rsqrt(mean(x^2) + eps)), row by row. x: [n, d] rows contiguous.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [n, d] with contiguous rows");
  const int64_t n = x.size(0), d = x.size(1), sx = x.stride(0);
  auto out = torch::empty({n, d}, x.options());
  auto w = weight.contiguous();
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* r = xp + i * sx;
      const float r_inv = 1.0f / std::sqrt(dot(r, r, d) / static_cast<float>(d) +
                                           static_cast<float>(eps));
      float* o = op + i * d;
      for (int64_t j = 0; j < d; ++j) o[j] = wp[j] * (r[j] * r_inv);
    }
  });
  return out;
}

// residual += delta (in place), then returns rms_norm(residual). Both [n, d] contiguous.
torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight,
                            double eps) {
  check_f32(residual, "residual");
  check_f32(delta, "delta");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == delta.sizes(),
              "residual must be contiguous and shaped like delta");
  auto dc = delta.contiguous();
  const int64_t n = residual.size(0), d = residual.size(1);
  float* rp = residual.data_ptr<float>();
  const float* dp = dc.data_ptr<float>();
  at::parallel_for(0, n * d, 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) rp[i] += dp[i];
  });
  return rms_norm(residual, weight, eps);
}

// Rotate-half RoPE in place on the first `heads` heads of x: [n, >=heads, hd] (rows strided,
// heads and head_dim contiguous). cos/sin: [n, hd] contiguous.
void rope_(torch::Tensor x, int64_t heads, torch::Tensor cos, torch::Tensor sin) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be [n, heads, head_dim] with contiguous heads");
  const int64_t n = x.size(0), hd = x.size(2), half = hd / 2, sx = x.stride(0);
  auto c = cos.contiguous(), s = sin.contiguous();
  float* xp = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  at::parallel_for(0, n * heads, 64, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t i = t / heads, h = t % heads;
      float* v = xp + i * sx + h * hd;
      const float* ci = cp + i * hd;
      const float* si = sp + i * hd;
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = v[j], x2 = v[j + half];
        const float a = x1 * ci[j], b2 = x2 * si[j];
        const float a2 = x2 * ci[j + half], b1 = x1 * si[j + half];
        v[j] = a + (-b2);
        v[j + half] = a2 + b1;
      }
    }
  });
}

// Store new K and V rows into the paged layer view kv: [blocks, 2, block_size, kv_heads, hd]
// (any strides on the first three dims; kv_heads x hd contiguous). k, v: [n, kv_heads, hd].
void write_kv(torch::Tensor kv, torch::Tensor k, torch::Tensor v, torch::Tensor slot_blocks,
              torch::Tensor slot_offsets) {
  check_f32(kv, "kv");
  TORCH_CHECK(kv.stride(4) == 1 && kv.stride(3) == kv.size(4), "kv heads must be contiguous");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
                  v.stride(1) == v.size(2), "k/v heads must be contiguous");
  auto blocks = slot_blocks.to(torch::kLong).contiguous();
  auto offs = slot_offsets.to(torch::kLong).contiguous();
  const int64_t n = k.size(0), row = k.size(1) * k.size(2);
  const int64_t sb = kv.stride(0), skv = kv.stride(1), so = kv.stride(2);
  float* kvp = kv.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t* ofp = offs.data_ptr<int64_t>();
  const int64_t num_blocks = kv.size(0), bs = kv.size(2);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(bp[i] >= 0 && bp[i] < num_blocks && ofp[i] >= 0 && ofp[i] < bs,
                "slot out of range");
  at::parallel_for(0, n, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float* dst = kvp + bp[i] * sb + ofp[i] * so;
      std::copy_n(kp + i * k.stride(0), row, dst);
      std::copy_n(vp + i * v.stride(0), row, dst + skv);
    }
  });
}

// One query token per sequence attending over its context, read in place from the paged
// layer view kv (as in write_kv). q: [b, heads, hd] (heads x hd contiguous); tables:
// [b, max_blocks] int64; lens: [b]. GQA: query head h reads kv head h / (heads / kv_heads).
// The scalar version, for head dims that are not a multiple of 16 (paged_decode_attention
// below takes the rest).
torch::Tensor paged_decode_attention_scalar(torch::Tensor q, torch::Tensor kv, torch::Tensor tables,
                                     torch::Tensor lens, double scale) {
  check_f32(q, "q");
  check_f32(kv, "kv");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q heads must be contiguous");
  TORCH_CHECK(kv.stride(4) == 1 && kv.stride(3) == kv.size(4), "kv heads must be contiguous");
  auto tab = tables.to(torch::kLong).contiguous();
  auto len = lens.to(torch::kLong).contiguous();
  const int64_t b = q.size(0), heads = q.size(1), hd = q.size(2);
  const int64_t kvh = kv.size(3), group = heads / kvh, bs = kv.size(2);
  const int64_t max_blocks = tab.size(1), num_blocks = kv.size(0);
  const int64_t sb = kv.stride(0), skv = kv.stride(1), so = kv.stride(2), sq = q.stride(0);
  auto out = torch::empty({b, heads, hd}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kvp = kv.data_ptr<float>();
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t* lp = len.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  check_tables(tp, lp, b, max_blocks, bs, num_blocks);
  const float sc = static_cast<float>(scale);
  // One task per (sequence, kv head): its `group` query heads share every K/V row read.
  at::parallel_for(0, b * kvh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = t / kvh, g = t % kvh, n = lp[s];
      const int64_t* table = tp + s * max_blocks;
      scores.assign(group * n, 0.0f);
      acc.assign(group * hd, 0.0f);
      for (int64_t p = 0; p < n; ++p) {
        const float* krow = kvp + table[p / bs] * sb + (p % bs) * so + g * hd;
        for (int64_t r = 0; r < group; ++r)
          scores[r * n + p] = dot(qp + s * sq + (g * group + r) * hd, krow, hd) * sc;
      }
      for (int64_t r = 0; r < group; ++r) {
        float* sr = scores.data() + r * n;
        const float mx = *std::max_element(sr, sr + n);
        float sum = 0.0f;
        for (int64_t p = 0; p < n; ++p) {
          sr[p] = std::exp(sr[p] - mx);
          sum += sr[p];
        }
        const float inv = 1.0f / sum;
        for (int64_t p = 0; p < n; ++p) sr[p] *= inv;
      }
      for (int64_t p = 0; p < n; ++p) {
        const float* vrow = kvp + table[p / bs] * sb + skv + (p % bs) * so + g * hd;
        for (int64_t r = 0; r < group; ++r) {
          const float w = scores[r * n + p];
          float* a = acc.data() + r * hd;
          for (int64_t j = 0; j < hd; ++j) a[j] += w * vrow[j];
        }
      }
      for (int64_t r = 0; r < group; ++r)
        std::copy_n(acc.data() + r * hd, hd, op + s * heads * hd + (g * group + r) * hd);
    }
  });
  return out;
}

// ---- Decode attention at memory speed -------------------------------------------------------
// 16-float vectors: one AVX-512 register (GCC/Clang vector extensions), or, on builds without
// AVX-512, a pair of 8-float halves (two AVX2 registers). GCC has no 16-float register there:
// it splits a plain 16-float vector's arithmetic into halves but keeps the vector in memory
// between statements and lowers its compares and shuffles one lane at a time, and an AVX2
// build ran this attention at a tenth of the read bandwidth (3 GB/s of 30). Every operation on
// the halves is the 16-wide one lane by lane, in the same order, so both builds give the same
// bits (hsum and hsum16 add in the same order too).
namespace {
template <typename F>
inline F vsplat(float x) { return F{} + x; }
template <typename F>
inline F vmax_t(F a, F b) { return a > b ? a : b; }
template <typename F>
inline F vmin_t(F a, F b) { return a < b ? a : b; }

#if defined(__AVX512F__)
typedef float vf __attribute__((vector_size(64)));
typedef float vfu __attribute__((vector_size(64), aligned(4)));  // unaligned loads and stores
typedef int32_t vi __attribute__((vector_size(64)));
inline vf load(const float* p) { return *reinterpret_cast<const vfu*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vfu*>(p) = v; }
inline vf splat(float x) { return vsplat<vf>(x); }
#else
typedef float vh __attribute__((vector_size(32)));
typedef float vhu __attribute__((vector_size(32), aligned(4)));
typedef int32_t vhi __attribute__((vector_size(32)));
struct vf {
  vh lo, hi;  // lanes 0-7, 8-15
  float operator[](int64_t i) const { return i < 8 ? lo[i] : hi[i - 8]; }
};
inline vf operator+(vf a, vf b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline vf operator-(vf a, vf b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline vf operator*(vf a, vf b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline vf operator/(vf a, vf b) { return {a.lo / b.lo, a.hi / b.hi}; }
inline vf operator-(vf a) { return {-a.lo, -a.hi}; }
inline vf load(const float* p) {
  return {*reinterpret_cast<const vhu*>(p), *reinterpret_cast<const vhu*>(p + 8)};
}
inline void store(float* p, vf v) {
  *reinterpret_cast<vhu*>(p) = v.lo;
  *reinterpret_cast<vhu*>(p + 8) = v.hi;
}
inline vf splat(float x) { return {vsplat<vh>(x), vsplat<vh>(x)}; }
#endif
constexpr int64_t VL = 16;

// e^x for x <= 88 (softmax after subtracting the max; silu), Cephes' single-precision polynomial
// with a Cody-Waite split of ln 2: within 2 ulp of expf. I: F's lanes as int32.
template <typename F, typename I>
inline F vexp_t(F x) {
  x = vmax_t(x, vsplat<F>(-87.33654f));
  F fx = x * vsplat<F>(1.44269504088896341f);
  F t = __builtin_convertvector(__builtin_convertvector(fx, I), F);  // toward zero
  fx = t - ((t > fx) ? vsplat<F>(1.0f) : vsplat<F>(0.0f));  // floor
  fx = ((x * vsplat<F>(1.44269504088896341f) - fx) >= vsplat<F>(0.5f)) ? fx + vsplat<F>(1.0f) : fx;
  x = x - fx * vsplat<F>(0.693359375f);
  x = x - fx * vsplat<F>(-2.12194440e-4f);
  F y = vsplat<F>(1.9875691500e-4f);
  y = y * x + vsplat<F>(1.3981999507e-3f);
  y = y * x + vsplat<F>(8.3334519073e-3f);
  y = y * x + vsplat<F>(4.1665795894e-2f);
  y = y * x + vsplat<F>(1.6666665459e-1f);
  y = y * x + vsplat<F>(5.0000001201e-1f);
  y = y * (x * x) + x + vsplat<F>(1.0f);
  const I n = __builtin_convertvector(fx, I);
  const I bits = (n + 127) << 23;
  F pow2;
  __builtin_memcpy(&pow2, &bits, sizeof pow2);
  return y * pow2;
}

#if defined(__AVX512F__)
inline float hsum(vf v) {
  const vi h8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
  const vi h4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
  const vi h2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
  const vi h1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
  v = v + __builtin_shuffle(v, h8);
  v = v + __builtin_shuffle(v, h4);
  v = v + __builtin_shuffle(v, h2);
  v = v + __builtin_shuffle(v, h1);
  return v[0];
}

inline vf vmax(vf a, vf b) { return vmax_t(a, b); }
inline vf vmin(vf a, vf b) { return vmin_t(a, b); }
inline vf vexp(vf x) { return vexp_t<vf, vi>(x); }

// The sums of 16 vectors' lanes, as one vector: lane t = hsum(part[t]), added in hsum's order
// (lanes i and i+8, then i+4, i+2, i+1), so a score is the same bits either way; 30 shuffles
// and 15 adds for 16 sums where hsum takes 64 and 64.
inline vf hsum16(const vf* part) {
  const vi lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vi lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vi hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const vi lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const vi hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const vi even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const vi odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  vf a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shuffle(part[2 * i], part[2 * i + 1], lo8) +
           __builtin_shuffle(part[2 * i], part[2 * i + 1], hi8);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo4) +
           __builtin_shuffle(a[2 * i], a[2 * i + 1], hi4);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) +
           __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
  return __builtin_shuffle(c[0], c[1], even) + __builtin_shuffle(c[0], c[1], odd);
}
#else
inline vf vmax(vf a, vf b) { return {vmax_t(a.lo, b.lo), vmax_t(a.hi, b.hi)}; }
inline vf vmin(vf a, vf b) { return {vmin_t(a.lo, b.lo), vmin_t(a.hi, b.hi)}; }
inline vf vexp(vf x) { return {vexp_t<vh, vhi>(x.lo), vexp_t<vh, vhi>(x.hi)}; }

// hsum's order on halves: lane i of lo + hi is lane i + lane i+8 of the vf, then i+4, i+2, i+1.
inline float hsum(vf v) {
  vh s = v.lo + v.hi;
  s = s + __builtin_shuffle(s, vhi{4, 5, 6, 7, 0, 1, 2, 3});
  s = s + __builtin_shuffle(s, vhi{2, 3, 0, 1, 6, 7, 4, 5});
  s = s + __builtin_shuffle(s, vhi{1, 0, 3, 2, 5, 4, 7, 6});
  return s[0];
}

// hsum16 on halves, each lane summed in the same order (so the same bits): each vector's two
// halves added, then pairs of 8-float vectors folded by 4, 2 and 1 lanes as hsum16 does.
inline vf hsum16(const vf* part) {
  vh s[16], a[8], b[4], c[2];
  for (int t = 0; t < 16; ++t) s[t] = part[t].lo + part[t].hi;
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shuffle(s[2 * i], s[2 * i + 1], vhi{0, 1, 2, 3, 8, 9, 10, 11}) +
           __builtin_shuffle(s[2 * i], s[2 * i + 1], vhi{4, 5, 6, 7, 12, 13, 14, 15});
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], vhi{0, 1, 4, 5, 8, 9, 12, 13}) +
           __builtin_shuffle(a[2 * i], a[2 * i + 1], vhi{2, 3, 6, 7, 10, 11, 14, 15});
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], vhi{0, 2, 4, 6, 8, 10, 12, 14}) +
           __builtin_shuffle(b[2 * i], b[2 * i + 1], vhi{1, 3, 5, 7, 9, 11, 13, 15});
  return {c[0], c[1]};
}
#endif

// How many 16-float sums pv_heads keeps in registers: 24 of AVX-512's 32, 4 (8 halves) of
// AVX2's 16, each head's V row then read from L1 by each head (more sums spilled to the stack
// every token: at 24, 0.43 of this attention's time on a Zen 3).
#if defined(__AVX512F__)
constexpr int64_t kPvSums = 24;
#else
constexpr int64_t kPvSums = 4;
#endif

// acc[r] += sum over tokens t of w[r * ws + t] * v_t for R query heads sharing one KV head:
// v_t = rows[t] (NV vectors); the R x NV sums stay in registers while the tokens stream by.
// Per element the same products, added in token order, as one head at a time in memory.
template <int NV, int R>
void pv_heads(const float* const* rows, int64_t m, const float* w, int64_t ws, float* acc) {
  vf a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) a[r][j] = load(acc + r * NV * VL + j * VL);
  for (int64_t t = 0; t < m; ++t) {
    vf v[NV];
    for (int j = 0; j < NV; ++j) v[j] = load(rows[t] + j * VL);
    for (int r = 0; r < R; ++r) {
      const vf wr = splat(w[r * ws + t]);
      for (int j = 0; j < NV; ++j) a[r][j] = a[r][j] + wr * v[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) store(acc + r * NV * VL + j * VL, a[r][j]);
}

// The same for any head size and head count, the sums in memory.
void pv_heads_any(const float* const* rows, int64_t m, const float* w, int64_t ws, float* acc,
                  int64_t r_heads, int64_t nv) {
  for (int64_t t = 0; t < m; ++t)
    for (int64_t r = 0; r < r_heads; ++r) {
      const vf wr = splat(w[r * ws + t]);
      float* a = acc + r * nv * VL;
      for (int64_t j = 0; j < nv; ++j) store(a + j * VL, load(a + j * VL) + wr * load(rows[t] + j * VL));
    }
}

// Streams one (sequence, span) task's K and V bytes into L2 a few cache lines at a time, so a
// thread can fetch its next task's context while it computes on the current one: a decode
// batch's blocks lie scattered through the pool, and fetched only when the arithmetic reaches
// them their reads wait on memory instead of overlapping it.
struct Ahead {
  const float* kvp = nullptr;
  const int64_t* table = nullptr;
  int64_t p = 0, p1 = 0, bs = 1, sb = 0, skv = 0, so = 0;
  int64_t kind = 0, off = 0;  // K (0) or V (1) of the block holding token p; bytes done of it

  int64_t lines() const { return (p1 - p) * 2 * so * static_cast<int64_t>(sizeof(float)) / 64; }

  // Issue up to n prefetches, in order: block by block, its K rows then its V rows.
  void step(int64_t n) {
    while (n > 0 && p < p1) {
      const int64_t q1 = std::min(p1, (p / bs + 1) * bs);  // end of this block's tokens
      const char* base = reinterpret_cast<const char*>(
          kvp + table[p / bs] * sb + kind * skv + (p % bs) * so);
      const int64_t bytes = (q1 - p) * so * static_cast<int64_t>(sizeof(float));
      for (; n > 0 && off < bytes; off += 64, --n) __builtin_prefetch(base + off, 0, 2);
      if (off >= bytes) {
        off = 0;
        if (++kind == 2) kind = 0, p = q1;
      }
    }
  }
};

// The `bytes` bytes from `offset` floats past each of the first n rows, into L1: the next
// 16-token group's K or V rows while the arithmetic works on this one.
inline void prefetch_rows(const float* const* rows, int64_t n, int64_t offset, int64_t bytes) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t off = 0; off < bytes; off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows[t] + offset) + off, 0, 3);
}

// The scores of up to 16 tokens (rows[0..cnt)) for every query head, into
// scores[h * stride + t]. Token by token, each row front to back (all KV heads' K in the order
// they lie, so a block is read as one ascending stream), each KV head's K (NV vectors, NV = 0:
// `nv` at run time) loaded once for its query heads; the dot products wait in `part` (heads x
// 16) for one hsum16 per head. Lanes past cnt are zeros: summed, then unread.
template <int NV>
void scores16(const float* const* rows, int64_t cnt, const float* qs, int64_t hd, int64_t kvh,
              int64_t group, vf* part, float* scores, int64_t stride, int64_t nv = NV) {
  const int64_t heads = kvh * group;
  for (int64_t t = 0; t < VL; ++t) {
    if (t >= cnt) {
      for (int64_t h = 0; h < heads; ++h) part[h * VL + t] = vf{};
      continue;
    }
    for (int64_t g = 0; g < kvh; ++g) {
      const float* k = rows[t] + g * hd;
      if constexpr (NV > 0) {
        vf kr[NV];
        for (int j = 0; j < NV; ++j) kr[j] = load(k + j * VL);
        for (int64_t r = 0; r < group; ++r) {
          const float* qh = qs + (g * group + r) * hd;
          vf a = load(qh) * kr[0];
          for (int j = 1; j < NV; ++j) a = a + load(qh + j * VL) * kr[j];
          part[(g * group + r) * VL + t] = a;
        }
      } else {
        for (int64_t r = 0; r < group; ++r) {
          const float* qh = qs + (g * group + r) * hd;
          vf a = load(qh) * load(k);
          for (int64_t j = 1; j < nv; ++j) a = a + load(qh + j * VL) * load(k + j * VL);
          part[(g * group + r) * VL + t] = a;
        }
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) store(scores + h * stride, hsum16(part + h * VL));
}

// R heads (1 <= R <= 24 / nv) through the register version where one is instantiated.
void pv_dispatch(const float* const* rows, int64_t m, const float* w, int64_t ws, float* acc,
                 int64_t r_heads, int64_t nv) {
#define PV_CASE(NV_, R_) \
  if (nv == NV_ && r_heads == R_) return pv_heads<NV_, R_>(rows, m, w, ws, acc);
  PV_CASE(4, 1) PV_CASE(4, 2) PV_CASE(4, 3) PV_CASE(4, 4) PV_CASE(4, 5) PV_CASE(4, 6)
  PV_CASE(8, 1) PV_CASE(8, 2) PV_CASE(8, 3)
#undef PV_CASE
  pv_heads_any(rows, m, w, ws, acc, r_heads, nv);
}
}  // namespace

// silu(gate) * up for gu = [gate | up] of shape [n, 2h] (rows contiguous): returns [n, h].
// 16 lanes at a time with vexp (within 2 ulp of expf; its argument clamped to where expf is
// finite, so a gate below -88 gives -0 * up as torch's does), the tail of a row scalar.
torch::Tensor silu_mul(torch::Tensor gu) {
  check_f32(gu, "gate_up");
  TORCH_CHECK(gu.dim() == 2 && gu.stride(1) == 1, "gate_up must be [n, 2h]");
  const int64_t n = gu.size(0), h = gu.size(1) / 2, sg = gu.stride(0);
  auto out = torch::empty({n, h}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t chunks = (h + 255) / 256;  // 256 outputs per task
  at::parallel_for(0, n * chunks, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t i = t / chunks, j0 = (t % chunks) * 256, j1 = std::min(h, j0 + 256);
      const float* g = gp + i * sg;
      const float* u = g + h;
      float* o = op + i * h;
      int64_t j = j0;
      for (; j + VL <= j1; j += VL) {
        const vf gv = load(g + j);
        const vf ex = vexp(vmin(-gv, splat(88.0f)));
        store(o + j, (gv / (splat(1.0f) + ex)) * load(u + j));
      }
      for (; j < j1; ++j) o[j] = (g[j] / (1.0f + std::exp(-g[j]))) * u[j];
    }
  });
  return out;
}

// One query token per sequence attending over its context (as paged_decode_attention_scalar
// above), for head_dim a multiple of 16; other head dims go to the scalar version. One task per (sequence, span of
// its context) covering every KV head, so each task reads whole token rows of the block
// (all heads' K, then all heads' V) front to back; long contexts are split into spans
// (flash-decoding) so that even one sequence keeps every thread busy, and the spans' partial
// softmaxes are merged at the end. Scores, exp and the V sums are 16-wide vector code. With
// `prefetch`, while a thread computes one task it asks for the next task's K and V (Ahead), and
// for the next 16 tokens' rows: the same arithmetic, the same bits. Whether that pays depends
// on the machine (0.72x the time on a Zen 4, 1.1-1.2x on a Cascade Lake Xeon, whose software
// prefetches take the fill buffers its demand loads need), so the engine measures it once per
// machine (kernels/__init__.py, attention_prefetch).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor tables,
                                     torch::Tensor lens, double scale, bool prefetch) {
  check_f32(q, "q");
  check_f32(kv, "kv");
  if (q.size(2) % VL != 0) return paged_decode_attention_scalar(q, kv, tables, lens, scale);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q heads must be contiguous");
  TORCH_CHECK(kv.stride(4) == 1 && kv.stride(3) == kv.size(4), "kv heads must be contiguous");
  auto tab = tables.to(torch::kLong).contiguous();
  auto len = lens.to(torch::kLong).contiguous();
  const int64_t b = q.size(0), heads = q.size(1), hd = q.size(2);
  const int64_t kvh = kv.size(3), group = heads / kvh, bs = kv.size(2);
  TORCH_CHECK(heads % kvh == 0, "query heads must be a multiple of the KV heads");
  const int64_t max_blocks = tab.size(1), num_blocks = kv.size(0);
  const int64_t sb = kv.stride(0), skv = kv.stride(1), so = kv.stride(2), sq = q.stride(0);
  auto out = torch::empty({b, heads, hd}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kvp = kv.data_ptr<float>();
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t* lp = len.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t longest = check_tables(tp, lp, b, max_blocks, bs, num_blocks);
  // Spans: whole blocks, at most kMaxSpan tokens, and enough of them for 4 tasks per thread.
  constexpr int64_t kMaxSpan = 512, kMinSpan = 64;
  const int64_t threads = at::get_num_threads();
  int64_t span = kMaxSpan;
  while (span > kMinSpan && b * ((longest + span - 1) / span) < 4 * threads) span /= 2;
  span = std::max(bs, span / bs * bs);
  const int64_t spans = (longest + span - 1) / span;
  // Partial results of every (sequence, span, head): max, sum, unnormalized output.
  std::vector<float> part_m(b * spans * heads), part_l(b * spans * heads);
  std::vector<float> part_o(spans > 1 ? b * spans * heads * hd : 0);
  const vf sc = splat(static_cast<float>(scale));
  const int64_t nv = hd / VL;
  const int64_t row_bytes = kvh * hd * static_cast<int64_t>(sizeof(float));  // one token's K or V
  at::parallel_for(0, b * spans, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(heads * (span + VL));
    std::vector<float> acc(heads * hd);
    std::vector<const float*> rows(span);
    std::vector<vf> part(heads * VL);  // a dot product per (query head, token of the 16)
    auto ahead_of = [&](int64_t t) {  // the task's bytes, for Ahead
      Ahead a;
      if (t >= end) return a;
      const int64_t s = t / spans, c = t % spans;
      a.kvp = kvp, a.table = tp + s * max_blocks, a.bs = bs, a.sb = sb, a.skv = skv, a.so = so;
      a.p = c * span, a.p1 = std::max(a.p, std::min(lp[s], a.p + span));
      return a;
    };
    if (prefetch) ahead_of(begin).step(INT64_MAX);  // the first task has nothing to hide behind
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = t / spans, c = t % spans, n = lp[s];
      const int64_t p0 = c * span, p1 = std::min(n, p0 + span);
      Ahead next = prefetch ? ahead_of(t + 1) : Ahead{};
      float* pm = part_m.data() + (s * spans + c) * heads;
      float* pl = part_l.data() + (s * spans + c) * heads;
      if (p0 >= p1) {  // this sequence is shorter than the span: nothing here
        for (int64_t h = 0; h < heads; ++h) pm[h] = -INFINITY, pl[h] = 0.0f;
        continue;
      }
      const int64_t m = p1 - p0, stride = span + VL;
      const int64_t* table = tp + s * max_blocks;
      const float* qs = qp + s * sq;
      for (int64_t p = p0; p < p1;) {  // block by block: one division a block, not a token
        const int64_t blk = p / bs, end_p = std::min(p1, (blk + 1) * bs);
        const float* row = kvp + table[blk] * sb + (p - blk * bs) * so;
        for (; p < end_p; ++p, row += so) rows[p - p0] = row;
      }
      // Scores 16 tokens at a time: the tokens' K rows stay in L1 for every head, and one
      // hsum16 finishes 16 dot products. Meanwhile the next 16 tokens' rows are asked for, and
      // a share of the next task's lines (spread over this task's groups, scores then V sums).
      const int64_t per_group = (next.lines() + 2 * ((m + VL - 1) / VL) - 1) /
                                std::max<int64_t>(1, 2 * ((m + VL - 1) / VL));
      for (int64_t t0 = 0; t0 < m; t0 += VL) {
        next.step(per_group);
        if (prefetch && t0 + VL < m)
          prefetch_rows(rows.data() + t0 + VL, std::min(VL, m - t0 - VL), 0, row_bytes);
        const int64_t cnt = std::min(VL, m - t0);
        const float* const* r16 = rows.data() + t0;
        float* s16 = scores.data() + t0;
        if (nv == 4)
          scores16<4>(r16, cnt, qs, hd, kvh, group, part.data(), s16, stride);
        else if (nv == 8)
          scores16<8>(r16, cnt, qs, hd, kvh, group, part.data(), s16, stride);
        else
          scores16<0>(r16, cnt, qs, hd, kvh, group, part.data(), s16, stride, nv);
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* sr = scores.data() + h * stride;
        vf mv = splat(-INFINITY);
        int64_t i = 0;
        for (; i + VL <= m; i += VL) mv = vmax(mv, load(sr + i));
        float mx = -INFINITY;
        for (int64_t l = 0; l < VL; ++l) mx = std::max(mx, mv[l]);
        for (; i < m; ++i) mx = std::max(mx, sr[i]);
        const vf mxv = splat(mx);
        vf sumv = {};
        for (i = 0; i + VL <= m; i += VL) {
          const vf e = vexp((load(sr + i) - mxv) * sc);
          store(sr + i, e);
          sumv = sumv + e;
        }
        float sum = hsum(sumv);
        if (i < m) {  // the tail, padded: lanes past m are dropped
          const vf e = vexp((load(sr + i) - mxv) * sc);
          for (int64_t l = 0; i + l < m; ++l) sr[i + l] = e[l], sum += e[l];
        }
        pm[h] = mx * static_cast<float>(scale);
        pl[h] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      // Weighted V sums 16 tokens at a time (their V rows stay in L1 for every head), a few
      // query heads' sums in registers at a time.
      const int64_t rmax = std::max<int64_t>(1, kPvSums / nv);
      for (int64_t t0 = 0; t0 < m; t0 += VL) {
        const int64_t cnt = std::min(VL, m - t0);
        next.step(per_group);
        if (prefetch && t0 + VL < m)
          prefetch_rows(rows.data() + t0 + VL, std::min(VL, m - t0 - VL), skv, row_bytes);
        for (int64_t g = 0; g < kvh; ++g) {
          const float* vrows[VL];
          for (int64_t t = 0; t < cnt; ++t) vrows[t] = rows[t0 + t] + skv + g * hd;
          for (int64_t r0 = 0; r0 < group; r0 += rmax) {
            const int64_t h = g * group + r0;
            pv_dispatch(vrows, cnt, scores.data() + h * stride + t0, stride,
                        acc.data() + h * hd, std::min(rmax, group - r0), nv);
          }
        }
      }
      if (spans == 1) {
        for (int64_t h = 0; h < heads; ++h) {
          const vf inv = splat(1.0f / pl[h]);
          for (int64_t j = 0; j < nv; ++j)
            store(op + s * heads * hd + h * hd + j * VL, load(acc.data() + h * hd + j * VL) * inv);
        }
      } else {
        std::copy(acc.begin(), acc.end(), part_o.begin() + (s * spans + c) * heads * hd);
      }
    }
  });
  if (spans > 1) {  // merge each sequence's spans: rescale by e^(m_c - m), sum, normalize
    at::parallel_for(0, b * heads, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t s = t / heads, h = t % heads;
        float mx = -INFINITY;
        for (int64_t c = 0; c < spans; ++c) mx = std::max(mx, part_m[(s * spans + c) * heads + h]);
        float* o = op + s * heads * hd + h * hd;
        std::fill(o, o + hd, 0.0f);
        float total = 0.0f;
        for (int64_t c = 0; c < spans; ++c) {
          const int64_t i = (s * spans + c) * heads + h;
          if (part_l[i] == 0.0f) continue;
          const float w = std::exp(part_m[i] - mx);
          total += w * part_l[i];
          const float* po = part_o.data() + i * hd;
          for (int64_t j = 0; j < hd; ++j) o[j] += w * po[j];
        }
        const float inv = 1.0f / total;
        for (int64_t j = 0; j < hd; ++j) o[j] *= inv;
      }
    });
  }
  return out;
}

// ---- float32 linear layers over weight panels -----------------------------------------------
// y = x @ W.T (+ b) for x [m, k], W [n, k], with W repacked once at load into panels of PW
// output rows: panel p holds W[p*PW + j, kk] at [p][kk][j] (rows past n are zero). A panel row
// is PNV vector registers; the micro-kernel keeps up to PMB rows of x times one panel in
// PMB*PNV accumulators, broadcasting x[i, kk] against the panel's row kk (one fused
// multiply-add per weight vector and x row). Each weight is read from memory once per call:
// panels are split among threads, and every x row of the call passes over a panel while it is
// in cache. At decode's batches (1-16 rows) oneDNN's prepacked fp32 GEMM read the weights at
// half the memory's speed or less; this streams them (bench.linear_kernels). Each output's sum
// over k runs in order in one accumulator.
namespace {
#if defined(__AVX512F__)
typedef __m512 pv;
constexpr int PV = 16, PNV = 2, PMB = 8;
inline pv pv_load(const float* p) { return _mm512_loadu_ps(p); }
inline void pv_store(float* p, pv v) { _mm512_storeu_ps(p, v); }
inline pv pv_fma(pv a, pv b, pv c) { return _mm512_fmadd_ps(a, b, c); }
inline pv pv_splat(float x) { return _mm512_set1_ps(x); }
inline pv pv_zero() { return _mm512_setzero_ps(); }
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 pv;
constexpr int PV = 8, PNV = 2, PMB = 6;
inline pv pv_load(const float* p) { return _mm256_loadu_ps(p); }
inline void pv_store(float* p, pv v) { _mm256_storeu_ps(p, v); }
inline pv pv_fma(pv a, pv b, pv c) { return _mm256_fmadd_ps(a, b, c); }
inline pv pv_splat(float x) { return _mm256_set1_ps(x); }
inline pv pv_zero() { return _mm256_setzero_ps(); }
#else
struct pv { float v[8]; };
constexpr int PV = 8, PNV = 2, PMB = 4;
inline pv pv_load(const float* p) { pv r; std::copy_n(p, 8, r.v); return r; }
inline void pv_store(float* p, pv v) { std::copy_n(v.v, 8, p); }
inline pv pv_fma(pv a, pv b, pv c) {
  for (int i = 0; i < 8; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline pv pv_splat(float x) { pv r; std::fill_n(r.v, 8, x); return r; }
inline pv pv_zero() { return pv_splat(0.0f); }
#endif
constexpr int64_t PW = PV * PNV;  // output rows per panel

// out[i, 0:PW] = x[i, :] . panel for MB rows i; `out` rows are PW floats apart in `tmp`
// when the panel is the ragged last one, else the output's own rows.
template <int MB>
inline void panel_tile(const float* x, int64_t sx, const float* panel, int64_t k, float* out,
                       int64_t so) {
  pv acc[MB][PNV];
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < PNV; ++v) acc[i][v] = pv_zero();
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* w = panel + kk * PW;
    pv wv[PNV];
    for (int v = 0; v < PNV; ++v) wv[v] = pv_load(w + v * PV);
    for (int i = 0; i < MB; ++i) {
      const pv xb = pv_splat(x[i * sx + kk]);
      for (int v = 0; v < PNV; ++v) acc[i][v] = pv_fma(xb, wv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int v = 0; v < PNV; ++v) pv_store(out + i * so + v * PV, acc[i][v]);
}

template <int MB>
void panel_rows(const float* x, int64_t sx, const float* panel, int64_t k, float* out,
                int64_t so, int64_t rows) {
  if constexpr (MB > 1) {
    if (rows < MB) return panel_rows<MB - 1>(x, sx, panel, k, out, so, rows);
  }
  panel_tile<MB>(x, sx, panel, k, out, so);
}

// Batches whose x outgrows half of L2: the same tiles over blocks of rows of x that fit
// there, each block passing over all of the thread's panels before the next. In one pass over
// all rows per panel, every panel re-reads all of x, from L3 once x is past L2: 1.1-1.2x the
// time from ~1,000 rows of 576 up (several prompts' chunks in one step). Below that, one
// pass is better: the blocks would read the weights once per block instead of once. Rows go
// 12 at a time on AVX-512 (24 of the 32 vector registers accumulate). A row's sums are the
// one-pass path's (each over k in order in one accumulator): the bits do not depend on the
// batch or on the machine's cache size.
constexpr int BMB = PMB == 8 ? 12 : PMB;
// The most dequantized panels one thread keeps for a call of the blocked path (bytes).
constexpr int64_t KEEP_MAX = int64_t{8} << 20;

int64_t l2_bytes() {
  static const int64_t bytes = [] {
    const long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return v > 0 ? static_cast<int64_t>(v) : int64_t{1} << 20;
  }();
  return bytes;
}

// The panel GEMM for both weight formats: `panel(p, buf)` gives panel p's float32 weights,
// the fp32 panels themselves or the int8 ones dequantized into `buf` (k * PW floats of the
// calling thread's). Both paths ask for each panel once per call.
template <typename PanelFn>
torch::Tensor panel_gemm(const torch::Tensor& x, int64_t n, int64_t np, int64_t k,
                         const c10::optional<torch::Tensor>& bias, bool buffered,
                         PanelFn panel) {
  const int64_t m = x.size(0), sx = x.stride(0);
  auto out = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  torch::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bc = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(bc.numel() == n, "bias must have n elements");
    bp = bc.data_ptr<float>();
  }
  const int64_t fits = l2_bytes() / 2 / (k * static_cast<int64_t>(sizeof(float)));  // rows
  if (m > fits && n % PW == 0) {  // (a ragged last panel takes the one-pass path)
    const int64_t block_rows = std::max<int64_t>(BMB, fits / BMB * BMB);
    at::parallel_for(0, np, 1, [&](int64_t b, int64_t e) {
      // Dequantized panels are made once per call, not once per block of rows: all of the
      // thread's, into a buffer it keeps between calls (no page faults per call), read back
      // per block as the float32 panels are. A thread's share past KEEP_MAX (an int8 LM head
      // over a prompt's rows) is dequantized per block into one panel's buffer instead.
      const int64_t share = (e - b) * k * PW;
      const bool per_block =
          buffered && share * static_cast<int64_t>(sizeof(float)) > KEEP_MAX;
      thread_local std::vector<float> kept;
      if (buffered && !per_block && kept.size() < static_cast<size_t>(share))
        kept.resize(share);
      std::vector<float> buf(per_block ? k * PW : 0);
      std::vector<const float*> ws(per_block ? 0 : e - b);
      for (int64_t p = b; p < e && !per_block; ++p)
        ws[p - b] = panel(p, buffered ? kept.data() + (p - b) * k * PW : nullptr);
      for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
        const int64_t mc = std::min(block_rows, m - m0);
        for (int64_t p = b; p < e; ++p) {
          const float* w = per_block ? panel(p, buf.data()) : ws[p - b];
          for (int64_t i0 = m0; i0 < m0 + mc; i0 += BMB) {
            const int64_t rows = std::min<int64_t>(BMB, m0 + mc - i0);
            panel_rows<BMB>(xp + i0 * sx, sx, w, k, op + i0 * n + p * PW, n, rows);
          }
        }
      }
    });
    if (bp) out.add_(bc);  // after the sums, as the one-pass path adds it
    return out;
  }
  at::parallel_for(0, np, 1, [&](int64_t b, int64_t e) {
    float tmp[PMB * PW];
    std::vector<float> buf(buffered ? k * PW : 0);
    for (int64_t p = b; p < e; ++p) {
      const float* w = panel(p, buf.data());
      const int64_t c0 = p * PW, cols = std::min(PW, n - c0);
      for (int64_t i0 = 0; i0 < m; i0 += PMB) {
        const int64_t rows = std::min<int64_t>(PMB, m - i0);
        const bool whole = cols == PW;
        float* dst = whole ? op + i0 * n + c0 : tmp;
        panel_rows<PMB>(xp + i0 * sx, sx, w, k, dst, whole ? n : PW, rows);
        if (!whole)
          for (int64_t i = 0; i < rows; ++i)
            std::copy_n(tmp + i * PW, cols, op + (i0 + i) * n + c0);
        if (bp)
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t j = 0; j < cols; ++j) op[(i0 + i) * n + c0 + j] += bp[c0 + j];
      }
    }
  });
  return out;
}

void check_x(const torch::Tensor& x) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [m, k] with contiguous rows");
}
}  // namespace

int64_t panel_width() { return PW; }

// W [n, k] -> panels [ceil(n / PW), k, PW], zero past row n (float32, or int8 for the int8
// panels of panel_linear_i8).
template <typename T>
void pack_rows(const T* s, T* d, int64_t n, int64_t k, int64_t np) {
  at::parallel_for(0, np, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t j = 0; j < PW && p * PW + j < n; ++j)
        for (int64_t kk = 0; kk < k; ++kk) d[(p * k + kk) * PW + j] = s[(p * PW + j) * k + kk];
  });
}

torch::Tensor pack_panels(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu(), "w must be a CPU [n, k]");
  const int64_t n = w.size(0), k = w.size(1), np = (n + PW - 1) / PW;
  auto src = w.contiguous();
  auto panels = torch::zeros({np, k, PW}, w.options());
  if (w.scalar_type() == torch::kChar) {
    pack_rows(src.data_ptr<int8_t>(), panels.data_ptr<int8_t>(), n, k, np);
  } else {
    check_f32(w, "w");
    pack_rows(src.data_ptr<float>(), panels.data_ptr<float>(), n, k, np);
  }
  return panels;
}

static void check_panels(const torch::Tensor& x, const torch::Tensor& panels, int64_t n) {
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == PW,
              "panels must come from pack_panels");
  const int64_t np = panels.size(0);
  TORCH_CHECK(panels.size(1) == x.size(1) && n > (np - 1) * PW && n <= np * PW,
              "panels do not match x or n");
}

torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels, int64_t n,
                           c10::optional<torch::Tensor> bias) {
  check_x(x);
  check_f32(panels, "panels");
  check_panels(x, panels, n);
  const int64_t k = x.size(1);
  const float* wp = panels.data_ptr<float>();
  return panel_gemm(x, n, panels.size(0), k, bias, false,
                    [&](int64_t p, float*) { return wp + p * k * PW; });
}

// x [m, k] float32, int8 panels of n rows (pack_panels) and their per-row scales [n].
static void check_i8(const torch::Tensor& x, const torch::Tensor& panels,
                     const torch::Tensor& scales, int64_t n) {
  check_x(x);
  TORCH_CHECK(panels.scalar_type() == torch::kChar, "int8 panels must be int8");
  check_panels(x, panels, n);
  check_f32(scales, "scales");
  TORCH_CHECK(scales.dim() == 1 && scales.numel() == n, "scales must be [n]");
}

// y = x @ (q * scales[:, None]).T (+ b) for int8 panels q (pack_panels of per-output-channel
// int8 weights): each panel is dequantized into the thread's buffer (L1/L2) as the GEMM comes
// to it, never the whole matrix to memory. The same bits as panel_linear over pack_panels of
// `q.float() * scales[:, None]` (the product is the same single rounding).
torch::Tensor panel_linear_i8(torch::Tensor x, torch::Tensor panels, torch::Tensor scales,
                              int64_t n, c10::optional<torch::Tensor> bias) {
  check_i8(x, panels, scales, n);
  const int64_t k = x.size(1), np = panels.size(0);
  auto sc = scales.contiguous();
  const int8_t* qp = panels.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  return panel_gemm(x, n, np, k, bias, true, [&](int64_t p, float* buf) {
    const int8_t* q = qp + p * k * PW;
    float s[PW];  // this panel's scales, zero past n (a ragged last panel's rows are zero)
    for (int64_t j = 0; j < PW; ++j) s[j] = p * PW + j < n ? sp[p * PW + j] : 0.0f;
    for (int64_t kk = 0; kk < k; ++kk)
      for (int64_t j = 0; j < PW; ++j)
        buf[kk * PW + j] = static_cast<float>(q[kk * PW + j]) * s[j];
    return static_cast<const float*>(buf);
  });
}

// panel_linear_i8 on the AMX tiles, for prompt-sized batches where the CPU has them (the caller
// checks): the int8 panels as bf16 W.T [k, n] (exact: |q| <= 127 fits bf16's 8 significant
// bits), x rounded to bf16, oneDNN's GEMM (at::mm: float32 sums, the output rounded to bf16;
// ATen has no bf16 -> float32 GEMM on CPU), then the scales and bias in float32. The bf16
// weights live for the call only (a layer's are 0.6-3.5 MB here), so int8 keeps its memory.
torch::Tensor panel_linear_i8_bf16(torch::Tensor x, torch::Tensor panels, torch::Tensor scales,
                                   int64_t n, c10::optional<torch::Tensor> bias) {
  check_i8(x, panels, scales, n);
  const int64_t k = x.size(1), np = panels.size(0);
  auto wt = panels.permute({1, 0, 2}).reshape({k, np * PW}).to(torch::kBFloat16);
  auto y = at::mm(x.to(torch::kBFloat16), wt).narrow(1, 0, n).to(torch::kFloat32).mul_(scales);
  if (bias.has_value()) y.add_(*bias);
  return y;
}

// int8 activation rows for engine.linear.Int8DynamicLinear: for x [m, k] returns
// rows [2m + 1, k] = (x / amax * shrink, residual / lo_amax * shrink, anchor), amax [m],
// lo_amax [m]. The residual is what the grid round(v * steps) / steps loses of the first row.
std::vector<torch::Tensor> int8_rows(torch::Tensor x, torch::Tensor anchor, double steps,
                                     double shrink) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [m, k] with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), sx = x.stride(0);
  auto rows = torch::empty({2 * m + 1, k}, x.options());
  auto amax = torch::empty({m}, x.options());
  auto lo_amax = torch::empty({m}, x.options());
  const float* xp = x.data_ptr<float>();
  float* rp = rows.data_ptr<float>();
  float* ap = amax.data_ptr<float>();
  float* lp = lo_amax.data_ptr<float>();
  const float st = static_cast<float>(steps), sh = static_cast<float>(shrink);
  at::parallel_for(0, m, 8, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float* r = xp + i * sx;
      float mx = 1e-30f;
      for (int64_t j = 0; j < k; ++j) mx = std::max(mx, std::fabs(r[j]));
      float* hi = rp + i * k;
      float* lo = rp + (m + i) * k;
      const float f = sh / mx;
      float lmx = 1e-30f;
      for (int64_t j = 0; j < k; ++j) {
        hi[j] = r[j] * f;
        lo[j] = hi[j] - std::nearbyint(hi[j] * st) / st;
        lmx = std::max(lmx, std::fabs(lo[j]));
      }
      const float g = sh / lmx;
      for (int64_t j = 0; j < k; ++j) lo[j] *= g;
      ap[i] = mx;
      lp[i] = lmx;
    }
  });
  std::copy_n(anchor.contiguous().data_ptr<float>(), k, rp + 2 * m * k);
  return {rows, amax, lo_amax};
}

// out[i] = (y[i] + y[m + i] * lo_amax[i]) * amax[i] / shrink (+ bias): undoes int8_rows.
torch::Tensor int8_merge(torch::Tensor y, torch::Tensor amax, torch::Tensor lo_amax,
                         double shrink, c10::optional<torch::Tensor> bias) {
  check_f32(y, "y");
  auto yc = y.contiguous();
  const int64_t m = amax.size(0), n = yc.size(1);
  auto out = torch::empty({m, n}, yc.options());
  const float* yp = yc.data_ptr<float>();
  const float* ap = amax.data_ptr<float>();
  const float* lp = lo_amax.data_ptr<float>();
  float* op = out.data_ptr<float>();
  torch::Tensor bc;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bc = bias->contiguous();
    bp = bc.data_ptr<float>();
  }
  const float sh = static_cast<float>(shrink);
  at::parallel_for(0, m * n, 1 << 14, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t i = t / n, j = t % n;
      float v = (yp[t] + yp[(m + i) * n + j] * lp[i]) * (ap[i] / sh);
      op[t] = bp ? v + bp[j] : v;
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------
// A step's decoder layers in one call (LlamaForCausalLM.forward's loop, op for op): decode
// steps, and steps with prompt pieces (whose attention is engine.attention.paged_attention's).
//
// Called from Python, the loop costs ~10 kernel calls a layer, each a pybind crossing that
// drops and retakes the GIL; on a 2-core machine the serving thread's event loop can take the
// GIL at each of them. `DecodeStack.run` makes the same calls, in the same order, on the same
// kernels, from C++ under one GIL release: the same bits, without the crossings.
//
// A linear is this extension's fp32 panels, int8 through fbgemm (`Int8Linear`), or a kernel
// of another extension that follows the `QuantFn` contract (quant_ops.cpp's
// quant_linear_panels), handed over as a named capsule so that a mismatched pointer is
// refused rather than called.
using QuantFn = torch::Tensor (*)(const torch::Tensor& x, const torch::Tensor& w,
                                  int64_t qtype, int64_t n, int64_t isa,
                                  const c10::optional<torch::Tensor>& bias);
constexpr const char* kQuantCapsule = "pdserve.quant_linear_panels";

// fbgemm's int8 GEMM (torch.ops.quantized.linear_dynamic), as engine.linear calls it.
const c10::OperatorHandle& linear_dynamic_op() {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_dynamic", "");
  return op;
}

// engine.linear.Int8DynamicLinear's call, op for op: batches from `amx_rows` rows (0: never)
// on the AMX tiles (panel_linear_i8_bf16), other batches over `small_m` rows through the int8
// panels (panel_linear_i8); smaller ones through fbgemm as two int8 rows per activation row
// (int8_rows, int8_merge).
struct Int8Linear {
  c10::IValue packed;  // the prepacked weights (a LinearPackedParamsBase)
  torch::Tensor scales, anchor;
  double steps = 0, shrink = 0;
  int64_t small_m = 0, amx_rows = 0;

  torch::Tensor operator()(const torch::Tensor& x, const torch::Tensor& qpanels, int64_t n,
                           const c10::optional<torch::Tensor>& bias) const {
    if (amx_rows > 0 && x.size(0) >= amx_rows)
      return panel_linear_i8_bf16(x, qpanels, scales, n, bias);
    if (x.size(0) > small_m) return panel_linear_i8(x, qpanels, scales, n, bias);
    TORCH_CHECK(x.stride(-1) == 1, "int8 activations need contiguous rows");
    std::vector<torch::Tensor> rows = int8_rows(x, anchor, steps, shrink);
    torch::jit::Stack stack{rows[0], packed, true};
    linear_dynamic_op().callBoxed(&stack);
    return int8_merge(stack[0].toTensor(), rows[1], rows[2], shrink, bias);
  }
};

struct StepLinear {
  torch::Tensor w;  // pack_panels' fp32 panels, the QuantFn's weights, or int8 panels
  int64_t n = 0;    // out features
  c10::optional<torch::Tensor> bias;
  QuantFn fn = nullptr;  // nullptr: panel_linear (or int8)
  int64_t qtype = 0, isa = 0;
  c10::optional<Int8Linear> int8;

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (int8) return (*int8)(x, w, n, bias);
    return fn ? fn(x, w, qtype, n, isa, bias) : panel_linear(x, w, n, bias);
  }
};

// (w, n, bias, kernel, qtype, isa): what engine.linear's kernels' `step_spec` gives. The
// kernel is None (w: fp32 panels), a QuantFn capsule, or for int8 a tuple (prepacked
// weights, scales, anchor row, steps, shrink, small_m, amx_rows) with w the int8 panels.
using LinearSpec = std::tuple<torch::Tensor, int64_t, c10::optional<torch::Tensor>,
                              py::object, int64_t, int64_t>;

StepLinear step_linear(const LinearSpec& spec) {
  StepLinear lin;
  py::object cap;
  std::tie(lin.w, lin.n, lin.bias, cap, lin.qtype, lin.isa) = spec;
  if (py::isinstance<py::tuple>(cap)) {
    auto t = cap.cast<py::tuple>();
    TORCH_CHECK(t.size() == 7, "an int8 kernel is (packed, scales, anchor, steps, shrink, "
                "small_m, amx_rows)");
    TORCH_CHECK(lin.w.scalar_type() == torch::kChar && lin.w.dim() == 3 &&
                    lin.w.size(2) == PW && lin.n > (lin.w.size(0) - 1) * PW &&
                    lin.n <= lin.w.size(0) * PW, "int8 weights must be pack_panels' int8 panels");
    Int8Linear q;
    q.packed = torch::jit::toIValue(t[0], linear_dynamic_op().schema().arguments()[1].type());
    q.scales = t[1].cast<torch::Tensor>();
    q.anchor = t[2].cast<torch::Tensor>();
    q.steps = t[3].cast<double>();
    q.shrink = t[4].cast<double>();
    q.small_m = t[5].cast<int64_t>();
    q.amx_rows = t[6].cast<int64_t>();
    check_f32(q.scales, "int8 scales");
    TORCH_CHECK(q.scales.dim() == 1 && q.scales.numel() == lin.n, "int8 scales must be [n]");
    check_f32(q.anchor, "int8 anchor row");
    lin.int8 = std::move(q);
  } else if (!cap.is_none()) {
    void* fn = PyCapsule_GetPointer(cap.ptr(), kQuantCapsule);
    if (fn == nullptr) {
      PyErr_Clear();
      TORCH_CHECK(false, "a linear's kernel must be a ", kQuantCapsule, " capsule");
    }
    lin.fn = reinterpret_cast<QuantFn>(fn);
  } else {
    check_f32(lin.w, "panels");
  }
  return lin;
}

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double scale, bool prefetch)
      : heads_(heads), kv_heads_(kv_heads), hd_(head_dim), scale_(scale), prefetch_(prefetch) {}

  void add_layer(const LinearSpec& qkv, const LinearSpec& o, const LinearSpec& gate_up,
                 const LinearSpec& down, torch::Tensor norm_w, double norm_eps,
                 torch::Tensor post_w, double post_eps) {
    check_f32(norm_w, "norm weight");
    check_f32(post_w, "post-attention norm weight");
    layers_.push_back({step_linear(qkv), step_linear(o), step_linear(gate_up),
                       step_linear(down), norm_w.contiguous(), norm_eps,
                       post_w.contiguous(), post_eps});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: the residual stream [n, hidden] of the step's packed tokens (prompt pieces first, then
  // one token per decoding sequence; updated in place: on return it is the last layer's
  // output, before the final norm). kv_layers: each layer's view of the pool. The rest is
  // engine.attention.AttentionMetadata's: each prompt piece's length, first position and
  // block table, and the decodes' block tables and context lengths (None without decodes).
  void run(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
           const std::vector<torch::Tensor>& kv_layers, const torch::Tensor& slot_blocks,
           const torch::Tensor& slot_offsets, const std::vector<int64_t>& prefill_lens,
           const std::vector<int64_t>& prefill_starts,
           const std::vector<torch::Tensor>& prefill_tables,
           const c10::optional<torch::Tensor>& tables,
           const c10::optional<torch::Tensor>& lens) const {
    const int64_t layers = num_layers();
    TORCH_CHECK(layers > 0, "no layers added");
    TORCH_CHECK(static_cast<int64_t>(kv_layers.size()) == layers, "one KV view per layer");
    check_f32(x, "x");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [n, hidden]");
    TORCH_CHECK(prefill_starts.size() == prefill_lens.size() &&
                    prefill_tables.size() == prefill_lens.size(),
                "one length, start and block table per prompt piece");
    const int64_t n = x.size(0), h = heads_, hkv = kv_heads_;
    int64_t prompt_tokens = 0;
    for (const int64_t len : prefill_lens) prompt_tokens += len;
    const bool decodes = n > prompt_tokens;
    TORCH_CHECK(!decodes || (tables.has_value() && lens.has_value() &&
                             tables->size(0) == n - prompt_tokens),
                "decodes need their block tables and context lengths");
    const Pieces pieces{prefill_lens, prefill_starts, prefill_tables, prompt_tokens};
    torch::Tensor hs = rms_norm(x, layers_[0].norm_w, layers_[0].norm_eps);
    for (int64_t i = 0; i < layers; ++i) {
      const Layer& l = layers_[i];
      torch::Tensor qkv = l.qkv(hs).view({n, h + 2 * hkv, hd_});
      rope_(qkv, h + hkv, cos, sin);
      torch::Tensor k = qkv.narrow(1, h, hkv), v = qkv.narrow(1, h + hkv, hkv);
      write_kv(kv_layers[i], k, v, slot_blocks, slot_offsets);
      torch::Tensor q = qkv.narrow(1, 0, h);
      torch::Tensor o = prompt_tokens == 0
                            ? paged_decode_attention(q, kv_layers[i], *tables, *lens, scale_,
                                                     prefetch_)
                            : attend_pieces(q, k, v, kv_layers[i], pieces, tables, lens);
      torch::Tensor a = l.o(o.reshape({n, h * hd_}));
      hs = add_rms_norm_(x, a, l.post_w, l.post_eps);
      torch::Tensor m = l.down(silu_mul(l.gate_up(hs)));
      if (i + 1 < layers)
        hs = add_rms_norm_(x, m, layers_[i + 1].norm_w, layers_[i + 1].norm_eps);
      else
        x.add_(m);
    }
  }

 private:
  struct Pieces {
    const std::vector<int64_t>& lens;
    const std::vector<int64_t>& starts;
    const std::vector<torch::Tensor>& tables;
    int64_t tokens;
  };

  // engine.attention.paged_attention for a step with prompt pieces, op for op: each piece
  // through ATen's scaled_dot_product_attention (causal over its own new K/V when it starts
  // the sequence, else over its context gathered from the pool with a causal mask), then the
  // decodes through the paged kernel.
  torch::Tensor attend_pieces(const torch::Tensor& q, const torch::Tensor& k_new,
                              const torch::Tensor& v_new, const torch::Tensor& kv,
                              const Pieces& pieces, const c10::optional<torch::Tensor>& tables,
                              const c10::optional<torch::Tensor>& lens) const {
    torch::Tensor out = torch::empty_like(q);
    int64_t pos = 0;
    for (size_t p = 0; p < pieces.lens.size(); ++p) {
      const int64_t n = pieces.lens[p], start = pieces.starts[p];
      torch::Tensor qs = q.narrow(0, pos, n).transpose(0, 1).unsqueeze(0);  // [1, h, n, d]
      torch::Tensor o;
      if (start == 0) {
        torch::Tensor ks = k_new.narrow(0, pos, n).transpose(0, 1).unsqueeze(0);
        torch::Tensor vs = v_new.narrow(0, pos, n).transpose(0, 1).unsqueeze(0);
        o = at::scaled_dot_product_attention(qs, ks, vs, {}, 0.0, /*is_causal=*/true, scale_,
                                             /*enable_gqa=*/true);
      } else {
        const torch::Tensor& table = pieces.tables[p];
        auto context = [&](int64_t kind) {  // [kv_heads, start + n, d], as attention._gather
          torch::Tensor rows = kv.select(1, kind).index_select(0, table.flatten());
          return rows.flatten(0, 1).narrow(0, 0, start + n).transpose(0, 1);
        };
        // Query i sits at position start + i and sees keys 0 .. start + i.
        torch::Tensor mask =
            torch::ones({n, start + n}, q.options().dtype(torch::kBool)).tril(start);
        o = at::scaled_dot_product_attention(qs, context(0).unsqueeze(0),
                                             context(1).unsqueeze(0), mask, 0.0, false, scale_,
                                             /*enable_gqa=*/true);
      }
      out.narrow(0, pos, n).copy_(o[0].transpose(0, 1));
      pos += n;
    }
    const int64_t b = q.size(0) - pos;
    if (b > 0)
      out.narrow(0, pos, b).copy_(paged_decode_attention(q.narrow(0, pos, b), kv, *tables,
                                                         *lens, scale_, prefetch_));
    return out;
  }

  struct Layer {
    StepLinear qkv, o, gate_up, down;
    torch::Tensor norm_w;
    double norm_eps;
    torch::Tensor post_w;
    double post_eps;
  };
  int64_t heads_, kv_heads_, hd_;
  double scale_;
  bool prefetch_;
  std::vector<Layer> layers_;
};

// Every op releases the GIL while it runs, as torch's own ops do: a worker's asyncio loop
// (heartbeats, streaming, gRPC) runs in another thread of the same process and must not wait
// for an attention or a matmul to finish.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("panel_width", &panel_width);
  m.def("pack_panels", &pack_panels, release());
  m.def("panel_linear", &panel_linear, release());
  m.def("panel_linear_i8", &panel_linear_i8, release());
  m.def("panel_linear_i8_bf16", &panel_linear_i8_bf16, release());
  m.def("int8_rows", &int8_rows, release());
  m.def("int8_merge", &int8_merge, release());
  m.def("rms_norm", &rms_norm, release());
  m.def("add_rms_norm_", &add_rms_norm_, release());
  m.def("rope_", &rope_, release());
  m.def("silu_mul", &silu_mul, release());
  m.def("write_kv", &write_kv, release());
  m.def("paged_decode_attention", &paged_decode_attention, py::arg("q"), py::arg("kv"),
        py::arg("tables"), py::arg("lens"), py::arg("scale"), py::arg("prefetch") = true,
        release());
  // module_local: another build of this file (bench --against, a test's rebuild) may load
  // into the same process, and pybind11 registers a global type only once.
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, double, bool>(), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("prefetch"))
      .def("add_layer", &DecodeStack::add_layer)
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def("run", &DecodeStack::run, release());
}
