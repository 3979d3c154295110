"""Workloads: one or more request streams, each with prompt/output lengths and an arrival pattern.

A stream sends `count` requests either closed-loop (`concurrency` clients, each sending its next
request when the last one finished), as a Poisson process (`rate` requests/s), or at a fixed
`interval`. Prompts are made of seeded random words cut to the requested token count, so the same
seed gives the same prompts in every mode.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field

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

    def __post_init__(self):
        if sum(bool(x) for x in (self.concurrency, self.rate, self.interval)) != 1:
            raise ValueError(f"stream {self.name!r}: give exactly one of concurrency, rate, interval")
        if self.prompt_len < 1 or self.output_len < 1 or self.count < 1:
            raise ValueError(f"stream {self.name!r}: prompt_len, output_len and count must be >= 1")


@dataclass(frozen=True)
class Scenario:
    name: str
    streams: tuple[Stream, ...]
    warmup: int = 2  # requests per stream left out of the statistics
    seed: int = 0
    description: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RequestSpec:
    stream: str
    index: int
    prompt: str
    max_tokens: int
    arrival: float | None  # seconds after start (open-loop streams), None for closed-loop ones
    warmup: bool = False
    extra: dict = field(default_factory=dict)


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


def make_prompt(tokenizer, n_tokens: int, rng: random.Random) -> str:
    """A prompt of exactly n_tokens tokens (as this tokenizer counts them) of random words."""
    words = " ".join(rng.choice(WORDS) for _ in range(n_tokens + 8))
    ids = tokenizer.encode(words)[:n_tokens]
    return tokenizer.decode(ids)


def requests_for(scenario: Scenario, tokenizer) -> list[RequestSpec]:
    rng = random.Random(scenario.seed)
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
            n_out = rng.randint(s.output_len, s.output_len_max) if s.output_len_max > s.output_len else s.output_len
            out.append(RequestSpec(s.name, i, make_prompt(tokenizer, s.prompt_len, rng), n_out, arrival,
                                   warmup=i < scenario.warmup))
    return out
