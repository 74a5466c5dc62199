"""Train a DFlash feature-conditioned draft for a Qwen3-style HF target, and write it as the GGUF that
llama.cpp's `dflash` architecture (and ember) loads. Needs the oracle extra (torch, transformers).

    python -m ember.daemon.speculative.dflash_training --target DIR --out DIR \
        --converter LLAMA_CPP/convert_hf_to_gguf.py [--corpus-mb 12] [--minutes 30] [--outtype q8_0]

1. Corpus: this machine's Python sources, as the demo models' corpus was built (dflash_corpus.py),
   tokenized with the target's tokenizer.
2. Each step: the frozen target (float32, CPU) runs a batch of corpus windows; forward hooks keep the
   outputs of the target_layer_ids layers (the draft's context rows) and the logits (its teacher).
   Anchors are sampled in each window (z-lab's recipe): a block is [token at the anchor, mask, ...],
   at the anchor's positions, seeing the context rows before the anchor. Block row k (k >= 1) learns
   the target's distribution for the token at anchor + k (soft cross-entropy against the target's
   logits, so the draft learns what the target would say, not the corpus), weighted exp(-(k-1)/gamma):
   early rows matter most, since a rejection ends the block.
3. Every --eval-every steps and at the end: greedy block acceptance on held-out prompts
   (dflash_acceptance.py); at the end also with the context rows rounded through each mirror dtype.
4. Save z-lab's HF layout (OUT/hf) and convert it with llama.cpp's own converter to
   OUT/<name>-<outtype>.gguf; training.json records the run.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from ember.daemon.loader.llama_cpp_converter import convert_hf
from ember.daemon.speculative.dflash_acceptance import EvalSet, FrozenTarget, block_inputs
from ember.daemon.speculative.dflash_corpus import build_corpus
from ember.daemon.speculative.dflash_torch import DFlashConfig, DFlashDraft
from ember.kernels.convert import STORAGE_DTYPES


@dataclass(frozen=True)
class Schedule:
    seq_len: int
    batch: int
    anchors: int  # blocks per window
    lr: float
    gamma: float  # loss decay over block rows
    seconds: float
    warmup: int = 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True, help="the target's HF directory (Qwen3)")
    p.add_argument("--out", type=Path, required=True, help="directory for hf/, the GGUF and training.json")
    p.add_argument("--converter", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py")
    p.add_argument("--outtype", default="q8_0", choices=["f32", "f16", "bf16", "q8_0"])
    p.add_argument("--name", default="ember-demo-dflash", help="GGUF file name stem")
    p.add_argument("--corpus-mb", type=float, default=12.0, help="MB of Python source to take")
    p.add_argument("--minutes", type=float, default=30.0, help="training wall time")
    p.add_argument("--target-layers", default="1,4", help="0-based target layers the draft reads")
    p.add_argument("--layers", type=int, default=1, help="draft layers")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--anchors", type=int, default=48)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--gamma", type=float, default=4.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts for acceptance")
    p.add_argument("--eval-tokens", type=int, default=96, help="generated tokens per prompt")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", type=Path, help="start from this draft (an earlier run's OUT/hf)")
    return p.parse_args(argv)


def draft_config(target_cfg: dict, args: argparse.Namespace, mask_token_id: int) -> DFlashConfig:
    rope = target_cfg.get("rope_parameters") or {}
    return DFlashConfig(
        hidden_size=target_cfg["hidden_size"], vocab_size=target_cfg["vocab_size"],
        rope_theta=float(rope.get("rope_theta", target_cfg.get("rope_theta", 10000.0))),
        rms_norm_eps=target_cfg["rms_norm_eps"], num_target_layers=target_cfg["num_hidden_layers"],
        target_layer_ids=tuple(int(i) for i in args.target_layers.split(",")), mask_token_id=mask_token_id,
        num_hidden_layers=args.layers, num_attention_heads=target_cfg["num_attention_heads"],
        num_key_value_heads=target_cfg["num_key_value_heads"],
        head_dim=target_cfg.get("head_dim", target_cfg["hidden_size"] // target_cfg["num_attention_heads"]),
        intermediate_size=target_cfg["intermediate_size"], block_size=args.block_size)


def rarest_token(train: np.ndarray, vocab: int) -> int:
    """The mask id: the token the corpus uses least (its embedding is the target's, frozen, so any id
    works; a rare one keeps the mask unlike every anchor the draft sees)."""
    counts = np.bincount(train, minlength=vocab)
    return int(vocab - 1 - np.argmin(counts[::-1]))  # ties: the highest id (the latest BPE merge)


def windows(data: np.ndarray, rng: np.random.Generator, batch: int, seq_len: int) -> torch.Tensor:
    starts = rng.integers(0, len(data) - seq_len, size=batch)
    return torch.from_numpy(np.stack([data[s:s + seq_len] for s in starts]).astype(np.int64))


def sample_anchors(rng: np.random.Generator, batch: int, seq_len: int, n: int, block: int) -> torch.Tensor:
    """n distinct sorted anchors per window in [1, seq_len - block]: every block has context and labels."""
    rows = [np.sort(rng.choice(np.arange(1, seq_len - block + 1), size=n, replace=False)) for _ in range(batch)]
    return torch.from_numpy(np.stack(rows))


def block_loss(draft: DFlashDraft, target: FrozenTarget, ids: torch.Tensor, anchors: torch.Tensor,
               gamma: float) -> tuple[torch.Tensor, float]:
    """Soft cross-entropy of the draft's block rows against the target's next-token distributions, and
    the share of rows whose argmax is the target's."""
    c = draft.c
    features, logits = target.run(ids)
    b, s = ids.shape
    block_ids, block_pos, mask = block_inputs(s, anchors, c.block_size, c.mask_token_id, ids)
    hidden = draft(target.embed(block_ids), features, block_pos, torch.arange(s).expand(b, s), mask)
    n = anchors.shape[1]
    k = torch.arange(1, c.block_size)
    # row k of a block guesses the token at anchor + k: the target's logits at anchor + k - 1 predict it
    teacher_pos = (anchors[:, :, None] + k - 1).reshape(b, -1)
    teacher = torch.gather(logits, 1, teacher_pos[:, :, None].expand(-1, -1, logits.shape[-1]))
    rows = hidden.view(b, n, c.block_size, -1)[:, :, 1:].reshape(b, n * (c.block_size - 1), -1)
    student = target.lm_head(rows)
    per_row = -(F.softmax(teacher, -1) * F.log_softmax(student, -1)).sum(-1).view(b, n, -1)
    weights = torch.exp(-(k - 1).float() / gamma)
    loss = (per_row * weights).sum() / (weights.sum() * b * n)
    agree = (student.argmax(-1) == teacher.argmax(-1)).float().mean().item()
    return loss, agree


