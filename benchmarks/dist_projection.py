"""Project a distributed GPTQ run of an 8B Llama from the ``distributed`` suite's measurements.

The pass worker of the ``dist_projection`` suite (``benchmarks/suites/dist_projection.py``):

    python -m benchmarks.dist_projection RESULT.json --json OUT [--source CKPT]

RESULT is a (complete) ``distributed`` suite result on the demo model. The projection is a
model, and says so: every number it takes from the measurement and every assumption it adds
is written into ``OUT`` (atomic, with the input's file name).

**What is measured** (the ``1-rank`` arm, one thread, median over the passes): the seconds of
the Hessian products (the report's ``hessians`` phase), of the GPTQ sweeps (``quantize``),
of the rest of the layers (the forward passes), of the head, and of everything else (start,
tokenization, writing). The products' flops are known from the shapes, so the Hessian phase
gives this machine's rate for large float32 matrix products, one core (``gemm_flops``); the
forward passes give theirs (``forward_flops``, lower: small matrices, attention, norms). From
the ``2-ranks`` arm: the bytes a rank receives per decoder layer and for the head, which the
payload model below must reproduce exactly for the demo model (``payload_check``).

**Compute of an 8B layer** (Llama-3-8B shapes, the same 128 x 512 calibration tokens), in
core-seconds at the measured large-product rate: forward ``2 x params + 4 x seqlen x q_width``
flops per token; Hessian products ``2 x K^2 x (n+1)/2n`` per token for each group's width K
(``hessians.gram``: upper blocks only, ``n`` column blocks of 256); sweeps ``2 x rows x K^2``
per stack (the sweep's block updates) plus ``2/3 K^3`` per Hessian (factorization). The demo's
sweeps are dominated by per-column overheads that do not grow with the matrix; at 8B the
products dominate, so they are the model. A host: 32 cores at ``EFFICIENCY`` of one core's
rate each (assumed), its ranks splitting every phase evenly (batches and sweep rows).

Memory: each rank holds its layer in float32, one batch's Hessian product until the running
sum reaches it (with ``--batch-size`` = its windows, one product) and the sum and its factor:
a lower bound per host is written beside each row.

**Traffic of a layer** (what ``distributed.py`` sends): per group, the running Hessian sum
(``4 K^2`` bytes) passes every rank once, in 4 MiB blocks that overlap along the chain, then
the last rank broadcasts it (gloo's broadcast: a binomial tree, ``log2`` rounds of the whole
matrix); the quantized rows (codes packed two per byte, float32 scales) are broadcast by their
owners. Ranks are numbered host by host, so the chain crosses each host boundary once, and
``log2(hosts)`` broadcast rounds cross the network. Links: 10 GbE (``NET_BYTES_PER_S`` each
way per host), copies between ranks of one host at ``LOCAL_BYTES_PER_S`` (assumed). Compute
and traffic do not overlap (the collectives sit between the phases).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CORES_PER_HOST = 32
EFFICIENCY = 0.8  # a core's share when all 32 work (memory bandwidth, imbalance): assumed
NET_BYTES_PER_S = 1.25e9  # 10 GbE, each direction
LOCAL_BYTES_PER_S = 5e9  # a copy between two ranks on one host (loopback TCP): assumed
WRITE_BYTES_PER_S = 5e8  # rank 0 writing the artifact: assumed
MAX_RANKS = 128  # one calibration window per batch (--batch-size 1) at most: 128 ranks
GRAM_BLOCK = 256  # hessians.GRAM_BLOCK
CHAIN_BLOCK = 4 << 20  # distributed.CHAIN_BLOCK_BYTES
TOKENS = 128 * 512
SEQLEN = 512


@dataclass(frozen=True)
class Shapes:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    def stacks(self) -> list[tuple[str, int, int]]:
        """(group, rows, K) of a layer's true-sequential groups, q/k/v and gate/up stacked."""
        kv = self.kv_heads * self.head_dim
        return [("qkv", self.q_width + 2 * kv, self.hidden), ("o", self.hidden, self.q_width),
                ("gate_up", 2 * self.intermediate, self.hidden),
                ("down", self.hidden, self.intermediate)]

    def params_per_layer(self) -> int:
        return sum(rows * k for _, rows, k in self.stacks())


LLAMA3_8B = Shapes("Llama-3-8B", hidden=4096, intermediate=14336, layers=32, heads=32,
                   kv_heads=8, head_dim=128, vocab=128256)


