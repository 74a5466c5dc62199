"""The `ember` subcommands that involve the daemon:

  ember serve [--model PATH ...] [--config FILE] [--socket PATH] [--device cpu|cuda:N] [--threads N]
              [--devices cpu:0,cpu:1 [--split 3,2] [--act-dtype T]]  layers split across stage processes
              [--draft PATH|ngram [--draft-tokens K]]          speculative decoding with a draft model
              [--http HOST:PORT]                               and the HTTP gateway as its child process
  ember generate PROMPT [--model NAME] [sampling options]     stream a completion from the daemon
  ember chat [--model NAME] [--system TEXT]                    an interactive chat with the daemon
  ember status                                                 health, models, batching and counters

The client commands take --wait SECONDS: wait that long for a daemon that is still starting.
Every failure is one line on stderr, `ember: error: ...`, and exit status 1; an error in the middle of
streamed text starts on a line of its own.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ember.client.cli.sampling_options import add_sampling_options, grammar_of


def add_daemon_commands(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the daemon: load models, serve clients on a Unix socket",
                           description="Run the ember daemon (no --model: the built-in demo model).")
    serve.add_argument("--model", action="append", metavar="PATH|NAME",
                       help="a model to serve (repeatable): a GGUF file, a Hugging Face directory, or a hub name "
                            "owner/repo[:QUANT], fetched into the Hugging Face cache (docs/models.md)")
    serve.add_argument("--config", metavar="FILE", help="TOML configuration (default: $EMBER_CONFIG, /etc/ember/ember.toml)")
    serve.add_argument("--socket", metavar="PATH", help="Unix socket to serve on")
    serve.add_argument("--device", help="cpu or cuda:N")
    serve.add_argument("--ctx", type=int, help="tokens per sequence (default: the model's context, at most 4096)")
    serve.add_argument("--max-active", type=int, help="sequences generated together (default 4)")
    serve.add_argument("--kv-dtype", metavar="T", help="KV cache dtype: f32, f16, bf16 or q8_0 (default: EMBER_KV_DTYPE, else f16)")
    serve.add_argument("--decode-act", metavar="P", choices=("q8_0", "f32"),
                       help="activations of generated tokens against quantized weights: q8_0 (default; integer dot "
                            "products, as llama.cpp) or f32 (exact, slower)")
    serve.add_argument("--prompt-act", metavar="P", choices=("q8_0", "f32"),
                       help="activations of prompt tokens against quantized weights: q8_0 (the default on CPUs "
                            "with AVX-512 VNNI or AVX2; quantized as generated tokens' are, integer products, "
                            "1.3-2x faster prefill) or f32 (exact; the default on other CPUs, where it is the "
                            "faster, and beside --decode-act f32)")
    serve.add_argument("--cuda-kernels", metavar="K", choices=("numba", "native"),
                       help="on a cuda device: numba (default; the numba.cuda kernels, every architecture) or "
                            "native (the CUDA C++ kernels through CuPy, decode replayed as graphs; dense models "
                            "on cuda:0; docs/cuda.md)")
    serve.add_argument("--draft", action="append", metavar="PATH",
                       help="a draft model for speculative decoding, one per --model in order (with no --model: "
                            "the demo model's); same vocabulary as its model, or a DFlash draft (llama.cpp's dflash "
                            "GGUF) for it, or ngram (prompt lookup: tokens copied from the sequence's own context, "
                            "no model); docs/speculative.md")
    serve.add_argument("--draft-tokens", type=int, metavar="K", help="tokens the draft proposes per step (default 4)")
    serve.add_argument("--expert-budget", metavar="SIZE|N%",
                       help="MoE models: hot experts' bytes at most (2GiB, or N%% of the experts; default all hot)")
    serve.add_argument("--cold-workers", type=int, metavar="N",
                       help="MoE models: CPU worker processes for the cold experts (default 2 when some are cold)")
    serve.add_argument("--cold-policy", choices=("exact", "mask"),
                       help="MoE models: cold experts computed exactly (default) or dropped (mask: faster, lossy)")
    serve.add_argument("--threads", type=int, help="kernel threads of the engine process (default: one per core)")
    serve.add_argument("--devices", metavar="D,D,..",
                       help="split the layers across stage processes, e.g. cpu:0,cpu:1 or cuda:0,cpu:0 (cpu:N: a "
                            "worker bound to NUMA node N where there is one; cuda:N: a worker on GPU N; plain cpu, "
                            "last only: the engine's own thread runs the last stage; ray:N/cpu: an actor on its own "
                            "node of the Ray cluster at RAY_ADDRESS, every stage then on Ray); see docs/layer_split.md, "
                            "docs/cluster.md")
    serve.add_argument("--split", metavar="N,N,..",
                       help="layers per device of --devices (default: their weights' bytes in proportion to the "
                            "devices' memory, the output head counted on the last)")
    serve.add_argument("--act-dtype", metavar="T",
                       help="the split's staged hidden states: f32, f16, bf16 or auto (default: EMBER_ACT_DTYPE, else auto)")
    serve.add_argument("--stage-threads", type=int, help="kernel threads per stage process (default: the CPUs shared out)")
    serve.add_argument("--log-format", choices=("auto", "json", "console"))
    serve.add_argument("--http", metavar="HOST:PORT",
                       help="also serve the OpenAI-compatible HTTP API there (`ember gateway` as a child process; "
                            "not loopback: set EMBER_API_KEY)")
    from ember.client.cli.gateway_command import add_cors_option

    add_cors_option(serve)
    serve.set_defaults(func=_serve)

    for name, helptext in (("generate", "stream a completion from the daemon"), ("chat", "chat with a model through the daemon")):
        p = sub.add_parser(name, help=helptext)
        if name == "generate":
            p.add_argument("prompt", help="the prompt text")
        else:
            p.add_argument("--system", help="a system message to start the chat with")
        p.add_argument("--model", help="model name (default: the only one loaded)")
        p.add_argument("--socket", metavar="PATH", help="the daemon's socket (default: the usual places)")
        p.add_argument("--max-tokens", type=int, default=256)
        add_sampling_options(p)
        p.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI additive penalty per repeat (-2..2)")
        p.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI additive penalty once seen (-2..2)")
        p.add_argument("--seed", type=int)
        p.add_argument("--stop", action="append", help="stop string (repeatable)")
        _add_wait(p)
        p.set_defaults(func=_generate if name == "generate" else _chat)

    status = sub.add_parser("status", help="ask a running daemon how it is (exit 0; 3: still starting, and what it "
                                           "is doing; 1: no daemon)")
    status.add_argument("--socket", metavar="PATH")
    _add_wait(status)
    status.set_defaults(func=_status)


def _add_wait(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for the daemon to come up (default: fail at once)")


def _connect(args: argparse.Namespace, timeout: float = 30.0) -> Any:
    """A Client of the daemon, retrying for --wait seconds while no daemon answers yet."""
    from ember.client.client import Client
    from ember.client.errors import DaemonUnavailable, UntrustedSocket

    start = time.monotonic()
    said = False
    while True:
        try:
            return Client(args.socket, timeout=timeout)
        except UntrustedSocket:
            raise  # waiting will not make it anyone else's
        except DaemonUnavailable:
            waited = time.monotonic() - start
            if waited >= args.wait:
                raise
            if waited >= 5.0 and not said:  # a daemon's first start compiles its kernels: say why nothing happens
                starting = _starting(args)
                doing = f": {starting[1]}" if starting else ""
                print(f"ember: waiting up to {args.wait:.0f} s for the daemon to start{doing}", file=sys.stderr)
                said = True
            time.sleep(0.25)


def _starting(args: argparse.Namespace) -> tuple[int, str] | None:
    """(pid, what it is doing) of a daemon on this command's socket that does not serve yet."""
    from ember.protocol.endpoint import client_socket_path, starting_daemon

    return starting_daemon(args.socket or client_socket_path())


