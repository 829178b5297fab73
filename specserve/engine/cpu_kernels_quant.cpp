// GGML block-quantized weights widened to float32: the reference dequantization's bits
// (Q8_0, Q5_0, Q4_K, Q6_K; GGUF's layout and the float operations are in
// specserve/engine/quant/formats.py), with the block structs of cpu_kernels_qblocks.cpp.
// The engine's products of quantized weights are cpu_kernels_int8.cpp's.
namespace {

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

}  // namespace
