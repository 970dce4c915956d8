"""The OpenAI-agent example's game (examples/openai_agent/guess_tools.py) has the levels its
docs and the learning check rely on: 1/3 for any policy blind to the tool results, 1 for
compare(1) then the answer its result names."""
import sys
from pathlib import Path

import pytest

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "openai_agent")
if EXAMPLE not in sys.path:
    sys.path.insert(0, EXAMPLE)
guess_tools = pytest.importorskip("guess_tools")

SECRETS = range(guess_tools.NUMBERS)


def _play(secret, calls):
    g = guess_tools.Game(secret)
    for name, n in calls:
        g.turns += 1
        g.call(name, {"n": n})
        if g.done:
            break
    return g.reward


def test_blind_policies_earn_a_third_and_reading_the_result_earns_one():
    blind = [[("answer", a)] for a in SECRETS] + [[("compare", c), ("answer", a)] for c in SECRETS for a in SECRETS]
    for calls in blind:  # the same calls whatever the secret
        assert sum(_play(s, calls) for s in SECRETS) / len(SECRETS) <= 1 / 3
    named = {"lower": 0, "equal": 1, "higher": 2}
    for s in SECRETS:
        g = guess_tools.Game(s)
        assert _play(s, [("compare", 1), ("answer", named[g.call("compare", {"n": 1})])]) == 1.0
        assert _play(s, [("answer", s)]) == 0.0  # an answer before any comparison does not count


def test_the_bench_raw_agent_sends_what_the_sdk_agent_sends():
    """bench.py's `raw` arm (raw_agent.py, plain aiohttp) stands for the same agent without the
    openai SDK: given the same replies it must send the same requests, body for body."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    import asyncio
    import json

    from aiohttp import web

    from moe_rl.tasks.base import Prompt
    from tests.engine.openai_server import serve

    agent, raw_agent = pytest.importorskip("agent"), pytest.importorskip("raw_agent")

    def reply(name, n, i):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": name, "arguments": json.dumps({"n": n})}}
        return {"id": f"c{i}", "object": "chat.completion", "created": 0, "model": "policy",
                "choices": [{"index": 0, "finish_reason": "tool_calls",
                             "message": {"role": "assistant", "content": None, "tool_calls": [call]}}]}

    async def play(module):
        seen = []
        moves = [("compare", 1), ("answer", 2)]

        async def chat(request):
            assert request.headers["Authorization"] == "Bearer k"
            seen.append(await request.json())
            return web.json_response(reply(*moves[len(seen) - 1], len(seen)))

        app = web.Application()
        app.router.add_post("/episodes/e1/v1/chat/completions", chat)
        runner, url = await serve(app)
        client = openai.AsyncOpenAI(base_url=f"{url}/episodes/e1/v1", api_key="k", max_retries=0)
        prompt = Prompt(0, [1], None, {"messages": [{"role": "user", "content": "guess"}], "answer": "2"})
        try:
            out = await module.play(client, prompt)
        finally:
            await client.close()
            await runner.cleanup()
        return seen, out

    sdk_seen, sdk_out = asyncio.run(play(agent))
    raw_seen, raw_out = asyncio.run(play(raw_agent))
    assert len(sdk_seen) == 2 and sdk_out["reward"] == 1.0  # compare(1) -> higher, answer(2) -> right
    assert raw_seen == sdk_seen and raw_out == sdk_out