def _serve(args: argparse.Namespace) -> int:
    from ember.daemon.config import load_config
    from ember.daemon.loader.model_file_error import ModelFileError
    from ember.daemon.server.engine_host import EngineStartFailed
    from ember.daemon.server.serve import serve
    from ember.daemon.server.socket_dir import SocketInUse

    flags = {"models": _models(args), "server.socket": args.socket, "engine.device": args.device,
             "engine.ctx": args.ctx, "engine.max_active": args.max_active, "engine.kv_dtype": args.kv_dtype,
             "engine.decode_act": args.decode_act, "engine.prompt_act": args.prompt_act,
             "engine.cuda_kernels": args.cuda_kernels,
             "engine.devices": args.devices, "engine.split": args.split,
             "engine.act_dtype": args.act_dtype, "engine.stage_threads": args.stage_threads,
             "engine.threads": args.threads, "server.log_format": args.log_format,
             "model.expert_budget": args.expert_budget, "model.cold_workers": args.cold_workers,
             "model.cold_policy": args.cold_policy}
    config = load_config(args.config, flags=flags)
    if args.cors_origin and not args.http:
        raise SystemExit("ember: error: --cors-origin needs --http")
    gateway = _start_gateway(args.http, config, tuple(args.cors_origin or ())) if args.http else None
    try:
        return serve(config)
    except (SocketInUse, EngineStartFailed) as e:
        print(f"ember: error: {e}", file=sys.stderr)
        return 1
    except ModelFileError as e:  # not an OSError: main() would print its traceback
        print(f"ember: error: cannot load model: {e}", file=sys.stderr)
        return 1
    finally:
        if gateway is not None:
            gateway.stop()


