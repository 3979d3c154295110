"""Priority classes in the planner: the workload draws them, the simulator serves them as the serving code
does (policies/; tests/policies/test_same_decisions.py compares the passes themselves), and a plan can
hold its SLO for the urgent classes only."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from cli.main import main
from planner.plan_workload import (Fixed, Poisson, RequestSpec, Workload, WorkloadError, describe_priorities, draw,
                                   parse_length, parse_priorities, with_class_lengths)
from planner.sim.events import EventLoop
from planner.sim.pages import PagePool
from planner.sim.request import SimRequest
from planner.sim.sim_decode import DecodeSim
from planner.sim.sim_layouts import Layout
from planner.sim.sim_metrics import summarize
from planner.sim.sim_run import simulate
from planner.sim.waiting import RETRY_DELAY_S
from tests.planner.test_plan_cli import WORKLOAD, _profile
from tests.planner.toy import toy_profile


def test_priority_classes_are_drawn_by_weight_after_the_lengths_and_arrivals():
    base = Workload(prompt=Fixed(value=5), output=Fixed(value=3), arrivals=Poisson(rate=4.0), requests=4000, seed=3)
    classes = base.model_copy(update={"priorities": parse_priorities("0:1, 5:3")})
    plain, drawn = draw(base), draw(classes)
    assert [(s.prompt_len, s.output_len, s.arrival) for s in plain] == [(s.prompt_len, s.output_len, s.arrival)
                                                                         for s in drawn]
    assert {s.priority for s in plain} == {0} and {s.priority for s in drawn} == {0, 5}
    assert sum(s.priority == 0 for s in drawn) / len(drawn) == pytest.approx(0.25, abs=0.03)
    assert draw(classes) == drawn  # the same for the same seed
    assert describe_priorities(classes.priorities) == "priority 0: 25%, priority 5: 75%"


def test_a_class_may_have_lengths_of_its_own_and_the_others_keep_the_workloads():
    base = Workload(prompt=parse_length("uniform:500:1000"), output=Fixed(value=64), arrivals=Poisson(rate=4.0),
                    requests=2000, seed=5, priorities=parse_priorities("0:1,1:3"))
    own = base.model_copy(update={"priorities": with_class_lengths(base.priorities, ("0=list:20,30",),
                                                                   ("0=8", "1=uniform:100:200"))})
    plain, drawn = draw(base), draw(own)
    assert [(s.arrival, s.priority) for s in plain] == [(s.arrival, s.priority) for s in drawn]
    for was, now in zip(plain, drawn):
        if now.priority == 0:
            assert now.prompt_len in (20, 30) and now.output_len == 8
        else:
            assert now.prompt_len == was.prompt_len and 100 <= now.output_len <= 200
    assert {s.prompt_len for s in drawn if s.priority == 0} == {20, 30} and draw(own) == drawn
    assert describe_priorities(own.priorities) == ("priority 0: 25% (prompt empirical (2 values, mean 25), output 8), "
                                                   "priority 1: 75% (output uniform 100..200)")


@pytest.mark.parametrize("prompts,why", [(("2=64",), "priority 2 is not one of the classes (0, 1)"),
                                         (("0=64", "0=32"), "priority 0 is given twice"),
                                         (("64",), "write PRIORITY=LENGTH, e.g. 0=128"),
                                         (("x=64",), "write PRIORITY=LENGTH"),
                                         (("0=uniform:9:1",), "uniform needs low <= high")])
def test_bad_class_lengths_say_what_is_allowed(prompts, why):
    with pytest.raises(WorkloadError, match="bad (class prompt )?length") as e:
        with_class_lengths(parse_priorities("0:1,1:1"), prompts)
    assert why in str(e.value)


@pytest.mark.parametrize("text,why", [("0", "'0' has no weight"), ("0:1,0:2", "each priority may be given once"),
                                      ("x:1", "invalid literal for int()"), ("1:0", "greater than 0"),
                                      ("1:nan", "finite number"), ("4294967296:1", "less than or equal to")])
def test_bad_priorities_say_what_is_allowed(text, why):
    with pytest.raises(WorkloadError, match="PRIORITY:WEIGHT") as e:
        parse_priorities(text)
    assert why in str(e.value)


# One decode worker of 10 pages (16 tokens each). A (6 pages) and E (3) are placed at once; B (8 pages)
# and D (2) find 1 page free and wait. E ends first, freeing 3 pages: D would fit, B not yet.
SPECS = [RequestSpec(80, 12, 0.0), RequestSpec(40, 2, 0.0), RequestSpec(110, 4, 0.0), RequestSpec(20, 2, 0.0)]
PAGES = {"serving": {"kv_pool_bytes": 10 * 16 * 1000}, "prefill": {"intercept_s": 0.1, "per_token_s": 0.0},
         "decode": {"intercept_s": 0.2}}


def with_priorities(specs: list[RequestSpec], priorities: tuple[int, ...]) -> list[RequestSpec]:
    return [RequestSpec(s.prompt_len, s.output_len, s.arrival, p) for s, p in zip(specs, priorities)]


def test_a_waiting_request_holds_off_those_of_a_worse_priority():
    fcfs = simulate(toy_profile(**PAGES), Layout("disaggregated", 1, 1), SPECS).requests
    classes = simulate(toy_profile(**PAGES), Layout("disaggregated", 1, 1), with_priorities(SPECS, (0, 0, 0, 1)))
    a, e, b, d = fcfs
    assert e.done_at < a.done_at
    assert d.reserved_at == pytest.approx(e.done_at + RETRY_DELAY_S)  # first come, first served: D backfills
    assert b.reserved_at == pytest.approx(a.done_at + RETRY_DELAY_S)
    a, e, b, d = classes.requests
    assert b.reserved_at == pytest.approx(a.done_at + RETRY_DELAY_S)  # B waits for A's pages (A is as urgent)...
    assert d.reserved_at == b.reserved_at  # ...and D, of a worse priority, waits until B is placed
    assert classes.system.preemptions == 0


@pytest.mark.parametrize("layout", [Layout("disaggregated", 1, 1), Layout("colocated", 1)])
def test_a_request_refused_for_pages_preempts_a_less_urgent_one_which_resumes_where_it_was(layout):
    # A (priority 1, 6 pages, 12 tokens) decodes; B (priority 0, 8 pages) arrives at 0.55 s: the pool has
    # 4 pages free, so B takes A's. A waits (B is more urgent) and resumes after B: its 3 tokens so far
    # prefilled with its prompt, the other 9 streamed after them.
    specs = [RequestSpec(80, 12, 0.0, 1), RequestSpec(110, 4, 0.55, 0)]
    run = simulate(toy_profile(**PAGES), layout, specs)
    a, b = run.requests
    assert run.system.preemptions == 1
    assert b.reserved_at == pytest.approx(0.55 + RETRY_DELAY_S)
    assert a.prior == pytest.approx([0.1, 0.3, 0.5]) and (a.prompt_len, a.output_len) == (83, 9)
    assert a.reserved_at == pytest.approx(b.done_at + RETRY_DELAY_S) and a.first_token > b.done_at
    times = a.token_times()
    assert times.size == a.answer_len == 12 and all(np.diff(times) > 0)
    fcfs = simulate(toy_profile(**PAGES), layout, with_priorities(specs, (0, 0)))
    a, b = fcfs.requests
    assert fcfs.system.preemptions == 0 and b.reserved_at == pytest.approx(a.done_at + RETRY_DELAY_S)


@pytest.mark.parametrize("layout", [Layout("disaggregated", 1, 2), Layout("colocated", 2)])
def test_the_victim_is_taken_on_the_worker_that_refused_first(layout):
    # Two workers of 10 pages. A (priority 2, 6 pages) opens on the first, C (priority 1, 5 pages) on the
    # second. B (priority 0, 8 pages) fits nowhere; the worker asked is the one with the most free pages,
    # C's (5 against 4), and B preempts C there although A, elsewhere, is less urgent: as the waiting room
    # does (control/waiting_room.py make_room). C, refused in turn (4 pages free, 2 on B's worker),
    # preempts A a round trip later: two preemptions, as the system makes them (the least urgent anywhere
    # would have made one).
    specs = [RequestSpec(80, 12, 0.0, 2), RequestSpec(70, 10, 0.01, 1), RequestSpec(110, 4, 0.55, 0)]
    run = simulate(toy_profile(**PAGES), layout, specs)
    a, c, b = run.requests
    assert run.system.preemptions == 2 and (a.attempt, c.attempt, b.attempt) == (1, 1, 0)
    assert b.reserved_at == pytest.approx(0.55 + RETRY_DELAY_S)
    assert c.reserved_at == pytest.approx(0.55 + 2 * RETRY_DELAY_S)  # on A's pages
    assert a.reserved_at == pytest.approx(b.done_at + RETRY_DELAY_S)  # on B's


class StepCosts:
    def decode_time(self, batch, context_tokens):
        return 1.0


def test_the_decode_batch_takes_the_urgent_first_when_it_has_room():
    loop, done = EventLoop(), []
    d = DecodeSim(loop, StepCosts(), PagePool(100, 16), max_batch=1, on_done=lambda r: done.append(r.index))
    reqs = [SimRequest(0, 10, 3, priority=1), SimRequest(1, 10, 2, priority=1), SimRequest(2, 10, 2, priority=0)]
    for r in reqs:
        d.reserve(r)
    loop.at(0.0, d.arrive, reqs[0])
    for r in reqs[1:]:  # their K/V arrive while request 0 fills the batch
        loop.at(0.5, d.arrive, r)
    loop.run()
    assert done == [0, 2, 1] and d.pool.used == 0


def test_the_urgent_class_is_served_first_and_the_slo_can_hold_for_it_alone():
    # Prefill-bound toy (0.1 s per prompt, ~12 prompts/s) offered 14/s: a queue builds; class 0 skips it.
    profile = toy_profile(prefill={"intercept_s": 0.1, "per_token_s": 0.0}, decode={"intercept_s": 0.01},
                          serving={"pass_tokens": 100})
    w = Workload(prompt=Fixed(value=100), output=Fixed(value=4), arrivals=Poisson(rate=14.0), requests=600,
                 priorities=parse_priorities("0:1,1:3"))
    run = simulate(profile, Layout("disaggregated", 1, 1), draw(w))
    whole = summarize(run.requests, profile.frontdoor, 0.5, 1.0)
    urgent = summarize(run.requests, profile.frontdoor, 0.5, 1.0, slo_priority=0)
    by = whole["by_priority"]
    assert by["0"]["requests"] + by["1"]["requests"] == 600
    assert by["0"]["ttft_s"]["p90"] < 0.5 < by["1"]["ttft_s"]["p90"]  # the queue is the worse class's
    ttft = {p: np.array([r.first_token - r.arrival for r in run.requests if r.priority == p]) for p in (0, 1)}
    assert ttft[0].max() < np.median(ttft[1])
    assert urgent["slo_attainment"] == pytest.approx(by["0"]["slo_attainment"])
    assert urgent["met_slo"] == by["0"]["met_slo"] and urgent["slo_attainment"] > whole["slo_attainment"]


def test_plan_holds_the_slo_for_the_urgent_class(tmp_path):
    out = tmp_path / "plan"
    args = ["plan", "--profile", _profile(tmp_path), "--devices", "2", *WORKLOAD, "--rates", "0.2,0.4,0.6",
            "--priorities", "0:1,1:1", "--out", str(out)]
    r = CliRunner().invoke(main, [*args, "--slo-priority", "0"])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "plan.json").read_text())
    assert doc["slo"]["priority"] == 0 and doc["workload"]["priorities"] == [{"priority": 0, "weight": 1.0},
                                                                             {"priority": 1, "weight": 1.0}]
    row = next(x for x in doc["results"] if x["layout"] == "1P1D" and x["rate"] == 0.6)
    assert set(row["metrics"]["by_priority"]) == {"0", "1"}
    assert row["metrics"]["slo_attainment"] == row["metrics"]["by_priority"]["0"]["slo_attainment"]
    md = (out / "plan.md").read_text()
    assert "of priority <= 0 (the others best effort)" in md and "Each priority class on" in md
    r = CliRunner().invoke(main, [*args, "--slo-priority", "-1"])
    assert r.exit_code == 1 and "the SLO's priority -1 covers no class of the workload (priorities 0, 1" in r.output
    r = CliRunner().invoke(main, [*args[:-4], "--priorities", "0:1,0:1", "--out", str(out)])
    assert r.exit_code == 1 and "bad priorities '0:1,0:1': each priority may be given once" in r.output
    r = CliRunner().invoke(main, [*args, "--class-prompt-len", "0=32", "--class-output-len", "0=8"])
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "plan.json").read_text())
    assert doc["workload"]["priorities"][0] == {"priority": 0, "weight": 1.0, "prompt": {"kind": "fixed", "value": 32},
                                                "output": {"kind": "fixed", "value": 8}}
    assert "priority 0: 50% (prompt 32, output 8), priority 1: 50%" in (out / "plan.md").read_text()
    r = CliRunner().invoke(main, [*args[:-6], "--class-prompt-len", "0=32", "--out", str(out)])
    assert r.exit_code == 1 and "priority 0 is not one of the classes (none given)" in r.output


def test_closed_loop_clients_and_an_open_stream_run_side_by_side():
    # One co-located engine, one 100-token prompt per pass (0.1 s), 2-token answers (one 0.2 s step).
    # Two clients send A, B, C, D (priority 1) in turn: A and B are done at 0.4 s, C's pass runs 0.4-0.5
    # while D waits; X (priority -1) arrives at 0.45 s and takes the next pass before D.
    profile = toy_profile(prefill={"intercept_s": 0.1, "per_token_s": 0.0}, decode={"intercept_s": 0.2},
                          serving={"pass_tokens": 100})
    specs = [RequestSpec(100, 2, None, 1)] * 4
    specs.insert(1, RequestSpec(100, 2, 0.45, -1))
    a, x, b, c, d = simulate(profile, Layout("colocated", 1), specs, concurrency=2).requests
    assert a.arrival == b.arrival == 0.0 and x.arrival == pytest.approx(0.45)
    assert c.arrival == pytest.approx(a.done_at) and d.arrival == pytest.approx(b.done_at)  # a client's next
    assert d.arrival < x.arrival and x.prefill_start < d.prefill_start  # X overtakes the waiting D
    with pytest.raises(ValueError, match="needs an arrival time"):
        simulate(profile, Layout("colocated", 1), specs)


@pytest.mark.parametrize("layout", [Layout("disaggregated", 1, 2), Layout("colocated", 2), Layout("chunked", 2)])
def test_under_page_pressure_every_answer_is_whole_and_every_page_comes_back(layout):
    profile = toy_profile(prefill={"intercept_s": 0.02, "per_token_s": 0.0005}, decode={"intercept_s": 0.01},
                          serving={"kv_pool_bytes": 40 * 16 * 1000, "pass_tokens": 256, "chunk_tokens": 64})
    w = Workload(prompt=parse_length("uniform:16:200"), output=parse_length("uniform:1:120"),
                 arrivals=Poisson(rate=40.0), requests=300, seed=5, priorities=parse_priorities("0:1,1:2,2:2"))
    specs = draw(w)
    run = simulate(profile, layout, specs, chunk_tokens=64)
    assert run.system.preemptions > 0
    for spec, r in zip(specs, run.requests):
        times = r.token_times()
        assert r.finished and r.answer_len == times.size == spec.output_len
        assert r.prompt_len == spec.prompt_len + len(r.prior) and all(np.diff(times) > 0)
    assert all(p.used == 0 for p in run.pools)
    by = summarize(run.requests, profile.frontdoor, 1.0, 1.0)["by_priority"]
    assert by["0"]["ttft_s"]["p90"] < by["2"]["ttft_s"]["p90"]
