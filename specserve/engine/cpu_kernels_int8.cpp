// Integer-dot products of GGML block-quantized weights (Q4_K, Q6_K, Q5_0, Q8_0) with
// activations quantized per row to 8-bit blocks, as llama.cpp multiplies them: Q4_K and
// Q6_K weights meet 256-value activation blocks (one float scale each, plus the sums of
// every 16 values: llama.cpp's Q8_K), Q5_0 and Q8_0 weights 32-value blocks (Q8_0 with a
// float32 scale). Compiled after cpu_kernels.cpp and cpu_kernels_qblocks.cpp (f16) in
// one unit; specserve/engine/cpu_kernels.py documents the ops.
//
// Batch invariance by construction: an output y[r, o] is one function of row r of x and
// weight row o. A row is quantized alone (its blocks' scales are its own); its dot
// product with a weight row runs the same instructions on the same values whatever the
// row count, the register tile (rows of x that share one decoding of the weights), the
// weight-row blocking or the thread split: exact int32 sums per 256- or 32-value block,
// then one float FMA per block (or two for Q4_K's mins) into 8 lanes, in order of k, and
// a fixed-order sum of the 8 lanes. So a verify row has the bits of a one-token step.
//
// One kernel per block type, 256-bit vectors on every x86 ISA; only the integer
// multiply-add differs: AVX2's maddubs + madd (+ add) or, with VNNI (AVX512-VNNI + VL),
// maddubs + vpdpwssd and vpdpbusd. Integer sums are exact and no pair sum saturates
// (|u8 x i8| pairs stay below 32767: weights <= 128 in magnitude as u8, activations in
// [-127, 127]), so both builds give the same int32 lanes, the same float operations on
// them, and the same bits.
namespace {

constexpr int QK = 256;  // values per K-quant block (and per 256-block of activations)
constexpr int Q0 = 32;   // values per Q5_0 / Q8_0 block (and per 32-block of activations)
constexpr int TILE_ROWS = 8;  // rows of x that share one decoding of a weight block
constexpr int WEIGHT_ROWS = 16;  // weight rows per unit of the thread split (L2-resident)

#if defined(SPECSERVE_VNNI)
// acc + madd(s, p): pairs of int16 multiplied, summed into int32 lanes.
inline __m256i madd_add(__m256i acc, __m256i s, __m256i p) { return _mm256_dpwssd_epi32(acc, s, p); }
// Lane i: u[4i..4i+3] . s[4i..4i+3], u unsigned, s signed bytes.
inline __m256i dot_u8i8(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}
#else
inline __m256i madd_add(__m256i acc, __m256i s, __m256i p) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(s, p));
}
inline __m256i dot_u8i8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif

inline __m256i load256(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }

// Pins an accumulator: the empty asm says v changed here, so the compiler keeps each
// addition where the source puts it. Integer additions are associative, and GCC
// otherwise regroups an unrolled run of them into a tree: every product of the run is
// computed first and spilled to the stack (16 ymm registers on AVX2). Pinned, the adds
// stay interleaved with the products and fewer accumulators spill (Q6_K's 8-row products
// 5-10% faster at 5-9 rows on the EPYC). Exact integer sums: no bit changes.
#if defined(__AVX512F__)
inline void pin(__m256i& v) { __asm__("" : "+v"(v)); }
#else
inline void pin(__m256i& v) { __asm__("" : "+x"(v)); }
#endif

// Software prefetch of the weight bytes 2 KiB ahead of a block of `bytes` (a weight
// row's blocks, and the next rows, lie back to back): a few percent at 1-5 rows here,
// as for the float32 kernels (the hardware streamers restart at every 4 KiB page).
constexpr int PREFETCH_AHEAD = 2048;
inline void prefetch_ahead(const uint8_t* blk, int bytes) {
  for (int off = 0; off < bytes; off += 64)
    _mm_prefetch((const char*)blk + PREFETCH_AHEAD + off, _MM_HINT_T0);
}

// The sum of 8 float lanes in one fixed order: (l + l+4), then + 2, + 1.
inline float hsum8(__m256 v) {
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(t2) + _mm_cvtss_f32(_mm_shuffle_ps(t2, t2, 1));
}

// The activations x [R, K] as 8-bit blocks, each row quantized alone: block b of row r
// holds q = round-to-nearest-even(x * (127 / amax)) (amax: the block's largest
// magnitude; q in [-127, 127]) and d = amax / 127, so x ~ d q. For 256-value blocks also
// the 16 sums of 16 consecutive q (the K-quants' mins and offsets are products with them).
struct Q8Rows {
  int64_t K = 0;
  std::vector<int8_t> q256, q32;  // [R, K] each, when that block size is needed
  std::vector<float> d256, d32;   // [R, K / 256], [R, K / 32]
  std::vector<int16_t> s256;      // [R, K / 16]
  std::vector<int16_t> s32;       // [R, K / 32]: sums of 32 q, with the 256-value blocks
  std::vector<int16_t> s32_0;     // [R, K / 32]: sums of the 32-value blocks' q
};

