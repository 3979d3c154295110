"""`tandem chat`: a client for a running `tandem serve` in the terminal: one question, or a conversation."""

from __future__ import annotations

import http.client
import json
import os
import sys
import urllib.error
import urllib.request

import click

EXIT = ("/exit", "/quit")


@click.command("chat")
@click.argument("message", required=False)
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="A `tandem serve` HTTP address.")
@click.option("--max-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--system", default=None, help="A system message before the conversation.")
def chat_command(message, url, max_tokens, temperature, system):
    """Ask a running `tandem serve` one question (MESSAGE), or, without one, hold a conversation: each line
    typed (or read from stdin) is the next user message, answered with the whole conversation before it;
    an empty line is skipped, and end of input (Ctrl-D) or /exit ends it. Answers stream to the terminal.
    In a conversation a refused turn (its error on stderr) is left out and the conversation goes on. A
    server that needs an API key gets TANDEM_API_KEY's."""
    turns = [{"role": "system", "content": system}] if system else []
    ask = {"url": url.rstrip("/"), "max_tokens": max_tokens, "temperature": temperature}
    if message is not None:
        _stream(turns + [{"role": "user", "content": message}], **ask)
        return
    prompt = sys.stdin.isatty()
    while True:
        if prompt:
            click.echo("> ", nl=False, err=True)
        line = sys.stdin.readline()
        text = line.strip()
        if not line or text in EXIT:
            return
        if not text:
            continue
        try:
            answer = _stream(turns + [{"role": "user", "content": text}], **ask)
        except click.ClickException as e:
            click.echo(f"Error: {e.message}", err=True)
            continue
        turns += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]


def _stream(messages: list[dict], url: str, max_tokens: int, temperature: float) -> str:
    """Stream the answer to `messages` to stdout (then a newline) and return it; ClickException naming
    the server's refusal, or that it cannot be reached or broke off."""
    body = json.dumps({"messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                       "stream": True}).encode()
    headers = {"Content-Type": "application/json"}
    if os.environ.get("TANDEM_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['TANDEM_API_KEY'].strip()}"
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers=headers)
    answer = []
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:  # a failure after the stream began
                    click.echo()
                    raise click.ClickException(chunk["error"]["message"])
                for choice in chunk.get("choices", []):
                    answer.append(choice.get("delta", {}).get("content") or "")
                    sys.stdout.write(answer[-1])
                    sys.stdout.flush()
    except urllib.error.HTTPError as e:
        raise click.ClickException(f"{e.code}: {e.read().decode(errors='replace')}") from None
    except urllib.error.URLError as e:
        raise click.ClickException(f"cannot reach {url}: {e.reason} (is 'tandem serve' running?)") from None
    except (OSError, http.client.HTTPException) as e:  # the connection broke mid-stream
        click.echo()
        raise click.ClickException(f"the answer from {url} broke off: {e}") from None
    click.echo()
    return "".join(answer)
