// CPU kernels of the specserve engine: float32 arithmetic (weights float32 or bfloat16;
// GGML quantized blocks are multiplied by cpu_kernels_int8.cpp and dequantized by
// cpu_kernels_quant.cpp, compiled after this source in the same unit), AVX-512 or AVX2 +
// FMA, torch's intra-op threads. Compiled on first use by specserve/engine/cpu_kernels.py
// (which documents them)
// with -DSPECSERVE_AVX512 or -DSPECSERVE_AVX2; LIBNAME (the op namespace) comes from its
// compiler flags too.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// Every dot product is accumulated in LANES = 16 fixed lanes (lane l sees the products
// at k = l mod 16, in order) and the lanes are summed in one fixed order (reduce16). On
// AVX-512 a lane set is one zmm, on AVX2 two ymm (lanes 0-7 and 8-15); the FMAs and the
// sum are the same operations on the same values, so both give the same bits.
constexpr int LANES = 16;

#if defined(SPECSERVE_AVX512)
using Vec = __m512;  // one hardware vector
constexpr int W = 16;  // floats per Vec

inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float a) { return _mm512_set1_ps(a); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
// The first n floats at p (0 <= n <= W; none read past them), zeros in the other lanes.
inline Vec vload_first(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1u), p);
}
// lanes 0-7 + lanes 8-15
inline __m256 fold256(const Vec* v) {
  return _mm256_add_ps(_mm512_castps512_ps256(v[0]),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[0]), 1)));
}
#elif defined(SPECSERVE_AVX2)
using Vec = __m256;
constexpr int W = 8;

inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float a) { return _mm256_set1_ps(a); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vload_first(const float* p, int64_t n) {
  const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n),
                                       _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_ps(p, m);
}
inline __m256 fold256(const Vec* v) { return _mm256_add_ps(v[0], v[1]); }
#else
#error "build with -DSPECSERVE_AVX512 (and -mavx512f -mfma) or -DSPECSERVE_AVX2 (-mavx2 -mfma)"
#endif

constexpr int P = LANES / W;  // Vecs per lane set

// Weights are float32 or bfloat16 (BF16: its 16 bits, the high half of a float32).
// A bfloat16 weight is widened to the float32 of the same value (exact: a shift) as it
// is loaded, and everything else is float32, so a product with bfloat16 weights gives
// the same bits as one with those weights converted to float32: half the bytes from
// memory for the same arithmetic.
using BF16 = uint16_t;