// The largest |x[i]| of n (a multiple of 8) floats; max is exact, so order is free.
inline float absmax(const float* x, int n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

// Quantizes n (a multiple of 32) floats to q; returns the scale d.
inline float quantize_block(const float* x, int n, int8_t* q) {
  const float amax = absmax(x, n);
  const __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < n; i += 32) {
    __m256i v[4];
    for (int j = 0; j < 4; ++j)  // the MXCSR's default rounding: to nearest, ties to even
      v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), id));
    // pack with saturation (a no-op: |v| <= 127) and undo the packs' lane interleaving
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                         _mm256_packs_epi32(v[2], v[3]));
    _mm256_storeu_si256((__m256i*)(q + i), _mm256_permutevar8x32_epi32(b, order));
  }
  return amax / 127.0f;
}

void quantize_rows(const float* x, int64_t ldx, int64_t R, int64_t K, bool need256, bool need32,
                   Q8Rows& a) {
  a.K = K;
  if (need256) {
    a.q256.resize(R * K), a.d256.resize(R * K / QK), a.s256.resize(R * K / 16);
    a.s32.resize(R * K / 32);
  }
  if (need32) a.q32.resize(R * K), a.d32.resize(R * K / Q0), a.s32_0.resize(R * K / Q0);
  at::parallel_for(0, R, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * ldx;
      if (need256) {
        int8_t* q = a.q256.data() + r * K;
        for (int64_t b = 0; b < K / QK; ++b) a.d256[r * (K / QK) + b] = quantize_block(xr + b * QK, QK, q + b * QK);
        int16_t* s = a.s256.data() + r * (K / 16);
        for (int64_t g = 0; g < K / 16; ++g) {
          int sum = 0;
          for (int i = 0; i < 16; ++i) sum += q[g * 16 + i];
          s[g] = static_cast<int16_t>(sum);
        }
        for (int64_t g = 0; g < K / 32; ++g)
          a.s32[r * (K / 32) + g] = static_cast<int16_t>(s[2 * g] + s[2 * g + 1]);
      }
      if (need32) {
        int8_t* q = a.q32.data() + r * K;
        for (int64_t b = 0; b < K / Q0; ++b) {
          a.d32[r * (K / Q0) + b] = quantize_block(xr + b * Q0, Q0, q + b * Q0);
          int sum = 0;
          for (int i = 0; i < Q0; ++i) sum += q[b * Q0 + i];
          a.s32_0[r * (K / Q0) + b] = static_cast<int16_t>(sum);
        }
      }
    }
  });
}

// One struct per weight type: dot<R>(w, nb, a, r0, out, ldo) sets out[r * ldo] (r < R) to
// the dot product of weight row w (nb blocks) with activation row r0 + r. Each decodes a
// weight block once (into registers) and meets the R rows with it.

// Q4_K: w = (d sc_i) q - (dmin m_i) per 32-value sub-block i, q a nibble; against a
// 256-block (d8, q8): d d8 sum_i sc_i (q . q8)_i - dmin d8 sum_i m_i sum(q8)_i.
struct Q4KDot {
  static constexpr int BYTES = 144;
  static constexpr bool ACT256 = true;
  // The eight 6-bit scales (bytes 0-7) and mins (8-15) of a block (get_scale_min_k4).
  static void scales_mins(const uint8_t* b, uint8_t* sm) {
    uint32_t u[4];
    std::memcpy(u, b + 4, 12);
    const uint32_t mins_lo = u[1] & 0x3f3f3f3fu;
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = mins_lo;
    u[0] &= 0x3f3f3f3fu;
    std::memcpy(sm, u, 16);
  }
  template <int R>
  static void dot(const uint8_t* w, int64_t nb, const Q8Rows& a, int64_t r0, float* out,
                  int64_t ldo) {
    const int64_t K = a.K;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * BYTES;
      prefetch_ahead(blk, BYTES);
      alignas(16) uint8_t sm[16];
      scales_mins(blk, sm);
      const float dw = f16(blk), dminw = f16(blk + 2);
      __m256i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {  // values 64 j .. 64 j + 63: sub-blocks 2 j, 2 j + 1
        const __m256i bits = load256(blk + 16 + 32 * j);
        const __m256i ql = _mm256_and_si256(bits, m4);
        const __m256i qh = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        const __m256i sl = _mm256_set1_epi16(sm[2 * j]), sh = _mm256_set1_epi16(sm[2 * j + 1]);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* q8 = a.q256.data() + (r0 + r) * K + b * QK + 64 * j;
          sumi[r] = madd_add(sumi[r], sl, _mm256_maddubs_epi16(ql, load256(q8)));
          sumi[r] = madd_add(sumi[r], sh, _mm256_maddubs_epi16(qh, load256(q8 + 32)));
          pin(sumi[r]);
        }
      }
      // int16 lanes 2 i, 2 i + 1: m_i, against the sums of values 32 i .. 32 i + 31
      const __m128i m8 = _mm_loadl_epi64((const __m128i*)(sm + 8));
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float d8 = a.d256[(r0 + r) * (K / QK) + b];
        const __m256i bsums = load256(a.s256.data() + (r0 + r) * (K / 16) + b * 16);
        const __m256i summ = _mm256_madd_epi16(mins, bsums);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * d8), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(-(dminw * d8)), _mm256_cvtepi32_ps(summ), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = hsum8(acc[r]);
  }
};

