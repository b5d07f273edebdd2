"""Red-team sweep (issues 15, 39, round 4): ~600 bad or edge inputs to every entry point, one subprocess each.

  python scripts/redteam.py [--only=SUBSTRING] [--json=PATH] [--table=PATH] [--keep]

Covers decode.py, train.py, distill.py, convert_hf.py, benchmark.py, export_drafter.py and
the Python API (checkpoints, safe writes, locks, HF import, tokenizers), plus issue 39's
classes, one group each: `outputs` (the output-path policy in every script: foreign files,
dspec's own files, symlinks, one path per output, outputs inside inputs, folders never
emptied, file modes), `api_args` (every public API argument: types, ranges, no coercion),
`config` (unknown fields nested or not, configs for another script), `context` (draft
length + max_new_tokens + prompt against the context, before compiling), `named` (damaged
files named in the error) and `locks` (stale locks and manifests, leftovers); and the
reliability issue's round-4 classes, one group each: `multiprocess` (flags and joins that
cannot complete end in one line within --distributed_timeout; launch_local.py refuses
unbounded waits and leaves no process behind however it ends; two processes decode
losslessly), `knobs` (every controller and tree knob ranged, drafter settings a tree mode
ignores refused by name, all before loading), `ckpt_values` (NaN, infinite or out-of-range
numbers in a drafter's config.json, a checkpoint's metadata or an HF config refused naming
file and field), `foreign_drafter` (a drafter built for another target refused naming both,
by load_drafter and generate; other weights of the same shapes: a warning, lossless),
`outputs_in_inputs` (every script's outputs inside any of its inputs, --force or not),
`force_replace` (--force replaces another drafter whole, a folder of two models refused on
load), `disk` (a full disk, a file-size limit, a read-only mount, an immutable or
unwritable folder: one line naming the output, the previous one intact; needs root, as the
container runs it), `api_errors` (the `dspec.errors` class each API failure raises),
`structured` (bad or unsatisfiable --json_schema / --regex / --grammar, modes that cannot
take one; constrained output with a drafter equals constrained AR) and `lossless_modes`
(tree and auto_tree give AR's output with every tree drafter). Every case runs in its own
scratch directory, and is classified:

  ok              an edge input that should work did, and its output checks passed
  clean error     exit 1 (launch_local.py: 2), exactly one `error:` line, no traceback
  traceback       a raw traceback, a crash, or a failure without one `error:` line
  hang            no exit within the case's timeout
  silently wrong  exit 0 where an error was due (unless the case documents a warning and
                  it was printed), an output check failed, an output was written anyway, or
                  a lock or temporary file was left behind
  data loss       a file or node the case planted was deleted, replaced or changed

Prints a line per case and the counts; exits 1 unless tracebacks, hangs, silently wrong
and data loss are all 0. `--table=PATH` writes the counts per group as a markdown table
(docs/results/redteam/results.md). Takes about 75 minutes on 2 CPU cores (JAX start-up
dominates; round 4's groups about 30 of them). Never touches anything outside its scratch
directory (`--out=` style paths run with the scratch directory as the working directory;
root and home are never given as outputs).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Callable, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
CATEGORIES = ('ok', 'clean error', 'traceback', 'hang', 'silently wrong', 'data loss')
BAD = ('traceback', 'hang', 'silently wrong', 'data loss')
TABLE_TITLE = '# Red-team sweep'   # the first line of --table (how an earlier one is known)


@dataclasses.dataclass
class Case:
  """One input. `argv` entries may hold {sb} (scratch dir), {fx} (fixtures) and {repo}."""

  name: str
  group: str
  argv: list
  expect: str = 'error'           # error | ok | either (error or ok are both fine)
  message: str = ''               # expected in the error line (a mismatch is noted)
  setup: Optional[Callable] = None          # setup(sb, fx)
  check: Optional[Callable] = None          # check(sb, fx, proc) -> problem or None
  warning: str = ''               # exit 0 is intended when stderr carries this warning
  cwd: str = 'repo'               # repo | sb
  timeout: int = 600
  memory_gb: int = 8              # address-space cap, so that no case can exhaust the host
  status: int = 1                 # the exit status of a clean error (launch_local.py: 2)


# ----------------------------------------------------------------------------- helpers

def _write(path, text, mode='w'):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, mode) as f:
    f.write(text)


def _sha(path) -> str:
  return hashlib.sha256(open(path, 'rb').read()).hexdigest()


def _flip_byte(path, fraction=0.5):
  data = bytearray(open(path, 'rb').read())
  data[int(len(data) * fraction)] ^= 0x10
  _write(path, bytes(data), 'wb')


def _truncate(path, fraction=0.5):
  data = open(path, 'rb').read()
  _write(path, data[:int(len(data) * fraction)], 'wb')


def _largest_data_file(ckpt):
  found = []
  for root, _, names in os.walk(os.path.join(ckpt, 'state')):
    if os.path.basename(root) == 'd':
      found += [os.path.join(root, n) for n in names]
  return max(found, key=os.path.getsize)


def _copy(src, dst):
  shutil.copytree(src, dst, symlinks=True)


def _plant(sb, rel='keep/thesis.tex', text='years of work'):
  _write(os.path.join(sb, rel), text)


def _planted_intact(rel='keep/thesis.tex', text='years of work'):
  def check(sb, fx, proc):
    path = os.path.join(sb, rel)
    if not os.path.isfile(path) or open(path).read() != text:
      return f'data loss: {rel} was deleted or changed'
    return None
  return check


def _refuse_constant(name):
  raise ValueError(f'non-finite value {name}')


def _strict_json(path):
  """The JSON in `path`; NaN and Infinity (which json.dump writes bare) raise ValueError."""
  with open(path) as f:
    return json.loads(f.read(), parse_constant=_refuse_constant)


def _all(*checks):
  def check(sb, fx, proc):
    for c in checks:
      problem = c(sb, fx, proc)
      if problem:
        return problem
    return None
  return check


def _no_file(rel):
  def check(sb, fx, proc):
    if proc.returncode != 0 and os.path.exists(os.path.join(sb, rel)):
      return f'wrong: {rel} was written although the run failed'
    return None
  return check


def _metrics_ok(rel='m.json'):
  def check(sb, fx, proc):
    if proc.returncode != 0:
      return None
    try:
      report = _strict_json(os.path.join(sb, rel))
    except (OSError, ValueError) as e:
      return f'wrong: {e}'
    if not report.get('new_tokens') or not report.get('output_ids'):
      return 'wrong: no tokens generated'
    return None
  return check


def _hold_lock(rel, what):
  """setup: a process of ours holding the directory lock of sb/rel (killed in the check)."""
  def setup(sb, fx):
    code = textwrap.dedent(f'''
        import sys, time
        sys.path.insert(0, {REPO!r})
        from dspec.files import directory_lock
        with directory_lock({os.path.join(sb, rel)!r}, {what!r}):
          print('locked', flush=True)
          time.sleep(600)''')
    holder = subprocess.Popen([PY, '-c', code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == 'locked'
    _HOLDERS[sb] = holder
  return setup


_HOLDERS: dict = {}
_CLEANUPS: dict = {}   # sb -> what to undo after the case, however it ended


def _release(sb, fx, proc):
  holder = _HOLDERS.pop(sb, None)
  if holder is not None:
    holder.kill()
    holder.wait()
  for undo in _CLEANUPS.pop(sb, []):
    undo()
  return None


def _api(code: str) -> list:
  """A Python API snippet run through the CLI wrapper (anticipated errors -> one line)."""
  body = textwrap.indent(textwrap.dedent(code).strip(), '  ')
  program = (f'import os, sys\nsys.path.insert(0, {REPO!r})\nfrom dspec import cli\n'
             f'def main(argv):\n{body}\ncli.run(main)\n')
  return [PY, '-c', program]


# ---------------------------------------------------------------------------- fixtures

FIXTURE_CODE = '''
import json, os, sys
sys.path.insert(0, {repo!r})
import orbax.checkpoint as ocp
from flax import nnx
from configs import common
from dspec import checkpoint
from dspec.hf_export import export_to_hf
from dspec.models.config import TransformerConfig
from dspec.models.transformer import Transformer
fx = {fx!r}
cfg = TransformerConfig(**common.MODEL_PRESETS['tiny'])
model = Transformer(cfg, rngs=nnx.Rngs(0))
checkpoint.save_model(os.path.join(fx, 'target'), model, kind='target', config=cfg.to_dict())
params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
metadata = dict(kind='target', config=cfg.to_dict(), storage_dtype='float32', extra={{}},
                dspec_format_version=1)
checkpoint._checkpointer().save(os.path.join(fx, 'target_old'), args=ocp.args.Composite(
    state=ocp.args.PyTreeSave(params), metadata=ocp.args.JsonSave(metadata)))
export_to_hf(model, os.path.join(fx, 'hf'))
'''


def build_fixtures(fx: str) -> None:
  os.makedirs(fx)
  steps = [
      ([PY, '-c', FIXTURE_CODE.format(repo=REPO, fx=fx)], 'target checkpoints and HF dir'),
      ([PY, 'scripts/train.py', '--config=configs/demo_target_v2.py:quick',
        f'--workdir={fx}/run4'], 'a 4-step quick training run'),
      ([PY, 'scripts/distill.py', '--config=configs/distill_demo.py:tiny',
        f'--out_dir={fx}/distill'], 'a tiny distilled set'),
  ]
  for argv, what in steps:
    t0 = time.time()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900,
                          preexec_fn=_limit_memory(8))
    if proc.returncode != 0:
      sys.exit(f'fixture failed ({what}):\n{proc.stderr[-3000:]}')
    print(f'fixture: {what} ({time.time() - t0:.0f}s)', flush=True)


# ------------------------------------------------------------------------------- cases

def decode_cases() -> list:
  base = ['scripts/decode.py', '--config=configs/tiny.py', '--config.max_new_tokens=8',
          '--config.timing_repeats=1', '--metrics_json={sb}/m.json']
  ckpt = ['--config.model.source=checkpoint', '--config.model.path={sb}/ckpt']

  def d(name, *args, expect='error', message='', setup=None, check=None, metrics=True,
        **kw):
    """A decode case; `metrics`: its report goes to {sb}/m.json (checked strictly)."""
    checks = [check] if check else []
    if metrics:
      checks.append(_metrics_ok() if expect != 'error' else _no_file('m.json'))
    return Case(name, 'decode', base + list(args), expect, message, setup, _all(*checks),
                **kw)

  def with_ckpt(damage=None, src='target'):
    def setup(sb, fx):
      _copy(os.path.join(fx, src), os.path.join(sb, 'ckpt'))
      if damage:
        damage(os.path.join(sb, 'ckpt'))
    return setup

  def edit_metadata(fn):
    def damage(path):
      meta = os.path.join(path, 'metadata', 'metadata')
      data = json.load(open(meta))
      fn(data)
      _write(meta, json.dumps(data))
    return damage

  def hf_setup(edit=None):
    def setup(sb, fx):
      _copy(os.path.join(fx, 'hf'), os.path.join(sb, 'hf'))
      if edit:
        edit(os.path.join(sb, 'hf'))
    return setup

  def hf_config(**changes):
    def edit(hf):
      path = os.path.join(hf, 'config.json')
      config = json.load(open(path))
      config.update(changes)
      _write(path, json.dumps(config))
    return edit

  def char_device(sb, fx):
    os.mknod(os.path.join(sb, 'node'), stat.S_IFCHR | 0o666, os.makedev(1, 3))

  def still_char_device(sb, fx, proc):
    st = os.lstat(os.path.join(sb, 'node'))
    return None if stat.S_ISCHR(st.st_mode) else 'data loss: the device node was replaced'

  def link_setup(sb, fx):
    _write(os.path.join(sb, 'real.json'), 'old')
    os.symlink(os.path.join(sb, 'real.json'), os.path.join(sb, 'link.json'))

  def link_kept(sb, fx, proc):
    if not os.path.islink(os.path.join(sb, 'link.json')):
      return 'data loss: the symlink was replaced by a file'
    if open(os.path.join(sb, 'real.json')).read() != 'old':
      return 'data loss: the file the symlink points to was overwritten'
    return None

  hf = ['--config.model.source=hf', '--config.model.path={sb}/hf']
  cases = [
      # sampling knobs
      d('temperature_nan', '--config.temperature=nan', message='temperature'),
      d('temperature_inf', '--config.temperature=inf', message='temperature'),
      d('temperature_neg_inf', '--config.temperature=-inf', message='temperature'),
      d('temperature_negative', '--config.temperature=-0.5', message='temperature'),
      d('temperature_text', '--config.temperature=hot', message='temperature'),
      d('temperature_huge', '--config.temperature=1e9', expect='ok'),
      d('temperature_tiny', '--config.temperature=1e-9', expect='ok'),
      d('temperature_sampled', '--config.temperature=0.7', '--config.top_p=0.9',
        expect='ok'),
      d('top_p_nan', '--config.top_p=nan', message='top_p'),
      d('top_p_zero', '--config.top_p=0', message='top_p'),
      d('top_p_negative', '--config.top_p=-0.1', message='top_p'),
      d('top_p_above_one', '--config.top_p=1.5', message='top_p'),
      d('top_p_inf', '--config.top_p=inf', message='top_p'),
      d('top_p_tiny', '--config.temperature=1.0', '--config.top_p=1e-9', expect='ok'),
      d('top_k_negative', '--config.top_k=-1', message='top_k'),
      d('top_k_int32_overflow', '--config.top_k=2147483648', message='top_k'),
      d('top_k_huge', '--config.top_k=1000000000000', message='top_k'),
      d('top_k_above_vocab', '--config.temperature=1.0', '--config.top_k=100000',
        expect='either'),
      d('top_k_five', '--config.temperature=1.0', '--config.top_k=5', expect='ok'),
      d('seed_negative', '--config.seed=-1', message='seed'),
      d('seed_int32_overflow', '--config.seed=2147483648', message='seed'),
      d('seed_huge', '--config.seed=1099511627776', message='seed'),
      d('seed_int32_max', '--config.seed=2147483647', '--config.temperature=1.0',
        expect='ok'),
      # lengths and batch
      d('max_new_tokens_zero', '--config.max_new_tokens=0', message='max_new_tokens'),
      d('max_new_tokens_negative', '--config.max_new_tokens=-1', message='max_new_tokens'),
      d('max_new_tokens_3e9', '--config.max_new_tokens=3000000000',
        message='max_new_tokens'),
      d('max_new_tokens_int32_max', '--config.max_new_tokens=2147483647',
        message='max_new_tokens'),
      d('max_new_tokens_float', '--config.max_new_tokens=3e9', message='max_new_tokens'),
      d('max_new_tokens_one', '--config.max_new_tokens=1', expect='ok'),
      d('batch_size_zero', '--config.batch_size=0', message='batch_size'),
      d('batch_size_negative', '--config.batch_size=-1', message='batch_size'),
      d('batch_size_int32_overflow', '--config.batch_size=2147483648',
        message='batch_size'),
      d('batch_size_oom', '--config.batch_size=100000', '--config.max_new_tokens=4000',
        message='out of memory'),
      d('batch_size_three', '--config.batch_size=3', expect='ok'),
      d('max_seq_len_zero', '--config.model.max_seq_len=0', message='max_seq_len'),
      d('max_seq_len_negative', '--config.model.max_seq_len=-5', message='max_seq_len'),
      d('timing_repeats_negative', '--config.timing_repeats=-1', message='timing_repeats'),
      # prompts
      d('empty_prompt', '--prompt=', message='empty prompt'),
      d('prompt_ids_out_of_vocab', '--prompt_ids=1,2,999', message='out of range'),
      d('prompt_ids_negative', '--prompt_ids=-1,2', message='out of range'),
      d('prompt_ids_text', '--prompt_ids=a,b', message='prompt_ids'),
      d('prompt_ids_empty', '--prompt_ids=', message='empty'),
      d('prompt_ids_huge', '--prompt_ids=99999999999999999999', message='out of range'),
      d('prompt_and_prompt_ids', '--prompt=hi', '--prompt_ids=1,2', message='not both'),
      d('prompts_beyond_batch', '--prompt=a', '--prompt=b', '--prompt=c',
        '--config.batch_size=2', message='batch_size'),
      d('two_prompts_batch_one', '--prompt=a', '--prompt=b', message='batch_size'),
      d('two_prompts_batch_two', '--prompt=ab', '--prompt=cd', '--config.batch_size=2',
        expect='ok'),
      d('prompt_too_long', '--config.model.max_seq_len=16',
        '--prompt_ids=' + ','.join(['1'] * 10), message='exceeds the model context'),
      d('prompt_huge_text', '--prompt=' + 'x' * 20000, message='exceeds the model context'),
      d('prompt_unicode', '--prompt=déf ƒ(ñ): 日本 🙂', expect='ok'),
      d('prompt_control_chars', '--prompt=\x01\x02\tx', expect='ok'),
      d('prompt_index_negative', '--config.prompt_set=gsm8k_test',
        '--config.prompt_index=-1', message='prompt_index'),
      d('prompt_index_huge', '--config.prompt_set=gsm8k_test',
        '--config.prompt_index=999999', message='prompt_index'),
      d('prompt_index_ok', '--config.prompt_set=gsm8k_test', '--config.prompt_index=3',
        expect='ok'),
      d('prompt_set_unknown', '--config.prompt_set=bogus', message='bogus'),
      d('prompt_set_data_dir_missing', '--config.prompt_set=gsm8k_test',
        '--config.data_dir=/nonexistent/data', message='/nonexistent'),
      # config plumbing
      d('unknown_config_key', '--config.bogus=1', message='unknown config field'),
      d('wrong_config_type', '--config.max_new_tokens=many', message='max_new_tokens'),
      d('config_missing', '--config=configs/no_such.py', message='not found'),
      d('config_not_python', '--config=README.md', expect='error'),
      d('config_bad_preset_arg', '--config=configs/tiny.py:bogus=1', message='bogus'),
      d('unknown_drafter', '--config.drafter=bogus', message='bogus'),
      d('mesh_bad_spec', '--config.mesh=bogus', message='mesh'),
      d('mesh_too_many_devices', '--config.mesh=data=3', message='device'),
      d('model_source_bogus', '--config.model.source=bogus', message='bogus'),
      d('model_zero_heads', '--config.model.shape.num_heads=0', message='num_heads'),
      d('model_kv_heads_not_divisor', '--config.model.shape.num_kv_heads=3',
        message='num_kv_heads'),
      d('model_zero_vocab', '--config.model.shape.vocab_size=0', message='vocab_size'),
      d('ngram_num_draft_zero', '--config.drafter=ngram',
        '--config.drafters.ngram.num_draft=0', message='num_draft'),
      d('ngram_num_draft_negative', '--config.drafter=ngram',
        '--config.drafters.ngram.num_draft=-3', message='num_draft'),
      d('ngram_ok', '--config.drafter=ngram', '--config.compare_ar=True', expect='ok'),
      d('suffix_ok', '--config.drafter=suffix', expect='ok'),
      d('mtp_path_missing', '--config.drafter=mtp', '--config.drafters.mtp.path=/nonexistent',
        message='/nonexistent'),
      d('mtp_path_is_a_target', '--config.drafter=mtp', '--config.drafters.mtp.path={sb}/ckpt',
        setup=with_ckpt(), message='target'),
      d('dflash_path_missing', '--config.drafter=dflash',
        '--config.drafters.dflash.path=/nonexistent', message='/nonexistent'),
      # controller and tree knobs: each in its range, checked before anything loads
      d('controller_profile_repeats_zero', '--config.drafter=ngram',
        '--config.controller.profile_repeats=0', message='controller.profile_repeats'),
      d('controller_profile_steps_zero', '--config.drafter=ngram',
        '--config.controller.profile_steps=0', message='controller.profile_steps'),
      d('controller_chunk_seconds_nan', '--config.controller.chunk_seconds=nan',
        message='controller.chunk_seconds'),
      d('controller_margin_negative', '--config.controller.margin=-1',
        message='controller.margin'),
      d('controller_prior_weight_inf', '--config.controller.prior_weight=inf',
        message='controller.prior_weight'),
      d('controller_probe_every_above_max', '--config.controller.probe_every=1024',
        message='controller.max_probe_every'),
      d('controller_shadow_warmup_negative', '--config.controller.shadow_warmup=-1',
        message='controller.shadow_warmup'),
      d('controller_removed_host_knob', '--config.controller.host_walk_tail=4',
        message='unknown config field controller.host_walk_tail'),
      d('controller_tiers_without_ar', '--config.controller.tiers=(1,3)',
        message='controller.tiers'),
      d('tree_top_k_huge', '--config.drafter=ngram', '--config.verify_length=tree',
        '--config.tree.top_k=1000000000', message='tree.top_k'),
      d('tree_num_nodes_huge', '--config.drafter=ngram', '--config.verify_length=tree',
        '--config.tree.num_nodes=100000', message='tree.num_nodes'),
      d('tree_ignores_dflash_denoise_steps', '--config.drafter=dflash',
        '--config.drafters.dflash.path=demo/dflash', '--config.verify_length=tree',
        '--config.drafters.dflash.denoise_steps=2', message='dflash.denoise_steps'),
      d('auto_tree_ignores_dspark_verify_budget', '--config.drafter=dspark',
        '--config.drafters.dspark.path=demo/dspark', '--config.verify_length=auto_tree',
        '--config.drafters.dspark.verify_budget=3', message='dspark.verify_budget'),
      d('distributed_timeout_nan', '--coordinator=127.0.0.1:9', '--num_processes=2',
        '--process_id=1', '--distributed_timeout=nan', message='--distributed_timeout',
        timeout=120),
      # checkpoints
      d('checkpoint_missing', '--config.model.source=checkpoint',
        '--config.model.path=/nonexistent/ckpt', message='/nonexistent/ckpt'),
      d('checkpoint_is_a_file', '--config.model.source=checkpoint',
        '--config.model.path={sb}/file', setup=lambda sb, fx: _write(f'{sb}/file', 'x'),
        message='file'),
      d('checkpoint_empty_dir', '--config.model.source=checkpoint',
        '--config.model.path={sb}/empty', setup=lambda sb, fx: os.makedirs(f'{sb}/empty'),
        message='{sb}/empty'),
      d('checkpoint_ok', *ckpt, setup=with_ckpt(), expect='ok'),
      d('checkpoint_old_without_checksums', *ckpt, setup=with_ckpt(src='target_old'),
        expect='ok', check=lambda sb, fx, p: None if 'not verified' in p.stderr
        else 'wrong: no "not verified" warning for a checkpoint without checksums'),
      d('checkpoint_flipped_byte', *ckpt, message='checksum',
        setup=with_ckpt(lambda p: _flip_byte(_largest_data_file(p)))),
      d('checkpoint_flipped_byte_early', *ckpt, message='ckpt',
        setup=with_ckpt(lambda p: _flip_byte(_largest_data_file(p), 0.1))),
      d('checkpoint_flipped_64_bytes', *ckpt, message='ckpt',
        setup=with_ckpt(lambda p: [_flip_byte(_largest_data_file(p), 0.3 + i / 200)
                                   for i in range(64)])),
      d('checkpoint_truncated_data', *ckpt, message='ckpt',
        setup=with_ckpt(lambda p: _truncate(_largest_data_file(p)))),
      d('checkpoint_no_metadata', *ckpt, message='ckpt',
        setup=with_ckpt(lambda p: shutil.rmtree(os.path.join(p, 'metadata')))),
      d('checkpoint_garbled_metadata', *ckpt, message='ckpt',
        setup=with_ckpt(lambda p: _write(os.path.join(p, 'metadata', 'metadata'), '{no'))),
      d('checkpoint_metadata_is_list', *ckpt, message='ckpt',
        setup=with_ckpt(lambda p: _write(os.path.join(p, 'metadata', 'metadata'), '[]'))),
      d('checkpoint_zero_heads', *ckpt, message='num_heads',
        setup=with_ckpt(edit_metadata(lambda m: m['config'].update(num_heads=0)))),
      d('checkpoint_vocab_text', *ckpt, message='vocab_size',
        setup=with_ckpt(edit_metadata(lambda m: m['config'].update(vocab_size='abc')))),
      d('checkpoint_rope_theta_nan', *ckpt, message='config.rope_theta',
        setup=with_ckpt(edit_metadata(lambda m: m['config'].update(rope_theta=math.nan)))),
      d('checkpoint_norm_eps_negative', *ckpt, message='config.norm_eps',
        setup=with_ckpt(edit_metadata(lambda m: m['config'].update(norm_eps=-1e-6)))),
      d('checkpoint_wrong_kind', *ckpt, message='mtp',
        setup=with_ckpt(edit_metadata(lambda m: m.update(kind='mtp')))),
      d('checkpoint_future_version', *ckpt, message='version',
        setup=with_ckpt(edit_metadata(lambda m: m.update(dspec_format_version=99)))),
      d('checkpoint_tampered_checksum', *ckpt, message='checksum',
        setup=with_ckpt(edit_metadata(lambda m: m['array_sha256'].update(
            embed_tokens='0' * 64)))),
      d('checkpoint_corrupt_tokenizer', *ckpt, message='tokenizer.json',
        setup=with_ckpt(lambda p: _write(os.path.join(p, 'tokenizer.json'), '{"trunc'))),
      d('checkpoint_garbled_tokenizer_config', *ckpt, '--config.model.tokenizer_dir={sb}/tok',
        message='tokenizer', setup=lambda sb, fx: (
            with_ckpt()(sb, fx), _write(f'{sb}/tok/tokenizer_config.json', '{bad'),
            shutil.copy(f'{REPO}/demo/tokenizer/tokenizer.json', f'{sb}/tok/'))),
      d('checkpoint_tokenizer_too_big', *ckpt, '--config.model.tokenizer_dir=demo/tokenizer',
        setup=with_ckpt(), message='tokenizer'),
      d('tokenizer_dir_missing', '--config.model.tokenizer_dir=/nonexistent/tok',
        message='/nonexistent/tok'),
      # Hugging Face sources
      d('hf_ok', *hf, setup=hf_setup(), expect='ok'),
      d('hf_config_list', *hf, message='JSON object',
        setup=hf_setup(lambda h: _write(os.path.join(h, 'config.json'), '[]'))),
      d('hf_vocab_text', *hf, message='vocab_size', setup=hf_setup(hf_config(vocab_size='abc'))),
      d('hf_zero_heads', *hf, message='num_attention_heads',
        setup=hf_setup(hf_config(num_attention_heads=0))),
      d('hf_zero_kv_heads', *hf, message='num_key_value_heads',
        setup=hf_setup(hf_config(num_key_value_heads=0))),
      d('hf_rms_norm_eps_above_one', *hf, message='rms_norm_eps',
        setup=hf_setup(hf_config(rms_norm_eps=2.0))),
      d('hf_safetensors_missing', *hf, message='safetensors',
        setup=hf_setup(lambda h: os.remove(os.path.join(h, 'model.safetensors')))),
      d('hf_safetensors_truncated', *hf, message='safetensors',
        setup=hf_setup(lambda h: _truncate(os.path.join(h, 'model.safetensors')))),
      d('hf_corrupt_tokenizer', *hf, message='tokenizer.json',
        setup=hf_setup(lambda h: _write(os.path.join(h, 'tokenizer.json'), '{"x": [1,'))),
      # output paths
      d('metrics_to_dev_null', '--metrics_json=/dev/null', expect='ok', metrics=False,
        check=lambda sb, fx, p: None if stat.S_ISCHR(os.lstat('/dev/null').st_mode)
        else 'data loss: /dev/null was replaced'),
      d('metrics_to_char_device', '--metrics_json={sb}/node', expect='ok', metrics=False,
        setup=char_device,
        check=still_char_device),
      d('metrics_through_symlink', '--metrics_json={sb}/link.json', message='symlink',
        metrics=False, setup=link_setup, check=link_kept),
      d('metrics_to_directory', '--metrics_json={sb}/keep', message='directory',
        setup=lambda sb, fx: _plant(sb), check=_planted_intact()),
      d('metrics_new_parent_dir', '--metrics_json={sb}/a/b/m.json', expect='ok', metrics=False,
        check=lambda sb, fx, p: None if os.path.isfile(f'{sb}/a/b/m.json')
        else 'wrong: metrics not written'),
      d('metrics_refuses_a_foreign_file', message='not written by dspec', metrics=False,
        setup=lambda sb, fx: _write(f'{sb}/m.json', 'old'), check=lambda sb, fx, p: None
        if open(f'{sb}/m.json').read() == 'old' else 'data loss: m.json was replaced'),
  ]
  return cases


def train_cases() -> list:
  base = ['scripts/train.py', '--config=configs/demo_target_v2.py:quick', '--workdir={sb}/run']

  def t(name, *args, expect='error', message='', setup=None, check=None, **kw):
    return Case(name, 'train', base + list(args), expect, message, setup, check, **kw)

  def bad(field, value, message=None):
    return t(f'{field.replace(".", "_")}_{value}'.replace('-', 'neg'),
             f'--config.training.{field}={value}', message=message or field)

  def copy_run(damage=None):
    def setup(sb, fx):
      _copy(os.path.join(fx, 'run4'), os.path.join(sb, 'run'))
      if damage:
        damage(os.path.join(sb, 'run'))
    return setup

  def final_unchanged(sb, fx, proc):
    a = os.path.join(fx, 'run4', 'final', 'metadata', 'metadata')
    b = os.path.join(sb, 'run', 'final', 'metadata', 'metadata')
    return None if os.path.exists(b) and _sha(a) == _sha(b) else \
        'data loss: final/ was rewritten or removed'

  def log_clean(sb, fx, proc):
    path = os.path.join(sb, 'run', 'train_log.jsonl')
    if not os.path.exists(path):
      return None
    try:
      steps = [_strict_json_line(line)['step'] for line in open(path)]
    except ValueError as e:
      return f'wrong: train_log.jsonl: {e}'
    if steps != sorted(set(steps)):
      return f'wrong: train_log.jsonl steps repeat or go back: {steps}'
    return None

  def final_at(step):
    def check(sb, fx, proc):
      if proc.returncode != 0:
        return None
      meta = os.path.join(sb, 'run', 'final', 'metadata', 'metadata')
      got = json.load(open(meta)).get('extra', {}).get('train_step')
      return None if got == step else f'wrong: final/ is at step {got}, expected {step}'
    return check

  def ckpt_file(step):
    return lambda run: _largest_data_file(os.path.join(run, 'checkpoints', str(step)))

  def strip_checksums(run):
    for root, _, names in os.walk(run):
      if os.path.basename(root) == 'metadata' and 'metadata' in names:
        path = os.path.join(root, 'metadata')
        data = json.load(open(path))
        data.pop('array_sha256', None)
        _write(path, json.dumps(data))

  def append_log(run):
    _write(os.path.join(run, 'train_log.jsonl'),
           '{"step": 5, "loss": 9.0}\n{"step": 6, "loss": 9.0}\n{"step": 7, "lo', 'a')

  return [
      Case('no_config', 'train', ['scripts/train.py', '--workdir={sb}/run'], message='config'),
      t('config_missing', '--config=configs/no_such.py', message='not found'),
      bad('ckpt_every', 0), bad('log_every', 0), bad('eval_every', 0),
      bad('export_every', -1), bad('learning_rate', 'nan'), bad('learning_rate', 'inf'),
      bad('learning_rate', -1.0), bad('num_steps', 0), bad('num_steps', -5),
      bad('num_steps', 3000000000), bad('seed', 2147483648), bad('seed', -1),
      bad('batch_size', 0), bad('seq_len', 0), bad('warmup_ratio', 2.0), bad('b1', 1.5),
      bad('b2', 'nan'), bad('grad_clip', 0.0), bad('weight_decay', 'nan'),
      bad('max_minutes', -1.0), bad('max_minutes', 'nan'), bad('decay_ratio', 0.0),
      bad('storage_dtype', 'float16'), bad('mixture.gsm8k', 0.0, 'mixture'),
      bad('mixture.gsm8k', 'nan', 'mixture'), bad('schedule', 'bogus', 'schedule'),
      bad('task', 'bogus', 'bogus'),
      t('unknown_training_key', '--config.training.bogus=1', message='unknown config field'),
      t('data_dir_missing', '--config.data_dir=/nonexistent/data', message='/nonexistent'),
      t('init_from_missing', '--config.training.init_from=/nonexistent/ckpt',
        message='/nonexistent/ckpt'),
      t('init_from_a_file', '--config.training.init_from={sb}/file',
        setup=lambda sb, fx: _write(f'{sb}/file', 'x'), message='file'),
      t('init_from_other_shape', '--config.training.init_from={fx}/target',
        message='shape'),
      t('init_from_bad_train_step', '--config.training.init_from={sb}/init',
        '--config.training.continue_from_init=True', message='train_step',
        setup=lambda sb, fx: (copy_run()(sb, fx), shutil.copytree(
            f'{sb}/run/final', f'{sb}/init'), _edit_json(
                f'{sb}/init/metadata/metadata', lambda m: m['extra'].update(train_step=-1)),
            shutil.rmtree(f'{sb}/run'))),
      t('tokenizer_dir_missing', '--config.model.tokenizer_dir=/nonexistent/tok',
        message='/nonexistent/tok'),
      t('tokenizer_corrupt', '--config.model.tokenizer_dir={sb}/tok', message='tokenizer.json',
        setup=lambda sb, fx: _write(f'{sb}/tok/tokenizer.json', '{"broken')),
      Case('workdir_is_a_file', 'train', base[:2] + ['--workdir={sb}/file'],
           setup=lambda sb, fx: _write(f'{sb}/file', 'keep'), message='file',
           check=lambda sb, fx, p: None if open(f'{sb}/file').read() == 'keep'
           else 'data loss: the file was changed'),
      Case('workdir_unwritable', 'train', base[:2] + ['--workdir=/proc/dspec_redteam'],
           message='/proc/dspec_redteam'),
      t('fresh_run', expect='ok', check=_all(log_clean, final_at(4))),
      t('rerun_finished_is_a_no_op', expect='ok', setup=copy_run(),
        check=_all(final_unchanged, log_clean)),
      t('resume_past_num_steps', '--config.training.num_steps=2', setup=copy_run(),
        message='nothing to train', check=final_unchanged),
      t('resume_extends', '--config.training.num_steps=6', setup=copy_run(), expect='ok',
        check=_all(log_clean, final_at(6))),
      t('resume_latest_checkpoint_flipped', '--config.training.num_steps=6', expect='ok',
        setup=copy_run(lambda r: _flip_byte(ckpt_file(4)(r))),
        check=_all(log_clean, final_at(6), lambda sb, fx, p: None if os.path.isdir(
            f'{sb}/run/checkpoints/corrupt_4') else 'wrong: damaged step not kept aside',
            lambda sb, fx, p: None if 'resuming from the older intact checkpoint' in p.stderr
            else 'wrong: no fallback warning')),
      t('resume_latest_checkpoint_truncated', '--config.training.num_steps=6', expect='ok',
        setup=copy_run(lambda r: _truncate(ckpt_file(4)(r))),
        check=_all(log_clean, final_at(6))),
      t('resume_latest_checkpoint_no_metadata', '--config.training.num_steps=6',
        expect='ok', setup=copy_run(lambda r: shutil.rmtree(
            os.path.join(r, 'checkpoints', '4', 'metadata'))),
        check=_all(log_clean, final_at(6))),
      t('resume_every_checkpoint_damaged', '--config.training.num_steps=6',
        message='no intact checkpoint',
        setup=copy_run(lambda r: (_flip_byte(ckpt_file(4)(r)), _flip_byte(ckpt_file(2)(r)))),
        check=final_unchanged),
      t('resume_old_checkpoints_without_checksums', '--config.training.num_steps=6',
        expect='ok', setup=copy_run(strip_checksums), check=_all(log_clean, final_at(6))),
      t('resume_trims_duplicate_log_lines', '--config.training.num_steps=6', expect='ok',
        setup=copy_run(append_log), check=_all(log_clean, final_at(6))),
      t('second_trainer_on_workdir', message='another trainer', setup=_hold_lock(
          'run', 'trainer'), check=_release),
      t('huge_learning_rate', '--config.training.learning_rate=1e30', expect='either',
        message='non-finite', check=log_clean),
  ]


def _strict_json_line(line):
  if not line.endswith('\n'):
    raise ValueError(f'torn line {line!r}')
  return json.loads(line, parse_constant=_refuse_constant)


def _edit_json(path, fn):
  data = json.load(open(path))
  fn(data)
  _write(path, json.dumps(data))


def distill_cases() -> list:
  base = ['scripts/distill.py', '--config=configs/distill_demo.py:tiny', '--out_dir={sb}/d']

  def x(name, *args, expect='error', message='', setup=None, check=None, **kw):
    return Case(name, 'distill', base + list(args), expect, message, setup, check, **kw)

  def copy_set(damage=None):
    def setup(sb, fx):
      _copy(os.path.join(fx, 'distill'), os.path.join(sb, 'd'))
      if damage:
        damage(os.path.join(sb, 'd'))
    return setup

  def shards_unchanged(sb, fx, proc):
    for name in os.listdir(os.path.join(fx, 'distill')):
      if name.startswith('shard_') and _sha(os.path.join(fx, 'distill', name)) != _sha(
          os.path.join(sb, 'd', name)):
        return f'data loss: {name} changed'
    return None

  def complete(sb, fx, proc):
    if proc.returncode != 0:
      return None
    manifest = json.load(open(os.path.join(sb, 'd', 'manifest.json')))
    if not manifest.get('complete') or len(manifest.get('target_sha256', '')) != 64:
      return 'wrong: manifest incomplete or without target_sha256'
    return None

  def drop_last_shard(d):
    manifest = json.load(open(os.path.join(d, 'manifest.json')))
    os.remove(os.path.join(d, manifest['shards'][-1]))
    manifest.update(shards=manifest['shards'][:-1], complete=False)
    _write(os.path.join(d, 'manifest.json'), json.dumps(manifest))

  return [
      Case('no_config', 'distill', ['scripts/distill.py', '--out_dir={sb}/d'],
           message='config'),
      Case('no_out_dir', 'distill', base[:2], message='out_dir'),
      Case('empty_out_dir', 'distill', base[:2] + ['--out_dir='], message='out_dir'),
      x('fresh', expect='ok', check=complete),
      x('rerun_complete', expect='ok', setup=copy_set(), check=_all(complete,
                                                                    shards_unchanged)),
      x('resume_after_kill', expect='ok', setup=copy_set(drop_last_shard), check=complete),
      x('resume_other_target_seed', '--config.model.seed=1', message='other target weights',
        setup=copy_set(), check=shards_unchanged),
      x('resume_other_settings', '--config.distill.max_new_tokens=5',
        message='other settings', setup=copy_set(), check=shards_unchanged),
      x('resume_old_manifest', expect='ok', warning='older dspec', setup=copy_set(
          lambda d: _edit_json(os.path.join(d, 'manifest.json'),
                               lambda m: (m.pop('target_sha256'), m.pop('tokenizer_sha256')))),
        check=_all(complete, shards_unchanged)),
      x('manifest_garbled', message='manifest.json',
        setup=copy_set(lambda d: _write(os.path.join(d, 'manifest.json'), '{no'))),
      x('manifest_list', message='manifest.json',
        setup=copy_set(lambda d: _write(os.path.join(d, 'manifest.json'), '[]'))),
      x('listed_shard_damaged', message='damaged shard', setup=copy_set(lambda d: (
          drop_last_shard(d), _write(os.path.join(d, 'shard_00000.npz'), 'garbage')))),
      x('out_dir_is_a_file', message='d', setup=lambda sb, fx: _write(f'{sb}/d', 'keep'),
        check=lambda sb, fx, p: None if open(f'{sb}/d').read() == 'keep'
        else 'data loss: the file was changed'),
      x('batch_size_zero', '--config.distill.batch_size=0', message='distill.batch_size'),
      x('max_new_tokens_zero', '--config.distill.max_new_tokens=0',
        message='distill.max_new_tokens'),
      x('shard_size_negative', '--config.distill.shard_size=-1', message='distill.shard_size'),
      x('prompt_limit_negative', '--config.distill.prompt_sets.gsm8k_train=-1',
        message='gsm8k_train'),
      x('temperature_nan', '--config.temperature=nan', message='temperature'),
      x('top_p_above_one', '--config.top_p=2', message='top_p'),
      x('seed_int32_overflow', '--config.seed=2147483648', message='seed'),
      x('second_distiller', message='another distillation',
        setup=_hold_lock('d', 'distillation'), check=_release),
  ]


def convert_cases() -> list:
  conv = [f'{REPO}/scripts/convert_hf.py']

  def c(name, *args, expect='error', message='', setup=None, check=None, cwd='sb'):
    return Case(name, 'convert_hf', conv + list(args), expect, message, setup, check,
                cwd=cwd)

  def hf(edit=None, rel='hf'):
    def setup(sb, fx):
      _plant(sb)
      _copy(os.path.join(fx, 'hf'), os.path.join(sb, rel))
      if edit:
        edit(os.path.join(sb, rel))
    return setup

  def hf_config(**changes):
    return lambda h: _edit_json(os.path.join(h, 'config.json'), lambda m: m.update(changes))

  def tensors(fn):
    def edit(h):
      from safetensors.numpy import load_file, save_file
      path = os.path.join(h, 'model.safetensors')
      save_file(fn(load_file(path)), path, metadata={'format': 'pt'})
    return edit

  def nan_tensor(ts):
    name = sorted(ts)[0]
    ts[name] = ts[name].copy()
    ts[name].flat[0] = float('nan')
    return ts

  def wrong_shape(ts):
    name = sorted(k for k in ts if k.endswith('up_proj.weight'))[0]
    ts[name] = ts[name][:, :3].copy()
    return ts

  def ckpt_loads(sb, fx, proc):
    out = os.path.join(sb, 'out')
    if proc.returncode == 0 and not os.path.isdir(os.path.join(out, 'state')):
      return 'wrong: no checkpoint written'
    return None

  src = ['--hf_dir={sb}/hf']
  keep = _planted_intact()
  return [
      c('no_hf_dir', '--out={sb}/out', message='hf_dir'),
      c('no_out', *src, setup=hf(), message='out'),
      c('hf_dir_missing', '--hf_dir={sb}/nope', '--out={sb}/out', message='nope'),
      c('out_empty_force', *src, '--out=', '--force', setup=hf(), message='empty',
        check=keep),
      c('out_dot_force', *src, '--out=.', '--force', setup=hf(), message='refusing',
        check=keep),
      Case('out_parent_force', 'convert_hf', conv + ['--hf_dir={sb}/hf', '--out=..',
                                                     '--force'],
           setup=lambda sb, fx: (hf()(sb, fx), os.makedirs(f'{sb}/sub')), message='refusing',
           check=keep, cwd='sb/sub'),
      c('out_user_dir_force', *src, '--out=keep', '--force', setup=hf(),
        message='not a dspec checkpoint', check=keep),
      c('out_user_dir', *src, '--out=keep', setup=hf(), message='did not write',
        check=keep),
      c('out_regular_file_force', *src, '--out=keep/thesis.tex', '--force', setup=hf(),
        message='not a directory', check=keep),
      c('out_symlink_to_user_dir_force', *src, '--out=link', '--force',
        setup=lambda sb, fx: (hf()(sb, fx), os.symlink(f'{sb}/keep', f'{sb}/link')),
        message='symlink', check=keep),
      c('out_checkpoint_with_user_file_force', *src, '--out=out', '--force',
        setup=lambda sb, fx: (hf()(sb, fx), _copy(f'{fx}/target', f'{sb}/out'),
                              _plant(sb, 'out/notes.txt', 'mine')),
        message='notes.txt', check=_planted_intact('out/notes.txt', 'mine')),
      c('out_checkpoint_force', *src, '--out=out', '--force', expect='ok',
        setup=lambda sb, fx: (hf()(sb, fx), _copy(f'{fx}/target', f'{sb}/out')),
        check=_all(keep, ckpt_loads)),
      c('out_checkpoint_no_force', *src, '--out=out', message='already exists',
        setup=lambda sb, fx: (hf()(sb, fx), _copy(f'{fx}/target', f'{sb}/out'))),
      c('ok', *src, '--out=out', expect='ok', setup=hf(), check=_all(keep, ckpt_loads)),
      c('ok_bfloat16', *src, '--out=out', '--storage_dtype=bfloat16', expect='ok',
        setup=hf(), check=ckpt_loads),
      c('ok_new_parent_dirs', *src, '--out=a/b/out', expect='ok', setup=hf()),
      c('storage_dtype_float16', *src, '--out=out', '--storage_dtype=float16', setup=hf(),
        message='storage_dtype'),
      c('config_list', *src, '--out=out', message='JSON object',
        setup=hf(lambda h: _write(os.path.join(h, 'config.json'), '[]'))),
      c('config_garbled', *src, '--out=out', message='config.json',
        setup=hf(lambda h: _write(os.path.join(h, 'config.json'), '{"model_type": '))),
      c('config_missing', *src, '--out=out', message='config.json',
        setup=hf(lambda h: os.remove(os.path.join(h, 'config.json')))),
      c('config_vocab_text', *src, '--out=out', message='vocab_size',
        setup=hf(hf_config(vocab_size='abc'))),
      c('config_zero_heads', *src, '--out=out', message='num_attention_heads',
        setup=hf(hf_config(num_attention_heads=0))),
      c('config_zero_kv_heads', *src, '--out=out', message='num_key_value_heads',
        setup=hf(hf_config(num_key_value_heads=0))),
      c('config_negative_layers', *src, '--out=out', message='num_hidden_layers',
        setup=hf(hf_config(num_hidden_layers=-2))),
      c('config_hidden_not_multiple', *src, '--out=out', message='hidden_size',
        setup=hf(hf_config(hidden_size=65, head_dim=None))),
      c('config_model_type_gpt2', *src, '--out=out', message='gpt2',
        setup=hf(hf_config(model_type='gpt2'))),
      c('config_rope_yarn', *src, '--out=out', message='yarn',
        setup=hf(hf_config(rope_scaling={'rope_type': 'yarn', 'factor': 4.0}))),
      c('config_rope_theta_text', *src, '--out=out', message='rope_theta',
        setup=hf(hf_config(rope_theta='big'))),
      c('safetensors_missing', *src, '--out=out', message='safetensors',
        setup=hf(lambda h: os.remove(os.path.join(h, 'model.safetensors')))),
      c('safetensors_truncated', *src, '--out=out', message='safetensors',
        setup=hf(lambda h: _truncate(os.path.join(h, 'model.safetensors')))),
      c('safetensors_garbage', *src, '--out=out', message='safetensors',
        setup=hf(lambda h: _write(os.path.join(h, 'model.safetensors'), 'garbage'))),
      c('tensor_missing', *src, '--out=out', message='missing',
        setup=hf(tensors(lambda ts: {k: v for i, (k, v) in enumerate(sorted(ts.items()))
                                     if i}))),
      c('tensor_wrong_shape', *src, '--out=out', message='shape',
        setup=hf(tensors(wrong_shape))),
      c('tensor_nan', *src, '--out=out', message='non-finite', setup=hf(tensors(nan_tensor)),
        check=lambda sb, fx, p: None if not os.path.exists(f'{sb}/out')
        else 'wrong: a NaN checkpoint was written'),
      c('index_garbled', *src, '--out=out', message='index',
        setup=hf(lambda h: _write(os.path.join(h, 'model.safetensors.index.json'), '{x'))),
      c('corrupt_tokenizer_copied', *src, '--out=out', expect='ok',
        setup=hf(lambda h: _write(os.path.join(h, 'tokenizer.json'), '{"x'))),
  ]


def bench_cases() -> list:
  b = ['scripts/benchmark.py']
  return [
      Case('no_out_dir', 'benchmark', b + ['--config=configs/bench_tiny.py'],
           message='out_dir'),
      Case('config_missing', 'benchmark', b + ['--config=configs/no_such.py',
                                               '--out_dir={sb}/o'], message='not found'),
      Case('render_missing', 'benchmark', b + ['--render={sb}/nope'], message='nope'),
      Case('unknown_key', 'benchmark', b + ['--config=configs/bench_tiny.py',
                                            '--config.bogus=1', '--out_dir={sb}/o'],
           message='unknown config field'),
      Case('out_dir_is_a_file', 'benchmark', b + ['--config=configs/bench_tiny.py',
                                                  '--out_dir={sb}/file'],
           setup=lambda sb, fx: _write(f'{sb}/file', 'keep'), message='file',
           check=lambda sb, fx, p: None if open(f'{sb}/file').read() == 'keep'
           else 'data loss: the file was changed'),
      Case('out_dir_dev_null', 'benchmark', b + ['--config=configs/bench_tiny.py',
                                                 '--out_dir=/dev/null'], message='/dev/null',
           check=lambda sb, fx, p: None if stat.S_ISCHR(os.lstat('/dev/null').st_mode)
           else 'data loss: /dev/null was replaced'),
      Case('num_prompts_zero', 'benchmark', b + ['--config=configs/bench_tiny.py',
                                                 '--config.bench.num_prompts=0',
                                                 '--out_dir={sb}/o'], message='num_prompts'),
  ]


def api_cases() -> list:
  def a(name, code, expect='error', message='', setup=None, check=None):
    return Case(name, 'api', _api(code), expect, message, setup, check)

  load = textwrap.dedent('''
      from flax import nnx
      from configs import common
      from dspec import checkpoint
      from dspec.models.config import TransformerConfig
      from dspec.models.transformer import Transformer
      cfg = TransformerConfig(**common.MODEL_PRESETS['tiny'])
      model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(1)))
      ''')

  def ckpt(damage=None):
    def setup(sb, fx):
      _copy(os.path.join(fx, 'target'), os.path.join(sb, 'ckpt'))
      if damage:
        damage(os.path.join(sb, 'ckpt'))
    return setup

  return [
      a('load_flipped_checkpoint', load + f"checkpoint.load_model_state('{{sb}}/ckpt', "
        "model, 'target')", message='checksum',
        setup=ckpt(lambda p: _flip_byte(_largest_data_file(p)))),
      a('load_checkpoint_ok', load + "checkpoint.load_model_state('{sb}/ckpt', model, "
        "'target')", expect='ok', setup=ckpt()),
      a('load_wrong_kind', load + "checkpoint.load_model_state('{sb}/ckpt', model, 'mtp')",
        message='mtp', setup=ckpt()),
      a('read_train_step_not_a_checkpoint',
        "from dspec import checkpoint\ncheckpoint.read_train_step('{sb}')", message='{sb}'),
      a('save_nan_weights', '''
          import jax.numpy as jnp
          from flax import nnx
          from dspec import checkpoint
          model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
          model.kernel[...] = model.kernel[...].at[0, 0].set(jnp.nan)
          checkpoint.save_model('{sb}/nan', model, kind='toy', config={})''',
        message='non-finite',
        check=lambda sb, fx, p: None if not os.path.exists(f'{sb}/nan')
        else 'wrong: a NaN checkpoint was written'),
      a('save_storage_dtype_float16', '''
          from flax import nnx
          from dspec import checkpoint
          checkpoint.save_model('{sb}/x', nnx.Linear(2, 2, rngs=nnx.Rngs(0)), kind='toy',
                                config={}, storage_dtype='float16')''', message='float16'),
      a('save_tree_empty_path_force', '''
          import numpy as np
          from dspec import checkpoint
          checkpoint.save_tree('', {'a': np.zeros(2)}, {}, force=True)''', message='empty'),
      a('save_tree_user_dir_force', '''
          import numpy as np
          from dspec import checkpoint
          checkpoint.save_tree('{sb}/keep', {'a': np.zeros(2)}, {}, force=True)''',
        message='not a dspec checkpoint', setup=lambda sb, fx: _plant(sb),
        check=_planted_intact()),
      a('write_json_through_symlink', '''
          from dspec import files
          files.write_json_atomic('{sb}/link.json', {'a': 1})''', message='symlink',
        setup=lambda sb, fx: (_write(f'{sb}/real.json', 'old'),
                              os.symlink(f'{sb}/real.json', f'{sb}/link.json')),
        check=lambda sb, fx, p: None if os.path.islink(f'{sb}/link.json') and open(
            f'{sb}/real.json').read() == 'old' else 'data loss: symlink or its file changed'),
      a('write_json_to_char_device', '''
          from dspec import files
          files.write_json_atomic('{sb}/node', {'a': 1})''', expect='ok',
        setup=lambda sb, fx: os.mknod(f'{sb}/node', stat.S_IFCHR | 0o666, os.makedev(1, 3)),
        check=lambda sb, fx, p: None if stat.S_ISCHR(os.lstat(f'{sb}/node').st_mode)
        else 'data loss: device node replaced'),
      a('write_json_to_directory', '''
          from dspec import files
          files.write_json_atomic('{sb}/keep', {'a': 1})''', message='directory',
        setup=lambda sb, fx: _plant(sb), check=_planted_intact()),
      a('write_text_to_fifo', '''
          import os, threading
          from dspec import files
          threading.Thread(target=lambda: open('{sb}/fifo').read(), daemon=True).start()
          files.write_text_atomic('{sb}/fifo', 'hello')''', expect='ok',
        setup=lambda sb, fx: os.mkfifo(f'{sb}/fifo'),
        check=lambda sb, fx, p: None if stat.S_ISFIFO(os.lstat(f'{sb}/fifo').st_mode)
        else 'data loss: fifo replaced'),
      a('load_distilled_missing', '''
          from dspec.training.distill import load_distilled
          load_distilled('{sb}/nope')''', message='nope'),
      a('load_tokenizer_corrupt', '''
          from dspec.tokenizer import load_tokenizer
          load_tokenizer('{sb}/tok', 300)''', message='tokenizer.json',
        setup=lambda sb, fx: _write(f'{sb}/tok/tokenizer.json', '{"v')),
      a('config_from_hf_list', '''
          from dspec.models.formats.hf_config import config_from_hf
          config_from_hf([])''', message='JSON object'),
      a('transformer_config_zero_heads', '''
          from dspec.models.config import TransformerConfig
          TransformerConfig(vocab_size=8, num_layers=1, embed_dim=8, num_heads=0,
                            num_kv_heads=0, head_dim=4, mlp_dim=8)''', message='num_heads'),
      a('train_checkpointer_flipped_step', '''
          import numpy as np
          from dspec import checkpoint
          ckpt = checkpoint.TrainCheckpointer('{sb}/run/checkpoints')
          step = ckpt.latest_step()
          tree, _ = checkpoint.load_tree('{sb}/run/checkpoints/%d' % step)
          ckpt.restore(step, tree)''', message='corrupt',
        setup=lambda sb, fx: (_copy(f'{fx}/run4', f'{sb}/run'), _flip_byte(
            _largest_data_file(f'{sb}/run/checkpoints/4')))),
      a('directory_lock_held_elsewhere', '''
          from dspec import files
          with files.directory_lock('{sb}/run', 'trainer'):
            pass''', message='another trainer', setup=_hold_lock('run', 'trainer'),
        check=_release),
  ]


# ------------------------------------------------------------- issue 39: round-3 classes

_SNAPSHOTS: dict = {}


def _digest(path) -> dict:
  """{relative name: sha256 or 'dir' or 'link->target'} of everything under `path`."""
  out = {}
  for root, dirs, names in os.walk(path):
    for n in dirs + names:
      p = os.path.join(root, n)
      rel = os.path.relpath(p, path)
      if os.path.islink(p):
        out[rel] = 'link->' + os.readlink(p)
      elif os.path.isdir(p):
        out[rel] = 'dir'
      else:
        out[rel] = _sha(p)
  return out


def _snapshot(*rels):
  """setup step: remember the content of sb/rel (a file or a tree) for `_unchanged`."""
  def setup(sb, fx):
    for rel in rels:
      path = os.path.join(sb, rel)
      _SNAPSHOTS[sb, rel] = _digest(path) if os.path.isdir(path) else _sha(path)
  return setup


def _unchanged(*rels):
  """check: sb/rel still holds what `_snapshot` saw (data loss otherwise)."""
  def check(sb, fx, proc):
    for rel in rels:
      path = os.path.join(sb, rel)
      if not os.path.lexists(path):
        return f'data loss: {rel} was deleted'
      now = _digest(path) if os.path.isdir(path) else _sha(path)
      if now != _SNAPSHOTS.pop((sb, rel)):
        return f'data loss: {rel} was changed'
    return None
  return check


def _steps(*fns):
  def setup(sb, fx):
    for fn in fns:
      fn(sb, fx)
  return setup


def _absent(rel):
  def check(sb, fx, proc):
    return f'wrong: {rel} was written' if os.path.lexists(os.path.join(sb, rel)) else None
  return check


def _file_mode(rel, mode=None):
  """check: sb/rel has `mode` (None: what the umask gives a new file)."""
  def check(sb, fx, proc):
    if proc.returncode != 0:
      return None
    umask = os.umask(0o022)
    os.umask(umask)
    want = 0o666 & ~umask if mode is None else mode
    got = stat.S_IMODE(os.stat(os.path.join(sb, rel)).st_mode)
    return None if got == want else f'wrong: {rel} has mode {got:o}, expected {want:o}'
  return check


def _no_leftovers(rel):
  """check: no `.lock` or temporary file left in sb/rel after the run."""
  def check(sb, fx, proc):
    path = os.path.join(sb, rel)
    if not os.path.isdir(path):
      return None
    left = [n for n in os.listdir(path) if n == '.lock' or '.tmp' in n or 'dspec-new' in n]
    return f'leftover: {left} in {rel}' if left else None
  return check


def _marked_json(rel, kind='decode metrics'):
  return lambda sb, fx: _write(os.path.join(sb, rel), json.dumps({'dspec_output': kind}))


def _link(target_rel, link_rel):
  return lambda sb, fx: os.symlink(os.path.join(sb, target_rel), os.path.join(sb, link_rel))


def _planted(rel='keep/thesis.tex', text='years of work'):
  return lambda sb, fx: _plant(sb, rel, text)


def output_cases() -> list:
  """The output-path policy, script by script: foreign files refused unless --force, dspec's
  own replaced, symlinks refused, one path per output, no output inside an input."""
  decode = [f'{REPO}/scripts/decode.py', f'--config={REPO}/configs/tiny.py',
            '--config.max_new_tokens=4', '--config.timing_repeats=0', '--quiet']
  ckpt = ['--config.model.source=checkpoint', '--config.model.path={sb}/ckpt']

  def o(name, *args, expect='error', message='', setup=None, check=None, base=decode,
        cwd='sb', **kw):
    return Case(name, 'outputs', base + list(args), expect, message, setup, check, cwd=cwd,
                **kw)

  def copy_fx(src, dst):
    return lambda sb, fx: _copy(os.path.join(fx, src), os.path.join(sb, dst))

  def copy_demo(src, dst):
    return lambda sb, fx: _copy(os.path.join(REPO, 'demo', src), os.path.join(sb, dst))

  def metrics_written(rel='m.json'):
    def check(sb, fx, proc):
      if proc.returncode != 0:
        return None
      try:
        report = _strict_json(os.path.join(sb, rel))
      except (OSError, ValueError) as e:
        return f'wrong: {rel}: {e}'
      return None if report.get('output_ids') else f'wrong: {rel} holds no output_ids'
    return check

  export = [f'{REPO}/scripts/export_drafter.py', '--path={sb}/in']
  train = [f'{REPO}/scripts/train.py', f'--config={REPO}/configs/demo_target_v2.py:quick']
  conv = [f'{REPO}/scripts/convert_hf.py']
  distill = [f'{REPO}/scripts/distill.py', f'--config={REPO}/configs/distill_demo.py:tiny']
  bench = [f'{REPO}/scripts/benchmark.py', f'--config={REPO}/configs/bench_tiny.py:nohf,t0',
           '--config.bench.datasets=("humaneval",)', '--config.bench.batch_sizes=(1,)']
  exported = lambda rel: lambda sb, fx, p: None if p.returncode or os.path.isfile(
      os.path.join(sb, rel, 'model.safetensors')) else f'wrong: no export in {rel}'
  return [
      # decode --metrics_json / --trace_json
      o('metrics_foreign_file', '--metrics_json=m.json', message='not written by dspec',
        setup=_steps(_planted('m.json'), _snapshot('m.json')), check=_unchanged('m.json')),
      o('metrics_foreign_json_object', '--metrics_json=m.json', message='not written by dspec',
        setup=_steps(lambda sb, fx: _write(f'{sb}/m.json', '{"tau": 9}'), _snapshot('m.json')),
        check=_unchanged('m.json')),
      o('metrics_foreign_file_force', '--metrics_json=m.json', '--force', expect='ok',
        setup=_planted('m.json'), check=metrics_written()),
      o('metrics_own_file_replaced', '--metrics_json=m.json', expect='ok',
        setup=_marked_json('m.json'), check=metrics_written()),
      o('metrics_rerun_replaces_own', '--metrics_json=a/m.json', expect='ok',
        setup=_marked_json('a/m.json'), check=_all(metrics_written('a/m.json'),
                                                    _no_leftovers('a'))),
      o('metrics_symlink_to_file', '--metrics_json=link.json', message='symlink',
        setup=_steps(_planted('real.json'), _link('real.json', 'link.json'),
                     _snapshot('real.json')), check=_unchanged('real.json')),
      o('metrics_symlink_to_own_file', '--metrics_json=link.json', message='symlink',
        setup=_steps(_marked_json('real.json'), _link('real.json', 'link.json'),
                     _snapshot('real.json')), check=_unchanged('real.json')),
      o('metrics_symlink_force', '--metrics_json=link.json', '--force', message='symlink',
        setup=_steps(_planted('real.json'), _link('real.json', 'link.json'),
                     _snapshot('real.json')), check=_unchanged('real.json')),
      o('metrics_dangling_symlink', '--metrics_json=link.json', message='symlink',
        setup=_link('nowhere.json', 'link.json'), check=_absent('nowhere.json')),
      o('metrics_symlink_to_dir', '--metrics_json=link', message='symlink',
        setup=_steps(_planted(), _link('keep', 'link'), _snapshot('keep')),
        check=_unchanged('keep')),
      o('trace_symlink_to_file', '--trace_json=link.json', message='symlink',
        setup=_steps(_planted('real.json'), _link('real.json', 'link.json'),
                     _snapshot('real.json')), check=_unchanged('real.json')),
      o('trace_foreign_file', '--trace_json=t.json', message='not written by dspec',
        setup=_steps(_planted('t.json'), _snapshot('t.json')), check=_unchanged('t.json')),
      o('metrics_equals_trace', '--metrics_json=m.json', '--trace_json=m.json',
        message='same file', check=_absent('m.json')),
      o('metrics_equals_trace_dot_slash', '--metrics_json=m.json', '--trace_json=./m.json',
        message='same file', check=_absent('m.json')),
      o('metrics_equals_trace_absolute', '--metrics_json=m.json', '--trace_json={sb}/m.json',
        message='same file', check=_absent('m.json')),
      o('metrics_equals_trace_via_dir_link', '--metrics_json=d/m.json',
        '--trace_json=l/m.json', message='same file',
        setup=lambda sb, fx: (os.makedirs(f'{sb}/d'), os.symlink(f'{sb}/d', f'{sb}/l')),
        check=_absent('d/m.json')),
      o('metrics_inside_model_checkpoint', *ckpt, '--metrics_json={sb}/ckpt/m.json',
        message='inside the input', setup=_steps(copy_fx('target', 'ckpt'),
                                                 _snapshot('ckpt')), check=_unchanged('ckpt')),
      o('trace_inside_model_checkpoint', *ckpt, '--trace_json={sb}/ckpt/state/t.json',
        message='inside the input', setup=_steps(copy_fx('target', 'ckpt'),
                                                 _snapshot('ckpt')), check=_unchanged('ckpt')),
      o('metrics_inside_tokenizer_dir', '--config.model.tokenizer_dir={sb}/tok',
        '--metrics_json={sb}/tok/m.json', message='inside the input',
        setup=_steps(copy_demo('tokenizer', 'tok'), _snapshot('tok')), check=_unchanged('tok')),
      o('metrics_inside_drafter_dir', '--config.drafter=mtp', '--config.drafters.mtp.path={sb}/mtp',
        '--metrics_json={sb}/mtp/m.json', message='inside the input',
        setup=_steps(copy_demo('mtp', 'mtp'), _snapshot('mtp')), check=_unchanged('mtp')),
      o('metrics_empty_path', '--metrics_json=', message='empty'),
      o('trace_empty_path', '--trace_json=', message='empty'),
      o('metrics_is_directory_force', '--metrics_json=keep', '--force', message='directory',
        setup=_steps(_planted(), _snapshot('keep')), check=_unchanged('keep')),
      o('metrics_new_file_mode', '--metrics_json=m.json', expect='ok',
        check=_all(metrics_written(), _file_mode('m.json'))),
      o('metrics_replaced_keeps_mode', '--metrics_json=m.json', expect='ok',
        setup=lambda sb, fx: (_marked_json('m.json')(sb, fx), os.chmod(f'{sb}/m.json', 0o600)),
        check=_all(metrics_written(), _file_mode('m.json', 0o600))),
      o('metrics_to_dev_stdout', '--metrics_json=/dev/stdout', expect='ok',
        check=lambda sb, fx, p: None if '"output_ids"' in p.stdout
        else 'wrong: no metrics on stdout'),
      # export_drafter --out
      o('export_foreign_dir', '--out=keep', base=export, message='did not write',
        setup=_steps(copy_demo('dflash', 'in'), _planted(), _snapshot('keep')),
        check=_unchanged('keep')),
      o('export_foreign_dir_force', '--out=keep', '--force', base=export, expect='ok',
        setup=_steps(copy_demo('dflash', 'in'), _planted(),
                     _snapshot('keep/thesis.tex')),
        check=_all(_unchanged('keep/thesis.tex'), exported('keep'))),
      o('export_rerun_replaces_own', '--out=out', base=export, expect='ok',
        setup=_steps(copy_demo('dflash', 'in'), lambda sb, fx: subprocess.run(
            [PY, f'{REPO}/scripts/export_drafter.py', f'--path={sb}/in', f'--out={sb}/out'],
            capture_output=True, check=True)),
        check=_all(exported('out'), _no_leftovers('out'))),
      o('export_own_plus_user_file', '--out=out', base=export, message='did not write',
        setup=_steps(copy_demo('dflash', 'in'), lambda sb, fx: subprocess.run(
            [PY, f'{REPO}/scripts/export_drafter.py', f'--path={sb}/in', f'--out={sb}/out'],
            capture_output=True, check=True), _planted('out/notes.txt', 'mine'),
            _snapshot('out')), check=_unchanged('out')),
      o('export_inside_input', '--out=in/sub', base=export, message='inside the input',
        setup=_steps(copy_demo('dflash', 'in'), _snapshot('in')), check=_unchanged('in')),
      o('export_inside_input_force', '--out=in/state', '--force', base=export,
        message='inside the input',
        setup=_steps(copy_demo('dflash', 'in'), _snapshot('in')), check=_unchanged('in')),
      o('export_equals_input_force', '--out=in', '--force', base=export,
        message='inside the input',
        setup=_steps(copy_demo('dflash', 'in'), _snapshot('in')), check=_unchanged('in')),
      o('export_out_symlink', '--out=link', base=export, message='symlink',
        setup=_steps(copy_demo('dflash', 'in'), _planted(), _link('keep', 'link'),
                     _snapshot('keep')), check=_unchanged('keep')),
      o('export_out_is_file', '--out=keep/thesis.tex', '--force', base=export,
        message='not a directory', setup=_steps(copy_demo('dflash', 'in'), _planted(),
                                                _snapshot('keep')), check=_unchanged('keep')),
      o('export_file_modes', '--out=out', base=export, expect='ok',
        setup=copy_demo('dflash', 'in'),
        check=_all(_file_mode('out/model.safetensors'), _file_mode('out/config.json'))),
      o('export_eagle3_inside_input', '--out=in/x', base=export, message='inside the input',
        setup=_steps(copy_demo('eagle3', 'in'), _snapshot('in')), check=_unchanged('in')),
      # convert_hf --out
      o('convert_out_inside_hf_dir', '--hf_dir={sb}/hf', '--out={sb}/hf/ckpt', base=conv,
        message='inside the input', setup=_steps(copy_fx('hf', 'hf'), _snapshot('hf')),
        check=_unchanged('hf')),
      o('convert_out_equals_hf_dir_force', '--hf_dir={sb}/hf', '--out={sb}/hf', '--force',
        base=conv, message='inside the input',
        setup=_steps(copy_fx('hf', 'hf'), _snapshot('hf')), check=_unchanged('hf')),
      o('convert_out_symlink_dir', '--hf_dir={sb}/hf', '--out=link', base=conv,
        message='symlink', setup=_steps(copy_fx('hf', 'hf'), copy_fx('target', 'ckpt'),
                                        _link('ckpt', 'link'), _snapshot('ckpt')),
        check=_unchanged('ckpt')),
      # distill --out_dir
      o('distill_foreign_dir', '--out_dir={sb}/keep', base=distill, message='did not write',
        setup=_steps(_planted(), _snapshot('keep')), check=_unchanged('keep'), cwd='repo'),
      o('distill_foreign_dir_force', '--out_dir={sb}/keep', '--force', base=distill,
        expect='ok', setup=_steps(_planted(), _snapshot('keep/thesis.tex')),
        check=_all(_unchanged('keep/thesis.tex'), _no_leftovers('keep')), cwd='repo'),
      o('distill_out_symlink', '--out_dir={sb}/link', base=distill, message='symlink',
        setup=_steps(_planted(), _link('keep', 'link'), _snapshot('keep')),
        check=_unchanged('keep'), cwd='repo'),
      o('distill_fresh_leaves_no_lock', '--out_dir={sb}/d', base=distill, expect='ok',
        check=_no_leftovers('d'), cwd='repo'),
      # train --workdir
      o('train_foreign_workdir', '--workdir={sb}/keep', base=train, message='did not write',
        setup=_steps(_planted(), _snapshot('keep')), check=_unchanged('keep'), cwd='repo'),
      o('train_foreign_log_only', '--workdir={sb}/keep', base=train, message='did not write',
        setup=_steps(_planted('keep/train_log.jsonl', 'my notes'), _snapshot('keep')),
        check=_unchanged('keep'), cwd='repo'),
      o('train_foreign_workdir_force', '--workdir={sb}/keep', '--force', base=train,
        expect='ok', setup=_steps(_planted(), _snapshot('keep/thesis.tex')),
        check=_all(_unchanged('keep/thesis.tex'), _no_leftovers('keep')), cwd='repo'),
      o('train_workdir_symlink', '--workdir={sb}/link', base=train, message='symlink',
        setup=_steps(_planted(), _link('keep', 'link'), _snapshot('keep')),
        check=_unchanged('keep'), cwd='repo'),
      o('train_workdir_inside_init_from', '--workdir={sb}/init/run',
        '--config.training.init_from={sb}/init', base=train, message='inside the input',
        setup=_steps(copy_fx('target', 'init'), _snapshot('init')), check=_unchanged('init'),
        cwd='repo'),
      # the bench_* scripts' --out
      o('bench_ar_foreign_out', '--out=r.json', base=[f'{REPO}/scripts/bench_ar.py'],
        message='not written by dspec', setup=_steps(_planted('r.json'), _snapshot('r.json')),
        check=_unchanged('r.json')),
      o('bench_engine_out_symlink', '--out=link.json', base=[f'{REPO}/scripts/bench_engine.py'],
        message='symlink', setup=_steps(_planted('r.json'), _link('r.json', 'link.json'),
                                        _snapshot('r.json')), check=_unchanged('r.json')),
      o('bench_draft_cost_out_is_dir', '--out=keep', base=[
          f'{REPO}/scripts/bench_draft_cost.py'], message='directory',
        setup=_steps(_planted(), _snapshot('keep')), check=_unchanged('keep')),
      # benchmark --out_dir
      o('bench_foreign_results_json', '--out_dir={sb}/o', base=bench, message='did not write',
        setup=_steps(lambda sb, fx: _write(f'{sb}/o/results.json', '[{"mine": 1}]'),
                     _snapshot('o')), check=_unchanged('o'), cwd='repo'),
      o('bench_foreign_dir_force_keeps_files', '--out_dir={sb}/o', '--force', base=bench,
        expect='ok', setup=_steps(_planted('o/thesis.tex'), _snapshot('o/thesis.tex')),
        check=_unchanged('o/thesis.tex'), cwd='repo'),
      o('bench_out_dir_symlink', '--out_dir={sb}/link', base=bench, message='symlink',
        setup=_steps(_planted(), _link('keep', 'link'), _snapshot('keep')),
        check=_unchanged('keep'), cwd='repo'),
      o('bench_rerun_own_dir', '--out_dir={sb}/o', base=bench, expect='ok',
        setup=lambda sb, fx: (_write(f'{sb}/o/results.json', '[]'), _write(
            f'{sb}/o/meta.json', json.dumps({'dspec_output': 'benchmark meta'}))),
        check=lambda sb, fx, p: None if p.returncode or json.load(
            open(f'{sb}/o/results.json')) else 'wrong: results.json not rewritten', cwd='repo'),
  ]


def api_arg_cases() -> list:
  """Every public API entry: a bad type or value is a ValueError naming the argument (one
  error line through the CLI wrapper), never a TypeError, a coercion or a silent result."""
  head = textwrap.dedent('''
      import numpy as np
      import dspec
      target = dspec.load_target('{fx}/target')
      ''')

  def a(name, call, message='', expect='error'):
    return Case(name, 'api_args', _api(head + call), expect, message)

  def gen(prompts, kwarg=''):   # max_new_tokens=4 unless the case sets it
    kwargs = kwarg if kwarg.startswith('max_new_tokens') else f'max_new_tokens=4, {kwarg}'
    return f"dspec.generate(target, {prompts}, {kwargs.rstrip(', ')})"

  cases = [a(f'prompts_{n}', gen(p), m) for n, p, m in [
      ('none', 'None', 'prompts'), ('dict', "{'a': 'x'}", 'prompts'),
      ('bytes', "b'abc'", 'prompts'), ('bytes_in_list', "[b'abc']", 'prompts[0]'),
      ('set', "{'abc'}", 'prompts'), ('int', '7', 'prompts'),
      ('float_ids', '[[1.0, 2.0]]', 'prompts[0]'), ('bool_ids', '[[True, 2]]', 'prompts[0]'),
      ('str_ids', "[['1', '2']]", 'prompts[0]'), ('nested_ids', '[[[1, 2]]]', 'prompts[0]'),
      ('none_in_list', '[None]', 'prompts[0]'), ('float_array', '[np.array([1.5, 2.0])]',
                                                 'prompts[0]'),
      ('generator', "(p for p in ['a'])", 'prompts'), ('empty_list', '[]', 'non-empty'),
      ('out_of_vocab', '[[1, 2, 10**12]]', 'out of range')]]
  cases += [a(f'{n}', gen("['abc']", kw), m) for n, kw, m in [
      ('max_new_tokens_float', 'max_new_tokens=4.0', 'max_new_tokens'),
      ('max_new_tokens_str', "max_new_tokens='4'", 'max_new_tokens'),
      ('max_new_tokens_none', 'max_new_tokens=None', 'max_new_tokens'),
      ('max_new_tokens_bool', 'max_new_tokens=True', 'max_new_tokens'),
      ('temperature_none', 'temperature=None', 'temperature'),
      ('temperature_str', "temperature='0.5'", 'temperature'),
      ('temperature_nan', "temperature=float('nan')", 'temperature'),
      ('top_p_none', 'top_p=None', 'top_p'), ('top_p_two', 'top_p=2', 'top_p'),
      ('top_k_float', 'top_k=3.0', 'top_k'), ('top_k_negative', 'top_k=-1', 'top_k'),
      ('seed_float', 'seed=1.5', 'seed'), ('seed_huge', 'seed=2**40', 'seed'),
      ('batch_size_float', 'batch_size=2.0', 'batch_size'),
      ('batch_size_negative', 'batch_size=-1', 'batch_size'),
      ('timing_repeats_none', 'timing_repeats=None', 'timing_repeats'),
      ('compare_ar_str', "compare_ar='no'", 'compare_ar'),
      ('trace_int', 'trace=1', 'trace'), ('verify_length_bogus', "verify_length='fast'",
                                          'verify_length'),
      ('drafter_str', "drafter='ngram'", 'drafter')]]
  cases += [
      a('generate_target_none', "dspec.generate(None, ['abc'])", 'target'),
      a('generate_target_path', "dspec.generate('{fx}/target', ['abc'])", 'target'),
      a('load_target_none', 'dspec.load_target(None)', 'path'),
      a('load_target_int', 'dspec.load_target(123)', 'path'),
      a('load_target_bytes', "dspec.load_target(b'{fx}/target')", 'path'),
      a('load_target_empty', "dspec.load_target('')", 'path'),
      a('load_target_max_seq_len_float', "dspec.load_target('{fx}/target', max_seq_len=64.0)",
        'max_seq_len'),
      a('load_target_tokenizer_dir_int', "dspec.load_target('{fx}/target', tokenizer_dir=3)",
        'tokenizer_dir'),
      a('load_drafter_kind_none', 'dspec.load_drafter(None, target=target)', 'unknown drafter'),
      a('load_drafter_target_none', "dspec.load_drafter('ngram', target=None)", 'target'),
      a('load_drafter_num_draft_float', "dspec.load_drafter('ngram', target=target, "
        'num_draft=4.0)', 'num_draft'),
      a('load_drafter_num_draft_str', "dspec.load_drafter('ngram', target=target, "
        "num_draft='4')", 'num_draft'),
      a('load_drafter_path_int', "dspec.load_drafter('mtp', 5, target=target)", 'path'),
      a('load_drafter_unknown_field', "dspec.load_drafter('ngram', target=target, bogus=1)",
        'bogus'),
      a('numpy_ids_and_tuple_ok', "out = dspec.generate(target, (np.array([1, 2, 3]),), "
        "max_new_tokens=np.int64(4))\nassert len(out.ids[0]) == 4", expect='ok'),
      a('pathlib_path_ok', "import pathlib\ndspec.load_target(pathlib.Path('{fx}/target'))",
        expect='ok'),
  ]
  return cases


def config_cases() -> list:
  """Config errors in every script: unknown fields (nested or not) name the full path and
  near matches; a config meant for another script is one line."""
  def c(name, script, *args, message='', expect='error'):
    return Case(name, 'config', [f'scripts/{script}'] + list(args), expect, message)

  tiny, train = '--config=configs/tiny.py', '--config=configs/demo_target_v2.py:quick'
  dist, bench = '--config=configs/distill_demo.py:tiny', '--config=configs/bench_tiny.py'
  return [
      c('decode_nested_unknown', 'decode.py', tiny, '--config.drafters.mtp.bogus=1',
        message='drafters.mtp.bogus'),
      c('decode_nested_typo', 'decode.py', tiny, '--config.drafters.ngram.num_drafts=3',
        message='did you mean drafters.ngram.num_draft'),
      c('decode_unknown_drafter_section', 'decode.py', tiny, '--config.drafters.eagle9.x=1',
        message='drafters.eagle9'),
      c('decode_model_shape_typo', 'decode.py', tiny, '--config.model.shape.num_layer=2',
        message='model.shape.num_layer'),
      c('decode_controller_unknown', 'decode.py', tiny, '--config.controller.bogus=1',
        message='controller.bogus'),
      c('decode_top_level_unknown', 'decode.py', tiny, '--config.bogus_field=1',
        message='bogus_field'),
      c('decode_top_level_typo', 'decode.py', tiny, '--config.temperatur=1',
        message='did you mean temperature'),
      c('decode_value_as_section', 'decode.py', tiny, '--config.max_new_tokens.x=1',
        message='not a section'),
      c('decode_default_config_unknown', 'decode.py', '--config.bogus=1', message='bogus'),
      c('decode_default_config_nested', 'decode.py', '--config.drafters.mtp.bogus=1',
        message='drafters.mtp.bogus'),
      c('decode_given_train_config', 'decode.py', train, '--config.max_new_tokens=4',
        expect='either'),
      c('decode_given_distill_config', 'decode.py', dist, '--config.max_new_tokens=4',
        expect='either'),
      c('train_nested_unknown', 'train.py', train, '--config.training.bogus=1',
        '--workdir=/tmp/dspec-redteam-unused', message='training.bogus'),
      c('train_typo', 'train.py', train, '--config.training.lerning_rate=1',
        '--workdir=/tmp/dspec-redteam-unused', message='did you mean training.learning_rate'),
      c('train_given_decode_config', 'train.py', tiny, '--workdir=/tmp/dspec-redteam-unused',
        message="no 'training' field"),
      c('train_given_distill_config', 'train.py', dist, '--workdir=/tmp/dspec-redteam-unused',
        message="no 'training' field"),
      c('train_given_bench_config', 'train.py', bench, '--workdir=/tmp/dspec-redteam-unused',
        message="no 'training' field"),
      c('distill_nested_unknown', 'distill.py', dist, '--config.distill.bogus=1',
        '--out_dir=/tmp/dspec-redteam-unused', message='distill.bogus'),
      c('distill_prompt_sets_unknown', 'distill.py', dist,
        '--config.distill.prompt_sets.bogus=3', '--out_dir=/tmp/dspec-redteam-unused',
        message='distill.prompt_sets.bogus'),
      c('distill_given_decode_config', 'distill.py', tiny,
        '--out_dir=/tmp/dspec-redteam-unused', message="no 'distill' field"),
      c('distill_given_train_config', 'distill.py', train,
        '--out_dir=/tmp/dspec-redteam-unused', message="no 'distill' field"),
      c('bench_nested_unknown', 'benchmark.py', bench, '--config.bench.hf.bogus=1',
        '--out_dir=/tmp/dspec-redteam-unused', message='bench.hf.bogus'),
      c('bench_typo', 'benchmark.py', bench, '--config.bench.num_prompt=1',
        '--out_dir=/tmp/dspec-redteam-unused', message='did you mean bench.num_prompts'),
      c('bench_given_decode_config', 'benchmark.py', tiny,
        '--out_dir=/tmp/dspec-redteam-unused', message="no 'bench' field"),
      c('bench_default_config_unknown', 'benchmark.py', '--config.bogus=1',
        '--out_dir=/tmp/dspec-redteam-unused', message='bogus'),
  ]


def context_cases() -> list:
  """num_draft, max_new_tokens and the prompt against the model context, before anything
  compiles: a too-long draft must be refused, not hang (a hang times out at 240 s)."""
  base = ['scripts/decode.py', '--config=configs/tiny.py', '--config.max_new_tokens=8',
          '--config.timing_repeats=0', '--quiet']

  def x(name, *args, expect='error', message='exceeds the model context'):
    return Case(name, 'context', base + list(args), expect, message, timeout=240)

  return [
      x('ngram_num_draft_100000', '--config.drafter=ngram',
        '--config.drafters.ngram.num_draft=100000'),
      x('ngram_num_draft_int32_max', '--config.drafter=ngram',
        '--config.drafters.ngram.num_draft=2147483647', message='num_draft'),
      x('suffix_num_draft_100000', '--config.drafter=suffix',
        '--config.drafters.suffix.num_draft=100000', message='num_draft'),
      x('oracle_num_draft_100000', '--config.drafter=oracle',
        '--config.drafters.oracle.num_draft=100000', message='num_draft'),
      x('self_num_draft_100000', '--config.drafter=self',
        '--config.drafters.self.num_draft=100000', message='num_draft'),
      x('ngram_num_draft_equals_context', '--config.drafter=ngram',
        '--config.drafters.ngram.num_draft=4096'),
      x('ngram_fixed_verify_huge', '--config.drafter=ngram', '--config.verify_length=fixed',
        '--config.drafters.ngram.num_draft=100000'),
      x('small_context_draft_overflows', '--config.model.max_seq_len=32',
        '--config.drafter=ngram', '--config.drafters.ngram.num_draft=24',
        '--prompt_ids=1,2,3'),
      x('small_context_draft_fits', '--config.model.max_seq_len=32', '--config.drafter=ngram',
        '--config.drafters.ngram.num_draft=20', '--prompt_ids=1,2,3', expect='ok'),
      x('max_new_tokens_fills_context', '--config.max_new_tokens=4094', '--prompt_ids=1,2,3'),
      x('max_new_tokens_plus_draft_overflows', '--config.max_new_tokens=4080',
        '--config.drafter=ngram', '--config.drafters.ngram.num_draft=16', '--prompt_ids=1,2'),
      Case('bench_size_100000', 'context', [
          'scripts/benchmark.py', '--config=configs/bench_tiny.py:nohf,t0',
          '--config.bench.sizes=(100000,)', '--out_dir={sb}/o'], 'error',
           'exceeds the model context', timeout=240, check=_absent('o/results.json')),
      Case('api_num_draft_100000', 'context', _api('''
          import dspec
          target = dspec.load_target('{fx}/target')
          drafter = dspec.load_drafter('ngram', target=target, num_draft=100000)
          dspec.generate(target, [[1, 2, 3]], drafter=drafter, max_new_tokens=4)'''),
           'error', 'exceeds the model context', timeout=240),
  ]


def named_file_cases() -> list:
  """Every error on a damaged file names that file."""
  bench = ['scripts/benchmark.py', '--config=configs/bench_tiny.py:nohf,t0', '--resume',
           '--out_dir={sb}/o']
  dspec_dir = lambda sb, fx: _write(f'{sb}/o/meta.json',
                                    json.dumps({'dspec_output': 'benchmark meta'}))

  def n(name, argv, message, setup=None, check=None):
    return Case(name, 'named', argv, 'error', message, setup, check)

  def hf(edit):
    def setup(sb, fx):
      _copy(os.path.join(fx, 'hf'), os.path.join(sb, 'hf'))
      edit(os.path.join(sb, 'hf'))
    return setup

  def drafter_dir(edit, src='dflash'):
    def setup(sb, fx):
      _copy(os.path.join(REPO, 'demo', src), os.path.join(sb, 'in'))
      edit(os.path.join(sb, 'in'))
    return setup

  export = ['scripts/export_drafter.py', '--path={sb}/in', '--out={sb}/out']
  decode_hf = ['scripts/decode.py', '--config=configs/tiny.py', '--config.model.source=hf',
               '--config.model.path={sb}/hf', '--quiet']
  conv = ['scripts/convert_hf.py', '--hf_dir={sb}/hf', '--out={sb}/out']

  def safetensors_dir(h):
    os.remove(os.path.join(h, 'model.safetensors'))
    os.makedirs(os.path.join(h, 'model.safetensors'))

  return [
      n('partial_control_char', bench, 'results.partial.json',
        setup=lambda sb, fx: (dspec_dir(sb, fx), _write(f'{sb}/o/results.partial.json',
                                                       '{"config": "\x01"}'))),
      n('partial_truncated', bench, 'results.partial.json',
        setup=lambda sb, fx: (dspec_dir(sb, fx), _write(f'{sb}/o/results.partial.json',
                                                       '{"config": {'))),
      n('partial_is_list', bench, 'results.partial.json',
        setup=lambda sb, fx: (dspec_dir(sb, fx), _write(f'{sb}/o/results.partial.json',
                                                       '[]'))),
      n('partial_binary', bench, 'results.partial.json',
        setup=lambda sb, fx: (dspec_dir(sb, fx), _write(f'{sb}/o/results.partial.json',
                                                       b'\xff\xfe\x00', 'wb'))),
      n('partial_is_directory', bench, 'results.partial.json',
        setup=lambda sb, fx: (dspec_dir(sb, fx), os.makedirs(f'{sb}/o/results.partial.json'))),
      n('render_corrupt_results', ['scripts/benchmark.py', '--render={sb}/o'], 'results.json',
        setup=lambda sb, fx: (dspec_dir(sb, fx), _write(f'{sb}/o/results.json', '[{'))),
      n('hf_safetensors_is_directory', conv, 'model.safetensors', setup=hf(safetensors_dir)),
      n('hf_safetensors_is_directory_decode', decode_hf, 'model.safetensors',
        setup=hf(safetensors_dir)),
      n('hf_config_binary', conv, 'config.json',
        setup=hf(lambda h: _write(os.path.join(h, 'config.json'), b'\xff\xfe{', 'wb'))),
      n('hf_config_is_directory', conv, 'config.json', setup=hf(lambda h: (
          os.remove(os.path.join(h, 'config.json')), os.makedirs(os.path.join(h, 'config.json'))))),
      n('hf_index_binary', conv, 'index',
        setup=hf(lambda h: _write(os.path.join(h, 'model.safetensors.index.json'), b'\xff\x00',
                                  'wb'))),
      n('drafter_config_garbled', export, 'config.json', setup=drafter_dir(
          lambda d: _write(os.path.join(d, 'config.json'), '{"x": '))),
      n('drafter_metadata_binary', export, '{sb}/in', setup=drafter_dir(
          lambda d: _write(os.path.join(d, 'metadata', 'metadata'), b'\xff\xfe', 'wb'))),
      n('token_map_binary', ['scripts/decode.py', '--config=configs/demo.py',
                             '--config.drafter=mtp', '--config.drafters.mtp.token_map={sb}/tm.json',
                             '--config.max_new_tokens=4', '--quiet'], 'tm.json',
        setup=lambda sb, fx: _write(f'{sb}/tm.json', b'\xff\xfe[1,2]', 'wb')),
      n('distill_manifest_binary', ['scripts/distill.py', '--config=configs/distill_demo.py:tiny',
                                    '--out_dir={sb}/d'], 'manifest.json',
        setup=lambda sb, fx: _write(f'{sb}/d/manifest.json', b'\xff\xfe', 'wb')),
  ]


def lock_cases() -> list:
  """Locks and manifests: removed on exit; a killed run's lock is stale and taken over; a
  manifest without shards from a killed run restarts; nothing is left behind."""
  distill = ['scripts/distill.py', '--config=configs/distill_demo.py:tiny', '--out_dir={sb}/d']
  train = ['scripts/train.py', '--config=configs/demo_target_v2.py:quick', '--workdir={sb}/run']

  def killed_holder(rel, what):
    """setup: a process that took sb/rel's lock, then died by kill -9 (its .lock stays)."""
    def setup(sb, fx):
      _hold_lock(rel, what)(sb, fx)
      holder = _HOLDERS.pop(sb)
      holder.kill()
      holder.wait()
    return setup

  def stale_manifest(sb, fx):
    _write(f'{sb}/d/manifest.json', json.dumps({'fingerprint': 'a killed run of other '
                                                'settings', 'shards': [], 'complete': False}))

  def complete(sb, fx, proc):
    if proc.returncode != 0:
      return None
    manifest = json.load(open(os.path.join(sb, 'd', 'manifest.json')))
    return None if manifest.get('complete') else 'wrong: manifest not complete'

  return [
      Case('distill_after_kill9_holder', 'locks', distill, 'ok',
           setup=killed_holder('d', 'distillation'), check=_all(complete, _no_leftovers('d'))),
      Case('distill_stale_shardless_manifest', 'locks', distill, 'ok', setup=stale_manifest,
           check=_all(complete, _no_leftovers('d'))),
      Case('distill_live_holder', 'locks', distill, 'error', 'another distillation',
           setup=_hold_lock('d', 'distillation'), check=_release),
      Case('train_after_kill9_holder', 'locks', train, 'ok',
           setup=killed_holder('run', 'trainer'), check=_no_leftovers('run')),
      Case('train_finished_leaves_no_lock', 'locks', train, 'ok', check=_no_leftovers('run')),
      Case('lock_released_after_error', 'locks', distill + ['--config.distill.max_new_tokens=0'],
           'error', 'distill.max_new_tokens', check=_no_leftovers('d')),
      Case('refused_run_creates_nothing', 'locks', ['scripts/benchmark.py',
                                                    '--config=configs/bench_tiny.py',
                                                    '--config.bench.num_prompts=0',
                                                    '--out_dir={sb}/o'],
           'error', 'num_prompts', check=_absent('o')),
      Case('api_lock_removed_on_exit', 'locks', _api('''
          import os
          from dspec import files
          os.makedirs('{sb}/run')
          with files.directory_lock('{sb}/run', 'trainer'):
            pass
          assert os.listdir('{sb}/run') == [], os.listdir('{sb}/run')
          with files.directory_lock('{sb}/new', 'trainer'):
            pass
          assert not os.path.exists('{sb}/new'), 'an empty directory made by the lock stayed' '''),
           'ok'),
  ]


