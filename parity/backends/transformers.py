"""The ``transformers`` backend: the official implementation (``transformers.models.qwen4_exp``) behind the
parity protocol, so ``qwen4exp parity MODEL --backend transformers`` checks the reference against the
official model on any checkpoint, and ``--backend transformers:dtype=bfloat16`` gives the official bf16 run
as a yardstick for bf16 engines.

Options (``--backend transformers:key=value,...``, or ``open(..., key=value)``):

* ``device``: ``cpu`` (default) or ``cuda`` (``cuda:N``; in float32, TF32 is turned off for the process: a
  float32 yardstick computes in float32).
* ``dtype``: ``float32`` (default) or ``bfloat16`` (precision ``bf16``).
* ``load``: ``pretrained`` -- ``<architecture>.from_pretrained`` (the class named by ``config.json``'s
  ``architectures``: ``Qwen4ExpForCausalLM``, or the ``Qwen4ExpForConditionalGeneration`` wrapper of release
  checkpoints); ``reader`` -- ``Qwen4ExpForCausalLM`` built from the text config with its weights read by
  ``reference.checkpoint`` (FP8 dequantised exactly in float32); ``auto`` (default): ``reader`` for a
  checkpoint with a ``quantization_config``, else ``pretrained``. Why: transformers 5.24's FP8 loader
  (``FineGrainedFP8HfQuantizer``) refuses to load without ``accelerate`` and, on a machine without a GPU,
  dequantises to bf16 -- not the exact float32 weights the reference computes with; ``load=pretrained`` on
  an FP8 checkpoint shows transformers' own message.
* ``perturb``: a module path of the registry tree (``layers.2.mlp``, ``layers.0.linear_attn`` ...): a forward
  hook adds ``PERTURB_REL`` x the RMS of that module's output to it (the negative control: parity must fail
  and name that block). The protocol's ``perturb=(tensor_name, fn)`` (a weight replaced) is accepted too.
* ``page_size``: accepted and ignored (the official cache has no pages).
* ``threads``: torch's intra-op CPU threads (``torch.set_num_threads``, process-wide), a positive integer or
  ``auto`` (default): 1 on CPU for a model of ``hidden_size`` <= :data:`SMALL_HIDDEN`, else torch's default. Why:
  the ops of a small model are too small to split across threads, and on a machine whose cores are busy the
  threads' barriers dominate -- measured on ``tiny`` (hidden 64, 2 busy cores): a 100-token prefill 3.0 s with 2
  threads vs 0.12 s with 1, a decode step 0.49 s vs 0.025 s, the logits bitwise equal. It changes no arithmetic
  of the official model (each output element's sum is one thread's either way on these shapes).

State: each sequence holds its own ``DynamicCache`` (modeling_qwen4_exp.py builds one per
``Qwen4ExpTextModel.forward`` when ``use_cache``); positions are passed explicitly (``position_ids`` =
``arange(pos, pos + T)``), so the ConditionalGeneration wrapper's shared ``rope_deltas`` never enters.

Capabilities (see :func:`parity.backends.base.capability`):

* ``snapshot`` / ``fork``: supported -- ``copy.deepcopy`` of the cache object (every tensor of every layer).
* ``verify``: supported (a multi-token forward on the cache).
* ``rollback``: the cache classes can crop attention layers (``DynamicIndexedLayer.crop`` drops keys, values,
  indexer keys and positions) but not a GDN layer: ``LinearAttentionCacheLayerMixin.is_croppable`` is False
  once a recurrent state exists (a recurrent state cannot be un-applied). So for a model without
  ``linear_attention`` layers rollback is supported (``cache.crop(-n)``); otherwise it is LIMITED to the
  tokens of the last ``forward_tokens`` call, right after it: that call keeps a deep copy of the cache from
  before it, and a rollback of ``n <= k`` tokens restores the copy and re-feeds the ``k - n`` accepted tokens.
  Anything else raises :class:`parity.backends.base.CapabilityLimit`.
* ``batched_decode``: limited -- the sequences of a batch are decoded one forward each (each has its own cache).
* ``state_arrays``: supported (every cache tensor, named ``layers.{i}.<field>``); ``snapshot_file``: unsupported.
* ``taps``: limited -- forward hooks on the official modules, mapped onto the registry names (below); they are
  installed for a forward only while a tap recorder listens (``reference.taphook.current()``), so plain forwards
  take torch's hook-free call path. ``produces_taps`` (:data:`TAPS`) declares exactly the taps they emit.
* ``perturb``: supported (weights and module outputs).

The tap map (official module under the text model ``model`` / ``model.language_model``; hook; registry name):

=======================================  =====================================  ==============================================
official module                          value taken                            registry tap
=======================================  =====================================  ==============================================
``embed_tokens``                         output                                 ``embed_tokens.out``
``layers.{i}.ple.ple_embedding``         output                                 ``layers.{i}.ple.ple_embedding.out``
``layers.{i}.ple``                       output                                 ``layers.{i}.ple.out``
``layers.{i}.attn_hyper_connection``     input 0 / output 0 / output 2          ``.in`` / ``.out`` / ``.injection_weights``
``layers.{i}.linear_attn.norm``          input 0, reshaped ``[T, nv, dv]``      ``layers.{i}.linear_attn.core_out``
``layers.{i}.linear_attn``               output                                 ``layers.{i}.linear_attn.out``
``layers.{i}.self_attn.indexer``         its own ``scores.topk`` call, per query  ``.indexer.block_scores`` / ``.indexer.selected_blocks``
``layers.{i}.self_attn``                 output 0                               ``layers.{i}.self_attn.out``
``layers.{i}.mlp_hyper_connection``      input 0                                ``layers.{i}.attn_hyper_connection.combine``
``layers.{i}.mlp_hyper_connection``      output 0 / output 2                    ``.out`` / ``.injection_weights``
``layers.{i}.mlp.gate``                  output 0 / 1 / 2                       ``router_logits`` / ``topk_weights`` / ``topk_ids``
``layers.{i}.mlp``                       output                                 ``layers.{i}.mlp.out``
``layers.{i}`` (decoder layer)           output                                 ``layers.{i}.mlp_hyper_connection.combine``
``hyper_connection_mixer``               output                                 ``hyper_connection_mixer.out``
``lm_head`` (top model)                  output                                 ``logits``
=======================================  =====================================  ==============================================

The indexer taps are the official code's own values: while ``Qwen4ExpTextQSAIndexer.forward`` runs, a
``torch.overrides.TorchFunctionMode`` records each ``scores.topk(...)`` call it makes (one per query with a
complete block, in query order): its input is that query's block scores, its ``indices`` the selected blocks
in the official order (score descending; exact ties as ``torch.topk`` breaks them -- on CPU not always the lower
index, which the registry's canonical order asks for; tap-diff reports such a row as a tie-break divergence).

Registry taps with NO counterpart in the official module tree (values computed inside a forward, never a
module's input or output nor a ranked call), so this backend does not emit them:
``layers.{i}.ple.ple_embedding.ngram_ids``, ``layers.{i}.ple.gate``, ``layers.{i}.linear_attn.conv_out``
(``causal_conv1d_fn`` is a function, not a module), ``layers.{i}.self_attn.core_out`` (``o_proj``'s input is
already multiplied by the output gate). :data:`NO_COUNTERPART` lists them.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np

from reference.errors import InputError

from parity.backends.base import Backend, BackendEntry, decode_args, BackendError, CapabilityLimit, Handles
from reference.session import check_ids

#: registry taps this backend cannot produce (see the module docstring)
NO_COUNTERPART = ("layers.{i}.ple.ple_embedding.ngram_ids", "layers.{i}.ple.gate", "layers.{i}.linear_attn.conv_out",
                  "layers.{i}.self_attn.core_out")

#: registry taps added after this map was written (the finer taps), NOT YET hooked here although most
#: are official module outputs (the norms) -- an open item, not a claim that they have no counterpart
NOT_YET_MAPPED = ("hyper_connection_mixer.hc_norm.out", "layers.{i}.attn_hyper_connection.hc_norm.out",
                  "layers.{i}.linear_attn.conv_state", "layers.{i}.linear_attn.norm.out",
                  "layers.{i}.mlp_hyper_connection.hc_norm.out", "layers.{i}.ple.conv_out", "layers.{i}.ple.norm_conv.out",
                  "layers.{i}.ple.norm_key.out", "layers.{i}.ple.norm_query.out", "layers.{i}.self_attn.indexer.block_keys",
                  "layers.{i}.self_attn.indexer.q_layernorm.out", "layers.{i}.self_attn.indexer.selected_tokens",
                  "layers.{i}.self_attn.k_norm.out", "layers.{i}.self_attn.q_norm.out")

#: the registry taps the tap hooks emit (the tap map of the module docstring; ``{i}``: a layer index), what a
#: located cell may list as missing (:attr:`parity.backends.base.Backend.produces_taps`): never a tap of
#: NO_COUNTERPART or NOT_YET_MAPPED
TAPS = ("embed_tokens.out", "layers.{i}.ple.ple_embedding.out", "layers.{i}.ple.out",
        "layers.{i}.attn_hyper_connection.in", "layers.{i}.attn_hyper_connection.out",
        "layers.{i}.attn_hyper_connection.injection_weights", "layers.{i}.linear_attn.core_out",
        "layers.{i}.linear_attn.out", "layers.{i}.self_attn.indexer.block_scores",
        "layers.{i}.self_attn.indexer.selected_blocks", "layers.{i}.self_attn.out",
        "layers.{i}.attn_hyper_connection.combine", "layers.{i}.mlp_hyper_connection.out",
        "layers.{i}.mlp_hyper_connection.injection_weights", "layers.{i}.mlp.gate.router_logits",
        "layers.{i}.mlp.gate.topk_weights", "layers.{i}.mlp.gate.topk_ids", "layers.{i}.mlp.out",
        "layers.{i}.mlp_hyper_connection.combine", "hyper_connection_mixer.out", "logits")

#: the module-output fault: ``out + PERTURB_REL * rms(out)`` -- 5% of the output's scale, far above float32
#: noise (~1e-6 relative) and still small enough that it is the kind of error a real kernel bug makes
PERTURB_REL = 0.05

#: the widest model for which ``threads=auto`` runs torch on one CPU thread (see the module docstring): below it
#: a matmul row is a few hundred multiply-adds, far less than a thread hand-off costs
SMALL_HIDDEN = 1024

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
LOADS = ("auto", "pretrained", "reader")


#: the first transformers release whose qwen4_exp is the specification (pyproject's `oracle` extra pins it)
MIN_TRANSFORMERS = (5, 23)


def _import_torch():
    from reference.paths import install_command
    try:
        import torch
        import transformers
        from transformers.models.qwen4_exp import modeling_qwen4_exp  # noqa: F401
    except ImportError as e:
        raise BackendError(f"backend transformers: expected torch and transformers >= "
                           f"{'.'.join(map(str, MIN_TRANSFORMERS))} with qwen4_exp (the `oracle` extra), found {e}; "
                           f"install them: {install_command('oracle')}") from e
    got = tuple(int(p) for p in re.findall(r"\d+", transformers.__version__)[:2])
    if got < MIN_TRANSFORMERS:  # an earlier qwen4_exp is not the specification (its config validation differs)
        raise BackendError(f"backend transformers: expected transformers >= "
                           f"{'.'.join(map(str, MIN_TRANSFORMERS))} (the official qwen4_exp), found "
                           f"{transformers.__version__}; install it: {install_command('oracle')}")
    return torch


class _Seq:
    """One sequence: its DynamicCache (None until the first forward), position, and the pre-verify copy."""

    def __init__(self):
        self.cache = None
        self.pos = 0
        self.pre_verify = None  # (cache copy, position, drafted ids) of the last forward_tokens call


class TransformersBackend(Backend):
    """The official ``Qwen4ExpForCausalLM`` / ``Qwen4ExpForConditionalGeneration`` as a backend (see the
    module docstring for the options, capabilities and the tap map)."""

    name = "transformers"
    produces_taps = TAPS

    def __init__(self, model, config, torch_dtype, device, name, model_path, load_note, crop_ok):
        torch = _import_torch()
        self.torch = torch
        self.model = model
        self.config = config
        self.dtype = torch_dtype
        self.device = device
        self.name = name
        self.model_path = model_path
        self.load_note = load_note
        self.precision = "bf16" if torch_dtype == torch.bfloat16 else "float32"
        self._seqs = Handles(self)
        self._tap_pos = 0
        self._hooks: list = []       # the perturbation's hooks (for the backend's life)
        self._tap_hooks: list = []   # the tap hooks, installed only for a forward run while taps are recorded
        self._crop_ok = crop_ok
        self.capabilities = {
            "page_sizes": None, "batched_decode": {"status": "limited", "limit": "one forward per sequence "
                                                   "(each sequence holds its own DynamicCache)"},
            "verify": True, "snapshot": True, "fork": True, "batched_prefill": True,
            "rollback": True if crop_ok else {
                "status": "limited", "within": "last_verify",
                "limit": "only the tokens of the last forward_tokens call, right after it (the official GDN cache "
                         "layer cannot crop a recurrent state: restored from a pre-verify copy, accepted tokens "
                         "re-fed)"},
            "taps": {"status": "limited", "limit": "no counterpart in the official module tree: "
                     + ", ".join(NO_COUNTERPART)},
            "perturb": True, "state_arrays": True, "snapshot_file": False}

    @property
    def text_model(self):
        """The ``Qwen4ExpTextModel`` inside the loaded model (``model.model`` or ``model.model.language_model``)."""
        inner = self.model.model
        return getattr(inner, "language_model", inner)

    # ------------------------------------------------------------------------------------------- opening
    @classmethod
    def open(cls, model_path, *, device="cpu", dtype="float32", load="auto", perturb=None, page_size=None,
             name=None, threads="auto", **opts) -> "TransformersBackend":
        """Open the official model on a checkpoint directory (options: the module docstring).

        Raises:
            InputError: an unknown option or value. BackendError: torch/transformers missing, CUDA asked for
            without a GPU, or transformers refusing the checkpoint (its own message quoted).
        """
        if opts:
            raise InputError(f"backend transformers: expected options device/dtype/load/perturb/page_size/threads, "
                             f"found {sorted(opts)}")
        torch = _import_torch()
        if str(dtype) not in DTYPES and not isinstance(dtype, torch.dtype):
            raise InputError(f"backend transformers: dtype: expected one of {sorted(set(DTYPES.values()))}, "
                             f"found {dtype!r}")
        tdt = dtype if isinstance(dtype, torch.dtype) else getattr(torch, DTYPES[str(dtype)])
        if tdt not in (torch.float32, torch.bfloat16):
            raise InputError(f"backend transformers: dtype: expected float32 or bfloat16, found {tdt}")
        dev = str(device)
        if not (dev == "cpu" or dev.startswith("cuda")):
            raise InputError(f"backend transformers: device: expected cpu or cuda[:N], found {device!r}")
        if dev.startswith("cuda") and not torch.cuda.is_available():
            raise BackendError(f"backend transformers: device {dev}: expected a CUDA GPU visible to torch, found none")
        if load not in LOADS:
            raise InputError(f"backend transformers: load: expected one of {', '.join(LOADS)}, found {load!r}")
        if str(threads) != "auto" and not (str(threads).isdigit() and int(threads) >= 1):
            raise InputError(f"backend transformers: threads: expected a positive integer or auto, found {threads!r}")
        from reference.config import load_config
        model_path = Path(model_path)
        cfg = load_config(model_path)
        if str(threads) != "auto":
            torch.set_num_threads(int(threads))
        elif dev == "cpu" and cfg.hidden_size <= SMALL_HIDDEN:
            torch.set_num_threads(1)
        quant = cfg.extra.get("quantization_config") if isinstance(getattr(cfg, "extra", None), dict) else None
        how = load if load != "auto" else ("reader" if quant else "pretrained")
        if how == "pretrained":
            model, note = _load_pretrained(model_path, tdt)
        else:
            model, note = _load_reader(model_path, cfg, tdt, quant)
        model = model.to(dev).eval()
        if dev.startswith("cuda") and tdt == torch.float32:
            # float32 means float32: torch lets cuDNN convolutions (the GDN / PLE causal conv1d) use TF32 by
            # default, whose 10-bit mantissa would make this float32 yardstick a reduced-precision engine
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        crop_ok = "linear_attention" not in cfg.layer_types
        be = cls(model, cfg, tdt, dev, name or "transformers", model_path, note, crop_ok)
        if perturb is not None:
            be._apply_perturb(perturb)
        return be

    def _apply_perturb(self, perturb):
        if isinstance(perturb, str):
            mod = self._module(perturb)
            torch = self.torch

            def hook(_m, _args, out):
                t = out[0] if isinstance(out, tuple) else out
                d = PERTURB_REL * torch.sqrt(torch.mean(t.float() ** 2)).to(t.dtype)
                return (t + d, *out[1:]) if isinstance(out, tuple) else t + d
            self._hooks.append(mod.register_forward_hook(hook))
            self.perturbed = f"module {perturb} output + {PERTURB_REL} x rms"
            return
        try:
            tname, fn = perturb
        except (TypeError, ValueError):
            raise InputError(f"backend transformers: perturb: expected a module path (layers.2.mlp) or "
                             f"(tensor_name, fn), found {perturb!r}") from None
        from reference.checkpoint import canonical_name
        params = {canonical_name(k): p for k, p in self.model.named_parameters()}
        if tname not in params:
            from reference.errors import CheckpointError
            raise CheckpointError(f"perturb: expected a tensor name of the official model "
                                  f"(e.g. layers.0.mlp.gate.weight), found {tname!r}")
        p = params[tname]
        with self.torch.no_grad():
            new = np.asarray(fn(p.detach().float().cpu().numpy()), dtype=np.float32)
            p.copy_(self.torch.from_numpy(new).to(p.dtype))
        self.perturbed = f"weight {tname}"

    def _module(self, path: str):
        """The official module at registry path ``path`` (``lm_head`` on the top model, others under the text
        model). Raises InputError naming the path when there is none."""
        root = self.model if path == "lm_head" else self.text_model
        m = root
        for part in path.split("."):
            nxt = getattr(m, part, None) if not part.isdigit() else (m[int(part)] if int(part) < len(m) else None)
            if nxt is None:
                raise InputError(f"backend transformers: perturb: expected a module path of the official model "
                                 f"(embed_tokens, layers.<i>.mlp, layers.<i>.linear_attn, hyper_connection_mixer, "
                                 f"lm_head ...), found {path!r} (no {part!r})")
            m = nxt
        return m

    # ------------------------------------------------------------------------------------------- taps
    def _install_tap_hooks(self):
        from reference import taphook
        be = self

        def emit(name, t):
            rec = taphook.current()
            if rec is None or (hasattr(rec, "wants") and not rec.wants(name)):
                return
            a = t.detach()[0]
            a = a.float().cpu().numpy() if a.is_floating_point() else a.cpu().numpy().astype(np.int64)
            rec.emit(name, a, positions=np.arange(be._tap_pos, be._tap_pos + a.shape[0]))

        def out_hook(name, pick=None):
            def h(_m, _args, out):
                emit(name, out if pick is None else out[pick])
            return h

        def in_hook(name):
            def h(_m, args, _out):
                emit(name, args[0])
            return h

        def gate_hook(prefix):
            def h(_m, args, out):
                T = args[0].shape[0]  # the router sees [T, H] (batch 1 flattened)
                for k, suffix in enumerate(("router_logits", "topk_weights", "topk_ids")):
                    emit(prefix + suffix, out[k].reshape(1, T, -1))
            return h

        tm = self.text_model
        reg = lambda m, h: self._tap_hooks.append(m.register_forward_hook(h))  # noqa: E731
        reg(tm.embed_tokens, out_hook("embed_tokens.out"))
        cfg = self.config
        nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        for i, layer in enumerate(tm.layers):
            p = f"layers.{i}."
            if getattr(layer, "ple", None) is not None:
                reg(layer.ple.ple_embedding, out_hook(p + "ple.ple_embedding.out"))
                reg(layer.ple, out_hook(p + "ple.out"))
            reg(layer.attn_hyper_connection, in_hook(p + "attn_hyper_connection.in"))
            reg(layer.attn_hyper_connection, out_hook(p + "attn_hyper_connection.out", 0))
            reg(layer.attn_hyper_connection, out_hook(p + "attn_hyper_connection.injection_weights", 2))
            if hasattr(layer, "linear_attn"):
                # the gated norm sees core_attn_out flattened to [T * nv, dv] (batch 1)
                reg(layer.linear_attn.norm, lambda _m, args, _o, n=p + "linear_attn.core_out":
                    emit(n, args[0].reshape(1, -1, nv, dv)))
                reg(layer.linear_attn, out_hook(p + "linear_attn.out"))
            else:
                self._spy_indexer(layer.self_attn.indexer, p + "self_attn.indexer.")
                reg(layer.self_attn, out_hook(p + "self_attn.out", 0))
            reg(layer.mlp_hyper_connection, in_hook(p + "attn_hyper_connection.combine"))
            reg(layer.mlp_hyper_connection, out_hook(p + "mlp_hyper_connection.out", 0))
            reg(layer.mlp_hyper_connection, out_hook(p + "mlp_hyper_connection.injection_weights", 2))
            reg(layer.mlp.gate, gate_hook(p + "mlp.gate."))
            reg(layer.mlp, out_hook(p + "mlp.out"))
            reg(layer, out_hook(p + "mlp_hyper_connection.combine"))
        reg(tm.hyper_connection_mixer, out_hook("hyper_connection_mixer.out"))
        reg(self.model.lm_head, out_hook("logits"))

    def _spy_indexer(self, ix, prefix: str) -> None:
        """Record the indexer's own ``scores.topk`` calls while it runs (see the module docstring) and emit
        ``block_scores [T, n_blocks]`` (-inf where a block is not complete/visible; one -inf column before the
        first complete block, as the reference) and ``selected_blocks [T, block_topk]`` (-1 padded)."""
        from torch.overrides import TorchFunctionMode

        from reference import taphook
        torch, be, cfg = self.torch, self, self.config
        r, k = cfg.indexer_compress_ratio, cfg.block_topk

        class Spy(TorchFunctionMode):
            def __init__(self):
                super().__init__()
                self.calls = []

            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func is torch.Tensor.topk:
                    self.calls.append((args[0].detach().float().cpu().numpy().copy(),
                                       out.indices.detach().cpu().numpy().astype(np.int64)))
                return out

        state = {}

        def pre(_m, args):
            rec = taphook.current()
            if rec is None or (hasattr(rec, "wants") and not (rec.wants(prefix + "block_scores")
                                                              or rec.wants(prefix + "selected_blocks"))):
                return
            spy = Spy()
            spy.__enter__()
            state["spy"] = spy

        def post(_m, args, _out):
            spy = state.pop("spy", None)
            if spy is None:
                return
            spy.__exit__(None, None, None)
            T = args[0].shape[1]
            pos = np.arange(be._tap_pos, be._tap_pos + T)
            nc = (pos + 1) // r
            width = max(1, int(nc.max()))
            scores = np.full((T, width), -np.inf, dtype=np.float32)
            sel = np.full((T, k), -1, dtype=np.int64)
            calls = iter(spy.calls)
            for t in np.nonzero(nc > 0)[0]:
                sc, idx = next(calls)
                scores[t, :sc.shape[0]] = sc
                sel[t, :idx.shape[0]] = idx
            rec = taphook.current()
            for name, v in ((prefix + "block_scores", scores), (prefix + "selected_blocks", sel)):
                if not hasattr(rec, "wants") or rec.wants(name):
                    rec.emit(name, v, positions=pos)

        self._tap_hooks.append(ix.register_forward_pre_hook(pre))
        self._tap_hooks.append(ix.register_forward_hook(post))

    # ------------------------------------------------------------------------------------------- sequences
    def _seq(self, h) -> _Seq:
        return self._seqs.get_live(h)

    def new_sequence(self):
        """A new empty sequence (no cache until its first forward); returns its int handle."""
        return self._seqs.add(_Seq())

    def free(self, h) -> None:
        """Drop sequence ``h`` and its cache (an unknown handle is ignored)."""
        self._seqs.pop(h, None)

    def _forward(self, s: _Seq, ids: list[int]) -> np.ndarray:
        """One official forward of ``ids`` on ``s``'s cache at positions ``s.pos..``; logits ``[T, V]`` float32."""
        torch = self.torch
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        pid = torch.arange(s.pos, s.pos + len(ids), device=self.device)[None]
        self._tap_pos = s.pos
        from reference import taphook
        # the tap hooks only while a recorder listens (taphook.current()): a hooked module takes torch's slow call
        # path, ~30% of a small model's decode step (measured on tiny); inference_mode: no autograd bookkeeping
        # (~10% more). Neither changes an operation of the official forward.
        hooked = taphook.current() is not None and not self._tap_hooks
        if hooked:
            self._install_tap_hooks()
        try:
            with torch.inference_mode():
                out = self.model(input_ids=x, position_ids=pid, cache=s.cache, use_cache=True)
        finally:
            if hooked:
                for hk in self._tap_hooks:
                    hk.remove()
                self._tap_hooks.clear()
        s.cache = out.cache
        s.pos += len(ids)
        return out.logits[0].float().cpu().numpy()

    def prefill(self, h, ids, chunk_size=None):
        """Logits ``[T, V]`` of ``ids`` fed to ``h`` in one forward (or chunks of ``chunk_size``).

        Raises:
            InputError: bad ids or chunk size. BackendError: ``h`` not live.
        """
        ids = check_ids(ids, self.config.vocab_size, "ids").tolist()
        s = self._seq(h)
        s.pre_verify = None
        if chunk_size is not None and int(chunk_size) < 1:
            raise InputError(f"prefill: chunk_size: expected a positive integer, found {chunk_size}")
        step = len(ids) if not chunk_size else int(chunk_size)
        return np.concatenate([self._forward(s, ids[k:k + step]) for k in range(0, len(ids), step)])

    def decode(self, hs, ids):
        """Logits ``[B, V]``: ``ids[i]`` on ``hs[i]``, one official forward per sequence.

        Raises:
            InputError: ``len(hs) != len(ids)`` or bad ids. BackendError: a handle that is not live.
        """
        ids = decode_args(hs, ids, self.config.vocab_size)
        rows = []
        for h, t in zip(hs, ids):
            s = self._seq(h)
            s.pre_verify = None
            rows.append(self._forward(s, [t])[0])
        return np.stack(rows)

    def forward_tokens(self, h, ids):
        """Logits ``[k, V]`` of the drafted ``ids``; keeps a deep copy of the cache from before them (for a
        rollback within this call). Raises InputError / BackendError as :meth:`prefill`."""
        ids = check_ids(ids, self.config.vocab_size, "draft ids").tolist()
        s = self._seq(h)
        pre = (copy.deepcopy(s.cache), s.pos, list(ids)) if not self._crop_ok else None
        out = self._forward(s, ids)
        s.pre_verify = pre
        return out

    def rollback(self, h, n):
        """Forget the last ``n`` tokens of ``h``: ``cache.crop(-n)`` when the model has no GDN layer, else
        within the last :meth:`forward_tokens` call (restore its pre-verify copy, re-feed the accepted tokens).

        Raises:
            InputError: ``n`` negative or above the position. CapabilityLimit: outside the declared limit.
        """
        n = int(n)
        s = self._seq(h)
        if n < 0 or n > s.pos:
            raise InputError(f"rollback: expected 0 <= n <= {s.pos} (the sequence length), found {n}")
        if n == 0:
            return
        if self._crop_ok:
            s.cache.crop(-n)
            s.pos -= n
            return
        pv = s.pre_verify
        if pv is None or n > len(pv[2]) or s.pos != pv[1] + len(pv[2]):
            raise CapabilityLimit(f"backend {self.name}: rollback of {n} token(s): the official cache cannot crop "
                                  f"a GDN recurrent state; this backend rolls back only within the last "
                                  f"forward_tokens call, right after it"
                                  + ("" if pv is None else f" ({len(pv[2])} token(s))"))
        cache, pos, drafted = pv
        # the pre-verify copy is this sequence's own (forward_tokens made it, nothing else holds it) and is used
        # once: it becomes the cache as it is, no second copy
        s.cache, s.pos, s.pre_verify = cache, pos, None
        keep = drafted[:len(drafted) - n]
        if keep:
            self._forward(s, keep)

    def snapshot(self, h):
        """A deep copy of ``h``'s cache and position (independent of the sequence afterwards)."""
        s = self._seq(h)
        return ("transformers-snapshot", id(self), copy.deepcopy(s.cache), s.pos)

    def restore(self, h, snap):
        """Put a deep copy of ``snap`` into ``h`` (the snapshot stays usable).

        Raises:
            InputError: ``snap`` is not a snapshot of this backend.
        """
        s = self._seq(h)
        if not (isinstance(snap, tuple) and len(snap) == 4 and snap[0] == "transformers-snapshot"
                and snap[1] == id(self)):
            raise InputError(f"backend {self.name}: restore: expected a snapshot of this backend, found "
                             f"{type(snap).__name__}")
        s.cache, s.pos, s.pre_verify = copy.deepcopy(snap[2]), snap[3], None

    def position(self, h):
        """Tokens in ``h``'s cache (tracked by the backend; ``cache.get_seq_length()`` agrees)."""
        return int(self._seq(h).pos)

    def state_arrays(self, h):
        """Every tensor of ``h``'s cache as float32/int64 arrays: ``layers.{i}.keys`` / ``.values`` /
        ``.indexer_keys`` (attention layers), ``layers.{i}.conv_states.{k}`` / ``.recurrent_states.{k}``
        (GDN layers: k = 0 GDN conv, 1 PLE conv, 2 n-gram token context). Empty for an empty sequence."""
        s = self._seq(h)
        out: dict[str, np.ndarray] = {}
        if s.cache is None:
            return out
        for i, layer in enumerate(s.cache.layers):
            for f in ("keys", "values", "indexer_keys"):
                t = getattr(layer, f, None)
                if t is not None and hasattr(t, "numel") and t.numel():
                    out[f"layers.{i}.{f}"] = _np(t)
            for f in ("conv_states", "recurrent_states"):
                for k, t in (getattr(layer, f, None) or {}).items():
                    if t is not None:
                        out[f"layers.{i}.{f}.{k}"] = _np(t)
        return out

    def close(self) -> None:
        """Remove the hooks and drop every sequence."""
        for hk in self._hooks + self._tap_hooks:
            hk.remove()
        self._hooks.clear()
        self._tap_hooks.clear()
        self._seqs.clear()