def demo_shapes(config: dict) -> Shapes:
    heads = config["num_attention_heads"]
    return Shapes("demo", config["hidden_size"], config["intermediate_size"],
                  config["num_hidden_layers"], heads, config.get("num_key_value_heads", heads),
                  config.get("head_dim") or config["hidden_size"] // heads, config["vocab_size"])


def gram_flops(k: int) -> float:
    n = math.ceil(k / GRAM_BLOCK)
    return 2.0 * k * k * (n + 1) / (2 * n)


def layer_flops(s: Shapes) -> dict[str, float]:
    """Flops of one decoder layer over the calibration tokens, by phase."""
    return {"forward": TOKENS * (2.0 * s.params_per_layer() + 4.0 * SEQLEN * s.q_width),
            "hessians": TOKENS * sum(gram_flops(k) for _, _, k in s.stacks()),
            "sweeps": sum(2.0 * rows * k * k + 2.0 / 3.0 * k ** 3 for _, rows, k in s.stacks())}


def head_flops(s: Shapes) -> float:
    return TOKENS * gram_flops(s.hidden) + 2.0 * s.vocab * s.hidden ** 2 + 2.0 / 3.0 * s.hidden ** 3


# -- the payload, as distributed.py sends it ---------------------------------------------------
def hessian_bytes(s: Shapes) -> list[int]:
    return [4 * k * k for _, _, k in s.stacks()]


def codes_bytes(rows: int, k: int, group: int) -> int:
    """One stack's quantized rows as exchanged: codes two per byte, float32 scales."""
    return rows * ((k + 1) // 2) + rows * (k // group) * 4


def demo_received_per_layer(s: Shapes, groups: dict[str, int]) -> dict[int, int]:
    """Bytes each of 2 ranks receives per decoder layer (distributed.py, exactly)."""
    from cpu_quant.quantize.distributed import rank_pieces

    got = {0: 0, 1: 0}
    for (name, rows, k), hb in zip(s.stacks(), hessian_bytes(s), strict=True):
        got[1] += 8 + hb  # the running sum and its row count, from rank 0
        got[0] += hb + 8  # the total broadcast back by rank 1 (the last)
        for p in rank_pieces(0, rows, 2):
            got[1 - p.owner] += codes_bytes(p.r1 - p.r0, k, groups[name])
    return got


# -- the projection ------------------------------------------------------------------------------
def traffic_seconds(total_bytes: float, largest_bytes: float, hosts: int, ranks_per_host: int,
                    rounds_bytes: float) -> float:
    """The chain (pipelined: the whole matrix once over the slowest link, plus one block per
    hop) and the binomial broadcasts (log2 rounds, network rounds over 10 GbE)."""
    link = NET_BYTES_PER_S if hosts > 1 else LOCAL_BYTES_PER_S
    hops = hosts * ranks_per_host - 1
    chain = total_bytes / link + hops * min(CHAIN_BLOCK, largest_bytes) / LOCAL_BYTES_PER_S
    net_rounds = math.ceil(math.log2(hosts)) if hosts > 1 else 0
    local_rounds = math.ceil(math.log2(ranks_per_host)) if ranks_per_host > 1 else 0
    bcast = rounds_bytes * (net_rounds / NET_BYTES_PER_S + local_rounds / LOCAL_BYTES_PER_S)
    return chain + bcast


def project(measured: dict) -> list[dict]:
    s = LLAMA3_8B
    rate = measured["gemm_flops"]
    flops = layer_flops(s)
    core_s = {k: v / rate for k, v in flops.items()}
    head_core_s = head_flops(s) / rate
    hb = hessian_bytes(s)
    codes = sum(codes_bytes(rows, k, 128) for _, rows, k in s.stacks())
    head_codes = codes_bytes(s.vocab, s.hidden, 128)
    artifact_bytes = s.layers * codes + head_codes + 2 * s.vocab * s.hidden  # + bf16 embedding
    out = []
    for hosts in (1, 4, 16):
        ranks_per_host = min(CORES_PER_HOST, MAX_RANKS // hosts)
        cores = hosts * CORES_PER_HOST * EFFICIENCY
        compute = sum(core_s.values()) / cores
        traffic = traffic_seconds(sum(hb), max(hb), hosts, ranks_per_host, sum(hb) + codes)
        head = head_core_s / cores + traffic_seconds(4 * s.hidden ** 2, 4 * s.hidden ** 2, hosts,
                                                     ranks_per_host, 4 * s.hidden ** 2 + head_codes)
        fixed = measured["fixed_seconds"] + artifact_bytes / WRITE_BYTES_PER_S
        total = fixed + s.layers * (compute + traffic) + head
        # a rank holds its layer in float32, one batch's Hessian product until the running
        # sum arrives (batch size = its windows), the sum and its factor: a lower bound
        rank_bytes = 4 * s.params_per_layer() + 3 * max(hb)
        out.append({"hosts": hosts, "ranks": hosts * ranks_per_host,
                    "memory_per_host_gb_at_least": round(ranks_per_host * rank_bytes / 1e9, 1),
                    "threads_per_rank": CORES_PER_HOST // ranks_per_host,
                    "layer_compute_seconds": round(compute, 2),
                    "layer_compute_by_phase_seconds": {k: round(v / cores, 2)
                                                       for k, v in core_s.items()},
                    "layer_traffic_seconds": round(traffic, 2),
                    "layer_bytes_per_rank": sum(hb) + codes,
                    "head_seconds": round(head, 1), "fixed_seconds": round(fixed, 1),
                    "total_hours": round(total / 3600, 2),
                    "bottleneck": "traffic (the Hessians)" if traffic > compute
                                  else max(core_s, key=core_s.get),
                    # a core faster than this makes a layer's traffic outlast its compute
                    "traffic_dominates_above_gflops_per_core": round(
                        sum(flops.values()) / (cores * traffic) / 1e9, 1)})
    return out


def measured_inputs(result: dict, source: Path | None = None) -> dict:
    """The medians the projection starts from (see the module docstring). ``source``: the
    measured model's checkpoint (its shapes), by default the one the result names."""
    from cpu_quant.core.io.checkpoint import open_checkpoint
    from cpu_quant.formats import get_format
    from cpu_quant.quantize.plan import plan_linear

    if result.get("suite") != "distributed" or result.get("smoke"):
        raise ValueError("give a complete (not smoke) result of the distributed suite")
    one = [r for r in result["records"] if r["arm"] == "1-rank" and r["ok"]]
    two = [r for r in result["records"] if r["arm"] == "2-ranks" and r["ok"]]
    if not one or not two:
        raise ValueError("the result has no successful pass of both arms")
    med = statistics.median
    settings = result.get("settings") or result["provenance"]["settings"]
    source = source or Path(settings["source"])
    if not (source / "config.json").is_file():
        raise ValueError(f"the measured model {source} is not here (give --source DIR)")
    ckpt = open_checkpoint(source)
    s = demo_shapes(ckpt.config)
    ckpt.close()
    limits = get_format("gptq").limits
    group = settings["group"]
    groups = {name: plan_linear(name, k, rows, group, False, limits).group_size
              for name, rows, k in s.stacks()}
    t_gram = med(r["extras"]["phase_seconds"]["hessians"] for r in one)
    t_sweep = med(r["extras"]["phase_seconds"]["quantize"] for r in one)
    t_layers = med(r["extras"]["layer_seconds_sum"] for r in one)
    t_head = med(r["extras"]["tool_head_seconds"] for r in one)
    t_total = med(r["extras"]["tool_total_seconds"] for r in one)
    wall = med(r["wall_seconds"] for r in one)
    flops = layer_flops(s)
    n = s.layers
    received = {r: med(rec["extras"]["traffic"]["ranks"][r]["layer_bytes_received_median"]
                       for rec in two) for r in (0, 1)}
    expected = demo_received_per_layer(s, groups)
    return {
        "demo_shapes": asdict(s), "demo_groups": groups,
        "hessian_seconds": t_gram, "sweep_seconds": t_sweep,
        "forward_seconds": round(t_layers - t_gram - t_sweep, 3), "head_seconds": t_head,
        "fixed_seconds": round(wall - t_layers - t_head, 3),
        "tool_total_seconds": t_total, "wall_seconds": wall,
        "gemm_flops": n * flops["hessians"] / t_gram,
        "forward_flops": n * flops["forward"] / (t_layers - t_gram - t_sweep),
        "two_ranks_layer_bytes_received": received,
        "payload_check": {"expected": expected, "measured": received,
                          "exact": all(expected[r] == received[r] for r in (0, 1))},
        "two_ranks_layer_collective_seconds": {
            r: med(rec["extras"]["traffic"]["ranks"][r]["layer_collective_seconds_median"]
                   for rec in two) for r in (0, 1)},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dist_projection", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", type=Path)
    ap.add_argument("--json", type=Path, required=True, help="where the projection goes")
    ap.add_argument("--source", type=Path, default=None,
                    help="the measured model's checkpoint, for its shapes (default: the path "
                         "the result names)")
    args = ap.parse_args(argv)
    try:
        result = json.loads(args.result.read_text())
        measured = measured_inputs(result, args.source)
    except (OSError, ValueError) as exc:
        print(f"error: {args.result}: {exc}", file=sys.stderr)
        return 2
    except KeyError as exc:
        print(f"error: {args.result}: not a distributed suite result (no {exc})", file=sys.stderr)
        return 2
    rows = project(measured)
    assumptions = {"cores_per_host": CORES_PER_HOST, "efficiency": EFFICIENCY,
                   "net_bytes_per_s": NET_BYTES_PER_S, "local_bytes_per_s": LOCAL_BYTES_PER_S,
                   "write_bytes_per_s": WRITE_BYTES_PER_S, "max_ranks": MAX_RANKS,
                   "calibration_tokens": TOKENS, "model": asdict(LLAMA3_8B)}
    doc = {"input": args.result.name, "measured": measured, "assumptions": assumptions,
           "projection": rows}
    path = args.json
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    for row in rows:
        print(f"{row['hosts']:>2} hosts ({row['ranks']} ranks): {row['total_hours']} h; per layer "
              f"compute {row['layer_compute_seconds']} s, traffic {row['layer_traffic_seconds']} s;"
              f" bottleneck {row['bottleneck']}")
    print(f"payload check (demo, 2 ranks, bytes per layer): {measured['payload_check']}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