inline Vec wload(const float* p) { return vload(p); }
inline Vec wload_first(const float* p, int64_t n) { return vload_first(p, n); }
#if defined(SPECSERVE_AVX512)
inline Vec wload(const BF16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#else
inline Vec wload(const BF16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif
// The first n (0 <= n <= W) weights at p widened, zeros in the other lanes (the tail of
// K only, so a scalar copy is fine).
inline Vec wload_first(const BF16* p, int64_t n) {
  alignas(64) uint32_t bits[W] = {};
  for (int64_t i = 0; i < n; ++i) bits[i] = uint32_t(p[i]) << 16;
  return vload(reinterpret_cast<const float*>(bits));
}

// The sum of the 16 lanes held in v[0 .. P): pairwise, lane l + lane l + 8, then + 4,
// + 2, + 1 (the order of GCC's _mm512_reduce_add_ps, written out so that it is fixed).
inline float reduce16(const Vec* v) {
  const __m256 t8 = fold256(v);
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(t2) + _mm_cvtss_f32(_mm_shuffle_ps(t2, t2, 1));
}

// Blocking of the products. A block of NB weight rows is the unit of the thread split;
// its rows meet register tiles of up to RG rows of x (RG x NB lane sets of accumulators).
// Up to SMALL_ROWS rows of x, more weight streams at once; more rows, more rows of x per
// weight load.
//   AVX-512 (32 zmm; measured on the 1.5B's projections, 2 threads, see ops.py): blocks
//   of 8 weight rows, tiles of 3 x 8 = 24 accumulators (~3% faster than 4 at 1-2 rows);
//   more rows, blocks of 4 and tiles of 6 rows of x (6 x 4 = 24 accumulators + 4 weights
//   + 1 x).
//   AVX2 (16 ymm, a lane set takes two; measured with 8960 x 1536 and 1536 x 8960
//   weights, 2 threads): blocks of 4 weight rows, tiles of 1 x 4 (8 ymm accumulators),
//   10-25% faster than one weight row at a time at 1 row; more rows, blocks of one weight
//   row and tiles of 6 rows of x (12 ymm accumulators + 1 weight; the FMAs read x from
//   L1), 20-40% faster at 5 rows than 3 x 2 tiles (which split K there) and as fast or
//   faster at 9-16 rows; blocks of 2-8 weight rows with 6 x 1 tiles were no faster.
#if defined(SPECSERVE_AVX512)
constexpr int SMALL_ROWS = 3, SMALL_NB = 8, SMALL_RG = 3;
constexpr int LARGE_NB = 4, LARGE_RG = 6;
#else
constexpr int SMALL_ROWS = 3, SMALL_NB = 4, SMALL_RG = 1;
constexpr int LARGE_NB = 1, LARGE_RG = 6;
#endif
constexpr int TAIL_RG = 6;  // tiles for the last < NB weight rows (one at a time)
constexpr int MAX_ROWS = 32;   // rows of x one pass over a block takes (ops.py sends <= 32)
constexpr int K_CHUNK = 256;   // floats of each weight row per pass for > 1 tile of rows
constexpr int PREFETCH_BYTES = 2048;  // ahead in a weight row (1-2 KiB of float32 were best)

// acc[(r * NO + o) * P + p] += x[r, k0:k1] . w[o, k0:k1] lane-wise, for R rows of x and
// NO weight rows; k0 is a multiple of 16, and a tail past the last multiple of 16 of K is
// read with masked loads. Each (r, o) has one lane set whose 16 lanes see the products
// in the same order however the caller splits [0, K) or groups the rows, so results do
// not depend on R, NO or the blocking.
template <int R, int NO, typename T>
__attribute__((always_inline)) inline void tile_acc(const float* x, int64_t ldx, const T* w,
                                                    int64_t ldw, int64_t k0, int64_t k1,
                                                    Vec* acc) {
  Vec a[R][NO][P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int o = 0; o < NO; ++o)
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) a[r][o][p] = acc[(r * NO + o) * P + p];
  int64_t k = k0;
  for (; k + LANES <= k1; k += LANES) {
    // Software prefetch 2 KiB ahead in every weight row: the hardware streamers restart
    // at each 4 KiB page; measured 3% (1 row) to 9% (5 rows) faster than without.
#pragma GCC unroll 8
    for (int o = 0; o < NO; ++o)
      _mm_prefetch((const char*)(w + o * ldw + k) + PREFETCH_BYTES, _MM_HINT_T0);
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {  // one Vec of the lane sets at a time: fewer registers
      Vec wv[NO];
#pragma GCC unroll 8
      for (int o = 0; o < NO; ++o) wv[o] = wload(w + o * ldw + k + p * W);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const Vec xv = vload(x + r * ldx + k + p * W);
#pragma GCC unroll 8
        for (int o = 0; o < NO; ++o) a[r][o][p] = vfma(xv, wv[o], a[r][o][p]);
      }
    }
  }
  if (k < k1) {  // the tail of K: masked loads read zeros past it (every lane gets its FMA)
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {
      const int64_t n = std::min<int64_t>(std::max<int64_t>(k1 - k - p * W, 0), W);
      Vec wv[NO];
#pragma GCC unroll 8
      for (int o = 0; o < NO; ++o) wv[o] = wload_first(w + o * ldw + k + p * W, n);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const Vec xv = vload_first(x + r * ldx + k + p * W, n);
#pragma GCC unroll 8
        for (int o = 0; o < NO; ++o) a[r][o][p] = vfma(xv, wv[o], a[r][o][p]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int o = 0; o < NO; ++o)
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) acc[(r * NO + o) * P + p] = a[r][o][p];
}

// tile_acc<g, NO> for a run-time g in [1, G].
template <int G, int NO, typename T>
inline void tile_acc_n(int64_t g, const float* x, int64_t ldx, const T* w, int64_t ldw,
                       int64_t k0, int64_t k1, Vec* acc) {
  if (g == G) {
    tile_acc<G, NO>(x, ldx, w, ldw, k0, k1, acc);
  } else if constexpr (G > 1) {
    tile_acc_n<G - 1, NO>(g, x, ldx, w, ldw, k0, k1, acc);
  }
}

// y[r, o] = sum of the lanes of lane set r * NO + o of acc (+ bias[o]).
inline void store(int64_t R, int64_t NO, const Vec* acc, float* y, int64_t ldy,
                  const float* bias) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t o = 0; o < NO; ++o) {
      const float s = reduce16(acc + (r * NO + o) * P);
      y[r * ldy + o] = bias ? s + bias[o] : s;
    }
}

