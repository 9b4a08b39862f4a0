"""Expert parallelism: the routed experts of every MoE layer split over several devices.

Design (one process drives every device, as :class:`engine.Engine` does for one):

* Device ``devices[0]`` (rank 0) runs the trunk: embeddings, PLE, hyper-connections, GDN, QSA, the
  shared expert, the router, the final mixer and ``lm_head``, and owns every state slab and KV page
  (so snapshots, verify and rollback are those of the single-device engine, unchanged).
* Rank ``r`` holds the routed experts ``[start_r, end_r)`` of every layer (contiguous blocks, sizes
  differing by at most one) plus one all-zero *sink* expert at local index ``end_r - start_r``.
* Per MoE layer: the mixed input ``x [T, H]`` and the router's ``(ids, weights) [T, k]`` are broadcast
  from rank 0; each rank maps the slots it owns to local expert ids and sends every other slot to its
  sink with weight 0 (no host round trip, no data-dependent shapes: the step stays graph-capturable
  per device); each rank runs the grouped expert GEMMs on its slots; the partial outputs ``[T, H]``
  are sum-reduced onto rank 0, where the shared expert is added.

The routed sum of a token is therefore ``sum_r sum_{slots on r} w * y`` instead of the single-device
slot-order sum: equal up to float32 reassociation (a few ulp), which is what the tests allow.

Communicators: :class:`LocalComm` is a stand-in whose "ranks" are arrays on one device (NumPy on the
CPU, or several logical ranks on one GPU), so the sharding logic runs and is tested without several
GPUs; :class:`NcclComm` uses NCCL through CuPy's bindings (``cupy.cuda.nccl``), one communicator per
device initialised with ``NcclCommunicator.initAll``. NVLink SHARP/multicast stays off
(``NCCL_NVLS_ENABLE=0`` is set before the first communicator is made unless the caller set it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from engine.kernels.quant import QuantWeight

from reference.errors import InputError

__all__ = ["LocalComm", "NcclComm", "ExpertParallel", "expert_ranges", "make_comm"]


def expert_ranges(num_experts: int, n_ranks: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` expert blocks per rank, sizes differing by at most one.

    Raises:
        InputError: fewer experts than ranks, or ``n_ranks < 1``.
    """
    if n_ranks < 1:
        raise InputError(f"devices: expected at least one device, found {n_ranks}")
    if num_experts < n_ranks:
        raise InputError(f"devices: expected at most num_experts={num_experts} devices for expert parallelism, "
                         f"found {n_ranks}")
    base, extra = divmod(num_experts, n_ranks)
    out, s = [], 0
    for r in range(n_ranks):
        e = s + base + (1 if r < extra else 0)
        out.append((s, e))
        s = e
    return out


class LocalComm:
    """Stand-in communicator: ``size`` logical ranks whose arrays all live on one device (``xp``).

    ``broadcast`` copies rank 0's array to every rank; ``reduce_sum`` adds the ranks' arrays in rank
    order onto rank 0 (the order NCCL's ring reduce is not bound to; results may differ from it in
    the last ulp, never more).
    """

    def __init__(self, size: int, xp=np):
        if size < 1:
            raise InputError(f"devices: expected at least one rank, found {size}")
        self.size = int(size)
        self.xp = xp
        self.devices = [None] * self.size
        self.calls = {"broadcast": 0, "reduce_sum": 0}

    def to_rank(self, r: int, host_array):
        """``host_array`` placed on rank ``r``'s device."""
        return self.xp.asarray(host_array)

    def broadcast(self, a) -> list:
        """``[a on rank 0, copy on rank 1, ...]``."""
        self.calls["broadcast"] += 1
        return [a] + [a.copy() for _ in range(self.size - 1)]

    def reduce_sum(self, parts: list):
        """``sum(parts)`` on rank 0 (``parts[r]`` on rank ``r``)."""
        self.calls["reduce_sum"] += 1
        if len(parts) != self.size:
            raise InputError(f"reduce_sum: expected {self.size} parts, found {len(parts)}")
        out = parts[0].copy()
        for p in parts[1:]:
            out += p
        return out

    def run_on(self, r: int):
        """Context manager selecting rank ``r``'s device (nothing to select here)."""
        import contextlib
        return contextlib.nullcontext()