# ------------------------------------------------- round 4: the reliability issue's classes
# One group per class: multi-process runs, knob ranges, numbers stored in checkpoints,
# drafters of another target, outputs inside inputs, --force onto another model, failed
# writes, the API's error hierarchy, structured output and the lossless modes (trees).

_EXEC = 'import os, sys\nos.execvp(sys.argv[1], sys.argv[1:])'


def _program(*argv) -> list:
  """The argv of a case running another program (exec'd from Python, which starts every
  case)."""
  return [PY, '-c', _EXEC, *argv]


_WITH_PORT = ('import os, sys\nport = open(sys.argv[1]).read().strip()\n'
              "argv = [a.replace('<port>', port) for a in sys.argv[2:]]\n"
              'os.execv(sys.executable, [sys.executable] + argv)')


def _with_port(*argv) -> list:
  """argv with `<port>` replaced by the port the case's setup wrote to sb/port."""
  return [PY, '-c', _WITH_PORT, '{sb}/port', *argv]


def _free_port(sb, fx):
  """setup: a port nobody listens on, in sb/port."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    _write(os.path.join(sb, 'port'), str(s.getsockname()[1]))


_PORT_HOLDER = '''
import socket, time
server = socket.socket()
server.bind(('127.0.0.1', 0))
server.listen()
print(server.getsockname()[1], flush=True)
time.sleep(600)'''


def _hold_port(sb, fx):
  """setup: another program (no coordinator) listening on sb/port; killed after the case."""
  holder = subprocess.Popen([PY, '-c', _PORT_HOLDER], stdout=subprocess.PIPE, text=True)
  _HOLDERS[sb] = holder
  _write(os.path.join(sb, 'port'), holder.stdout.readline().strip())


def _alive(pid: int) -> bool:
  """Whether process `pid` runs (a zombie, dead and not yet reaped, does not)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rpartition(')')[2].split()[0] != 'Z'
  except (OSError, IndexError):
    return False


