"""True-sequential quantization of one decoder layer, for the compute of one forward pass.

Each group of linears that share an input (on Llama-like layers: q/k/v, o, gate/up, down) is
quantized with the Hessian of the input it sees when every group before it in the layer is
already quantized, so GPTQ compensates the error of those before it within the layer too
("true sequential", GPTQModel's default). The layer's output, the next layer's input, comes
from every linear quantized.

Done naively that is a forward pass up to each group: four or five per layer. Instead the
layer is probed once (per kind of layer, on its first calibration batch) for its *blocks*:
children (``self_attn``, ``mlp``) whose output is the very tensor their last linear returns
(``o_proj``, ``down_proj``). The stage that collects the Hessian of a block's last linear keeps
that linear's input for every batch; once the linear is quantized, the block's output is the
linear applied to it, and every later pass returns that output from the block instead of
running it. So every linear multiplies each batch once, with its final weights, and the
re-runs of the layer's code cost only the norms and residual adds around the blocks: about one
forward in all, against two (Hessians from the original weights, then the forward with the
quantized ones). The result is bit for bit the layer's own forward with the quantized weights.

A stored block's *feed*, the child (the norm in front of it) whose output only that block reads,
is skipped as well: four of a Llama layer's eight norm calls, each about six element-wise
passes over the batch in float32. The probe replays the layer with the blocks returning their
recorded outputs, the first one, then the first two (the stages' situations), and keeps the
feeds only if the output is the same bit for bit, so a norm whose output some other code also
reads is computed as before.

Held per batch meanwhile, in the compute dtype: the attention's output (hidden size) and the
MLP's down-projection input (intermediate size; ``down_proj`` is applied to it in the final
pass); on the demo model at 128 x 512 calibration
tokens in bf16, 75 MB and 201 MB, each store in one slab (:class:`BatchStore`). With
``--offload-activations`` they are kept on disk with the activations.

A layer without this structure (a linear called twice, a block whose output is not its last
linear's, a linear outside any block) is quantized by the caller's two-pass path instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from ..core.io.safetensors_writer import write_safetensors
from .hessians import GramSum, NewGramSum
from .streaming import STORAGE_DTYPE, LayerDone


@dataclass(frozen=True)
class Block:
    child: str  # the layer's attribute, e.g. "self_attn"
    tail: str  # its last linear, relative to the layer, e.g. "self_attn.o_proj"
    extra: int | None  # output format: None = the tensor; k = a tuple of it and k Nones
    feed: str | None = None  # a child (a norm) computing only this block's input, or None


@dataclass(frozen=True)
class Structure:
    groups: tuple[tuple[str, ...], ...]  # linears sharing an input (relative names), call order
    blocks: tuple[Block, ...]


def signature(layer: nn.Module) -> tuple:
    """Layers with equal signatures have the same structure (probed once)."""
    return (type(layer).__qualname__,
            tuple(n for n, m in layer.named_modules() if isinstance(m, nn.Linear)),
            tuple((n, type(m).__qualname__) for n, m in layer.named_children()))


@torch.no_grad()
def probe(layer: nn.Module, run: Callable[[], object]) -> Structure | None:
    """Watch one full call of the layer (``run``) and find its groups and blocks; None when
    the layer does not qualify (module docstring)."""
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    calls: list[tuple[str, torch.Tensor]] = []
    outputs: dict[str, list] = {}
    handles = []
    for name, m in linears.items():
        handles.append(m.register_forward_pre_hook(
            lambda mod, args, name=name: calls.append((name, args[0]))))
        handles.append(m.register_forward_hook(
            lambda mod, args, out, name=name: outputs.setdefault(name, []).append(out)))
    inputs: dict[str, list[list[torch.Tensor]]] = {}  # child -> its calls' tensor arguments
    for name, child in layer.named_children():
        handles.append(child.register_forward_hook(
            lambda mod, args, out, name=name: outputs.setdefault("child:" + name, []).append(out)))
        handles.append(child.register_forward_pre_hook(
            lambda mod, args, kwargs, name=name: inputs.setdefault(name, []).append(
                [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]),
            with_kwargs=True))
    try:
        want = run()
    finally:
        for h in handles:
            h.remove()
    names = [n for n, _ in calls]
    if not names or sorted(names) != sorted(linears):  # every linear exactly once
        return None
    groups: list[tuple[list[str], torch.Tensor]] = []
    for name, x in calls:
        if groups and groups[-1][1] is x:
            groups[-1][0].append(name)
        elif any(g[1] is x for g in groups):
            return None
        else:
            groups.append(([name], x))
    blocks = []
    covered: set[str] = set()
    for child, _ in layer.named_children():
        mine = [n for n in names if n.startswith(child + ".")]
        if not mine:
            continue
        outs = outputs.get("child:" + child, [])
        if len(outs) != 1:
            return None
        out, extra = outs[0], None
        if isinstance(out, tuple):
            if not out or any(e is not None for e in out[1:]):
                return None
            out, extra = out[0], len(out) - 1
        tail = mine[-1]
        if outputs[tail][0] is not out or [tail] not in [g for g, _ in groups]:
            return None
        blocks.append(Block(child, tail, extra, _feed(layer, child, outputs, inputs, linears)))
        covered.update(mine)
    # every linear inside a block, each block's linears whole groups in one run of calls
    if covered != set(names):
        return None
    for block in blocks:
        idx = [i for i, (g, _) in enumerate(groups) if g[0].startswith(block.child + ".")]
        if idx != list(range(idx[0], idx[-1] + 1)) or any(
                not n.startswith(block.child + ".") for i in idx for n in groups[i][0]):
            return None
    # The shortcut's premise, checked once per kind of layer: with the first k blocks returning
    # what they returned here (the stages' situations, k = 1 .. all) and their feeds skipped,
    # the layer's own code must give the same output bit for bit. A feed whose output is also
    # used by code no hook sees (a residual taken after the norm, a later block's input
    # computed from it) fails this and is not skipped.
    recorded = {}
    for b in blocks:
        out = outputs["child:" + b.child][0]
        recorded[b.child] = out[0] if isinstance(out, tuple) else out
    with_feeds = tuple(blocks)
    without = tuple(Block(b.child, b.tail, b.extra) for b in blocks)
    for candidate in (with_feeds, without) if any(b.feed for b in blocks) else (without,):
        if all(_same_output(layer, candidate[:k], recorded, run, want)
               for k in range(1, len(candidate) + 1)):
            return Structure(tuple(tuple(g) for g, _ in groups), candidate)
    return None


def _same_output(layer: nn.Module, blocks: tuple[Block, ...], recorded: dict, run, want) -> bool:
    with _replaced(layer, list(blocks), recorded):
        got = run()
    return isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and torch.equal(got, want)


def _feed(layer: nn.Module, child: str, outputs: dict, inputs: dict, linears: dict) -> str | None:
    """The child whose single output is this block's input and nothing else's (by identity),
    and that holds no linear: on Llama-like layers the norm in front of the block. Once the
    block returns a stored output, computing its input is wasted work."""
    block_inputs = inputs.get(child, [[]])[0]
    for name, module in layer.named_children():
        outs = outputs.get("child:" + name, [])
        if name == child or len(outs) != 1 or not isinstance(outs[0], torch.Tensor):
            continue
        if any(isinstance(m, nn.Linear) for m in module.modules()):
            continue
        out = outs[0]
        if not any(t is out for t in block_inputs):
            continue
        users = [n for n, calls in inputs.items() for call in calls for t in call if t is out]
        return name if users == [child] else None
    return None


class BatchStore:
    """One tensor per calibration batch, all the same width: in memory, or one file each under
    ``root``.

    In memory they share one slab (``rows[b]`` rows for batch ``b``), allocated at the first
    ``put``: one large block that the allocator maps and unmaps as a whole. Kept as one tensor
    per batch, these long-lived blocks (12.6 MB each for the demo model's down-projection
    input) sat in the heap between the layer's short-lived temporaries and fragmented it:
    measured peak RssAnon 875 and 1045 MiB in two passes of the same run."""

    def __init__(self, root: Path | None = None, rows: list[int] | None = None) -> None:
        self.root = root
        self.rows = rows
        self._slab: torch.Tensor | None = None
        self._shapes: dict[int, torch.Size] = {}
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)

    def _span(self, b: int) -> slice:
        start = sum(self.rows[:b])  # type: ignore[index]
        return slice(start, start + self.rows[b])  # type: ignore[index]

    def put(self, b: int, t: torch.Tensor) -> None:
        if self.root is not None:
            write_safetensors(self.root / f"{b:05d}.safetensors", {"t": t})
            return
        if self.rows is None:
            raise ValueError("an in-memory BatchStore needs the rows of every batch")
        if self._slab is None:
            self._slab = torch.empty(sum(self.rows), t.shape[-1], dtype=t.dtype)
        self._slab[self._span(b)].copy_(t.reshape(-1, t.shape[-1]))
        self._shapes[b] = t.shape

    def get(self, b: int) -> torch.Tensor:
        if self.root is not None:
            return load_file(str(self.root / f"{b:05d}.safetensors"))["t"]
        return self._slab[self._span(b)].view(self._shapes[b])  # type: ignore[index]

    def clear(self) -> None:
        self._slab = None
        self._shapes.clear()
        if self.root is not None:
            for f in self.root.glob("*.safetensors"):
                f.unlink()


class _Current:
    b = 0


def _skip(x, *args, **kwargs):
    return x


@contextmanager
def _replaced(layer: nn.Module, blocks: list[Block], stores: dict, cur: _Current | None = None):
    """Every block in ``stores`` returns its output for the current batch without running:
    the stored output, or its last linear applied to the stored input (a plain tensor in
    ``stores`` is returned as it is). The block's feed, whose output only the block would
    read, returns its input instead of computing."""
    def make(block: Block, store: BatchStore | torch.Tensor, tail: nn.Module | None = None):
        def forward(*args, **kwargs):
            out = store if isinstance(store, torch.Tensor) else store.get(cur.b)
            if tail is not None:
                out = tail(out)
            return out if block.extra is None else (out,) + (None,) * block.extra
        return forward

    patched = []
    try:
        for block in blocks:
            if block.child in stores:
                module = getattr(layer, block.child)
                entry = stores[block.child]
                module.forward = make(block, *(entry if isinstance(entry, tuple) else (entry,)))
                patched.append(module)
                if block.feed is not None:
                    feed = getattr(layer, block.feed)
                    feed.forward = _skip
                    patched.append(feed)
        yield
    finally:
        for module in patched:
            del module.forward


@torch.no_grad()
def run_true_sequential(layer: nn.Module, structure: Structure, hidden: Iterable[torch.Tensor],
                        call: Callable[[int, torch.Tensor], torch.Tensor | None],
                        quantize_group: Callable[[tuple[str, ...], torch.Tensor], None],
                        new_store: Callable[[str, list[int] | None], BatchStore],
                        gram: Callable[[torch.Tensor], torch.Tensor],
                        new_sum: NewGramSum = GramSum) -> Iterator[torch.Tensor]:
    """Quantize ``layer`` group by group (``quantize_group(names, hessian)`` replaces their
    weights), then return the layer's outputs per batch (lazily, in ``STORAGE_DTYPE``).

    ``call(b, h)`` runs the layer on batch ``b`` and returns its output, or None when a hook
    ended the batch (:class:`LayerDone`); ``new_sum(width)`` makes each group's Hessian sum."""
    modules = dict(layer.named_modules())
    # rows per batch, for the in-memory stores' slabs (an offloaded run's stores are on disk)
    rows = [h.shape[:-1].numel() for h in hidden] if isinstance(hidden, list) else None
    tails = {b.tail: b for b in structure.blocks}
    stores: dict[str, tuple[BatchStore, nn.Module | None]] = {}  # child -> (store, tail to apply)
    cur = _Current()
    for names in structure.groups:
        block = tails.get(names[0])
        keep = new_store(block.child, rows) if block else None
        width = modules[names[0]].in_features
        acc = new_sum(width)  # made before the batches' temporaries (GramSum)

        def hook(module, args, keep=keep, acc=acc):
            x = args[0]
            acc.add(gram(x.reshape(-1, x.shape[-1])), x.numel() // x.shape[-1])
            if keep is not None:
                keep.put(cur.b, x)
            raise LayerDone

        with ExitStack() as stack:
            stack.enter_context(_replaced(layer, list(structure.blocks), stores, cur))
            handle = modules[names[0]].register_forward_pre_hook(hook)
            stack.callback(handle.remove)
            for b, h in enumerate(hidden):
                cur.b = b
                if call(b, h) is not None:
                    raise RuntimeError(f"{names[0]} did not see this batch's input")
        quantize_group(names, acc.hessian())
        if block is None:
            continue
        # the block's output, from its (now quantized) last linear: computed once here when
        # several passes follow; for the layer's last group only the final pass needs it, so
        # it is computed there, batch by batch (no second store next to the first)
        tail = modules[block.tail]
        if names == structure.groups[-1]:
            stores[block.child] = (keep, tail)
            continue
        outs = new_store(block.child + "-out", rows)
        for b in range(len(hidden)):  # type: ignore[arg-type]
            outs.put(b, tail(keep.get(b)))
        keep.clear()
        stores[block.child] = (outs, None)
    return _final_pass(layer, structure, hidden, call, stores, cur)


def _final_pass(layer, structure, hidden, call, stores, cur) -> Iterator[torch.Tensor]:
    with torch.no_grad(), _replaced(layer, list(structure.blocks), stores, cur):
        for b, h in enumerate(hidden):
            cur.b = b
            yield call(b, h).to(STORAGE_DTYPE)
        for store, _ in stores.values():
            store.clear()