class NcclComm:
    """NCCL over several GPUs of one host (single process, one communicator per device).

    Args:
        devices: CUDA device ordinals, rank ``r`` = ``devices[r]``.
    Raises:
        InputError: repeated devices; cupy without NCCL.
    """

    def __init__(self, devices: list[int]):
        import cupy as cp
        if len(set(devices)) != len(devices):
            raise InputError(f"devices: expected distinct CUDA devices, found {devices}")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (device notes)
        try:
            from cupy.cuda import nccl
        except ImportError as e:
            raise InputError(f"devices {devices}: expected cupy with NCCL (cupy.cuda.nccl), found {e}") from None
        self.cp, self.nccl = cp, nccl
        self.devices = list(devices)
        self.size = len(devices)
        self.xp = cp
        self.comms = nccl.NcclCommunicator.initAll(self.devices)
        self.calls = {"broadcast": 0, "reduce_sum": 0}

    def run_on(self, r: int):
        """Context manager: rank ``r``'s device is current."""
        return self.cp.cuda.Device(self.devices[r])

    def to_rank(self, r: int, host_array):
        """``host_array`` copied to rank ``r``'s device."""
        with self.run_on(r):
            return self.cp.asarray(host_array)

    @staticmethod
    def _nccl_dtype(nccl, a):
        import numpy as _np
        m = {_np.dtype(_np.float32): nccl.NCCL_FLOAT32, _np.dtype(_np.int32): nccl.NCCL_INT32,
             _np.dtype(_np.int64): nccl.NCCL_INT64, _np.dtype(_np.float64): nccl.NCCL_FLOAT64}
        try:
            return m[_np.dtype(a.dtype)]
        except KeyError:
            raise InputError(f"NCCL: unsupported dtype {a.dtype}") from None

    def broadcast(self, a) -> list:
        """``a`` (on rank 0) broadcast: one buffer per rank, each on its device."""
        cp, nccl = self.cp, self.nccl
        self.calls["broadcast"] += 1
        bufs = [a]
        for r in range(1, self.size):
            with self.run_on(r):
                bufs.append(cp.empty_like(a))
        dt = self._nccl_dtype(nccl, a)
        nccl.groupStart()
        for r, c in enumerate(self.comms):
            with self.run_on(r):
                c.bcast(bufs[r].data.ptr, bufs[r].size, dt, 0, cp.cuda.get_current_stream().ptr)
        nccl.groupEnd()
        return bufs

    def reduce_sum(self, parts: list):
        """Sum of ``parts`` (``parts[r]`` on device ``r``) onto rank 0."""
        cp, nccl = self.cp, self.nccl
        self.calls["reduce_sum"] += 1
        with self.run_on(0):
            out = cp.empty_like(parts[0])
        dt = self._nccl_dtype(nccl, parts[0])
        nccl.groupStart()
        for r, c in enumerate(self.comms):
            with self.run_on(r):
                recv = out.data.ptr if r == 0 else parts[r].data.ptr  # non-root recv buffers are ignored
                c.reduce(parts[r].data.ptr, recv, parts[r].size, dt, nccl.NCCL_SUM, 0,
                         cp.cuda.get_current_stream().ptr)
        nccl.groupEnd()
        return out


def make_comm(devices, device: str, xp):
    """The communicator for ``Engine(devices=...)``: NCCL on CUDA with distinct devices, else the stand-in.

    Args:
        devices: an int (that many ranks) or a list of CUDA ordinals.
        device: the engine's ``device`` ('cpu' or 'cuda').
    Raises:
        InputError: a malformed ``devices`` value.
    """
    if isinstance(devices, bool) or not isinstance(devices, (int, list, tuple)):
        raise InputError(f"devices: expected a number of ranks or a list of CUDA device ids, found {devices!r}")
    if isinstance(devices, int):
        n = devices
        ids = list(range(n))
    else:
        ids = list(devices)
        if not ids:
            raise InputError("devices: expected at least one device id, found an empty list")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in ids):
            raise InputError(f"devices: expected non-negative integer device ids, found {devices!r}")
        n = len(ids)
    if n < 1:
        raise InputError(f"devices: expected at least one device, found {devices!r}")
    if device == "cuda" and len(set(ids)) == n and n > 1 and os.environ.get("QWEN4EXP_EP_LOCAL") != "1":
        import cupy as cp
        have = cp.cuda.runtime.getDeviceCount()
        if max(ids) >= have:
            raise InputError(f"devices {ids}: expected CUDA device ids below {have} (this host's GPUs), found "
                             f"{max(ids)}")
        return NcclComm(ids)
    return LocalComm(n, xp)


