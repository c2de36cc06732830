"""Quantize a model larger than the memory the process may use, under a hard cap.

The pass worker of the ``memory_cap`` suite (``benchmarks/suites/memory_cap.py``):

``python -m benchmarks.memory_cap --json OUT [--depth 8] [--cap-mib 1400] [--samples 16]
[--seqlen 512] [--workdir DIR] [--extra FLAGS]``

Builds (once, cached in the work directory) a synthetic model of the demo model's layer shapes at
``--depth`` times its 30 layers (8x: 240 layers, 1.77 GB of bf16), then runs
``cpu-quant gptq`` on it inside a memory cgroup whose hard limit (``memory.limit_in_bytes``,
cgroup v1, or ``memory.max``, cgroup v2) is ``--cap-mib``, below the model's bf16 size. The
cgroup charges anonymous memory and page cache alike; the kernel reclaims the page cache of the
memory-mapped checkpoint under the cap, and kills the process (OOM) if anonymous memory alone
exceeds it.

RLIMIT_AS is not usable for this: it limits address space, and memory-mapping the checkpoint
(let alone torch's own reservations) takes more address space than the cap.

``OUT`` (JSON) records the
exit status, whether the cgroup's OOM killer fired, the cgroup's peak usage and failcnt, the
process tree's peak RssAnon (sampled), the model's bf16 size and the wall time. Needs root (to
create the cgroup).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .rss import TreeRssSampler
from .suites.memory import synthetic_model

V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup/unified")
CLI = [sys.executable, "-m", "cpu_quant.cli"]


class Cgroup:
    def __init__(self, name: str, cap_bytes: int) -> None:
        if (V1 / "memory.limit_in_bytes").is_file():
            self.version, self.path = 1, V1 / name
        elif (V2 / "cgroup.controllers").is_file() and "memory" in (V2 / "cgroup.controllers").read_text():
            self.version, self.path = 2, V2 / name
        else:
            raise SystemExit("error: no memory cgroup controller is mounted here")
        self.path.mkdir(exist_ok=True)
        if self.version == 1:
            (self.path / "memory.limit_in_bytes").write_text(str(cap_bytes))
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.is_file():
                swap.write_text(str(cap_bytes))  # no escape into swap either
        else:
            (self.path / "memory.max").write_text(str(cap_bytes))
            (self.path / "memory.swap.max").write_text("0")

    def read(self) -> dict:
        def num(name: str) -> int | None:
            f = self.path / name
            return int(f.read_text().split()[0]) if f.is_file() else None

        if self.version == 1:
            oom = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
            return {"limit_bytes": num("memory.limit_in_bytes"),
                    "peak_usage_bytes": num("memory.max_usage_in_bytes"),
                    "failcnt": num("memory.failcnt"), "oom_kill": int(oom.get("oom_kill", 0))}
        events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
        return {"limit_bytes": num("memory.max"), "peak_usage_bytes": num("memory.peak"),
                "failcnt": int(events.get("max", 0)), "oom_kill": int(events.get("oom_kill", 0))}

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8, help="multiple of the demo model's 30 layers")
    parser.add_argument("--cap-mib", type=int, default=1400, help="hard memory limit of the run")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--workdir", default=None, help="default: $XDG_CACHE_HOME/cpu-quant/bench-work")
    parser.add_argument("--json", type=Path, required=True, help="where the record goes")
    parser.add_argument("--extra", default="", help="extra cpu-quant gptq flags, space-separated")
    parser.add_argument("--smoke", action="store_true", help="the smoke shapes (hidden 64)")
    args = parser.parse_args(argv)

    from .peers.gptqmodel_env import cache_root

    work = Path(args.workdir) if args.workdir else cache_root() / "bench-work" / "memory_cap"
    shapes = "smoke" if args.smoke else "demo"
    src = synthetic_model(work / f"{shapes}-depth-{args.depth}x", 30 * args.depth, smoke=args.smoke)
    model_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    cap = args.cap_mib << 20
    if cap >= model_bytes:
        print(f"warning: the cap ({cap >> 20} MiB) is not below the model's bf16 size "
              f"({model_bytes >> 20} MiB)", file=sys.stderr)
    dst = work / "out"
    argv = [*CLI, "gptq", str(src), str(dst), "--samples", str(args.samples), "--seqlen",
            str(args.seqlen), "--no-eval", "--overwrite", *args.extra.split()]
    group = Cgroup(f"cpu-quant-cap-{os.getpid()}", cap)
    procs = group.path / "cgroup.procs"
    # the child joins the cgroup before exec, so every byte it and its children touch counts
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, preexec_fn=lambda: procs.write_text(str(os.getpid())),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = TreeRssSampler(proc.pid)
    sampler.start()
    _, err = proc.communicate()
    sampler.stop()
    wall = time.perf_counter() - t0
    cg = group.read()
    group.remove()
    result = {
        "suite": "memory_cap",
        "model": {"path": str(src), "layers": 30 * args.depth, "bf16_bytes": model_bytes},
        "cap_bytes": cap,
        "argv": argv,
        "exit_status": proc.returncode,
        "completed": proc.returncode == 0 and (dst / "config.json").is_file(),
        "wall_seconds": round(wall, 1),
        "rss": sampler.as_dict(),
        "cgroup": {"version": group.version, **cg},
        "stderr_tail": err[-3000:],
        "settings": {"depth": args.depth, "cap_mib": args.cap_mib, "samples": args.samples,
                     "seqlen": args.seqlen, "extra": args.extra},
    }
    path = args.json
    path.write_text(json.dumps(result, indent=2) + "\n")
    peak = result["rss"].get("peak_rss_anon_bytes")
    print(f"model {model_bytes / 2**20:.0f} MiB bf16, cap {args.cap_mib} MiB: exit {proc.returncode}, "
          f"oom_kill {cg['oom_kill']}, cgroup peak {(cg['peak_usage_bytes'] or 0) / 2**20:.0f} MiB, "
          f"peak RssAnon {(peak or 0) / 2**20:.0f} MiB, {wall:.0f} s -> {path}")
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
