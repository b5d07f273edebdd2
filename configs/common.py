"""Shared pieces of dspec configs: argument parsing, the decode skeleton, model presets.

Config files define `get_config(arg=None)`; `arg` is the text after `:` in
`--config=configs/x.py:arg`, e.g. `tiny`, `batch=4` or `tiny,batch=4` (big_vision style).
"""

import copy
import dataclasses

import ml_collections

from dspec import sharding
from dspec.decoding.drafters import registry
from dspec.decoding.policy import ControllerConfig

# Model shapes used by several configs. `tiny` runs in seconds on a laptop CPU.
MODEL_PRESETS = {
    'tiny': dict(vocab_size=256, num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2,
                 head_dim=16, mlp_dim=128, rope_theta=10_000.0, qk_norm=True,
                 tie_embeddings=True),
    # ~100M parameters: the memory-bound AR roofline target (random weights).
    'roofline100m': dict(vocab_size=32_000, num_layers=12, embed_dim=768, num_heads=12,
                         num_kv_heads=4, head_dim=64, mlp_dim=2048, rope_theta=1e6,
                         qk_norm=True, tie_embeddings=True),
    # The demo target trained by configs/demo_target.py (~15.7M parameters).
    'demo': dict(vocab_size=8192, num_layers=8, embed_dim=384, num_heads=6, num_kv_heads=2,
                 head_dim=64, mlp_dim=1024, rope_theta=10_000.0, qk_norm=True,
                 tie_embeddings=True),
}

def parse_arg(arg, **spec):
  """Parses `a,b=3` into a ConfigDict over `spec` (defaults); bare words set True."""
  cfg = ml_collections.ConfigDict(spec)
  if not arg:
    return cfg
  for item in arg.split(','):
    if not item:
      continue
    key, eq, value = item.partition('=')
    if key not in spec:
      raise ValueError(f'unknown config argument {key!r}; known: {sorted(spec)}')
    default = spec[key]
    if not eq:
      cfg[key] = True
    elif isinstance(default, bool):
      cfg[key] = value.lower() in ('1', 'true', 'yes')
    elif default is None:
      cfg[key] = value
    else:
      cfg[key] = type(default)(value)
  return cfg


def model_config(preset: str) -> ml_collections.ConfigDict:
  """Target model section: where the weights come from, and the shape for random init."""
  return ml_collections.ConfigDict({
      'source': 'random',     # random | checkpoint | hf
      'path': '',             # checkpoint dir (source=checkpoint) or HF dir (source=hf)
      'tokenizer_dir': '',    # dir with tokenizer.json; '' -> next to the weights, else bytes
      'seed': 0,
      'max_seq_len': 4096,    # prompt + max_new_tokens must fit
      'shape': dict(MODEL_PRESETS[preset]),
      'widen_mlp': 1,         # > 1: MLPs that many times wider, same tokens (models/widen)
  })


def drafter_configs() -> ml_collections.ConfigDict:
  """Sub-configs of every drafter (`registry.DEFAULTS`); `drafter` picks which one runs."""
  return ml_collections.ConfigDict(copy.deepcopy(registry.DEFAULTS))


def controller_config() -> ml_collections.ConfigDict:
  """The verify-length controller's knobs (`dspec.decoding.policy.ControllerConfig`)."""
  return ml_collections.ConfigDict(dataclasses.asdict(ControllerConfig()))


def decode_config(preset: str = 'tiny') -> ml_collections.ConfigDict:
  """The fields every decode config has (docs/DESIGN.md, "Command-line contract")."""
  cfg = ml_collections.ConfigDict()
  cfg.model = model_config(preset)
  cfg.max_new_tokens = 64
  cfg.temperature = 0.0
  cfg.top_k = 0
  cfg.top_p = 1.0
  cfg.seed = 0
  cfg.batch_size = 1
  cfg.drafter = 'none'        # none | ngram | suffix | oracle | self | mtp | dflash
  cfg.compare_ar = False
  cfg.verify_length = 'auto'  # auto: the load-aware controller picks it | fixed: num_draft
                              # | tree: a token tree per step (cfg.tree)
                              # | auto_tree: the controller picks the tree's node budget
  cfg.controller = controller_config()   # its knobs (tiers capped at num_draft)
  cfg.tree = ml_collections.ConfigDict({'num_nodes': 32, 'top_k': 8})
  cfg.mesh = ''               # e.g. 'data=2,tensor=4'; '' = single device
  cfg.sharding_rules = sharding.DEFAULT_RULES
  cfg.distributed = False     # True: jax.distributed.initialize() first (multi-host)
  cfg.prompt = 'def fibonacci(n):'
  cfg.prompt_set = ''         # e.g. humaneval | gsm8k_test: take the prompt from a dataset
  cfg.prompt_index = 0
  cfg.data_dir = 'data'       # GSM8K and Spec-Bench ship in the repo (data/README.md)
  cfg.timing_repeats = 3      # timed runs after warm-up; the median is reported
  cfg.debug = False           # jax_transfer_guard='disallow': no implicit transfers
  cfg.drafters = drafter_configs()
  return cfg


