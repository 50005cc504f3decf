"""prime_ops' DeepEP buffers against DeepEP 2.1.0's ``Buffer`` configs, size hints and arguments.

DeepEP is not on PyPI and its Python package imports its CUDA extension at once (``deep_ep/
__init__.py`` runs ``check_nccl_so()`` and ``init_jit()``), so nothing of it runs here. What
prime_ops' construction reaches is recorded below as data, read from deepseek-ai/DeepEP @
dd758caf4518 (2026-07-14, ``__version__ = '2.1.0'``):

- ``deep_ep/buffers/legacy.py``: ``Buffer.num_sms = 20``; ``Buffer.__init__``'s parameters;
  ``get_dispatch_config`` / ``get_combine_config``: a ``Config(num_sms, ...)`` per group size,
  ``assert num_ranks in config_map, 'Unsupported number of EP ranks: ...'`` for any other
  (1.x's ``deep_ep/buffer.py`` @ 92fe2de has the same twelve sizes);
- ``csrc/legacy/config.hpp``: ``Config``'s constructor asserts and its two size hints, with their
  asserts (``LEGACY_NUM_MAX_NVL_PEERS`` = 8, ``csrc/kernels/legacy/compiled.cuh``; ``SourceMeta``
  is two ints, ``csrc/kernels/legacy/internode.cu``; ``topk_idx_t`` int64 by default).

:class:`StandInDeepEP` enforces those and records the ``Buffer`` call; the tests check that
prime_ops accepts exactly the sizes DeepEP has configs for, sizes the buffer by DeepEP's hints
and passes DeepEP's keyword arguments through to it.
"""

from __future__ import annotations

import inspect
import sys
import types

import pytest

from prime_ops import deepep, deepep_prime_rl

DEEPEP_VERSION = "2.1.0"
DEEPEP_COMMIT = "dd758caf451848bd150e1046af3d0a73e5fff38d"
LEGACY_PY = "deep_ep/buffers/legacy.py"
CONFIG_HPP = "csrc/legacy/config.hpp"

NUM_SMS = 20
NVL_PEERS = 8
SOURCE_META_BYTES = 8
TOPK_IDX_BYTES = 8
MAX_TOPK = MAX_SCALES = 128

