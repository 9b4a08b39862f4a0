"""Generation: chat rendering, sampling, streaming, stop conditions, batch == single, CLI errors.

Most tests run on a toy language model (logits a fixed pseudo-random function of the token history)
and a byte-level BPE tokenizer trained here, so they are fast and independent of the other
packages; the tiny-checkpoint tests at the end run the real reference/engine when present.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from parity import generate as G
from parity.backends import Backend

# --------------------------------------------------------------------------------------------- fixtures
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CORPUS = ["hello world, the quick brown fox jumps over the lazy dog",
          "héllo wörld ünïcode çafé naïve", "日本語のテキスト 你好世界", "emoji 🙂🚀 and more 🙂"] * 20


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


class ToyConfig:
    def __init__(self, vocab, eos=(0,)):
        self.vocab_size = vocab
        self.eos_token_ids = eos
        self.max_position_embeddings = 1 << 20


class ToyLM(Backend):
    """A toy backend (the parity Backend protocol, as the generator sees every model): logits are a
    pseudo-random function of (position, last two tokens), a stateful model whose every mistake in state
    or position handling changes the output. ``closed`` counts freed sequences."""

    def __init__(self, vocab, max_context=256, eos_bias_after=None, eos=0, scale=4.0):
        self.max_positions, self.config = max_context, ToyConfig(vocab, (eos,))
        self.vocab_size = vocab
        self.eos_bias_after, self.eos, self.scale = eos_bias_after, eos, scale
        self.closed = 0

    def row(self, hist):
        key = [len(hist), hist[-1], hist[-2] if len(hist) > 1 else 7]
        x = np.random.default_rng(key).normal(size=self.vocab_size) * self.scale
        x[self.eos] = -50.0
        if self.eos_bias_after is not None and len(hist) >= self.eos_bias_after:
            x[self.eos] = 100.0
        return x.astype(np.float32)

    def new_sequence(self):
        return []

    def prefill(self, h, ids, chunk_size=None):
        rows = []
        for t in ids:
            h.append(int(t))
            rows.append(self.row(h))
        return np.stack(rows)

    def decode(self, hs, ids):
        rows = []
        for h, t in zip(hs, ids):
            h.append(int(t))
            rows.append(self.row(h))
        return np.stack(rows)

    def free(self, h):
        self.closed += 1


class RowSwapLM(ToyLM):
    """Negative control: a batched decode that returns its rows in the wrong order."""

    def decode(self, hs, ids):
        out = super().decode(hs, ids)
        return out[::-1].copy() if len(out) > 1 else out


class StaleStateLM(ToyLM):
    """Negative control: in a batch, sequence 1's state misses the latest token (dropped state)."""

    def decode(self, hs, ids):
        rows = []
        for j, (h, t) in enumerate(zip(hs, ids)):
            h.append(int(t))
            rows.append(self.row(h[:-1] if (j == 1 and len(hs) > 1) else h))
        return np.stack(rows)


def prompts_for(tok):
    return [tok.encode(s).ids for s in ("hello world", "héllo wörld ünïcode", "你好", "the lazy dog jumps")]


# --------------------------------------------------------------------------------------------- chat template
USER = {"role": "user", "content": "Hi"}


def test_chatml_thinking_on_by_default():
    s = G.render_chatml([USER])
    assert s == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_chatml_thinking_off():
    s = G.render_chatml([USER], enable_thinking=False)
    assert s.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert s.count("<think>") == 1
    # negative control: thinking on must not produce the closed think block
    assert not G.render_chatml([USER]).endswith("</think>\n\n")


def test_chatml_no_generation_prompt():
    assert G.render_chatml([USER], add_generation_prompt=False) == "<|im_start|>user\nHi<|im_end|>\n"


def test_chatml_leading_system_messages_merged():
    msgs = [{"role": "system", "content": "A"}, {"role": "developer", "content": "B"}, USER]
    s = G.render_chatml(msgs)
    assert s.startswith("<|im_start|>system\nA\n\nB<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")
    assert s.count("<|im_start|>system") == 1


