"""Benchmarks run by ``replaymoe bench <op>``; shared timing helpers are in ``_timing``."""