def _gone(pid: int, within: float = 10.0) -> bool:
  deadline = time.monotonic() + within
  while _alive(pid):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.1)
  return True


_LAUNCH_CHILD = '''import os, sys, time
print(os.getpid(), flush=True)
if 'chatty' in sys.argv:
  for _ in range(4000):
    print('x' * 100, flush=True)
  sys.exit(0)
if 'fail' in sys.argv and '--process_id=1' in sys.argv:
  time.sleep(1)
  sys.exit(3)
time.sleep(120)
'''

# How launch_local.py ends (argv[1]: a signal sent to it, 'timeout', 'fail' (process 1
# exits 3) or 'chatty' (its stdout a closed pipe)); prints {status, seconds, children} for
# `_launch_ended`.
_LAUNCH_PROBE = '''
import json, os, signal, subprocess, sys, time
how, sb = sys.argv[1], sys.argv[2]
child = [os.path.join(sb, 'child.py')] + ([how] if how in ('chatty', 'fail') else [])
argv = [sys.executable, %r, '-n', '2', '--grace=1',
        '--timeout=%%d' %% (3 if how == 'timeout' else 60), '--', *child]
t0 = time.monotonic()
if how == 'chatty':   # a reader that went away: the launcher's stdout is a closed pipe
  read_end, write_end = os.pipe()
  os.close(read_end)
  launcher = subprocess.Popen(argv, stdout=write_end, stderr=subprocess.DEVNULL)
  os.close(write_end)
  pids = []
else:
  launcher = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
  pids = [int(launcher.stdout.readline().split()[-1]) for _ in range(2)]
  if how.startswith('SIG'):
    launcher.send_signal(getattr(signal, how))
try:
  status = launcher.wait(timeout=60)
except subprocess.TimeoutExpired:
  launcher.kill()
  status = 'no exit within 60 s'
print(json.dumps({'status': status, 'seconds': time.monotonic() - t0, 'children': pids}))
''' % os.path.join(REPO, 'scripts', 'launch_local.py')


