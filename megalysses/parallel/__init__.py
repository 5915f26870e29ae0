"""Parallel building blocks: tensor-parallel layers, Ulysses attention, pipeline schedules, data parallelism."""
