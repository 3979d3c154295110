"""The prepared device check (`scripts/gpu-check`): one command on one GPU, a table and a JSON file.

See docs/gpu.md for what it measures and how to run it; `--dry-run` runs every section small on CPU.
"""
