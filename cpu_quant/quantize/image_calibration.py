"""Image calibration of a vision-language model (``--image-samples N``).

Image-free calibration (the default) runs the calibration text through the language model
alone: its linears never see the embeddings of image tokens, which a served model feeds them
for every image. With ``--image-samples N`` the first N calibration windows each begin with a
user turn that holds one image and a request to describe it, in the model's chat template
(a template that takes no image parts gets the processor's image token in its text), laid out
by the checkpoint's own processor; the window's text follows to fill ``--seqlen`` tokens. The
image is the processor's single global view (no tiling: a tiled image takes more tokens than a
window holds). The vision tower and the projector (kept bf16, as they are in the artifact)
turn it into the image tokens' embeddings, merged into the window's token embeddings as the
model does; the window enters the language model as those embeddings. Everything after the
embeddings (smoothing's statistics, the Hessians, the layers' outputs) is as for a text window.

Images: the built-in set (``data.images``) or ``--images DIR``, taken in order, round-robin.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..core.errors import CpuQuantError
from ..core.io.checkpoint import empty_causal_lm, load_hf_config
from ..core.vision_language import CALIBRATION, family_of
from ..data.images import load_images

PROMPT = "Describe this image."


def calibration_note(settings) -> str:
    """How a vision-language model's run calibrated (the report's and the summary's words)."""
    n = settings.image_samples
    if not n:
        return CALIBRATION
    where = settings.images or "the built-in images (cpu_quant/data/images)"
    return (f"with images: {n} of {settings.samples} windows begin with a user turn holding one "
            f"image ({where}, the processor's single global view) and the request "
            f"{PROMPT!r}, the image tokens' embeddings from the vision tower and the projector; "
            "the other windows are text only")


def image_prompt(processor) -> str:
    """The user turn holding one image and :data:`PROMPT`, in the chat template, with the
    generation prompt; a template without image parts gets the image token in its text."""
    image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    token = getattr(processor, "image_token", "<image>")
    try:
        text = processor.apply_chat_template(image, add_generation_prompt=True, tokenize=False)
        if token in text:
            return text
    except (TypeError, ValueError, AttributeError):
        pass
    tok = processor.tokenizer
    plain = [{"role": "user", "content": f"{token}{PROMPT}"}]
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    return f"User:{token}{PROMPT}\nAssistant:"


def _processor(src: Path):
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(src))
    except Exception as e:  # transformers raises many kinds for a processor it cannot build
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CpuQuantError(f"--image-samples: the checkpoint's processor cannot be built here "
                            f"({first})") from None


def _vision_model(ckpt, config, dtype: torch.dtype):
    """The whole model with only what makes image-token embeddings loaded: the vision tower,
    the projector and the token embedding (the decoder stays empty)."""
    from accelerate.utils import set_module_tensor_to_device

    family = family_of(config)
    model = empty_causal_lm(config, dtype).eval()
    emb = model.get_input_embeddings()
    emb_name = next(n for n, m in model.named_modules() if m is emb) + ".weight"
    for name, _ in list(model.named_parameters()):
        if name == emb_name or family.kept_module(name) is not None:
            set_module_tensor_to_device(model, name, "cpu",
                                        value=ckpt.tensor(name, check_finite=True).to(dtype))
    return model.get_submodule(family.language_model.rsplit(".", 1)[0])


@torch.no_grad()
def image_windows(src: Path, ckpt, text_windows: list[list[int]], seqlen: int,
                  images_dir: str | None, dtype: torch.dtype) -> list[torch.Tensor]:
    """One embedding window [seqlen, hidden] per text window: the image prompt's tokens (the
    image's embeddings in place of its image tokens) followed by the window's first tokens."""
    config = load_hf_config(ckpt.path)
    processor = _processor(src)
    prompt = image_prompt(processor)
    model = _vision_model(ckpt, config, dtype)
    out = []
    for window, image in zip(text_windows, load_images(images_dir, len(text_windows)),
                             strict=True):
        inputs = processor(text=[prompt], images=[[image]], return_tensors="pt",
                           do_image_splitting=False)
        ids = inputs["input_ids"][0].tolist()
        if len(ids) >= seqlen:
            raise CpuQuantError(f"--image-samples: the image prompt takes {len(ids)} tokens, "
                                f"not fewer than --seqlen {seqlen}")
        ids = torch.tensor([ids + list(window[: seqlen - len(ids)])])
        features = model.get_image_features(inputs["pixel_values"].to(dtype),
                                            inputs.get("pixel_attention_mask"))
        features = getattr(features, "pooler_output", features)
        embeds = model.get_input_embeddings()(ids)
        out.append(model.inputs_merger(ids, embeds, features)[0])
    return out
