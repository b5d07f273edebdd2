"""One tokenizer interface for every model: Hugging Face `tokenizer.json`, raw bytes, or
none (token ids only).

`load_tokenizer(model_dir, vocab_size)` picks the right one: an `HFTokenizer` when the model
directory ships a `tokenizer.json`; else, for a model with a vocabulary of its own (a
Hugging Face model, `byte_fallback=False`), an `IdsOnlyTokenizer`: prompts must be token
ids, and the stop ids are the ones the model's config files declare; else (dspec's own
byte-level models) a `ByteTokenizer` (ids 0..255 are bytes, special ids above).
`train_byte_level_bpe` trains the small byte-level BPE used by the demo target.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import tokenizers

from dspec import files

EOS_TOKEN = '<|endoftext|>'
MASK_TOKEN = '<|mask|>'

_COMMON_TOKEN_NAMES = {
    'eos': ('<|endoftext|>', '</s>', '<eos>', '<|end_of_text|>'),
    'bos': ('<s>', '<bos>', '<|begin_of_text|>'),
    'mask': ('<|mask|>', '<mask>'),
}


@runtime_checkable
class Tokenizer(Protocol):
  """What the rest of dspec needs from a tokenizer.

  `stop_ids` are all ids that end generation (every declared EOS id); `eos_id` is the
  primary one (used e.g. as the document separator when packing training data).
  `mask_id` is a spare special id usable as the DFlash MASK token, or None.
  """

  vocab_size: int
  bos_id: int | None
  eos_id: int | None
  mask_id: int | None
  stop_ids: tuple[int, ...]

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
  """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, special ids usually live above 255.

  `stop_ids` defaults to `(eos_id,)`. `decode` drops ids that are not bytes (specials,
  out-of-range) and replaces invalid UTF-8.
  """

  def __init__(self, vocab_size: int = 257, eos_id: int | None = 256,
               bos_id: int | None = None, mask_id: int | None = None,
               stop_ids: Iterable[int] | None = None):
    if vocab_size < 256:
      raise ValueError(f'ByteTokenizer needs vocab_size >= 256, got {vocab_size}')
    if stop_ids is None:
      stop_ids = () if eos_id is None else (eos_id,)
    self.stop_ids = tuple(int(i) for i in stop_ids)
    named = [('eos_id', eos_id), ('bos_id', bos_id), ('mask_id', mask_id)]
    for name, value in named + [('stop id', i) for i in self.stop_ids]:
      if value is not None and not 0 <= value < vocab_size:
        raise ValueError(f'ByteTokenizer {name}={value} is outside [0, {vocab_size})')
    self.vocab_size = vocab_size
    self.eos_id = eos_id
    self.bos_id = bos_id
    self.mask_id = mask_id

  def encode(self, text: str) -> list[int]:
    """UTF-8 bytes of `text` as ids (no special tokens added)."""
    return list(text.encode('utf-8'))

  def decode(self, ids: Iterable[int]) -> str:
    """Text of the byte ids in `ids`; other ids are skipped, bad UTF-8 is replaced."""
    data = bytes(i for i in (int(x) for x in ids) if 0 <= i < 256)
    return data.decode('utf-8', errors='replace')

  def __repr__(self) -> str:
    return (f'ByteTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, '
            f'bos_id={self.bos_id}, mask_id={self.mask_id})')


class IdsOnlyTokenizer:
  """A model without a tokenizer: token ids in, token ids out.

  `encode` refuses text (ValueError naming `source`, the directory without a
  tokenizer.json); `decode` writes the ids out as a list ("[5, 17, 3]"), never as text.
  Special ids are the ones the model's own config declares (`eos_token_id` of config.json,
  generation_config.json or tokenizer_config.json): `stop_ids` may be empty.
  """

  def __init__(self, vocab_size: int, source: str | None = None,
               eos_ids: Iterable[int] = (), bos_id: int | None = None):
    self.vocab_size = vocab_size
    self.source = source
    self.stop_ids = tuple(int(i) for i in eos_ids)
    self.eos_id = self.stop_ids[0] if self.stop_ids else None
    self.bos_id = bos_id
    self.mask_id = None
    for i in self.stop_ids + (() if bos_id is None else (bos_id,)):
      if not 0 <= i < vocab_size:
        raise ValueError(f'{source or "model"}: special token id {i} is outside the '
                         f'vocabulary [0, {vocab_size})')

  def encode(self, text: str) -> list[int]:
    """Refused: this model has no tokenizer."""
    where = f'{self.source} has no tokenizer.json' if self.source else \
        f'the {self.vocab_size}-token model has no tokenizer'
    raise ValueError(f'{where}: give prompts as token ids, or a tokenizer directory '
                     '(model.tokenizer_dir / tokenizer_dir)')

  def decode(self, ids: Iterable[int]) -> str:
    """The ids written out, e.g. "[5, 17, 3]" (there is no text without a tokenizer)."""
    return str([int(i) for i in ids])

  def __repr__(self) -> str:
    return (f'IdsOnlyTokenizer(vocab_size={self.vocab_size}, source={self.source!r}, '
            f'stop_ids={self.stop_ids})')


class HFTokenizer:
  """A Hugging Face `tokenizers` tokenizer read from `tokenizer.json`.

  `path` is the model directory or the `tokenizer.json` file itself. Special ids come from
  `tokenizer_config.json`, `config.json` and `generation_config.json` in the same directory
  (`eos_token_id` may be an int or a list; every listed id becomes a stop id), else from
  common token names (`<|endoftext|>`, `</s>`, `<eos>`, ...). `encode` applies the
  tokenizer's own post-processor (e.g. Llama's BOS), like `transformers` does by default.
  """

  def __init__(self, path: str):
    path = os.fspath(path)
    file = path if path.endswith('.json') else os.path.join(path, 'tokenizer.json')
    if not os.path.isfile(file):
      raise FileNotFoundError(f'no tokenizer file at {file}')
    try:
      self._tok = tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # `tokenizers` raises a bare Exception for any bad file.
      raise ValueError(f'{file}: not a valid tokenizer.json ({_first_line(e)})') from None
    self.path = file
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    model_dir = os.path.dirname(file)
    eos_ids = _declared_special_ids(model_dir, 'eos', self._tok.token_to_id)
    self.eos_id = eos_ids[0] if eos_ids else None
    self.stop_ids = tuple(eos_ids)
    bos_ids = _declared_special_ids(model_dir, 'bos', self._tok.token_to_id)
    self.bos_id = bos_ids[0] if bos_ids else None
    mask_ids = _declared_special_ids(model_dir, 'mask', self._tok.token_to_id)
    self.mask_id = mask_ids[0] if mask_ids else None

  def encode(self, text: str) -> list[int]:
    """Token ids of `text` (post-processor special tokens included)."""
    return self._tok.encode(text).ids

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids`; special tokens and ids outside the vocabulary are skipped."""
    valid = [i for i in (int(x) for x in ids) if 0 <= i < self.vocab_size]
    return self._tok.decode(valid, skip_special_tokens=True)

  def token_to_id(self, token: str) -> int | None:
    """Id of one token string, or None when it is not in the vocabulary."""
    return self._tok.token_to_id(token)

  def to_json_str(self) -> str:
    """The tokenizer as `tokenizer.json` text (what grammar engines build their
    token tries from)."""
    return self._tok.to_str()

  def __repr__(self) -> str:
    return (f'HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, '
            f'eos_id={self.eos_id}, bos_id={self.bos_id}, mask_id={self.mask_id})')


