"""One math-verify worker process (moe_rl.tasks.answers.MathVerifier starts it).

Protocol, one JSON object per line: it prints ``{"ready": true}`` once math-verify is imported,
then answers each request ``{"response": str, "reference": str}`` on stdin with
``{"correct": bool}`` (or ``{"error": "..."}``) on stdout, until stdin closes. math-verify's
own timeouts are off (they use SIGALRM, and a long computation inside one C call does not
see a signal anyway): the parent bounds every answer and kills a worker that is late.

Started by path (``python .../verify_worker.py``), not with ``-m``: ``-m moe_rl.tasks...``
would import the tasks package, and with it the config and torch, into every worker.
"""
import json
import logging
import sys


def check(response: str, reference: str) -> bool:
    """math-verify's verdict on ``response`` (free text: the boxed answer, else the last
    expression) against ``reference`` (an answer, read as the content of a ``\\boxed{}``)."""
    from math_verify import parse, verify

    gold = parse("\\boxed{" + reference + "}", parsing_timeout=None)
    pred = parse(response, parsing_timeout=None)
    return bool(verify(gold, pred, timeout_seconds=None))


def main() -> None:
    from moe_rl.lifetime import die_with_parent

    die_with_parent()
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled": the parent times us
    import math_verify  # noqa: F401  (imported before "ready", so the first deadline covers only the check)

    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
            reply = {"correct": check(req["response"], req["reference"])}
        except Exception as e:  # noqa: BLE001  (reported to the caller, which scores the sample)
            reply = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: its modules (tools.py, env.py, ...) must not shadow top-level ones
    main()
