"""Run real vLLM (CPU) on a checkpoint and print greedy tokens as JSON.

Usage: python vllm_generate.py MODEL_DIR PROMPTS_JSON MAX_TOKENS [extra LLM kwargs as JSON]

Runs in its own process because vLLM spawns workers (hence the __main__ guard).
Prints one JSON line prefixed with ``RESULT `` holding the token ids per prompt.
"""

import json
import os
import sys

if __name__ == "__main__":
    model_dir, prompts_path, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(open(prompts_path).read())
    kwargs = {"max_model_len": 512, "enforce_eager": True, "dtype": "bfloat16", "seed": 0}
    kwargs.update(extra)
    llm = LLM(model=model_dir, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    result = []
    for o in outs:
        c = o.outputs[0]
        margins = []
        for lp in c.logprobs:
            vals = sorted((v.logprob for v in lp.values()), reverse=True)
            margins.append(vals[0] - vals[1] if len(vals) > 1 else None)
        result.append({"tokens": list(c.token_ids), "top2_margin": margins})
    print("RESULT " + json.dumps(result), flush=True)
