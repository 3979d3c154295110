"""NOT TensorRT-LLM (see the package docstring)."""


class RequestError(RuntimeError):
    """A request failed inside the executor (here: the generation side could not pull its context)."""
