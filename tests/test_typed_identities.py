"""Roles and modes are typed (tandem/roles.py, tandem/modes.py) yet keep their words everywhere a person
or another process reads them: the deployment file, CLI choices, JSON, metric labels, worker names."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import main
from ops.deployment import Deployment
from ops.local_workers import plan_cpus
from ops.stack import worker_counts
from tandem.modes import HandoffMode, Mode
from tandem.roles import ENGINE_ROLES, Role
from tandem.wire import WorkerStats, decode_reply, encode_reply


def test_members_read_as_their_words():
    assert f"{Role.GENERATE}-0" == "generate-0" and str(Mode.CHUNKED) == "chunked"
    assert json.dumps({Role.DECODE: HandoffMode.PULL}) == '{"decode": "pull"}'
    assert Role.PREFILL == "prefill" and {"decode": 1}[Role.DECODE] == 1


def test_parse_names_the_allowed_words():
    assert Role.parse(" Decode ") is Role.DECODE
    with pytest.raises(ValueError, match="unknown role 'verify'; allowed: prefill, decode, generate"):
        Role.parse("verify")
    with pytest.raises(ValueError, match="allowed: push, pull"):
        HandoffMode.parse("poll")


def test_deployment_fields_are_enums_from_the_same_words():
    dep = Deployment(mode="colocated", handoff={"mode": "pull"}, transport="shm")
    assert dep.mode is Mode.COLOCATED and dep.handoff.mode is HandoffMode.PULL
    assert dep.model_dump(mode="json")["mode"] == "colocated"
    with pytest.raises(ValueError, match="'disaggregated', 'colocated' or 'chunked'"):
        Deployment(mode="split")


def test_every_worker_spec_carries_its_role():
    colocated = worker_counts(Deployment(mode="chunked", replicas=2))
    assert colocated == {Role.GENERATE: 2} and Mode.CHUNKED.roles == (Role.GENERATE,)
    specs = plan_cpus({Role.PREFILL: 1, Role.DECODE: 2}, [0, 1, 2])
    assert [(s.role, s.name) for s in specs] == [(Role.PREFILL, "prefill-0"), (Role.DECODE, "decode-0"),
                                                (Role.DECODE, "decode-1")]
    assert all(type(s.role) is Role for s in specs)


def test_stats_carry_the_role_over_the_wire_as_a_role():
    back = decode_reply(encode_reply(WorkerStats(role=Role.GENERATE, running=3))).body
    assert back.role is Role.GENERATE and back.running == 3


def test_build_refuses_the_generate_role():
    assert Role.GENERATE not in ENGINE_ROLES
    out = CliRunner().invoke(main, ["build", "--roles", "prefill,generate"])
    assert out.exit_code != 0 and "engines are built for prefill and decode" in out.output
