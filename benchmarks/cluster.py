"""What the cluster costs and gives, on this machine, in one run: one daemon behind its gateway vs two
replicas on a two-node Ray cluster behind the ingress (`ember cluster serve`, its own process).

- Throughput: N greedy streams of /v1/completions started together (`--tokens` each, ignore_eos,
  different prompts), aggregate tokens/s, at 8 and 32 streams; `--repeats` rounds of each path,
  alternating, medians.
- Added latency per request: sequential one-token chat requests, the median wall time through each
  path; the difference is the ingress, the Serve handle, the relay and the loopback hop to the
  replica's gateway.
- Where the cluster path's CPU goes: each process's CPU time (/proc) over the cluster rounds, by its
  part (ingress, replica actors, their gateways, daemons and engine processes, Ray's own), per token.

Fair on one machine: the lone daemon's kernels get every core (--threads default), each replica's
its one Ray CPU (replicas.cpus = cores / 2). On this 2-core VM both paths share the same two cores,
so the replicas cannot add throughput here; the figures show what the path costs. What they mean on
real nodes: docs/cluster.md.

    python benchmarks/cluster.py [--model PATH] [--tokens 128] [--repeats 3] [--requests 40]
    python benchmarks/cluster.py --split [--model PATH] [--tokens 128] [--repeats 3]

`--split`: a layer split across two Ray nodes of this machine vs the same split in local stage
processes (split_hop): decode tok/s at 1 and 8 streams and the hop's cost per token.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "daemon"))

from daemon_process import DaemonProcess, children  # noqa: E402
from gateway import cpu_seconds, free_port, gateway_round, timed, wait_http  # noqa: E402

DAEMON_CONFIG = "[engine]\nmax_active = 8\nmax_per_process = 0\n[limits]\nmax_tokens = 32768\n"


async def model_name(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/v1/models") as r:
        return str((await r.json())["data"][0]["id"])


async def latency(url: str, model: str, requests: int) -> float:
    """Median seconds of a one-token chat request, sent one after another."""
    times = []
    async with aiohttp.ClientSession() as session:
        for i in range(requests):
            body = {"model": model, "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "user", "content": f"Say a word about {i}."}]}
            t0 = time.perf_counter()
            async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:])  # the first requests load code


ROLES = (("ingress", "cluster serve"), ("replica actors", "ServeReplica"), ("replica gateways", "daemon_child gateway"),
         ("replica daemons", "daemon_child serve"), ("replica engines", "engine_main"), ("ray", "ray"))


def cpu_by_role(exclude: set[int]) -> dict[str, float]:
    """CPU seconds so far of this machine's processes, by their part in the cluster path (by command
    line; `exclude`: the lone daemon's processes)."""
    out = dict.fromkeys([r for r, _ in ROLES], 0.0)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) in exclude:
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            seconds = cpu_seconds(int(proc.name))
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        for role, needle in ROLES:
            if needle in cmdline:
                out[role] += seconds
                break
    return out


async def compare(args: argparse.Namespace, single: str, cluster: str, lone: set[int]) -> None:
    await wait_http(single, 60)
    await wait_http(cluster, 600)  # its /health is a replica's gateway's: up once a daemon serves
    model = await model_name(single)
    print(f"model {model}, {args.tokens} tokens a stream, {args.repeats} rounds each, "
          f"{os.cpu_count()} cores", flush=True)
    for n in (8, 32):
        rates: dict[str, list[float]] = {"single": [], "cluster": []}
        spent = dict.fromkeys([r for r, _ in ROLES], 0.0)
        for r in range(args.repeats):
            for name in (("single", "cluster") if r % 2 == 0 else ("cluster", "single")):
                url = single if name == "single" else cluster
                before = cpu_by_role(lone)
                rates[name].append(await timed(lambda k, t, u=url: gateway_round(u, model, k, t), n, args.tokens))
                if name == "cluster":
                    spent = {k: v + cpu_by_role(lone)[k] - before[k] for k, v in spent.items()}
        s, c = statistics.median(rates["single"]), statistics.median(rates["cluster"])
        print(f"{n:3d} streams: one daemon {s:8.1f} tok/s, two replicas {c:8.1f} tok/s, ratio {c / s:.2f}x", flush=True)
        tokens = n * args.tokens * args.repeats
        print("     cluster CPU ms per token: " + ", ".join(f"{k} {v * 1e3 / tokens:.3f}" for k, v in spent.items()),
              flush=True)
    async with aiohttp.ClientSession() as session, session.get(f"{cluster}/v1/cluster/replicas") as r:
        served = [d["stats"]["requests_total"] for d in (await r.json())["data"] if "stats" in d]
    print(f"requests per replica: {served}", flush=True)
    lone, spread = await latency(single, model, args.requests), await latency(cluster, model, args.requests)
    print(f"one-token request: one daemon {lone * 1e3:.1f} ms, through the cluster {spread * 1e3:.1f} ms, "
          f"added {(spread - lone) * 1e3:.1f} ms", flush=True)