def _launch_ended(status, within):
  """check: the probe's launcher ended with `status` within `within` s, and none of the
  processes it started outlived it (any that did is killed here)."""
  def check(sb, fx, proc):
    if proc.returncode != 0:
      return None
    try:
      report = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
      return f'wrong: no report from the probe ({proc.stdout[-200:]!r})'
    left = [pid for pid in report['children'] if not _gone(pid)]
    for pid in left:
      os.kill(pid, signal.SIGKILL)
    if left:
      return f'wrong: processes {left} outlived the launcher'
    if report['status'] != status:
      return f'wrong: the launcher ended with {report["status"]}, expected {status}'
    if report['seconds'] > within:
      return f'wrong: the launcher took {report["seconds"]:.0f} s (bound: {within} s)'
    return None
  return check


def _lossless(rel='m.json', **expected):
  """check: the metrics JSON says the output equals AR's (`lossless` true), with tokens,
  and holds `expected` (e.g. verify_length='tree')."""
  tokens = _metrics_ok(rel)

  def check(sb, fx, proc):
    problem = tokens(sb, fx, proc)
    if proc.returncode != 0 or problem:
      return problem
    report = _strict_json(os.path.join(sb, rel))
    if report.get('lossless') is not True:
      return f'wrong: lossless is {report.get("lossless")!r}, not true'
    for key, value in expected.items():
      if report.get(key) != value:
        return f'wrong: {key} is {report.get(key)!r}, expected {value!r}'
    return None
  return check


