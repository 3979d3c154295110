"""The capacity planner: which serving layout and P:D ratio meets an SLO on given hardware.

- `profile.py`: the hardware profile (`tandem-profile/1` JSON): pass and step times, handoff, front door.
- `measure.py`: `tandem profile`, which measures a profile of this machine and our PyTorch engine.
- `workload.py`: prompt/output length distributions and arrival patterns.
- `sim/`: a discrete-event simulation of the schedulers Tandem ships, per layout.
- `plan.py`, `report.py`: `tandem plan`, which simulates every layout and recommends one.

The simulator is pure Python + numpy; only `tandem profile` loads the engine (lazily).
"""
