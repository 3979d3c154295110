"""Triton entry point of the `decode` model; the logic lives in engine/triton/decode_model.py."""

from engine.triton.decode_model import TritonPythonModel  # noqa: F401
