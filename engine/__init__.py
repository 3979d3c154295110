"""The runtime both role engines execute: a paged-KV PyTorch engine for Llama-family decoders.

Importing this package is cheap; torch is imported by the submodules that need it.
"""
