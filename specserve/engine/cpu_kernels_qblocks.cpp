// GGML blocks widened to float32 vectors: the vector helpers and one struct per block type
// (Q8_0, Q5_0, Q4_K, Q6_K; GGUF's layout and the reference's float operations are in
// specserve/engine/quant/formats.py). Compiled after cpu_kernels.cpp (its Vec, W, LANES)
// and before cpu_kernels_quant.cpp (the dequantization that uses these), in one unit.
//
// Exactness: a block's values come out as the reference dequantization's float32 values,
// bit for bit: each operation below is the reference's (an exact product, or the one
// rounding of Q4_K's subtraction, which an FMA of an exact product performs identically).
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
inline VecI isub(VecI a, VecI b) { return _mm512_sub_epi32(a, b); }
inline VecI isrli(VecI a, unsigned n) { return _mm512_srli_epi32(a, n); }
inline VecI islli(VecI a, unsigned n) { return _mm512_slli_epi32(a, n); }
// (a & m) | b, one instruction.
inline VecI ior_and(VecI a, VecI m, VecI b) { return _mm512_ternarylogic_epi32(a, m, b, 0xEA); }
inline Vec itof(VecI a) { return _mm512_cvtepi32_ps(a); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
// a * b - c with one rounding (where a * b is exact, the bits of a * b, then - c).
inline Vec vfmsub(Vec a, Vec b, Vec c) { return _mm512_fmsub_ps(a, b, c); }
inline Vec viota() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
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
inline VecI isrli(VecI a, unsigned n) { return _mm256_srli_epi32(a, n); }
inline VecI islli(VecI a, unsigned n) { return _mm256_slli_epi32(a, n); }
inline VecI isrlv(VecI a, VecI n) { return _mm256_srlv_epi32(a, n); }
inline VecI ior_and(VecI a, VecI m, VecI b) { return ior(iand(a, m), b); }
inline VecI iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline Vec itof(VecI a) { return _mm256_cvtepi32_ps(a); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vfmsub(Vec a, Vec b, Vec c) { return _mm256_fmsub_ps(a, b, c); }
#endif

// The float16 at p as float32 (exact).
inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// One struct per block type: BLOCK values in BYTES bytes; scales(b) decodes a block's
// scales once (the float products of formats.py); widen(b, s, e, use) widens the GROUP
// values from e (a multiple of GROUP, itself a multiple of LANES) of that block and calls
// use(v, wv) for each Vec of them in order: wv is values e + v W ... e + v W + W - 1 as
// float32. Callers keep every accumulator's order of k, so the group's decoding may share
// loads and tables across its vectors.
struct Q8_0 {
  static constexpr int BLOCK = 32, BYTES = 34, GROUP = 32;
  struct Scales {
    float d;
  };
  static Scales scales(const uint8_t* b) { return {f16(b)}; }
  template <typename F>
  __attribute__((always_inline)) static void widen(const uint8_t* b, const Scales& s, int e,
                                                   F&& use) {
#pragma GCC unroll 4
    for (int v = 0; v < GROUP / W; ++v) use(v, vmul(itof(iload_i8(b + 2 + e + v * W)), vset1(s.d)));
  }
};

struct Q5_0 {
  static constexpr int BLOCK = 32, BYTES = 22, GROUP = 32;
  struct Scales {
    float d;
    uint32_t qh;  // bit j: the fifth bit of value j
  };
  static Scales scales(const uint8_t* b) {
    Scales s{f16(b), 0};
    std::memcpy(&s.qh, b + 2, 4);
    return s;
  }
  template <typename F>
  __attribute__((always_inline)) static void widen(const uint8_t* b, const Scales& s, int,
                                                   F&& use) {
#if defined(SPECSERVE_AVX512)
    // A 32-entry table t[q] = (q - 16) * d (the reference's product) indexed by the 5-bit
    // q: low nibble from qs, fifth bit rotated from qh into bit 4 of each lane (the
    // permute reads bits 0-4 of an index only).
    const Vec d = vset1(s.d);
    const Vec t0 = vmul(_mm512_setr_ps(-16, -15, -14, -13, -12, -11, -10, -9, -8, -7, -6, -5,
                                       -4, -3, -2, -1),
                        d);
    const Vec t1 = vmul(viota(), d);
    const VecI qh = iset1(static_cast<int32_t>(s.qh));
    const VecI nib = iload_u8(b + 6), low = iset1(15);
    const VecI rot_lo = _mm512_setr_epi32(28, 29, 30, 31, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11);
    const VecI rot_hi = _mm512_add_epi32(rot_lo, iset1(16));
    // (a & 15) | (b & ~15): a's nibble, b's bit 4 (and bits above, which the permute ignores)
    const VecI i0 = _mm512_ternarylogic_epi32(nib, _mm512_rorv_epi32(qh, rot_lo), low, 0xE4);
    const VecI i1 =
        _mm512_ternarylogic_epi32(isrli(nib, 4), _mm512_rorv_epi32(qh, rot_hi), low, 0xE4);
    use(0, _mm512_permutex2var_ps(t0, i0, t1));
    use(1, _mm512_permutex2var_ps(t0, i1, t1));
#else
#pragma GCC unroll 4
    for (int v = 0; v < GROUP / W; ++v) {
      // values 0-15: low nibbles of qs[0..15]; 16-31: their high nibbles
      const int e = v * W;
      const VecI bytes = iload_u8(b + 6 + (e & 15));
      const VecI q4 = e < 16 ? iand(bytes, iset1(15)) : isrli(bytes, 4);
      const VecI high = isrlv(iset1(static_cast<int32_t>(s.qh >> e)), iota());
      const VecI q = isub(ior_and(islli(high, 4), iset1(16), q4), iset1(16));
      use(v, vmul(itof(q), vset1(s.d)));
    }
#endif
  }
};

struct Q4_K {
  static constexpr int BLOCK = 256, BYTES = 144, GROUP = 64;
  struct Scales {
    alignas(64) float d[8];  // per 32-value sub-block: d * sc
    float m[8];              // dmin * m
  };
  static Scales scales(const uint8_t* b) {
    // The eight 6-bit scales and mins as bytes (llama.cpp's get_scale_min_k4, 4 at a time).
    uint32_t u[4];
    std::memcpy(u, b + 4, 12);
    const uint32_t mins_lo = u[1] & 0x3f3f3f3fu;
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);  // m[4..7]
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);         // sc[4..7]
    u[2] = mins_lo;                                                            // m[0..3]
    u[0] &= 0x3f3f3f3fu;                                                       // sc[0..3]
    const float d = f16(b), dmin = f16(b + 2);
    Scales s;
#if defined(SPECSERVE_AVX512)
    const Vec factor = _mm512_mask_blend_ps(0xFF00, vset1(d), vset1(dmin));
    vstore(s.d, vmul(itof(iload_u8(reinterpret_cast<const uint8_t*>(u))), factor));
#else
    vstore(s.d, vmul(itof(iload_u8(reinterpret_cast<const uint8_t*>(u))), vset1(d)));
    vstore(s.m, vmul(itof(iload_u8(reinterpret_cast<const uint8_t*>(u + 2))), vset1(dmin)));
#endif
    return s;
  }
  template <typename F>
  __attribute__((always_inline)) static void widen(const uint8_t* b, const Scales& s, int e,
                                                   F&& use) {
    // Values e .. e + 63: sub-blocks i = e / 32 (low nibbles of qs[32 j ...], j = e / 64)
    // and i + 1 (their high nibbles). w = (d * sc) * q - dmin * m: the product is exact
    // (formats.py), so the fused a * b - c rounds once, as the reference's subtraction.
    const int i = e >> 5;
    const uint8_t* qs = b + 16 + 16 * i;
#if defined(SPECSERVE_AVX512)
    // A 16-entry table per sub-block, t[q] = d1 * q - m1, indexed by the nibble (the
    // permute reads bits 0-3 of an index only, so the low nibble needs no mask).
    const VecI n0 = iload_u8(qs), n1 = iload_u8(qs + 16);
    const Vec t0 = vfmsub(viota(), vset1(s.d[i]), vset1(s.m[i]));
    use(0, _mm512_permutexvar_ps(n0, t0));
    use(1, _mm512_permutexvar_ps(n1, t0));
    const Vec t1 = vfmsub(viota(), vset1(s.d[i + 1]), vset1(s.m[i + 1]));
    use(2, _mm512_permutexvar_ps(isrli(n0, 4), t1));
    use(3, _mm512_permutexvar_ps(isrli(n1, 4), t1));
#else
    VecI n[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      n[c] = iload_u8(qs + c * W);
      use(c, vfmsub(itof(iand(n[c], iset1(15))), vset1(s.d[i]), vset1(s.m[i])));
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
      use(4 + c, vfmsub(itof(isrli(n[c], 4)), vset1(s.d[i + 1]), vset1(s.m[i + 1])));
#endif
  }
};

struct Q6_K {
  static constexpr int BLOCK = 256, BYTES = 210;
#if defined(SPECSERVE_AVX512)
  // A half-block at a time: its 64 ql and 32 qh bytes become one byte per value, 4 (q - 32)
  // as an int8, with a few byte-wide operations for all 128 values; then each Vec of 16
  // is a sign extension, a conversion and the scale's product.
  static constexpr int GROUP = 128;
  static constexpr float QSCALE = 0.25f;  // scales times 1/4 meet 4 (q - 32)
#else
  static constexpr int GROUP = 32;  // one part
  static constexpr float QSCALE = 1.0f;
#endif
  struct Scales {
    // per 16 values: d * scales[j] (* QSCALE: a power of 2, exact, as the product of
    // 4 (q - 32) and a quarter of the scale is then the exact (q - 32) * d * scales[j]
    // of the reference, the sign of zero included)
    alignas(64) float s[16];
  };
  static Scales scales(const uint8_t* b) {
    const Vec d = vset1(f16(b + 208));
    Scales s;
#pragma GCC unroll 2
    for (int j = 0; j < 16; j += W) {
      const Vec sd = vmul(itof(iload_i8(b + 192 + j)), d);
      vstore(s.s + j, QSCALE == 1.0f ? sd : vmul(sd, vset1(QSCALE)));
    }
    return s;
  }
#if defined(SPECSERVE_AVX512)
  // Bytes 16 N .. 16 N + 15 of v (int8) as float32, times scale.
  template <int N>
  __attribute__((always_inline)) static Vec lane(__m512i v, float scale) {
    __m128i bytes;
    if constexpr (N == 0) {
      bytes = _mm512_castsi512_si128(v);
    } else {
      bytes = _mm512_extracti32x4_epi32(v, N);
    }
    return vmul(itof(_mm512_cvtepi8_epi32(bytes)), vset1(scale));
  }
#endif
  template <typename F>
  __attribute__((always_inline)) static void widen(const uint8_t* b, const Scales& s, int e,
                                                   F&& use) {
    // value 128 h + 32 part + l: nibble part / 2 of ql[64 h + 32 (part % 2) + l], bits
    // 2 part, 2 part + 1 of qh[32 h + l]; w = (d * scales[j]) * (q - 32).
    const int h = e >> 7;
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
#if defined(SPECSERVE_AVX512)
    // Byte j of v01: value j of the half (parts 0 and 1: the low nibble of ql[j]); of v23,
    // value 64 + j (the high nibble). Each is (q << 2) ^ 0x80, i.e. the int8 4 (q - 32):
    // the nibble shifted to bits 2-5, qh's two bits of its part to bits 6-7 (word shifts,
    // whose spill into the next byte the masks drop), bits 0-1 cleared, bit 7 flipped.
    const __m512i L = _mm512_loadu_si512(ql);
    const __m512i H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)qh));
    const __m512i nib = _mm512_set1_epi8(0x3C), keep = _mm512_set1_epi8((char)0xFC);
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    // qh bits of parts 0 | 1 (the two 256-bit halves) and 2 | 3 to bits 6-7
    const __m512i h01 = _mm512_sllv_epi16(
        H, _mm512_inserti64x4(_mm512_set1_epi16(6), _mm256_set1_epi16(4), 1));
    const __m512i h23 = _mm512_sllv_epi16(
        H, _mm512_inserti64x4(_mm512_set1_epi16(2), _mm256_set1_epi16(0), 1));
    // (a & nib) | (b & ~nib) (0xE4), then (x & keep) ^ flip (0x6A)
    const __m512i v01 = _mm512_ternarylogic_epi32(
        _mm512_ternarylogic_epi32(_mm512_slli_epi16(L, 2), h01, nib, 0xE4), keep, flip, 0x6A);
    const __m512i v23 = _mm512_ternarylogic_epi32(
        _mm512_ternarylogic_epi32(_mm512_srli_epi16(L, 2), h23, nib, 0xE4), keep, flip, 0x6A);
    const float* sc = s.s + (e >> 4);
    use(0, lane<0>(v01, sc[0]));
    use(1, lane<1>(v01, sc[1]));
    use(2, lane<2>(v01, sc[2]));
    use(3, lane<3>(v01, sc[3]));
    use(4, lane<0>(v23, sc[4]));
    use(5, lane<1>(v23, sc[5]));
    use(6, lane<2>(v23, sc[6]));
    use(7, lane<3>(v23, sc[7]));
#else
    const int part = (e >> 5) & 3;
#pragma GCC unroll 4
    for (int c = 0; c < 32 / W; ++c) {
      const VecI lq = iload_u8(ql + 32 * (part & 1) + c * W);
      const VecI hq = iload_u8(qh + c * W);
      const VecI low = part < 2 ? iand(lq, iset1(15)) : isrli(lq, 4);
      const VecI high = part < 2 ? islli(hq, 4 - 2 * part) : isrli(hq, 2 * part - 4);
      const VecI q = isub(ior_and(high, iset1(0x30), low), iset1(32));
      use(c, vmul(itof(q), vset1(s.s[(e + c * W) >> 4])));
    }
#endif
  }
};

}  // namespace
