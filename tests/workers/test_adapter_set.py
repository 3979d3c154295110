"""A worker's LoRA adapters changed while it serves (engine/workers/adapter_set.py), on the real engine
and PEFT adapters: a request keeps the adapter it was admitted with when the set drops it, and ends
with the tokens it would have had; a later request naming it is refused; a set is taken whole or not at
all, and the adapters it keeps are not loaded again; the worker holds what any orchestrator needs and
its own configured adapters throughout; an orchestrator's set leaves a while after its last watch went,
unless it sends a set again first."""

from __future__ import annotations

import threading
import time

import pytest

from engine.errors import InvalidRequest
from engine.load import load_engine
from engine.tokenizer import ChatMessage
from engine.workers import adapter_set
from engine.workers.adapter_set import AdapterSet
from engine.workers.watchers import Watchers
from tandem.sampling_params import SamplingParams
from tandem.status import InvalidArgument, Status, status_of
from tandem.roles import Role
from tandem.wire import Ack, Adapters, WorkerStats
from tests.engine.test_lora import TARGETS, make_adapter
from tests.workers.test_handoff import ListSink

pytest.importorskip("peft")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def folders(hf_default_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-set")
    made = {"every": str(root / "every"), "qv": str(root / "qv")}
    make_adapter(hf_default_model[1], made["every"], TARGETS, 1)
    make_adapter(hf_default_model[1], made["qv"], ["q_proj", "v_proj"], 2)
    return made


@pytest.fixture
def engine(folders):
    """An engine configured with adapter `every` (as `tandem serve --lora-modules` starts its workers)."""
    return load_engine("smollm2-135m", kv_bytes=64 << 20, lora_modules={"every": folders["every"]})


def apply(adapters: AdapterSet, modules: dict, owner: str = "o1") -> ListSink:
    sink = ListSink()
    adapters.apply(Adapters(owner, modules), sink)
    assert sink.finished.wait(60)
    return sink


def answer(engine, ids: list[int], drop_after: int | None = None, adapters: AdapterSet | None = None) -> list[int]:
    """Greedy tokens of `ids` with adapter `every`; with `drop_after`, the set is emptied after that many."""
    seq = engine.new_sequence("r", ids, SamplingParams(max_tokens=MAX_TOKENS, lora="every"))
    engine.admit(seq)
    engine.prefill([seq])
    while not seq.finished:
        if len(seq.output_ids) == drop_after:
            assert isinstance(apply(adapters, {}).replies[-1], Ack)
        engine.decode_step([seq])
    engine.release(seq)
    return seq.output_ids


def test_a_request_keeps_its_adapter_when_the_set_drops_it(engine):
    """`every` as if an orchestrator had loaded it (the worker's own configuration left empty)."""
    changes = []
    adapters = AdapterSet(engine, {}, lambda: changes.append(len(engine.model.loras)))
    ids = engine.tokenizer.encode_chat([ChatMessage("user", "What is the capital of France?")])
    whole = answer(engine, ids)
    assert answer(engine, ids, drop_after=4, adapters=adapters) == whole
    assert engine.model.loras == {} and changes == [0]
    with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'every'"):
        engine.new_sequence("later", ids, SamplingParams(lora="every"))


def test_a_set_is_taken_whole_or_not_at_all(engine, folders):
    changes = []
    adapters = AdapterSet(engine, {}, lambda: changes.append(sorted(engine.model.loras)))
    every = engine.model.loras["every"]
    failed = apply(adapters, {"every": folders["every"], "qv": folders["qv"], "gone": "/nonexistent"})
    assert status_of(failed.error) is Status.INVALID_ARGUMENT and "LoRA adapter 'gone'" in str(failed.error)
    assert engine.model.loras == {"every": every} and changes == []  # nothing changed
    assert isinstance(apply(adapters, {"every": folders["every"], "qv": folders["qv"]}).replies[-1], Ack)
    assert engine.model.loras["every"] is every and engine.model.loras["qv"].rank == 8  # kept, and loaded
    assert changes == [["every", "qv"]]


def test_the_worker_holds_every_orchestrators_adapters_and_its_own(engine, folders):
    adapters = AdapterSet(engine, {"every": folders["every"]}, lambda: None)
    every = engine.model.loras["every"]
    for owner, modules, held in (("o1", {"qv": folders["qv"]}, ["every", "qv"]),
                                 ("o2", {"qv": folders["qv"]}, ["every", "qv"]),
                                 ("o1", {}, ["every", "qv"]),  # o2 still needs it
                                 ("o2", {}, ["every"])):  # nobody does; the worker's own stays
        assert isinstance(apply(adapters, modules, owner).replies[-1], Ack)
        assert sorted(engine.model.loras) == held, (owner, modules)
    assert engine.model.loras["every"] is every  # never loaded again


@pytest.mark.parametrize("owner, modules", [("o", {"": "/x"}), ("o", {"k" * 161: "/x"}), ("o", {"a": 3}),
                                            ("o", {"a": ""}), ("", {"a": "/x"})])
def test_a_malformed_set_is_refused_at_once(engine, owner, modules):
    with pytest.raises(InvalidArgument, match="an owner, and each key 1-160 characters naming a folder"):
        AdapterSet(engine, {}, lambda: None).apply(Adapters(owner, modules), ListSink())


def test_a_set_leaves_a_while_after_its_orchestrators_last_watch(engine, folders, monkeypatch):
    """o1's watches both go (its set is dropped after the grace); o2's one goes, then o2 sends its set
    again (alive: kept). The watchers are real; their sinks are ended as a cancelled Watch call's would be."""
    monkeypatch.setattr(adapter_set, "OWNER_GRACE_S", 0.2)
    dropped = threading.Event()
    adapters = AdapterSet(engine, {}, lambda: dropped.set() if "qv" not in engine.model.loras else None)
    watchers = Watchers(lambda: "stats")
    watchers.on_owner_gone = adapters.owner_gone
    try:
        sinks = {name: ListSink() for name in ("o1-a", "o1-b", "o2")}
        for name, sink in sinks.items():
            watchers.add(sink, 60.0, name[:2])
        apply(adapters, {"qv": folders["qv"]}, "o1")
        apply(adapters, {"every": folders["every"]}, "o2")
        sinks["o1-a"].gone = sinks["o2"].gone = True
        watchers.push(force=True)  # o1 still watches through o1-b; o2's last watch went
        apply(adapters, {"every": folders["every"]}, "o2")  # o2 is back: its set stays
        assert not dropped.wait(0.6) and sorted(engine.model.loras) == ["every", "qv"]
        sinks["o1-b"].gone = True
        watchers.push(force=True)  # o1's last watch went
        assert dropped.wait(10) and sorted(engine.model.loras) == ["every"]
        assert adapters.sets == {"": {}, "o2": {"every": folders["every"]}}
    finally:
        watchers.close()


def test_a_set_stays_when_its_orchestrators_watch_ends_to_be_renewed(engine, folders, monkeypatch):
    """A Watch call ends every so often (tandem/call_renewal.py) and its orchestrator watches
    again at once, sending no set (it never left routing): the watch coming back keeps the set, as a set
    would. Without the watch (the same renewal, nobody back) the set goes after the grace."""
    monkeypatch.setattr(adapter_set, "OWNER_GRACE_S", 0.2)
    adapters = AdapterSet(engine, {}, lambda: None)
    watchers = Watchers(lambda: WorkerStats(role=Role.DECODE))
    watchers.on_owner_gone, watchers.on_owner_back = adapters.owner_gone, adapters.owner_back
    try:
        apply(adapters, {"qv": folders["qv"]}, "o1")
        apply(adapters, {"every": folders["every"]}, "o2")
        first = [ListSink(), ListSink()]
        for sink, owner in zip(first, ("o1", "o2")):
            watchers.add(sink, 60.0, owner, renew_after=1)  # the first push (at once) is its call's last
        assert all(s.finished.wait(10) and s.replies[-1].renew for s in first)
        watchers.add(ListSink(), 60.0, "o1")  # o1 watches again; o2 does not
        deadline = time.monotonic() + 10
        while "o2" in adapters.sets and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.4)  # o1's grace (0.2 s) is over too
        assert adapters.sets == {"": {}, "o1": {"qv": folders["qv"]}}
        assert sorted(engine.model.loras) == ["qv"]  # o2's `every` left with o2's set
    finally:
        watchers.close()
