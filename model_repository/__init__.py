"""Triton model-repository templates rendered by `tandem repo` (see builder/repo.py).

Each model is `<name>/config.pbtxt` (with ${key} placeholders) and `<name>/1/model.py`, a one-line
import of the engine's adapter. Rendering fails on any placeholder left unfilled.
"""
