"""Ports a serve promised to its front door are never handed to its workers, which start first.

A CI run once lost a session's `tandem serve` this way: a worker's Triton took the port the HTTP door was
about to bind. Which port the kernel hands out cannot be chosen, so one test replaces that choice
(the fault), beside one on real sockets."""

from __future__ import annotations

import socket

import ops.triton_process as triton_process
from ops.triton_process import free_port


def test_a_real_free_port_is_bindable_and_not_one_to_avoid():
    first = free_port()
    port = free_port([first])
    assert port != first
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free, as promised


def test_a_port_promised_elsewhere_is_skipped_when_the_kernel_offers_it(monkeypatch):
    offered = iter([8001, 8000, 8001, 41234])

    class KernelOffers(socket.socket):
        def getsockname(self):
            return ("127.0.0.1", next(offered))

    monkeypatch.setattr(triton_process.socket, "socket", KernelOffers)
    assert free_port([8000, 8001]) == 41234
