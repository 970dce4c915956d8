"""The guessing game of the OpenAI-agent example: its rules, tools, task and the same game as
a token-level environment (the side-by-side baseline of the agent path).

A secret number in 0..2. Two tools: ``compare(n)`` answers ``higher`` (the secret is higher
than n), ``lower`` or ``equal``; ``answer(n)`` ends the game, ``right`` or ``wrong``, and
counts only after a ``compare`` (an answer before any comparison is ``wrong``). At most
``max_turns`` model turns; a turn without a tool call ends the game. Reward: 1 for the right
answer, else 0. A policy that ignores the tool results earns at most 1/3; ``compare(1)`` and
then the answer the result names earns 1: a mean reward above 1/3 means the model reads the
results. (Without the compare-first rule the model settles on answering at once, 1/3: a
comparison pays only once the answer after it is learned.)
"""
from __future__ import annotations

import json
from pathlib import Path

from moe_rl.tasks.base import Prompt, rng_for

TOKENIZER = Path(__file__).parent / "tokenizer"
QUESTION = "guess 0 to 2"
NUMBERS = 3
TOOLS = [
    {"type": "function", "function": {
        "name": "compare", "description": "Compare n with the secret number: higher, lower or equal.",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}},
    {"type": "function", "function": {
        "name": "answer", "description": "Give the secret number; ends the game: right or wrong.",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}},
]


class Game:
    """One game's state; ``call`` plays one tool call and returns the tool's answer."""

    def __init__(self, secret: int):
        self.secret, self.turns, self.reward, self.done, self.found = secret, 0, 0.0, False, False
        self.compared = False

    def call(self, name: str, arguments: dict) -> str:
        n = arguments.get("n")
        if not isinstance(n, int) or name not in ("compare", "answer"):
            return "error"
        if name == "answer":
            self.done = True
            if n == self.secret and self.compared:
                self.found = True
                self.reward = 1.0
                return "right"
            return "wrong"
        self.compared = True
        return "higher" if self.secret > n else "lower" if self.secret < n else "equal"


class GuessToolsTask:
    """The prompt stream: one user message, the secret in ``meta["answer"]``."""

    name = "guess_tools"

    def __init__(self, tokenizer_path: str | None = None, seed: int = 0):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or TOKENIZER)
        self.seed = seed
        self.vocab_size_needed = len(self.tokenizer)
        eos = json.loads((Path(tokenizer_path or TOKENIZER) / "generation_config.json").read_text())["eos_token_id"]
        self.stop_token_ids = list(eos)
        self.num_prompts = None

    def prompt(self, index: int) -> Prompt:
        secret = int(rng_for(self.seed, index).integers(0, NUMBERS))
        messages = [{"role": "user", "content": QUESTION}]
        text = self.tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return Prompt(index, ids, None, {"text": QUESTION, "messages": messages, "answer": str(secret)})

    def reward(self, prompt: Prompt, response_ids: list[int]) -> float:
        """Single-turn use (no tool results, so no answer counts): 1 for the best first move,
        ``compare(1)``, whose result names the secret."""
        return float(self.decode(response_ids[:1]).startswith('<tool_call>\n{"name": "compare", "arguments": {"n": 1}'))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def make_task(tokenizer_path: str | None = None, seed: int = 0) -> GuessToolsTask:
    """``data.task: guess_tools:make_task``; ``tokenizer_path`` receives model.tokenizer_path."""
    return GuessToolsTask(tokenizer_path, seed)


class GuessToolsEnv:
    """The same game as a token-level environment (``env.factory``): the chat template's text
    after each model turn, encoded once, is the observation -- the tokens the engine's
    chat endpoint puts in the agent's next prompt, so both paths do the same work."""

    def __init__(self, task: GuessToolsTask, max_turns: int = 3):
        from moe_rl.engine import chat

        self.chat, self.task, self.tok, self.max_turns = chat, task, task.tokenizer, max_turns
        self.stop_texts = [self.tok.decode([t], skip_special_tokens=False) for t in task.stop_token_ids]

    async def reset(self, prompt: Prompt) -> list[int]:
        self.game, self.messages, self.ids = Game(int(prompt.meta["answer"])), list(prompt.meta["messages"]), list(prompt.input_ids)
        self.text = None  # the template's text of self.ids (the engine keeps it from its render too)
        return list(prompt.input_ids)

    async def step(self, action_ids: list[int], action_text: str):
        g, chat = self.game, self.chat
        g.turns += 1
        content, calls = chat.parse_tool_calls(self.tok.decode(action_ids, skip_special_tokens=False), "hermes", TOOLS)
        assistant = {"role": "assistant", "content": content}
        if calls:
            assistant["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                       for c in calls]
        turn = chat.Turn.answered(chat.Ask(self.messages, TOOLS), self.ids, list(action_ids), assistant,
                                  prompt_text=self.text)
        self.messages.append(assistant)
        for c in calls:
            self.messages.append({"role": "tool", "content": g.call(c.name, json.loads(c.arguments))})
            if g.done:
                break
        if not calls or g.done or g.turns >= self.max_turns:
            return [], g.reward, True, {"found": float(g.found)}
        ids, self.text = chat.continuation(self.tok, turn, chat.Ask(self.messages, TOOLS), self.stop_texts)
        obs = ids[len(self.ids) + len(action_ids):]
        self.ids = ids
        return obs, 0.0, False, {}  # the reward comes with the last step
