"""Experiments from config: ``moe-rl sweep`` (arms x seeds, summary table and plots)."""
