"""`tandem build` (checkpoint -> role engines) and `tandem repo` (engines -> Triton model repository)."""
