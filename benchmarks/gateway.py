"""What the HTTP gateway costs: tokens/s of 1 and of 8 concurrent streams through the gateway vs through
the native client, in the same run, against the same daemon (goal: >= 0.95x), and the gateway's CPU
time per streamed token.

Starts a real `ember serve` (max_active 8) on a temporary socket and `ember gateway` beside it (its own
process, as in production), then, for each stream count, runs `--repeats` pairs of rounds, native and
gateway, in alternating order: N streams started together, greedy, `--tokens` tokens each with
ignore_eos, different prompts; aggregate tokens/s = all tokens / wall time from the first request to the
last token. Reported: the medians, and the ratio as the median of each pair's (these VMs drift by 10%
within a minute). Native streams are AsyncClients; gateway streams are aiohttp clients reading
/v1/completions' server-sent events (each event decoded as JSON, usage from stream_options), so the
figure is the gateway's cost plus an HTTP client's, not a heavyweight SDK's. The gateway's CPU per
token is its process's CPU time (/proc) over the gateway rounds divided by the tokens it streamed.

    python benchmarks/gateway.py [--model PATH] [--tokens 512] [--repeats 9]
    python benchmarks/gateway.py --grammar    # the per-token cost of constrained decoding
    python benchmarks/gateway.py --stacks     # server CPU per SSE event: aiohttp vs starlette+uvicorn

`--grammar` runs the same gateway rounds (1 and 8 streams, greedy and sampled at temperature 0.8,
seeded) free and under a grammar, alternating, and reports time per token: under a grammar that
admits any text (regex `(.|\n)*`: the mechanism's own cost, the same tokens as free) and under a JSON
schema (24 records of a name and a value: a real grammar's masks, ~400-500 tokens an answer; other
tokens than the free rounds').

`--stacks` needs starlette and uvicorn (not dependencies of ember): it is the measurement behind the
choice of aiohttp (docs/gateway.md). Everything shares the machine's cores, as a local setup does.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "daemon"))  # the test suite's daemon launcher

from daemon_process import DaemonProcess

from ember.client import AsyncClient

SNIPPETS = ["def fibonacci(n):", "import os\nimport sys\n", "class Parser:\n    def __init__(self, text):",
            "for i in range(10):\n    print(", "# read the config file\nwith open(", "x = [", "return self.",
            "async def fetch(session, url):"]
MODEL = "ember-demo"
Round = Callable[[int, int], Awaitable[int]]  # (streams, tokens) -> tokens received


# --- the two paths -----------------------------------------------------------------------------------
async def native_round(socket_path: Path, n: int, tokens: int) -> int:
    async def one(i: int) -> int:
        async with AsyncClient(socket_path, timeout=600) as client:
            return sum([len(c.token_ids) async for c in client.generate(SNIPPETS[i % 8], max_tokens=tokens,
                                                                         ignore_eos=True)])
    return sum(await asyncio.gather(*(one(i) for i in range(n))))


async def gateway_round(url: str, model: str, n: int, tokens: int, **extra: Any) -> int:
    """n streams of /v1/completions; extra: body fields (a grammar, sampling)."""
    decode = msgspec.json.Decoder().decode

    async def one(session: aiohttp.ClientSession, i: int) -> int:
        body = {"model": model, "prompt": SNIPPETS[i % 8], "max_tokens": tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, "seed": i, **extra}
        async with session.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            usage = 0
            async for line in response.content:
                if line.startswith(b"data: {"):
                    event = decode(line[6:])
                    if event.get("usage"):
                        usage = event["usage"]["completion_tokens"]
            return int(usage)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return sum(await asyncio.gather(*(one(session, i) for i in range(n))))


async def timed(run: Round, n: int, tokens: int) -> float:
    t0 = time.perf_counter()
    got = await run(n, tokens)
    assert got == n * tokens, f"{got} tokens, expected {n * tokens}"
    return got / (time.perf_counter() - t0)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# --- the run -----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(f"{url}/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not come up")
            await asyncio.sleep(0.1)


async def compare(args: argparse.Namespace, socket_path: Path, url: str, gateway_pid: int, model: str) -> None:
    def native(n: int, tokens: int) -> Awaitable[int]:
        return native_round(socket_path, n, tokens)

    def gateway(n: int, tokens: int) -> Awaitable[int]:
        return gateway_round(url, model, n, tokens)

    await timed(native, 2, 16)  # warm both paths (connections, the gateway's first request)
    await timed(gateway, 2, 16)
    print(f"{args.tokens} tokens per stream, greedy, medians of {args.repeats} rounds of each path, alternating")
    print("| streams | native tok/s | gateway tok/s | gateway / native | gateway CPU per token |")
    print("|---|---|---|---|---|")
    for n in (1, 8):
        rates: dict[str, list[float]] = {"native": [], "gateway": []}
        cpu = 0.0
        for i in range(args.repeats):
            for path in (("native", "gateway") if i % 2 == 0 else ("gateway", "native")):  # drift hits both alike
                before = cpu_seconds(gateway_pid)
                rates[path].append(await timed(native if path == "native" else gateway, n, args.tokens))
                if path == "gateway":
                    cpu += cpu_seconds(gateway_pid) - before
        a, b = statistics.median(rates["native"]), statistics.median(rates["gateway"])
        ratio = statistics.median(g / r for g, r in zip(rates["gateway"], rates["native"]))  # of each round's pair
        per_token = cpu / (args.repeats * n * args.tokens) * 1e6
        print(f"| {n} | {a:.0f} | {b:.0f} | {ratio:.3f} | {per_token:.0f} us |", flush=True)


RECORDS = {"type": "array", "minItems": 24, "maxItems": 24,  # long answers: the demo would close an open array at once
           "items": {"type": "object", "additionalProperties": False, "required": ["name", "value"],
                     "properties": {"name": {"type": "string", "minLength": 4, "maxLength": 12},
                                    "value": {"type": "integer", "minimum": 0, "maximum": 9999}}}}
GRAMMARS = {"any text": {"guided_regex": "(.|\n)*"}, "JSON schema": {"json_schema": RECORDS}}


async def compare_grammar(args: argparse.Namespace, url: str, model: str) -> None:
    """Time per token, free and under each of GRAMMARS, in alternating rounds through the gateway."""
    async def per_token(n: int, **extra: Any) -> float:
        t0 = time.perf_counter()
        got = await gateway_round(url, model, n, args.tokens, **extra)
        return (time.perf_counter() - t0) / got * 1e6

    await per_token(2, **GRAMMARS["JSON schema"])  # warm: llguidance's vocabulary is built on first use
    print(f"{args.tokens} tokens per stream at most, medians of {args.repeats} rounds, alternating; us per token "
          "(wall time / tokens, all streams together)")
    print("| streams | sampling | grammar | free | constrained | constrained / free |")
    print("|---|---|---|---|---|---|")
    for n in (1, 8):
        for sampling in ({"temperature": 0}, {"temperature": 0.8}):
            for name, grammar in GRAMMARS.items():
                times: dict[str, list[float]] = {"free": [], "constrained": []}
                for i in range(args.repeats):
                    for kind in (("free", "constrained") if i % 2 == 0 else ("constrained", "free")):
                        times[kind].append(await per_token(n, **sampling, **(grammar if kind == "constrained" else {})))
                free, bound = statistics.median(times["free"]), statistics.median(times["constrained"])
                ratio = statistics.median(c / f for c, f in zip(times["constrained"], times["free"]))
                label = "greedy" if sampling["temperature"] == 0 else "T 0.8"
                print(f"| {n} | {label} | {name} | {free:.0f} | {bound:.0f} | {ratio:.3f} |", flush=True)


def run_comparison(args: argparse.Namespace) -> None:
    config = "[engine]\nmax_active = 8\n[limits]\nmax_tokens = 32768\n"
    daemon_args = ("--model", args.model) if args.model else ()
    daemon = DaemonProcess(config, args=daemon_args).wait_ready(600)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "EMBER_API_KEY"}
    gateway = subprocess.Popen([sys.executable, "-m", "ember.client.cli", "gateway", "--listen", f"127.0.0.1:{port}",
                                "--socket", str(daemon.socket)], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        async def go() -> None:
            await wait_http(url)
            async with AsyncClient(daemon.socket) as client:
                model = (await client.models())[0].name
            if args.grammar:
                await compare_grammar(args, url, model)
            else:
                await compare(args, daemon.socket, url, gateway.pid, model)

        asyncio.run(go())
    finally:
        gateway.terminate()
        gateway.wait(30)
        daemon.stop()


# --- --stacks: aiohttp vs starlette + uvicorn, one SSE event per token --------------------------------
EVENT = (b'data: {"id":"cmpl-0123456789abcdef01234567","object":"text_completion","created":1700000000,'
         b'"model":"ember-demo","choices":[{"text":" tok","index":0,"logprobs":null,"finish_reason":null}]}\n\n')


async def _events(n: int) -> AsyncIterator[bytes]:
    """n events, each after a queue hand-off as the gateway's come from the SDK's reader task."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def feed() -> None:
        for _ in range(n):
            queue.put_nowait(EVENT)
            await asyncio.sleep(0)
        queue.put_nowait(None)

    task = asyncio.ensure_future(feed())
    while (event := await queue.get()) is not None:
        yield event
    yield b"data: [DONE]\n\n"
    await task