def learning_rate(step: int, total: int | None, sched: Schedule) -> float:
    warm = min(1.0, (step + 1) / sched.warmup)
    if total is None:
        return sched.lr * warm
    return sched.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / total))))


def train(draft: DFlashDraft, target: FrozenTarget, data: np.ndarray, sched: Schedule, evals: EvalSet,
          eval_every: int, seed: int) -> tuple[int, list[dict]]:
    """Train for sched.seconds (the cosine schedule's length is estimated from the first 20 steps);
    returns the steps taken and the log (loss: the mean of the last 10 steps)."""
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(draft.parameters(), lr=sched.lr, betas=(0.9, 0.95), weight_decay=0.01)
    log: list[dict] = []
    t0, step, total, recent = time.time(), 0, None, []
    while (elapsed := time.time() - t0) < sched.seconds:
        if step == 20:
            total = int(sched.seconds / (elapsed / 20))
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, total, sched)
        ids = windows(data, rng, sched.batch, sched.seq_len)
        anchors = sample_anchors(rng, sched.batch, sched.seq_len, sched.anchors, draft.c.block_size)
        loss, agree = block_loss(draft, target, ids, anchors, sched.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        recent = [*recent[-9:], (loss.item(), agree)]
        entry = {"step": step, "seconds": round(time.time() - t0, 1),
                 "loss": round(float(np.mean([r[0] for r in recent])), 4),
                 "agree": round(float(np.mean([r[1] for r in recent])), 4)}
        if step % eval_every == 0:
            stats = evals.measure(draft, target)
            entry |= {"acceptance": round(stats.acceptance_rate, 4),
                      "mean_accepted_length": round(stats.mean_accepted_length, 3)}
        if step % 10 == 0 or "acceptance" in entry:
            print(json.dumps(entry), flush=True)
            log.append(entry)
    return step, log


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import transformers  # the oracle extra; imported here so --help works without it

    t0 = time.time()
    corpus = build_corpus(args.target / "tokenizer.json", int(args.corpus_mb * (1 << 20)))
    print(f"corpus: {corpus.n_files} files, {corpus.n_bytes} bytes, {len(corpus.train)} train tokens, "
          f"{len(corpus.val)} val tokens ({time.time() - t0:.0f} s)", flush=True)
    target_cfg = json.loads((args.target / "config.json").read_text())
    cfg = draft_config(target_cfg, args, rarest_token(corpus.train, target_cfg["vocab_size"]))
    model = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32)
    target = FrozenTarget(model, cfg.target_layer_ids)
    if len(corpus.val) < 1000:
        raise ValueError(f"the corpus holds {len(corpus.val)} validation tokens: raise --corpus-mb")
    prompts = [corpus.val[s:s + 48].tolist() for s in
               np.random.default_rng(args.seed + 1).integers(0, len(corpus.val) - 48, args.eval_prompts)]
    evals = EvalSet.build(target, prompts, args.eval_tokens)
    draft = DFlashDraft(cfg)
    if args.init is not None:  # continue from an earlier run's draft (same shape)
        draft.load_state_dict(load_file(str(args.init / "model.safetensors")))
    print(f"draft: {sum(p.numel() for p in draft.parameters())} parameters, {cfg}", flush=True)
    sched = Schedule(args.seq_len, args.batch, args.anchors, args.lr, args.gamma, args.minutes * 60)
    t_train = time.time()
    steps, log = train(draft, target, corpus.train, sched, evals, args.eval_every, args.seed)
    train_seconds = time.time() - t_train
    acceptance = {}
    for dtype in STORAGE_DTYPES:
        stats = evals.measure(draft, target, dtype)
        acceptance[dtype] = {"acceptance": round(stats.acceptance_rate, 4), "proposed": stats.proposed,
                             "mean_accepted_length": round(stats.mean_accepted_length, 3)}
        print(f"acceptance with a {dtype} mirror: {acceptance[dtype]}", flush=True)
    hf_dir = args.out / "hf"
    draft.save(hf_dir)
    gguf_path = args.out / f"{args.name}-{args.outtype}.gguf"
    convert_hf(args.converter, hf_dir, gguf_path, args.outtype, "--target-model-dir", str(args.target),
               "--model-name", args.name)
    record = {"command": " ".join(sys.argv), "init": str(args.init) if args.init else None, "corpus_bytes": corpus.n_bytes, "corpus_files": corpus.n_files,
              "train_tokens": int(len(corpus.train)), "val_tokens": int(len(corpus.val)), "steps": steps,
              "windows_seen": steps * args.batch, "tokens_seen": steps * args.batch * args.seq_len,
              "train_seconds": round(train_seconds, 1), "schedule": asdict(sched), "config": cfg.hf_config(),
              "final_loss": log[-1]["loss"] if log else None, "eval": {"prompts": args.eval_prompts,
              "tokens": args.eval_tokens, "acceptance": acceptance}, "log": log}
    (args.out / "training.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {gguf_path} ({gguf_path.stat().st_size} bytes)", flush=True)


if __name__ == "__main__":
    main()
