"""NOT TensorRT-LLM (see the package docstring): its DisaggregatedParams and DisaggScheduleStyle, with
the fields api_surface.json records."""

import enum
from dataclasses import dataclass


class DisaggScheduleStyle(enum.IntEnum):
    CONTEXT_FIRST = 0
    GENERATION_FIRST = 1


@dataclass
class DisaggregatedParams:
    request_type: str | None = None
    first_gen_tokens: list[int] | None = None
    ctx_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None
    disagg_request_id: int | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | None = None
    schedule_style: DisaggScheduleStyle | None = None
    first_gen_log_probs: list | None = None
    first_gen_logits: list | None = None
    multimodal_embedding_handles: list | None = None
    multimodal_hashes: list | None = None
    mrope_position_ids_handle: dict | None = None
    mrope_position_deltas_handle: dict | None = None
