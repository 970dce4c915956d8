"""The example's agent (``agent.py``) with the openai SDK swapped for plain aiohttp requests: the
same game, the same requests to the same endpoint, the same messages. Not how to write an agent
(``agent.py`` is); the benchmark's ``raw`` arm (``bench.py --arm raw=env.openai_agent=raw_agent:play``)
uses it to tell the SDK's own CPU per call from the rest of the agent path. It takes the
episode's address and key from the client moe-rl hands it and opens an aiohttp session per
episode (a connection per episode: more work than the SDK's shared pool, not less).
"""
from __future__ import annotations

import json

import aiohttp

from guess_tools import TOOLS, Game


async def play(client, prompt, max_turns: int = 3) -> dict:
    url = f"{str(client.base_url).rstrip('/')}/chat/completions"
    headers = {"Authorization": f"Bearer {client.api_key}"}
    game = Game(int(prompt.meta["answer"]))
    messages = list(prompt.meta["messages"])
    async with aiohttp.ClientSession(headers=headers) as session:
        while not game.done and game.turns < max_turns:
            game.turns += 1
            body = {"model": "policy", "messages": messages, "tools": TOOLS}
            async with session.post(url, json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
                reply = await r.json()
            message = {k: v for k, v in reply["choices"][0]["message"].items() if v is not None}
            messages.append(message)
            if not message.get("tool_calls"):
                break
            for call in message["tool_calls"]:
                result = game.call(call["function"]["name"], json.loads(call["function"]["arguments"]))
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
                if game.done:
                    break
    return {"reward": game.reward, "found": float(game.found), "agent_turns": float(game.turns)}
