// RoPE, the paged KV-cache write and causal GQA attention of a few new tokens (a decode or
// verify step), one op; compiled after cpu_kernels.cpp in the same unit. 256-bit vectors
// on every ISA (the AVX-512 builds run the same instructions), so both builds give the
// same bits.
//
// Batch invariance: a token's output is a function of its own query, its position and
// the cache rows it reads, computed by the same operations in the same order however
// many tokens share the call, so a verify row has the bits of a one-token step. Keys are
// scored 8 at a time (lane j of a vector is key j0 + j); each lane's dot product and its
// reduction run the same operations whatever the other lanes hold, and so does a score's
// soft-cap (Gemma 2: tanh256, lane by lane, before the max and the softmax).
namespace {

// out = x * cos + rotate_half(x) * sin for one head of D = 2 * half values.
inline void rotate(const float* x, const float* c, const float* s, int64_t half, float* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    out[i] = a * c[i] - b * s[i];
    out[i + half] = b * c[i] + a * s[i];
  }
}

// e^x in 8 lanes, within ~2 ulp of the exact value for x in [-87, 88] (Cody-Waite
// reduction x = n ln 2 + r, |r| <= ln 2 / 2, and a degree-6 polynomial of r, as in
// Cephes' expf); 0 below -87 (no subnormal results: a subnormal lane would slow every
// sum that meets it). Attention calls it on scores minus their maximum (x <= 0).
inline __m256 exp256(__m256 x) {
  const __m256 too_small = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(too_small, _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n)));
}

// tanh(x) in 8 lanes, each lane by the same operations whatever the others hold: for
// |x| < 0.25 the odd Taylor polynomial to x^9 (the next term is below 1e-8 of |x| there),
// else sign(x) (1 - e) / (1 + e) with e = e^(-2|x|) (exp256: 0 past |x| = 43.5, giving
// +-1; 1 - e keeps at least 0.39 there, so no cancellation). Within a few ulp of tanh.
// Attention's score soft-cap calls it.
inline __m256 tanh256(__m256 x) {
  const __m256 sign = _mm256_and_ps(x, _mm256_set1_ps(-0.0f));
  const __m256 ax = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 e = exp256(_mm256_mul_ps(ax, _mm256_set1_ps(-2.0f)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  const __m256 x2 = _mm256_mul_ps(ax, ax);
  __m256 p = _mm256_set1_ps(62.0f / 2835.0f);
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-17.0f / 315.0f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.0f / 15.0f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-1.0f / 3.0f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, x2), ax, ax);
  const __m256 is_small = _mm256_cmp_ps(ax, _mm256_set1_ps(0.25f), _CMP_LT_OQ);
  return _mm256_or_ps(sign, _mm256_blendv_ps(big, small, is_small));
}

// Lane j: the sum of the 8 lanes of a[j], each as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) +
// (l6 + l7)) whatever j is.
inline __m256 sum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The sum of 8 lanes in one fixed order.
inline float hsum256(__m256 v) {
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(t2) + _mm_cvtss_f32(_mm_shuffle_ps(t2, t2, 1));
}

constexpr int KEYS = 8;  // keys scored per vector (one lane each)