def _models(args: argparse.Namespace) -> list[Any] | None:
    """--model paths, each with its --draft (in order) and --draft-tokens when given."""
    if not args.draft:
        if args.draft_tokens is not None:
            raise SystemExit("ember: error: --draft-tokens needs --draft")
        return args.model
    from ember.daemon.loader.demo_model import DEMO_MODEL
    from ember.daemon.server.serve import DEMO_NAME

    models = [{"path": p} for p in args.model] if args.model else [{"path": str(DEMO_MODEL), "name": DEMO_NAME}]
    if len(args.draft) != len(models):
        raise SystemExit(f"ember: error: {len(args.draft)} --draft for {len(models)} model(s): give one per --model")
    extra = {} if args.draft_tokens is None else {"draft_tokens": args.draft_tokens}
    return [{**m, "draft": d, **extra} for m, d in zip(models, args.draft)]


def _start_gateway(listen: str, config: Any, cors_origins: tuple[str, ...]) -> Any:
    """The gateway as a child process, on an address bound here (GatewayConfigError: refused, nothing runs)."""
    from pathlib import Path

    from ember.client.gateway.serve_child import GatewayChild
    from ember.protocol.endpoint import daemon_socket_path

    socket_path = Path(config.server.socket) if config.server.socket else daemon_socket_path()
    return GatewayChild(listen, socket_path, config.server.log_format, cors_origins)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(model=args.model, max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty, seed=args.seed,
                stop=args.stop, grammar=grammar_of(args))


def _generate(args: argparse.Namespace) -> int:
    from ember.client.errors import EmberError

    try:
        with _connect(args) as client:
            stream = client.generate(args.prompt, **_options(args))
            sys.stdout.write(args.prompt)
            try:
                for chunk in stream:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                stream.close()
                raise
            finally:
                _end_line()  # also before an error, so that it starts on its own line
    except EmberError as e:
        print(f"ember: error: {e}", file=sys.stderr)
        return 1
    return 0


def _end_line() -> None:
    """End the line of streamed text (stdout and stderr share the terminal)."""
    sys.stdout.write("\n")
    sys.stdout.flush()


def _chat(args: argparse.Namespace) -> int:
    from ember.client.errors import EmberError

    history: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    try:
        with _connect(args) as client:
            print(f"{client.server} — an empty line or Ctrl-D ends the chat", file=sys.stderr)
            while True:
                try:
                    line = input("> ")
                except EOFError:
                    break
                if not line.strip():
                    break
                history.append({"role": "user", "content": line})
                stream = client.chat(history, **_options(args))
                reply = []
                try:
                    for chunk in stream:
                        reply.append(chunk.text)
                        sys.stdout.write(chunk.text)
                        sys.stdout.flush()
                except KeyboardInterrupt:  # stop this answer, keep the chat
                    stream.close()
                finally:
                    _end_line()
                history.append({"role": "assistant", "content": "".join(reply)})
    except EmberError as e:
        print(f"ember: error: {e}", file=sys.stderr)
        return 1
    return 0


STARTING = 3  # `ember status`'s exit status for a daemon that does not serve yet (0: serving, 1: none)


def _status(args: argparse.Namespace) -> int:
    from ember.client.errors import EmberError
    from ember.protocol.endpoint import client_socket_path

    try:
        with _connect(args, timeout=5.0) as client:
            health, stats, models = client.health(), client.stats(), client.models()
    except EmberError as e:
        starting = _starting(args)
        if starting is None:
            print(f"ember: error: {e}", file=sys.stderr)
            return 1
        pid, doing = starting
        print(f"ember daemon (pid {pid}) at {args.socket or client_socket_path()}: starting: {doing}")
        return STARTING
    print(f"{client.server} at {client.socket_path}: {health.status}, up {health.uptime_s:.0f} s")
    for m in models:
        print(f"  model {m.name}: {m.arch}, vocab {m.vocab}, context {m.context_length}")
    print(f"  requests: {stats.active} running, {stats.queued} queued, {stats.requests_total} total, "
          f"{stats.tokens_total} tokens, {stats.cancelled_total} cancelled, {stats.busy_total} refused busy")
    print(f"  batching: {stats.tokens_per_s:.1f} tokens/s, KV blocks {stats.kv_blocks_used} used / "
          f"{stats.kv_blocks_free} free, prefix cache hit rate {stats.prefix_hit_rate:.0%}, "
          f"{stats.preemptions} preemptions")
    if stats.spec_mean_accepted_length or stats.spec_plain_tokens:
        saved = stats.spec_saved_s_per_token
        verdict = "" if not saved else f", saves {saved * 1e6:.0f} us a token" if saved > 0 else \
            f", costs {-saved * 1e6:.0f} us a token"
        print(f"  speculative decoding: k {stats.spec_mean_proposals:.2f} (draft tokens a verification checked), "
              f"{stats.spec_acceptance_rate:.0%} of them accepted, "
              f"{stats.spec_mean_accepted_length:.2f} tokens per verification{verdict}; "
              f"{stats.spec_plain_tokens} tokens decoded without the draft (it measured slower)")
    if stats.total_experts:
        print(f"  experts: {stats.hot_experts} of {stats.total_experts} hot, {stats.cold_share:.0%} of routed slots "
              f"computed cold, {stats.expert_swaps} swapped in, {stats.cold_worker_restarts} worker restarts")
    return 0