# group size -> Config arguments after num_sms: (nvl send, nvl recv, rdma send, rdma recv) tokens
DISPATCH_CONFIGS = {
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (36, 288, 20, 128),
    24: (32, 288, 8, 128),
    32: (32, 288, 8, 128),
    48: (32, 288, 8, 128),
    64: (32, 288, 8, 128),
    96: (20, 480, 12, 128),
    128: (20, 560, 12, 128),
    144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
COMBINE_CONFIGS = {
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (4, 288, 12, 128),
    24: (1, 288, 8, 128),
    32: (1, 288, 8, 128),
    48: (1, 288, 8, 128),
    64: (1, 288, 8, 128),
    96: (1, 480, 8, 128),
    128: (1, 560, 8, 128),
    144: (2, 720, 8, 128),
    160: (2, 720, 8, 128),
}
BUFFER_PARAMETERS = {
    "group": inspect.Parameter.empty,
    "num_nvl_bytes": 0,
    "num_rdma_bytes": 0,
    "low_latency_mode": False,
    "num_qps_per_rank": 24,
    "allow_nvlink_for_low_latency_mode": True,
    "allow_mnnvl": False,
    "explicitly_destroy": False,
    "enable_shrink": False,
    "comm": None,
}


def _align(value: int, to: int) -> int:
    return -(-value // to) * to


class _Config:
    """``Config``'s constructor asserts and size hints (``csrc/legacy/config.hpp``)."""

    def __init__(self, num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv):
        assert num_sms >= 0
        assert nvl_send > 0 and nvl_recv > 0 and nvl_send < nvl_recv
        assert rdma_send > 0 and rdma_recv > 0
        rdma_recv = _align(rdma_recv, rdma_send)
        assert rdma_send < rdma_recv and rdma_send <= rdma_recv // 2
        self.num_sms, self.nvl_recv, self.rdma_recv = num_sms, nvl_recv, rdma_recv

    def _per_token(self, hidden_bytes: int) -> int:
        """Bytes one buffered token takes: its row, source meta, top-k indices and weights,
        scales."""
        return hidden_bytes + SOURCE_META_BYTES + MAX_TOPK * (TOPK_IDX_BYTES + 4) + MAX_SCALES * 4

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        assert num_ranks < NVL_PEERS or num_ranks % NVL_PEERS == 0
        assert num_ranks <= NVL_PEERS or self.num_sms % 2 == 0
        rdma_ranks, nvl_ranks = max(num_ranks // NVL_PEERS, 1), min(num_ranks, NVL_PEERS)
        channels = self.num_sms // 2
        size = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
        size += channels * nvl_ranks * self.nvl_recv * self._per_token(hidden_bytes)
        return _align(size, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NVL_PEERS:
            return 0
        assert num_ranks % NVL_PEERS == 0 and self.num_sms % 2 == 0
        rdma_ranks, channels = num_ranks // NVL_PEERS, self.num_sms // 2
        size = channels * rdma_ranks * (NVL_PEERS * 2 + 2) * 2 * 4
        size += channels * rdma_ranks * self.rdma_recv * (self._per_token(hidden_bytes) + 16) * 2
        return _align(size, 128)


def _buffer_signature() -> inspect.Signature:
    self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    rest = [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)
        for name, default in BUFFER_PARAMETERS.items()
    ]
    return inspect.Signature([self, *rest])


class StandInBuffer:
    """``deep_ep.Buffer`` up to its runtime: DeepEP's parameters (a call DeepEP would refuse
    raises TypeError here too), its config tables and their asserts; records each construction."""

    num_sms = NUM_SMS
    made: list = []

    def __init__(self, *args, **kwargs):
        bound = _buffer_signature().bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments["self"]
        group = arguments["group"]
        assert group is not None or arguments["comm"] is not None
        self.made.append(arguments)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> _Config:
        assert num_ranks in DISPATCH_CONFIGS, f"Unsupported number of EP ranks: {num_ranks}"
        return _Config(StandInBuffer.num_sms, *DISPATCH_CONFIGS[num_ranks])

    @staticmethod
    def get_combine_config(num_ranks: int) -> _Config:
        assert num_ranks in COMBINE_CONFIGS, f"Unsupported number of EP ranks: {num_ranks}"
        return _Config(StandInBuffer.num_sms, *COMBINE_CONFIGS[num_ranks])


class _Group:
    def __init__(self, ranks: int):
        self.ranks = ranks

    def size(self) -> int:
        return self.ranks

    def rank(self) -> int:
        return 0


@pytest.fixture
def made(monkeypatch):
    module = types.ModuleType("deep_ep")
    module.Buffer = StandInBuffer
    module.__version__ = DEEPEP_VERSION
    monkeypatch.setitem(sys.modules, "deep_ep", module)
    monkeypatch.setattr(StandInBuffer, "made", [])
    monkeypatch.setattr(deepep_prime_rl, "_current", None)
    return StandInBuffer.made


def _hints(ranks: int, hidden_bytes: int) -> tuple[int, int]:
    configs = (StandInBuffer.get_dispatch_config(ranks), StandInBuffer.get_combine_config(ranks))
    return (
        max(c.get_nvl_buffer_size_hint(hidden_bytes, ranks) for c in configs),
        max(c.get_rdma_buffer_size_hint(hidden_bytes, ranks) for c in configs),
    )


def test_prime_ops_accepts_the_sizes_deep_ep_has_configs_for():
    assert deepep.EP_SIZES == tuple(sorted(DISPATCH_CONFIGS)) == tuple(sorted(COMBINE_CONFIGS))
    for ranks in DISPATCH_CONFIGS:  # DeepEP's own asserts hold for its table
        _hints(ranks, 7168 * 2)


@pytest.mark.parametrize("ranks", deepep.EP_SIZES)
def test_buffers_are_sized_by_deep_eps_hints(made, ranks):
    hidden = 7168  # DeepSeek-V3
    nvl, rdma = _hints(ranks, hidden * 2)
    assert (rdma == 0) == (ranks <= NVL_PEERS)
    deepep.Dispatcher(_Group(ranks), num_experts=ranks * 2, hidden=hidden)
    group = _Group(ranks)
    deepep_prime_rl.create_buffer(group, hidden * 2, num_qps_per_rank=StandInBuffer.num_sms)
    dispatcher_call, prime_rl_call = made
    assert (dispatcher_call["num_nvl_bytes"], dispatcher_call["num_rdma_bytes"]) == (nvl, rdma)
    assert prime_rl_call == {
        **{name: default for name, default in BUFFER_PARAMETERS.items()},
        "group": group,
        "num_nvl_bytes": nvl,
        "num_rdma_bytes": rdma,
        "num_qps_per_rank": NUM_SMS,  # prime-rl's argument, passed through
    }


@pytest.mark.parametrize("ranks", [1, 3, 6, 12, 40, 56, 72, 80, 176, 192])
def test_sizes_without_a_config_are_refused_before_deep_ep_sees_them(made, ranks):
    with pytest.raises(AssertionError, match=f"Unsupported number of EP ranks: {ranks}"):
        StandInBuffer.get_dispatch_config(ranks)  # where main's call ended for 40, 56, 72, ...
    for make, kwargs in (
        (deepep.Dispatcher, {"num_experts": ranks * 2, "hidden": 1024}),
        (deepep_prime_rl.create_buffer, {"hidden_bytes": 2048}),
    ):
        with pytest.raises(ValueError, match=f"the group has {ranks} rank.*160 ranks only"):
            make(_Group(ranks), **kwargs)
    assert made == []


def test_buffer_arguments_pass_through_and_unknown_ones_fail_as_in_deep_ep(made):
    deepep.Dispatcher(
        _Group(16), num_experts=32, hidden=4096, allow_mnnvl=True, explicitly_destroy=True
    )
    assert made[-1]["allow_mnnvl"] is True and made[-1]["explicitly_destroy"] is True
    with pytest.raises(TypeError, match="num_qp_per_rank"):
        deepep_prime_rl.create_buffer(_Group(8), 8192, num_qp_per_rank=24)  # a typo
