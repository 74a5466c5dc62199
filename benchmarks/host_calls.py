"""Python calls per decoded token, by part of the engine step: a measure of host overhead that does
not depend on how loaded the machine is (unlike tok/s on a shared VM).

In process (ember.load, Model.engine), batch 1, greedy: after a 16-token prompt, every call Python
makes during --tokens decode steps is counted (sys.setprofile: Python functions and C functions
called from Python) and charged to the part of the step it happens in: the scheduler, StepBatch.build,
the runner's prepare, the model's embedding, layers and head, sampling, and the accounting.

    python benchmarks/host_calls.py [MODEL ...] [--tokens 32]     (default: the demo model)
"""
from __future__ import annotations

import argparse
import collections
import sys

# the step's parts, by the name of the function that starts each (its callees are charged to it)
PARTS = ("schedule", "_build", "prepare", "embed_tokens", "run_layers", "head", "_sample", "_account")


def calls_per_token(path: str, tokens: int) -> tuple[collections.Counter[str], int]:
    import ember
    from ember.daemon.engine.sequence import Sequence

    model = ember.load(path)

    def engine():  # type: ignore[no-untyped-def]
        eng = model.engine(16 + tokens + 2)
        eng.add(Sequence(list(range(100, 116)), tokens + 1))
        eng.step()  # the prompt
        return eng

    warm = engine()
    while warm.has_work:
        warm.step()
    counts: collections.Counter[str] = collections.Counter()
    stack: list[str] = []

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event in ("call", "c_call"):
            part = stack[-1] if stack else "step"
            if event == "call" and frame.f_code.co_name in PARTS and part in ("step", "_account"):
                part = frame.f_code.co_name
            stack.append(part)
            counts[part] += 1
        elif stack:
            stack.pop()

    eng, steps = engine(), 0
    while eng.has_work:
        stack[:] = ["step"]
        sys.setprofile(profile)
        eng.step()
        sys.setprofile(None)
        steps += 1
    return counts, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    if not args.models:
        from ember.daemon.loader.demo_model import DEMO_MODEL

        args.models = [str(DEMO_MODEL)]
    for path in args.models:
        counts, steps = calls_per_token(path, args.tokens)
        parts = ", ".join(f"{name.strip('_')} {n / steps:.0f}" for name, n in counts.most_common())
        print(f"{path}: {sum(counts.values()) / steps:.0f} Python calls per decoded token ({parts})")


if __name__ == "__main__":
    main()
