"""DistServe-style placement planning: latency model, workloads, simulator, placement search, replanning,
and FastDecode sizing. Pure Python + numpy; no accelerator needed."""