// Q6_K: w = (d sc_j) (q - 32) per 16 values j, q six bits; against a 256-block:
// d d8 (sum_j sc_j (q . q8)_j - 32 sum_j sc_j sum(q8)_j).
struct Q6KDot {
  static constexpr int BYTES = 210;
  static constexpr bool ACT256 = true;
  template <int R>
  static void dot(const uint8_t* w, int64_t nb, const Q8Rows& a, int64_t r0, float* out,
                  int64_t ldo) {
    const int64_t K = a.K;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * BYTES;
      prefetch_ahead(blk, BYTES);
      const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
      const float dw = f16(blk + 208);
      __m256i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {  // values 128 h + 32 s + l: s = part, l < 32
        const __m256i l0 = load256(blk + 64 * h), l1 = load256(blk + 64 * h + 32);
        const __m256i hb = load256(blk + 128 + 32 * h);
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) {
          const __m256i low = s == 0   ? _mm256_and_si256(l0, m4)
                              : s == 1 ? _mm256_and_si256(l1, m4)
                              : s == 2 ? _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4)
                                       : _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4);
          const __m256i high =
              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * s), m2), 4);
          const __m256i q6 = _mm256_or_si256(low, high);  // 0 .. 63
          const int j = 8 * h + 2 * s;  // scales of values l < 16 and l >= 16
          const __m256i scv =
              _mm256_setr_m128i(_mm_set1_epi16(sc[j]), _mm_set1_epi16(sc[j + 1]));
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const int8_t* q8 = a.q256.data() + (r0 + r) * K + b * QK + 128 * h + 32 * s;
            sumi[r] = madd_add(sumi[r], scv, _mm256_maddubs_epi16(q6, load256(q8)));
            pin(sumi[r]);
          }
        }
      }
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)sc));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float d8 = a.d256[(r0 + r) * (K / QK) + b];
        const __m256i bsums = load256(a.s256.data() + (r0 + r) * (K / 16) + b * 16);
        const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bsums), 5);
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * d8),
                                 _mm256_cvtepi32_ps(_mm256_sub_epi32(sumi[r], offset)), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = hsum8(acc[r]);
  }
};

// Q4_K repacked, 8 weight rows at a time (kQ4_K_X8, made by repack_q4_k_x8 at load): per
// 256 values, X8_BYTES bytes for the 8 rows w:
//   d[8], dmin[8]     float16                 (bytes 0-31)
//   sc[8 i][8 w]      6-bit scales as bytes    (32-95)
//   m[8 i][8 w]       6-bit mins as bytes      (96-159)
//   qs[4 j][8 t][8 w][4]  bytes 32 j + 4 t .. + 3 of row w's qs (160-1183): low nibbles
//                     values 64 j + 4 t .., of sub-block 2 j; high nibbles 32 later
// A 32-byte load holds 4 values of 8 rows; it meets 4 activations of one row broadcast,
// so each unsigned-by-signed pair sum is one row's. Eight such products of a sub-block
// add up in int16 (|sum| <= 8 * 2 * 15 * 127 < 32768) before the one madd with the 8
// rows' scales: 8 maddubs + 1 madd per 8 rows x 32 values x 1 row, where the row-major
// layout needs a madd per maddubs. The 8 lanes of a result are the 8 weight rows' outputs
// (no horizontal sums); each lane sees its blocks in order with the same float operations
// for any row count.
constexpr int X8_BYTES = 1184;
constexpr int X8_TILE = 6;

inline __m256i bcast32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Lanes (2 w, 2 w + 1) of the result: byte w of p (8 bytes), as int16.
inline __m256i pairs16(const uint8_t* p) {
  const __m128i v = _mm_loadl_epi64((const __m128i*)p);
  return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
}