// y[r, o] = x[r, :] . w[o, :] (+ bias[o]) for all R rows of x and NO weight rows.
// Up to RG rows: one pass over [0, K) with the accumulators in registers. More: the
// block's weight rows are read once from memory in chunks of K_CHUNK, and every group of
// RG rows meets each chunk while it is in L1 (accumulators kept in a stack buffer
// between chunks), so neither the weights nor x fall out of L1.
template <int NO, int RG, typename T>
void block(int64_t R, const float* x, int64_t ldx, const T* w, int64_t ldw, int64_t K,
           float* y, int64_t ldy, const float* bias) {
  alignas(64) Vec acc[MAX_ROWS * NO * P];
  for (int64_t s0 = 0; s0 < R; s0 += MAX_ROWS) {
    const int64_t rows = R - s0 < MAX_ROWS ? R - s0 : MAX_ROWS;
    const float* xs = x + s0 * ldx;
    for (int64_t i = 0; i < rows * NO * P; ++i) acc[i] = vzero();
    if (rows <= RG) {
      tile_acc_n<RG, NO>(rows, xs, ldx, w, ldw, 0, K, acc);
    } else {
      for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
        const int64_t k1 = K - k0 < K_CHUNK ? K : k0 + K_CHUNK;
        for (int64_t r0 = 0; r0 < rows; r0 += RG) {
          const int64_t g = rows - r0 < RG ? rows - r0 : RG;
          tile_acc_n<RG, NO>(g, xs + r0 * ldx, ldx, w, ldw, k0, k1, acc + r0 * NO * P);
        }
      }
    }
    store(rows, NO, acc, y + s0 * ldy, ldy, bias);
  }
}

// The NB weight rows from row o of w [out, K] (fewer at the end of w); yo: y's column o.
template <int NB, int RG, typename T>
inline void rows_block(int64_t R, const float* x, int64_t ldx, const T* w, int64_t ldw,
                       int64_t K, int64_t o, int64_t out, float* yo, int64_t ldy,
                       const float* bias) {
  const T* wo = w + o * ldw;
  const float* bo = bias ? bias + o : nullptr;
  if (out - o >= NB) {
    block<NB, RG>(R, x, ldx, wo, ldw, K, yo, ldy, bo);
  } else {
    for (int64_t j = 0; j < out - o; ++j)
      block<1, TAIL_RG>(R, x, ldx, wo + j * ldw, ldw, K, yo + j, ldy, bo ? bo + j : nullptr);
  }
}

// What a weight matrix holds: float32, bfloat16, or GGML blocks (the GGUF type number).
// ldw counts elements of a float32 or bfloat16 weight and bytes of a quantized one.
enum WeightType : int64_t {
  kF32 = -1,
  kBF16 = -2,
  kQ5_0 = 6,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ6_K = 14,
  // Q4_K repacked for the integer kernels, 8 weight rows interleaved (cpu_kernels_int8.cpp):
  // rows padded to a multiple of 8, 148 bytes per row per 256 values.
  kQ4_K_X8 = (1 << 16) | 12,
  kQ6_K_X8 = (1 << 16) | 14,  // the same for Q6_K: 210 bytes per row per 256 values
  kQ5_0_X8 = (1 << 16) | 6,   // and Q5_0: 22 bytes per row per 32 values
};

