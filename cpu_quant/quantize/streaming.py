"""Layer-streaming execution of a Hugging Face decoder-only model on calibration data.

The model is built from its config with empty (meta) parameters, so nothing but one decoder
layer at a time is ever materialised. ``LayerStream``:

1. loads the non-layer parameters (embedding, final norm) from the memory-mapped checkpoint;
2. replaces every decoder layer with a recorder and runs the model once per calibration batch,
   capturing each layer's call arguments (position embeddings, masks, ...) and the embedding
   output. This works for any architecture whose model loops over ``layers`` calling each
   with the hidden states first, which is every decoder-only model in transformers. The input
   embedding is then dropped (its outputs are the first layer's inputs; the head and the
   written embedding are read from the checkpoint): it is not held through the layers (at 8B,
   2 GB in float32);
3. then, for layer ``i``: ``load_layer(i)`` materialises it from the checkpoint (checking that
   config and tensors agree), the caller runs ``forward_layer`` as often as it needs, and
   ``unload_layer(i)`` returns its memory.

Peak memory is one layer's weights plus the calibration activations, whatever the depth.

Dtypes: the calibration activations are stored in bf16 between layers (what a bf16 model
passes on). A layer computes in bf16 where the CPU has a native bf16 GEMM (oneDNN with
AVX-512 or AMX; ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``) and in float32 elsewhere:
on an AVX2-only CPU PyTorch's bf16 GEMM is a slow fallback (measured on an AMD EPYC with AVX2:
one demo-model layer over 8 x 512 tokens took 3.5x as long in bf16 as in float32).
``CPU_QUANT_COMPUTE_DTYPE=bf16|fp32`` overrides the choice.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..core.errors import CpuQuantError
from ..core.io.checkpoint import Checkpoint, empty_causal_lm, load_hf_config, tensors_disagree
from ..core.vision_language import family_of

STORAGE_DTYPE = torch.bfloat16
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
           "float32": torch.float32}


def compute_dtype() -> torch.dtype:
    """bf16 where this CPU multiplies bf16 natively, float32 elsewhere (module docstring)."""
    name = os.environ.get("CPU_QUANT_COMPUTE_DTYPE", "").strip().lower()
    if name:
        if name not in _DTYPES:
            raise CpuQuantError(f"CPU_QUANT_COMPUTE_DTYPE must be bf16 or fp32, not {name!r}")
        return _DTYPES[name]
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


class _StopForward(Exception):
    pass


class LayerDone(Exception):
    """Raised by a hook in :meth:`LayerStream.observe_layer` to end a batch early."""


class _Recorder(nn.Module):
    def __init__(self, original: nn.Module, sink: list, stop: bool) -> None:
        super().__init__()
        self.sink = sink
        self.stop = stop
        for attr in ("attention_type", "layer_idx", "is_sliding"):
            if hasattr(original, attr):
                setattr(self, attr, getattr(original, attr))

    def forward(self, hidden_states, *args, **kwargs):
        self.sink.append((hidden_states, args, kwargs))
        if self.stop:
            raise _StopForward
        return hidden_states


@dataclass
class LayerCall:
    args: tuple
    kwargs: dict


def _find_layers(model: nn.Module, n_layers: int) -> tuple[str, nn.ModuleList]:
    family = family_of(model.config)
    if family is not None:  # its vision tower's layers may be as many, and come first
        return family.layers, model.get_submodule(family.layers)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n_layers and name.endswith("layers"):
            return name, module
    raise CpuQuantError("cannot find the decoder layers of this model "
                        "(only decoder-only transformers models are supported)")


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class LayerStream:
    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.compute = compute_dtype()
        self.config = load_hf_config(ckpt.path)  # never repository code
        for attr in ("use_cache",):
            setattr(self.config, attr, False)
        self.model = empty_causal_lm(self.config, self.compute)
        self.model.eval()
        tcfg = text_config(self.config)
        self.n_layers = int(tcfg.num_hidden_layers)
        self.layers_prefix, self.layers = _find_layers(self.model, self.n_layers)
        # what calibration runs: a vision-language model's language model alone (image-free)
        family = family_of(self.config)
        self.calibrated = (self.model.get_submodule(family.language_model) if family
                           else self.model)
        self.tied = bool(getattr(tcfg, "tie_word_embeddings",
                                 getattr(self.config, "tie_word_embeddings", False)))
        self._check_tensor_names()
        self._load_outer()
        self.calls: list[list[LayerCall]] = []  # [layer][batch]
        self._meta: dict[int, dict] = {}

    # -- checkpoint <-> model agreement -----------------------------------------------------
    def _check_tensor_names(self) -> None:
        problem = tensors_disagree(self.model, {n: self.ckpt.shape(n) for n in self.ckpt.names},
                                   self.tied)
        if problem:
            raise CpuQuantError(f"config disagrees with the tensors: {problem}")

    def _set_param(self, name: str, tensor: torch.Tensor) -> None:
        from accelerate.utils import set_module_tensor_to_device

        set_module_tensor_to_device(self.model, name, "cpu", value=tensor.to(self.compute))

    def _load_outer(self) -> None:
        """The parameters outside the decoder layers, but the head and a vision-language
        model's kept modules: calibration is image-free, its vision tower never runs."""
        prefix = self.layers_prefix + "."
        family = family_of(self.config)
        for name, _ in list(self.model.named_parameters()):
            if name.startswith(prefix) or name == "lm_head.weight":
                continue
            if family is not None and family.kept_module(name) is not None:
                continue
            self._set_param(name, self.ckpt.tensor(name, check_finite=True))

    def head_weight_name(self) -> str:
        if "lm_head.weight" in self.ckpt.names:
            return "lm_head.weight"
        return self.embedding_weight_name()

    def embedding_weight_name(self) -> str:
        emb = self.model.get_input_embeddings()
        for n, m in self.model.named_modules():
            if m is emb:
                return n + ".weight"
        raise CpuQuantError("cannot find the input embedding weight")

    def final_norm(self) -> nn.Module:
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        for attr in ("norm", "final_layernorm", "final_norm", "ln_f"):
            if hasattr(decoder, attr):
                return getattr(decoder, attr)
        raise CpuQuantError("cannot find the final norm before the output head")

    # -- calibration capture -------------------------------------------------------------
    @torch.no_grad()
    def capture(self, batches: list[torch.Tensor], into=None):
        """Record every layer's call arguments; returns the embedding outputs per batch, appended
        to ``into`` (a list by default; ``activations.DiskActivations`` writes each to disk)."""
        if self.model.get_input_embeddings().weight.is_meta:  # dropped by an earlier capture
            name = self.embedding_weight_name()
            self._set_param(name, self.ckpt.tensor(name, check_finite=True))
        originals = list(self.layers)
        sinks: list[list] = [[] for _ in originals]
        for i, layer in enumerate(originals):
            self.layers[i] = _Recorder(layer, sinks[i], stop=i == len(originals) - 1)
        hidden = [] if into is None else into
        try:
            for ids in batches:
                try:
                    if ids.is_floating_point():  # an image window's input embeddings
                        self.calibrated(inputs_embeds=ids.to(self.compute), use_cache=False)
                    else:
                        self.calibrated(input_ids=ids, use_cache=False)
                except _StopForward:
                    pass
                hidden.append(sinks[0][-1][0].to(STORAGE_DTYPE))
                for sink in sinks:  # the call arguments stay; the activation goes to ``into``
                    _, args, kwargs = sink[-1]
                    sink[-1] = (None, args, kwargs)
        finally:
            for i, layer in enumerate(originals):
                self.layers[i] = layer
        self.calls = [[LayerCall(a, k) for (_, a, k) in sink] for sink in sinks]
        self._drop_input_embedding()
        return hidden

    def _drop_input_embedding(self) -> None:
        """The input embedding's weight back to an empty (meta) one: after the capture nothing
        runs it (module docstring)."""
        emb, out = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        empty = nn.Parameter(torch.empty_like(emb.weight, device="meta"), requires_grad=False)
        if out is not None and out.weight is emb.weight:  # tied: no second holder is left
            out.weight = empty
        emb.weight = empty

    # -- one layer at a time ---------------------------------------------------------------
    def layer_param_names(self, i: int) -> list[str]:
        return [f"{self.layers_prefix}.{i}.{n}" for n, _ in self.layers[i].named_parameters()]

    def load_layer(self, i: int) -> nn.Module:
        layer = self.layers[i]
        # the empty (meta) parameters, put back as they are by unload_layer (a second load
        # before an unload keeps the first record: those are the empty ones)
        self._meta.setdefault(i, {(mod, pname): p for mod in layer.modules()
                                  for pname, p in mod._parameters.items() if p is not None})
        for name in self.layer_param_names(i):
            self._set_param(name, self.ckpt.tensor(name, check_finite=True))
        return layer

    def unload_layer(self, i: int) -> None:
        """Return layer ``i``'s memory. Its original empty parameters go back in place rather
        than new ones (``.to("meta")``): every new tensor object is a small allocation that
        lives to the end of the run wherever malloc put it, often in the middle of the space
        the next layer's large temporaries need; one layer after another, the heap then
        fragments and the peak grows with depth."""
        saved = self._meta.pop(i, None)
        if saved is None:
            self.layers[i].to("meta")
            return
        for (mod, pname), p in saved.items():
            mod._parameters[pname] = p

    @torch.no_grad()
    def forward_layer(self, i: int, hidden: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        layer = self.layers[i]
        for b, h in enumerate(hidden):
            call = self.calls[i][b]
            out = layer(h.to(self.compute), *call.args, **call.kwargs)
            yield (out[0] if isinstance(out, tuple) else out).to(STORAGE_DTYPE)

    @torch.no_grad()
    def call_layer(self, i: int, b: int, h: torch.Tensor) -> torch.Tensor | None:
        """Layer ``i`` on batch ``b``: its output (compute dtype), or None when a hook ended the
        batch early (:class:`LayerDone`)."""
        call = self.calls[i][b]
        try:
            out = self.layers[i](h.to(self.compute), *call.args, **call.kwargs)
        except LayerDone:
            return None
        return out[0] if isinstance(out, tuple) else out

    @torch.no_grad()
    def observe_layer(self, i: int, hidden, before_batch=None, after_full_batch=None) -> None:
        """Run layer ``i`` over every batch only for what its hooks see; a hook may end a batch
        early by raising :class:`LayerDone`. ``before_batch()`` is called before each batch,
        ``after_full_batch()`` after each batch that ran to the end."""
        layer = self.layers[i]
        for b, h in enumerate(hidden):
            call = self.calls[i][b]
            if before_batch is not None:
                before_batch()
            try:
                layer(h.to(self.compute), *call.args, **call.kwargs)
            except LayerDone:
                continue
            if after_full_batch is not None:
                after_full_batch()

    def linears(self, i: int) -> dict[str, nn.Linear]:
        prefix = f"{self.layers_prefix}.{i}."
        return {prefix + n: m for n, m in self.layers[i].named_modules() if isinstance(m, nn.Linear)}
