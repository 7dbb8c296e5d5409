"""Profiling: benchmark harness (batch, state, step timer), device timing, kernel bench, FLOPs."""
