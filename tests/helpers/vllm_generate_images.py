"""Run real vLLM (CPU) on a vision-language checkpoint with image prompts; print greedy tokens.

Usage: python vllm_generate_images.py MODEL_DIR PROMPTS_JSON MAX_TOKENS

PROMPTS_JSON is a list of ``{"prompt": TEXT, "image_seed": SEED}``: each prompt's text holds
the processor's image placeholder, and its image is :func:`random_image` of the seed (the test
builds the same image for the torch reference). Runs in its own process (vLLM spawns workers)
and imports nothing but vLLM, numpy and PIL before ``LLM(...)`` is built.

Prints ``INFO `` (the model's quantization method) and ``RESULT ``: per prompt, vLLM's prompt
token ids (the image placeholder expanded by the processor), the greedy token ids and the
top-2 log-prob margin at every step.
"""

import json
import os
import sys

IMAGE_SIZE = (40, 50)  # height, width: not the model's square, so the processor resizes it


def random_image(seed: int):
    """A deterministic random RGB image."""
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (*IMAGE_SIZE, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


if __name__ == "__main__":
    model_dir, prompts_path, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    prompts = json.loads(open(prompts_path).read())
    llm = LLM(model=model_dir, max_model_len=256, enforce_eager=True, dtype="bfloat16", seed=0,
              limit_mm_per_prompt={"image": 1})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    requests = [{"prompt": p["prompt"], "multi_modal_data": {"image": random_image(p["image_seed"])}}
                for p in prompts]
    result = []
    for o in llm.generate(requests, params):
        c = o.outputs[0]
        margins = []
        for lp in c.logprobs:
            vals = sorted((v.logprob for v in lp.values()), reverse=True)
            margins.append(vals[0] - vals[1] if len(vals) > 1 else None)
        result.append({"prompt_ids": list(o.prompt_token_ids), "tokens": list(c.token_ids),
                       "top2_margin": margins})
    info = {"quantization": llm.llm_engine.vllm_config.model_config.quantization}
    print("INFO " + json.dumps(info), flush=True)
    print("RESULT " + json.dumps(result), flush=True)
