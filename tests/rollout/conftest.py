"""Fixtures of the agent-rollout tests."""
import pytest


@pytest.fixture(scope="module")
def server():
    """An embedded engine behind ``moe-rl serve``'s application, in this process, with the
    OpenAI-agent example's tokenizer (tests/engine/openai_server.py)."""
    pytest.importorskip("transformers")
    from tests.engine.openai_server import InProcessServer

    s = InProcessServer()
    yield s
    s.stop()
