"""Random-init tiny target: the fastest end-to-end check of the decode path.

Command:
  python scripts/decode.py --config=configs/tiny.py --prompt_ids=1,2,3
  python scripts/decode.py --config=configs/tiny.py --config.drafter=ngram --config.compare_ar=True
Expected: runs in a few seconds on a CPU; random weights give meaningless tokens, and with
`compare_ar=True` the metrics line reports `lossless=True`.
"""

from configs import common


def get_config(arg=None):
  args = common.parse_arg(arg, batch=1)
  cfg = common.decode_config('tiny')
  cfg.batch_size = args.batch
  cfg.max_new_tokens = 32
  return cfg
