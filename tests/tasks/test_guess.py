"""Guess the number: the environment's answers and the rewards the docstring claims."""
import asyncio
import itertools

from moe_rl.tasks.guess import GuessEnv, GuessTask
from moe_rl.tasks.synthetic import EOS, FIRST_SYMBOL


def play(task, secret_index, policy, max_turns=3):
    """Plays one episode; ``policy(history of (guess, feedback))`` -> the next guess token."""
    env = GuessEnv(task)

    async def go():
        p = task.prompt(0)
        p.meta["secret"] = FIRST_SYMBOL + secret_index
        await env.reset(p)
        total, history = 0.0, []
        for _ in range(max_turns):
            g = policy(history)
            r = await env.step([g], "")
            total += r.reward
            if r.done:
                break
            history.append((g, r.observation[0]))
        return total

    return asyncio.run(go())


def test_binary_search_beats_every_policy_that_ignores_feedback():
    task = GuessTask(num_symbols=4)
    H = task.HIGHER

    def binary(history):
        lo, hi = 0, 3
        for g, fb in history:
            v = g - FIRST_SYMBOL
            lo, hi = (v + 1, hi) if fb == H else (lo, v - 1)
        return FIRST_SYMBOL + (lo + hi + 1) // 2

    search = sum(play(task, s, binary) for s in range(4)) / 4
    assert abs(search - 0.85) < 1e-9  # (1 + 0.85 + 0.85 + 0.7) / 4
    best_blind = max(sum(play(task, s, lambda h, o=order: FIRST_SYMBOL + o[len(h)]) for s in range(4)) / 4
                     for order in itertools.product(range(4), repeat=3))
    assert abs(best_blind - 0.675) < 1e-9


def test_feedback_tokens_and_invalid_guesses():
    task = GuessTask(num_symbols=4)
    env = GuessEnv(task)
    p = task.prompt(5)
    assert asyncio.run(env.reset(p)) == p.input_ids
    secret = p.meta["secret"]
    r = asyncio.run(env.step([EOS], ""))
    assert r.observation == [task.INVALID, 2] and r.reward == 0.0 and not r.done
    other = FIRST_SYMBOL if secret != FIRST_SYMBOL else FIRST_SYMBOL + 1
    r = asyncio.run(env.step([other], ""))
    assert r.observation[0] == (task.HIGHER if secret > other else task.LOWER) and r.reward == 0.05
    assert asyncio.run(env.step([other], "")).reward == 0.0  # a repeated guess earns nothing
    r = asyncio.run(env.step([secret], ""))
    assert r.done and abs(r.reward - (1 - 0.2 * 3)) < 1e-9