struct Q4KX8Dot {
  static constexpr bool ACT256 = true;
  static constexpr int ROWS = 8;  // weight rows per call of dot
  // out[r * ldo + w] (w < 8, r < R): weight rows of group g with activation row r0 + r.
  template <int R>
  static void dot(const uint8_t* g, int64_t nb, const Q8Rows& a, int64_t r0, float* out,
                  int64_t ldo) {
    const int64_t K = a.K;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = g + b * X8_BYTES;
      prefetch_ahead(blk, X8_BYTES);
      const __m256 vd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
      const __m256 vdmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16)));
      const uint8_t* sc = blk + 32;
      const uint8_t* mn = blk + 96;
      const uint8_t* qs = blk + 160;
      __m256i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
      // sub-block i = 2 j + h: nibble h of the bytes of j; 2 R + 4 registers in the loop
      const auto sub_block = [&](int i) {
        const int j = i >> 1, h = i & 1;
        __m256i acc16[R];
        for (int r = 0; r < R; ++r) acc16[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int t = 0; t < 8; ++t) {
          const __m256i bits = load256(qs + (j * 8 + t) * 32);
          const __m256i q4 = _mm256_and_si256(h ? _mm256_srli_epi16(bits, 4) : bits, m4);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const int8_t* q8 = a.q256.data() + (r0 + r) * K + b * QK + 32 * i + 4 * t;
            acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(q4, bcast32(q8)));
            pin(acc16[r]);
          }
        }
        const __m256i scv = pairs16(sc + 8 * i);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          sumi[r] = madd_add(sumi[r], scv, acc16[r]);
          pin(sumi[r]);
        }
      };
      // one or two rows: unrolled (h a constant, no branch per load: one-row products
      // 1-6% faster on the EPYC); more rows: rolled (unrolled, 4% slower there)
      if constexpr (R <= 2) {
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) sub_block(i);
      } else {
        for (int i = 0; i < 8; ++i) sub_block(i);
      }
      // mins: lane w gets sum_i m[w][i] * (sum of row r's values of sub-block i)
      __m256i mp[4];
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m128i a0 = _mm_loadl_epi64((const __m128i*)(mn + 16 * p));
        const __m128i a1 = _mm_loadl_epi64((const __m128i*)(mn + 16 * p + 8));
        mp[p] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a0, a1));
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const int16_t* s32 = a.s32.data() + (r0 + r) * (K / 32) + b * 8;
        __m256i summ = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
          int32_t pair;
          std::memcpy(&pair, s32 + 2 * p, 4);
          summ = madd_add(summ, mp[p], _mm256_set1_epi32(pair));
        }
        const __m256 v = _mm256_fmsub_ps(vd, _mm256_cvtepi32_ps(sumi[r]),
                                         _mm256_mul_ps(vdmin, _mm256_cvtepi32_ps(summ)));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(a.d256[(r0 + r) * (K / QK) + b]), v, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
  }
};

// Q6_K repacked, 8 weight rows at a time (kQ6_K_X8, repack_q6_k_x8): per 256 values,
// Q6_X8_BYTES bytes (8 x 210: no byte more than the rows themselves):
//   d[8]                    float16                                 (bytes 0-15)
//   sc[16 j][8 w]           int8 scales                             (16-143)
//   ql[2 h][2 u][8 t][8 w][4]  row w's ql[64 h + 32 u + 4 t ..]       (144-1167)
//   qh[2 h][8 t][8 w][4]       row w's qh[32 h + 4 t ..]              (1168-1679)
// Value 128 h + 32 s + l (part s, l = 4 t + e) is the nibble s / 2 of ql[64 h + 32 (s % 2)
// + l] with bits 2 s, 2 s + 1 of qh[32 h + l] above it: q in [0, 63], w = d sc (q - 32).
// A product pair sum is at most 2 * 63 * 127, so two add up in int16 before the madd with
// the 16-value sub-block's scales; the offset -32 is taken once per block from the
// activation sums of 16.
constexpr int Q6_X8_BYTES = 1680;

struct Q6KX8Dot {
  template <int R>
  static void dot(const uint8_t* g, int64_t nb, const Q8Rows& a, int64_t r0, float* out,
                  int64_t ldo) {
    const int64_t K = a.K;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = g + b * Q6_X8_BYTES;
      prefetch_ahead(blk, Q6_X8_BYTES);
      const __m256 vd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
      const uint8_t* sc = blk + 16;
      const uint8_t* ql = blk + 144;
      const uint8_t* qh = blk + 1168;
      __m256i sumi[R];
      for (int r = 0; r < R; ++r) sumi[r] = _mm256_setzero_si256();
      // half h, part s; s and tp unrolled, so the decoding's shifts and masks are constants
      // (one row: 2x the products a second on the EPYC; the 1.5B's step 5% faster)
      for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
#pragma GCC unroll 4
        for (int tp = 0; tp < 8; tp += 2) {  // t = tp, tp + 1: one half of a sub-block
          __m256i q[2];
#pragma GCC unroll 2
          for (int e = 0; e < 2; ++e) {
            const int t = tp + e;
            const __m256i qlc = load256(ql + ((h * 2 + (s & 1)) * 8 + t) * 32);
            const __m256i qhc = load256(qh + (h * 8 + t) * 32);
            const __m256i nib = _mm256_and_si256(s < 2 ? qlc : _mm256_srli_epi16(qlc, 4), m4);
            const __m256i hb = s == 0   ? _mm256_slli_epi16(qhc, 4)
                               : s == 1 ? _mm256_slli_epi16(qhc, 2)
                               : s == 2 ? qhc
                                        : _mm256_srli_epi16(qhc, 2);
            q[e] = _mm256_or_si256(nib, _mm256_and_si256(hb, m30));
          }
          const int j = 8 * h + 2 * s + (tp >> 2);
          const __m128i sj = _mm_loadl_epi64((const __m128i*)(sc + 8 * j));
          const __m256i scv = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sj, sj));
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const int8_t* q8 = a.q256.data() + (r0 + r) * K + b * QK + 128 * h + 32 * s + 4 * tp;
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(q[0], bcast32(q8)),
                                               _mm256_maddubs_epi16(q[1], bcast32(q8 + 4)));
            sumi[r] = madd_add(sumi[r], scv, p);
            pin(sumi[r]);
          }
        }
      }
      // the offset: lane w gets 32 sum_j sc[w][j] * (sum of row r's 16 values of j)
      __m256i off[R];
      for (int r = 0; r < R; ++r) off[r] = _mm256_setzero_si256();
      for (int p = 0; p < 8; ++p) {
        const __m128i s0 = _mm_loadl_epi64((const __m128i*)(sc + 16 * p));
        const __m128i s1 = _mm_loadl_epi64((const __m128i*)(sc + 16 * p + 8));
        const __m256i scp = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s0, s1));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int16_t* bs = a.s256.data() + (r0 + r) * (K / 16) + b * 16 + 2 * p;
          int32_t pair;
          std::memcpy(&pair, bs, 4);
          off[r] = madd_add(off[r], scp, _mm256_set1_epi32(pair));
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i total = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32(off[r], 5));
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(a.d256[(r0 + r) * (K / QK) + b]),
                                 _mm256_mul_ps(vd, _mm256_cvtepi32_ps(total)), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
  }
};

