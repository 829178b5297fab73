// GGML block-quantized weights in the CPU kernels: Q8_0, Q5_0, Q4_K and Q6_K rows (GGUF's
// layout; formats and float operations in specserve/engine/quant/formats.py) widened to
// float32 in registers and multiplied by the tile code of cpu_kernels.cpp, which this
// source follows in one compilation unit (it uses its Vec, tiles, blocking and store).
//
// Exactness: a weight vector is widened with the reference's float operations (each exact
// or one rounding, see formats.py), and then meets x in the same FMAs, lanes and order as
// a float32 weight does in tile_acc: every product gives the bits of the float32 kernel
// on the dequantized matrix, for any row count.
#include <cstring>

namespace {

#if defined(SPECSERVE_AVX512)
using VecI = __m512i;  // W int32 lanes
// W bytes at p, zero- or sign-extended to int32 lanes.
inline VecI iload_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
}
inline VecI iload_i8(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p));
}
inline VecI iset1(int32_t a) { return _mm512_set1_epi32(a); }
inline VecI iand(VecI a, VecI b) { return _mm512_and_si512(a, b); }
inline VecI ior(VecI a, VecI b) { return _mm512_or_si512(a, b); }
inline VecI isub(VecI a, VecI b) { return _mm512_sub_epi32(a, b); }
inline VecI isrlv(VecI a, VecI n) { return _mm512_srlv_epi32(a, n); }
inline VecI ishl4(VecI a) { return _mm512_slli_epi32(a, 4); }
inline VecI iota() {
  return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline Vec itof(VecI a) { return _mm512_cvtepi32_ps(a); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
// Quantized weight rows per register tile (accumulators stay in registers with the
// decoding temporaries beside them).
constexpr int QNO = 4;
#else
using VecI = __m256i;
inline VecI iload_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
}
inline VecI iload_i8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
}
inline VecI iset1(int32_t a) { return _mm256_set1_epi32(a); }
inline VecI iand(VecI a, VecI b) { return _mm256_and_si256(a, b); }
inline VecI ior(VecI a, VecI b) { return _mm256_or_si256(a, b); }
inline VecI isub(VecI a, VecI b) { return _mm256_sub_epi32(a, b); }
inline VecI isrlv(VecI a, VecI n) { return _mm256_srlv_epi32(a, n); }
inline VecI ishl4(VecI a) { return _mm256_slli_epi32(a, 4); }
inline VecI iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline Vec itof(VecI a) { return _mm256_cvtepi32_ps(a); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
constexpr int QNO = 2;
#endif

// The float16 at p as float32 (exact).
inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One struct per block type: BLOCK values in BYTES bytes; scales(b) decodes a block's
// scales once (the float products of formats.py); widen(b, s, e) is the W values from
// e (a multiple of W) of that block as float32.
struct Q8_0 {
  static constexpr int BLOCK = 32, BYTES = 34;
  struct Scales {
    float d;
  };
  static Scales scales(const uint8_t* b) { return {f16(b)}; }
  static Vec widen(const uint8_t* b, const Scales& s, int e) {
    return vmul(itof(iload_i8(b + 2 + e)), vset1(s.d));
  }
};

struct Q5_0 {
  static constexpr int BLOCK = 32, BYTES = 22;
  struct Scales {
    float d;
    uint32_t qh;  // bit j: the fifth bit of value j
  };
  static Scales scales(const uint8_t* b) {
    Scales s{f16(b), 0};
    std::memcpy(&s.qh, b + 2, 4);
    return s;
  }
  static Vec widen(const uint8_t* b, const Scales& s, int e) {
    // values 0-15: low nibbles of qs[0..15]; 16-31: their high nibbles
    VecI q = iand(isrlv(iload_u8(b + 6 + (e & 15)), iset1((e >> 4) * 4)), iset1(15));
    const VecI high = iand(isrlv(iset1(static_cast<int32_t>(s.qh >> e)), iota()), iset1(1));
    q = isub(ior(q, ishl4(high)), iset1(16));
    return vmul(itof(q), vset1(s.d));
  }
};

struct Q4_K {
  static constexpr int BLOCK = 256, BYTES = 144;
  struct Scales {
    float d[8], m[8];  // per 32-value sub-block: d * sc, dmin * m
  };
  static Scales scales(const uint8_t* b) {
    const float d = f16(b), dmin = f16(b + 2);
    const uint8_t* q = b + 4;
    Scales s;
    for (int j = 0; j < 8; ++j) {
      const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      const int m = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
      s.d[j] = d * static_cast<float>(sc);
      s.m[j] = dmin * static_cast<float>(m);
    }
    return s;
  }
  static Vec widen(const uint8_t* b, const Scales& s, int e) {
    const int i = e >> 5;  // sub-block: nibble i % 2 of qs[32 (i / 2) ...]
    const VecI q =
        iand(isrlv(iload_u8(b + 16 + 32 * (i >> 1) + (e & 31)), iset1((i & 1) * 4)), iset1(15));
    return vsub(vmul(itof(q), vset1(s.d[i])), vset1(s.m[i]));
  }
};

struct Q6_K {
  static constexpr int BLOCK = 256, BYTES = 210;
  struct Scales {
    float s[16];  // per 16 values: d * scales[j]
  };
  static Scales scales(const uint8_t* b) {
    const float d = f16(b + 208);
    Scales s;
    for (int j = 0; j < 16; ++j) s.s[j] = d * static_cast<float>(static_cast<int8_t>(b[192 + j]));
    return s;
  }
  static Vec widen(const uint8_t* b, const Scales& s, int e) {
    const int h = e >> 7, part = (e >> 5) & 3, l = e & 31;  // value 128 h + 32 part + l
    const VecI low =
        iand(isrlv(iload_u8(b + 64 * h + 32 * (part & 1) + l), iset1(4 * (part >> 1))), iset1(15));
    const VecI high = iand(isrlv(iload_u8(b + 128 + 32 * h + l), iset1(2 * part)), iset1(3));
    const VecI q = isub(ior(low, ishl4(high)), iset1(32));
    return vmul(itof(q), vset1(s.s[e >> 4]));
  }
};

constexpr int QPREFETCH_BYTES = 1024;  // ahead in a quantized weight row

// As tile_acc, for NO quantized weight rows (ldw bytes apart) whose accumulators are
// lane sets (r * ACC_NO + o) of acc; k0 and k1 are multiples of the block size. The x
// vectors of a lane group are loaded once and each widened weight vector meets them all.
template <int R, int NO, int ACC_NO, typename Q>
__attribute__((always_inline)) inline void qtile_acc(const float* x, int64_t ldx,
                                                     const uint8_t* w, int64_t ldw, int64_t k0,
                                                     int64_t k1, Vec* acc) {
  Vec a[R][NO][P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int o = 0; o < NO; ++o)
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) a[r][o][p] = acc[(r * ACC_NO + o) * P + p];
  for (int64_t k = k0; k < k1; k += Q::BLOCK) {
    const uint8_t* blk[NO];
    typename Q::Scales sc[NO];
#pragma GCC unroll 8
    for (int o = 0; o < NO; ++o) {
      blk[o] = w + o * ldw + k / Q::BLOCK * Q::BYTES;
      for (int off = 0; off < Q::BYTES; off += 64)
        _mm_prefetch((const char*)blk[o] + QPREFETCH_BYTES + off, _MM_HINT_T0);
      sc[o] = Q::scales(blk[o]);
    }
    for (int e = 0; e < Q::BLOCK; e += LANES) {
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) {
        Vec xv[R];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) xv[r] = vload(x + r * ldx + k + e + p * W);
#pragma GCC unroll 8
        for (int o = 0; o < NO; ++o) {
          const Vec wv = Q::widen(blk[o], sc[o], e + p * W);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) a[r][o][p] = vfma(xv[r], wv, a[r][o][p]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int o = 0; o < NO; ++o)
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) acc[(r * ACC_NO + o) * P + p] = a[r][o][p];
}

