"""The reference every output is checked against: transformers on the same weights."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def hf_greedy(model_dir: Path, prompts: Sequence[Sequence[int]],
              max_new_tokens: int) -> list[list[int]]:
    """Greedy outputs of transformers generate (fp32) for each prompt, one at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              local_files_only=True)
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([list(ids)])
            y = hf.generate(x, attention_mask=torch.ones_like(x),
                            max_new_tokens=max_new_tokens, do_sample=False)
            outs.append(y[0, len(ids):].tolist())
    del hf
    return outs