// Q5_0 repacked, 8 weight rows at a time (kQ5_0_X8, repack_q5_0_x8): per 32 values,
// Q5_X8_BYTES bytes (8 x 22):
//   d[8]              float16                          (bytes 0-15)
//   qh[8]             row w's 32 fifth bits, uint32    (16-47)
//   qs[4 t][8 w][4]   row w's qs[4 t .. 4 t + 3]        (48-175): low nibbles values
//                     4 t + e, high nibbles 16 + 4 t + e
// q = nibble | fifth bit << 4 in [0, 31] meets 4 activations broadcast; four products of
// a half-block add up in int16 (4 * 2 * 31 * 127 < 32768), the offset -16 comes from the
// activation block's sum, and one float FMA a block takes the 8 rows' d times the
// activation scale.
constexpr int Q5_X8_BYTES = 176;

struct Q5_0X8Dot {
  template <int R>
  static void dot(const uint8_t* g, int64_t nb, const Q8Rows& a, int64_t r0, float* out,
                  int64_t ldo) {
    const int64_t K = a.K;
    const __m256i m4 = _mm256_set1_epi8(0x0F), b5 = _mm256_set1_epi8(0x10);
    const __m256i ones = _mm256_set1_epi16(1);
    // the 4 bits of a 4-value group within its qh byte, as byte masks
    const __m256i bits_lo = _mm256_set1_epi32(0x08040201), bits_hi = _mm256_set1_epi32(0x80402010);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = g + b * Q5_X8_BYTES;
      prefetch_ahead(blk, Q5_X8_BYTES);
      const __m256 vd = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)blk));
      const __m256i qh = load256(blk + 16);
      const uint8_t* qs = blk + 48;
      __m256i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {  // values 16 half + 4 t + e
        __m256i acc16[R];
        for (int r = 0; r < R; ++r) acc16[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
          const __m256i c = load256(qs + 32 * t);
          const __m256i nib = _mm256_and_si256(half ? _mm256_srli_epi16(c, 4) : c, m4);
          // byte e of lane w: qh_w's byte (16 half + 4 t) / 8, then its bit 4 (t & 1) + e
          const int byte = 2 * half + (t >> 1);
          const __m256i lanes = _mm256_add_epi8(_mm256_set1_epi8((char)byte), _mm256_set_epi8(
              12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0,
              12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0));
          const __m256i mask = (t & 1) ? bits_hi : bits_lo;
          const __m256i set = _mm256_cmpeq_epi8(
              _mm256_and_si256(_mm256_shuffle_epi8(qh, lanes), mask), mask);
          const __m256i q = _mm256_or_si256(nib, _mm256_and_si256(set, b5));
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const int8_t* q8 = a.q32.data() + (r0 + r) * K + b * Q0 + 16 * half + 4 * t;
            acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(q, bcast32(q8)));
            pin(acc16[r]);
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          isum[r] = madd_add(isum[r], ones, acc16[r]);
          pin(isum[r]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t ab = (r0 + r) * (K / Q0) + b;
        const __m256i total = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(16 * a.s32_0[ab]));
        acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(vd, _mm256_set1_ps(a.d32[ab])),
                                 _mm256_cvtepi32_ps(total), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * ldo, acc[r]);
  }
};

// The skeleton of every repack: GGUF blocks [out, K / values * src_bytes] of `type` ->
// [out padded to 8, K / values * group_bytes / 8], one group of 8 rows a block after
// another; place(dst, src, w) writes row w's block src into its group's block dst.
// Padding rows stay zeros (scales 0: outputs 0).
template <typename F>
at::Tensor repack_x8(const at::Tensor& blocks_in, WeightType type, int64_t K, int values,
                     int src_bytes, int group_bytes, F&& place) {
  const at::Tensor blocks = blocks_in.contiguous();
  const WeightRef wr = weight_ref(blocks, type, K);
  const int64_t nb = K / values, out8 = (wr.out + 7) / 8 * 8;
  at::Tensor y = at::empty({out8, nb * (group_bytes / 8)}, blocks.options());
  uint8_t* yp = y.mutable_data_ptr<uint8_t>();
  std::memset(yp, 0, y.numel());
  const uint8_t* bp = static_cast<const uint8_t*>(wr.data);
  at::parallel_for(0, out8 / 8, 16, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < nb; ++b)
        for (int w = 0; w < 8 && g * 8 + w < wr.out; ++w)
          place(yp + g * 8 * nb * (group_bytes / 8) + b * group_bytes,
                bp + (g * 8 + w) * wr.ldw + b * src_bytes, w);
  });
  return y;
}