// A weight: its type, data, row stride and output rows.
struct WeightRef {
  WeightType type;
  const void* data;
  int64_t ldw;
  int64_t out;
};

// Checks a weight [out, K] given as a tensor and a type (0: the tensor's dtype, float32 or
// bfloat16; a GGML type: uint8 blocks [out, bytes of K values]), contiguous where needed.
WeightRef weight_ref(const at::Tensor& w, int64_t type, int64_t K);

// The NB weight rows from row o of a float32 or bfloat16 weight w, with the small-row or
// large-row blocking.
inline void rows_block_any(bool small, const WeightRef& w, int64_t R, const float* x,
                           int64_t ldx, int64_t K, int64_t o, float* yo, int64_t ldy,
                           const float* bias) {
  auto run = [&](auto* wt) {
    if (small) {
      rows_block<SMALL_NB, SMALL_RG>(R, x, ldx, wt, w.ldw, K, o, w.out, yo, ldy, bias);
    } else {
      rows_block<LARGE_NB, LARGE_RG>(R, x, ldx, wt, w.ldw, K, o, w.out, yo, ldy, bias);
    }
  };
  TORCH_CHECK(w.type == kBF16 || w.type == kF32,
              "quantized weights go to q8_linears / q8_gate_up_silu");
  if (w.type == kBF16) {
    run(static_cast<const BF16*>(w.data));
  } else {
    run(static_cast<const float*>(w.data));
  }
}

WeightRef weight_ref(const at::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.device().is_cpu() && w.stride(1) == 1,
              "each weight must be a CPU matrix with unit column stride");
  if (type == 0) {
    TORCH_CHECK(w.size(1) == K &&
                    (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
                "each weight must be a float32 or bfloat16 matrix [out, K] matching x");
    return {w.scalar_type() == at::kBFloat16 ? kBF16 : kF32, w.const_data_ptr(), w.stride(0),
            w.size(0)};
  }
  int64_t block = 0, bytes = 0;
  switch (type) {
    case kQ8_0: block = 32, bytes = 34; break;
    case kQ5_0: block = 32, bytes = 22; break;
    case kQ4_K: block = 256, bytes = 144; break;
    case kQ6_K: block = 256, bytes = 210; break;
    case kQ4_K_X8: block = 256, bytes = 148; break;
    case kQ6_K_X8: block = 256, bytes = 210; break;
    case kQ5_0_X8: block = 32, bytes = 22; break;
    default: TORCH_CHECK(false, "GGML type ", type, " is not one the kernels read");
  }
  TORCH_CHECK(w.scalar_type() == at::kByte && K % block == 0 && w.size(1) == K / block * bytes,
              "a GGML type ", type, " weight must be uint8 blocks [out, ", K / block * bytes,
              "] for K = ", K, " (a multiple of ", block, ")");
  TORCH_CHECK((type & (1 << 16)) == 0 || (w.size(0) % 8 == 0 && w.is_contiguous()),
              "a repacked weight must be contiguous with a multiple of 8 rows");
  return {static_cast<WeightType>(type), w.const_data_ptr(), w.stride(0), w.size(0)};
}

