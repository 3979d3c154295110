"""A worker's LoRA adapters while it serves: `Adapters` (tandem/wire.py) makes its engine hold exactly the
adapters it names (by key, control/adapters.py), loading the new ones on a thread of their own, so a
load never holds up the messages Triton hands the worker meanwhile.

A request keeps the adapter it was admitted with (Sequence.adapter), so dropping one never touches a
request in flight; a request naming it afterwards is refused (Engine.new_sequence). Changes apply one at
a time, each whole or not at all: a folder that cannot be loaded leaves the set as it was.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.lora import adapters_for
from engine.workers.sink import Responder
from tandem.sampling_params import MAX_LORA_NAME
from tandem.status import InvalidArgument
from tandem.wire import Ack, Adapters


class AdapterSet:
    def __init__(self, engine: Engine, on_change: Callable[[], None]):
        """`on_change`: called after a change (the worker pushes its stats, which count the adapters)."""
        self.engine, self.on_change = engine, on_change
        self._lock = threading.Lock()  # one change at a time

    def apply(self, msg: Adapters, sink: Responder) -> None:
        """Answer Ack once the engine holds exactly msg.modules, or fail with why not (INVALID_ARGUMENT
        for a folder that is not an adapter of this model)."""
        modules = msg.modules
        bad = [k for k, v in modules.items() if not (isinstance(v, str) and v and 0 < len(k) <= MAX_LORA_NAME)]
        if bad:
            raise InvalidArgument(f"adapters: each key must be 1-{MAX_LORA_NAME} characters naming a folder; "
                                  f"got {bad[0]!r:.80}", "modules")
        threading.Thread(target=self._apply, args=(dict(modules), sink), name="adapters", daemon=True).start()

    def _apply(self, modules: dict[str, str], sink: Responder) -> None:
        model = self.engine.model
        try:
            with self._lock:
                model.loras = adapters_for(model.loras, modules, self.engine.cfg, model.device, model.dtype)
        except ModelLoadError as e:
            sink.fail(InvalidArgument(str(e), "modules"))
        except Exception as e:  # noqa: BLE001 - anything else is this worker's fault, said as such
            sink.fail(e)
        else:
            self.on_change()
            sink.send(Ack(), final=True)
