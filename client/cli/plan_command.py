"""`ember plan MODEL`: the memory plan of a model on given devices, from its metadata alone, as a table
or as JSON (schema: docs/planner.md). Exit status 0 when it fits, 2 when it does not (1 for errors).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

EXIT_DOES_NOT_FIT = 2


def add_plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="compute a model's memory plan from its metadata (no weights read)",
                       description="Print how much memory MODEL needs per device, and whether it fits. "
                                   "Exit status: 0 fits, 2 does not fit, 1 error.")
    p.add_argument("model", metavar="MODEL", help="GGUF file, Hugging Face model directory, or a hub name "
                                                  "owner/repo[:QUANT] (fetched into the hub's cache first)")
    p.add_argument("--ctx", type=int, default=None, help="tokens per sequence (default: the model's context length)")
    p.add_argument("--seqs", type=int, default=1, help="sequences resident at once (default 1)")
    p.add_argument("--device", action="append", default=None, metavar="SPEC",
                   help="cpu, cpu=16GiB, cuda:0=24GiB or cuda:0=24GiB@8.9 (compute capability); repeat to split "
                        "the layers across devices, in order (default: cpu with the available RAM)")
    p.add_argument("--split", default=None, metavar="N,N,..",
                   help="layers per device (default: their weights' bytes in proportion to the budgets, the "
                        "output head counted on the last)")
    p.add_argument("--kv-dtype", default=None, help="f32, f16, bf16 or q8_0 (also EMBER_KV_DTYPE)")
    p.add_argument("--act-dtype", default=None, help="activation staging: f32, f16 or bf16 (also EMBER_ACT_DTYPE)")
    p.add_argument("--feature-dtype", default=None, help="speculative feature mirror: f32, f16, bf16, q8_0 "
                                                          "(also EMBER_FEATURE_DTYPE)")
    p.add_argument("--prefill-chunk", type=int, default=None, help="prompt tokens per step (default 256)")
    p.add_argument("--expert-offload", action="store_true", help="MoE: GPUs keep the experts that fit, CPU workers the rest")
    p.add_argument("--expert-budget", default=None, metavar="SIZE|N%",
                   help="MoE: hot experts' bytes at most (512MiB, or N%% of the experts); the rest run cold on CPU workers")
    p.add_argument("--speculative", action="store_true", help="reserve the speculative-decoding feature mirror")
    p.add_argument("--spec-layers", type=int, default=3,
                   help="target layers a feature draft reads per position: len(dflash.target_layers) (default 3)")
    p.add_argument("--draft", default=None, metavar="PATH", help="a draft model for speculative decoding: its weights, "
                   "KV cache and proposals are counted on the device (a DFlash draft: its feature mirror too); "
                   "ngram: no model, the proposals' logits rows only")
    p.add_argument("--draft-tokens", type=int, default=4, help="tokens the draft proposes per step (default 4)")
    p.add_argument("--graph-headroom", default=None, metavar="SIZE", help="per CUDA device (default 256MiB)")
    p.add_argument("--act-cap", default=None, metavar="SIZE", help="activation reservation cap per device")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (schema ember.plan/1)")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    from ember.client.cli.hub_commands import progress_for_stderr
    from ember.daemon.loader.hub import Hub, resolve_model
    from ember.daemon.loader.model_file_error import ModelFileError
    from ember.daemon.planning.planner import plan_model

    hub, progress = Hub.from_env(os.environ), progress_for_stderr()  # a model by name is fetched first
    model = resolve_model(args.model, hub, progress)
    # n-gram proposals (--draft ngram) need no model: no draft in the plan (their logits rows: _request)
    draft = None if args.draft in (None, "ngram") else resolve_model(args.draft, hub, progress)
    try:
        plan = plan_model(model, _request(args), draft, args.draft_tokens)
    except ModelFileError as e:
        print(f"ember: error: cannot read model: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(plan_dict(plan), indent=2))
    else:
        print(render_table(plan))
    return 0 if plan.fits else EXIT_DOES_NOT_FIT


def _request(args: argparse.Namespace) -> Any:
    from ember.daemon.planning.planner import PlanRequest, SpeculativeSettings, parse_device, parse_size
    from ember.daemon.planning.precision import PrecisionSettings

    devices = [parse_device(s) for s in (args.device or ["cpu"])]
    options: dict[str, Any] = dict(ctx=args.ctx, seqs=args.seqs, expert_offload=args.expert_offload,
                                   expert_budget=args.expert_budget)
    if args.split:
        options["split"] = tuple(int(n) for n in args.split.split(","))
    if args.prefill_chunk is not None:
        options["prefill_chunk"] = args.prefill_chunk
    if args.speculative:
        options["speculative"] = SpeculativeSettings(args.spec_layers)
    if args.draft == "ngram":  # n-gram lookup: no draft model, the proposals' logits rows only
        options["proposals"] = args.draft_tokens
    if args.graph_headroom is not None:
        options["graph_headroom"] = parse_size(args.graph_headroom)
    if args.act_cap is not None:
        options["act_cap"] = parse_size(args.act_cap)
    flags = PrecisionSettings(act=args.act_dtype, feature=args.feature_dtype, kv=args.kv_dtype)
    # the kernel threads a process started from this shell would run (numba's variable, else one per core)
    threads = int(os.environ.get("NUMBA_NUM_THREADS") or 0) or None
    return PlanRequest.create(devices, flags=flags, env=os.environ, cpu_threads=threads, **options)


def render_table(plan: Any) -> str:
    """The plan as a readable table: one column per device, then the verdict (and, if it does not
    fit, what to change)."""
    from pathlib import Path

    from ember.daemon.planning.planner import explain, fmt_bytes

    cfg, req, pol = plan.model.config, plan.request, plan.request.policy
    moe = f", {cfg.n_experts} experts ({cfg.n_experts_used} used)" if cfg.n_experts else ""
    if cfg.linear:
        moe += f", {cfg.linear.n_layers} linear-attention layers ({fmt_bytes(cfg.state_bytes())} state per sequence)"
    src = pol.sources
    head = [
        f"model    {Path(plan.model.path).name} ({plan.model.format}, {cfg.arch}, {cfg.n_layers} layers, "
        f"hidden {cfg.hidden}, ffn {cfg.ffn}{moe}, vocab {cfg.vocab})",
        f"request  ctx {plan.ctx} x {req.seqs} sequence{'s' if req.seqs > 1 else ''}, "
        f"{max(req.seqs, req.prefill_chunk)} tokens per step",
        f"dtypes   kv {pol.kv} ({src.get('kv')}), activations {pol.act} ({src.get('act')}), "
        f"feature mirror {pol.feature} ({src.get('feature')})",
        "",
    ]

    def size(n: int) -> str:
        return fmt_bytes(n) if n else "-"

    ds = plan.devices
    rows: list[tuple[str, list[str]]] = [
        ("", [d.device.name for d in ds]),
        ("layers", [f"{d.layers[0]}-{d.layers[1] - 1}" if d.layers[1] > d.layers[0] else "-" for d in ds]),
        ("budget", [fmt_bytes(d.device.budget) for d in ds]),
        ("weights", [size(d.weights.total - d.weights.experts) for d in ds]),
        ("  embeddings", [size(d.weights.embeddings) for d in ds]),
        ("  attention", [size(d.weights.attention) for d in ds]),
        ("  dense FFN", [size(d.weights.dense_ffn) for d in ds]),
        ("  output", [size(d.weights.output) for d in ds]),
        ("  other", [size(d.weights.other) for d in ds]),
    ]
    if cfg.n_experts:
        rows += [("MoE experts", [size(d.weights.experts) for d in ds]),
                 ("  hot (resident)", [size(d.experts_hot) for d in ds]),
                 ("  cold (CPU workers)", [size(d.weights.experts - d.experts_hot) for d in ds])]
    rows += [
        ("KV cache", [size(d.kv_cache) for d in ds]),
    ]
    if cfg.linear:
        rows += [("recurrent state", [size(d.recurrent_state) for d in ds])]
    rows += [
        ("activations", [size(d.activations.bytes) for d in ds]),
        ("CUDA-graph headroom", [size(d.graph_headroom) for d in ds]),
        ("layer-split staging", [size(d.staging) for d in ds]),
        ("feature mirror", [size(d.feature_mirror) for d in ds]),
    ]
    if plan.draft is not None:
        rows += [("draft model", [size(d.draft) for d in ds]), ("  weights", [size(d.draft_weights) for d in ds]),
                 ("  KV cache", [size(d.draft_kv_cache) for d in ds]), ("  proposals", [size(d.draft_proposals) for d in ds])]
    rows += [
        ("required", [fmt_bytes(d.required) for d in ds]),
        ("free", [fmt_bytes(d.free) for d in ds]),
        ("fits", ["yes" if d.fits else "NO" for d in ds]),
    ]
    width = max(12, *(len(v) for _, vals in rows for v in vals))
    lines = head + [f"{label:<22}" + "".join(f"{v:>{width + 2}}" for v in vals) for label, vals in rows]
    a = ds[-1].activations
    if a.estimate is None:
        lines.append(f"\nactivations: model dimensions unknown, the flat {fmt_bytes(a.cap)} per device")
    else:
        capped = f", capped at {fmt_bytes(a.cap)}" if a.rule == "cap" else ""
        lines.append(f"\nactivations ({ds[-1].device.name}): the larger of {a.widest} wide x {a.tokens} tokens x "
                     f"{a.elem_bytes} B x {a.safety:.3f} = {fmt_bytes(a.buffers)} and logits {fmt_bytes(a.logits)} + "
                     f"sampler {fmt_bytes(a.sampler)}, plus kernel scratch {fmt_bytes(a.scratch)}{capped}")
    lines += _placement_lines(plan)
    lines.append("\n" + ("It fits." if plan.fits else explain(plan)))
    return "\n".join(lines)


def _placement_lines(plan: Any) -> list[str]:
    """Hot and cold experts per MoE layer (ids where there are few enough to read)."""
    from ember.daemon.experts.placement import planned_placement

    placed = planned_placement(plan, _cache_dir())
    if placed is None or not any(d.offloads_experts for d in plan.devices):
        return []
    hot, moe = placed
    lines = ["", "hot experts per layer (placed by the saved routing statistics, else by id):"]
    for layer, row in enumerate(hot):
        if not moe[layer]:
            lines.append(f"  layer {layer:>3}: dense")
            continue
        ids = [int(e) for e in row.nonzero()[0]]
        listed = f"  [{' '.join(map(str, ids))}]" if row.size <= 64 else ""
        lines.append(f"  layer {layer:>3}: {len(ids):>4} hot, {row.size - len(ids):>4} cold{listed}")
    return lines


def plan_dict(plan: Any) -> dict[str, Any]:
    """The plan as the JSON document of docs/planner.md (schema ember.plan/1); all sizes in bytes."""
    from ember.daemon.planning.planner import SCHEMA, explain, expert_ffn

    cfg, req, pol = plan.model.config, plan.request, plan.request.policy
    return {
        "schema": SCHEMA,
        "model": {"path": plan.model.path, "format": plan.model.format, "arch": cfg.arch, "layers": cfg.n_layers,
                  "hidden": cfg.hidden, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                  "ffn": cfg.ffn, "vocab": cfg.vocab, "context_length": cfg.context_length, "experts": cfg.n_experts,
                  "experts_used": cfg.n_experts_used, "expert_ffn": expert_ffn(cfg)},
        "request": {"ctx": plan.ctx, "seqs": req.seqs, "prefill_chunk": req.prefill_chunk, "kv_block": req.kv_block,
                    "expert_offload": req.expert_offload, "expert_budget": req.expert_budget,
                    "speculative": None if req.speculative is None else vars(req.speculative).copy()},
        "precision": {"act": pol.act, "feature": pol.feature, "kv": pol.kv, "sources": dict(pol.sources)},
        "devices": [_device_dict(d) for d in plan.devices],
        "hot_experts": _hot_ids(plan),
        "fits": plan.fits,
        "problem": None if plan.fits else explain(plan),
    }


def _cache_dir() -> Any:
    """ember's cache directory, where routing statistics are saved (this command's environment)."""
    from ember.daemon.experts.routing_stats import cache_root

    return cache_root(os.environ)


def _hot_ids(plan: Any) -> list[list[int]] | None:
    """Per layer, the ids of the hot experts (docs/experts.md); None for a dense model."""
    from ember.daemon.experts.placement import planned_placement

    placed = planned_placement(plan, _cache_dir())
    return None if placed is None else [[int(e) for e in row.nonzero()[0]] for row in placed[0]]


def _device_dict(d: Any) -> dict[str, Any]:
    from ember.daemon.planning.planner import WEIGHT_CLASSES

    w, a = d.weights, d.activations
    return {
        "device": d.device.name, "budget": d.device.budget, "layers": list(d.layers),
        "weights": {**{c: getattr(w, c) for c in WEIGHT_CLASSES}, "total": w.total},
        "kv_cache": d.kv_cache, "recurrent_state": d.recurrent_state,
        "activations": {"bytes": a.bytes, "rule": a.rule, "estimate": a.estimate, "cap": a.cap, "widest": a.widest,
                        "tokens": a.tokens, "elem_bytes": a.elem_bytes, "safety": a.safety, "buffers": a.buffers,
                        "logits": a.logits, "sampler": a.sampler, "scratch": a.scratch},
        "graph_headroom": d.graph_headroom, "staging": d.staging, "feature_mirror": d.feature_mirror,
        "draft": {"weights": d.draft_weights, "kv_cache": d.draft_kv_cache, "proposals": d.draft_proposals, "total": d.draft},
        "experts_offloaded": d.offloads_experts, "experts_hot": d.experts_hot,
        "experts_cold": d.weights.experts - d.experts_hot, "expert_bytes": d.expert_bytes,
        "required": d.required, "free": d.free, "fits": d.fits,
    }