@pytest.mark.parametrize("msgs, match", [
    ([USER, {"role": "system", "content": "late"}], "must come before"),
    ([{"role": "robot", "content": "x"}, USER], "role"),
    ([{"role": "system", "content": "only system"}], "user message"),
    ([{"role": "system", "content": [{"type": "image"}]}, USER], "cannot contain images"),
    ([], "non-empty"),
])
def test_chatml_raise_sites(msgs, match):
    with pytest.raises(G.TemplateError, match=match):
        G.render_chatml(msgs)


def test_chatml_tool_turns():
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "añadir", "parameters": {}}}]
    msgs = [{"role": "system", "content": "S"}, USER,
            {"role": "assistant", "content": "", "reasoning_content": "need time",
             "tool_calls": [{"function": {"name": "get_time", "arguments": {"tz": "UTC", "n": 2}}}]},
            {"role": "tool", "content": "12:00"}, {"role": "tool", "content": "13:00"}]
    s = G.render_chatml(msgs, tools=tools)
    sys_turn = s.split("<|im_end|>")[0]
    assert sys_turn.startswith("<|im_start|>system\nS\n\n# Tools")
    body = sys_turn.split("<tools>")[1].split("</tools>")[0]
    # one JSON object per line, non-ASCII kept
    assert [json.loads(x) for x in body.strip("\n").split("\n")] == tools
    assert "añadir" in body
    call = ("<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n<parameter=n>\n2\n</parameter>\n"
            "</function>\n</tool_call>")
    assert f"<|im_start|>assistant\n<think>\nneed time\n</think>\n\n{call}<|im_end|>\n" in s
    # consecutive tool results merge into ONE user turn
    assert ("<|im_start|>user\n<tool_response>\n12:00\n</tool_response>\n<tool_response>\n13:00\n"
            "</tool_response><|im_end|>\n") in s
    assert s.count("<|im_start|>user") == 2


def test_chatml_preserves_past_thinking():
    msgs = [USER, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello"}, USER]
    s = G.render_chatml(msgs)
    assert "<|im_start|>assistant\n<think>\nhmm\n</think>\n\nHello<|im_end|>\n" in s
    s2 = G.render_chatml([USER, {"role": "assistant", "content": "Hello", "reasoning_content": "r"}, USER])
    assert "<|im_start|>assistant\n<think>\nr\n</think>\n\nHello<|im_end|>" in s2


def test_chatml_images_in_user_turn():
    s = G.render_chatml([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}])
    assert "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>what?<|im_end|>" in s


def test_chatml_reasoning_effort_gap_is_an_error():
    assert G.render_chatml([USER], reasoning_effort="medium") == G.render_chatml([USER])
    with pytest.raises(G.TemplateError, match="built-in"):
        G.render_chatml([USER], reasoning_effort="xhigh")
    with pytest.raises(G.TemplateError, match="expected one of"):
        G.render_chatml([USER], reasoning_effort="extreme")


MARKER_TEMPLATE = ("{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}"
                   "{% if add_generation_prompt %}<gen think={{ enable_thinking }}>{% endif %}")