// qtile_acc over weight rows O0 .. NO - 1 of a tile of NO, in register tiles of up to QNO.
template <int R, int NO, typename Q, int O0 = 0>
inline void qtile(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t k0,
                  int64_t k1, Vec* acc) {
  constexpr int N = NO - O0 < QNO ? NO - O0 : QNO;
  qtile_acc<R, N, NO, Q>(x, ldx, w + O0 * ldw, ldw, k0, k1, acc + O0 * P);
  if constexpr (O0 + N < NO) qtile<R, NO, Q, O0 + N>(x, ldx, w, ldw, k0, k1, acc);
}

// qtile<g, NO> for a run-time g in [1, G].
template <int G, int NO, typename Q>
inline void qtile_n(int64_t g, const float* x, int64_t ldx, const uint8_t* w, int64_t ldw,
                    int64_t k0, int64_t k1, Vec* acc) {
  if (g == G) {
    qtile<G, NO, Q>(x, ldx, w, ldw, k0, k1, acc);
  } else if constexpr (G > 1) {
    qtile_n<G - 1, NO, Q>(g, x, ldx, w, ldw, k0, k1, acc);
  }
}

// The values [k0, k1) (multiples of the block size) of quantized row w, widened, to out.
template <typename Q>
inline void widen_row(const uint8_t* w, int64_t k0, int64_t k1, float* out) {
  for (int64_t k = k0; k < k1; k += Q::BLOCK) {
    const uint8_t* b = w + k / Q::BLOCK * Q::BYTES;
    const typename Q::Scales s = Q::scales(b);
    for (int e = 0; e < Q::BLOCK; e += W) vstore(out + (k - k0) + e, Q::widen(b, s, e));
  }
}

