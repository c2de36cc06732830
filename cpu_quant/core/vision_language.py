"""Vision-language checkpoints: the families cpu-quant quantizes, and what it keeps of them.

A vision-language checkpoint is a language model (a decoder like any other) fed by a vision
tower through a projector. cpu-quant quantizes the language model's linears and its head like
a decoder-only model's; the vision tower and the projector stay bf16, copied unchanged, for the
reasons of :data:`TOWER_WHY` and :data:`PROJECTOR_WHY`.

Calibration is image-free by default: the calibration text runs through the language model
alone, the vision tower and the projector never run (:data:`CALIBRATION`); with images
(``--image-samples``) some windows begin with an image (``quantize.image_calibration``).

One row per family (:data:`FAMILIES`), kept as data: its ``model_type``, the transformers auto
class that builds it, where its language model's decoder layers are, and the checkpoint-name
prefixes of the modules it keeps. A checkpoint with a ``vision_config`` of another family is
refused in one line (:func:`refuse_vision_language`).
"""

from __future__ import annotations

from dataclasses import dataclass

TOWER_WHY = ("vision tower: runs once per image, not once per generated token, and text-only "
             "calibration gives its linears no Hessian")
PROJECTOR_WHY = ("projector: maps the vision tower's features into the language model's "
                 "embeddings; text-only calibration gives it no Hessian")
CALIBRATION = ("image-free: the calibration text runs through the language model only; the "
               "vision tower and the projector are not run")


@dataclass(frozen=True)
class KeptModule:
    """Tensors a run copies unchanged (bf16): those whose names start with ``prefix``."""

    prefix: str  # a checkpoint tensor-name prefix, ending in "."
    why: str


@dataclass(frozen=True)
class VisionLanguageFamily:
    model_type: str  # config.json's model_type
    name: str
    auto_class: str  # the transformers auto class that builds the whole model
    language_model: str  # the decoder that calibration runs (module name in that model)
    kept: tuple[KeptModule, ...]

    @property
    def layers(self) -> str:
        """The language model's decoder layers (module name)."""
        return self.language_model + ".layers"

    def kept_module(self, tensor_name: str) -> KeptModule | None:
        return next((k for k in self.kept if tensor_name.startswith(k.prefix)), None)


FAMILIES: dict[str, VisionLanguageFamily] = {
    # SmolVLM (v1) checkpoints are Idefics3's: a SigLIP tower, a pixel-shuffle projector, a
    # Llama decoder; vLLM's module names are the checkpoint's
    "idefics3": VisionLanguageFamily(
        "idefics3", "Idefics3 (SmolVLM)", "AutoModelForImageTextToText", "model.text_model",
        (KeptModule("model.vision_model.", TOWER_WHY),
         KeptModule("model.connector.", PROJECTOR_WHY))),
}


def family_of(config) -> VisionLanguageFamily | None:
    """The vision-language family of a config (``config.json``'s dict or a transformers
    config), or None for any other model."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(
        config, "model_type", None)
    return FAMILIES.get(model_type) if isinstance(model_type, str) else None


def auto_class(config) -> str:
    """The transformers auto class that builds the model of ``config``: its family's, else
    ``AutoModelForCausalLM``."""
    family = family_of(config)
    return family.auto_class if family else "AutoModelForCausalLM"


def refuse_vision_language(config: dict) -> str | None:
    """Why a checkpoint with a vision tower cannot be quantized (a family not in
    :data:`FAMILIES`), or None."""
    if "vision_config" not in config or family_of(config) is not None:
        return None
    names = ", ".join(f.name for f in FAMILIES.values())
    return (f"a {config.get('model_type')!s} vision-language checkpoint: cpu-quant quantizes the "
            f"language model of {names} only")