def _serve_stack(stack: str, port: int) -> None:
    import uvloop

    if stack == "aiohttp":
        from aiohttp import web

        async def stream(request: web.Request) -> web.StreamResponse:
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            async for event in _events(int(request.query["n"])):
                await response.write(event)
            await response.write_eof()
            return response

        async def cpu(request: web.Request) -> web.Response:
            return web.Response(text=str(time.process_time()))

        app = web.Application()
        app.router.add_get("/stream", stream)
        app.router.add_get("/cpu", cpu)
        web.run_app(app, host="127.0.0.1", port=port, print=None, loop=uvloop.new_event_loop())
    else:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import PlainTextResponse, StreamingResponse
        from starlette.routing import Route

        async def sstream(request: Request) -> StreamingResponse:
            return StreamingResponse(_events(int(request.query_params["n"])), media_type="text/event-stream")

        async def scpu(request: Request) -> PlainTextResponse:
            return PlainTextResponse(str(time.process_time()))

        uvicorn.run(Starlette(routes=[Route("/stream", sstream), Route("/cpu", scpu)]), host="127.0.0.1", port=port,
                    loop="uvloop", http="httptools", log_level="error")


async def _stack_round(url: str, streams: int, n: int) -> tuple[float, float]:
    """(server CPU us per event, events/s) for `streams` concurrent streams of n events."""
    async with aiohttp.ClientSession() as session:
        async def cpu() -> float:
            async with session.get(f"{url}/cpu") as r:
                return float(await r.text())

        async def one() -> int:
            async with session.get(f"{url}/stream", params={"n": str(n)}) as r:
                return sum([line.startswith(b"data: {") async for line in r.content])

        c0, t0 = await cpu(), time.perf_counter()
        events = sum(await asyncio.gather(*(one() for _ in range(streams))))
        wall, used = time.perf_counter() - t0, await cpu() - c0
    return used / events * 1e6, events / wall


