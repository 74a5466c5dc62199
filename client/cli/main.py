"""The `ember` command line.

Subcommands:
  ember run [MODEL] PROMPT   load a model in this process and stream a completion to stdout
                             (MODEL: a GGUF file, a Hugging Face directory or a hub name owner/repo[:QUANT];
                             omitted: the built-in demo)
  ember pull NAME, list      models by name in the Hugging Face cache (client/cli/hub_commands.py)
  ember serve, generate, chat, status    the daemon and its clients (client/cli/daemon_commands.py)
  ember gateway              the OpenAI-compatible HTTP API in front of the daemon (client/cli/gateway_command.py)
  ember cluster serve        replicas of the daemon on Ray behind one HTTP endpoint (client/cli/cluster_command.py)
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="ember: a local LLM inference daemon, its clients and tools")
    parser.add_argument("--version", action="version", version=f"ember {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="generate a completion in this process and stream it to stdout",
                         description="Load MODEL (default: the built-in demo model) and stream a completion of PROMPT.")
    run.add_argument("args", nargs="+", metavar="[MODEL] PROMPT",
                     help="model (optional: a path, or a hub name owner/repo[:QUANT]) and prompt text")
    run.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    from ember.client.cli.sampling_options import add_sampling_options

    add_sampling_options(run)
    run.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI additive penalty per repeat (-2..2)")
    run.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI additive penalty once seen (-2..2)")
    run.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    run.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    run.add_argument("--device", default="cpu", help="cpu (default) or cuda:N")
    run.set_defaults(func=_run)
    from ember.client.cli.cluster_command import add_cluster_parser
    from ember.client.cli.daemon_commands import add_daemon_commands
    from ember.client.cli.gateway_command import add_gateway_parser
    from ember.client.cli.hub_commands import add_hub_commands
    from ember.client.cli.plan_command import add_plan_parser

    add_daemon_commands(sub)
    add_hub_commands(sub)
    add_gateway_parser(sub)
    add_plan_parser(sub)
    add_cluster_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError) as e:  # ModelFileError, TokenizerError and bad options are one-liners
        print(f"ember: error: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    from ember.client.cli.hub_commands import progress_for_stderr
    from ember.client.cli.sampling_options import grammar_of
    from ember.daemon.loader.demo_model import DEMO_MODEL
    from ember.daemon.loader.hub import Hub, resolve_model
    from ember.daemon.loader.model_file_error import ModelFileError
    from ember.daemon.runner.devices import DeviceName, backend_for
    from ember.daemon.runtime import load

    if len(args.args) > 2:
        raise ValueError("expected [MODEL] PROMPT: quote the prompt")
    model_path, prompt = (args.args if len(args.args) == 2 else (DEMO_MODEL, args.args[0]))
    backend_for(DeviceName.parse(args.device)).prepare(on_compile=_show_compile)  # a first run compiles: say so
    try:
        model = load(resolve_model(model_path, Hub.from_env(os.environ), progress_for_stderr()), device=args.device,
                     on_layer=_LoadLine())
    except ModelFileError as e:
        print(f"ember: error: cannot load model: {e}", file=sys.stderr)
        return 1
    decoder = model.tokenizer.stream_decoder()
    out = sys.stdout
    out.write(prompt)
    sampling = model.sampling.filled(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                     min_p=args.min_p, repetition_penalty=args.repetition_penalty)
    sampling.update(frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty)
    ends = frozenset() if args.ignore_eos else frozenset(model.tokenizer.eos_ids)
    for token in model.generate(prompt, max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos,
                                grammar=grammar_of(args), **sampling):
        if token in ends:
            break  # the end token's text (<|endoftext|>) is not the model's output
        out.write(decoder.feed(token))
        out.flush()
    out.write(decoder.flush() + "\n")
    return 0


class _LoadLine:
    """A slow load's progress on stderr (a GPU's upload of a big model): once it has taken a second,
    one line that counts up on a terminal, else a line every 5 s and the last."""

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.start < 1.0 and not self.shown:
            return
        tty = sys.stderr.isatty()
        if not tty and now - self.last < 5.0 and done < total:
            return
        self.shown, self.last = True, now
        print(f"ember: loading the model: {done} of {total} layers", end="\r" if tty and done < total else "\n",
              file=sys.stderr, flush=True)


def _show_compile(done: int, total: int) -> None:
    """A first run's kernel compile on stderr: one line that counts up on a terminal, a line per part else."""
    if done == 0:
        print("ember: compiling the CPU kernels (the first run after an install; later runs load them)",
              file=sys.stderr)
    last = done == total or not sys.stderr.isatty()
    print(f"ember: compiling the CPU kernels: {done} of {total} parts", end="\n" if last else "\r", file=sys.stderr,
          flush=True)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ember")
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
