"""Measurement scripts (each runs as `python benchmarks/<name>.py`; see its docstring) and what they share
(harness.py). A package so that they import each other by name, ahead of any other `benchmarks` on the path."""
