"""Replay (bisect) for tap-diff: re-run the reference block producing a tap on B's own recorded input, so a
divergence is told apart as a bug of that block or an error already in its input."""
from __future__ import annotations

import numpy as np

from reference.errors import UserError
from taps import registry
from taps.accumulate import align_positions
from taps.archive import ArchiveError, MemoryArchive, TapSource
from taps.diff import as_source, compare_tap
from taps.profiles import Profile, load_profile

__all__ = ["replay_check"]


def replay_check(model, B: TapSource, tap: str, profile: Profile | str = "fp32", A: TapSource | None = None) -> dict:
    """Re-run the block producing ``tap`` in the reference ``model`` on B's recorded input to that block
    and compare the replayed output with B's recorded ``tap``.

    Uses ``model.replay_inputs(tap) -> list[str]`` and ``model.replay(tap, inputs, token_ids) -> dict``.

    Returns: ``{"tap", "inputs", "verdict": "block" | "upstream", "message", "replayed_vs_b": metrics}``:
    ``block`` when B's output is wrong given its own input (a block bug), ``upstream`` when the
    reference, fed B's input, reproduces B's output (the input already carried the error).

    Raises:
        ArchiveError: B lacks an input tap or the token ids the replay needs.
        UserError: the model cannot replay this tap.
    """
    prof = profile if isinstance(profile, Profile) else load_profile(profile)
    B = as_source(B)
    need = list(model.replay_inputs(tap))
    token_ids = B.token_ids
    if token_ids is None:
        raise ArchiveError(f"{B.where}: replay of {tap!r}: expected the archive's token ids, found none")
    inputs = {}
    for n in need:
        if not B.has(n):
            raise ArchiveError(f"{B.where}: replay of {tap!r} needs the input tap {n!r}, which was not recorded "
                               f"(record it too, e.g. --taps '{n}')")
        pos = B.positions(n)
        common, _, rows = align_positions(pos, pos)
        if len(common) != len(token_ids) or (len(common) and (common[0] != 0 or common[-1] != len(token_ids) - 1)):
            raise ArchiveError(f"{B.where}: replay of {tap!r}: input tap {n!r} must cover positions 0..{len(token_ids)-1}, "
                               f"found {len(common)} positions")
        inputs[n] = B.read_rows(n, rows)
    out = model.replay(tap, inputs, list(token_ids))
    if tap not in out:
        raise UserError(f"replay of {tap!r}: the model returned {sorted(out)} but not the tap itself")
    positions = np.arange(len(token_ids), dtype=np.int64)
    manifest = {"order": [], "taps": {}}
    data = {}
    for n, v in out.items():
        v = np.asarray(v)
        kind = (registry.spec_for(n).kind if registry.spec_for(n) else "activation")
        manifest["order"].append(n)
        manifest["taps"][n] = {"dtype": str(v.dtype), "tail": list(v.shape[1:]), "rows": len(v), "kind": kind}
        data[n] = [(positions[:len(v)], v)]
    R = MemoryArchive(manifest, data)
    res = compare_tap(R, B, tap, prof)
    verdict = "upstream" if res.ok else "block"
    vs_a = None
    if A is not None:
        A = as_source(A)
        if A.has(tap):
            vs_a = compare_tap(R, A, tap, prof)
    if verdict == "block":
        msg = (f"block bug: fed B's own recorded input ({', '.join(need)}), the reference block does not "
               f"reproduce B's {tap} ({res.note})")
        if vs_a is not None and vs_a.ok:
            msg += "; it reproduces A's instead"
    else:
        msg = (f"look upstream: fed B's recorded input ({', '.join(need)}), the reference block reproduces B's "
               f"{tap}; the error was already in the block's input")
    return {"tap": tap, "inputs": need, "verdict": verdict, "message": msg, "replayed_vs_b": res.metrics,
            "status": res.status, "replayed_vs_a": None if vs_a is None else vs_a.metrics}
