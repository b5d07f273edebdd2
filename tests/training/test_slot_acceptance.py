"""Teacher-forced per-slot acceptance (dspec/training/slot_acceptance.py): the statistics,
and agreement with T = 0 decoding of the committed demo block drafters (DFlash, DFlash-2,
DSpark) at fixed verification."""

import functools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from conftest import REPO_ROOT
from dspec.decoding.drafters.dflash import DFlashDrafter
from dspec.decoding.drafters.dspark import DSparkDrafter
from dspec.decoding.engine import SpeculativeEngine
from dspec.decoding.prompts import pad_prompts
from dspec.models import dflash2
from dspec.training import slot_acceptance
from dspec.training.slot_acceptance import SlotTable

PROMPTS = ('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
           'Question: Tom has 3 boxes with 12 apples each. He gives away 7 apples. How many '
           'apples does he have left?\nAnswer:',
           'def is_prime(n):\n')
NEW_TOKENS = 48
PROMPT_WIDTH = 64    # every prompt padded to it
ROW_WIDTH = 128      # >= prompt + NEW_TOKENS + a block + 1 (the end steps' longer decode)


def test_slot_table_statistics_by_hand():
  # 3 anchors, K = 3. Anchor 0 hits 1, 2 and misses 3; anchor 1 misses slot 1 but hits
  # slot 2 (no effect on the run); anchor 2 hits slot 1, slot 2 is not target-written.
  hit = [[1, 1, 0], [0, 1, 1], [1, 0, 0]]
  valid = [[1, 1, 1], [1, 1, 1], [1, 0, 0]]
  table = SlotTable.from_hits(hit, valid)
  assert table.num_anchors == 3
  np.testing.assert_array_equal(table.reached_K, [3, 1, 1])
  np.testing.assert_array_equal(table.passed_K, [2, 1, 0])
  np.testing.assert_allclose(table.conditional, [2 / 3, 1.0, 0.0])
  np.testing.assert_allclose(table.start_hit, [2 / 3, 2 / 3, 0.0])
  np.testing.assert_allclose(table.marginal, [2 / 3, 1.0, 0.5])
  assert table.tau == pytest.approx(1 + 4 / 3)
  assert table.to_dict()['reached'] == [3, 1, 1]


@pytest.fixture(scope='module')
def demo_target():
  from dspec.loading import build_target
  from configs import dflash_demo
  cfg = dflash_demo.get_config()
  cfg.model.path = os.path.join(REPO_ROOT, 'demo', 'target')
  target, tokenizer, _ = build_target(cfg.model)
  return target, tokenizer


def _demo_drafter(name, target):
  from dspec.models.formats.dflash import load_dflash
  from dspec.models.formats.dspark import load_dspark
  load = load_dspark if name == 'dspark' else load_dflash
  return load(os.path.join(REPO_ROOT, 'demo', name), num_target_layers=target.cfg.num_layers)


@functools.lru_cache(maxsize=None)
def _engine(target, drafter):
  """One traced engine per drafter (every decode below shares its compiled programs)."""
  if slot_acceptance.kind_of(drafter) == 'dspark':
    spec_drafter, dparams = DSparkDrafter.create(drafter, verify_cost=0.0)
  else:
    spec_drafter, dparams = DFlashDrafter.create(drafter)
  graphdef, params = nnx.split(target)
  return SpeculativeEngine(graphdef, drafter=spec_drafter, trace=True), params, dparams


@functools.lru_cache(maxsize=None)
def _decode(target, drafter, prompt, new_tokens):
  """(row tokens, committed tokens per verify step, drafts per step [S, K]) of a T = 0
  decode verifying every draft (cached: the mutation check reuses it). DSpark verifies its
  whole block (λ = 0: its confidence rule then keeps every draft). Every call has one
  prompt width and token buffer: one compile per drafter."""
  engine, params, dparams = _engine(target, drafter)
  prompt_BP, lens = pad_prompts([prompt], width_multiple=PROMPT_WIDTH)
  state = engine.generate(params, dparams, engine.prefill(
      params, dparams, prompt_BP, lens, max_new_tokens=new_tokens,
      buffer_len=engine.buffer_len(PROMPT_WIDTH, NEW_TOKENS + 32)))
  n, steps = int(state.num_tokens_B[0]), int(state.stats.steps_B[0])
  committed = np.asarray(state.stats.row0_committed_S)[:steps]
  return (np.asarray(state.tokens_BL[0, :n]), committed,
          np.asarray(state.trace.drafts_SG)[:steps])