def run_stacks() -> None:
    print("| stack | streams | server CPU per event | events/s |")
    print("|---|---|---|---|")
    for stack in ("aiohttp", "starlette+uvicorn"):
        port = free_port()
        server = subprocess.Popen([sys.executable, __file__, "--serve-stack", stack, str(port)])
        try:
            asyncio.run(wait_http_port(port))
            for streams, n in ((1, 20000), (8, 2500)):
                best = min(asyncio.run(_stack_round(f"http://127.0.0.1:{port}", streams, n)) for _ in range(3))
                print(f"| {stack} | {streams} | {best[0]:.1f} us | {best[1]:.0f} |", flush=True)
        finally:
            server.terminate()
            server.wait(10)


async def wait_http_port(port: int) -> None:
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError("the stack's server did not come up")


def main() -> None:
    if sys.argv[1:2] == ["--serve-stack"]:
        return _serve_stack(sys.argv[2], int(sys.argv[3]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model file or directory (default: the built-in demo model)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per stream (default 512)")
    parser.add_argument("--repeats", type=int, default=9, help="rounds of each path per stream count (default 9)")
    parser.add_argument("--grammar", action="store_true", help="the per-token cost of constrained decoding")
    parser.add_argument("--stacks", action="store_true", help="compare the HTTP stacks instead (needs starlette, uvicorn)")
    args = parser.parse_args()
    if args.stacks:
        run_stacks()
    else:
        run_comparison(args)


if __name__ == "__main__":
    main()
