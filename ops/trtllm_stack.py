"""What the stack needs of a TensorRT-LLM deployment (`backend: tensorrt-llm`): its engines folder and
what the orchestrator reads from it.

The folder is the one `tandem build --backend tensorrt-llm` writes (builder/trtllm_build.py): per role
the HF checkpoint files and the LLM-API options YAML; no Tandem manifest. It is built from `model`
when missing (engines named explicitly are used as they are), and checked as `tandem repo --backend
tensorrt-llm` checks it (builder/trtllm_repo.py: the two roles can pull from each other). The
orchestrator's page size (for routing and admission arithmetic) is the role YAMLs' KV block size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from builder.build import BuildError, BuildRequest
from builder.repo import RenderError
from builder.trtllm_build import build_trtllm
from builder.trtllm_repo import OPTIONS_FILE, role_files
from ops.deployment import Deployment, DeploymentError
from ops.model_files import served_names
from tandem.roles import Role


@dataclass(frozen=True)
class TrtllmEngines:
    folder: str
    tokens_per_page: int  # kv_cache_config.tokens_per_block, the same in both role YAMLs
    served_names: list[str]  # the OpenAI model ids (ops/model_files.served_names)
    gpus_per_engine: dict[str, int]  # role -> tensor_parallel_size of its YAML


def trtllm_engines(dep: Deployment, log=print) -> TrtllmEngines:
    """The deployment's TensorRT-LLM engines folder, built when missing; DeploymentError when unusable."""
    folder = dep.engines_dir
    have = all(os.path.isfile(os.path.join(folder, r, OPTIONS_FILE)) for r in ("prefill", "decode"))
    if not have:
        if dep.engines:
            raise DeploymentError(f"{folder} holds no TensorRT-LLM role engines (prefill/ and decode/ with "
                                  f"{OPTIONS_FILE}): build them with `tandem build --backend tensorrt-llm --out {folder}`")
        try:
            build_trtllm(BuildRequest(model=dep.model, out=folder), dry_run=False, log=log)
        except BuildError as e:
            raise DeploymentError(str(e)) from None
    try:
        files = role_files(folder)
    except RenderError as e:
        raise DeploymentError(str(e)) from None
    tokens = files[Role.DECODE][1]["kv_cache_config"]["tokens_per_block"]
    tp = {role.value: options.get("tensor_parallel_size", 1) for role, (_, options) in files.items()}
    return TrtllmEngines(folder, tokens, served_names(dep, dep.model), tp)


def trtllm_gpus_per_node(dep: Deployment, gpus: dict[str, tuple[int, ...]], engines: TrtllmEngines) -> int:
    """How many GPUs the local TensorRT-LLM engines are placed on in order (ops/gpu_plan.role_gpus found
    them; builder/trtllm_repo.py places them). DeploymentError when there are local workers and no CUDA
    device, or more engine GPUs than visible ones: each engine takes its own (TensorRT-LLM sizes its KV
    cache by a fraction of a GPU's free memory, so two on one GPU would not fit as configured)."""
    need = sum(getattr(dep, role).count * engines.gpus_per_engine[role] for role in ("prefill", "decode"))
    if need and not gpus:
        raise DeploymentError("backend tensorrt-llm runs its local workers on CUDA and no CUDA device is visible "
                              "(run them elsewhere and list their urls, or serve with backend torch)")
    have = max((len(g) for g in gpus.values()), default=0)
    if need > have:
        raise DeploymentError(f"backend tensorrt-llm: the local workers' engines need {need} GPUs "
                              f"(count x tensor_parallel_size per role) and {have} are visible; start fewer "
                              f"workers here and list the others' urls")
    return have
