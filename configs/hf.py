"""Decode with a Hugging Face model directory (config.json, safetensors, tokenizer.json).

Command:
  python scripts/decode.py --config=configs/hf.py:/path/to/Qwen3-0.6B --prompt="def f(x):"
  python scripts/decode.py --config=configs/hf.py:/path/to/model --config.drafter=ngram \
      --config.compare_ar=True
Expected: prints the continuation and a metrics line; Llama and Qwen3 checkpoints load
directly (sharded safetensors, tied embeddings, qk-norm).
"""

from configs import common


def get_config(arg=None):
  if not arg:
    raise ValueError('configs/hf.py needs a model directory: --config=configs/hf.py:<dir>')
  cfg = common.decode_config('tiny')
  cfg.model.source = 'hf'
  cfg.model.path = arg
  return cfg