// x [R, K] times each ws[i] [out_i, K] (+ bs[i]). The results lie side by side in one
// [R, sum out_i] buffer; returned as column views of it, one per weight. types[i] says what
// ws[i] holds (weight_ref); x, biases and results are float32.
std::vector<at::Tensor> typed_linears(const at::Tensor& x_in, at::TensorList ws_in,
                                      at::IntArrayRef types,
                                      const c10::List<std::optional<at::Tensor>>& bs) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "x must be a float32 CPU matrix");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  std::vector<at::Tensor> ws;  // unit column stride (a no-op for checkpoint weights)
  ws.reserve(ws_in.size());
  for (const at::Tensor& w : ws_in)
    ws.push_back(w.dim() == 2 && w.stride(1) != 1 ? w.contiguous() : w);
  TORCH_CHECK(bs.size() == ws.size() && types.size() == ws.size(),
              "one type and one bias entry (or None) per weight");
  const int64_t R = x.size(0), K = x.size(1), ldx = x.stride(0);
  const size_t n = ws.size();
  std::vector<WeightRef> wr(n);
  std::vector<const float*> bp(n);
  std::vector<int64_t> outs(n), col(n + 1, 0), first(n + 1, 0);
  std::vector<at::Tensor> keep;  // contiguous copies of odd biases live until the end
  for (size_t i = 0; i < n; ++i) {
    wr[i] = weight_ref(ws[i], types[i], K);
    outs[i] = wr[i].out;
    const std::optional<at::Tensor> b = bs.get(i);
    bp[i] = nullptr;
    if (b.has_value() && b->defined()) {
      TORCH_CHECK(b->numel() == outs[i] && b->scalar_type() == at::kFloat && b->device().is_cpu(),
                  "each bias must be a float32 CPU vector [out] or None");
      keep.push_back(b->contiguous());
      bp[i] = keep.back().const_data_ptr<float>();
    }
    col[i + 1] = col[i] + outs[i];
  }
  at::Tensor y = at::empty({R, col[n]}, x.options());
  float* yp = y.mutable_data_ptr<float>();
  const float* xp = x.const_data_ptr<float>();
  const int64_t ldy = col[n];
  const bool small = R <= SMALL_ROWS;
  const int64_t nb = small ? SMALL_NB : LARGE_NB;  // weight rows per block
  for (size_t i = 0; i < n; ++i) first[i + 1] = first[i] + (outs[i] + nb - 1) / nb;
  // Threads only when each gets at least ~64 KiB of weight: a tiny product is not worth
  // waking the other threads (on a busy machine that can cost a scheduler slice).
  const int64_t grain = (16384 + nb * K - 1) / (nb * K);
  at::parallel_for(0, first[n], grain, [&](int64_t b0, int64_t b1) {
    size_t i = 0;
    for (int64_t blk = b0; blk < b1; ++blk) {
      while (blk >= first[i + 1]) ++i;
      const int64_t o = (blk - first[i]) * nb;
      rows_block_any(small, wr[i], R, xp, ldx, K, o, yp + col[i] + o, ldy, bp[i]);
    }
  });
  std::vector<at::Tensor> views;
  views.reserve(n);
  for (size_t i = 0; i < n; ++i) views.push_back(y.narrow(1, col[i], outs[i]));
  return views;
}

// typed_linears with float32 or bfloat16 weights only.
std::vector<at::Tensor> linears(const at::Tensor& x, at::TensorList ws,
                                const c10::List<std::optional<at::Tensor>>& bs) {
  return typed_linears(x, ws, std::vector<int64_t>(ws.size(), 0), bs);
}

// silu(x @ wg.T) * (x @ wu.T): the gate and up rows of one block go through the same tile
// code as linears (same bits for g and u), then the activation, so the [R, I] gate and up
// products are never written out and no separate silu / mul ops run. tg and tu say what wg
// and wu hold (weight_ref); each its own.
at::Tensor typed_gate_up_silu(const at::Tensor& x_in, const at::Tensor& wg_in, int64_t tg,
                              const at::Tensor& wu_in, int64_t tu) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "x must be a float32 CPU matrix");
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor wg = wg_in.contiguous(), wu = wu_in.contiguous();
  const int64_t R = x.size(0), K = x.size(1), ldx = x.stride(0);
  const WeightRef gr = weight_ref(wg, tg, K), ur = weight_ref(wu, tu, K);
  const int64_t I = gr.out;
  TORCH_CHECK(ur.out == I, "gate and up must have the same rows [I, K]");
  at::Tensor y = at::empty({R, I}, x.options());
  float* yp = y.mutable_data_ptr<float>();
  const float* xp = x.const_data_ptr<float>();
  const bool small = R <= SMALL_ROWS;
  const int64_t nb = small ? SMALL_NB : LARGE_NB;  // weight rows per block, as in linears
  const int64_t grain = (16384 + 2 * nb * K - 1) / (2 * nb * K);
  at::parallel_for(0, (I + nb - 1) / nb, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> g(R * nb), u(R * nb);  // [R, nb] gate and up products of a block
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t o = blk * nb, no = I - o < nb ? I - o : nb;
      rows_block_any(small, gr, R, xp, ldx, K, o, g.data(), nb, nullptr);
      rows_block_any(small, ur, R, xp, ldx, K, o, u.data(), nb, nullptr);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < no; ++j) {
          const float gv = g[r * nb + j];
          yp[r * I + o + j] = gv / (1.0f + std::exp(-gv)) * u[r * nb + j];
        }
    }
  });
  return y;
}

