"""Loading and unloading LoRA adapters while serving, as vLLM's runtime LoRA routes do:

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "sql-v2", "load_inplace": false}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

answered 200 with vLLM's text ("Success: LoRA adapter 'sql' added successfully.") or an OpenAI error.
Off unless the deployment names a folder (`lora_loading.root`, `tandem serve --lora-root DIR`): only an
adapter inside it may be loaded (a relative `lora_path` is taken inside it; one leading out of it, by
`..` or a link, is refused), so a caller can make the server read no other file. Every worker must see
the folder at the same path (as for --lora-modules). The adapter is checked against the model here,
without torch (engine/lora_files.py), before a worker reads it; control/adapters.py then brings it to
every worker. Callers need an API key when the server has keys, as on every /v1 route.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Collection

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field

from control.adapters import Adapters
from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.lora_files import NAME, check_against, check_module
from frontdoor.http_body import read_object
from tandem.status import InvalidArgument, NotFound

_FIELDS = {"/v1/load_lora_adapter": {"lora_name", "lora_path", "load_inplace"},
           "/v1/unload_lora_adapter": {"lora_name", "lora_int_id"}}  # lora_int_id: vLLM's, ignored as there


class LoraLoading(BaseModel):
    """The deployment's `lora_loading` (ops/deployment.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    root: str | None = None  # adapters in this folder may be loaded while serving; null: the routes are off
    max_adapters: int = Field(16, ge=1, le=4096)  # held at once: given at start, loaded, unloaded but still serving


class LoraRoutes:
    def __init__(self, adapters: Adapters, root: str | None, cfg: ModelConfig, taken: Collection[str]):
        """`root`: lora_loading.root (None: the routes answer 404 saying how to turn them on); `cfg`: the model
        an adapter must fit; `taken`: the names the model itself is served under."""
        self.adapters, self.cfg, self.taken = adapters, cfg, taken
        self.root = os.path.realpath(root) if root else None

    def add_to(self, router) -> None:
        router.add_post("/v1/load_lora_adapter", self.load)
        router.add_post("/v1/unload_lora_adapter", self.unload)

    async def load(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        name, path, inplace = body.get("lora_name"), body.get("lora_path"), body.get("load_inplace", False)
        if not isinstance(path, str) or not path:
            raise InvalidArgument("lora_path must be the adapter's folder (a string), inside lora_loading.root",
                                  "lora_path")
        if not isinstance(inplace, bool):
            raise InvalidArgument(f"load_inplace must be true or false, got {inplace!r:.40}", "load_inplace")
        if name in self.taken:
            raise InvalidArgument(f"{name!r} is a name the model is served under; give the adapter another",
                                  "lora_name")
        folder = os.path.realpath(os.path.join(self.root, path))
        if os.path.commonpath([folder, self.root]) != self.root:
            raise InvalidArgument(f"lora_path {path!r:.200} is outside the folder adapters may be loaded from "
                                  f"(lora_loading.root)", "lora_path")
        await asyncio.get_running_loop().run_in_executor(None, self._check, name, folder)
        await self.adapters.load(name, folder, inplace)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        name = (await self._body(request)).get("lora_name")
        await self.adapters.unload(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _body(self, request: web.Request) -> dict:
        """The request's JSON object, its fields known and its name a string; NotFound while loading is off."""
        if self.root is None:
            raise NotFound(f"{request.path}: loading LoRA adapters while serving is off; start tandem serve "
                           f"with --lora-root DIR (deployment: lora_loading.root)")
        body = await read_object(request)
        unknown = sorted(set(body) - _FIELDS[request.path])
        if unknown:
            raise InvalidArgument(f"unknown fields {unknown}; allowed: {sorted(_FIELDS[request.path])}", unknown[0])
        if not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
            raise InvalidArgument("lora_name must be the adapter's name (a string)", "lora_name")
        return body

    def _check(self, name: str, folder: str) -> None:
        """InvalidArgument naming what is wrong with the adapter's name or files (its header, not its weights)."""
        try:
            check_module(name, folder)
            check_against(name, folder, self.cfg)
        except (ValueError, ModelLoadError) as e:
            raise InvalidArgument(str(e), "lora_path" if NAME.fullmatch(name) else "lora_name") from None
