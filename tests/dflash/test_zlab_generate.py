"""Step-for-step parity with z-lab's `dflash_generate` at T = 0, through the public API.

A random HF Qwen3 target and random z-lab DFlash / DFlash-2 drafters are saved with
`save_pretrained`; dspec loads both directories (`dspec.load_target`, `load_drafter`) and
decodes with a fixed verify length and z-lab's shrinking block (`shrink_block=True`; dspec's
default drafts the whole block, as trained). Against `dflash_generate` on the same prompt:
the same output ids, the same `acceptance_lengths`, and the same drafted block at every step
(dspec's trace against the blocks z-lab's target verified).
"""

import pytest
import torch
from dflash import model as zlab
from transformers import Qwen3Config, Qwen3ForCausalLM

import dspec

VOCAB, MASK, DEPTH, NEW_TOKENS = 300, 299, 4, 40   # >= 256: the byte tokenizer fits
SHAPES = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, head_dim=12, rope_theta=5000.0, rms_norm_eps=1e-5)
CASES = {
    'dflash_taps_b8': (zlab.DFlashDraftModel,
                       dict(block_size=8, target_layer_ids=[0, 2, 3])),
    'dflash_default_taps_b16': (zlab.DFlashDraftModel, dict(block_size=16)),
    'dflash2_softcap_multiplier_b8': (
        zlab.DFlash2DraftModel,
        dict(block_size=8, output_multiplier=0.7, final_logit_softcapping=2.5,
             conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=6)),
}


def _randomize(model, gen):
  """Random weights; the final norm keeps only hidden dimension 0, so (with the tied
  embedding rows of tokens 7 and 8 set to +-30 there) both the target and the drafter
  emit 7 or 8 by the sign of that dimension: they agree about half the time. DFlash-2's
  codebooks are small, so its selector mostly keeps the top unary candidate."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen)
      p.copy_(1 + 0.1 * noise if name.endswith('norm.weight') else
              noise / p.shape[-1] ** 0.5 * (0.05 if 'codebook' in name else 1.0))
    model.get_submodule('model.norm' if hasattr(model, 'model') else 'norm').weight.copy_(
        torch.nn.functional.one_hot(torch.tensor(0), SHAPES['hidden_size']).float())


@pytest.fixture(scope='module')
def target(tmp_path_factory):
  """(HF target, dspec target, its directory, prompt ids)."""
  root = tmp_path_factory.mktemp('zlab_generate')
  torch.manual_seed(0)
  hf = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=DEPTH, tie_word_embeddings=True,
                                    **SHAPES)).eval()
  _randomize(hf, torch.Generator().manual_seed(1))
  with torch.no_grad():
    hf.model.embed_tokens.weight[7, 0], hf.model.embed_tokens.weight[8, 0] = 30.0, -30.0
  hf.save_pretrained(str(root / 'target'))
  prompt = [5, 17, 3, 40, 5, 17, 3, 40, 5, 17, 9]
  return hf, dspec.load_target(str(root / 'target')), root, prompt


def _zlab_run(model, hf, prompt):
  """(output ids, acceptance_lengths, the drafted block of every verify step)."""
  blocks, forward = [], hf.forward

  def recording_forward(input_ids=None, **kw):
    if input_ids is not None and input_ids.shape[1] > 1 and kw.get('logits_to_keep') != 1:
      blocks.append(input_ids[0, 1:].tolist())
    return forward(input_ids=input_ids, **kw)

  hf.forward = recording_forward
  try:
    stats = zlab.dflash_generate(model, hf, torch.tensor([prompt]), NEW_TOKENS, None,
                                 return_stats=True)
  finally:
    hf.forward = forward
  return stats.output_ids[0, len(prompt):].tolist(), list(stats.acceptance_lengths), blocks


# dflash_default_taps_b16: the module's quick test.
@pytest.mark.parametrize('name', [n if n == 'dflash_default_taps_b16' else
                                  pytest.param(n, marks=pytest.mark.slow) for n in sorted(CASES)])
def test_dspec_follows_dflash_generate_step_for_step(target, name, monkeypatch):
  monkeypatch.setattr(zlab, '_cuda_time', lambda: 0.0)
  hf, ours, root, prompt = target
  cls, draft_cfg = CASES[name]
  config = Qwen3Config(num_hidden_layers=2, num_target_layers=DEPTH, **SHAPES,
                       dflash_config=dict(mask_token_id=MASK, **draft_cfg))
  model = cls(config)
  # Drafter seeds picked so each case both accepts and rejects drafts.
  _randomize(model, torch.Generator().manual_seed(14 if name == 'dflash_taps_b8' else 7))
  model.save_pretrained(str(root / name))
  model = cls.from_pretrained(str(root / name)).eval()
  ids, lengths, blocks = _zlab_run(model, hf, prompt)

  drafter = dspec.load_drafter('dflash', str(root / name), target=ours, shrink_block=True)
  out = dspec.generate(ours, [prompt], drafter=drafter, max_new_tokens=NEW_TOKENS,
                       verify_length='fixed', trace=True)
  assert out.ids[0] == ids
  assert out.metrics['acceptance_lengths'] == lengths
  assert [s['proposed'] for s in out.trace['steps']] == blocks
  assert max(lengths) > 1, 'the case should accept some drafts'
