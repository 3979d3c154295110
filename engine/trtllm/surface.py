"""The TensorRT-LLM API surface Tandem relies on (api_surface.json beside this file), and the startup
check of an installed `tensorrt_llm` against it.

The JSON records, for one pinned release, the import paths, the fields of `DisaggregatedParams` and
`SamplingParams` the adapter sets, the `LlmArgs` fields a role YAML may hold, and the source files
(path and commit) they were read from. The mapping tests check the adapter against it; a worker
checks the installed package against it before it loads a model, so a drifted API fails the model's
load with the names that differ instead of failing requests later.
"""

from __future__ import annotations

import functools
import json
import os

PATH = os.path.join(os.path.dirname(__file__), "api_surface.json")


class SurfaceMismatch(RuntimeError):
    """The installed tensorrt_llm lacks names Tandem's adapter uses; the message lists them."""


@functools.cache
def surface() -> dict:
    with open(PATH, encoding="utf-8") as f:
        return json.load(f)


def release() -> str:
    return surface()["release"]


def disagg_fields() -> tuple[str, ...]:
    return tuple(surface()["disaggregated_params"]["fields"])


def sampling_fields() -> tuple[str, ...]:
    return tuple(surface()["sampling_params"]["fields_used"])


def check_installed(version: str, disagg_field_names, sampling_field_names) -> list[str]:
    """Raise SurfaceMismatch when a field the adapter always sets is missing; return warnings (a
    different release, or a newer-only field that will be left unset)."""
    dp, sp = set(disagg_field_names), set(sampling_field_names)
    optional = set(surface()["disaggregated_params"]["since_main"])
    missing = [f"DisaggregatedParams.{f}" for f in disagg_fields() if f not in dp and f not in optional]
    missing += [f"SamplingParams.{f}" for f in sampling_fields() if f not in sp]
    if missing:
        raise SurfaceMismatch(f"tensorrt_llm {version} lacks {', '.join(missing)}, which Tandem's adapter uses "
                              f"(recorded for TensorRT-LLM {release()} in {PATH})")
    warnings = [f"DisaggregatedParams.{f} is not in tensorrt_llm {version}: left unset"
                for f in disagg_fields() if f in optional and f not in dp]
    if version.split(".")[:2] != release().split(".")[:2]:
        warnings.insert(0, f"tensorrt_llm {version} is installed; Tandem's adapter was written against "
                           f"{release()} (the fields it uses are present)")
    return warnings
