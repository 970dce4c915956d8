"""The ``moe-rl`` command line: validate, train, serve, bench."""
from __future__ import annotations

import argparse
import importlib
import sys

# bench name -> module with ``main(argv: list[str]) -> int``
BENCHES = {
    "logprobs": "moe_rl.kernels.bench.logprobs",
    "replay": "moe_rl.bench.replay",
    "engine": "moe_rl.bench.engine",
    "sync": "moe_rl.bench.sync",
    "async": "moe_rl.bench.async_rl",
    "routing": "moe_rl.bench.routing",
}


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        print("usage: moe-rl bench {%s} [--json] [options]" % ",".join(BENCHES), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(BENCHES[argv[0]])
    return int(module.main(argv[1:]) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="moe-rl", description=__doc__)
    parser.add_argument("command", choices=["validate", "train", "serve", "bench"])
    if not argv:
        parser.print_help()
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        return _bench(rest)
    args = parser.parse_args([cmd])
    raise SystemExit(f"moe-rl {args.command}: not implemented yet")


if __name__ == "__main__":
    sys.exit(main())