def multiprocess_cases() -> list:
  """Multi-process runs end in bounded time, in one line: flags checked before anything
  starts, joins that cannot complete (nobody at the coordinator, process 0 alone, a port
  or address another program holds) end at --distributed_timeout with status 1;
  launch_local.py refuses unbounded waits and, however it ends, leaves no process behind."""
  decode = ['scripts/decode.py', '--config=configs/tiny.py', '--config.max_new_tokens=4',
            '--config.timing_repeats=0', '--quiet', '--compilation_cache_dir=']
  two = ['--num_processes=2']
  launch = ['scripts/launch_local.py', '-n', '2']

  def m(name, *args, message):
    return Case(name, 'multiprocess', decode + list(args), 'error', message)

  def join(name, process_id, message, setup=_free_port):
    """Process `process_id` of 2 at 127.0.0.1:<port>, a 4 s join timeout."""
    return Case(name, 'multiprocess', _with_port(
        *decode, '--coordinator=127.0.0.1:<port>', *two, f'--process_id={process_id}',
        '--distributed_timeout=4'), 'error', message, setup=setup, timeout=120)

  def flag(name, *args, message):
    return Case(name, 'multiprocess', launch + list(args), 'error', message, status=2,
                timeout=60)

  def probe(name, how, status, within=40):
    return Case(name, 'multiprocess', [PY, '-c', _LAUNCH_PROBE, how, '{sb}'], 'ok',
                setup=lambda sb, fx: _write(os.path.join(sb, 'child.py'), _LAUNCH_CHILD),
                check=_launch_ended(status, within), timeout=120)

  def only_process_0_prints(sb, fx, proc):
    lines = [line for line in proc.stdout.splitlines() if 'metrics: ' in line]
    if not lines or not all(line.startswith('[p0] ') for line in lines):
      return f'wrong: metrics lines {lines!r} (expected one, from process 0 only)'
    return None

  peer = ['--coordinator=127.0.0.1:9', *two, '--process_id=1']
  return [
      m('timeout_inf', *peer, '--distributed_timeout=inf', message='--distributed_timeout'),
      m('timeout_zero', *peer, '--distributed_timeout=0', message='--distributed_timeout'),
      m('timeout_negative', *peer, '--distributed_timeout=-5',
        message='--distributed_timeout'),
      m('timeout_24_days_plus', *peer, '--distributed_timeout=1e12',
        message='--distributed_timeout'),
      m('timeout_text', *peer, '--distributed_timeout=soon', message='distributed_timeout'),
      m('coordinator_without_port', '--coordinator=127.0.0.1', *two, '--process_id=0',
        message='host:port'),
      m('coordinator_port_zero', '--coordinator=127.0.0.1:0', *two, '--process_id=0',
        message='host:port'),
      m('coordinator_port_above_65535', '--coordinator=127.0.0.1:70000', *two,
        '--process_id=0', message='host:port'),
      m('coordinator_without_host', '--coordinator=:1234', *two, '--process_id=0',
        message='host:port'),
      m('process_id_missing', '--coordinator=127.0.0.1:9', *two, message='--process_id'),
      m('process_id_alone', '--process_id=0', message='--coordinator'),
      m('process_id_out_of_range', '--coordinator=127.0.0.1:9', *two, '--process_id=2',
        message='--process_id'),
      m('process_id_negative', '--coordinator=127.0.0.1:9', *two, '--process_id=-1',
        message='--process_id'),
      m('num_processes_zero', '--coordinator=127.0.0.1:9', '--num_processes=0',
        '--process_id=0', message='--num_processes'),
      join('nobody_at_the_coordinator', 1, 'cannot reach the coordinator'),
      join('process_0_alone', 0, 'not every process joined'),
      join('port_held_by_another_server', 0, 'is in use', setup=_hold_port),
      join('address_held_by_another_server', 1, 'not every process joined',
           setup=_hold_port),
      Case('launch_two_processes_lossless', 'multiprocess', launch + [
          '--devices_per_process=1', '--timeout=400', '--grace=2', '--', *decode,
          '--config.drafter=ngram', '--config.compare_ar=True', '--distributed_timeout=60',
          '--metrics_json={sb}/m.json'], 'ok',
           check=_all(_lossless(), only_process_0_prints), timeout=480),
      flag('launch_timeout_nan', '--timeout=nan', '--', 'scripts/decode.py',
           message='--timeout must be a finite number'),
      flag('launch_timeout_inf', '--timeout=inf', '--', 'scripts/decode.py',
           message='--timeout must be a finite number'),
      flag('launch_timeout_zero', '--timeout=0', '--', 'scripts/decode.py',
           message='--timeout must be a finite number'),
      flag('launch_grace_nan', '--grace=nan', '--', 'scripts/decode.py',
           message='--grace must be a finite number'),
      flag('launch_grace_inf', '--grace=inf', '--', 'scripts/decode.py',
           message='--grace must be a finite number'),
      flag('launch_grace_negative', '--grace=-1', '--', 'scripts/decode.py',
           message='--grace must be a finite number'),
      flag('launch_zero_processes', '-n', '0', '--', 'scripts/decode.py', message='-n'),
      flag('launch_no_command', message='give the script'),
      flag('launch_not_a_script', '--', 'README.md', message='not a Python script'),
      probe('launch_sighup_leaves_no_process', 'SIGHUP', 128 + signal.SIGHUP),
      probe('launch_sigterm_leaves_no_process', 'SIGTERM', 128 + signal.SIGTERM),
      probe('launch_sigint_leaves_no_process', 'SIGINT', 128 + signal.SIGINT),
      probe('launch_sigkill_leaves_no_process', 'SIGKILL', -signal.SIGKILL),
      probe('launch_timeout_stops_every_process', 'timeout', 124),
      probe('launch_failed_process_stops_the_other', 'fail', 3),
      probe('launch_closed_stdout_drains', 'chatty', 0),
  ]


