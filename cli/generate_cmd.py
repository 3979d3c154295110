"""`tandem generate`: one prompt through a single in-process engine (no servers), streamed."""

from __future__ import annotations

import json
import sys

import click

from engine.checkpoint import DEFAULT_MODEL


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
    from engine.errors import EngineError
    from engine.generate import run_generation
    from engine.load import load_engine
    from tandem.sampling_params import SamplingParams
    from engine.tokenizer import ChatMessage

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