def load_tokenizer(model_dir: str | None, vocab_size: int, *,
                   byte_fallback: bool = True) -> Tokenizer:
  """The tokenizer for a model with `vocab_size` embedding rows.

  `HFTokenizer` when `model_dir/tokenizer.json` exists. Otherwise the model's own declared
  special ids (`eos_token_id` of the directory's config files; every listed id stops
  generation) and: with `byte_fallback` (dspec's own byte-level models) and a vocabulary
  of at least 256, a `ByteTokenizer` whose EOS is a declared id or id 256 when the
  vocabulary has room; else an `IdsOnlyTokenizer` (token-id prompts only).
  Raises ValueError when the tokenizer does not fit the model's vocabulary.
  """
  if model_dir is not None and not os.path.isdir(model_dir):
    raise FileNotFoundError(f'model directory {model_dir} does not exist')
  tokenizer_file = os.path.join(model_dir, 'tokenizer.json') if model_dir else None
  if tokenizer_file and os.path.lexists(tokenizer_file) and not os.path.isfile(tokenizer_file):
    raise ValueError(f'{tokenizer_file}: not a readable file')
  if tokenizer_file and os.path.isfile(tokenizer_file):
    tok = HFTokenizer(model_dir)
    if tok.vocab_size > vocab_size:
      raise ValueError(
          f"{tok.path} has {tok.vocab_size} tokens but the model's vocab_size is "
          f'{vocab_size}: the tokenizer does not belong to this model')
    return tok
  eos_ids = _declared_special_ids(model_dir, 'eos', None) if model_dir else []
  bos_ids = _declared_special_ids(model_dir, 'bos', None) if model_dir else []
  if not byte_fallback or vocab_size < 256:
    return IdsOnlyTokenizer(vocab_size, model_dir, eos_ids, bos_ids[0] if bos_ids else None)
  eos_ids = [i for i in eos_ids if i < vocab_size]
  bos_ids = [i for i in bos_ids if i < vocab_size]
  if not eos_ids and vocab_size > 256:
    eos_ids = [256]
  return ByteTokenizer(vocab_size=vocab_size,
                       eos_id=eos_ids[0] if eos_ids else None,
                       bos_id=bos_ids[0] if bos_ids else None,
                       stop_ids=eos_ids)


TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json')   # what training writes


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int, out_dir: str) -> HFTokenizer:
  """Train a byte-level BPE on `texts` and write `tokenizer.json` + `tokenizer_config.json`
  into `out_dir`, both or neither (`files.write_dir`; other files there are kept).

  Special tokens: `<|endoftext|>` (id 0, EOS and document separator) and `<|mask|>` (id 1,
  a spare id for the DFlash MASK token). Deterministic for the same texts in the same order.
  """
  if vocab_size < 256 + 2:
    raise ValueError(f'a byte-level BPE needs vocab_size >= 258, got {vocab_size}')
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size,
      special_tokens=[EOS_TOKEN, MASK_TOKEN],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False,
  )
  tok.train_from_iterator(texts, trainer)
  config = {
      'tokenizer_class': 'PreTrainedTokenizerFast',
      'eos_token': EOS_TOKEN,
      'eos_token_id': tok.token_to_id(EOS_TOKEN),
      'bos_token': None,
      'mask_token': MASK_TOKEN,
      'mask_token_id': tok.token_to_id(MASK_TOKEN),
  }

  def write(tmp):
    os.makedirs(tmp)
    tok.save(os.path.join(tmp, TOKENIZER_FILES[0]))
    with open(os.path.join(tmp, TOKENIZER_FILES[1]), 'w') as f:
      json.dump(config, f, indent=2)
      f.write('\n')

  files.write_dir(out_dir, write)
  return HFTokenizer(out_dir)


def declared_eos_ids(model_dir: str) -> list[int]:
  """The end-of-sequence ids the config files of `model_dir` declare (config.json,
  generation_config.json, tokenizer_config.json `eos_token_id`), in order, deduplicated."""
  return _declared_special_ids(model_dir, 'eos', None)


def _declared_special_ids(model_dir: str, name: str, token_to_id) -> list[int]:
  """Ids a model directory declares for special token `name` ('eos', 'bos' or 'mask').

  Order: tokenizer_config.json (`<name>_token_id`, then `<name>_token` looked up with
  `token_to_id`), config.json, generation_config.json; common token names only when none of
  these declares one. Duplicates removed, first occurrence kept.
  """
  ids: list[int] = []
  key = f'{name}_token_id'
  config_path = os.path.join(model_dir, 'tokenizer_config.json')
  tokenizer_config = _read_json(config_path)
  ids += _as_id_list(tokenizer_config.get(key), f'{config_path}: {key}')
  token = tokenizer_config.get(f'{name}_token')
  if isinstance(token, dict):
    token = token.get('content')
  if isinstance(token, str) and token_to_id is not None:
    ids += _as_id_list(token_to_id(token), f'{config_path}: {name}_token')
  for file in ('config.json', 'generation_config.json'):
    path = os.path.join(model_dir, file)
    ids += _as_id_list(_read_json(path).get(key), f'{path}: {key}')
  if not ids and token_to_id is not None:
    ids = [i for i in map(token_to_id, _COMMON_TOKEN_NAMES[name]) if i is not None][:1]
  return list(dict.fromkeys(ids))


def _as_id_list(value, where: str) -> list[int]:
  """An `*_token_id` field (None, int or list of ints) as a list of ints."""
  values = value if isinstance(value, (list, tuple)) else [value]
  ids = []
  for v in values:
    if v is None:
      continue
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
      raise ValueError(f'{where} must be a non-negative integer id (or a list of them), '
                       f'got {value!r}')
    ids.append(v)
  return ids


def _read_json(path: str) -> dict:
  """The JSON object in `path`, or {} when nothing is there."""
  if not os.path.lexists(path):
    return {}
  try:
    with open(path) as f:
      data = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ValueError(f'{path}: not valid JSON ({_first_line(e)})') from None
  except OSError as e:
    raise ValueError(f'{path}: cannot be read ({e.strerror or e})') from None
  return data if isinstance(data, dict) else {}


def fingerprint(tokenizer: Tokenizer) -> str:
  """SHA-256 identifying a tokenizer: its class, special ids and (HF) tokenizer.json bytes."""
  digest = hashlib.sha256(json.dumps(
      [type(tokenizer).__name__, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.bos_id,
       tokenizer.mask_id, list(tokenizer.stop_ids)]).encode())
  path = getattr(tokenizer, 'path', None)
  if path:
    with open(path, 'rb') as f:
      digest.update(f.read())
  return digest.hexdigest()


def _first_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return lines[0][:300] if lines else type(e).__name__
