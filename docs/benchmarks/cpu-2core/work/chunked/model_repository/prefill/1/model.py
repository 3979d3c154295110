"""Triton entry point of the `prefill` model; the logic lives in engine/triton/prefill_model.py."""

from engine.triton.prefill_model import TritonPythonModel  # noqa: F401
