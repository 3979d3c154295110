"""Tandem's own CPU kernels, for the places a decode step on CPU loses to PyTorch's dispatch and
oneDNN's generic paths (measured in docs/benchmarks/engine):

- `gemv`: one-row matrix-vector products (a decode step of one sequence) at about the memory bandwidth;
- `attention`: decode attention read straight out of the paged KV pool, with no gather;
- `norm`: a decode step's RMSNorms (with the residual add) in one call each, not eight ops.

Each module's `supports(...)` says whether its kernel applies; callers fall back to PyTorch otherwise.
`build` compiles the C++ sources once into a cache.
"""