// typed_gate_up_silu of float32 or bfloat16 weights of one dtype.
at::Tensor gate_up_silu(const at::Tensor& x, const at::Tensor& wg, const at::Tensor& wu) {
  TORCH_CHECK(wg.scalar_type() == wu.scalar_type(), "gate and up must be of one dtype");
  return typed_gate_up_silu(x, wg, 0, wu, 0);
}

// Products of quantized weights with 8-bit activations, any row count (cpu_kernels_int8.cpp).
std::vector<at::Tensor> q8_linears(const at::Tensor& x, at::TensorList ws, at::IntArrayRef types,
                                   const c10::List<std::optional<at::Tensor>>& bs);
at::Tensor q8_gate_up_silu(const at::Tensor& x, const at::Tensor& wg, int64_t tg,
                           const at::Tensor& wu, int64_t tu);
at::Tensor repack_q4_k_x8(const at::Tensor& blocks, int64_t K);
at::Tensor repack_q6_k_x8(const at::Tensor& blocks, int64_t K);
at::Tensor repack_q5_0_x8(const at::Tensor& blocks, int64_t K);

// The float32 values [rows, K] of quantized rows `blocks` of GGML `type`, the reference
// dequantization's bits (cpu_kernels_quant.cpp).
at::Tensor dequantize_blocks(const at::Tensor& blocks, int64_t type, int64_t K);

// a[0:n] . b[0:n] in one lane set, as tile_acc with one row and one weight row.
inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc[P];
#pragma GCC unroll 2
  for (int p = 0; p < P; ++p) acc[p] = vzero();
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) acc[p] = vfma(vload(a + i + p * W), vload(b + i + p * W), acc[p]);
  if (i < n)
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {
      const int64_t m = std::min<int64_t>(std::max<int64_t>(n - i - p * W, 0), W);
      acc[p] = vfma(vload_first(a + i + p * W, m), vload_first(b + i + p * W, m), acc[p]);
    }
  return reduce16(acc);
}

// weight * (x * rsqrt(mean(x^2) + eps)) per row, as the decoder's RMSNorm in float32.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu() && x_in.dim() >= 1,
              "x must be a float32 CPU tensor");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t K = x.size(-1), R = K ? x.numel() / K : 0;
  TORCH_CHECK(w.numel() == K && w.scalar_type() == at::kFloat, "weight must be float32 [hidden]");
  at::Tensor y = at::empty(x.sizes(), x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * K;
      float* yr = yp + r * K;
      const float scale = 1.0f / std::sqrt(dot(xr, xr, K) / (float)K + (float)eps);
      for (int64_t k = 0; k < K; ++k) yr[k] = wp[k] * (xr[k] * scale);
    }
  });
  return y;
}

// RoPE, the KV-cache write and attention of a few new tokens (cpu_kernels_attention.cpp).
at::Tensor rope_cache_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& positions_in, const at::Tensor& inv_freq_in,
                                double rope_scale, at::Tensor& k_cache, at::Tensor& v_cache,
                                const at::Tensor& write_slots_in, const at::Tensor& read_slots_in,
                                const at::Tensor& token_session_in, int64_t window,
                                double softcap);

