"""A two-tool agent written with the openai SDK only: it plays the guessing game of
``guess_tools.py`` through chat completions with tools, as it would against any
OpenAI-compatible server. moe-rl calls ``play`` once per episode (``env.openai_agent:
agent:play``) with an ``openai.AsyncOpenAI`` client scoped to the episode; every call it makes
is recorded by the engine and trained on, token for token.
"""
from __future__ import annotations

import json

from guess_tools import TOOLS, Game


async def play(client, prompt, max_turns: int = 3) -> dict:
    game = Game(int(prompt.meta["answer"]))  # the game's side: the agent's "world"
    messages = list(prompt.meta["messages"])
    while not game.done and game.turns < max_turns:
        game.turns += 1
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break  # a plain answer ends the game
        for call in message.tool_calls:
            result = game.call(call.function.name, json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            if game.done:
                break
    return {"reward": game.reward, "found": float(game.found), "agent_turns": float(game.turns)}
