"""A worker's LoRA adapters while it serves. Each orchestrator sends the set it needs (`Adapters`, by
key: control/adapters.py), replacing its own earlier one; the engine holds the union of every
orchestrator's set and the adapters the worker was configured with (--lora-modules: those stay), so
orchestrators sharing workers never take each other's adapters away. New ones are loaded on a thread of
their own, so a load never holds up the messages Triton hands the worker meanwhile.

An orchestrator that stops sends an empty set. One killed cannot: its set is dropped OWNER_GRACE_S after
its last Watch went (Watchers.on_owner_gone), unless it watched or sent a set again meanwhile (a Watch call
ends every so often and is begun again at once: tandem/call_renewal.py). An orchestrator that
was alive after all (its watch broke) took the worker out of routing when it broke, and sends its set
before routing to it again (control/adapters.py join), so the drop never refuses one of its requests.

A request keeps the adapter it was admitted with (Sequence.adapter), so dropping one never touches a
request in flight; a request naming it afterwards is refused (Engine.new_sequence). Changes apply one at
a time, each whole or not at all: a folder that cannot be loaded leaves the set as it was.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable

from engine.engine import Engine
from engine.errors import ModelLoadError
from engine.lora import adapters_for
from engine.workers.sink import Responder
from tandem.sampling_params import MAX_LORA_NAME
from tandem.status import InvalidArgument
from tandem.wire import Ack, Adapters

log = logging.getLogger("tandem.worker")
OWNER_GRACE_S = 10.0  # an orchestrator's last watch gone this long: its set is dropped


class AdapterSet:
    def __init__(self, engine: Engine, configured: dict[str, str], on_change: Callable[[], None]):
        """`configured`: the worker's own adapters (folder by name), held throughout; `on_change`: called
        after a change (the worker pushes its stats, which count the adapters)."""
        self.engine, self.on_change = engine, on_change
        self.sets: dict[str, dict[str, str]] = {"": dict(configured)}  # by owner ("": the worker's own)
        self.signs: Counter[str] = Counter()  # sets received and watches begun, by owner (one since its
        # last watch went: it is alive)
        self._lock = threading.Lock()  # one change at a time

    def apply(self, msg: Adapters, sink: Responder) -> None:
        """Answer Ack once the engine holds exactly msg.modules, or fail with why not (INVALID_ARGUMENT
        for a folder that is not an adapter of this model)."""
        modules = msg.modules
        bad = [k for k, v in modules.items() if not (isinstance(v, str) and v and 0 < len(k) <= MAX_LORA_NAME)]
        if bad or not msg.owner:
            raise InvalidArgument(f"adapters: an owner, and each key 1-{MAX_LORA_NAME} characters naming a folder; "
                                  f"got {(bad or [''])[0]!r:.80} of owner {msg.owner!r:.40}", "modules")
        self.signs[msg.owner] += 1
        threading.Thread(target=self._apply, args=(msg.owner, dict(modules), sink), name="adapters",
                         daemon=True).start()

    def owner_gone(self, owner: str) -> None:
        """Orchestrator `owner`'s last watch went: drop its set in OWNER_GRACE_S unless it watches or sends
        one first."""
        if owner in self.sets:
            timer = threading.Timer(OWNER_GRACE_S, self._expire, (owner, self.signs[owner]))
            timer.daemon = True
            timer.start()

    def owner_back(self, owner: str) -> None:
        """Orchestrator `owner` began a watch: it is alive, its set stays."""
        self.signs[owner] += 1

    def _expire(self, owner: str, signs: int) -> None:
        if self.signs[owner] == signs and owner in self.sets:
            log.warning("orchestrator %s went away without stopping: dropping its LoRA adapters %s", owner,
                        sorted(self.sets[owner]))
            self._change(owner, {})

    def _apply(self, owner: str, modules: dict[str, str], sink: Responder) -> None:
        try:
            self._change(owner, modules)
        except ModelLoadError as e:
            sink.fail(InvalidArgument(str(e), "modules"))
        except Exception as e:  # noqa: BLE001 - anything else is this worker's fault, said as such
            sink.fail(e)
        else:
            sink.send(Ack(), final=True)

    def _change(self, owner: str, modules: dict[str, str]) -> None:
        """Hold `modules` for `owner` (ModelLoadError: nothing changed), then tell `on_change`."""
        model = self.engine.model
        with self._lock:
            sets = {k: v for k, v in {**self.sets, owner: modules}.items() if v or not k}  # none kept empty
            union = {k: v for m in sets.values() for k, v in m.items()}
            model.loras = adapters_for(model.loras, union, self.engine.cfg, model.device, model.dtype)
            self.sets = sets
        self.on_change()
