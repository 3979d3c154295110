"""Workloads: one or more request streams, each with prompt/output lengths and an arrival pattern.

A stream sends `count` requests either closed-loop (`concurrency` clients, each sending its next
request when the last one finished), as a Poisson process (`rate` requests/s), or at a fixed
`interval`. Prompts are made of seeded random words cut to the requested token count, so the same
seed gives the same prompts in every mode, or come from a file (a dataset stream, clients/bench/dataset.py).

The seed workload is the shape the disaggregation claim is reported on (64 concurrent requests,
512-token prompts, 128-token answers: phase separation cut TTFT by 25% and total time by 22%); it
is sent as one burst (each client one request) and `seed_scenario(scale)` makes smaller bursts of
the same shape. `poisson_scenario` is one point of an arrival-rate sweep.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

WORDS = ("river market lantern garden engine harbor winter copper meadow signal forest letter orbit canyon "
         "violin pepper thunder marble island compass velvet ladder mirror saddle beacon ember glacier "
         "parcel quartz tunnel willow anchor basket cobalt desert falcon harvest jigsaw kettle lagoon").split()


@dataclass(frozen=True)
class Stream:
    name: str
    prompt_len: int
    output_len: int
    count: int
    concurrency: int = 0  # closed loop with this many clients ...
    rate: float = 0.0  # ... or Poisson arrivals at this many requests/s ...
    interval: float = 0.0  # ... or one request every `interval` seconds
    start_after: float = 0.0  # seconds after the run starts
    output_len_max: int = 0  # > output_len: output lengths drawn uniformly in [output_len, output_len_max]
    # a dataset's (prompt, answer tokens), one per request in order, in place of made-up prompts
    # (clients/bench/dataset.py); prompt_len and output_len are then their means, for the report
    prompts: tuple[tuple[str, int], ...] = ()
    source: str = ""  # the file `prompts` came from
    priority: int = 0  # the requests' `priority` (OpenAI protocol; non-zero needs --scheduling-policy priority)

    def __post_init__(self):
        if sum(bool(x) for x in (self.concurrency, self.rate, self.interval)) != 1:
            raise ValueError(f"stream {self.name!r}: give exactly one of concurrency, rate, interval")
        if self.prompt_len < 1 or self.output_len < 1 or self.count < 1:
            raise ValueError(f"stream {self.name!r}: prompt_len, output_len and count must be >= 1")
        if self.prompts and len(self.prompts) != self.count:
            raise ValueError(f"stream {self.name!r}: {len(self.prompts)} prompts for {self.count} requests")


@dataclass(frozen=True)
class Scenario:
    name: str
    streams: tuple[Stream, ...]
    warmup: int = 2  # requests per stream left out of the statistics
    seed: int = 0
    description: str = ""
    models: tuple[str, ...] = ()  # each request names one of these, drawn by the seed (LoRA adapters); (): none

    def to_dict(self) -> dict:
        d = asdict(self)
        for s in d["streams"]:
            s["prompts"] = len(s["prompts"])  # a dataset is named by its file and count, not copied
        return d


@dataclass(frozen=True)
class RequestSpec:
    stream: str
    index: int
    prompt: str
    max_tokens: int
    arrival: float | None  # seconds after start (open-loop streams), None for closed-loop ones
    warmup: bool = False
    priority: int = 0  # lower is served first, by a server with priority scheduling
    model: str = ""  # the model (a LoRA adapter) the request names; "": the driver's own


SCENARIOS = {
    # The claim's shape (64 concurrent requests of 512 prompt / 128 output tokens on an A100), scaled to
    # what two CPU cores do in about a minute per mode.
    "steady": Scenario("steady", (Stream("steady", prompt_len=256, output_len=64, count=28, concurrency=6),),
                       warmup=4, description="6 concurrent clients, 256-token prompts, 64-token answers"),
    # Long prompts arriving while short requests stream: the generation-stall case.
    "stall": Scenario("stall", (
        Stream("short", prompt_len=48, output_len=96, count=16, concurrency=4),
        Stream("long", prompt_len=1536, output_len=8, count=4, interval=5.0, start_after=2.0),
    ), warmup=1, description="4 clients streaming short answers; a 1536-token prompt every 5 s"),
}


SEED_CLIENTS, SEED_PROMPT, SEED_OUTPUT = 64, 512, 128
WARMUP_SEED = 999


def seed_scenario(clients_scale: float = 1.0, length_scale: float = 1.0, seed: int = 1) -> Scenario:
    """The seed burst: SEED_CLIENTS x clients_scale clients at once, each sending one request of
    SEED_PROMPT x length_scale prompt and SEED_OUTPUT x length_scale output tokens (rounded, >= 1)."""
    if not (0 < clients_scale <= 1 and 0 < length_scale <= 1):
        raise ValueError(f"seed scales must be in (0, 1], got clients {clients_scale}, lengths {length_scale}")
    clients = max(1, round(SEED_CLIENTS * clients_scale))
    prompt, output = max(1, round(SEED_PROMPT * length_scale)), max(1, round(SEED_OUTPUT * length_scale))
    full = clients_scale == 1 and length_scale == 1
    name = "seed" if full else f"seed-{clients}x{prompt}-{output}"
    how = ("the claim's workload" if full
           else f"the seed scaled: {clients_scale:g} of its clients, {length_scale:g} of its lengths")
    return Scenario(name, (Stream(name, prompt, output, count=clients, concurrency=clients),), warmup=0, seed=seed,
                    description=f"{clients} concurrent requests at once, {prompt}-token prompts, {output}-token "
                                f"answers ({how})")


def poisson_scenario(rate: float, prompt_len: int, output_len: int, duration_s: float, min_requests: int = 10,
                     seed: int = 0) -> Scenario:
    """Poisson arrivals at `rate` requests/s for about `duration_s` seconds (at least `min_requests`)."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"a Poisson point needs rate > 0 and duration_s > 0, got {rate} and {duration_s}")
    count = max(min_requests, math.ceil(rate * duration_s))
    name = f"rate-{rate:g}"
    return Scenario(name, (Stream("poisson", prompt_len, output_len, count=count, rate=rate),), warmup=0, seed=seed,
                    description=f"Poisson arrivals at {rate:g} req/s, {count} requests of {prompt_len} prompt / "
                                f"{output_len} output tokens")


