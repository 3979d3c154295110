"""`tandem repo --backend tensorrt-llm`: Triton model repositories of TensorRT-LLM role engines for any
xPyD, from the folder `tandem build --backend tensorrt-llm` wrote. One repository per worker (a Triton
server each, as Tandem runs its workers), its one model named by its role like the torch models, so
the orchestrator addresses every worker the same way:

    DIR/prefill_0/prefill/config.pbtxt + 1/model.py   ... DIR/prefill_{x-1}/   context_only engines
    DIR/decode_0/decode/config.pbtxt   + 1/model.py   ... DIR/decode_{y-1}/    generation_only engines

Each model names its role, the checkpoint, the role YAML (ENGINES/ROLE/llm_api_options.yaml, the
LLM-API options TensorRT-LLM gets) and its GPUs: engines take `tensor_parallel_size` GPUs each,
prefill engines first, numbered from 0 on every node of `gpus_per_node` GPUs (`tritonserver
--model-repository=DIR/decode_1` on the node that holds its GPUs). The role YAMLs are checked by the schema mirror
(builder/trtllm.py) and against each other: the two roles must share the cache transceiver's backend
and the KV block size, or the pull cannot work; the context role runs without the overlap scheduler.
Written to a temporary folder and renamed into place, like the torch repository (builder/repo.py).
"""

from __future__ import annotations

import os

from builder.repo import TEMPLATES, RenderError, write_model, write_replacing
from engine.trtllm.llm_options import load_role_options
from tandem.roles import Role

TEMPLATE = os.path.join(TEMPLATES, "trtllm")
OPTIONS_FILE = "llm_api_options.yaml"


def role_files(engines: str) -> dict[Role, tuple[str, dict]]:
    """(role folder, checked options) per role; RenderError says what is missing or inconsistent."""
    out = {}
    for role in (Role.PREFILL, Role.DECODE):
        folder = os.path.abspath(os.path.join(engines, role.value))
        path = os.path.join(folder, OPTIONS_FILE)
        if not os.path.isfile(path) or not os.path.isfile(os.path.join(folder, "config.json")):
            raise RenderError(f"{folder} lacks {OPTIONS_FILE} or the checkpoint's config.json: build it with "
                              f"`tandem build --backend tensorrt-llm --out {engines}`")
        try:
            out[role] = (folder, load_role_options(path))
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            raise RenderError(f"{path} is not valid LLM-API options: {e}") from None
    ctx, gen = out[Role.PREFILL][1], out[Role.DECODE][1]
    for key, inner in (("cache_transceiver_config", "backend"), ("kv_cache_config", "tokens_per_block")):
        a, b = ctx.get(key, {}).get(inner), gen.get(key, {}).get(inner)
        if a is None or a != b:
            raise RenderError(f"the prefill and decode role YAMLs must set the same {key}.{inner} (got {a!r} and "
                              f"{b!r}): the decode engine pulls the prefill engine's K/V")
    if not ctx.get("disable_overlap_scheduler"):
        raise RenderError("the prefill role YAML must set disable_overlap_scheduler: true (context_only requests "
                          "run without TensorRT-LLM's overlap scheduler)")
    return out


def worker_plan(files: dict, prefill_workers: int, decode_workers: int, gpus_per_node: int,
                on_gpu: bool = True) -> list[dict]:
    """Placeholder values per engine model, GPUs assigned in order. `on_gpu` False: Triton instances of
    KIND_CPU (only the test double of tensorrt_llm runs so: tests/trtllm/fake_trtllm/)."""
    if prefill_workers < 1 or decode_workers < 1 or gpus_per_node < 1:
        raise RenderError(f"need at least one prefill and one decode engine and one GPU per node, got "
                          f"{prefill_workers}P{decode_workers}D on {gpus_per_node} GPUs per node")
    plan, offset = [], 0
    for role, count in ((Role.PREFILL, prefill_workers), (Role.DECODE, decode_workers)):
        folder, options = files[role]
        tp = options.get("tensor_parallel_size", 1)
        if tp > gpus_per_node:
            raise RenderError(f"{role.value} engines need {tp} GPUs (tensor_parallel_size) but a node has "
                              f"{gpus_per_node}")
        for i in range(count):
            if offset % gpus_per_node + tp > gpus_per_node:  # an engine does not straddle two nodes
                offset += gpus_per_node - offset % gpus_per_node
            first = offset % gpus_per_node
            plan.append(dict(worker=f"{role.value}_{i}", name=role.value, role=role.value, model_dir=folder,
                             llm_yaml=os.path.join(folder, OPTIONS_FILE),
                             instance=f"kind: KIND_GPU count: 1 gpus: [ {first} ]" if on_gpu else "kind: KIND_CPU count: 1",
                             gpu_ids=",".join(str(first + g) for g in range(tp))))
            offset += tp
    return plan


def render_trtllm_repo(engines: str, out: str, prefill_workers: int = 1, decode_workers: int = 1,
                       gpus_per_node: int = 8, on_gpu: bool = True) -> list[str]:
    """Write the repositories to `out` (replacing what was there); return the worker names."""
    plan = worker_plan(role_files(engines), prefill_workers, decode_workers, gpus_per_node, on_gpu)

    def fill(tmp: str) -> None:
        for v in plan:
            values = {k: x for k, x in v.items() if k != "worker"}
            write_model(os.path.join(tmp, v["worker"], v["name"]), TEMPLATE, values,
                        f"{v['worker']}/{v['name']}/config.pbtxt")

    write_replacing(out, fill)
    return [v["worker"] for v in plan]
