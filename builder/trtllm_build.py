"""`tandem build --backend tensorrt-llm`: per-role TensorRT-LLM configs next to the checkpoint.

    engines/NAME/prefill/   HF checkpoint files + llm_api_options.yaml (context role)
    engines/NAME/decode/    HF checkpoint files + llm_api_options.yaml (generation role)

The role folders are what `tandem repo --backend tensorrt-llm` turns into Tandem's Triton workers
(builder/trtllm_repo.py); the files below serve the same engines without Tandem, through TensorRT-LLM's
own `trtllm-serve disaggregated`:

    engines/NAME/disagg_config.yaml        for `trtllm-serve disaggregated` (and .compose.yaml for deploy/)
    engines/NAME/launch_trtllm.sh          the three trtllm-serve commands
    engines/NAME/trtllm_build_legacy.sh    the legacy convert_checkpoint + trtllm-build commands

Everything is validated by builder/trtllm.py's schema mirrors. Nothing is executed unless
`tensorrt_llm` imports and a GPU is visible; then the YAML is also checked by TensorRT-LLM itself.
"""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile

import yaml

from builder.build import BuildError, BuildRequest, plan, role_profile
from builder.trtllm import ConvertCheckpointArgs, DisaggConfig, DisaggServers, TrtllmBuildArgs
from engine.trtllm.llm_options import CacheTransceiverConfig, CudaGraphConfig, KvCacheConfig, LlmApiOptions
from tandem.roles import Role

CTX_PORT, GEN_PORT, FRONT_PORT = 8101, 8102, 8000
KV_TRANSFER_TIMEOUT_MS = 30_000  # TensorRT-LLM's own bound on a context side's held K/V (Tandem aborts sooner)


def role_options(role: Role, req: BuildRequest, max_seq_len: int) -> LlmApiOptions:
    p = role_profile(role, req.weight_quant)
    kv = KvCacheConfig(tokens_per_block=req.tokens_per_page)
    transceiver = CacheTransceiverConfig(backend="NIXL", max_tokens_in_buffer=max(p.max_num_tokens, max_seq_len),
                                         kv_transfer_timeout_ms=KV_TRANSFER_TIMEOUT_MS)
    if role is Role.PREFILL:
        # context server: big packed passes, no overlap scheduler (required for context-only), no CUDA graphs
        return LlmApiOptions(max_batch_size=p.max_batch_size, max_num_tokens=p.max_num_tokens, max_seq_len=max_seq_len,
                             disable_overlap_scheduler=True, kv_cache_config=kv, cuda_graph_config=None,
                             cache_transceiver_config=transceiver)
    sizes = list(p.cuda_graph_batch_sizes)
    return LlmApiOptions(max_batch_size=p.max_batch_size, max_num_tokens=p.max_num_tokens, max_seq_len=max_seq_len,
                         kv_cache_config=kv, cuda_graph_config=CudaGraphConfig(batch_sizes=sizes,
                                                                               max_batch_size=max(sizes),
                                                                               enable_padding=True),
                         cache_transceiver_config=transceiver)


def legacy_commands(req: BuildRequest, ckpt_folder: str, max_seq_len: int) -> list[list[str]]:
    cmds = []
    for role in req.roles:
        p = role_profile(role, req.weight_quant)
        ck = os.path.join(req.out, role.value, "tllm_checkpoint")
        cmds.append(ConvertCheckpointArgs(model_dir=ckpt_folder, output_dir=ck, dtype=req.dtype,
                                          use_weight_only=p.weight_quant != "none").argv())
        cmds.append(TrtllmBuildArgs(checkpoint_dir=ck, output_dir=os.path.join(req.out, role.value, "trt_engine"),
                                    max_batch_size=p.max_batch_size, max_num_tokens=p.max_num_tokens,
                                    max_input_len=max_seq_len - 1, max_seq_len=max_seq_len,
                                    tokens_per_block=req.tokens_per_page).argv())
    return cmds


def launch_commands(out: str) -> list[list[str]]:
    return [["trtllm-serve", os.path.join(out, "prefill"), "--host", "localhost", "--port", str(CTX_PORT),
             "--config", os.path.join(out, "prefill", "llm_api_options.yaml")],
            ["trtllm-serve", os.path.join(out, "decode"), "--host", "localhost", "--port", str(GEN_PORT),
             "--config", os.path.join(out, "decode", "llm_api_options.yaml")],
            ["trtllm-serve", "disaggregated", "-c", os.path.join(out, "disagg_config.yaml")]]