def knob_cases() -> list:
  """Every controller and tree knob in its range, and drafter settings a tree mode ignores
  refused by name; all checked before anything loads (the target path does not exist, so
  an error about it means a knob was checked late or not at all)."""
  base = ['scripts/decode.py', '--config=configs/tiny.py', '--config.max_new_tokens=4',
          '--config.timing_repeats=0', '--quiet', '--config.model.source=checkpoint',
          '--config.model.path=/nonexistent/target']

  def k(name, *args, message):
    return Case(name, 'knobs', base + list(args), 'error', message)

  def c(knob, value, message=None, *more):
    name = f'controller_{knob}_{value}'.replace('-', 'neg').replace('.', '_')
    return k(name, f'--config.controller.{knob}={value}', *more,
             message=message or f'controller.{knob}')

  def t(name, *args, message):
    return k(f'tree_{name}', '--config.drafter=ngram', '--config.verify_length=tree', *args,
             message=message)

  dflash = ['--config.drafter=dflash', '--config.drafters.dflash.path=/nonexistent/dflash']
  dspark = ['--config.drafter=dspark', '--config.drafters.dspark.path=/nonexistent/dspark']
  return [
      c('chunk_seconds', '0'), c('chunk_seconds', 'inf'), c('chunk_seconds', '-1'),
      c('margin', 'nan'), c('prior_weight', '0'), c('prior_weight', '-1'),
      c('prior', '0'), c('prior', '1.5'), c('ema', 'nan'), c('probe_every', '0'),
      c('max_probe_every', '-1'), c('profile_steps', '-1'),
      c('profile_repeats', '-1'), c('steps_per_decision', '0'),
      c('shadow_budget', 'nan'), c('objective', 'fast'),
      c('probe_every', '64', 'controller.probe_every=64 must be <= '
        'controller.max_probe_every=32', '--config.controller.max_probe_every=32'),
      t('num_nodes_one', '--config.tree.num_nodes=1', message='tree.num_nodes'),
      t('top_k_zero', '--config.tree.top_k=0', message='tree.top_k'),
      t('top_k_above_num_nodes', '--config.tree.num_nodes=8', '--config.tree.top_k=9',
        message='tree.top_k=9 must be <= tree.num_nodes=8'),
      t('top_k_int64_max', '--config.tree.top_k=9223372036854775807', message='tree.top_k'),
      t('num_nodes_float', '--config.tree.num_nodes=2.5', message='tree.num_nodes'),
      t('unknown_knob', '--config.tree.nodes=8', message='tree.nodes'),
      k('auto_tree_dflash_denoise_steps', *dflash, '--config.verify_length=auto_tree',
        '--config.drafters.dflash.denoise_steps=2', message='dflash.denoise_steps=2'),
      k('tree_dspark_verify_cost', *dspark, '--config.verify_length=tree',
        '--config.drafters.dspark.verify_cost=0.5', message='dspark.verify_cost=0.5'),
      k('tree_dspark_verify_budget_and_cost', *dspark, '--config.verify_length=tree',
        '--config.drafters.dspark.verify_budget=2', '--config.drafters.dspark.verify_cost=0.5',
        message='drafters.dspark.verify_budget=2, drafters.dspark.verify_cost=0.5'),
      Case('api_tree_dflash_denoise_steps', 'knobs', _api('''
          import dspec
          target = dspec.load_target('demo/target')
          drafter = dspec.load_drafter('dflash', 'demo/dflash', target=target, denoise_steps=2)
          dspec.generate(target, ['def f(x):'], drafter, max_new_tokens=4,
                         verify_length='tree')'''), 'error', 'drafters.dflash.denoise_steps=2'),
      Case('fixed_honours_dflash_denoise_steps', 'knobs', [
          'scripts/decode.py', '--config=configs/demo.py:small,drafter=dflash',
          '--config.max_new_tokens=8', '--config.timing_repeats=0', '--quiet',
          '--config.verify_length=fixed', '--config.drafters.dflash.denoise_steps=2',
          '--metrics_json={sb}/m.json'], 'ok', check=_lossless(verify_length='fixed')),
  ]


def _export_fixture(fx, kind):
  """{fx}/export_<kind>: demo/<kind> exported in its default published form (made on first
  use)."""
  out = os.path.join(fx, f'export_{kind}')
  if not os.path.isdir(out):
    subprocess.run([PY, 'scripts/export_drafter.py', f'--path=demo/{kind}', f'--out={out}'],
                   cwd=REPO, capture_output=True, check=True, timeout=600)
  return out


def _exported(kind, rel='in', edit=None):
  """setup: demo/<kind>'s export copied to sb/rel, its config.json edited by `edit`."""
  def setup(sb, fx):
    _copy(_export_fixture(fx, kind), os.path.join(sb, rel))
    if edit:
      _edit_json(os.path.join(sb, rel, 'config.json'), edit)
  return setup


def _demo_copy(kind, rel='in', edit=None):
  """setup: demo/<kind> (a dspec checkpoint) copied to sb/rel, `edit` applied to its
  metadata's config."""
  def setup(sb, fx):
    _copy(os.path.join(REPO, 'demo', kind), os.path.join(sb, rel))
    if edit:
      _edit_json(os.path.join(sb, rel, 'metadata', 'metadata'), lambda m: edit(m['config']))
  return setup


def _set(path, value):
  """An edit setting the field at `path` (keys and indices) of a JSON object."""
  def edit(data):
    for key in path[:-1]:
      data = data[key]
    data[path[-1]] = value
  return edit


def ckpt_value_cases() -> list:
  """Numbers read from a model's files (a drafter's config.json, a checkpoint's metadata, a
  Hugging Face config) are checked on load: a NaN, an infinity or an out-of-range value is
  one error naming the file and the field, whichever entry point reads it."""
  export = ['scripts/export_drafter.py', '--path={sb}/in', '--out={sb}/out']
  decode = ['scripts/decode.py', '--config=configs/demo.py:small', '--config.max_new_tokens=4',
            '--config.timing_repeats=0', '--quiet']

  def v(name, argv, message, setup):
    return Case(name, 'ckpt_values', argv, 'error', message, setup, _absent('out'))

  temps = ['dspec_confidence_temperatures', 1]
  conf = '{sb}/in/config.json: dspec_confidence_temperatures[1] must be'
  meta = '{sb}/in: bad metadata: config.dspark.confidence_temperatures[1] must be'
  nan_export = _exported('dspark', edit=_set(temps, math.nan))
  nan_meta = _demo_copy('dspark', edit=_set(['dspark', 'confidence_temperatures', 1],
                                             math.nan))
  dspark_in = ['--config.drafter=dspark', '--config.drafters.dspark.path={sb}/in']
  api_load = '''
      import dspec
      target = dspec.load_target('demo/target')
      dspec.load_drafter('dspark', '{sb}/in', target=target)'''
  return [
      v('export_dspark_temperature_nan', export, conf + ' a finite number', nan_export),
      v('export_dspark_temperature_inf', export, conf + ' a finite number',
        _exported('dspark', edit=_set(temps, math.inf))),
      v('export_dspark_temperature_negative', export, conf + ' in (0',
        _exported('dspark', edit=_set(temps, -1.0))),
      v('export_dspark_greedy_temperature_nan', export,
        '{sb}/in/config.json: dspec_greedy_confidence_temperatures[0]',
        _exported('dspark', edit=_set(['dspec_greedy_confidence_temperatures', 0],
                                      math.nan))),
      v('decode_dspark_temperature_nan', decode + dspark_in, conf + ' a finite number',
        nan_export),
      v('api_dspark_temperature_nan', _api(api_load), conf + ' a finite number', nan_export),
      v('decode_dspark_checkpoint_temperature_nan', decode + dspark_in,
        meta + ' a finite number', nan_meta),
      v('api_dspark_checkpoint_temperature_nan', _api(api_load), meta + ' a finite number',
        nan_meta),
      v('export_dspark_checkpoint_temperature_inf', export, meta + ' a finite number',
        _demo_copy('dspark', edit=_set(['dspark', 'confidence_temperatures', 1], math.inf))),
      v('decode_dspark_checkpoint_block_size_one', decode + dspark_in,
        'config.dspark.block_size', _demo_copy('dspark', edit=_set(['dspark', 'block_size'],
                                                                   1))),
      v('export_eagle3_rms_norm_eps_negative', export,
        '{sb}/in/config.json: transformer_layer_config.rms_norm_eps',
        _exported('eagle3', edit=_set(['transformer_layer_config', 'rms_norm_eps'], -1e-6))),
      v('export_dflash_mask_token_negative', export,
        '{sb}/in/config.json: dflash_config.mask_token_id',
        _exported('dflash', edit=_set(['dflash_config', 'mask_token_id'], -1))),
      v('decode_dflash_rope_theta_inf', decode + ['--config.drafter=dflash',
                                                  '--config.drafters.dflash.path={sb}/in'],
        '{sb}/in/config.json: rope_parameters.rope_theta',
        _exported('dflash', edit=_set(['rope_parameters', 'rope_theta'], math.inf))),
      v('api_target_embed_dim_inf', _api('''
          import dspec
          dspec.load_target('{sb}/in')'''), 'config.embed_dim must be a finite number',
        lambda sb, fx: (_copy(os.path.join(fx, 'target'), os.path.join(sb, 'in')), _edit_json(
            os.path.join(sb, 'in', 'metadata', 'metadata'),
            lambda m: m['config'].update(embed_dim=math.inf)))),
      v('decode_hf_initializer_range_inf', [
          'scripts/decode.py', '--config=configs/tiny.py', '--config.model.source=hf',
          '--config.model.path={sb}/in', '--quiet'], '{sb}/in/config.json: initializer_range',
        lambda sb, fx: (_copy(os.path.join(fx, 'hf'), os.path.join(sb, 'in')), _edit_json(
            os.path.join(sb, 'in', 'config.json'), _set(['initializer_range'], math.inf)))),
      v('api_save_nan_temperature', _api('''
          import math
          from flax import nnx
          from dspec import checkpoint
          config = {'dspark': {'block_size': 4, 'confidence_temperatures': [1.0, math.nan]}}
          checkpoint.save_model('{sb}/out', nnx.Linear(2, 2, rngs=nnx.Rngs(0)),
                                kind='dspark', config=config)'''),
        'confidence_temperatures[1] must be a finite number', None),
  ]


def foreign_drafter_cases() -> list:
  """A drafter built for another target is refused naming both widths, whether it is
  loaded against the target or built for one target and passed to dspec.generate with
  another; one trained against other weights of the same shapes loads with a warning naming
  both targets (it stays lossless)."""
  tiny = "import dspec\ntarget = dspec.load_target('{fx}/target')\n"

  def f(name, code, message='384 does not match the target width 64', expect='error',
        check=None, **kw):
    return Case(name, 'foreign_drafter', _api(code), expect, message, check=check, **kw)

  def other_weights(sb, fx):
    """{fx}/demo_other: a target of demo/target's shapes and tokenizer, other weights."""
    path = os.path.join(fx, 'demo_other')
    if not os.path.isdir(path):
      subprocess.run(_api(f'''
          import shutil
          from flax import nnx
          from dspec import checkpoint
          from dspec.models.config import TransformerConfig
          from dspec.models.transformer import Transformer
          meta = checkpoint.read_model_metadata('demo/target', 'target')
          cfg = TransformerConfig(**meta['config'])
          checkpoint.save_model({path!r}, Transformer(cfg, rngs=nnx.Rngs(7)), kind='target',
                                config=cfg.to_dict())
          for name in ('tokenizer.json', 'tokenizer_config.json'):
            shutil.copy(os.path.join('demo/target', name), {path!r})'''),
                     cwd=REPO, capture_output=True, check=True, timeout=600)

  warned = lambda sb, fx, p: None if p.returncode or 'was trained against the target' in \
      p.stderr else 'wrong: no warning naming the target the drafter was trained against'
  cases = [f(f'load_{kind}_for_tiny', tiny + f"dspec.load_drafter('{kind}', 'demo/{kind}', "
             'target=target)') for kind in ('mtp', 'eagle3', 'dflash', 'dspark')]
  cases += [f(f'generate_{kind}_of_demo_on_tiny', f'''
      import dspec
      demo = dspec.load_target('demo/target')
      drafter = dspec.load_drafter('{kind}', 'demo/{kind}', target=demo)
      tiny = dspec.load_target('{{fx}}/target')
      dspec.generate(tiny, [[1, 2, 3]], drafter, max_new_tokens=4)''')
            for kind in ('mtp', 'eagle3', 'dflash', 'dspark')]
  cases += [
      Case('decode_mtp_on_tiny', 'foreign_drafter', [
          'scripts/decode.py', '--config=configs/tiny.py', '--config.drafter=mtp',
          '--config.drafters.mtp.path=demo/mtp', '--quiet'], 'error',
           '384 does not match the target width 64'),
      Case('decode_eagle3_on_tiny', 'foreign_drafter', [
          'scripts/decode.py', '--config=configs/tiny.py', '--config.drafter=eagle3',
          '--config.drafters.eagle3.path=demo/eagle3', '--quiet'], 'error',
           '384 does not match the target width 64'),
      f('load_mtp_for_other_weights_warns', '''
          import dspec
          target = dspec.load_target('{fx}/demo_other')
          dspec.load_drafter('mtp', 'demo/mtp', target=target)''', expect='ok',
        setup=other_weights, check=warned),
      Case('decode_mtp_on_other_weights_lossless', 'foreign_drafter', [
          'scripts/decode.py', '--config=configs/demo.py:small',
          '--config.model.path={fx}/demo_other', '--config.max_new_tokens=8',
          '--config.timing_repeats=0', '--quiet', '--config.verify_length=fixed',
          '--metrics_json={sb}/m.json'], 'ok',
           setup=other_weights, check=_all(warned, _lossless())),
  ]
  return cases