// Q5_0 blocks -> the layout of Q5_0X8Dot.
at::Tensor repack_q5_0_x8(const at::Tensor& blocks, int64_t K) {
  return repack_x8(blocks, kQ5_0, K, Q0, 22, Q5_X8_BYTES,
                   [](uint8_t* dst, const uint8_t* src, int w) {
                     std::memcpy(dst + 2 * w, src, 2);
                     std::memcpy(dst + 16 + 4 * w, src + 2, 4);
                     for (int t = 0; t < 4; ++t)
                       std::memcpy(dst + 48 + (t * 8 + w) * 4, src + 6 + 4 * t, 4);
                   });
}

// T::dot<n> for a run-time n in [1, G] (Q4KX8Dot, Q6KX8Dot).
template <typename T, int G = X8_TILE>
inline void x8_dot_n(int64_t n, const uint8_t* w, int64_t nb, const Q8Rows& a, int64_t r0,
                     float* out, int64_t ldo) {
  if (n == G) {
    T::template dot<G>(w, nb, a, r0, out, ldo);
  } else if constexpr (G > 1) {
    x8_dot_n<T, G - 1>(n, w, nb, a, r0, out, ldo);
  }
}

// Q6_K blocks -> the layout of Q6KX8Dot.
at::Tensor repack_q6_k_x8(const at::Tensor& blocks, int64_t K) {
  return repack_x8(blocks, kQ6_K, K, QK, Q6KDot::BYTES, Q6_X8_BYTES,
                   [](uint8_t* dst, const uint8_t* src, int w) {
                     std::memcpy(dst + 2 * w, src + 208, 2);
                     for (int j = 0; j < 16; ++j) dst[16 + 8 * j + w] = src[192 + j];
                     for (int h = 0; h < 2; ++h)
                       for (int t = 0; t < 8; ++t) {
                         for (int u = 0; u < 2; ++u)
                           std::memcpy(dst + 144 + (((h * 2 + u) * 8 + t) * 8 + w) * 4,
                                       src + 64 * h + 32 * u + 4 * t, 4);
                         std::memcpy(dst + 1168 + ((h * 8 + t) * 8 + w) * 4,
                                     src + 128 + 32 * h + 4 * t, 4);
                       }
                   });
}

// Q4_K blocks -> the layout of Q4KX8Dot.
at::Tensor repack_q4_k_x8(const at::Tensor& blocks, int64_t K) {
  return repack_x8(blocks, kQ4_K, K, QK, Q4KDot::BYTES, X8_BYTES,
                   [](uint8_t* dst, const uint8_t* src, int w) {
                     std::memcpy(dst + 2 * w, src, 2);
                     std::memcpy(dst + 16 + 2 * w, src + 2, 2);
                     alignas(16) uint8_t sm[16];
                     Q4KDot::scales_mins(src, sm);
                     for (int i = 0; i < 8; ++i) {
                       dst[32 + 8 * i + w] = sm[i];
                       dst[96 + 8 * i + w] = sm[8 + i];
                     }
                     for (int j = 0; j < 4; ++j)
                       for (int t = 0; t < 8; ++t)
                         std::memcpy(dst + 160 + ((j * 8 + t) * 8 + w) * 4,
                                     src + 16 + 32 * j + 4 * t, 4);
                   });
}

// The 32-value block types: a block decodes to 32 signed bytes wq (w = d wq) and meets a
// 32-block of activations (d8, q8) as d d8 (wq . q8), the sign moved onto q8 so that an
// unsigned-by-signed byte product applies (llama.cpp's trick).
template <typename Decode>
struct Block32Dot {
  static constexpr int BYTES = Decode::BYTES;
  static constexpr bool ACT256 = false;
  template <int R>
  static void dot(const uint8_t* w, int64_t nb, const Q8Rows& a, int64_t r0, float* out,
                  int64_t ldo) {
    const int64_t K = a.K;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + b * BYTES;
      prefetch_ahead(blk, BYTES);
      const float dw = f16(blk);
      const __m256i wq = Decode::bytes(blk);
      const __m256i mag = _mm256_sign_epi8(wq, wq);  // |wq| (-128 stays 0x80: 128 unsigned)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256i q8 = load256(a.q32.data() + (r0 + r) * K + b * Q0);
        const __m256i sumi = dot_u8i8(mag, _mm256_sign_epi8(q8, wq));
        const float d8 = a.d32[(r0 + r) * (K / Q0) + b];
        acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * d8), _mm256_cvtepi32_ps(sumi), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r * ldo] = hsum8(acc[r]);
  }
};

struct Q8_0Bytes {
  static constexpr int BYTES = 34;
  static __m256i bytes(const uint8_t* b) { return load256(b + 2); }
};