def _script(cmds: list[list[str]], background_all_but_last: bool = False, note: str = "") -> str:
    lines = []
    for i, c in enumerate(cmds):
        line = " ".join(shlex.quote(a) for a in c)
        lines.append(line + (" &" if background_all_but_last and i < len(cmds) - 1 else ""))
    head = "#!/usr/bin/env bash\n" + (f"# {note}\n" if note else "") + "set -euo pipefail\n"
    return head + "\n".join(lines) + "\n"


def trtllm_runnable() -> str | None:
    """None when TensorRT-LLM and a GPU are here; otherwise why the configs cannot be executed."""
    import importlib.util

    if importlib.util.find_spec("tensorrt_llm") is None:
        return ("tensorrt_llm is not installed (PyPI carries only placeholder wheels; use NVIDIA's Triton "
                "TensorRT-LLM container)")
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def build_trtllm(req: BuildRequest, dry_run: bool, log=print) -> None:
    ckpt, _, _, _ = plan(req)
    max_seq_len = ckpt.config.max_position
    options = {role: role_options(role, req, max_seq_len) for role in req.roles}
    disagg = DisaggConfig(port=FRONT_PORT, context_servers=DisaggServers(urls=[f"localhost:{CTX_PORT}"]),
                          generation_servers=DisaggServers(urls=[f"localhost:{GEN_PORT}"]))
    files = {os.path.join(role.value, "llm_api_options.yaml"): yaml.safe_dump(o.model_dump(exclude_none=True),
                                                                              sort_keys=False)
             for role, o in options.items()}
    files["disagg_config.yaml"] = yaml.safe_dump(disagg.model_dump(), sort_keys=False)
    compose = DisaggConfig(hostname="0.0.0.0", port=FRONT_PORT,  # deploy/docker-compose.trtllm.yml's service names
                           context_servers=DisaggServers(urls=[f"prefill:{CTX_PORT}"]),
                           generation_servers=DisaggServers(urls=[f"decode:{GEN_PORT}"]))
    files["disagg_config.compose.yaml"] = yaml.safe_dump(compose.model_dump(), sort_keys=False)
    files["launch_trtllm.sh"] = _script(launch_commands(req.out), background_all_but_last=True,
                                        note="context and generation workers, then the disaggregated front end")
    files["trtllm_build_legacy.sh"] = _script(legacy_commands(req, ckpt.folder, max_seq_len),
                                              note="legacy TensorRT engines: run in examples/models/core/llama of a "
                                                   "TensorRT-LLM release that still ships trtllm-build (<= 1.2)")
    if dry_run:
        for name, text in files.items():
            log(f"--- would write {os.path.join(req.out, name)}\n{text}")
        log(f"--- would copy the checkpoint ({ckpt.folder}) into each role folder")
    else:
        _write(req, ckpt.folder, files)
        log(f"wrote TensorRT-LLM configs for {', '.join(r.value for r in req.roles)} into {req.out}")
    why = trtllm_runnable()
    if why:
        log(f"not executed: {why}. The configs were checked against Tandem's mirror of TensorRT-LLM's schema; "
            f"on GPU nodes, render Tandem's Triton workers with `tandem repo --backend tensorrt-llm --engines "
            f"{req.out}` (or run TensorRT-LLM's own server: {os.path.join(req.out, 'launch_trtllm.sh')}).")
        return
    _check_with_trtllm(options)
    log("configs accepted by TensorRT-LLM's own argument models")


def _write(req: BuildRequest, ckpt_folder: str, files: dict[str, str]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(req.out)) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".trtllm-", dir=os.path.dirname(os.path.abspath(req.out)))
    try:
        for role in req.roles:
            shutil.copytree(ckpt_folder, os.path.join(tmp, role.value), copy_function=_link_or_copy)
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        os.chmod(os.path.join(tmp, "launch_trtllm.sh"), 0o755)
        os.chmod(os.path.join(tmp, "trtllm_build_legacy.sh"), 0o755)
        if os.path.exists(req.out):
            raise BuildError(f"output folder {req.out} exists; choose another --out for the TensorRT-LLM build")
        os.replace(tmp, req.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _check_with_trtllm(options: dict) -> None:  # pragma: no cover - needs TensorRT-LLM and a GPU
    from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

    for role, o in options.items():
        TorchLlmArgs(model="unused", **o.model_dump(exclude_none=True))