// As block (cpu_kernels.cpp) for NO quantized weight rows. Up to SMALL_ROWS rows of x the
// weights are widened in registers and meet every row there; more, each K_CHUNK of the
// NO rows is widened once into an L1 buffer that the float32 tiles then read for every
// group of RG rows (the same FMAs on the same values: the same bits).
template <int NO, int RG, typename Q>
void qblock(int64_t R, const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t K,
            float* y, int64_t ldy, const float* bias) {
  constexpr int REG_ROWS = SMALL_ROWS < RG ? SMALL_ROWS : RG;
  alignas(64) Vec acc[MAX_ROWS * NO * P];
  alignas(64) float buf[NO * K_CHUNK];
  for (int64_t s0 = 0; s0 < R; s0 += MAX_ROWS) {
    const int64_t rows = R - s0 < MAX_ROWS ? R - s0 : MAX_ROWS;
    const float* xs = x + s0 * ldx;
    for (int64_t i = 0; i < rows * NO * P; ++i) acc[i] = vzero();
    if (rows <= REG_ROWS) {
      qtile_n<REG_ROWS, NO, Q>(rows, xs, ldx, w, ldw, 0, K, acc);
    } else {
      for (int64_t k0 = 0; k0 < K; k0 += K_CHUNK) {
        const int64_t k1 = K - k0 < K_CHUNK ? K : k0 + K_CHUNK;
        for (int o = 0; o < NO; ++o) widen_row<Q>(w + o * ldw, k0, k1, buf + o * K_CHUNK);
        for (int64_t r0 = 0; r0 < rows; r0 += RG) {
          const int64_t g = rows - r0 < RG ? rows - r0 : RG;
          tile_acc_n<RG, NO>(g, xs + r0 * ldx + k0, ldx, static_cast<const float*>(buf),
                             K_CHUNK, 0, k1 - k0, acc + r0 * NO * P);
        }
      }
    }
    store(rows, NO, acc, y + s0 * ldy, ldy, bias);
  }
}