@pytest.mark.parametrize("where", ["jinja", "config", "config_list"])
def test_checkpoint_template_used_where_present(tmp_path, where):
    if where == "jinja":
        (tmp_path / "chat_template.jinja").write_text(MARKER_TEMPLATE)
    elif where == "config":
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": MARKER_TEMPLATE}))
    else:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(
            {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": MARKER_TEMPLATE}]}))
    text, src = G.render_chat([USER], model_dir=tmp_path, enable_thinking=False)
    assert src == "checkpoint"
    assert text == "[user|Hi]<gen think=False>"


def test_builtin_used_when_checkpoint_has_no_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    text, src = G.render_chat([USER], model_dir=tmp_path)
    assert src == "builtin" and text == G.render_chatml([USER])


def test_jinja_raise_exception_and_sandbox():
    with pytest.raises(G.TemplateError, match="no user"):
        G.render_jinja_template("{{ raise_exception('no user query') }}", [USER])
    with pytest.raises(G.TemplateError):  # sandbox: no attribute walking to Python internals
        G.render_jinja_template("{{ ''.__class__.__mro__[1].__subclasses__() }}", [USER])


def test_chatml_jinja_equivalence_on_a_qwen_style_template():
    """A checkpoint ChatML template (written here from the same rules) and the built-in agree;
    negative control: a template with a wrong think block is told apart."""
    tpl = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}"
           "{% if enable_thinking is defined and not enable_thinking %}{{ '\\n</think>\\n\\n' }}{% endif %}{% endif %}")
    msgs = [{"role": "system", "content": "S"}, USER, {"role": "assistant", "content": "ok"}, USER]
    for think in (True, False):
        assert G.render_jinja_template(tpl, msgs, enable_thinking=think) == G.render_chatml(msgs, enable_thinking=think)
    bad = tpl.replace("<think>\\n' }}", "<think>' }}")
    assert bad != tpl
    assert G.render_jinja_template(bad, msgs, enable_thinking=True) != G.render_chatml(msgs)


# --------------------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("kw, name", [({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                                      ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
                                      ({"top_k": 2.5}, "top_k"), ({"seed": -3}, "seed"), ({"max_new_tokens": 0}, "max_new_tokens")])
def test_sampling_range_errors(kw, name):
    with pytest.raises(G.SamplingError, match=name):
        G.SamplingParams(**kw).validate()


def test_sampler_greedy_and_degenerate_filters():
    rng = np.random.default_rng(1)
    for _ in range(20):
        x = rng.normal(size=50)
        best = int(np.argmax(x))
        assert G.Sampler(G.SamplingParams(do_sample=False))(x) == best
        assert G.Sampler(G.SamplingParams(temperature=0.0))(x) == best
        assert G.Sampler(G.SamplingParams(top_k=1, seed=int(rng.integers(1000))))(x) == best
        assert G.Sampler(G.SamplingParams(top_p=1e-6, seed=int(rng.integers(1000))))(x) == best
    # ties: lowest id, as numpy/transformers argmax
    assert G.Sampler(G.SamplingParams(do_sample=False))(np.array([0.0, 3.0, 3.0])) == 1


def test_sampler_support_and_distribution():
    x = np.log(np.array([0.4, 0.3, 0.2, 0.06, 0.04]))
    s = G.Sampler(G.SamplingParams(top_p=0.85, seed=3))
    draws = np.array([s(x) for _ in range(4000)])
    # top-p 0.85 keeps {0,1,2} (cumulative 0.4, 0.7, 0.9): ids 3, 4 must never appear
    assert set(np.unique(draws)) == {0, 1, 2}
    freq = np.bincount(draws, minlength=5)[:3] / len(draws)
    expect = np.array([0.4, 0.3, 0.2]) / 0.9
    # binomial std at n=4000, p<=0.45 is <= 0.0079; 5 sigma = 0.04 keeps false failures negligible
    assert np.max(np.abs(freq - expect)) < 0.04
    s = G.Sampler(G.SamplingParams(top_k=2, seed=4))
    assert set(s(x) for _ in range(500)) == {0, 1}
    # temperature flattens: at T=10 the rarest token shows up regularly, at T=0.1 essentially never
    hot = G.Sampler(G.SamplingParams(temperature=10.0, seed=5))
    cold = G.Sampler(G.SamplingParams(temperature=0.1, seed=5))
    assert sum(hot(x) == 4 for _ in range(1000)) > 100
    assert sum(cold(x) == 4 for _ in range(1000)) == 0


def test_sampler_seeded():
    x = np.random.default_rng(0).normal(size=100)
    a = [G.Sampler(G.SamplingParams(seed=9))(x) for _ in range(1)]
    s1, s2, s3 = (G.Sampler(G.SamplingParams(seed=k)) for k in (9, 9, 10))
    r1, r2, r3 = ([s(x) for _ in range(30)] for s in (s1, s2, s3))
    assert r1 == r2 and r1[0] == a[0]
    assert r1 != r3  # negative control: another seed draws another sequence


