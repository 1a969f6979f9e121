"""Reference outputs from vLLM's own offline ``LLM.generate``, in a process of its own.

Usage: python -m tests.helpers.offline_reference SPEC.json  (prints a JSON result on stdout)
SPEC: {"model": dir, "prompts": [[ids]], "sampling": {vllm SamplingParams kwargs}}
Prompts run one at a time so batch shapes match a server handling one request at a time.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any


def _at(position: dict[int, Any] | None, token: int) -> float:
    """The logprob vLLM gave ``token`` at one position (it gives one where asked)."""
    assert position is not None
    return float(position[token].logprob)


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model"],
        dtype="float32",
        max_model_len=spec.get("max_model_len", 512),
        enforce_eager=True,
        seed=0,
    )
    params = SamplingParams(**spec["sampling"])
    results = []
    for prompt in spec["prompts"]:
        (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        completion = output.outputs[0]
        logprobs = None
        if completion.logprobs is not None:
            logprobs = [
                _at(position, token)
                for token, position in zip(completion.token_ids, completion.logprobs, strict=True)
            ]
        results.append({"token_ids": list(completion.token_ids), "logprobs": logprobs})
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
