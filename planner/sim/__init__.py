"""A discrete-event simulation of Tandem's schedulers (not idealised ones), per serving layout.

- `events.py`: the simulated clock and event heap.
- `request.py`: one simulated request and its timestamps; `pages.py`: a KV page pool's accounting.
- `batch.py`: the running decode batch (one token per sequence per step).
- `prefill.py`, `decode.py`: the disaggregated workers; `disaggregated.py`: reservation and routing.
- `colocated.py`: one co-located engine (prefill-first or chunked); `replicas.py`: routing over them.
- `layouts.py`: the layouts N devices allow; `run.py`: simulate a workload on a layout;
  `metrics.py`: TTFT/TPOT/ITL percentiles, throughput, goodput, SLO attainment.
"""
