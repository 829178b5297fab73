// One decoder layer of quantized weights as one op (after the other sources, in the same
// unit): the ops a decode or verify step runs per layer, called from C++ instead of from
// Python. It calls the very functions the separate ops call, in the same order, on the
// same values, so a layer gives the bits of the Python loop over those ops (the engine's
// tests compare them bit for bit); what it removes is ~15 Python-level calls per layer.
#include <ATen/ops/add.h>

namespace {

// The first `out` columns of a kernel result whose weight rows were padded (a repacked
// weight's rows are a multiple of 8): a view, as the Python wrapper's `y[:, :out]`.
inline at::Tensor first_columns(const at::Tensor& y, int64_t out) {
  return y.size(1) == out ? y : y.narrow(1, 0, out);
}

// h + attention(rms_norm(h)) then + mlp(rms_norm(...)), as CausalLM's layer with the
// kernels: ws = [q, k, v, o, gate, up, down] blocks as the integer kernels read them,
// types their type codes, outs their output widths before any row padding, bs the q, k
// and v biases (padded alike, or None), norms the input and post-attention norm weights.
// The attention arguments are rope_cache_attention's but its soft-cap (none: a Llama
// layer has no cap); head_dim splits q, k, v into heads.
at::Tensor decoder_layer(const at::Tensor& h, at::TensorList ws, at::IntArrayRef types,
                         at::IntArrayRef outs, const c10::List<std::optional<at::Tensor>>& bs,
                         at::TensorList norms, double eps, int64_t head_dim,
                         const at::Tensor& positions, const at::Tensor& inv_freq,
                         double rope_scale, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& write_slots, const at::Tensor& read_slots,
                         const at::Tensor& token_session, int64_t window) {
  TORCH_CHECK(ws.size() == 7 && types.size() == 7 && outs.size() == 7,
              "a layer has 7 weights: q, k, v, o, gate, up, down");
  TORCH_CHECK(bs.size() == 3 && norms.size() == 2, "3 bias entries (q, k, v) and 2 norms");
  TORCH_CHECK(h.dim() == 2 && head_dim > 0, "h must be [tokens, hidden]");
  const int64_t T = h.size(0);
  const at::Tensor x = rms_norm(h, norms[0], eps);
  const std::vector<at::Tensor> qkv =
      q8_linears(x, ws.slice(0, 3), types.slice(0, 3), bs);
  const at::Tensor q = first_columns(qkv[0], outs[0]).view({T, -1, head_dim});
  const at::Tensor k = first_columns(qkv[1], outs[1]).view({T, -1, head_dim});
  const at::Tensor v = first_columns(qkv[2], outs[2]).view({T, -1, head_dim});
  const at::Tensor attn = rope_cache_attention(q, k, v, positions, inv_freq, rope_scale, k_cache,
                                               v_cache, write_slots, read_slots, token_session,
                                               window, /*softcap=*/0.0);
  const c10::List<std::optional<at::Tensor>> none({std::nullopt});
  const at::Tensor o = q8_linears(attn, ws.slice(3, 1), types.slice(3, 1), none)[0];
  const at::Tensor h1 = at::add(h, first_columns(o, outs[3]));
  const at::Tensor x2 = rms_norm(h1, norms[1], eps);
  const at::Tensor gu = first_columns(q8_gate_up_silu(x2, ws[4], types[4], ws[5], types[5]),
                                      outs[4]);
  const at::Tensor d = q8_linears(gu, ws.slice(6, 1), types.slice(6, 1), none)[0];
  return at::add(h1, first_columns(d, outs[6]));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(LIBNAME, m) {
  m.def(
      "decoder_layer(Tensor h, Tensor[] ws, int[] types, int[] outs, Tensor?[] bs, "
      "Tensor[] norms, float eps, int head_dim, Tensor positions, Tensor inv_freq, "
      "float rope_scale, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor write_slots, "
      "Tensor read_slots, Tensor token_session, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(LIBNAME, CPU, m) { m.impl("decoder_layer", &decoder_layer); }