struct Q5_0Bytes {
  static constexpr int BYTES = 22;
  // q - 16 for q = nibble | fifth bit << 4: values 0-15 from the low nibbles of qs,
  // 16-31 from the high ones; a byte whose fifth bit is clear gets 0xF0 (nibble - 16).
  static __m256i bytes(const uint8_t* b) {
    const __m128i qs = _mm_loadu_si128((const __m128i*)(b + 6));
    const __m256i nib =
        _mm256_and_si256(_mm256_setr_m128i(qs, _mm_srli_epi16(qs, 4)), _mm256_set1_epi8(0x0F));
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    // byte j: bit j of qh, spread (one byte per bit) and compared
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(static_cast<int32_t>(qh)),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i set = _mm256_cmpeq_epi8(
        _mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
    return _mm256_or_si256(nib, _mm256_andnot_si256(set, _mm256_set1_epi8((char)0xF0)));
  }
};

// T::dot<n> for a run-time n in [1, G].
template <typename T, int G = TILE_ROWS>
inline void dot_n(int64_t n, const uint8_t* w, int64_t nb, const Q8Rows& a, int64_t r0,
                  float* out, int64_t ldo) {
  if (n == G) {
    T::template dot<G>(w, nb, a, r0, out, ldo);
  } else if constexpr (G > 1) {
    dot_n<T, G - 1>(n, w, nb, a, r0, out, ldo);
  }
}

template <typename F>
void with_dot(WeightType type, F&& f) {
  switch (type) {
    case kQ4_K: f(Q4KDot{}); break;
    case kQ6_K: f(Q6KDot{}); break;
    case kQ5_0: f(Block32Dot<Q5_0Bytes>{}); break;
    case kQ8_0: f(Block32Dot<Q8_0Bytes>{}); break;
    default: TORCH_CHECK(false, "weight type ", static_cast<int64_t>(type), " is not quantized");
  }
}

inline bool act256(WeightType type) {
  return type == kQ4_K || type == kQ6_K || type == kQ4_K_X8 || type == kQ6_K_X8;
}

// y[r, o - o0] (+ bias[o]) for all R rows of x and weight rows [o0, o1) of w: rows of x
// in register tiles of TILE_ROWS, every tile meeting every weight row (the caller's
// WEIGHT_ROWS rows stay in L2 across tiles).
void q8_rows(const WeightRef& w, const Q8Rows& a, int64_t R, int64_t o0, int64_t o1, float* y,
             int64_t ldy, const float* bias) {
  if (R == 0) return;
  if (w.type == kQ4_K_X8 || w.type == kQ6_K_X8 || w.type == kQ5_0_X8) {  // groups of 8 rows
    const int64_t nb = a.K / (w.type == kQ5_0_X8 ? Q0 : QK);
    const uint8_t* wp = static_cast<const uint8_t*>(w.data);
    const int64_t tiles = (R + X8_TILE - 1) / X8_TILE, size = (R + tiles - 1) / tiles;
    for (int64_t r0 = 0; r0 < R; r0 += size) {
      const int64_t n = R - r0 < size ? R - r0 : size;
      for (int64_t o = o0; o < o1; o += 8)
        if (w.type == kQ4_K_X8) {
          x8_dot_n<Q4KX8Dot>(n, wp + o * w.ldw, nb, a, r0, y + r0 * ldy + (o - o0), ldy);
        } else if (w.type == kQ5_0_X8) {
          x8_dot_n<Q5_0X8Dot>(n, wp + o * w.ldw, nb, a, r0, y + r0 * ldy + (o - o0), ldy);
        } else {
          x8_dot_n<Q6KX8Dot>(n, wp + o * w.ldw, nb, a, r0, y + r0 * ldy + (o - o0), ldy);
        }
    }
  } else {
  with_dot(w.type, [&](auto t) {
    using T = decltype(t);
    const int64_t nb = a.K / (T::ACT256 ? QK : Q0);
    const uint8_t* wp = static_cast<const uint8_t*>(w.data);
    // tiles of equal size (9 rows: 5 + 4, not 8 + 1): the same decodings, fewer idle lanes
    const int64_t tiles = (R + TILE_ROWS - 1) / TILE_ROWS, size = (R + tiles - 1) / tiles;
    for (int64_t r0 = 0; r0 < R; r0 += size) {
      const int64_t n = R - r0 < size ? R - r0 : size;
      for (int64_t o = o0; o < o1; ++o)
        dot_n<T>(n, wp + o * w.ldw, nb, a, r0, y + r0 * ldy + (o - o0), ldy);
    }
  });
  }
  if (bias)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t o = o0; o < o1; ++o) y[r * ldy + (o - o0)] += bias[o];
}

// Checks x and returns it with unit column stride.
at::Tensor q8_input(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be a float32 CPU matrix");
  return x.stride(1) == 1 ? x : x.contiguous();
}

