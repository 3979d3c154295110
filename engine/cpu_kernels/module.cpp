// The Python module of Tandem's CPU kernels; each function's contract is in kernels.h.
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y [M, out] = x [M, in] @ W [out, in].T, W packed by gemv.py");
  m.def("rms_norm", &rms_norm, "x += delta (if given), then RMSNorm of x's rows");
  m.def("decode_attention", &decode_attention, "one query row per sequence over its paged context");
  m.def("decode_step_attention", &decode_step_attention, "rotary, K/V write and decode attention of one row each");
  m.def("decode_layers", &decode_layers, "a pass of rows through every decoder layer, each as its own sequence");
}
