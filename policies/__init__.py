"""Decisions written once: the serving code (engine/workers, control/router.py) and the planner's
simulator (planner/sim) both call these, so a prediction follows the code it predicts.

Nothing here imports torch, Triton or the engine: a policy is a pure function (or a tiny state
machine) over what the caller knows about its queue or its workers.
"""
