"""`tandem build` and `tandem repo` command lines."""

from __future__ import annotations

import time

import click

from engine.checkpoint import DEFAULT_MODEL
from tandem.modes import HandoffMode
from tandem.roles import ENGINE_ROLES, Role


def _roles(text: str) -> tuple[Role, ...]:
    try:
        roles = tuple(dict.fromkeys(Role.parse(r) for r in text.split(",") if r.strip()))
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if not roles:
        raise click.BadParameter("give at least one role: prefill, decode or prefill,decode")
    if any(r not in ENGINE_ROLES for r in roles):
        raise click.BadParameter("engines are built for prefill and decode (a generate worker runs the prefill engine)")
    return roles


@click.command("build")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="smollm2-135m, a .gguf file, a Hugging Face Llama-family folder, or its repo id (org/name) "
                   "in the local Hugging Face cache.")
@click.option("--out", default=None, help="Output folder (default: engines/<model name>).")
@click.option("--roles", default="prefill,decode", show_default=True, help="Comma-separated roles to build.")
@click.option("--backend", type=click.Choice(["torch", "tensorrt-llm"]), default="torch", show_default=True)
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the engines will run (auto: CUDA when visible); picks the default --dtype.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Weights and KV dtype (default: bfloat16 for cuda, float32 for cpu).")
@click.option("--tokens-per-page", type=click.IntRange(1, 1024), default=16, show_default=True)
@click.option("--weight-quant", type=click.Choice(["none", "int8", "int8-dynamic"]), default="none",
              show_default=True, help="Decode role only: int8 weights (bandwidth-bound decode reads 4x fewer bytes).")
@click.option("--dry-run", is_flag=True, help="Print what would be built and run; write nothing.")
@click.option("--force", is_flag=True, help="Replace an output folder that holds a different model.")
def build_command(model, out, roles, backend, device, dtype, tokens_per_page, weight_quant, dry_run, force):
    """Build role engines (prefill, decode) from one checkpoint."""
    from builder.build import BuildError, BuildRequest, build, default_out, plan
    from tandem.devices import DeviceError, resolve_device

    try:
        device = resolve_device(device)
    except DeviceError as e:
        raise click.ClickException(str(e)) from None
    dtype = dtype or ("bfloat16" if device == "cuda" else "float32")

    req = BuildRequest(model=model, out=out or default_out(model), roles=_roles(roles), dtype=dtype,
                       tokens_per_page=tokens_per_page, weight_quant=weight_quant, force=force)
    try:
        if backend == "tensorrt-llm":
            from builder.trtllm_build import build_trtllm

            build_trtllm(req, dry_run=dry_run, log=click.echo)
            return
        if dry_run:
            ckpt, _, layout, keys = plan(req)
            click.echo(f"would build {', '.join(r.value for r in req.roles)} engines of {ckpt.config.architecture} "
                       f"from {ckpt.source} into {req.out} ({dtype}, KV {layout.to_dict()})")
            return
        t = time.perf_counter()
        build(req, log=click.echo)
        click.echo(f"done in {time.perf_counter() - t:.2f}s")
    except BuildError as e:
        raise click.ClickException(str(e)) from None


@click.command("repo")
@click.option("--engines", required=True, help="Folder with prefill/ and decode/ engines (from tandem build).")
@click.option("--out", required=True, help="Model repository folder to write (replaced if it exists).")
@click.option("--backend", type=click.Choice(["torch", "tensorrt-llm"]), default="torch", show_default=True)
@click.option("--transport", type=click.Choice(["shm", "cuda_ipc", "nixl", "auto"]), default=None,
              help="Default: the one-host transport for the decode device (shm on cpu, cuda_ipc on cuda).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="cuda: KIND_GPU instance groups (auto: cuda when visible here).")
@click.option("--gpu", "gpu_map", multiple=True, metavar="MODEL=INDEX",
              help="cuda: the GPU of a model, e.g. --gpu prefill=0 --gpu decode=1 (default: 0 for each).")
@click.option("--threads", type=click.IntRange(1, 256), default=1, show_default=True, help="Torch threads per instance.")
@click.option("--kv-pool-bytes", type=click.IntRange(1 << 20), default=None, help="Decode KV pool size (default: profile).")
@click.option("--chunk-tokens", type=click.IntRange(0), default=0, show_default=True,
              help="generate/ model: chunked-prefill budget per step (0 = prefill first).")
@click.option("--handoff", type=click.Choice([m.value for m in HandoffMode]), default=HandoffMode.PUSH.value, show_default=True,
              help="KV handoff: push (prefill writes into decode's pages) or pull (decode reads them from prefill's pool).")
@click.option("--prefill-workers", type=click.IntRange(1), default=1, show_default=True,
              help="tensorrt-llm: prefill engines (prefill_0...).")
@click.option("--decode-workers", type=click.IntRange(1), default=1, show_default=True,
              help="tensorrt-llm: decode engines (decode_0...).")
@click.option("--gpus-per-node", type=click.IntRange(1), default=8, show_default=True,
              help="tensorrt-llm: GPUs per node, for the engines' GPU assignment.")
def repo_command(engines, out, backend, transport, device, gpu_map, threads, kv_pool_bytes, chunk_tokens,
                 handoff, prefill_workers, decode_workers, gpus_per_node):
    """Render the Triton model repository for built engines: prefill/, decode/, generate/ (torch), or one
    repository per TensorRT-LLM worker, prefill_0/.. decode_0/.. (tensorrt-llm, any xPyD; every engine
    on a GPU, its handoff TensorRT-LLM's own pull).

    `--device cuda` renders KIND_GPU instance groups; it may be given on a machine without CUDA (the
    repository is for the machine that serves it), while `auto` asks this machine."""
    from builder.build import BuildError
    from builder.repo import MODELS, RenderError, RepoOptions, render_repo
    from tandem.devices import DeviceError, resolve_device

    if backend == "tensorrt-llm":
        _render_trtllm(engines, out, prefill_workers, decode_workers, gpus_per_node)
        return
    try:
        on_gpu = device == "cuda" or (device == "auto" and resolve_device("auto") == "cuda")
    except DeviceError as e:
        raise click.ClickException(str(e)) from None
    gpus = dict.fromkeys(MODELS, 0) if on_gpu else {}
    for item in gpu_map:
        name, _, index = item.partition("=")
        if not on_gpu or name not in MODELS or not index.isdigit():
            raise click.BadParameter(f"{item!r}: give MODEL=INDEX with MODEL one of {', '.join(MODELS)}, "
                                     f"with --device cuda", param_hint="--gpu")
        gpus[name] = int(index)
    try:
        models = render_repo(engines, out, RepoOptions(transport=transport, threads=threads, gpus=tuple(gpus.items()),
                                                       kv_pool_bytes=kv_pool_bytes, chunk_tokens=chunk_tokens,
                                                       handoff=handoff))
    except (RenderError, BuildError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"rendered {', '.join(models)} into {out}")


def _render_trtllm(engines: str, out: str, prefill_workers: int, decode_workers: int, gpus_per_node: int) -> None:
    from builder.repo import RenderError
    from builder.trtllm_repo import render_trtllm_repo

    try:
        workers = render_trtllm_repo(engines, out, prefill_workers, decode_workers, gpus_per_node)
    except RenderError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"rendered {', '.join(workers)} into {out}")
