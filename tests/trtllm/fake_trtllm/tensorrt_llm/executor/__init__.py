"""NOT TensorRT-LLM (see the package docstring)."""