def _copy_of(src, rel):
  """setup: `src` ('demo/<x>', 'data', or '{fx}/<x>') copied to sb/rel."""
  def setup(sb, fx):
    path = os.path.join(REPO, src.replace('{fx}', fx))
    if os.path.isdir(path):
      _copy(path, os.path.join(sb, rel))
    else:
      shutil.copy(path, os.path.join(sb, rel))
  return setup


def output_in_input_cases() -> list:
  """No script writes inside anything it reads, with or without --force: eval_drafter.py's
  --out inside its drafter, target or data; bench_trees.py's inside its target or a
  drafter; benchmark.py's and bench_concurrency.py's --out_dir inside their data folder or
  target; and the other scripts' outputs likewise. Inputs are copies, checked unchanged."""
  def o(name, argv, message, *inputs):
    rels = [rel for _, rel in inputs]
    return Case(name, 'outputs_in_inputs', argv, 'error', message,
                _steps(*(_copy_of(src, rel) for src, rel in inputs), _snapshot(*rels)),
                _unchanged(*rels))

  evaluate = ['scripts/eval_drafter.py', '--kind=dflash2']
  trees = ['scripts/bench_trees.py']
  bench = ['scripts/benchmark.py', '--config=configs/bench_tiny.py:nohf,t0']
  inside = 'inside the input '
  return [
      o('eval_drafter_out_inside_path', evaluate + ['--path={sb}/in', '--out={sb}/in/e.json'],
        inside + '--path', ('demo/dflash2', 'in')),
      o('eval_drafter_out_inside_path_force', evaluate + [
          '--path={sb}/in', '--out={sb}/in/state/e.json', '--force'], inside + '--path',
        ('demo/dflash2', 'in')),
      o('eval_drafter_out_inside_target', evaluate + [
          '--path=demo/dflash2', '--target={sb}/t', '--out={sb}/t/e.json'], inside + '--target',
        ('demo/target', 't')),
      o('eval_drafter_out_inside_data', evaluate + [
          '--path=demo/dflash2', '--data={sb}/d', '--out={sb}/d/e.json'], inside + '--data',
        ('demo/distill_demo8k', 'd')),
      o('bench_trees_out_inside_target', trees + [
          '--target={sb}/t', '--out={sb}/t/rows.json'], inside + '--target',
        ('demo/target', 't')),
      o('bench_trees_out_inside_drafter', trees + [
          '--drafters=eagle3:{sb}/e', '--out={sb}/e/rows.json'], inside + '--drafters=eagle3',
        ('demo/eagle3', 'e')),
      o('bench_trees_out_inside_drafter_force', trees + [
          '--drafters=eagle3:{sb}/e', '--out={sb}/e/state/rows.json', '--force'],
        inside + '--drafters=eagle3', ('demo/eagle3', 'e')),
      o('benchmark_out_dir_inside_data_dir', bench + [
          '--config.data_dir={sb}/data', '--out_dir={sb}/data/bench'],
        inside + '--config.data_dir', ('data', 'data')),
      o('benchmark_out_dir_is_data_dir_force', bench + [
          '--config.data_dir={sb}/data', '--out_dir={sb}/data', '--force'],
        inside + '--config.data_dir', ('data', 'data')),
      o('benchmark_out_dir_inside_target', bench + [
          '--config.model.source=checkpoint', '--config.model.path={sb}/t',
          '--out_dir={sb}/t/bench'], inside + '--config.model.path', ('{fx}/target', 't')),
      o('bench_concurrency_out_dir_inside_data_dir', [
          'scripts/bench_concurrency.py', '--config.data_dir={sb}/data',
          '--out_dir={sb}/data/c'], inside + '--config.data_dir', ('data', 'data')),
      o('bench_structured_out_inside_target', [
          'scripts/bench_structured.py', '--target={sb}/t', '--out={sb}/t/s'],
        inside + '--target', ('demo/target', 't')),
      o('bench_buckets_out_inside_drafter', [
          'scripts/bench_buckets.py', '--drafter=mtp:{sb}/m', '--out={sb}/m/r.json'],
        inside + '--drafter', ('demo/mtp', 'm')),
      o('decode_metrics_inside_data_dir', [
          'scripts/decode.py', '--config=configs/tiny.py', '--config.prompt_set=gsm8k_test',
          '--config.data_dir={sb}/data', '--metrics_json={sb}/data/m.json'],
        inside + '--config.data_dir', ('data', 'data')),
      o('decode_metrics_is_token_map', [
          'scripts/decode.py', '--config=configs/demo.py:small', '--config.drafter=mtp',
          '--config.drafters.mtp.token_map={sb}/tm.json', '--metrics_json={sb}/tm.json',
          '--force'], 'token_map', ('demo/token_map_2048.json', 'tm.json')),
      o('distill_out_dir_inside_target', [
          'scripts/distill.py', '--config=configs/distill_demo.py:tiny',
          '--config.model.path={sb}/t', '--out_dir={sb}/t/d'], inside + '--config.model.path',
        ('demo/target', 't')),
      o('train_workdir_inside_data_dir', [
          'scripts/train.py', '--config=configs/demo_target_v2.py:quick',
          '--config.data_dir={sb}/data', '--workdir={sb}/data/run'],
        inside + '--config.data_dir', ('data', 'data')),
  ]


def _names(rel, *expected):
  """check: sb/rel holds exactly `expected` (nothing left over, nothing beside)."""
  def check(sb, fx, proc):
    got = sorted(os.listdir(os.path.join(sb, rel)))
    return None if got == sorted(expected) else f'wrong: {rel or "."} holds {got}'
  return check


def _export_of(rel, kind_key):
  """check: sb/rel is an export (config.json + model.safetensors, nothing else) whose
  config.json has `kind_key` (dflash_config: z-lab DFlash; speculators_model_type: ...)."""
  def check(sb, fx, proc):
    if proc.returncode != 0:
      return None
    problem = _names(rel, 'config.json', 'model.safetensors')(sb, fx, proc)
    config = json.load(open(os.path.join(sb, rel, 'config.json')))
    return problem or (None if kind_key in config else
                       f'wrong: {rel}/config.json lacks {kind_key} (not the new drafter)')
  return check


def force_replace_cases() -> list:
  """--force onto another model: export_drafter.py replaces a dspec checkpoint or an
  earlier export of another drafter whole (nothing of the old one left, nothing left
  beside it) and never mixes two drafters in a folder; a folder holding two models' files
  is refused on load by every entry point; user files are never removed."""
  export = ['scripts/export_drafter.py', '--path=demo/dflash', '--out={sb}/out']
  decode = ['scripts/decode.py', '--config=configs/demo.py:small', '--config.max_new_tokens=4',
            '--config.timing_repeats=0', '--quiet']

  def r(name, argv, expect='error', message='', setup=None, check=None):
    return Case(name, 'force_replace', argv, expect, message, setup, check)

  def mixed(src, files_of):
    """setup: sb/mixed holds a dspec checkpoint (`src`) plus another model's config.json and
    model.safetensors (`files_of(sb, fx)`: their folder)."""
    def setup(sb, fx):
      _copy_of(src, 'mixed')(sb, fx)
      for name in ('config.json', 'model.safetensors'):
        shutil.copy(os.path.join(files_of(sb, fx), name), os.path.join(sb, 'mixed', name))
    return setup

  eagle3_export = lambda sb, fx: _export_fixture(fx, 'eagle3')
  hf = lambda sb, fx: os.path.join(fx, 'hf')
  two = "holds two models' files"
  return [
      r('export_force_onto_other_drafter_checkpoint', export + ['--force'], 'ok',
        setup=_copy_of('demo/eagle3', 'out'),
        check=_all(_export_of('out', 'dflash_config'), _names('', 'out'))),
      r('export_onto_other_drafter_checkpoint', export, message='--force',
        setup=_steps(_copy_of('demo/eagle3', 'out'), _snapshot('out')),
        check=_unchanged('out')),
      r('export_force_onto_other_export', export + ['--force'], 'ok',
        setup=_exported('eagle3', 'out'),
        check=_all(_export_of('out', 'dflash_config'), _names('', 'out'))),
      r('export_onto_own_export_of_other_drafter', export, 'ok',
        setup=_exported('eagle3', 'out'),
        check=_all(_export_of('out', 'dflash_config'), _names('', 'out'))),
      r('export_force_onto_checkpoint_with_user_file', export + ['--force'],
        message="holds another model's files", setup=_steps(_copy_of('demo/eagle3', 'out'),
                                          _planted('out/notes.txt', 'mine'), _snapshot('out')),
        check=_unchanged('out')),
      r('export_force_onto_export_with_user_file', export + ['--force'], 'ok',
        setup=_steps(_exported('eagle3', 'out'), _planted('out/notes.txt', 'mine')),
        check=_all(_planted_intact('out/notes.txt', 'mine'), lambda sb, fx, p: None if p.returncode
                   or 'dflash_config' in json.load(open(f'{sb}/out/config.json'))
                   else 'wrong: config.json is not the new drafter\'s')),
      r('convert_hf_force_onto_drafter_export', [
          'scripts/convert_hf.py', '--hf_dir={fx}/hf', '--out={sb}/out', '--force'],
        message='not a dspec checkpoint',
        setup=_steps(_exported('eagle3', 'out'), _snapshot('out')), check=_unchanged('out')),
      r('api_save_force_onto_drafter_export', _api('''
          from flax import nnx
          from dspec import checkpoint
          checkpoint.save_model('{sb}/out', nnx.Linear(2, 2, rngs=nnx.Rngs(0)), kind='toy',
                                config={}, force=True)'''), message='not a dspec checkpoint',
        setup=_steps(_exported('eagle3', 'out'), _snapshot('out')), check=_unchanged('out')),
      r('decode_drafter_folder_with_two_models', decode + [
          '--config.drafter=eagle3', '--config.drafters.eagle3.path={sb}/mixed'],
        message=two, setup=mixed('demo/eagle3', eagle3_export)),
      r('export_from_folder_with_two_models', [
          'scripts/export_drafter.py', '--path={sb}/mixed', '--out={sb}/out'], message=two,
        setup=mixed('demo/eagle3', eagle3_export), check=_absent('out')),
      r('api_drafter_folder_with_two_models', _api('''
          import dspec
          target = dspec.load_target('demo/target')
          dspec.load_drafter('eagle3', '{sb}/mixed', target=target)'''), message=two,
        setup=mixed('demo/eagle3', eagle3_export)),
      r('decode_target_folder_with_two_models', [
          'scripts/decode.py', '--config=configs/tiny.py', '--config.model.source=checkpoint',
          '--config.model.path={sb}/mixed', '--quiet'], message=two,
        setup=mixed('{fx}/target', hf)),
      r('api_target_folder_with_two_models', _api('''
          import dspec
          dspec.load_target('{sb}/mixed')'''), message=two, setup=mixed('{fx}/target', hf)),
  ]


_FILE_SIZE_LIMIT = ('import resource, runpy, sys\nlimit = int(sys.argv[1])\n'
                    'resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))\n'
                    "sys.argv = sys.argv[2:]\nrunpy.run_path(sys.argv[0], run_name='__main__')")


def _file_size_limit(limit, *argv) -> list:
  """argv run with writes past `limit` bytes failing (EFBIG: a disk that fills up; Python
  ignores SIGXFSZ)."""
  return [PY, '-c', _FILE_SIZE_LIMIT, str(limit), *argv]


def _read_only(rel, *argv) -> list:
  """argv run with sb/rel mounted read-only (its own mount namespace: EROFS)."""
  mount = ('d=$1; shift; mount --bind "$d" "$d" && mount -o remount,bind,ro "$d" "$d" && '
           'exec "$@"')
  return _program('unshare', '-m' if os.geteuid() == 0 else '-rm', 'sh', '-c', mount, 'sh',
                  '{sb}/' + rel, PY, *argv)


def _immutable(rel):
  """setup: sb/rel made immutable (chattr +i: no entry created, renamed or removed in it,
  even by root: EPERM); undone after the case however it ends."""
  def setup(sb, fx):
    path = os.path.join(sb, rel)
    os.makedirs(path, exist_ok=True)
    subprocess.run(['chattr', '+i', path], check=True)
    _CLEANUPS.setdefault(sb, []).append(
        lambda: subprocess.run(['chattr', '-i', path], check=False))
  return setup


def _no_dac_override(*argv) -> list:
  """argv run without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (so that root, too, is
  refused a folder without write permission: EACCES)."""
  return _program('setpriv', '--bounding-set=-dac_override,-dac_read_search', '--', PY,
                  *argv)


def _unwritable(rel):
  """setup: sb/rel made read and execute only (0555); its mode is put back after the
  case."""
  def setup(sb, fx):
    path = os.path.join(sb, rel)
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o555)
    _CLEANUPS.setdefault(sb, []).append(lambda: os.chmod(path, 0o755))
  return setup


def disk_cases() -> list:
  """A write that fails (a full disk, a file-size limit, a read-only file system, an
  immutable folder) is one error line naming the output; the previous output is intact
  and nothing is left beside it."""
  decode = ['scripts/decode.py', '--config=configs/tiny.py', '--config.max_new_tokens=4',
            '--config.timing_repeats=0', '--quiet', '--compilation_cache_dir=']
  export = ['scripts/export_drafter.py', '--path=demo/dflash']
  convert = ['scripts/convert_hf.py', '--hf_dir={fx}/hf']

  def w(name, argv, message, setup=None, check=None):
    return Case(name, 'disk', argv, 'error', message, setup, check)

  full = 'cannot write it (No space left on device)'
  big = 'cannot write it (File too large)'
  ro = 'cannot write it (Read-only file system)'
  denied = 'cannot write it (Operation not permitted)'
  previous = _steps(_marked_json('out/m.json'), _snapshot('out'))
  previous_export = _steps(_exported('eagle3', 'out'), _snapshot('out'))
  previous_ckpt = _steps(_copy_of('{fx}/target', 'out'), _snapshot('out'))
  return [
      w('decode_metrics_to_dev_full', decode + ['--metrics_json=/dev/full'],
        '/dev/full: ' + full),
      w('decode_trace_to_dev_full', decode + ['--trace_json=/dev/full'], '/dev/full: ' + full),
      w('api_write_json_to_dev_full', _api('''
          from dspec import files
          files.write_json_atomic('/dev/full', {'a': 1})'''), '/dev/full: ' + full),
      w('decode_metrics_file_size_limit', _file_size_limit(
          512, *decode, '--metrics_json={sb}/out/m.json'), '{sb}/out/m.json: ' + big,
        previous, _all(_unchanged('out'), _names('out', 'm.json'))),
      w('export_file_size_limit_keeps_previous', _file_size_limit(
          2 ** 20, *export, '--out={sb}/out', '--force'), '{sb}/out: ' + big,
        previous_export, _all(_unchanged('out'), _names('', 'out'))),
      w('export_file_size_limit_new_out', _file_size_limit(
          2 ** 20, *export, '--out={sb}/out'), '{sb}/out: ' + big, check=_names('')),
      w('convert_hf_file_size_limit_keeps_previous', _file_size_limit(
          2 ** 16, *convert, '--out={sb}/out', '--force'), '{sb}/out: ' + big,
        previous_ckpt, _all(_unchanged('out'), _names('', 'out'))),
      w('api_save_model_file_size_limit', _api('''
          import resource
          import dspec
          from dspec import checkpoint
          model = dspec.load_target('{sb}/out').model
          resource.setrlimit(resource.RLIMIT_FSIZE, (2 ** 16, 2 ** 16))
          checkpoint.save_model('{sb}/out', model, kind='target', config=model.cfg.to_dict(),
                                force=True)'''), '{sb}/out: ' + big, previous_ckpt,
        _all(_unchanged('out'), _names('', 'out'))),
      w('decode_metrics_read_only_fs', _read_only(
          'out', *decode, '--metrics_json={sb}/out/m.json'), '{sb}/out/m.json: ' + ro,
        previous, _unchanged('out')),
      w('export_read_only_fs', _read_only('ro', *export, '--out={sb}/ro/x'),
        '{sb}/ro/x: ' + ro, lambda sb, fx: os.makedirs(f'{sb}/ro'), _names('ro')),
      w('convert_hf_read_only_fs', _read_only('ro', *convert, '--out={sb}/ro/ckpt'),
        '{sb}/ro/ckpt: ' + ro, lambda sb, fx: os.makedirs(f'{sb}/ro'), _names('ro')),
      w('distill_read_only_fs', _read_only(
          'ro', 'scripts/distill.py', '--config=configs/distill_demo.py:tiny',
          '--out_dir={sb}/ro/d'), '{sb}/ro/d', lambda sb, fx: os.makedirs(f'{sb}/ro'),
        _names('ro')),
      w('export_permission_denied_keeps_previous', _no_dac_override(
          *export, '--out={sb}/p/out', '--force'),
        '{sb}/p/out: cannot write it (Permission denied)',
        _steps(_exported('eagle3', 'p/out'), _snapshot('p'), _unwritable('p')),
        _unchanged('p')),
      w('decode_metrics_permission_denied', _no_dac_override(
          *decode, '--metrics_json={sb}/out/m.json'),
        '{sb}/out/m.json: cannot write it (Permission denied)',
        _steps(previous, _unwritable('out')), _unchanged('out')),
      w('decode_metrics_immutable_dir', decode + ['--metrics_json={sb}/out/m.json'],
        '{sb}/out/m.json: ' + denied, _steps(previous, _immutable('out')), _unchanged('out')),
      w('export_immutable_parent_keeps_previous', export + ['--out={sb}/p/out', '--force'],
        '{sb}/p/out: ' + denied, _steps(_exported('eagle3', 'p/out'), _snapshot('p'),
                                        _immutable('p')), _unchanged('p')),
  ]


