"""Tandem's own CPU kernels, for the places a decode step on CPU loses to PyTorch's dispatch and
oneDNN's generic paths (measured in docs/benchmarks/engine):

- `gemv`: products of a few rows (a decode step, a short prompt) against a weight packed once, at about
  the memory bandwidth for one row and near the multiply-add peak for dozens (fp32);
- `layers`: a pass (a decode step, a prompt of up to 1024 fp32 / 16 bf16 rows) through every layer in one call;
- `attention`: decode attention read straight out of the paged KV pool, with no gather;
- `norm`: a decode step's RMSNorms (with the residual add) in one call each, not eight ops.

Each module's `supports(...)` says whether its kernel applies; callers fall back to PyTorch otherwise.
`build` compiles the C++ sources once into a cache.
"""