def _np(t) -> np.ndarray:
    a = t.detach().cpu()
    return a.float().numpy().copy() if a.is_floating_point() else a.numpy().astype(np.int64)


def _quiet():
    """Silence transformers' load report and kernel-fallback notices (not errors; they flood the table)."""
    from transformers.utils import logging as tlog
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()


def _load_pretrained(model_path: Path, tdt):
    """``<architectures[0]>.from_pretrained`` in ``tdt`` with eager attention. A release (ConditionalGeneration)
    checkpoint that stores no vision tensors gets a one-block 16-wide vision tower: the default one is ~450M
    random parameters (2 GB of RAM) that a text forward never touches.

    Raises:
        BackendError: an architecture that is not a qwen4_exp class, or transformers refusing the checkpoint.
    """
    import transformers
    from transformers import AutoConfig
    _quiet()
    try:
        hcfg = AutoConfig.from_pretrained(str(model_path))
    except Exception as e:
        raise BackendError(f"backend transformers: AutoConfig.from_pretrained({str(model_path)!r}) refused the "
                           f"checkpoint: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    arch = (getattr(hcfg, "architectures", None) or ["Qwen4ExpForCausalLM"])[0]
    if arch not in ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"):
        raise BackendError(f"backend transformers: config.json architectures: expected Qwen4ExpForCausalLM or "
                           f"Qwen4ExpForConditionalGeneration, found {arch!r}")
    # the reader's checks first (headers only): a missing, mis-shaped or truncated tensor is one error naming the
    # tensor, its file and the shapes, where from_pretrained reports only that its conversion failed
    from reference.checkpoint import Checkpoint
    ck = Checkpoint.open(model_path)
    try:
        ck.validate()
        stores_vision = any(n.startswith("visual.") for n in ck.names())
    finally:
        ck.close()
    note = f"{arch}.from_pretrained"
    if arch == "Qwen4ExpForConditionalGeneration" and not stores_vision:
        v = hcfg.vision_config
        v.depth, v.hidden_size, v.intermediate_size, v.num_heads, v.num_position_embeddings = 1, 16, 16, 1, 4
        v.out_hidden_size = hcfg.text_config.hidden_size
        note += " (checkpoint has no vision tensors: vision tower shrunk to one 16-wide block, unused by text)"
    cls = getattr(transformers, arch)
    try:
        model = cls.from_pretrained(str(model_path), config=hcfg, dtype=tdt, attn_implementation="eager")
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise BackendError(f"backend transformers: {arch}.from_pretrained refused {str(model_path)!r}: "
                           f"{type(e).__name__}: {msg} (load=reader reads the weights with reference.checkpoint "
                           f"instead)") from e
    return model, note


def _load_reader(model_path: Path, cfg, tdt, quant):
    """``Qwen4ExpForCausalLM(text config)`` with every parameter read by ``reference.checkpoint`` (float32,
    FP8 dequantised exactly; per-expert or fused experts; sharded n-gram tables concatenated), then cast to
    ``tdt``. Buffers derived from the config (PLE multipliers, head sizes) keep the official values.

    Raises:
        CheckpointError: a parameter of the official model the checkpoint lacks.
    """
    import torch
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpForCausalLM
    from reference.checkpoint import Checkpoint, canonical_name
    _quiet()
    d = dict(cfg.to_dict())
    d.pop("model_type", None)
    d.pop("quantization_config", None)
    tcfg = Qwen4ExpTextConfig(**{k: v for k, v in d.items() if k not in ("architectures",)})
    tcfg._attn_implementation = "eager"
    model = Qwen4ExpForCausalLM(tcfg).eval()
    ck = Checkpoint.open(model_path)
    try:
        with torch.no_grad():
            for hname, p in model.named_parameters():
                n = canonical_name(hname)
                m = _fused_expert(n)
                if m is not None and not ck.has(n):
                    layer, which = m
                    parts = [ck.expert(layer, e) for e in range(cfg.num_experts)]
                    arr = np.stack([np.concatenate([g, u]) if which == "gate_up_proj" else dn
                                    for g, u, dn in parts])
                else:
                    arr = ck.get(n, np.float32)
                if tuple(arr.shape) != tuple(p.shape):
                    from reference.errors import CheckpointError
                    raise CheckpointError(f"{model_path}: tensor {n!r}: expected shape {tuple(p.shape)} (the "
                                          f"official module), found {tuple(arr.shape)}")
                p.copy_(torch.from_numpy(np.ascontiguousarray(arr)))
    finally:
        ck.close()
    note = "load=reader: Qwen4ExpForCausalLM + weights read by reference.checkpoint" + (
        f" ({quant.get('quant_method', 'quantised')} dequantised exactly in float32; transformers' own FP8 loader "
        f"needs accelerate and dequantises to bf16 without a GPU)" if quant else "")
    return model.to(tdt), note


def _fused_expert(name: str):
    import re
    m = re.match(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
    return (int(m.group(1)), m.group(2)) if m else None


# the official implementation; device also takes cuda:N, perturb a module path (layers.2.mlp), threads a positive
# integer or auto: each is checked by TransformersBackend.open
BACKEND = BackendEntry("transformers", TransformersBackend,
                       {"device": str, "dtype": ("float32", "bfloat16"), "load": ("auto", "pretrained", "reader"),
                        "perturb": str, "page_size": int, "threads": str},
                       help="the official implementation; device cpu or cuda[:N], perturb a module path, "
                            "threads N or auto")