def split_hop(args: argparse.Namespace) -> None:
    """The same split (3 + 2 layers, f32 staging, one kernel thread a stage) as two local stage processes
    (shared memory) and as two Ray actors on two nodes of this machine (object store): decode rates at
    1 and 8 streams, alternating, medians, and what the Ray hop adds per token of one stream."""
    import ray
    from ray.cluster_utils import Cluster

    import ember
    from ember.daemon.loader.demo_model import DEMO_MODEL
    from layer_split import decode

    path = args.model or str(DEMO_MODEL)
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    nodes.add_node(num_cpus=1)
    ray.init(address=nodes.address, log_to_driver=False)
    split = None if args.model else [3, 2]
    models = {"local cpu:0,cpu:1": ember.load(path, devices="cpu:0,cpu:1", split=split, act_dtype="f32", stage_threads=1),
              "ray:0/cpu,ray:1/cpu": ember.load(path, devices=["ray:0/cpu", "ray:1/cpu"], split=split, act_dtype="f32",
                                               stage_threads=1)}
    try:
        print(f"{path}: split {[(s.first, s.end) for s in models['local cpu:0,cpu:1'].pipeline.specs]}, "
              f"{args.tokens} greedy tokens a stream, {args.repeats} rounds each, alternating", flush=True)
        for streams in (1, 8):
            rates: dict[str, list[float]] = {name: [] for name in models}
            for r in range(args.repeats):
                for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
                    rates[name].append(decode(models[name], streams, args.tokens).rate)
            local, remote = (statistics.median(v) for v in rates.values())
            line = f"{streams} stream(s): local stages {local:7.1f} tok/s, Ray stages {remote:7.1f} tok/s ({remote / local:.2f}x)"
            if streams == 1:
                line += f"; the Ray hops add {(1 / remote - 1 / local) * 1e3:.2f} ms a token (two hops and the logits)"
            print(line, flush=True)
            for name, m in models.items():  # each stage's own time (the last rounds' decode micro-batches)
                p = m.pipeline
                print(f"    {name}: " + ", ".join(f"stage {i} {1e3 * t / max(n, 1):.3f} ms x {n}"
                                                 for i, (t, n) in enumerate(zip(p.run_seconds, p.runs, strict=True))),
                      flush=True)
    finally:
        for m in models.values():
            m.close()
        ray.shutdown()
        nodes.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model file or directory (default: the built-in demo model)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream (default 128)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of each path per stream count (default 3)")
    parser.add_argument("--requests", type=int, default=40, help="sequential requests for the latency (default 40)")
    parser.add_argument("--split", action="store_true", help="a layer split on two Ray nodes vs the same in local "
                                                             "processes: the hop's cost per token")
    args = parser.parse_args()
    if args.split:
        return split_hop(args)
    import ray
    from ray.cluster_utils import Cluster

    model_args = ["--model", args.model] if args.model else []
    cores = os.cpu_count() or 2
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": max(1, cores // 2)})
    nodes.add_node(num_cpus=max(1, cores // 2))
    work = Path(tempfile.mkdtemp(prefix="ember-cluster-bench-"))
    (work / "ember.toml").write_text(DAEMON_CONFIG)
    port = free_port()
    (work / "cluster.toml").write_text(
        f'[ingress]\nlisten = "127.0.0.1:{port}"\n[replicas]\nmin = 2\nmax = 2\ncpus = {max(1, cores // 2)}\n'
        f'max_ongoing_requests = 64\n[daemon]\nconfig = "{work / "ember.toml"}"\nargs = {model_args!r}\n'.replace("'", '"'))
    env = {k: v for k, v in os.environ.items() if k != "EMBER_API_KEY"}
    ingress = subprocess.Popen([sys.executable, "-m", "ember.client.cli", "cluster", "serve", str(work / "cluster.toml"),
                                "--address", nodes.address], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    daemon = DaemonProcess(DAEMON_CONFIG, args=tuple(model_args)).wait_ready(600)
    gport = free_port()
    gateway = subprocess.Popen([sys.executable, "-m", "ember.client.cli", "gateway", "--listen", f"127.0.0.1:{gport}",
                                "--socket", str(daemon.socket)], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        lone = {daemon.proc.pid, gateway.pid, *children(daemon.proc.pid)}
        asyncio.run(compare(args, f"http://127.0.0.1:{gport}", f"http://127.0.0.1:{port}", lone))
    finally:
        for p in (gateway, ingress):
            p.terminate()
            p.wait(60)
        daemon.stop()
        ray.shutdown()
        nodes.shutdown()


if __name__ == "__main__":
    main()