// x [R, K] times each quantized ws[i] [out_i, K] (GGML type types[i]) (+ bs[i]), any R:
// the results side by side in one [R, sum out_i] buffer, returned as column views.
std::vector<at::Tensor> q8_linears(const at::Tensor& x_in, at::TensorList ws_in,
                                   at::IntArrayRef types,
                                   const c10::List<std::optional<at::Tensor>>& bs) {
  const at::Tensor x = q8_input(x_in);
  TORCH_CHECK(bs.size() == ws_in.size() && types.size() == ws_in.size(),
              "one type and one bias entry (or None) per weight");
  const int64_t R = x.size(0), K = x.size(1);
  const size_t n = ws_in.size();
  std::vector<at::Tensor> ws(ws_in.begin(), ws_in.end()), keep;
  std::vector<WeightRef> wr(n);
  std::vector<const float*> bp(n, nullptr);
  std::vector<int64_t> col(n + 1, 0), first(n + 1, 0);
  bool need256 = false, need32 = false;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(types[i] != 0, "q8_linears takes quantized weights only");
    if (!ws[i].is_contiguous()) ws[i] = ws[i].contiguous();
    wr[i] = weight_ref(ws[i], types[i], K);
    (act256(wr[i].type) ? need256 : need32) = true;
    const std::optional<at::Tensor> b = bs.get(i);
    if (b.has_value() && b->defined()) {
      TORCH_CHECK(b->numel() == wr[i].out && b->scalar_type() == at::kFloat && b->device().is_cpu(),
                  "each bias must be a float32 CPU vector [out] or None");
      keep.push_back(b->contiguous());
      bp[i] = keep.back().const_data_ptr<float>();
    }
    col[i + 1] = col[i] + wr[i].out;
    first[i + 1] = first[i] + (wr[i].out + WEIGHT_ROWS - 1) / WEIGHT_ROWS;
  }
  Q8Rows a;
  quantize_rows(x.const_data_ptr<float>(), x.stride(0), R, K, need256, need32, a);
  at::Tensor y = at::empty({R, col[n]}, x.options());
  float* yp = y.mutable_data_ptr<float>();
  const int64_t ldy = col[n];
  // Threads only when each gets at least ~64 KiB of weights (a tiny product is not worth
  // waking them) or the rows make the work compute-bound.
  const int64_t bytes = WEIGHT_ROWS * (wr.empty() ? 1 : std::max<int64_t>(wr[0].ldw, 1));
  const int64_t grain = std::max<int64_t>(1, 65536 / (bytes * std::max<int64_t>(R, 1)));
  at::parallel_for(0, first[n], grain, [&](int64_t b0, int64_t b1) {
    size_t i = 0;
    for (int64_t blk = b0; blk < b1; ++blk) {
      while (blk >= first[i + 1]) ++i;
      const int64_t o0 = (blk - first[i]) * WEIGHT_ROWS;
      const int64_t o1 = std::min<int64_t>(o0 + WEIGHT_ROWS, wr[i].out);
      q8_rows(wr[i], a, R, o0, o1, yp + col[i] + o0, ldy, bp[i] ? bp[i] : nullptr);
    }
  });
  std::vector<at::Tensor> views;
  views.reserve(n);
  for (size_t i = 0; i < n; ++i) views.push_back(y.narrow(1, col[i], wr[i].out));
  return views;
}

// silu(x @ wg.T) * (x @ wu.T) for quantized gate and up weights (types tg, tu), any R.
at::Tensor q8_gate_up_silu(const at::Tensor& x_in, const at::Tensor& wg_in, int64_t tg,
                           const at::Tensor& wu_in, int64_t tu) {
  const at::Tensor x = q8_input(x_in);
  TORCH_CHECK(tg != 0 && tu != 0, "q8_gate_up_silu takes quantized weights only");
  const at::Tensor wg = wg_in.contiguous(), wu = wu_in.contiguous();
  const int64_t R = x.size(0), K = x.size(1);
  const WeightRef gr = weight_ref(wg, tg, K), ur = weight_ref(wu, tu, K);
  const int64_t I = gr.out;
  TORCH_CHECK(ur.out == I, "gate and up must have the same rows [I, K]");
  Q8Rows a;
  quantize_rows(x.const_data_ptr<float>(), x.stride(0), R, K,
                act256(gr.type) || act256(ur.type), !act256(gr.type) || !act256(ur.type), a);
  at::Tensor y = at::empty({R, I}, x.options());
  float* yp = y.mutable_data_ptr<float>();
  const int64_t blocks = (I + WEIGHT_ROWS - 1) / WEIGHT_ROWS;
  const int64_t grain =
      std::max<int64_t>(1, 65536 / (2 * WEIGHT_ROWS * gr.ldw * std::max<int64_t>(R, 1)));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> g(R * WEIGHT_ROWS), u(R * WEIGHT_ROWS);  // [R, WEIGHT_ROWS]
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t o0 = blk * WEIGHT_ROWS, o1 = std::min<int64_t>(o0 + WEIGHT_ROWS, I);
      q8_rows(gr, a, R, o0, o1, g.data(), WEIGHT_ROWS, nullptr);
      q8_rows(ur, a, R, o0, o1, u.data(), WEIGHT_ROWS, nullptr);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < o1 - o0; ++j) {
          const float gv = g[r * WEIGHT_ROWS + j];
          yp[r * I + o0 + j] = gv / (1.0f + std::exp(-gv)) * u[r * WEIGHT_ROWS + j];
        }
    }
  });
  return y;
}

}  // namespace
