"""Tandem: prefill/decode disaggregated LLM serving on Triton Inference Server.

This package is the small shared core that `builder`, `engine` and `orchestrator` all use: role names,
the KV page layout and its compatibility rule, the engine manifest schema and the wire messages. It
imports nothing heavy (no torch, no Triton), so any process can use it.
"""

__version__ = "0.1.0"
