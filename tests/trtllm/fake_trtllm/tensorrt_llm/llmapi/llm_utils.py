"""NOT TensorRT-LLM (see the package docstring)."""


def update_llm_args_with_extra_dict(llm_args: dict, llm_args_dict: dict, extra_llm_api_options=None) -> dict:
    """The LLM's keyword arguments: `llm_args` updated with the options of a YAML (`llm_args_dict`)."""
    return {**llm_args, **llm_args_dict}
