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
