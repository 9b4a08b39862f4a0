"""Quantised weights kept in their stored format (engine/kernels/quant.py, cuda/quant_linear.cu), CPU side.

What is checked without a GPU:
* the reader dequantises NVFP4 exactly (tiny-nvfp4 against hand-decoded codes) and refuses a malformed
  NVFP4 tensor with one clear error;
* the engine keeps tiny-fp8's and tiny-nvfp4's quantised tensors as QuantWeight (not float32 copies) and
  the twin's dequantisation is bit-identical to the reader's, stacked gate + up included;
* the CUDA decoders' bit manipulation (a line-by-line Python twin of ``e4m3_to_f32`` / ``e2m1_to_f32``)
  equals ml_dtypes / the E2M1 table for every code;
* the stored-format engine reproduces the goldens and a wrong scale is caught (negative control).
"""
import numpy as np
import pytest

from engine import Engine
from engine.kernels import linear as L
from engine.kernels.quant import QuantWeight, dequantize, stack_rows
from fixture_helpers import fixture_dir, load_golden
from reference.checkpoint import E2M1_VALUES, Checkpoint, CheckpointError, DictWeights


def _e4m3_bits_twin(b: int) -> float:
    """common.cuh:e4m3_to_f32 (used by quant_linear.cu, gemm_tc.cu), operation by operation."""
    em = b & 0x7F
    if em >= 8:
        v = np.array([(em << 20) + (120 << 23)], np.uint32).view(np.float32)[0]
    else:
        v = np.float32(em) * np.float32(0.001953125)
    if em == 0x7F:
        v = np.float32(np.nan)
    return -v if b & 0x80 else v


def _e2m1_bits_twin(nib: int) -> float:
    """common.cuh:e2m1_to_f32, operation by operation."""
    m = nib & 7
    bits = ((0x3F00 + m * 0x40) << 16) if m >= 2 else (0x3F000000 if m else 0)
    return np.array([bits | ((nib & 8) << 28)], np.uint32).view(np.float32)[0]


def test_cuda_decoders_match_every_code():
    import ml_dtypes
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.array([_e4m3_bits_twin(b) for b in range(256)], np.float32)
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32)) or np.array_equal(
        np.isnan(ref), np.isnan(got)) and np.array_equal(ref[~np.isnan(ref)], got[~np.isnan(got)])
    assert np.array_equal(np.array([_e2m1_bits_twin(n) for n in range(16)], np.float32).view(np.uint32),
                          E2M1_VALUES.view(np.uint32))
    # negative control: a decoder with the wrong exponent bias is caught by the same comparison
    wrong = np.array([np.float32(_e4m3_bits_twin(b)) * 2 for b in range(1, 0x7F)], np.float32)
    assert not np.array_equal(wrong, ref[1:0x7F])


