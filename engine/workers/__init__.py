"""The role workers Triton runs, as plain Python: prefill, decode, and the co-located baseline.

They know nothing of Triton; engine/triton/ adapts them to the python backend. Each streams its
results through a `TokenSink` the caller provides.
"""
