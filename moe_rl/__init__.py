"""moe-rl: asynchronous RL training for Mixture-of-Experts language models."""

__version__ = "0.1.0"