def test_reader_dequantises_nvfp4_exactly():
    ck = Checkpoint.open(fixture_dir("tiny-nvfp4"))
    n = "layers.0.mlp.experts.3.up_proj.weight"
    assert ck.dtype(n) == "U8" and ck.is_nvfp4(n)
    q = np.asarray(ck.get_raw(n)).view(np.uint8)
    sc = np.asarray(ck.get_raw("layers.0.mlp.experts.3.up_proj.weight_scale")).astype(np.float32)
    g = np.float32(np.asarray(ck.get_raw("layers.0.mlp.experts.3.up_proj.weight_scale_2")).reshape(()))
    N, K2 = q.shape
    by_hand = np.empty((N, 2 * K2), np.float32)
    for r in range(N):
        for k in range(2 * K2):
            code = (q[r, k // 2] >> (4 * (k % 2))) & 15
            by_hand[r, k] = (E2M1_VALUES[code] * sc[r, k // 16]) * g
    got = ck.get(n)
    assert got.shape == (N, 2 * K2) == (ck.config.moe_intermediate_size, ck.config.hidden_size)
    assert np.array_equal(got, by_hand)
    g_, u_, d_ = ck.expert(0, 3)
    assert np.array_equal(u_, by_hand)
    assert ck.validate() == []  # weight_scale_2 / input_scale are known names, shapes checked logically


def test_reader_refuses_malformed_nvfp4():
    ck = Checkpoint.open(fixture_dir("tiny-nvfp4"))
    arrays = {n: np.asarray(ck.get_raw(n)) for n in ck.names() if ".mlp.experts.0." in n and "layers.0." in n}
    base = "layers.0.mlp.experts.0.gate_proj."
    bad = dict(arrays)
    bad[base + "weight_scale"] = np.asarray(arrays[base + "weight_scale"])[:, :2]
    dw = DictWeights(ck.config, bad)
    with pytest.raises(CheckpointError, match=r"weight_scale.*unexpected shape.*expected \[32, 4\]"):
        dw.get(base + "weight")
    del bad[base + "weight_scale"]
    with pytest.raises(CheckpointError, match=r"expected 'layers.0.mlp.experts.0.gate_proj.weight_scale'"):
        DictWeights(ck.config, bad).get(base + "weight")


@pytest.mark.parametrize("name, fmt", [("tiny-fp8", "fp8"), ("tiny-nvfp4", "nvfp4")])
def test_engine_keeps_stored_format_and_twin_is_bit_exact(name, fmt):
    ck = Checkpoint.open(fixture_dir(name))
    eng = Engine(ck, device="cpu")
    w = eng.model.w
    gu, dn = w["layers.1.mlp.experts.gate_up"], w["layers.1.mlp.experts.down"]
    assert isinstance(gu, QuantWeight) and gu.fmt == fmt and isinstance(dn, QuantWeight)
    c = ck.config
    I = c.moe_intermediate_size
    for e in (0, c.num_experts - 1):
        g, u, d = ck.expert(1, e)
        deq = dequantize(gu[e])
        assert np.array_equal(deq[:I], g) and np.array_equal(deq[I:], u)
        assert np.array_equal(dequantize(dn[e]), d)
    assert np.array_equal(dequantize(gu)[e], np.concatenate([g, u]))  # stacked form == per-expert form
    if fmt == "fp8":  # a dense FP8 projection too, and gate/up stacked with 32-row scale blocks (I=32 < 128)
        n = "layers.2.self_attn.o_proj.weight"
        assert isinstance(w[n], QuantWeight) and np.array_equal(dequantize(w[n]), ck.get(n))
        assert gu.rb == 32
    # 1 byte (fp8) / half a byte (nvfp4) per expert weight instead of 4
    assert gu.q.nbytes == gu.shape[0] * gu.shape[1] * gu.shape[2] // (1 if fmt == "fp8" else 2)


@pytest.mark.parametrize("name", ["tiny-fp8", "tiny-nvfp4"])
def test_stored_format_engine_matches_goldens_and_a_wrong_scale_is_caught(name):
    ck = Checkpoint.open(fixture_dir(name))
    g, _ = load_golden(name)
    ids = g["qsa/ids"]
    want = g["qsa/logits"]
    eng = Engine(ck, precision="float32", device="cpu")
    s = eng.add_sequence()
    got = eng.prefill(s, ids)
    scale = np.abs(want).max()
    # float32 throughout: only summation order differs from the official float32 forward
    assert np.abs(got - want).max() / scale < 1e-5
    # negative control: one expert's scale off by 2x (what a dropped weight_scale_2 or a misread block does)
    gu = eng.model.w["layers.0.mlp.experts.gate_up"]
    if gu.fmt == "fp8":
        gu.scale[:] *= 2
    else:
        gu.scale2[:] *= 2
    s2 = eng.add_sequence()
    bad = eng.prefill(s2, ids)
    assert np.abs(bad - want).max() / scale > 1e-3


def test_stack_rows_keeps_every_scale():
    rng = np.random.default_rng(0)

    def fp8(n, k, rb):
        q = rng.integers(0, 0x7E, size=(n, k), dtype=np.uint8)
        s = rng.uniform(0.5, 2, size=(-(-n // rb), -(-k // 128))).astype(np.float32)
        return QuantWeight("fp8", (n, k), q, s, rb=rb, cb=128)
    a, b = fp8(40, 256, 128), fp8(40, 256, 128)
    st = stack_rows([a, b])
    assert st.rb == 8 and np.array_equal(dequantize(st), np.concatenate([dequantize(a), dequantize(b)]))


def test_quant_kernel_choice():
    # unaligned / odd K: the scalar kernels (4 weight rows per warp; few blocks for the SMs: 8 warps split K)
    scalar = dict(sms=132, vec=False)
    assert L.quant_kernel_choice("nvfp4", 4, 131072, 2560, 1, **scalar) == ("qgemv_nvfp4_nt4_r4_ks1_s", 4096)
    assert L.quant_kernel_choice("fp8", 1, 10240, 2560, 1, **scalar) == ("qgemv_fp8_nt1_r4_ks1_s", 320)
    assert L.quant_kernel_choice("fp8", 1, 2560, 640, 1, **scalar) == ("qgemv_fp8_nt1_r1_ks8_s", 2560)
    assert L.quant_kernel_choice("nvfp4", 16, 131072, 2560, 1, **scalar) == ("qgemv_nvfp4_nt16_r1_ks1_s", 16384)
    # streaming kernels: KS so that one round of U chunks per lane covers a row (nvfp4 gate_up: 80 chunks =
    # 4 lanes x 4 warps x 5; down: 20 = 4 x 1 x 5), rows per block (8 / KS) * (32 / G) * RL
    v2 = dict(sms=132, config=(4, 1, 5), qmma=False)
    assert L.quant_kernel_choice("nvfp4", 1, 1280, 2560, 20, vec=True, **v2) == ("qgemv2_nvfp4_nt1_g4_r1_ks4_u5", 80)
    assert L.quant_kernel_choice("nvfp4", 1, 2560, 640, 20, vec=True, **v2) == ("qgemv2_nvfp4_nt1_g4_r1_ks1_u5", 40)
    assert L.quant_kernel_choice("fp8", 1, 1280, 2560, 20, vec=True, **v2) == ("qgemv2_fp8_nt1_g4_r1_ks8_u5", 160)
    # few blocks for the SMs: KS doubled (one 320-row matrix: 5 blocks at KS 1 -> 8 warps split K)
    assert L.quant_kernel_choice("nvfp4", 1, 320, 640, 1, vec=True, **v2) == ("qgemv2_nvfp4_nt1_g4_r1_ks8_u5", 40)
    assert L.quant_kernel_choice("fp8", 64, 1000, 64, 3, vec=True, sms=132)[0] == "qgemm_fp8"
    # the tensor-core NVFP4 GEMV (K % 128 == 0, sm_80+): KS doubled while blocks < 2 x SMs, up to the 128-k groups
    tc = dict(sms=132, vec=True, qmma=True, cc=90)
    assert L.quant_kernel_choice("nvfp4", 1, 1280, 2560, 10, **tc) == ("qmma_nvfp4_nt1_ks4", 40)
    assert L.quant_kernel_choice("nvfp4", 1, 2560, 640, 10, **tc) == ("qmma_nvfp4_nt1_ks2", 40)
    assert L.quant_kernel_choice("nvfp4", 16, 2560, 128, 1, **tc) == ("qmma_nvfp4_nt16_ks1", 20)  # one group
    assert L.quant_kernel_choice("nvfp4", 4, 131072, 4096, 1, **tc) == ("qmma_nvfp4_nt4_ks1", 1024)
    assert L.quant_kernel_choice("nvfp4", 1, 1280, 2560, 10, **dict(tc, cc=75))[0].startswith("qgemv2_")
    assert L.quant_kernel_choice("nvfp4", 1, 1280, 2592, 10, **tc)[0].startswith("qgemv2_")  # K % 128 != 0
    # FP8: 64-k groups; scale blocks of 16 rows x 64 columns (multiples) or qgemv2
    assert L.quant_kernel_choice("fp8", 1, 1280, 2560, 10, **tc) == ("qmma_fp8_nt1_ks4", 40)
    assert L.quant_kernel_choice("fp8", 1, 1280, 2560, 10, blocks=(8, 128), **tc)[0].startswith("qgemv2_")
    assert L.quant_kernel_choice("fp8", 1, 1280, 2560, 10, blocks=(128, 32), **tc)[0].startswith("qgemv2_")
    assert L.quant_kernel_choice("fp8", 1, 1280, 2592, 10, **tc)[0].startswith("qgemv2_")
    # the default (qmma=None): FP8 at one row over several row tiles (routed experts, batch 1) stays on qgemv2
    dflt = dict(sms=132, vec=True, cc=90)
    assert L.quant_kernel_choice("fp8", 1, 1280, 2560, 10, **dflt)[0].startswith("qgemv2_fp8_nt1")
    assert L.quant_kernel_choice("fp8", 1, 1280, 2560, 1, **dflt)[0].startswith("qmma_fp8_nt1")
    assert L.quant_kernel_choice("fp8", 4, 1280, 2560, 10, **dflt)[0].startswith("qmma_fp8_nt4")
    assert L.quant_kernel_choice("nvfp4", 1, 1280, 2560, 10, **dflt)[0].startswith("qmma_nvfp4_nt1")


@pytest.mark.parametrize("name", ["tiny-fp8", "tiny-nvfp4"])
def test_stacked_quantised_projections_are_views_and_change_nothing(name):
    """The CUDA engine stacks projections that read one input (engine/model.py:_fuse_weights); with stored
    formats the stack is a QuantWeight whose members are row views. Here the same stacking runs on the CPU
    path (where it is off by default): logits agree to float32 summation noise and no weight is copied."""
    ck = Checkpoint.open(fixture_dir(name))
    g, _ = load_golden(name)
    ids = g["qsa/ids"]
    eng = Engine(ck, precision="float32", device="cpu")
    before = eng.prefill(eng.add_sequence(), ids)
    eng.model._fuse_weights()
    fused = eng.model.fused
    if name == "tiny-fp8":
        assert "layers.2.self_attn.fused_in_proj" in fused and "layers.0.linear_attn.fused_in_proj_qkv_z" in fused
        st = eng.model.w["layers.2.self_attn.fused_in_proj"]
        q = eng.model.w["layers.2.self_attn.q_proj.weight"]
        assert isinstance(st, QuantWeight) and np.shares_memory(q.q, st.q) and np.shares_memory(q.scale, st.scale)
        assert np.array_equal(dequantize(q), ck.get("layers.2.self_attn.q_proj.weight"))
    after = eng.prefill(eng.add_sequence(), ids)
    assert np.abs(after - before).max() / np.abs(before).max() < 1e-5


def test_rows_refuses_a_cut_scale_block():
    w = QuantWeight("fp8", (256, 128), np.zeros((256, 128), np.uint8), np.ones((2, 1), np.float32))
    assert w.rows(128, 256).shape == (128, 128)
    with pytest.raises(ValueError, match="cut 128-row scale blocks"):
        w.rows(64, 256)


def test_every_kernel_the_dispatch_can_pick_exists_in_the_source():
    """quant_kernel_choice's names against the entries quant_linear.cu generates (a renamed or missing
    variant would otherwise surface only on a GPU)."""
    import re

    from engine.backend import CUDA_DIR
    from engine.kernels import dense_common
    src = (CUDA_DIR / "quant_linear.cu").read_text()
    fam = src[src.index("#define QGEMV_FAMILY"):src.index("QGEMV_FAMILY(fp8, FP8W)")]
    entries = {f"qgemv_{fmt}_nt{nt}_r{r}_ks{ks}_{suf}" for fmt in ("fp8", "nvfp4")
               for nt, r, ks, suf in re.findall(r"QGEMV_ENTRY\(FMT, LD, (\d+), (\d+), (\d+), \w+, (\w)\)", fam)}
    entries |= set(re.findall(r'extern "C" __global__ void __launch_bounds__\(256\) (qgemm_\w+)\(', src))
    fam2 = src[src.index("// qgemv2 instances begin"):src.index("// qgemv2 instances end")]
    # NVRTC compiles each row tile's instances in its own module (-DQGEMV2_NT=n, dense_common.kernel_module_options):
    # every line of QGEMV2_FAMILY_NT<n> must be an n-row instance, and the options must name that module
    blocks = re.findall(r"#define QGEMV2_FAMILY_NT(\d+)\(FMT, LD\)((?:.*\\\n)*.*)", fam2)
    assert sorted(int(n) for n, _ in blocks) == [1, 4, 16]
    for n, body in blocks:
        assert {int(x) for x in re.findall(r"QGEMV2_KS\(FMT, LD, (\d+),", body)} == {int(n)}, n
        assert f"#if QL_NT({n})\nQGEMV2_FAMILY_NT{n}(fp8, FP8S)\nQGEMV2_FAMILY_NT{n}(nvfp4, NVFP4S)" in src
    assert dense_common.kernel_module_options("quant_linear.cu", "qgemv2_nvfp4_nt16_g2_r2_ks8_u3") == ("-DQGEMV2_NT=16",)
    assert dense_common.kernel_module_options("quant_linear.cu", "qgemv_nvfp4_nt16_r1_ks1_s") == ()
    assert dense_common.kernel_module_options("dense_linear.cu", "qgemv2_fp8_nt1_g4_r1_ks1_u5") == ()
    configs = {}
    for nt, g, rl, u in re.findall(r"QGEMV2_KS\(FMT, LD, (\d+), (\d+), (\d+), (\d+)\)", fam2):
        configs.setdefault(int(nt), set()).add((int(g), int(rl), int(u)))
        entries |= {f"qgemv2_{fmt}_nt{nt}_g{g}_r{rl}_ks{ks}_u{u}" for fmt in ("fp8", "nvfp4") for ks in (1, 2, 4, 8)}
    assert all(L.QGEMV2_CONFIG[fmt, nt] in configs[nt] for fmt in ("fp8", "nvfp4") for nt in (1, 4, 16)), \
        (L.QGEMV2_CONFIG, configs)
    # the tensor-core NVFP4 entries, in the same per-tile modules
    qmma = re.findall(r"QMMA_ENTRY\((\w+), \w+, NT, (\d+)\)", src)
    assert sorted(qmma) == sorted((f, k) for f in ("fp8", "nvfp4") for k in "1248")
    for n in (1, 4, 16):
        assert f"QGEMV2_FAMILY_NT{n}(nvfp4, NVFP4S)\nQMMA_FAMILY({n})\n#endif" in src
        entries |= {f"qmma_{f}_nt{n}_ks{k}" for f, k in qmma}
    assert dense_common.kernel_module_options("quant_linear.cu", "qmma_nvfp4_nt4_ks2") == ("-DQGEMV2_NT=4",)
    picked = set()
    for fmt in ("fp8", "nvfp4"):
        for rpt in (1, 4, 16, 64):
            for N in (8, 320, 2560, 131072):
                for K in (64, 640, 2560, 10240):
                    for grid_y in (1, 12, 500):
                        for vec in (True, False):
                            cfgs = sorted(configs.get(rpt, {None})) if vec else [None]
                            for cfg in cfgs:
                                for cc in (75, 90, 121):
                                    for blocks in ((128, 128), (8, 128)):
                                        picked.add(L.quant_kernel_choice(fmt, rpt, N, K, grid_y, vec=vec, sms=132,
                                                                         config=cfg, cc=cc, blocks=blocks)[0])
    assert picked <= entries, sorted(picked - entries)
    assert not any(n.startswith("qgemv_") and n.endswith("_v") for n in picked)  # one kernel per op
    assert len(picked) >= 50 and {n[:9] for n in picked if n.startswith("qmma_")} == {"qmma_fp8_", "qmma_nvfp"}


def test_qgemv2_fast_decode_arithmetic_is_exact():
    """The streaming GEMV's decode (quant_linear.cu, NVFP4S / FP8S), emulated step for step in NumPy: every
    E2M1 byte (two nibbles) under every finite E4M3 scale code and several global scales gives the reader's
    value bit for bit: nibble s.ee.m -> E4M3 byte s.0ee.m00 (= E2M1 * 2^-6), -> f16, times scale * 64 in f16
    (exact), -> f32, times the global scale; FP8 via f16 equals E4M3 -> f32 directly. The GPU test
    (test_quant_linear.py::test_qgemv2_decodes_exactly_every_config) checks the kernels themselves; this
    one pins the arithmetic argument on the CPU. Negative control: dropping the 2^6 correction is caught."""
    import ml_dtypes

    from reference.checkpoint import E2M1_VALUES

    def e4(b):
        return np.asarray(b, np.uint8).view(ml_dtypes.float8_e4m3fn)

    u = np.arange(256, dtype=np.uint32) * 0x01010101  # each byte value in all four byte positions of a word
    A = ((u << 2) & 0x1C1C1C1C) | ((u << 4) & 0x80808080)  # low nibbles (even elements)
    B = ((u >> 2) & 0x1C1C1C1C) | (u & 0x80808080)  # high nibbles (odd elements)
    for shift in (0, 8, 16, 24):
        lo = e4(((A >> shift) & 0xFF).astype(np.uint8)).astype(np.float16)
        hi = e4(((B >> shift) & 0xFF).astype(np.uint8)).astype(np.float16)
        codes = np.arange(256)
        for scode in range(256):
            if scode & 0x7F == 0x7F:
                continue  # NaN scale
            s32 = e4(np.uint8(scode)).astype(np.float32)
            sc16 = e4(np.uint8(scode)).astype(np.float16) * np.float16(64.0)
            for g in (np.float32(0.00123), np.float32(7.77), np.float32(3e-30)):
                for got16, nib in ((lo, codes & 15), (hi, codes >> 4)):
                    got = (got16 * sc16).astype(np.float32) * g
                    want = (E2M1_VALUES[nib] * s32) * g
                    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (scode, g)
                    if shift == 0 and scode == 0x38 and g == np.float32(7.77):  # negative control
                        bad = (got16 * e4(np.uint8(scode)).astype(np.float16)).astype(np.float32) * g
                        assert not np.array_equal(bad, want)
    c = np.arange(256, dtype=np.uint8)
    assert np.array_equal(e4(c).astype(np.float16).astype(np.float32), e4(c).astype(np.float32), equal_nan=True)


def _bf16_value(bits):
    """BF16 bit patterns (uint32 low 16 bits) -> float64 values (subnormals included)."""
    return (np.asarray(bits, np.uint32) << 16).astype(np.uint32).view(np.float32).astype(np.float64)


def _qmma_pair_twin(v, i):
    """gemv_qmma.cuh:e2m1_pair_bf16<i>, operation by operation: (low, high) BF16 bits of nibbles i and i + 4."""
    v = np.asarray(v, np.uint32)
    sh = {0: v << 6, 1: v << 2, 2: v >> 2, 3: v >> 6}[i]
    sg = {0: v << 12, 1: v << 8, 2: v << 4, 3: v}[i]
    p = (sh & 0x01C001C0) | (sg & 0x80008000)
    return p & 0xFFFF, p >> 16


def test_qmma_decode_arithmetic_is_exact():
    """The tensor-core NVFP4 GEMV's A operand (gemv_qmma.cuh), emulated in NumPy: every code nibble in every
    position of a word, as BF16 code x 2^-126 (the subnormal 0.5 included), times every finite E4M3 scale x 2^119
    rounded to BF16, gives code x scale x 2^-7 exactly, as a normal BF16 value (no rounding in the BF16 product).
    The GPU test (test_quant_linear.py::test_qmma_decodes_exactly_every_config) checks the kernel itself.
    Negative control: a sign moved to the wrong bit is caught."""
    import ml_dtypes
    words = np.arange(1 << 16, dtype=np.uint32)
    words = words | (words << 16)  # every nibble value in every nibble position, both halves
    for i in range(4):
        lo, hi = _qmma_pair_twin(words, i)
        for half, nib in ((lo, (words >> (4 * i)) & 15), (hi, (words >> (4 * i + 16)) & 15)):
            assert np.array_equal(_bf16_value(half), E2M1_VALUES[nib].astype(np.float64) * 2.0 ** -126)
    codes = E2M1_VALUES.astype(np.float64)[:, None] * 2.0 ** -126
    scodes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    scale = scodes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    sbf = (scale * 2.0 ** 119).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
    assert np.array_equal(sbf, scale * 2.0 ** 119)  # the BF16 scale is exact
    prod = codes * sbf[None, :]
    want = E2M1_VALUES.astype(np.float64)[:, None] * scale[None, :] * 2.0 ** -7
    assert np.array_equal(prod, want)
    nz = prod[prod != 0]
    assert np.all(np.abs(nz) >= 2.0 ** -126)  # normal
    assert np.array_equal(nz.astype(ml_dtypes.bfloat16).astype(np.float64), nz)  # exact in BF16
    bad = (((words << 6) & 0x01C001C0) | ((words << 11) & 0x80008000)) & 0xFFFF  # negative control
    assert not np.array_equal(_bf16_value(bad), E2M1_VALUES[words & 15].astype(np.float64) * 2.0 ** -126)


def test_qmma_fragment_layout_is_a_permutation_of_k():
    """gemv_qmma.cuh's fragment layout, emulated for one warp tile: the A registers every lane builds (rows g and
    g + 8, MMA step j of group kg: word j / 2 of its 16 bytes, nibble pairs (p, p + 4) and (p + 1, p + 5)), the
    B fragments the block stages (sB[group][j][column][t]: (x[k0], x[k0 + 4]), (x[k0 + 1], x[k0 + 5])) and the
    m16n8k16 fragment rules (a0 / a1 rows g / g + 8 at slots 2t, 2t + 1, a2 / a3 at 2t + 8, 2t + 9; b0 / b1 the
    same slots of column g) multiply every weight with its own activation: the emulated GEMV equals W x for 1, 2
    and 5 tokens (columns 3 tok + part). Negative control: staging B with the codes' natural order is caught."""
    rng = np.random.default_rng(5)
    K = 256
    W = rng.standard_normal((16, K))
    for T in (1, 2, 5):
        X = rng.standard_normal((T, K))
        NC = 3 * T
        parts = np.stack([X, np.zeros_like(X), np.zeros_like(X)], 1).reshape(NC, K)  # column c: part c % 3

        def emulate(natural=False):
            Y = np.zeros((16, NC))
            for kg in range(K // 128):
                for j in range(8):
                    p, q = 2 * (j & 1), j >> 1
                    A = np.zeros((16, 16))
                    B = np.zeros((16, NC))
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        base = kg * 128 + 32 * t + 8 * q  # the lane's word q: codes base .. base + 7
                        for r in (g, g + 8):  # a0 / a2 (row g), a1 / a3 (row g + 8)
                            A[r, 2 * t], A[r, 2 * t + 1] = W[r, base + p], W[r, base + p + 4]
                            A[r, 2 * t + 8], A[r, 2 * t + 9] = W[r, base + p + 1], W[r, base + p + 5]
                        k0 = kg * 128 + 32 * t + 8 * (j >> 1) + 2 * (j & 1)
                        d = (1, 2, 3) if natural else (4, 1, 5)
                        for c in range(NC):  # b0 / b1 of the lanes of column c (staged for every t)
                            B[2 * t, c], B[2 * t + 1, c] = parts[c, k0], parts[c, k0 + d[0]]
                            B[2 * t + 8, c], B[2 * t + 9, c] = parts[c, k0 + d[1]], parts[c, k0 + d[2]]
                    Y += A @ B
            return Y[:, 0::3]  # hi columns (mid, lo are zero here)

        np.testing.assert_allclose(emulate(), W @ X.T, rtol=1e-12, atol=1e-12)
        assert not np.allclose(emulate(natural=True), W @ X.T)