// out[h, d0 : d0 + 8 C] = sum_j w[h, j] v_j[d0 : d0 + 8 C] over the n value rows (j in
// order) for NH heads (w's rows n8 apart, out's D apart): the NH x C accumulators stay
// in registers, so each value row's chunk is read once for all the heads.
template <int NH, int C>
inline void head_values(const float* w, int64_t n8, const float* v, int64_t stride,
                        const int64_t* slots, int64_t n, int64_t D, float* out) {
  __m256 acc[NH][C];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) acc[h][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* vrow = v + slots[j] * stride;
    __m256 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = _mm256_loadu_ps(vrow + 8 * c);
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const __m256 wv = _mm256_set1_ps(w[h * n8 + j]);
      for (int c = 0; c < C; ++c) acc[h][c] = _mm256_fmadd_ps(wv, vv[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(out + h * D + 8 * c, acc[h][c]);
}

// head_values<nh, C> for a run-time nh in [1, MAXH].
constexpr int MAXH = 6;
template <int C, int NH = MAXH>
inline void head_values_n(int64_t nh, const float* w, int64_t n8, const float* v,
                          int64_t stride, const int64_t* slots, int64_t n, int64_t D,
                          float* out) {
  if (nh == NH) {
    head_values<NH, C>(w, n8, v, stride, slots, n, D, out);
  } else if constexpr (NH > 1) {
    head_values_n<C, NH - 1>(nh, w, n8, v, stride, slots, n, D, out);
  }
}

// Attention of one token's G query heads q [G, D] (after RoPE) over its n cache rows
// (slots: their cache slots; row stride KH * D, this kv head's offset already applied to
// kc, vc): out [G, D] = softmax(cap(q k^T * scale)) v, w a scratch of G * n8 floats,
// cap(s) = softcap * tanh(s / softcap) where softcap > 0 (Gemma 2), else s. D is a
// multiple of 8.
void attend(const float* q, int64_t G, int64_t D, const float* kc, const float* vc,
            int64_t stride, const int64_t* slots, int64_t n, float scale, float softcap,
            float* w, float* out) {
  const int64_t n8 = (n + KEYS - 1) / KEYS * KEYS;
  // Scores, 8 keys at a time (a short last group repeats its first key; those lanes are
  // never read).
  for (int64_t j0 = 0; j0 < n; j0 += KEYS) {
    const float* krow[KEYS];
    for (int j = 0; j < KEYS; ++j) krow[j] = kc + slots[j0 + j < n ? j0 + j : j0] * stride;
    for (int64_t h = 0; h < G; ++h) {
      __m256 acc[KEYS];
      for (int j = 0; j < KEYS; ++j) acc[j] = _mm256_setzero_ps();
      const float* qh = q + h * D;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qh + d);
#pragma GCC unroll 8
        for (int j = 0; j < KEYS; ++j)
          acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(krow[j] + d), acc[j]);
      }
      __m256 score = _mm256_mul_ps(sum8x8(acc), _mm256_set1_ps(scale));
      if (softcap > 0.0f) {  // per lane, before the max and the softmax
        const __m256 cap = _mm256_set1_ps(softcap);
        score = _mm256_mul_ps(tanh256(_mm256_div_ps(score, cap)), cap);
      }
      _mm256_storeu_ps(w + h * n8 + j0, score);
    }
  }
  // Softmax per head: max and exp in 8 lanes, the lanes summed in a fixed order.
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t h = 0; h < G; ++h) {
    float* wh = w + h * n8;
    __m256 mv = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 8) {
      const __m256 valid = _mm256_castsi256_ps(
          _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j)), lane));
      mv = _mm256_max_ps(mv, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(wh + j), valid));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 zv = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
      const __m256 valid = _mm256_castsi256_ps(
          _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j)), lane));
      const __m256 e = _mm256_and_ps(valid, exp256(_mm256_sub_ps(_mm256_loadu_ps(wh + j), m)));
      _mm256_storeu_ps(wh + j, e);
      zv = _mm256_add_ps(zv, e);
    }
    const __m256 rz = _mm256_set1_ps(1.0f / hsum256(zv));
    for (int64_t j = 0; j < n; j += 8) _mm256_storeu_ps(wh + j, _mm256_mul_ps(_mm256_loadu_ps(wh + j), rz));
  }
  // out[h] = sum_j w[h, j] v_j, j in order, for up to MAXH heads and 16 values of a row
  // at a time (8 for an odd last chunk).
  for (int64_t h0 = 0; h0 < G; h0 += MAXH) {
    const int64_t nh = std::min<int64_t>(MAXH, G - h0);
    const float* wh = w + h0 * n8;
    float* oh = out + h0 * D;
    int64_t d0 = 0;
    for (; d0 + 16 <= D; d0 += 16)
      head_values_n<2>(nh, wh, n8, vc + d0, stride, slots, n, D, oh + d0);
    if (d0 < D) head_values_n<1>(nh, wh, n8, vc + d0, stride, slots, n, D, oh + d0);
  }
}