def drafter_training(cfg, task: str, data_path: str, steps: int, minutes: float):
  """Adds the `data` (self-distilled shards, 3% held out) and `training` sections of a
  drafter-training config; returns the training section."""
  cfg.data = ml_collections.ConfigDict({'path': data_path, 'heldout_fraction': 0.03})
  cfg.training = training_config(task)
  t = cfg.training
  t.num_steps = steps
  t.max_minutes = minutes
  # One budget for every drafter of the family, so their tables compare like with like.
  t.batch_size = 8
  t.seq_len = 320                  # distill_demo: <= 192 prompt + 128 written tokens
  t.learning_rate = 6e-4
  t.warmup_ratio = 0.04
  t.weight_decay = 0.0
  t.eval_every = 250
  t.eval_windows = 64
  # Resumable on a fresh machine: commit <workdir>/export (train_step in its metadata),
  # then rerun with --config.training.init_from=<it> --config.training.continue_from_init=True.
  t.export_every = 250
  return t


# The deep recipe of the block drafters (DFlash and its successors), after z-lab's: every
# target-written position of a row is an anchor (a demo row writes <= 128 tokens), several
# epochs, rows of a batch few so that one step stays a few seconds on a CPU.
DEEP_ANCHORS = 128
DEMO_TRAIN_ROWS = 7760    # distill_demo's 8000 rows less the 3% held out


def demo_epoch_steps(epochs: float, batch_size: int) -> int:
  """Steps for `epochs` passes over the demo distillation's training rows."""
  return int(-(-epochs * DEMO_TRAIN_ROWS // batch_size))


# Arguments of the block drafters' configs (DFlash, DFlash-2, DSpark) for `block_recipe`.
BLOCK_RECIPE_ARGS = dict(deep=False, anchors=0, batch=0, epochs=0.0)


def block_recipe(t: ml_collections.ConfigDict, section: ml_collections.ConfigDict,
                 args) -> None:
  """The block drafters' recipe arguments (`BLOCK_RECIPE_ARGS`) on a `drafter_training`
  section `t` and the drafter section (its `num_anchors`). `deep`: 4 rows of 128 anchors
  per step, 4 epochs, WSD (its end can move while it runs: runs span sessions), bf16
  exports every 250 steps (what a fresh machine resumes from), 128 held-out rows; then
  anchors=N, batch=N and epochs=E (steps from the demo's row count) override."""
  if args.deep:
    section.num_anchors = DEEP_ANCHORS
    t.batch_size = 4
    t.num_steps = demo_epoch_steps(4, t.batch_size)
    t.schedule = 'wsd'
    t.decay_ratio = 0.15
    t.storage_dtype = 'bfloat16'
    t.eval_every = 500
    t.eval_windows = 128
  if args.anchors:
    section.num_anchors = args.anchors
  if args.batch:
    t.batch_size = args.batch
  if args.epochs:
    t.num_steps = demo_epoch_steps(args.epochs, t.batch_size)


def training_config(task: str) -> ml_collections.ConfigDict:
  """Optimiser, schedule, logging and checkpoint knobs shared by every objective."""
  return ml_collections.ConfigDict({
      'task': task,             # target | mtp | dflash | bd3lm
      'workdir': '',            # '' -> runs/<config name>
      'num_steps': 1000,
      'batch_size': 16,
      'seq_len': 256,
      'learning_rate': 3e-3,
      'schedule': 'cosine',     # cosine | wsd (warmup-stable-decay, extendable)
      'warmup_ratio': 0.04,
      'decay_ratio': 0.1,       # wsd: the final fraction of num_steps that decays
      'weight_decay': 0.1,
      'grad_clip': 1.0,
      'b1': 0.9,
      'b2': 0.95,
      'seed': 0,
      'log_every': 50,
      'eval_every': 500,
      'eval_windows': 64,
      'ckpt_every': 200,
      'max_minutes': 0.0,       # 0 = no wall-clock cap; else stop, checkpoint and export
      'storage_dtype': 'float32',
      'heldout_fraction': 0.02,
      'init_from': '',          # target / mtp_joint: the target to start from; drafter
                                # tasks: a drafter export to start from (same kind, shapes)
      'continue_from_init': False,  # no workdir checkpoint: warm restart at init's step
      'export_every': 0,        # > 0: also export the model to <workdir>/export this often
      'corpus_eval': False,     # mtp_posthoc: also evaluate on held-out corpus windows
      'mixture': {'python_stdlib': 0.6, 'gsm8k': 0.4},
      'mesh': '',               # e.g. 'fsdp=4,tensor=2'; '' = single device
      'sharding_rules': sharding.DEFAULT_RULES,
  })
