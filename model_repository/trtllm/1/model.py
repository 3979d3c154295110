"""Triton entry point of the TensorRT-LLM role models; the logic lives in engine/triton/trtllm_model.py."""

from engine.triton.trtllm_model import TritonPythonModel  # noqa: F401
