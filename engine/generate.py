"""One prompt through a single in-process engine, with text streamed as it is generated."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.detokenizer import TextStream
from tandem.sampling_params import SamplingParams
from engine.scheduler import Scheduler


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    ttft_s: float
    tokens_per_s: float  # output tokens after the first, per second of decoding
    logprobs: list[float] = field(default_factory=list)


def run_generation(engine, prompt_ids: list[int], params: SamplingParams, on_text=None) -> GenerationResult:
    """Generate for one prompt; `on_text(str)` receives each piece of final text as it appears."""
    seq = engine.new_sequence("generate-0", prompt_ids, params)
    stream = TextStream(engine.tokenizer, params.stop)
    engine.admit(seq)  # OutOfPages when the pool cannot hold prompt + max_tokens
    sched = Scheduler(engine)
    sched.add_prefill(seq)
    t0 = time.perf_counter()
    t_first = None
    text = []
    while sched.has_work:
        for ev in sched.step():
            t_first = t_first or time.perf_counter()
            ends = ev.token in seq.eos_ids or ev.token in params.stop_token_ids  # its text is not the answer's
            piece = "" if ends else stream.add(ev.token)
            text.append(piece)
            if on_text and piece:
                on_text(piece)
    engine.release(seq)
    tail = stream.flush()
    if on_text and tail:
        on_text(tail)
    t_end = time.perf_counter()
    n = len(seq.output_ids)
    return GenerationResult(
        text="".join(text) + tail, token_ids=seq.output_ids, prompt_token_ids=seq.prompt_ids,
        finish_reason=seq.finish_reason.value, ttft_s=t_first - t0,
        tokens_per_s=(n - 1) / (t_end - t_first) if n > 1 and t_end > t_first else 0.0,
        logprobs=seq.output_logprobs)