def _padded(row):
  """`row` zero-padded to ROW_WIDTH (one shape for the teacher-forced programs: the target
  is causal, so the padding changes no draft at the row's anchors)."""
  assert len(row) <= ROW_WIDTH, len(row)
  return np.pad(row, (0, ROW_WIDTH - len(row)))


def _agreement(target, tokenizer, drafter):
  """(steps where the teacher-forced run of hits equals the drafts decode accepted, steps
  compared, decode τ over those steps, the rows' table with its decode walk, end steps
  whose drafts equal teacher forcing's, end steps): the steps compared have a whole block
  inside the budget; the end steps do not, and their drafts are teacher-forced on a longer
  decode of the same prompt."""
  k = slot_acceptance.num_slots(drafter)
  same = total = decode_committed = end_same = end_total = 0
  hits, valids, walk_steps, walk_committed = [], [], 0, 0
  for text in PROMPTS:
    prompt = tuple(tokenizer.encode(text))
    p = len(prompt)
    row, committed, drafts_SK = _decode(target, drafter, prompt, NEW_TOKENS)
    mask = np.zeros(ROW_WIDTH, bool)
    mask[p:len(row)] = True
    all_anchors = slot_acceptance.decode_anchors(mask)
    hit, valid = slot_acceptance.row_hits(drafter, target, _padded(row), mask, all_anchors,
                                          k)
    hits.append(hit)
    valids.append(valid)
    steps, tokens = slot_acceptance.decode_walk(all_anchors, hit, valid, p)
    walk_steps, walk_committed = walk_steps + steps, walk_committed + tokens
    # The prefill commits token p, so the first verify step drafts from position p.
    anchors = p + np.concatenate([[0], np.cumsum(committed)[:-1]])
    full = anchors + k <= len(row) - 1     # the whole block inside the decoded budget
    run = np.cumprod(hit & valid, axis=1).sum(axis=1)[np.searchsorted(all_anchors,
                                                                      anchors[full])]
    same += int(np.sum(run == committed[full] - 1))
    total += int(full.sum())
    decode_committed += int(committed[full].sum())
    long_row = _decode(target, drafter, prompt, NEW_TOKENS + k + 1)[0]
    end_N = anchors[~full]
    padded_1N = np.pad(end_N, (0, slot_acceptance.ANCHORS_PER_CALL - len(end_N)),
                       mode='edge')[None].astype(np.int32)
    forced_NK = np.asarray(slot_acceptance.anchor_drafts(drafter, target,
                                                         _padded(long_row)[None], padded_1N,
                                                         k))[0, :len(end_N)]
    end_same += int(np.sum(np.all(forced_NK == drafts_SK[~full], axis=1)))
    end_total += len(end_N)
  table = SlotTable.from_hits(np.concatenate(hits), np.concatenate(valids), walk_steps,
                              walk_committed)
  return same, total, decode_committed / max(total, 1), table, end_same, end_total


