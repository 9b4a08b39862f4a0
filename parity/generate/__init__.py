"""Text generation on the reference or the engine: tokenizer, chat template, sampling, streaming, batch.

Pieces (each usable alone):

* :func:`load_tokenizer` - the checkpoint's ``tokenizer.json`` through the ``tokenizers`` library.
* :func:`load_chat_template` / :func:`render_chat` - the checkpoint's own jinja chat template
  (``chat_template.jinja`` or ``tokenizer_config.json``), rendered in a sandboxed jinja2 environment
  the way transformers' ``apply_chat_template`` does; otherwise :func:`render_chatml`, a built-in
  ChatML rendering of the official template's rules (``/work/shared/model-facts.md`` §5).
* :class:`SamplingParams` / :class:`Sampler` - greedy, temperature, top-k, top-p (transformers'
  warper order: temperature, then top-k, then top-p), seeded; defaults from ``generation_config.json``.
* :class:`StreamDecoder` - incremental detokenisation that never emits half of a multi-byte character.
* :class:`Generator` - prefill + decode loop over any :class:`parity.backends.Backend` (opened by
  :func:`parity.backends.open_backend`; :class:`BackendLM` is the thin adapter), single or batched,
  with stop conditions and timings.
* :func:`generate_speculative` - generation with the checkpoint's MTP head as the drafter.

The pieces live in :mod:`.chat`, :mod:`.sampling`, :mod:`.generator` and :mod:`.speculative`; this package face
re-exports every public name.
"""
from __future__ import annotations

from parity.generate.chat import (TOOLS_PREAMBLE, TOOLS_RULES, TemplateError, load_chat_template,
                                  load_tokenizer_config, read_json_object, render_chat, render_chatml,
                                  render_jinja_template)
from parity.generate.generator import (NOISE_NOTE, BackendLM, ContextError, DeviceUnavailableError,
                                       GenerationResult, Generator, StreamDecoder, first_divergence, open_lm)
from parity.generate.sampling import (Sampler, SamplingError, SamplingParams, eos_ids_from, load_generation_config,
                                      sampling_defaults)
from parity.generate.speculative import generate_speculative, parse_speculative, speculative_accept
from reference.errors import InputError, UserError
from reference.tokenizer import TokenizerMissingError, load_tokenizer

__all__ = ["TOOLS_PREAMBLE", "TOOLS_RULES", "TemplateError", "load_chat_template", "load_tokenizer_config",
           "read_json_object", "render_chat", "render_chatml", "render_jinja_template", "NOISE_NOTE", "BackendLM",
           "ContextError", "DeviceUnavailableError", "GenerationResult", "Generator", "StreamDecoder",
           "first_divergence", "open_lm", "Sampler", "SamplingError", "SamplingParams", "eos_ids_from",
           "load_generation_config", "sampling_defaults", "generate_speculative", "parse_speculative",
           "speculative_accept", "InputError", "UserError", "TokenizerMissingError", "load_tokenizer"]
