// GGML block-quantized weights in the CPU kernels: Q8_0, Q5_0, Q4_K and Q6_K rows (GGUF's
// layout; formats and float operations in specserve/engine/quant/formats.py), widened to
// float32 in registers by cpu_kernels_qblocks.cpp and multiplied by the tile code of
// cpu_kernels.cpp; the three sources are one compilation unit, in that order.
//
// Exactness: a weight vector is widened with the reference's float operations (each exact
// or one rounding, see formats.py), and then meets x in the same FMAs, lanes and order as
// a float32 weight does in tile_acc: every product gives the bits of the float32 kernel
// on the dequantized matrix, for any row count.
namespace {

// As tile_acc, for NO quantized weight rows (ldw bytes apart) whose accumulators are
// lane sets (r * ACC_NO + o) of acc; k0 and k1 are multiples of the block size. Each
// weight row's group of values is widened once and meets every row of x (read from L1)
// in order of k, so each lane sees its products in the float32 kernel's order.
template <int R, int NO, int ACC_NO, typename Q>
__attribute__((always_inline)) inline void qtile_acc(const float* x, int64_t ldx,
                                                     const uint8_t* w, int64_t ldw, int64_t k0,
                                                     int64_t k1, Vec* acc) {
  static_assert(Q::GROUP % LANES == 0 && Q::BLOCK % Q::GROUP == 0, "groups of whole lane sets");
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
    // Prefetch the next tile's rows (a contiguous weight's rows lie back to back, so they
    // start at w + NO ldw) into L2, NO blocks' bytes a step: all of them while this tile
    // runs, far enough ahead to hide the memory's latency, as a row-local stream is not.
    const char* ahead = (const char*)(w + NO * ldw) + k / Q::BLOCK * NO * Q::BYTES;
    for (int off = 0; off < NO * Q::BYTES; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int o = 0; o < NO; ++o) {
      blk[o] = w + o * ldw + k / Q::BLOCK * Q::BYTES;
      sc[o] = Q::scales(blk[o]);
    }
#pragma GCC unroll 8
    for (int e = 0; e < Q::BLOCK; e += Q::GROUP) {
      const float* xe = x + k + e;
#pragma GCC unroll 8
      for (int o = 0; o < NO; ++o) {
        Q::widen(blk[o], sc[o], e, [&](int v, Vec wv) {
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r)
            a[r][o][v % P] = vfma(vload(xe + r * ldx + v * W), wv, a[r][o][v % P]);
        });
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

// qtile_acc over weight rows O0 .. NO - 1 of a tile of NO, in register tiles of up to
// qno(R).
template <int R, int NO, typename Q, int O0 = 0>
inline void qtile(const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t k0,
                  int64_t k1, Vec* acc) {
  constexpr int N = NO - O0 < qno(R) ? NO - O0 : qno(R);
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
    float* o = out + (k - k0);
#pragma GCC unroll 8
    for (int e = 0; e < Q::BLOCK; e += Q::GROUP)
      Q::widen(b, s, e, [&](int v, Vec wv) { vstore(o + e + v * W, wv); });
  }
}

// As block (cpu_kernels.cpp) for NO quantized weight rows. Up to REG_ROWS rows of x the
// weights are widened in registers and meet every row there; more, each K_CHUNK of the
// NO rows is widened once into an L1 buffer that the float32 tiles then read for every
// group of RG rows (the same FMAs on the same values: the same bits).
template <int NO, int RG, int REG_ROWS, typename Q>
void qblock(int64_t R, const float* x, int64_t ldx, const uint8_t* w, int64_t ldw, int64_t K,
            float* y, int64_t ldy, const float* bias) {
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

// As rows_block, for a quantized weight; REG_ROWS as in qblock.
template <typename Q, int NB, int RG, int REG_ROWS>
void qrows_block(int64_t R, const float* x, int64_t ldx, const uint8_t* w, int64_t ldw,
                 int64_t K, int64_t o, int64_t out, float* yo, int64_t ldy, const float* bias) {
  const uint8_t* wo = w + o * ldw;
  const float* bo = bias ? bias + o : nullptr;
  if (out - o >= NB) {
    qblock<NB, RG, REG_ROWS, Q>(R, x, ldx, wo, ldw, K, yo, ldy, bo);
  } else {
    for (int64_t j = 0; j < out - o; ++j)
      qblock<1, TAIL_RG, REG_ROWS, Q>(R, x, ldx, wo + j * ldw, ldw, K, yo + j, ldy,
                                      bo ? bo + j : nullptr);
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
    // Rows of x in registers: the small blocking's tile (R <= SMALL_ROWS), else QREG_ROWS.
    constexpr int SMALL_REG = SMALL_ROWS < SMALL_RG ? SMALL_ROWS : SMALL_RG;
    if (small) {
      qrows_block<Q, SMALL_NB, SMALL_RG, SMALL_REG>(R, x, ldx, w, ldw, K, o, out, yo, ldy, bias);
    } else {
      qrows_block<Q, LARGE_NB, LARGE_RG, QREG_ROWS>(R, x, ldx, w, ldw, K, o, out, yo, ldy, bias);
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
