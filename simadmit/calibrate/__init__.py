"""`simadmit calibrate`: load-test a live vLLM endpoint and fit the simulator's cost model from what it measured.

The pipeline is endpoint -> measurements (CSV, appended row by row) -> least-squares fit -> `Profile` (YAML).
"""
