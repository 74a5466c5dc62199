"""Where a decode step's time goes, by compiled function: batched decode under Linux `perf`, with the
names of numba's compiled code.

perf sees numba's kernels as anonymous JIT memory. This script decodes (--streams sequences, --runs
times) and then writes /tmp/perf-<pid>.map, perf's map of JIT symbols, from every symbol numba's JIT
engine has defined (sized up to the next one: copies of a function that numba links into other
libraries carry no name of their own and count toward the symbol before them). Run it as

    perf record -F 4000 -g -o step.data python benchmarks/perf_profile.py FILE --streams 8
    perf report -i step.data --no-children --sort dso,symbol -g none

The load and the first run are in the profile too; --runs dilutes them. --dump NAME writes the bytes
of the first symbol whose name holds NAME to NAME.bin with its address, for
`objdump -D -b binary -m i386:x86-64 --adjust-vma=ADDRESS NAME.bin`, whose instructions the hot
addresses of `perf script -F ip,sym` fall on (how the loops that LLVM made gathers and scatters in an
8-stream step were found: docs/runtime.md, 2026-12-03 afternoon).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def perf_map() -> Path:
    """/tmp/perf-<pid>.map from numba's JIT engine: each defined symbol at its address."""
    from numba.core.registry import cpu_target

    engine = cpu_target.target_context.codegen()._engine
    symbols = sorted((engine.get_function_address(name), name) for name in list(engine._defined_symbols))
    symbols = [(address, name) for address, name in symbols if address]
    path = Path(f"/tmp/perf-{os.getpid()}.map")
    with path.open("w") as f:
        for (address, name), (following, _) in zip(symbols, symbols[1:] + [(symbols[-1][0] + 4096, "")]):
            f.write(f"{address:x} {min(following - address, 1 << 20):x} {name}\n")
    return path


def dump(map_path: Path, name: str) -> None:
    """NAME.bin: the bytes of the first mapped symbol holding `name`, read through /proc/self/mem (a
    size past the code's last page ends the read there rather than faulting)."""
    for line in map_path.read_text().splitlines():
        address, size, symbol = line.split(" ", 2)
        if name in symbol and not symbol.startswith("__gufunc") and "NumbaEnv" not in symbol:
            start, size = int(address, 16), int(size, 16)
            data = _readable(start, size)
            Path(f"{name}.bin").write_bytes(data)
            print(f"{name}.bin: {len(data)} bytes of {symbol[:80]}... at {start:#x}")
            return
    print(f"no symbol holds {name!r}")


def _readable(start: int, size: int) -> bytes:
    """This process's bytes from `start`, up to `size` or the first page that is not mapped."""
    chunks = []
    fd = os.open("/proc/self/mem", os.O_RDONLY)
    try:
        for offset in range(0, size, 4096):
            try:
                chunks.append(os.pread(fd, min(4096, size - offset), start + offset))
            except OSError:  # past the code's last mapped page
                break
    finally:
        os.close(fd)
    return b"".join(chunks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", type=Path, help="a GGUF file (or a directory ember.load takes)")
    ap.add_argument("--streams", type=int, default=8, help="sequences decoded together")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each sequence decodes in a run")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dump", action="append", default=[], help="a symbol's bytes to NAME.bin (repeatable)")
    args = ap.parse_args()

    import numba

    import ember
    from ember.daemon.engine.sequence import Sequence

    numba.set_num_threads(args.threads)
    model = ember.load(args.file)

    def run(tokens: int) -> int:
        engine = model.engine(args.streams * (16 + tokens + 1), max_running=args.streams)
        seqs = [Sequence(list(range(100 + 7 * i, 116 + 7 * i)), tokens + 1) for i in range(args.streams)]
        for seq in seqs:
            engine.add(seq)
        while engine.has_work:
            engine.step()
        return sum(len(seq.generated) for seq in seqs)

    run(4)  # every compiled function the runs call is loaded before the map is written
    map_path = perf_map()
    for name in args.dump:
        dump(map_path, name)
    start = time.perf_counter()
    tokens = sum(run(args.tokens) for _ in range(args.runs))
    print(f"{tokens / (time.perf_counter() - start):.0f} tok/s over {args.runs} runs of {args.streams} streams; "
          f"symbols in {map_path}")


if __name__ == "__main__":
    main()