// Coupled sampling (specserve/engine/coupling.py): per row, argmax_v p[v] / E[v] with
// E[v] = -log(u[v]) and u[v] from the SplitMix64 word mix(key + (v / 2 + 1) * GAMMA),
// bits 41..63 for an even v and 0..22 for an odd one, u = (bits + 0.5) * 2^-23. As
// -log(u) >= 1 - u, p / (1 - u) bounds the score: the logarithm is taken only where
// that bound (less a 1e-3 margin for rounding) reaches the best score so far, about
// twice a row. Ties go to the lower id, as torch.argmax.
constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kMul1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kMul2 = 0x94D049BB133111EBull;
constexpr uint32_t kLow23 = (1u << 23) - 1u;

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * kMul1;
  z = (z ^ (z >> 27)) * kMul2;
  return z ^ (z >> 31);
}

inline void coupled_visit(const float* p, int64_t v, uint32_t bits, float& best, int64_t& arg) {
  const float pv = p[v];
  if (!(pv > 0.0f)) return;  // no mass (filtered out): score 0, never above a positive one
  const float u = (static_cast<float>(bits) + 0.5f) * (1.0f / 8388608.0f);
  if (pv < best * (1.0f - u) * 0.999f) return;  // its score is below the best
  const float score = pv / -std::log(u);
  if (score > best) {
    best = score;
    arg = v;
  }
}

int64_t coupled_row(const float* p, int64_t vocab, uint64_t key) {
  float best = 0.0f;
  int64_t arg = 0;
  for (int64_t i = 0; 2 * i < vocab; ++i) {
    const uint64_t h = mix64(key + static_cast<uint64_t>(i + 1) * kGamma);
    coupled_visit(p, 2 * i, static_cast<uint32_t>(h >> 41), best, arg);
    if (2 * i + 1 < vocab) coupled_visit(p, 2 * i + 1, static_cast<uint32_t>(h) & kLow23, best, arg);
  }
  return arg;
}

at::Tensor coupled_argmax(const at::Tensor& probs, const at::Tensor& keys) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == at::kFloat && probs.is_contiguous(),
              "probs must be a contiguous float32 [n, vocab] tensor");
  TORCH_CHECK(keys.dim() == 1 && keys.scalar_type() == at::kLong && keys.size(0) == probs.size(0),
              "keys must be int64 [n]");
  const int64_t n = probs.size(0), vocab = probs.size(1);
  at::Tensor out = at::empty({n}, keys.options());
  const float* p = probs.data_ptr<float>();
  const int64_t* k = keys.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) o[r] = coupled_row(p + r * vocab, vocab, static_cast<uint64_t>(k[r]));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(LIBNAME, m) {
  m.def("coupled_argmax(Tensor probs, Tensor keys) -> Tensor");
  m.def("linears(Tensor x, Tensor[] ws, Tensor?[] bs) -> Tensor[]");
  m.def("gate_up_silu(Tensor x, Tensor wg, Tensor wu) -> Tensor");
  m.def("q8_linears(Tensor x, Tensor[] ws, int[] types, Tensor?[] bs) -> Tensor[]");
  m.def("q8_gate_up_silu(Tensor x, Tensor wg, int tg, Tensor wu, int tu) -> Tensor");
  m.def("repack_q4_k_x8(Tensor blocks, int K) -> Tensor");
  m.def("repack_q6_k_x8(Tensor blocks, int K) -> Tensor");
  m.def("repack_q5_0_x8(Tensor blocks, int K) -> Tensor");
  m.def("dequantize(Tensor blocks, int type, int K) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def(
      "rope_cache_attention(Tensor q, Tensor k, Tensor v, Tensor positions, Tensor inv_freq, "
      "float rope_scale, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write_slots, "
      "Tensor read_slots, Tensor token_session, int window, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(LIBNAME, CPU, m) {
  m.impl("linears", &linears);
  m.impl("gate_up_silu", &gate_up_silu);
  m.impl("q8_linears", &q8_linears);
  m.impl("q8_gate_up_silu", &q8_gate_up_silu);
  m.impl("repack_q4_k_x8", &repack_q4_k_x8);
  m.impl("repack_q6_k_x8", &repack_q6_k_x8);
  m.impl("repack_q5_0_x8", &repack_q5_0_x8);
  m.impl("dequantize", &dequantize_blocks);
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_cache_attention", &rope_cache_attention);
  m.impl("coupled_argmax", &coupled_argmax);
}
