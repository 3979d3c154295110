// The Python module of Tandem's CPU kernels; each function's contract is in kernels.h. Every kernel runs
// without the GIL, as PyTorch's own ops do (decode_layers releases it itself and takes it back for its
// per-layer callback), so the caller's other Python threads run meanwhile.
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("gemv", &gemv, "y [M, out] = x [M, in] @ W [out, in].T, W packed by gemv.py", NoGil());
  m.def("rms_norm", &rms_norm, "x += delta (if given), then RMSNorm of x's rows", NoGil());
  m.def("decode_attention", &decode_attention, "one query row per sequence over its paged context", NoGil());
  m.def("decode_step_attention", &decode_step_attention, "rotary, K/V write and decode attention of one row each",
        NoGil());
  m.def("decode_layers", &decode_layers, "a pass of rows through every decoder layer, each as its own sequence");
}