@pytest.mark.slow
@pytest.mark.parametrize('name', ['dflash', 'dflash2', 'dspark'])
def test_teacher_forced_walk_equals_decode(demo_target, name, monkeypatch):
  """At every step a T = 0 decode ran with a whole block inside its budget, the
  teacher-forced run of hits equals the drafts decode accepted, and the table's decode
  walk commits exactly decode's tokens per step: decoding drafts as training did (the
  whole block, whatever the budget left: at the end of the budget its drafts are still
  teacher forcing's). (The all-anchor `tau` weights every position
  alike, so on rows with long easy stretches it sits well above decode τ: it is printed,
  not compared.) Drafting DFlash-2 without its candidate selector (unary argmax) fails the
  agreement."""
  target, tokenizer = demo_target
  drafter = _demo_drafter(name, target)
  same, total, decode_tau, table, end_same, end_total = _agreement(target, tokenizer,
                                                                   drafter)
  print(f'{name}: agree {same}/{total} decode tau {decode_tau:.3f} walk tau '
        f'{table.walk_tau:.3f} all-anchor tau {table.tau:.3f}; end steps {end_same}/'
        f'{end_total}')
  assert total >= 8 and end_total >= 3, (total, end_total)
  assert same == total, (same, total)
  assert table.walk_tau == pytest.approx(decode_tau, rel=1e-9), (table.walk_tau, decode_tau)
  assert end_same == end_total, (end_same, end_total)   # z-lab's shrinking block fails
  if name != 'dflash2':
    return

  unary = lambda d, t, hidden, anchor, **kw: dflash2.SelectorWalk(
      d.draft_logits(t, hidden).argmax(-1), None, None)
  monkeypatch.setattr(slot_acceptance, 'propose_block', unary)
  slot_acceptance.anchor_drafts.clear_cache()
  mutated_same, mutated_total = _agreement(target, tokenizer, drafter)[:2]
  slot_acceptance.anchor_drafts.clear_cache()
  assert mutated_same < 0.97 * mutated_total, (mutated_same, mutated_total)


def _eval_drafter(*args):
  return subprocess.run([sys.executable, os.path.join(REPO_ROOT, 'scripts', 'eval_drafter.py'),
                         '--kind=dflash2', f'--path={os.path.join(REPO_ROOT, "demo", "dflash2")}',
                         f'--target={os.path.join(REPO_ROOT, "demo", "target")}', *args],
                        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_eval_drafter_cli_writes_the_table_and_refuses_bad_input(tmp_path):
  """The script evaluates the held-out rows of a distilled set, or the benchmark prompts'
  greedy continuations (--prompts), and writes its JSON; a missing drafter, a non-dspec
  --out or a wrong --kind is one error line."""
  data = tmp_path / 'distilled'
  data.mkdir()
  rng = np.random.default_rng(0)
  tokens = rng.integers(2, 8000, size=(40, 48)).astype(np.int32)
  mask = np.zeros(tokens.shape, bool)
  mask[:, 16:] = True
  np.savez(data / 'shard_00000.npz', tokens=tokens, loss_mask=mask,
           lengths=np.full(40, 48, np.int32))
  (data / 'manifest.json').write_text(json.dumps({'shards': ['shard_00000.npz']}))
  out = tmp_path / 'eval.json'
  done = _eval_drafter(f'--data={data}', f'--out={out}')
  assert done.returncode == 0, done.stderr[-2000:]
  assert 'walk tau' in done.stdout
  table = json.loads(out.read_text())
  assert table['kind'] == 'dflash2' and table['num_slots'] == 15 and table['rows'] == 1
  # anchors 15..46: the last prompt token and every written token but the last
  assert table['num_anchors'] == 48 - 16 and len(table['conditional']) == 15
  assert 1.0 <= table['tau'] <= 16.0

  bench = tmp_path / 'bench.json'   # the benchmark prompts' greedy continuations
  done = _eval_drafter('--prompts=1', '--max_new_tokens=24', f'--out={bench}')
  assert done.returncode == 0, done.stderr[-2000:]
  table = json.loads(bench.read_text())
  assert table['rows'] == 2 and 'GSM8K' in table['data'] and table['walk_steps'] >= 2
  assert 2 <= table['num_anchors'] <= 48 and 1.0 <= table['walk_tau'] <= 16.0

  other = tmp_path / 'notes.json'
  other.write_text('{"mine": 1}')
  for args, words in [([f'--data={data}', f'--out={other}'], 'not written by dspec'),
                      ([f'--data={data}', '--path=/nonexistent/x'], 'no such directory')]:
    done = _eval_drafter(*args)
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith(
        'error: ') and words in done.stderr, done.stderr[-2000:]
  assert other.read_text() == '{"mine": 1}'