def _raises(cls, call, *before, base='errors.DspecError'):
  """API code: `call` raises `cls` (and `base`), through the CLI wrapper as one line; any
  other exception becomes a RuntimeError (a traceback: the documented class was not
  raised), none at all exits 0 (silently wrong)."""
  lines = ['import dspec', 'from dspec import errors, files',
           'from dspec.checkpoint import CheckpointError', *before, 'try:', f'  {call}',
           'except Exception as e:',
           f'  if not (isinstance(e, {cls}) and isinstance(e, {base})):',
           f"    raise RuntimeError(f'raised {{type(e).__name__}}, not {cls}: {{e}}') from None",
           '  raise']
  return _api('\n'.join(lines))


def api_error_cases() -> list:
  """The API's errors are the documented `dspec.errors` classes: a checkpoint of the wrong
  kind, missing, damaged or mixed is a CheckpointError (a ValueError), a bad argument a
  ValueError, a refused or failed output an OutputPathError or WriteError, a held folder a
  LockedError (OSErrors): one `except` catches each family."""
  demo = "target = dspec.load_target('demo/target')"

  def e(name, cls, call, *before, message='', setup=None, check=None, base=None):
    base = base or ('OSError' if cls.startswith('files.') else 'ValueError')
    return Case(name, 'api_errors', _raises(cls, call, *before, base=base), 'error',
                message, setup, check)

  ckpt = 'CheckpointError'
  return [
      e('load_target_of_a_drafter', ckpt, "dspec.load_target('demo/mtp')", message='mtp'),
      e('load_target_of_a_drafter_export', ckpt, "dspec.load_target('{sb}/in')",
        message='{sb}/in', setup=_exported('eagle3')),
      e('load_target_missing', ckpt, "dspec.load_target('/nonexistent/target')",
        message='/nonexistent/target'),
      e('load_target_of_a_file', ckpt, "dspec.load_target('{sb}/file')", message='{sb}/file',
        setup=lambda sb, fx: _write(f'{sb}/file', 'x')),
      e('load_target_flipped_byte', ckpt, "dspec.load_target('{sb}/in')", message='checksum',
        setup=lambda sb, fx: (_copy_of('{fx}/target', 'in')(sb, fx),
                              _flip_byte(_largest_data_file(f'{sb}/in')))),
      e('load_drafter_of_another_kind', ckpt,
        "dspec.load_drafter('dflash', 'demo/mtp', target=target)", demo, message='mtp'),
      e('load_drafter_of_a_target', ckpt,
        "dspec.load_drafter('mtp', 'demo/target', target=target)", demo, message='target'),
      e('load_drafter_export_of_another_kind', ckpt,
        "dspec.load_drafter('dflash', '{sb}/in', target=target)", demo, message='{sb}/in',
        setup=_exported('eagle3')),
      e('load_drafter_missing', ckpt,
        "dspec.load_drafter('mtp', '/nonexistent/mtp', target=target)", demo,
        message='/nonexistent/mtp'),
      e('load_drafter_bad_argument', 'ValueError',
        "dspec.load_drafter('ngram', target=target, num_draft=4.0)", demo,
        message='num_draft', base='ValueError'),
      e('generate_bad_argument', 'ValueError', "dspec.generate(target, None)", demo,
        message='prompts', base='ValueError'),
      e('write_through_symlink', 'files.OutputPathError',
        "files.write_json_atomic('{sb}/link.json', {'a': 1})", message='symlink',
        setup=_steps(_planted('real.json'), _link('real.json', 'link.json'),
                     _snapshot('real.json')), check=_unchanged('real.json')),
      e('write_to_dev_full', 'files.WriteError',
        "files.write_json_atomic('/dev/full', {'a': 1})", message='/dev/full'),
      e('folder_held_by_another_process', 'files.LockedError',
        "files.directory_lock('{sb}/run', 'trainer').__enter__()", message='another trainer',
        setup=_hold_lock('run', 'trainer'), check=_release),
      e('save_force_onto_user_folder', ckpt, "dspec.checkpoint.save_model('{sb}/keep', "
        "nnx.Linear(2, 2, rngs=nnx.Rngs(0)), kind='toy', config={}, force=True)",
        'import dspec.checkpoint', 'from flax import nnx', message='not a dspec checkpoint',
        setup=_steps(_planted(), _snapshot('keep')), check=_unchanged('keep')),
  ]


_YES_NO = r'(Yes|No)\. [A-Za-z ,]{1,30}\.'
_SCHEMA = {'type': 'object',
           'properties': {'name': {'type': 'string', 'maxLength': 12},
                          'age': {'type': 'integer', 'minimum': 0, 'maximum': 999}},
           'required': ['name', 'age'], 'additionalProperties': False}
_GRAMMAR = 'start: ("Yes" | "No") ". " WORD "."\nWORD: /[a-z]{1,12}/\n'


def _follows(kind, source=None):
  """check: the metrics JSON's output matches the constraint where it says it completed
  (re.fullmatch for a regex; JSON with the schema's two keys)."""
  def check(sb, fx, proc):
    if proc.returncode != 0:
      return None
    report = _strict_json(os.path.join(sb, 'm.json'))
    texts = report.get('texts') or [report.get('text')]
    complete = report.get('constraint_complete') or []
    for text, done in zip(texts, complete):
      if not done:
        continue
      if kind == 'regex' and not re.fullmatch(source, text):
        return f'wrong: {text!r} does not match {source}'
      if kind == 'json_schema':
        try:
          value = json.loads(text)
        except ValueError:
          return f'wrong: {text!r} is not JSON'
        if not isinstance(value, dict) or set(value) != {'name', 'age'}:
          return f'wrong: {text!r} does not follow the schema'
    return None
  return check


def structured_cases() -> list:
  """Structured output (--json_schema, --regex, --grammar): a missing or invalid file, a
  bad or unsatisfiable constraint, one where it cannot run (a mesh, a byte tokenizer, two
  at once) and the grammar drafter without one are each one error line before anything
  compiles; with a drafter, chains and trees, the output equals constrained AR's."""
  base = ['scripts/decode.py', '--config=configs/demo.py:small', '--config.drafter=ngram',
          '--config.max_new_tokens=16', '--config.timing_repeats=0', '--quiet']

  def s(name, *args, message='', expect='error', setup=None, check=None,
        prompt='Question: Is 7 a prime number?\nAnswer: '):
    if expect == 'ok':
      args += ('--config.compare_ar=True', '--metrics_json={sb}/m.json')
    return Case(name, 'structured', base + [f'--prompt={prompt}', *args], expect, message,
                setup, check)

  def file(rel, text):
    return lambda sb, fx: _write(os.path.join(sb, rel), text, 'wb' if isinstance(
        text, bytes) else 'w')

  schema = json.dumps(_SCHEMA)
  api = '''
      import dspec
      target = dspec.load_target('demo/target')
      dspec.generate(target, ['a', 'b'], max_new_tokens=4, {})'''
  return [
      s('json_schema_missing', '--json_schema={sb}/nope.json',
        message='--json_schema={sb}/nope.json: cannot read it'),
      s('json_schema_is_directory', '--json_schema={sb}', message='cannot read it'),
      s('json_schema_binary', '--json_schema={sb}/s.json', message='cannot read it',
        setup=file('s.json', b'\xff\xfe{')),
      s('json_schema_truncated', '--json_schema={sb}/s.json',
        message='json_schema: not valid JSON', setup=file('s.json', '{"type": "object",')),
      s('json_schema_list', '--json_schema={sb}/s.json', message='a schema is a JSON object',
        setup=file('s.json', '[1, 2]')),
      s('json_schema_string', '--json_schema={sb}/s.json',
        message='a schema is a JSON object', setup=file('s.json', '"object"')),
      s('json_schema_unknown_type', '--json_schema={sb}/s.json', message='json_schema: ',
        setup=file('s.json', '{"type": "nonsense"}')),
      s('json_schema_empty_file', '--json_schema={sb}/s.json',
        message='json_schema: the constraint is empty', setup=file('s.json', '')),
      s('regex_invalid', '--regex=[0-9', message='regex: '),
      s('regex_unbalanced', '--regex=(ab', message='regex: '),
      s('regex_empty', '--regex=', message='regex: the constraint is empty'),
      s('regex_only_the_empty_output', '--regex=a{0}', message='allows no output'),
      s('grammar_missing', '--grammar={sb}/nope.lark',
        message='--grammar={sb}/nope.lark: cannot read it'),
      s('grammar_invalid', '--grammar={sb}/g.lark', message='grammar: ',
        setup=file('g.lark', 'start: ((\n')),
      s('grammar_without_start', '--grammar={sb}/g.lark', message='grammar: ',
        setup=file('g.lark', 'foo: "a"\n')),
      s('two_constraints', '--regex=a+', '--json_schema={sb}/s.json', message='give one of',
        setup=file('s.json', schema)),
      s('grammar_drafter_without_constraint', '--config.drafter=grammar',
        message='drafts only the tokens a constraint forces'),
      s('noforced_drafts_without_constraint', '--noforced_drafts',
        message='--noforced_drafts needs a constraint'),
      Case('constraint_on_a_byte_tokenizer', 'structured', [
          'scripts/decode.py', '--config=configs/tiny.py', '--regex=a+', '--quiet'], 'error',
           'needs a model with a tokenizer.json'),
      Case('api_regex_invalid', 'structured', _api(api.format("regex='[0-9'")), 'error',
           'regex: '),
      Case('api_one_constraint_for_two_prompts', 'structured',
           _api(api.format("regex=['a+']")), 'error', 'one entry (or None) per prompt (2)'),
      Case('api_two_constraints_for_a_row', 'structured',
           _api(api.format("regex='a+', json_schema={'type': 'object'}")), 'error',
           'give one constraint per row'),
      s('regex_ngram_lossless', f'--regex={_YES_NO}', expect='ok',
        check=_all(_lossless(), _follows('regex', _YES_NO))),
      s('json_schema_mtp_lossless', '--config.drafter=mtp', '--json_schema={sb}/s.json',
        '--config.max_new_tokens=24', prompt='A person described in JSON: ', expect='ok',
        setup=file('s.json', schema), check=_all(_lossless(), _follows('json_schema'))),
      s('grammar_drafter_lossless', '--config.drafter=grammar', '--grammar={sb}/g.lark',
        expect='ok', setup=file('g.lark', _GRAMMAR), check=_lossless()),
      s('regex_tree_lossless', f'--regex={_YES_NO}', '--config.verify_length=tree',
        expect='ok', check=_all(_lossless(verify_length='tree'), _follows('regex', _YES_NO))),
      s('regex_noforced_drafts_lossless', f'--regex={_YES_NO}', '--noforced_drafts',
        '--config.verify_length=fixed', expect='ok',
        check=_all(_lossless(), _follows('regex', _YES_NO))),
  ]


def lossless_mode_cases() -> list:
  """Token trees (verify_length tree and auto_tree) give AR's output token for token, with
  every tree drafter, on ragged batches and small or degenerate tree shapes (lossless in
  the metrics JSON); a drafter with no tree mode is refused."""
  tiny = ['scripts/decode.py', '--config=configs/tiny.py', '--config.max_new_tokens=12',
          '--config.timing_repeats=0', '--quiet', '--config.compare_ar=True',
          '--metrics_json={sb}/m.json']
  demo = ['scripts/decode.py', '--config=configs/demo.py:small', '--config.max_new_tokens=12',
          '--config.timing_repeats=0', '--quiet', '--metrics_json={sb}/m.json']
  quick_profile = ['--config.controller.profile_repeats=1', '--config.controller.profile_steps=2']

  def l(name, base, drafter, mode, *args):
    return Case(name, 'lossless_modes', base + [f'--config.drafter={drafter}',
                                                f'--config.verify_length={mode}', *args],
                'ok', check=_lossless(verify_length=mode))

  return [
      l('tiny_ngram_tree', tiny, 'ngram', 'tree'),
      l('tiny_ngram_auto_tree', tiny, 'ngram', 'auto_tree', *quick_profile),
      l('tiny_self_tree', tiny, 'self', 'tree'),
      l('tiny_ngram_tree_ragged_batch', tiny, 'ngram', 'tree', '--prompt=def f(x):',
        '--prompt=abcabcabc', '--prompt=1, 2, 3, 1, 2, 3, 1', '--config.batch_size=3'),
      l('tiny_ngram_tree_4_nodes', tiny, 'ngram', 'tree', '--config.tree.num_nodes=4',
        '--config.tree.top_k=2'),
      l('tiny_ngram_tree_top_k_one', tiny, 'ngram', 'tree', '--config.tree.num_nodes=8',
        '--config.tree.top_k=1'),
      Case('tiny_suffix_tree_refused', 'lossless_modes', tiny + [
          '--config.drafter=suffix', '--config.verify_length=tree'], 'error',
           'verify_length=tree', check=_absent('m.json')),
      l('eagle3_tree', demo, 'eagle3', 'tree'),
      l('dflash2_tree', demo + ['--config.drafters.dflash.path=demo/dflash2'], 'dflash',
        'tree'),
      l('dspark_tree', demo, 'dspark', 'tree'),
      l('mtp_auto_tree', demo, 'mtp', 'auto_tree', *quick_profile),
  ]

def all_cases() -> list:
  return (decode_cases() + train_cases() + distill_cases() + convert_cases() + bench_cases()
          + api_cases() + output_cases() + api_arg_cases() + config_cases() + context_cases()
          + named_file_cases() + lock_cases() + multiprocess_cases() + knob_cases()
          + ckpt_value_cases() + foreign_drafter_cases() + output_in_input_cases()
          + force_replace_cases() + disk_cases() + api_error_cases() + structured_cases()
          + lossless_mode_cases())


# ------------------------------------------------------------------------------ running

def _limit_memory(gb):
  def preexec():
    limit = gb * 2 ** 30
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  return preexec


def classify(case: Case, proc, problem: Optional[str], fill) -> tuple[str, str]:
  """(category, note) of one finished case."""
  if proc is None:
    return 'hang', f'no exit within {case.timeout} s'
  stderr = proc.stderr
  errors = [line for line in stderr.splitlines() if line.startswith('error: ')]
  if problem and problem.startswith('data loss'):
    return 'data loss', problem
  if 'Traceback (most recent call last)' in stderr:
    last = [line for line in stderr.strip().splitlines() if line.strip()][-1:]
    return 'traceback', last[0][:160] if last else ''
  if proc.returncode != 0:
    if proc.returncode != case.status or len(errors) != 1:
      return 'traceback', f'exit {proc.returncode}, {len(errors)} error lines'
    note = errors[0][:160]
    if problem:
      return 'silently wrong', problem
    if case.expect == 'ok':
      note = 'refused an input that should work: ' + note
    elif case.message and fill(case.message) not in errors[0]:
      note = f'(message lacks {case.message!r}) ' + note
    return 'clean error', note
  if problem:
    return 'silently wrong', problem
  if case.expect == 'error':
    if case.warning and case.warning in stderr:
      return 'ok', f'warned: {case.warning}'
    return 'silently wrong', 'exit 0 where an error was due'
  return 'ok', ''


def run_case(case: Case, scratch: str, fx: str) -> tuple[str, str, float]:
  sb = os.path.join(scratch, f'{case.group}-{case.name}')
  os.makedirs(sb)
  fill = lambda s: s.replace('{sb}', sb).replace('{fx}', fx).replace('{repo}', REPO)
  argv = [fill(a) for a in case.argv]
  if argv[0] != PY:
    argv = [PY] + argv
  cwd = REPO if case.cwd == 'repo' else os.path.join(sb, case.cwd[3:])
  t0 = time.time()
  try:
    if case.setup:
      case.setup(sb, fx)
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                          timeout=case.timeout, preexec_fn=_limit_memory(case.memory_gb))
  except subprocess.TimeoutExpired:
    proc = None
  problem = None
  if proc is not None and case.check:
    problem = case.check(sb, fx, proc)
  _release(sb, fx, proc)
  category, note = classify(case, proc, problem, fill)
  return category, note, time.time() - t0


def markdown_table(results: list, wall_s: float) -> str:
  """The counts per group and category, the command and the cases that were not clean."""
  groups = list(dict.fromkeys(r['group'] for r in results))
  head = ['group', 'cases', *CATEGORIES]
  lines = [TABLE_TITLE, '',
           f'`python scripts/redteam.py` ({time.strftime("%Y-%m-%d", time.gmtime())}, '
           f'{wall_s / 60:.0f} min on {os.cpu_count()} CPU cores): {len(results)} cases, '
           'each in its own subprocess and scratch directory (categories: the docstring of '
           'scripts/redteam.py).', '',
           '| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
  for group in groups + ['total']:
    rows = [r for r in results if group in ('total', r['group'])]
    cells = [group, len(rows)] + [sum(r['category'] == c for r in rows) for c in CATEGORIES]
    lines.append('| ' + ' | '.join(f'**{c}**' if group == 'total' else str(c)
                                   for c in cells) + ' |')
  bad = [r for r in results if r['category'] in BAD]
  lines += ['', 'Not clean: ' + ('none.' if not bad else '')]
  lines += [f'- {r["group"]}/{r["name"]}: {r["category"]} ({r["note"]})' for r in bad]
  return '\n'.join(lines) + '\n'


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--only', default='', help='comma-separated substrings: run the '
                      'cases whose group/name contains one of them')
  parser.add_argument('--json', default='', help='also write the results here')
  parser.add_argument('--table', default='', help='also write the counts per group as a '
                      'markdown table here')
  parser.add_argument('--keep', action='store_true', help='keep the scratch directory')
  parser.add_argument('--force', action='store_true', help='replace --json / --table files '
                      'dspec did not write')
  args = parser.parse_args()
  sys.path.insert(0, REPO)
  from dspec import files   # the output-path policy, checked before the 45 minutes of cases
  try:
    files.check_outputs({'--json': args.json or None, '--table': args.table or None},
                        force=args.force, ours={'--table': files.starts_with(TABLE_TITLE)})
  except files.OutputPathError as e:
    parser.exit(1, f'error: {e}\n')
  only = args.only.split(',')
  cases = [c for c in all_cases() if any(o in f'{c.group}/{c.name}' for o in only)]
  scratch = tempfile.mkdtemp(prefix='dspec-redteam-')
  fx = os.path.join(scratch, '_fixtures')
  print(f'{len(cases)} cases; scratch {scratch}', flush=True)
  build_fixtures(fx)
  results, counts = [], {c: 0 for c in CATEGORIES}
  t_start = time.time()
  try:
    for i, case in enumerate(cases):
      category, note, seconds = run_case(case, scratch, fx)
      counts[category] += 1
      results.append({'group': case.group, 'name': case.name, 'category': category,
                      'note': note, 'seconds': round(seconds, 1)})
      print(f'[{i + 1:3d}/{len(cases)}] {category:14s} {case.group}/{case.name} '
            f'({seconds:.0f}s) {note}', flush=True)
  finally:
    for sb in list(_HOLDERS) + list(_CLEANUPS):
      _release(sb, fx, None)
    if not args.keep:
      shutil.rmtree(scratch, ignore_errors=True)
  print(f'\n{len(results)} cases in {(time.time() - t_start) / 60:.1f} min')
  for category in CATEGORIES:
    print(f'  {category:15s} {counts[category]}')
  if args.json:
    files.write_json_atomic(args.json, files.mark({'counts': counts, 'cases': results},
                                                  'redteam'))
  if args.table:
    files.write_text_atomic(args.table, markdown_table(results, time.time() - t_start))
  bad = sum(counts[c] for c in BAD)
  sys.exit(1 if bad else 0)


if __name__ == '__main__':
  main()
