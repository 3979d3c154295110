"""Adapters from Triton's python backend to the role workers. Imported only inside a Triton stub
(they need `triton_python_backend_utils`, which exists only there)."""