def test_sampler_refuses_logits_nothing_can_be_drawn_from():
    """NaN or +inf logits (a backend or checkpoint gone wrong) are one inconclusive error naming the draw, the id
    and the value -- not numpy's 'Probabilities contain NaN' as an internal error, nor a silent argmax landing on
    the NaN's id. -inf alone marks an excluded id and is sampled around (negative control)."""
    from reference.errors import EXIT_INCONCLUSIVE, InconclusiveError
    x = np.array([0.5, 1.0, 2.0, 0.1])
    for params in (G.SamplingParams(seed=1), G.SamplingParams(do_sample=False), G.SamplingParams(top_p=0.5)):
        for val, j in ((np.nan, 2), (np.inf, 1)):
            y = x.copy()
            y[j] = val
            with pytest.raises(InconclusiveError, match=rf"generated token 3: .*found {val} at id {j}") as e:
                G.Sampler(params)(y, "generated token 3")
            assert e.value.exit_code == EXIT_INCONCLUSIVE
        with pytest.raises(InconclusiveError, match="found -inf at id 0"):
            G.Sampler(params)(np.full(4, -np.inf))
        y = x.copy()
        y[2] = -np.inf
        assert G.Sampler(params)(y) != 2


def test_generation_config_defaults():
    gc = {"eos_token_id": [248046, 248044], "do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95}
    d = G.sampling_defaults(gc)
    assert d == {"do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95}
    assert G.eos_ids_from(gc, (248044,)) == (248044, 248046)
    assert G.sampling_defaults({})["do_sample"] is False


# --------------------------------------------------------------------------------------------- streaming
def test_stream_decoder_reassembles_multibyte(tokenizer):
    rng = np.random.default_rng(0)
    n_vocab = tokenizer.get_vocab_size()
    texts = CORPUS[:4] + ["🙂🙂 ok", "ü日🚀"]
    for t in texts:
        ids = tokenizer.encode(t).ids
        sd = G.StreamDecoder(tokenizer)
        pieces = [sd.push(i) for i in ids] + [sd.flush()]
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=False) == t
        assert not any("\ufffd" in p for p in pieces)
    for _ in range(30):  # random id streams incl. split multi-byte characters
        ids = rng.integers(0, n_vocab, size=25).tolist()
        sd = G.StreamDecoder(tokenizer)
        got = "".join([sd.push(i) for i in ids] + [sd.flush()])
        assert got == tokenizer.decode(ids, skip_special_tokens=False)


def test_stream_negative_control_naive_per_token_decode(tokenizer):
    """Decoding token by token breaks multi-byte characters; the test above would catch a streamer that did it."""
    ids = tokenizer.encode("🙂🚀日本").ids
    naive = "".join(tokenizer.decode([i]) for i in ids)
    assert naive != tokenizer.decode(ids)


# --------------------------------------------------------------------------------------------- generator
def test_stop_at_eos_and_length_and_context(tokenizer):
    V = tokenizer.get_vocab_size()
    prompt = tokenizer.encode("hello").ids
    lm = ToyLM(V, eos_bias_after=len(prompt) + 3)
    r = G.Generator(lm, tokenizer, eos_ids=[0]).generate(prompt, G.SamplingParams(do_sample=False, max_new_tokens=50))
    assert r.stop_reason == "eos" and r.token_ids[-1] == 0 and len(r.token_ids) == 4
    assert r.text == tokenizer.decode(r.token_ids[:-1])  # EOS not in the text
    # without EOS in the stop set the same run goes on to the limit
    r2 = G.Generator(lm, tokenizer, eos_ids=[]).generate(prompt, G.SamplingParams(do_sample=False, max_new_tokens=7))
    assert r2.stop_reason == "length" and len(r2.token_ids) == 7
    lm3 = ToyLM(V, max_context=len(prompt) + 5)
    r3 = G.Generator(lm3, tokenizer, eos_ids=[0]).generate(prompt, G.SamplingParams(do_sample=False, max_new_tokens=50))
    # positions len(prompt) .. max_context-1 can hold generated tokens: exactly 5
    assert r3.stop_reason == "context" and len(r3.token_ids) == 5
    assert lm.closed == 2 and lm3.closed == 1


def test_streamed_text_equals_result(tokenizer):
    lm = ToyLM(tokenizer.get_vocab_size())
    got = []
    r = G.Generator(lm, tokenizer).generate(tokenizer.encode("héllo").ids, G.SamplingParams(seed=1, max_new_tokens=30),
                                            on_text=got.append)
    assert "".join(got) == r.text == tokenizer.decode(r.token_ids, skip_special_tokens=False) and len(got) > 1


def test_prompt_longer_than_context(tokenizer):
    lm = ToyLM(tokenizer.get_vocab_size(), max_context=4)
    g = G.Generator(lm, tokenizer)
    with pytest.raises(G.ContextError, match="fewer than 4 tokens"):
        g.generate(list(range(1, 5)), G.SamplingParams())
    with pytest.raises(G.InputError, match="token ids"):
        g.generate([1, 10 ** 6], G.SamplingParams())


@pytest.mark.parametrize("params", [G.SamplingParams(do_sample=False, max_new_tokens=12),
                                    G.SamplingParams(seed=11, top_k=20, top_p=0.9, max_new_tokens=12)])
def test_batch_equals_single_toy(tokenizer, params):
    V = tokenizer.get_vocab_size()
    prompts = prompts_for(tokenizer)
    gen = G.Generator(ToyLM(V), tokenizer, eos_ids=[0])
    batch = gen.generate_batch(prompts, params)
    single = [gen.generate(p, params) for p in prompts]
    assert G.first_divergence(batch, single) is None
    assert len({tuple(r.token_ids) for r in batch}) == len(prompts)  # the prompts really differ


@pytest.mark.parametrize("faulty, seq", [(RowSwapLM, 0), (StaleStateLM, 1)])
def test_batch_negative_controls(tokenizer, faulty, seq):
    V = tokenizer.get_vocab_size()
    prompts = prompts_for(tokenizer)
    params = G.SamplingParams(do_sample=False, max_new_tokens=8)
    single = [G.Generator(ToyLM(V), tokenizer).generate(p, params) for p in prompts]
    batch = G.Generator(faulty(V), tokenizer).generate_batch(prompts, params)
    where = G.first_divergence(batch, single)
    assert where is not None and where[0] == seq and where[1] == 1  # the first decode step, not the prefill


# --------------------------------------------------------------------------------------------- real backends / CLI
TINY = Path(__file__).resolve().parents[2] / "fixtures" / "tiny"


def _need_tiny(backend):
    if not (TINY / "config.json").is_file() or not (TINY / "tokenizer.json").is_file():
        pytest.skip("fixtures/tiny (with tokenizer.json) not built yet")
    try:
        if backend == "engine":
            import engine
            getattr(engine, "Engine")
        else:
            import reference.model  # noqa: F401
    except (ImportError, AttributeError) as e:
        pytest.skip(f"{backend} not importable yet: {e}")


@pytest.mark.parametrize("backend", ["reference", "engine"])
def test_batch_equals_single_tiny(backend):
    _need_tiny(backend)
    lm = G.open_lm(TINY, backend=backend, device="cpu" if backend == "engine" else "auto", precision="float32")
    tok = G.load_tokenizer(TINY)
    prompts = [tok.encode(t).ids for t in ("hello world", "a b c d e f", "x")]
    prompts = [p if p else [1] for p in prompts]
    params = G.SamplingParams(do_sample=False, max_new_tokens=4)
    gen = G.Generator(lm, tok, eos_ids=[])
    batch = gen.generate_batch(prompts, params)
    single = [gen.generate(p, params) for p in prompts]
    assert G.first_divergence(batch, single) is None
    assert all(len(r.token_ids) == 4 for r in batch)


def _cli(argv, capsys):
    from parity.cli import main
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_cli_generate_json_tiny(capsys):
    _need_tiny("reference")
    rc, out, err = _cli(["generate", "--prompt", "hello", "--backend", "reference", "--max-new-tokens", "3",
                         "--greedy", "--json"], capsys)
    assert rc == 0, err
    obj = json.loads(out)
    assert len(obj["token_ids"]) <= 3 and obj["timings"]["prompt_tokens"] == len(obj["prompt_ids"]) > 0
    assert err.count("noise") == 1


def test_cli_errors(tmp_path, capsys):
    _need_tiny("reference")
    (tmp_path / "config.json").write_text((TINY / "config.json").read_text())
    rc, out, err = _cli(["generate", str(tmp_path), "--prompt", "x", "--backend", "reference"], capsys)
    assert rc == 2 and "tokenizer" in err and "tokenizer.json" in err
    rc, out, err = _cli(["generate", "--prompt", "x", "--backend", "reference", "--top-p", "1.5"], capsys)
    assert rc == 2 and "--top-p" in err
    rc, out, err = _cli(["generate", "--prompt", "x", "--backend", "reference", "--temperature", "-1"], capsys)
    assert rc == 2 and "temperature" in err
    from engine.backend import gpu_available
    if not gpu_available():
        rc, out, err = _cli(["generate", "--prompt", "x", "--backend", "engine", "--device", "cuda"], capsys)
        assert rc == 2 and "GPU" in err


def test_cli_prompt_longer_than_context(tmp_path, capsys):
    _need_tiny("reference")
    import shutil
    d = tmp_path / "m"
    shutil.copytree(TINY, d)
    cfg = json.loads((d / "config.json").read_text())
    tgt = cfg.get("text_config", cfg)
    tgt["max_position_embeddings"] = 8
    (d / "config.json").write_text(json.dumps(cfg))
    rc, out, err = _cli(["generate", str(d), "--prompt", "hello " * 20, "--backend", "reference"], capsys)
    # refused when the prompt is read, naming the limit (the context) and the prompt's length
    assert rc == 2 and "--prompt" in err and "max_position_embeddings=8" in err and "found" in err


def test_tiny_checkpoint_template_agrees_with_builtin_rules():
    """The bundled tiny checkpoint ships its own ChatML template; where the rules overlap (plain turns,
    thinking on/off) it must render exactly what the built-in rendering does."""
    if (TINY / "tokenizer_config.json").is_file() and G.load_chat_template(TINY):
        msgs = [{"role": "system", "content": "S"}, USER, {"role": "assistant", "content": "ok"}, USER]
        for think in (True, False):
            text, src = G.render_chat(msgs, model_dir=TINY, enable_thinking=think)
            assert src == "checkpoint"
            assert text == G.render_chatml(msgs, enable_thinking=think)
    else:
        pytest.skip("fixtures/tiny ships no chat template")


@pytest.mark.gpu
def test_batch_equals_single_tiny_gpu():
    from engine.backend import gpu_available
    if not gpu_available():
        pytest.skip("no CUDA GPU / cupy")
    _need_tiny("engine")
    tok = G.load_tokenizer(TINY)
    prompts = [tok.encode(t).ids or [1] for t in ("hello world", "a b c d e f", "x")]
    params = G.SamplingParams(do_sample=False, max_new_tokens=6)
    # float32: a greedy flip needs a top-2 logit gap below float32 rounding (~1e-6 relative), far below
    # the gaps of tiny's random logits; bf16 rounding could flip near-ties between batch shapes
    for prec in ("float32",):
        lm = G.open_lm(TINY, backend="engine", device="cuda", precision=prec)
        gen = G.Generator(lm, tok, eos_ids=[])
        batch = gen.generate_batch(prompts, params)
        single = [gen.generate(p, params) for p in prompts]
        assert G.first_divergence(batch, single) is None, prec
    # the GPU engine in float32 generates what the reference generates (greedy, 6 tokens)
    ref = G.Generator(G.open_lm(TINY, backend="reference"), tok, eos_ids=[]).generate_batch(prompts, params)
    gpu = G.Generator(G.open_lm(TINY, backend="engine", device="cuda", precision="float32"), tok,
                      eos_ids=[]).generate_batch(prompts, params)
    assert G.first_divergence(gpu, ref) is None
