"""A worker's replies on a request whose stream went away (engine/triton/common.py: ResponseSink).

The python backend's response sender exists only inside a Triton stub, and the fault under test (a send
that fails because the caller's stream is gone) happens there only when a cancellation races a reply:
the chaos stop scenario (tests/faults/test_chaos.py) meets it now and then against real workers. Here
the sender is a stand-in that keeps the backend's documented contract: a final send closes the sender
before it goes out, and any send on a closed sender raises TritonModelException."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from tandem.status import Cancelled
from tandem.wire import Ack

FINAL = 1


class TritonModelException(Exception):
    pass


class Sender:
    def __init__(self, refuse: bool):
        self.refuse = refuse  # every send reaches a request that is gone
        self.closed = False
        self.sent: list[tuple[bool, int]] = []  # (carried a response, flags) of each send that went out
        self.tries = 0

    def send(self, response=None, flags: int = 0) -> None:
        self.tries += 1
        if self.closed:
            raise TritonModelException("Unable to send response. Response sender has been closed.")
        if flags == FINAL:
            self.closed = True
        if self.refuse:
            raise TritonModelException("the request is gone")
        self.sent.append((response is not None, flags))

    def is_cancelled(self) -> bool:
        return self.refuse


class Request:
    def __init__(self, sender: Sender):
        self.sender = sender

    def get_response_sender(self) -> Sender:
        return self.sender


@pytest.fixture
def common(monkeypatch):
    """engine.triton.common, imported against the stand-in backend module (and forgotten afterwards)."""
    backend = types.ModuleType("triton_python_backend_utils")
    backend.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    backend.TritonModelException = TritonModelException
    backend.InferenceResponse = lambda output_tensors: output_tensors
    backend.Tensor = lambda name, array: (name, array)
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", backend)
    sys.modules.pop("engine.triton.common", None)
    yield importlib.import_module("engine.triton.common")
    sys.modules.pop("engine.triton.common", None)
    vars(sys.modules["engine.triton"]).pop("common", None)


def test_a_final_reply_to_a_request_that_is_gone_is_tried_once(common):
    sender = Sender(refuse=True)
    sink = common.ResponseSink(Request(sender))
    sink.fail(Cancelled("the watcher went away"))  # used to retry without end: RecursionError in the sender's thread
    assert sender.tries == 1 and sink.done and sink.cancelled()
    sink.fail(Cancelled("again"))  # nothing more goes out, and nothing raises
    assert sender.tries == 1


def test_after_a_failed_reply_only_the_final_flag_goes_out(common):
    sender = Sender(refuse=True)
    sink = common.ResponseSink(Request(sender))
    sink.send(Ack())  # refused: the request is gone, the sink drops what follows
    sender.refuse = False
    sink.send(Ack())
    sink.send(Ack(), final=True)
    assert sender.sent == [(False, FINAL)] and sink.done


def test_replies_go_out_until_the_final_one(common):
    sender = Sender(refuse=False)
    sink = common.ResponseSink(Request(sender))
    sink.send(Ack())
    sink.send(Ack(), final=True)
    sink.send(Ack())  # after the final reply: dropped
    assert sender.sent == [(True, 0), (True, FINAL)] and sink.done
