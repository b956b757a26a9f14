// The Python module of the native CPU kernels: every entry point of csrc/, bound once here
// (one torch extension built from all the sources, see `lmprog_runtime/native.py`).
#include <torch/extension.h>

#include "native_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU, float32 or bfloat16)");
  m.def("extend_attention", &extend_attention,
        "causal extend attention over the paged pool (CPU, bfloat16; AMX tiles or AVX512-BF16)");
  m.def("extend_attention_available", &extend_attention_available,
        "whether extend_attention can run here, on AMX tiles (amx=True) or AVX512-BF16");
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU, float32 or bfloat16)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm of residual");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up over a fused [rows, 2 * inter] input");
  m.def("rope_", &rope_, "in-place rotate-half RoPE on q and k");
  m.def("q8_0_linear", &q8_0_linear, "x @ w.T over Q8_0 blocks");
  m.def("q4_1_linear", &q4_1_linear, "x @ w.T over Q4_1 blocks");
  m.def("quantized_dense_rows", &quantized_dense_rows,
        "rows from which a quantized layer runs as a dense matmul over its dequantized weight");
  m.def("q8_0_dequantize", &q8_0_dequantize, "Q8_0 blocks to a dense float32 / bfloat16 matrix");
  m.def("q4_1_dequantize", &q4_1_dequantize, "Q4_1 blocks to a dense float32 / bfloat16 matrix");
  m.def("w8a8_quantize_rows", &w8a8_quantize_rows,
        "rows rounded to int8 with one scale each: (int8 [rows, in], float32 [rows])");
  m.def("w8a8_packed_available", &w8a8_packed_available,
        "whether w8a8_linear's packed-weight kernel (AVX512-VNNI) is in this build");
  m.def("w8a8_packed_max_rows", &w8a8_packed_max_rows,
        "up to how many rows w8a8_linear multiplies through the packed weight");
  m.def("w8a8_pack", &w8a8_pack, "an int8 weight [out, in] packed for w8a8_linear's VNNI kernel "
        "(gated: a fused gate/up weight for w8a8_gated)", py::arg("qweight"), py::arg("gated") = false);
  m.def("w8a8_gated", &w8a8_gated,
        "silu(gate) * up of a gated MLP from x and its fused gate/up weight packed gated");
  m.def("w8a8_linear", &w8a8_linear,
        "x @ w.T + bias over an int8 weight with per-output scales, x rounded to int8 per row",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("packed") = py::none(),
        py::arg("bias") = py::none(), py::arg("out_float32") = false);
  m.def("amx_linear_available", &amx_linear_available, "whether amx_linear can run here");
  m.def("amx_linear_max_rows", &amx_linear_max_rows,
        "up to how many rows amx_linear beats a dense matmul on this CPU");
  m.def("amx_linear", &amx_linear, "x @ w.T + bias over a weight packed for AMX tiles (CPU, bfloat16)",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.def("amx_gated_available", &amx_gated_available,
        "whether amx_gated can run here (AVX512-BF16 dot products)");
  m.def("amx_gated", &amx_gated,
        "silu(x @ gate.T) * (x @ up.T) over a fused gate/up weight packed by pairs (CPU, bfloat16)",
        py::arg("x"), py::arg("packed"));
  register_decode_stack(m);
}
