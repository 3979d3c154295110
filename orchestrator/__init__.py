"""The orchestrator: routes requests through prefill and decode workers, and the client front doors."""
