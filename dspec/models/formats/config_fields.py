"""The fields each config.json reader knows: a field is read (honoured, or refused at a value
dspec does not implement) or listed here as metadata that changes no target or drafter
math. Any other field is refused by name (`check_known`): a published config is never read
with a field silently ignored.
"""

from __future__ import annotations

# HF `PretrainedConfig` bookkeeping, generation defaults and training-only or serving-limit
# fields: none of them changes a forward pass.
HF_METADATA = frozenset({
    '_name_or_path', 'name_or_path', '_attn_implementation_autoset', 'architectures',
    'auto_map', 'transformers_version', 'torch_dtype', 'dtype', 'use_cache',
    'initializer_range', 'attention_dropout', 'max_position_embeddings', 'bos_token_id',
    'eos_token_id', 'pad_token_id', 'sep_token_id', 'decoder_start_token_id',
    'tokenizer_class', 'prefix', 'task_specific_params', 'finetuning_task', 'torchscript',
    'use_bfloat16', 'tf_legacy_loss', 'pruned_heads', 'chunk_size_feed_forward',
    'id2label', 'label2id', 'problem_type', 'is_encoder_decoder', 'is_decoder',
    'add_cross_attention', 'cross_attention_hidden_size', 'tie_encoder_decoder',
    'output_hidden_states', 'output_attentions', 'return_dict', 'max_length', 'min_length',
    'do_sample', 'early_stopping', 'num_beams', 'num_beam_groups', 'diversity_penalty',
    'temperature', 'top_k', 'top_p', 'typical_p', 'repetition_penalty', 'length_penalty',
    'no_repeat_ngram_size', 'encoder_no_repeat_ngram_size', 'bad_words_ids',
    'num_return_sequences', 'output_scores', 'return_dict_in_generate',
    'forced_bos_token_id', 'forced_eos_token_id', 'remove_invalid_values',
    'exponential_decay_length_penalty', 'suppress_tokens', 'begin_suppress_tokens',
    # Llama's tensor-parallel split of its matmuls: the same product, summed in slices.
    'pretraining_tp',
})

# A Llama / Qwen3 decoder config (`hf_config.config_from_hf`, `drafter_dir.read_draft_layers`):
# shapes, norm, activation, RoPE, biases, sliding windows and tied embeddings.
DECODER_FIELDS = HF_METADATA | {
    'model_type', 'vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
    'num_attention_heads', 'num_key_value_heads', 'head_dim', 'hidden_act', 'rms_norm_eps',
    'rope_theta', 'rope_scaling', 'rope_parameters', 'partial_rotary_factor',
    'attention_bias', 'mlp_bias', 'tie_word_embeddings', 'use_sliding_window',
    'sliding_window', 'max_window_layers', 'layer_types',
}
# A HF checkpoint with DeepSeek-V3 MTP layers (`formats.mtp`, `hf_import`).
TARGET_FIELDS = DECODER_FIELDS | {'num_nextn_predict_layers'}

# Every speculators config (`SpeculatorModelConfig`): the kind, its version, the draft layers
# and the proposal / verifier record. Each kind's reader adds its own fields
# (`SPECULATORS_FIELDS` of formats.dflash, dspark, eagle3, mtp).
SPECULATORS_COMMON_FIELDS = HF_METADATA | {
    'speculators_model_type', 'speculators_version', 'speculators_config',
    'transformer_layer_config', 'tie_word_embeddings',
}
# ... and of every DFlash-family one (dflash, dflash2, dspark).
SPECULATORS_DFLASH_FIELDS = SPECULATORS_COMMON_FIELDS | {
    'draft_vocab_size', 'block_size', 'target_hidden_size', 'aux_hidden_state_layer_ids',
    'mask_token_id', 'sliding_window_non_causal', 'sample_from_anchor',
}
# `speculators_config`: the proposal methods (the first one's `speculative_tokens` is the
# trained draft length; its acceptance settings are serving policy, dspec verifies exactly)
# and the verifier it was trained against.
SPECULATORS_CONFIG_FIELDS = frozenset({'algorithm', 'default_proposal_method',
                                       'proposal_methods', 'verifier'})
PROPOSAL_FIELDS = frozenset({'proposal_type', 'speculative_tokens', 'accept_tolerance',
                             'verifier_accept_k'})
VERIFIER_FIELDS = frozenset({'name_or_path', 'architectures'})
# The draft layers of a DFlash-family drafter (z-lab's `is_causal` included).
DFLASH_LAYER_FIELDS = DECODER_FIELDS | {'is_causal'}

# z-lab's DFlash config.json: a Qwen3 config of the draft layers plus the DFlash keys, each
# in `dflash_config` or at the top level.
ZLAB_DRAFT_FIELDS = frozenset({
    'mask_token_id', 'target_layer_ids', 'block_size', 'input_embedding_scale',
    'output_multiplier', 'final_logit_softcapping', 'conv_kernel_size', 'conv_group_size',
    'selector_rank', 'selector_top_k'})
ZLAB_FIELDS = DECODER_FIELDS | ZLAB_DRAFT_FIELDS | {'num_target_layers', 'dflash_config',
                                                   'is_causal'}

# SafeAILab / SpecForge EAGLE-3: a Llama config of the draft layer, the draft vocabulary and
# SGLang's `eagle_config` (its aux hidden-state ids).
LEGACY_EAGLE3_FIELDS = DECODER_FIELDS | {'draft_vocab_size', 'eagle_config'}
EAGLE_CONFIG_FIELDS = frozenset({'eagle_aux_hidden_state_layer_ids', 'use_aux_hidden_state'})


def unknown_fields(config: dict, known) -> list:
  """The keys of `config` not in `known`, sorted."""
  return sorted(k for k in config if k not in known)
