"""dspec: lossless speculative decoding in JAX/Flax NNX.

The API (`dspec/api.py`):
  load_target(path)                    a dspec target checkpoint or a Hugging Face model dir
  load_drafter(kind, path, target=...) ngram | suffix | oracle | self | mtp | dflash
  generate(target, prompts, drafter=..., max_new_tokens=..., temperature=...,
           top_k=..., top_p=..., seed=...)  -> Generation(texts, ids, metrics, per_prompt)
  warmup(target, drafter, prompt_lengths=..., max_new_tokens=...)  compiles those shape
                                       buckets ahead: later generate calls in them compile
                                       nothing
Lower levels: `dspec.decoding` (engine, drafters, controller, batching) and `dspec.models`.
"""

from dspec.api import (Drafter, Generation, Target, generate, load_drafter, load_target,
                       warmup)

__all__ = ['Drafter', 'Generation', 'Target', 'generate', 'load_drafter', 'load_target',
           'warmup']
