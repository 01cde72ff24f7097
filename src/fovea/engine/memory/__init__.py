"""GPU and host memory at start-up: the plan's arithmetic (``plan``: lines, budget, KV blocks; no
device), its measurement (``profile``: a CUDA meter and peak-of-a-call), the planner that
measures the model runner's dummy steps and sizes the KV cache (``planner``, through the narrow
``PlannedRunner`` interface), and the start-up timings cached on disk (``tuning_cache``).
"""
