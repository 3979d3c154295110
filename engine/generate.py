"""`tandem generate`: one prompt through a single in-process engine, streamed to the terminal."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field

import click

from engine.checkpoint import DEFAULT_MODEL
from engine.detokenizer import TextStream
from engine.errors import EngineError
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.tokenizer import ChatMessage


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
    sched = Scheduler(engine)
    sched.add(seq)
    t0 = time.perf_counter()
    t_first = None
    text = []
    while sched.has_work:
        for ev in sched.step():
            t_first = t_first or time.perf_counter()
            piece = stream.add(ev.token) if ev.token not in seq.eos_ids else ""
            text.append(piece)
            if on_text and piece:
                on_text(piece)
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


@click.command("generate")
@click.option("--prompt", required=True, help="The prompt (a user message when --chat).")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="smollm2-135m, a .gguf file, a Hugging Face folder or an engine folder.")
@click.option("--max-tokens", default=128, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=0, show_default=True, type=int, help="0 = disabled.")
@click.option("--seed", default=None, type=int, help="Makes sampling reproducible.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--chat/--no-chat", default=None, help="Apply the chat template (default: when the model has one).")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(["float32", "bfloat16", "float16"]))
@click.option("--device", default="cpu", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
def generate_command(prompt, model, max_tokens, temperature, top_p, top_k, seed, stop, chat, dtype, device, as_json):
    """Generate an answer with a single in-process engine (no servers)."""
    from engine.load import load_engine

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=tuple(stop))
        if not prompt:
            raise click.UsageError("--prompt is empty; give the text to answer")
        engine = load_engine(model, dtype=dtype, device=device, kv_bytes=256 << 20)
        use_chat = engine.tokenizer.chat_template is not None if chat is None else chat
        ids = (engine.tokenizer.encode_chat([ChatMessage("user", prompt)]) if use_chat
               else engine.tokenizer.encode(prompt))
        on_text = None if as_json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        result = run_generation(engine, ids, params, on_text)
    except EngineError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps({k: v for k, v in result.__dict__.items() if k != "logprobs"}))
    else:
        click.echo()
