"""`tandem bench`: drive any front door with a workload and measure TTFT, inter-token gaps, E2E,
throughput and goodput; `tandem bench compare`: the same workloads against all three serving modes."""
