"""Which layers run where: a layer split's devices and layer counts, checked before anything starts.

`--devices cpu:0,cpu:1 [--split 3,2]` (or `ember.load(path, devices=[...], split=[...])`) becomes one
StageSpec per device. Without a split, the planner's rule divides the layers in proportion to each
device's memory budget (planner.split_layers). Every refusal says what to change.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ember.daemon.planning.planner import Device, LayerWeights, split_layers
from ember.daemon.runner.devices import DeviceName, backend_for


class SplitSpecError(ValueError):
    """The devices or the split cannot run this model; the message says what to change."""


@dataclass(frozen=True)
class StageSpec:
    device: DeviceName
    first: int  # [first, end) layers of the model
    end: int


def parse_devices(devices: str | Sequence[str]) -> list[DeviceName]:
    """'cpu:0,cpu:1' or ['cpu:0', 'cpu:1'] -> device names, each one known to this build."""
    names = [d for d in (devices.split(",") if isinstance(devices, str) else devices)]
    if not names or any(not n.strip() for n in names):
        raise SplitSpecError(f"devices {devices!r}: name each device, separated by commas (e.g. cpu:0,cpu:1)")
    parsed = []
    for text in names:
        try:
            name = DeviceName.parse(text)
            backend_for(name)
        except ValueError as e:
            raise SplitSpecError(f"unknown device in --devices: {e}") from None
        parsed.append(name)
    seen = [str(n) for n in parsed]
    dupes = sorted({n for n in seen if seen.count(n) > 1})
    if dupes:
        raise SplitSpecError(f"{', '.join(dupes)} named twice in --devices: each stage needs a device of its own")
    if len(parsed) > 1 and any(in_engine(n) for n in parsed[:-1]):
        raise SplitSpecError("'cpu' before the last stage of a split: plain 'cpu' is the engine's own process, which "
                             "can run the last stage only (it samples what that stage computes); name the other CPU "
                             "stages cpu:N (each a worker process, on NUMA node N where there is one), e.g. cpu:0,cpu")
    return parsed


def in_engine(device: DeviceName) -> bool:
    """Whether a split's stage on `device` runs in the engine's own process (plain `cpu`, the last
    stage only) rather than in a worker process of its own (cpu:N, cuda:N)."""
    return device.kind == "cpu" and device.index is None


def parse_split(split: str | Sequence[int] | None) -> tuple[int, ...] | None:
    if split is None or split == "":
        return None
    try:
        counts = tuple(int(c) for c in (split.split(",") if isinstance(split, str) else split))
    except ValueError:
        raise SplitSpecError(f"split {split!r}: give layer counts separated by commas (e.g. 3,2)") from None
    return counts


def plan_stages(devices: Sequence[DeviceName], split: Sequence[int] | None, n_layers: int,
                budgets: Sequence[int] | None = None, weights: LayerWeights | None = None) -> list[StageSpec]:
    """One StageSpec per device: `split` layer counts as given, else proportional to `budgets` (equal
    when None), in bytes of weights where `weights` gives them (planner.split_layers)."""
    names = ",".join(map(str, devices))
    if len(devices) > n_layers:
        raise SplitSpecError(f"{len(devices)} devices ({names}) for a model of {n_layers} layers: every stage needs "
                             f"a layer; name at most {n_layers} devices")
    if split is not None:
        if len(split) != len(devices):
            raise SplitSpecError(f"split {','.join(map(str, split))} gives {len(split)} layer counts for "
                                 f"{len(devices)} devices ({names}): give one count per device")
        if any(c < 1 for c in split):
            raise SplitSpecError(f"split {','.join(map(str, split))}: every stage needs at least one layer")
        if sum(split) != n_layers:
            raise SplitSpecError(f"split {','.join(map(str, split))} adds up to {sum(split)} layers; the model has "
                                 f"{n_layers}: e.g. --split {','.join(map(str, _even(n_layers, len(devices))))}")
    budgets = budgets or [1] * len(devices)
    bounds = split_layers(n_layers, [Device(str(d), b) for d, b in zip(devices, budgets, strict=True)], split, weights)
    if any(end <= first for first, end in bounds):
        raise SplitSpecError(f"the memory budgets leave a stage of {names} without layers: give --split")
    return [StageSpec(d, first, end) for d, (first, end) in zip(devices, bounds, strict=True)]


def stage_budgets(devices: Sequence[DeviceName]) -> list[int]:
    """Each device's memory budget for a split: what its backend offers, CPU stages sharing the host's
    memory equally (the planner's split_layers then gives them equal layer counts)."""
    cpus = cpu_stages(devices)
    return [backend_for(d).available_memory(d) // (cpus if d.kind == "cpu" else 1) for d in devices]


def cpu_stages(devices: Sequence[DeviceName]) -> int:
    """How many of a split's stages share the host's CPUs and memory (a cuda stage takes neither)."""
    return sum(d.kind == "cpu" for d in devices)


def stage_threads_for(asked: int, stages: int, cpus: int) -> int:
    """Kernel threads per stage process: `asked`, or (0) the CPUs shared out among the stages. More
    threads than CPUs is refused: a stage's idle OpenMP threads spin-wait between kernels, holding the
    cores the other stages need (2 stages x 2 threads on 2 cores decoded 30x slower than x 1)."""
    threads = asked or max(1, cpus // stages)
    if threads > 1 and threads * stages > cpus:
        raise SplitSpecError(f"stage_threads {threads} x {stages} stages is {threads * stages} kernel threads on "
                             f"{cpus} CPUs: idle kernel threads spin and stall the other stages; give "
                             f"--stage-threads {max(1, cpus // stages)} (or 0: the CPUs shared out)")
    return threads


def _even(n_layers: int, parts: int) -> list[int]:
    return [n_layers // parts + (i < n_layers % parts) for i in range(parts)]
