"""TensorRT-LLM as a role engine inside Tandem's Triton workers (see docs/trtllm.md).

Nothing here imports `tensorrt_llm` at module import: only `TrtllmRole.start` does, in a worker.
"""