// As rows_block, for a quantized weight.
template <typename Q, int NB, int RG>
void qrows_block(int64_t R, const float* x, int64_t ldx, const uint8_t* w, int64_t ldw,
                 int64_t K, int64_t o, int64_t out, float* yo, int64_t ldy, const float* bias) {
  const uint8_t* wo = w + o * ldw;
  const float* bo = bias ? bias + o : nullptr;
  if (out - o >= NB) {
    qblock<NB, RG, Q>(R, x, ldx, wo, ldw, K, yo, ldy, bo);
  } else {
    for (int64_t j = 0; j < out - o; ++j)
      qblock<1, TAIL_RG, Q>(R, x, ldx, wo + j * ldw, ldw, K, yo + j, ldy, bo ? bo + j : nullptr);
  }
}

template <typename F>
void with_format(WeightType type, F&& f) {
  switch (type) {
    case kQ8_0: f(Q8_0{}); break;
    case kQ5_0: f(Q5_0{}); break;
    case kQ4_K: f(Q4_K{}); break;
    case kQ6_K: f(Q6_K{}); break;
    default: TORCH_CHECK(false, "weight type ", static_cast<int64_t>(type), " is not quantized");
  }
}

void rows_block_quant(bool small, WeightType type, int64_t R, const float* x, int64_t ldx,
                      const uint8_t* w, int64_t ldw, int64_t K, int64_t o, int64_t out,
                      float* yo, int64_t ldy, const float* bias) {
  with_format(type, [&](auto q) {
    using Q = decltype(q);
    if (small) {
      qrows_block<Q, SMALL_NB, SMALL_RG>(R, x, ldx, w, ldw, K, o, out, yo, ldy, bias);
    } else {
      qrows_block<Q, LARGE_NB, LARGE_RG>(R, x, ldx, w, ldw, K, o, out, yo, ldy, bias);
    }
  });
}

at::Tensor dequantize_blocks(const at::Tensor& blocks_in, int64_t type, int64_t K) {
  TORCH_CHECK(type != 0, "dequantize takes a GGML type");
  const at::Tensor blocks = blocks_in.contiguous();
  const WeightRef wr = weight_ref(blocks, type, K);
  at::Tensor y = at::empty({wr.out, K}, blocks.options().dtype(at::kFloat));
  float* yp = y.mutable_data_ptr<float>();
  const uint8_t* bp = static_cast<const uint8_t*>(wr.data);
  with_format(wr.type, [&](auto q) {
    using Q = decltype(q);
    at::parallel_for(0, wr.out, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) widen_row<Q>(bp + r * wr.ldw, 0, K, yp + r * K);
    });
  });
  return y;
}

// The float32 values of quantized rows `blocks` [rows, bytes of K values] written into
// `out` [rows, K] (contiguous float32, the caller's buffer): one tile of a weight for a
// product of many rows (specserve/engine/tiled_products.py), widened as the kernels widen
// it, without allocating.
void dequantize_into(const at::Tensor& blocks_in, int64_t type, int64_t K, at::Tensor& out) {
  TORCH_CHECK(type != 0, "dequantize_into takes a GGML type");
  const at::Tensor blocks = blocks_in.contiguous();
  const WeightRef wr = weight_ref(blocks, type, K);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.device().is_cpu() && out.is_contiguous() &&
                  out.dim() == 2 && out.size(0) == wr.out && out.size(1) == K,
              "out must be a contiguous float32 CPU matrix [", wr.out, ", ", K, "]");
  float* yp = out.mutable_data_ptr<float>();
  const uint8_t* bp = static_cast<const uint8_t*>(wr.data);
  with_format(wr.type, [&](auto q) {
    using Q = decltype(q);
    at::parallel_for(0, wr.out, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) widen_row<Q>(bp + r * wr.ldw, 0, K, yp + r * K);
    });
  });
}

}  // namespace
