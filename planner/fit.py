"""Least-squares fits of pass-time models to measured points, with every coefficient >= 0.

A pass-time model is linear in a few features (a constant, tokens, attention work, ...). Times span
milliseconds to seconds, so the fit minimises *relative* error: each row is divided by its measured
time. Negative coefficients would predict impossible (negative or shrinking) times outside the
measured range, so the fit is non-negative least squares, solved exactly by trying every subset of
features (models have at most 4, so at most 15 small solves) and keeping the best subset whose
unconstrained solution is non-negative.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FitResult:
    coefficients: tuple[float, ...]  # one per feature column, each >= 0
    max_rel_error: float  # max |predicted - measured| / measured over the points
    mean_rel_error: float


def nonnegative_fit(features: np.ndarray, seconds: np.ndarray) -> FitResult:
    """features: [n_points, n_features], seconds: [n_points] (> 0) -> the best non-negative fit.

    Raises ValueError when there are no points or a time is not positive.
    """
    features = np.asarray(features, dtype=np.float64)  # [N, K]
    seconds = np.asarray(seconds, dtype=np.float64)  # [N]
    if features.ndim != 2 or features.shape[0] != seconds.shape[0] or features.shape[0] == 0:
        raise ValueError(f"need a [points, features] matrix and one time per point; got {features.shape} "
                         f"and {seconds.shape}")
    if np.any(seconds <= 0):
        raise ValueError("every measured time must be > 0 seconds")
    n, k = features.shape
    weighted = features / seconds[:, None]  # [N, K]: rows scaled so the residual is relative error
    ones = np.ones(n)
    best: tuple[float, np.ndarray] | None = None
    for size in range(1, min(k, n) + 1):
        for cols in itertools.combinations(range(k), size):
            sol, *_ = np.linalg.lstsq(weighted[:, cols], ones, rcond=None)  # [size]
            if np.any(sol < 0):
                continue
            coef = np.zeros(k)
            coef[list(cols)] = sol
            err = float(np.sum((weighted @ coef - ones) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, coef)
    if best is None:  # cannot happen (a single column always has a >= 0 solution); kept as a clear error
        raise ValueError("no non-negative fit exists for these points")
    coef = best[1]
    rel = np.abs(features @ coef - seconds) / seconds  # [N]
    return FitResult(tuple(float(c) for c in coef), float(rel.max()), float(rel.mean()))