// One attention step for a few new tokens over a paged KV cache, as the decoder's
// torch path computes it (RoPE, cache write, causal SDPA with GQA, optional window, each
// score soft-capped to softcap * tanh(score / softcap) where softcap > 0, 0: no cap):
//   q [T, H, D], k and v [T, KH, D] (views with unit last stride; D a multiple of 8) are
//   the projections of the T packed new tokens; positions [T] their absolute positions;
//   token_session [T] the row of read_slots [B, L] (each session's slots by position)
//   each belongs to. K (after RoPE) and V go to k_cache / v_cache [S, KH, D] at
//   write_slots [T] first, so a token sees the keys of the new tokens before it.
//   Returns [T, H * D].
at::Tensor rope_cache_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& positions_in, const at::Tensor& inv_freq_in,
                                double rope_scale, at::Tensor& k_cache, at::Tensor& v_cache,
                                const at::Tensor& write_slots_in, const at::Tensor& read_slots_in,
                                const at::Tensor& token_session_in, int64_t window,
                                double softcap) {
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: no cap)");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [T, heads, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KH = k.size(1), half = D / 2;
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->size(0) == T &&
                    t->size(2) == D && t->stride(2) == 1,
                "q, k, v must be float32 CPU [T, heads, D] with unit last stride");
  TORCH_CHECK(v.size(1) == KH && KH > 0 && H % KH == 0 && D % 8 == 0,
              "bad head counts (or a head size that is not a multiple of 8)");
  for (const at::Tensor* c : {&k_cache, &v_cache})
    TORCH_CHECK(c->scalar_type() == at::kFloat && c->is_contiguous() && c->dim() == 3 &&
                    c->size(1) == KH && c->size(2) == D,
                "caches must be contiguous float32 [slots, KH, D]");
  const at::Tensor positions = positions_in.contiguous(), write_slots = write_slots_in.contiguous();
  const at::Tensor read_slots = read_slots_in.contiguous();
  const at::Tensor token_session = token_session_in.contiguous();
  const at::Tensor inv_freq = inv_freq_in.contiguous();
  TORCH_CHECK(inv_freq.scalar_type() == at::kFloat && inv_freq.numel() == half, "bad inv_freq");
  for (const at::Tensor* t : {&positions, &write_slots, &token_session})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == T, "bad index tensor");
  TORCH_CHECK(read_slots.scalar_type() == at::kLong && read_slots.dim() == 2, "bad read_slots");
  const int64_t B = read_slots.size(0), L = read_slots.size(1), S = k_cache.size(0);
  const int64_t* pos = positions.const_data_ptr<int64_t>();
  const int64_t* wslot = write_slots.const_data_ptr<int64_t>();
  const int64_t* rslot = read_slots.const_data_ptr<int64_t>();
  const int64_t* sess = token_session.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sess[t] >= 0 && sess[t] < B && pos[t] >= 0 && pos[t] < L && wslot[t] >= 0 &&
                    wslot[t] < S,
                "token ", t, " has an index outside the cache");
  const float* inv = inv_freq.const_data_ptr<float>();
  float* kc = k_cache.mutable_data_ptr<float>();
  float* vc = v_cache.mutable_data_ptr<float>();
  at::Tensor qr = at::empty({T, H, D}, q.options());
  float* qrp = qr.mutable_data_ptr<float>();
  // RoPE on q (into qr) and k (straight into the cache); v into the cache.
  std::vector<float> cs(half), sn(half);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = (float)pos[t] * inv[i];
      cs[i] = std::cos(a) * (float)rope_scale;
      sn[i] = std::sin(a) * (float)rope_scale;
    }
    const float* qt = q.const_data_ptr<float>() + t * q.stride(0);
    for (int64_t h = 0; h < H; ++h)
      rotate(qt + h * q.stride(1), cs.data(), sn.data(), half, qrp + (t * H + h) * D);
    const float* kt = k.const_data_ptr<float>() + t * k.stride(0);
    const float* vt = v.const_data_ptr<float>() + t * v.stride(0);
    for (int64_t g = 0; g < KH; ++g) {
      rotate(kt + g * k.stride(1), cs.data(), sn.data(), half, kc + (wslot[t] * KH + g) * D);
      std::copy(vt + g * v.stride(1), vt + g * v.stride(1) + D, vc + (wslot[t] * KH + g) * D);
    }
  }
  // Attention per (token, kv head): the G query heads of a group share each K / V row read.
  const int64_t G = H / KH;
  const float sm_scale = 1.0f / std::sqrt((float)D);
  at::Tensor out = at::empty({T, H * D}, q.options());
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, T * KH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> w;
    for (int64_t idx = i0; idx < i1; ++idx) {
      const int64_t t = idx / KH, g = idx % KH, p = pos[t];
      const int64_t lo = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0, n = p - lo + 1;
      w.resize(G * ((n + KEYS - 1) / KEYS * KEYS));
      attend(qrp + (t * H + g * G) * D, G, D, kc + g * D, vc + g * D, KH * D,
             rslot + sess[t] * L + lo, n, sm_scale, (float)softcap, w.data(),
             op + t * H * D + g * G * D);
    }
  });
  return out;
}

}  // namespace
