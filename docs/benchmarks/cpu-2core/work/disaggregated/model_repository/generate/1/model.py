"""Triton entry point of the `generate` model; the logic lives in engine/triton/generate_model.py."""

from engine.triton.generate_model import TritonPythonModel  # noqa: F401