@dataclass
class _Shard:
    start: int
    end: int
    arrays: dict  # suffix ('gate_up', 'down', ...) -> the rank's local stack, sink expert last


class ExpertParallel:
    """The routed experts of every layer sharded over ``comm``'s ranks.

    Args:
        model: the :class:`engine.model.EngineModel` whose full expert stacks (``layers.{i}.mlp.experts.*``
            in ``model.w``, leading axis = expert) are split; they are removed from rank 0's weights.
        comm: a :class:`LocalComm` or :class:`NcclComm`.
    """

    def __init__(self, model, comm):
        c = model.config
        self.comm = comm
        self.ranges = expert_ranges(c.num_experts, comm.size)
        self.shards: dict[int, list[_Shard]] = {}
        xp = model.xp
        for i in range(c.num_hidden_layers):
            pre = f"layers.{i}.mlp.experts."
            keys = [k for k in list(model.w) if k.startswith(pre)]
            full = {k[len(pre):]: model.w.pop(k) for k in keys}
            shards = []
            for r, (s, e) in enumerate(self.ranges):
                arrs = {}
                for suf, a in full.items():
                    if isinstance(a, QuantWeight):  # stored FP8 / NVFP4: the rank's experts + a zero sink
                        arrs[suf] = a.expert_block(s, e, sink=True).map(lambda x, r=r: comm.to_rank(r, x))
                        continue
                    host = a if xp is np else xp.asnumpy(a)
                    local = np.concatenate([np.asarray(host[s:e]), np.zeros_like(host[:1])], axis=0)
                    arrs[suf] = comm.to_rank(r, local)
                shards.append(_Shard(s, e, arrs))
            self.shards[i] = shards

    def weight_bytes(self) -> list[int]:
        """Expert bytes held per rank (sink included)."""
        return [sum(int(a.nbytes) for sh in (self.shards[i][r] for i in self.shards) for a in sh.arrays.values())
                for r in range(self.comm.size)]

    def routed(self, i: int, x, ids, weights, shared=None, shared_gate=None):
        """The routed-expert sum of layer ``i`` (+ the gated shared expert) on rank 0.

        Args:
            x: ``[T, H]`` float32 on rank 0; ids: int ``[T, k]`` global expert ids; weights ``[T, k]``.
            shared / shared_gate: rank 0's shared-expert output ``[T, H]`` and pre-sigmoid gate ``[T, 1]``.
        Returns:
            ``[T, H]`` float32 on rank 0 (what :func:`engine.kernels.moe.moe_experts` returns on one device).
        """
        from engine.kernels import moe as K_moe
        comm = self.comm
        xs = comm.broadcast(x)
        ids32 = ids.astype(np.int32) if ids.dtype != np.int32 else ids
        idb = comm.broadcast(ids32)
        wb = comm.broadcast(weights.astype(np.float32) if weights.dtype != np.float32 else weights)
        parts = []
        for r, sh in enumerate(self.shards[i]):
            with comm.run_on(r):
                xpr = comm.xp
                gid, w = idb[r], wb[r]
                own = (gid >= sh.start) & (gid < sh.end)
                sink = sh.end - sh.start
                lid = xpr.where(own, gid - sh.start, sink).astype(np.int32)
                lw = xpr.where(own, w, xpr.zeros_like(w))
                if r == 0 and shared is not None:
                    parts.append(K_moe.moe_experts(xs[r], lid, lw, sh.arrays["gate_up"], sh.arrays["down"],
                                                   shared=shared, shared_gate=shared_gate))
                else:
                    parts.append(K_moe.moe_experts(xs[r], lid, lw, sh.arrays["gate_up"], sh.arrays["down"]))
        return comm.reduce_sum(parts)