def warmup_scenario(workers: int) -> Scenario:
    """Two short requests per worker, as many at once as there are workers, so every worker has run
    its first passes (which allocate) before anything is measured."""
    # its own seed: no prompt of it may be a prefix of a measured one (a prefix cache would hit it)
    return Scenario("warmup", (Stream("warmup", 64, 8, count=2 * workers, concurrency=workers),), warmup=0,
                    seed=WARMUP_SEED)


# the seed and its scaled variant, by name (distinct seeds: neither's prompts are prefixes of the other's)
SCENARIOS.update({sc.name: sc for sc in (seed_scenario(seed=1), seed_scenario(0.25, 0.5, seed=2))})


def make_prompt(tokenizer, n_tokens: int, rng: random.Random) -> str:
    """A prompt of exactly n_tokens tokens (as this tokenizer counts them) of random words."""
    words = " ".join(rng.choice(WORDS) for _ in range(n_tokens + 8))
    ids = tokenizer.encode(words)[:n_tokens]
    return tokenizer.decode(ids)


def requests_for(scenario: Scenario, tokenizer) -> list[RequestSpec]:
    """Every request of the scenario, in order. Its models are drawn from a generator of their own, so
    the prompts, lengths and arrivals are those of the same scenario without them."""
    rng, pick = random.Random(scenario.seed), random.Random(f"models-{scenario.seed}")
    out = []
    for s in scenario.streams:
        t = s.start_after
        for i in range(s.count):
            arrival = None
            if s.rate:
                t += rng.expovariate(s.rate)
                arrival = t
            elif s.interval:
                arrival = s.start_after + i * s.interval
            if s.prompts:
                prompt, n_out = s.prompts[i]
            else:
                n_out = rng.randint(s.output_len, s.output_len_max) if s.output_len_max > s.output_len \
                    else s.output_len
                prompt = make_prompt(tokenizer, s.prompt_len, rng)
            model = pick.choice(scenario.models) if scenario.models else ""
            out.append(RequestSpec(s.name, i, prompt, n_out, arrival, warmup=i < scenario.warmup, model=model,
                                   priority=s.priority))
    return out
