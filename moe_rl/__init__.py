"""moe-rl: asynchronous RL training for Mixture-of-Experts language models."""

# The one place the version is written: pyproject.toml reads it (setuptools' dynamic version),
# so the installed metadata and `moe-rl --version` agree with it. CHANGELOG.md's top entry names it.
__version__ = "0.2.0"
