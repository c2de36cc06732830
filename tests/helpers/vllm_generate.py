"""Run real vLLM (CPU) on a checkpoint and print greedy tokens as JSON.

Usage: python vllm_generate.py MODEL_DIR PROMPTS_JSON MAX_TOKENS [LLM_KWARGS_JSON] [--rescore]

Runs in its own process because vLLM spawns workers (hence the __main__ guard), and imports
nothing but vLLM before ``LLM(...)`` is built: whatever loads the checkpoint must come through
vLLM itself (its config, its plugins' entry points).

Prints one JSON line prefixed with ``RESULT ``: per prompt, the greedy token ids, the top-2
log-prob margin and the chosen token's log-prob at every step. With ``--rescore``, each
prompt + continuation is then scored again as one prefill (``prompt_logprobs``), and every
sequence also gets ``prefill``: per continuation token, its rank, log-prob and the best
log-prob at that position. A second line, ``INFO ``, holds the model's quantization method,
the ``cpu_quant`` modules imported before ``LLM(...)`` was built (must be none), and, when the
engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and the cpu_int4 runtime
is loaded, its path counters per phase (``generate``, ``rescore``).
"""

import json
import os
import sys


def _path_calls():
    runtime = sys.modules.get("cpu_quant.formats.cpu_int4.kernel")
    return None if runtime is None else dict(runtime.PATH_CALLS)


def _delta(after, before):
    if after is None:
        return None
    return {k: v - (before or {}).get(k, 0) for k, v in after.items()}


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    rescore = "--rescore" in sys.argv[1:]
    model_dir, prompts_path, max_tokens = args[0], args[1], int(args[2])
    extra = json.loads(args[3]) if len(args) > 3 else {}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.loads(open(prompts_path).read())
    kwargs = {"max_model_len": 512, "enforce_eager": True, "dtype": "bfloat16", "seed": 0}
    kwargs.update(extra)
    imported_before = sorted(m for m in sys.modules if m.split(".")[0] == "cpu_quant")
    llm = LLM(model=model_dir, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    calls0 = _path_calls()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    calls1 = _path_calls()
    result = []
    for o in outs:
        c = o.outputs[0]
        margins, chosen = [], []
        for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
            vals = sorted((v.logprob for v in lp.values()), reverse=True)
            margins.append(vals[0] - vals[1] if len(vals) > 1 else None)
            chosen.append(lp[tok].logprob)
        result.append({"tokens": list(c.token_ids), "top2_margin": margins, "logprob": chosen})
    calls2 = calls1
    if rescore:
        full = [p + r["tokens"] for p, r in zip(prompts, result, strict=True)]
        once = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
        scored = llm.generate([TokensPrompt(prompt_token_ids=f) for f in full], once)
        calls2 = _path_calls()
        for p, r, s in zip(prompts, result, scored, strict=True):
            prefill = []
            for pos in range(len(p), len(p) + len(r["tokens"])):
                lp = s.prompt_logprobs[pos]
                tok = s.prompt_token_ids[pos]
                prefill.append({"rank": lp[tok].rank, "logprob": lp[tok].logprob,
                                "best": max(v.logprob for v in lp.values())})
            r["prefill"] = prefill
    info = {"quantization": llm.llm_engine.vllm_config.model_config.quantization,
            "cpu_quant_imported_before_llm": imported_before,
            "path_calls": {"generate": _delta(calls1, calls0), "rescore": _delta(calls2, calls1)}}
    print("INFO " + json.dumps(info), flush=True)
    print("RESULT " + json.dumps(result), flush=True)
