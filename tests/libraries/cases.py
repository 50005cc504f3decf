"""Calls of prime_ops' CUDA paths shared by tests/libraries (the real libraries' host code on CPU)
and tests/gpu (the same calls with real kernels on a GPU).

Run as a script, it compiles the FA4 cases for one architecture in this process and prints one
JSON object per line; tests/libraries/test_fa4_compile.py runs it once per architecture, since FA4
and the CUTLASS DSL read their architecture settings once per process:

    python tests/libraries/cases.py fa4 sm_90      # or: quack sm_100, ... [CASE...]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import NamedTuple

FA4_VERSIONS = ("4.0.0b28", "4.0.0b30", "4.0.0b36", "4.0.0b40")
"""flash-attn-4 releases these cases were checked against (tests/libraries skips any other);
the runner's rows from b28 and b30 equal b36's (pyproject.toml's floor comment says more)."""
FA4_HD256_NO_SOFTCAP = ("4.0.0b28", "4.0.0b30", "4.0.0b36")
"""Those of them whose SM100 (256, 256) backward is a dedicated kernel without softcap (b39
dropped it: b40's backward takes softcap there)."""
QUACK_VERSIONS = ("0.6.5",)
"""quack-kernels releases checked the same way."""

FA4_ARCH_ENV = {
    "sm_90": {"FLASH_ATTENTION_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a"},
    "sm_100": {"FLASH_ATTENTION_ARCH": "sm_100", "CUTE_DSL_ARCH": "sm_100a"},
}
"""FA4's own settings for compiling without a GPU (``flash_attn/cute/interface.py``,
``_get_device_arch``): the kernel path, the compile target; H100/H200/B200 have 132 or 148 SMs,
and the SM count only sizes the persistent grid."""
FA4_NUM_SMS = "132"
QUACK_ARCH_ENV = {
    "sm_90": {"QUACK_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a"},
    "sm_100": {"QUACK_ARCH": "sm_100", "CUTE_DSL_ARCH": "sm_100a"},
}
"""QuACK's kernel selection (``quack/cute_dsl_utils.py``) and the CUTLASS DSL compile target."""


def require(distribution: str, versions: tuple[str, ...]) -> str:
    """The installed version of ``distribution``; skips the calling test module (at import)
    where it is missing or is not a version these cases were checked against."""
    import importlib.metadata

    import pytest

    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(
            f"{distribution} is not installed: tests/libraries run in .venv-libs with the real "
            "[all] extras (bash scripts/test_libraries.sh)",
            allow_module_level=True,
        )
    if version not in versions:
        pytest.skip(
            f"{distribution} {version} is installed; these cases were checked against "
            f"{', '.join(versions)} (tests/libraries/cases.py): check them and add it",
            allow_module_level=True,
        )
    return version


class Runs:
    """One runner process per architecture (``python cases.py LIBRARY ARCH [CASE...]``, with
    ``env`` added to this process's), all started at once so they compile in parallel; each one's
    JSON rows are read when first asked for."""

    def __init__(self, library: str, arches, timeout: float = 1200.0, names=(), env=None):
        import subprocess

        self._timeout = timeout
        self._rows: dict[str, list[dict]] = {}
        self._procs = {
            arch: subprocess.Popen(
                [sys.executable, __file__, library, arch, *names],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**os.environ, **(env or {})},
            )
            for arch in arches
        }

    def rows(self, arch: str) -> list[dict]:
        if arch not in self._rows:
            proc = self._procs[arch]
            out, err = proc.communicate(timeout=self._timeout)
            if proc.returncode:
                raise RuntimeError(f"{proc.args} exited {proc.returncode}:\n{err[-4000:]}")
            self._rows[arch] = [json.loads(line) for line in out.splitlines() if line]
        return self._rows[arch]

    def row(self, arch: str, **match) -> dict:
        found = [r for r in self.rows(arch) if all(r.get(k) == v for k, v in match.items())]
        assert len(found) == 1, f"{arch}: {len(found)} rows match {match}"
        return found[0]


class AttnCase(NamedTuple):
    """One varlen attention call: packed sequence lengths, heads, head dims and options."""

    lengths: tuple[int, ...]
    h: int
    hkv: int
    d: int
    dv: int
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    softmax_scale: float | None = None
    arches: tuple[str, ...] = ("sm_90", "sm_100")
    backward: bool = True


FA4_CASES = {
    # prime-rl's common call: causal, GQA 4:1, head dim 128; a length-1 sequence among long ones
    "causal_gqa_d128": AttnCase((200, 1, 77), h=8, hkv=2, d=128, dv=128, causal=True),
    # a sliding window with softcap and an explicit scale (Gemma-style), MQA
    "window_softcap_d64": AttnCase(
        (96, 40),
        h=4,
        hkv=1,
        d=64,
        dv=64,
        causal=True,
        window=(32, 0),
        softcap=5.0,
        softmax_scale=0.1,
    ),
    # the largest head dims each architecture takes: 256 on SM90; (256, 256) on SM100, whose
    # backward there is a dedicated kernel without softcap
    "hdim256": AttnCase((130, 64), h=4, hkv=2, d=256, dv=256, causal=True),
    # DeepSeek's MLA shape (q/k 192, v 128) and the smallest head dim, on SM90 only: for these
    # SM100 picks FA4's static persistent scheduler, which asks the CUDA driver for the SM count
    # (cutlass.utils.HardwareInfo) while compiling, so they cannot compile without a GPU
    "hdim192_v128": AttnCase((128, 33), h=4, hkv=4, d=192, dv=128, causal=True, arches=("sm_90",)),
    "hdim8": AttnCase((64,), h=2, hkv=2, d=8, dv=8, causal=True, arches=("sm_90",), backward=False),
}
"""Calls compiled for each architecture in ``arches``, forward and (``backward``) backward."""

FA4_REFUSED = {
    # forward refusals (backward=False) and a backward refusal
    "hdim264_sm90": AttnCase((64,), h=2, hkv=2, d=264, dv=264, arches=("sm_90",), backward=False),
    "hdim136_sm100": AttnCase((64,), h=2, hkv=2, d=136, dv=136, arches=("sm_100",), backward=False),
    # FA4's dedicated (256, 256) SM100 backward asserts softcap == 0 (prime_ops refuses it in
    # its fake and kernel; FLASH_ATTENTION_HD256_GENERIC_BWD=1 takes it, test_fa4_compile.py);
    # refused only by the releases in FA4_HD256_NO_SOFTCAP, taken by later ones
    "hdim256_softcap_bwd_sm100": AttnCase(
        (64,), h=2, hkv=2, d=256, dv=256, softcap=5.0, arches=("sm_100",)
    ),
}
"""Calls FA4 refuses on the given architecture: prime_ops must refuse them first, naming why."""


class GemmCase(NamedTuple):
    """A QuACK GEMM through prime_ops: ``m`` rows, ``k`` in, ``n`` out, ``groups`` experts
    (0: dense ``prime_linear``) with ``counts`` rows each."""

    m: int
    k: int
    n: int
    counts: tuple[int, ...] = ()
    bias: bool = False


QUACK_CASES = {
    "linear": GemmCase(256, 512, 384),
    "linear_bias": GemmCase(128, 256, 256, bias=True),
    "grouped": GemmCase(384, 256, 512, counts=(128, 0, 256)),
}


def cu_seqlens(lengths, device):
    import torch

    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def fa4_args(case: AttnCase):
    """The op's arguments after q, k, v and the offsets, in FA4's schema order."""
    n = max(case.lengths)
    left, right = (None if w < 0 else w for w in case.window)
    return (n, n, case.causal, left, right, case.softmax_scale, case.softcap)


def _fa4_compile(arch: str, names) -> None:
    """Compile the named cases for ``arch`` under CUDA fake tensors; print one JSON per case."""
    os.environ.update(FA4_ARCH_ENV[arch], FLASH_ATTENTION_NUM_SMS=FA4_NUM_SMS)
    # FA4's persistent compile cache loads without a driver: a second run takes seconds. Its
    # entries sit under FA4's source fingerprint; one folder per architecture, since not every
    # key names the architecture (the backward's pre-processing kernel's does not).
    cache = os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), "prime-ops-fa4-cache"
    )
    os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "1"
    os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"] = os.path.join(cache, arch)
    import torch
    from flash_attn.cute import interface
    from torch._subclasses.fake_tensor import FakeTensorMode

    from prime_ops.attn import varlen

    forward, backward = varlen.OPS["fa4"]
    caches = {
        "fwd": interface._flash_attn_fwd.compile_cache,
        "bwd": interface._flash_attn_bwd.compile_cache,
    }
    for name in names:
        case = FA4_CASES.get(name) or FA4_REFUSED[name]
        row = {"case": name, "arch": arch, "fa4_arch": interface._get_device_arch()}
        with FakeTensorMode():
            dev = torch.device("cuda")
            tokens = sum(case.lengths)
            q = torch.empty(tokens, case.h, case.d, dtype=torch.bfloat16, device=dev)
            k = torch.empty(tokens, case.hkv, case.d, dtype=torch.bfloat16, device=dev)
            v = torch.empty(tokens, case.hkv, case.dv, dtype=torch.bfloat16, device=dev)
            cu = cu_seqlens(case.lengths, dev)
            rest = (cu, cu, *fa4_args(case))
            out = torch.empty(tokens, case.h, case.dv, dtype=torch.bfloat16, device=dev)
            lse = torch.empty(case.h, tokens, dtype=torch.float32, device=dev)
            saved = (out, q, k, v, out, lse, *rest)
            if name in FA4_REFUSED:
                row["prime_ops"] = _refusal(forward, q, k, v, *rest)
                if case.backward and not row["prime_ops"]:
                    row["prime_ops"] = _refusal(backward, *saved)
                    row["prime_ops_kernel"] = _refusal(backward._init_fn, *saved)
                row["fa4"] = _fa4_refusal(interface, case, q, k, v, out, lse, cu)
            else:
                # The op under a fake mode runs prime_ops' fake (its checks, its output
                # shapes); the op's own kernel (_init_fn) runs the same checks and then FA4's
                # host code, which compiles its kernel and skips the launch under a fake mode.
                before = {key: len(c.cache) for key, c in caches.items()}
                t0 = time.perf_counter()
                got = forward._init_fn(q, k, v, *rest)
                row["fwd_s"] = round(time.perf_counter() - t0, 2)
                row["fwd"] = [_meta(*got), _meta(*forward(q, k, v, *rest))]
                if case.backward:
                    saved = (torch.empty_like(got[0]), q, k, v, *got, *rest)
                    t0 = time.perf_counter()
                    grads = backward._init_fn(*saved)
                    row["bwd_s"] = round(time.perf_counter() - t0, 2)
                    row["bwd"] = [_meta(*grads), _meta(*backward(*saved))]
                row["compiled"] = {key: len(c.cache) - before[key] for key, c in caches.items()}
        print(json.dumps(row), flush=True)


def _refusal(fn, *args, **kwargs) -> str:
    """The message of the ValueError or AssertionError ``fn`` raises, or ''."""
    try:
        fn(*args, **kwargs)
    except (ValueError, AssertionError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _fa4_refusal(interface, case: AttnCase, q, k, v, out, lse, cu) -> str:
    """FA4 called directly, as prime_ops calls it: the forward, or the backward where the
    forward is accepted."""
    common = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, softcap=case.softcap or None)
    n = max(case.lengths)
    found = (
        _refusal(
            interface._flash_attn_fwd,
            q,
            k,
            v,
            max_seqlen_q=n,
            max_seqlen_k=n,
            return_lse=True,
            **common,
        )
        if not case.backward
        else ""
    )
    if case.backward:
        common["softcap"] = case.softcap
        found = _refusal(
            interface._flash_attn_bwd,
            q,
            k,
            v,
            out,
            out,
            lse,
            max_seqlen_q=n,
            max_seqlen_k=n,
            **common,
        )
    return found


def _quack_host(arch: str, names) -> None:
    """Run prime_ops' QuACK GEMM kernels (forward and backward) for ``arch`` under CUDA fake
    tensors with QuACK's tuning off (its autotuner synchronises the device); print one JSON
    per call: the GEMMs prime_ops asked QuACK for, and where QuACK stopped."""
    os.environ.update(QUACK_ARCH_ENV[arch], QUACK_CACHE_ENABLED="0")
    import functools
    import traceback

    import quack.gemm_interface as gemm_interface
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from prime_ops import quack as prime_quack

    calls = []
    untuned = functools.partial(gemm_interface.gemm, tuned=False)

    def recording_gemm(A, B, **kwargs):
        """QuACK's gemm, untuned; records the call and where QuACK stopped. Without a GPU it
        stops at its driver query: then a tensor of QuACK's output shape stands in for the
        launch, so prime_ops' kernel goes on to its next GEMM."""
        call = {
            "args": [_layout(A), _layout(B)],
            "kwargs": {k: _layout(v) for k, v in sorted(kwargs.items()) if v is not None},
        }
        calls.append(call)
        try:
            out = untuned(A, B, **kwargs)
            call["stopped"] = None
            return out
        except Exception as e:  # where QuACK stopped is what the tests check
            frames = traceback.extract_tb(e.__traceback__)
            call["stopped"] = {
                "error": type(e).__name__,
                "message": str(e).splitlines()[0][:200] if str(e) else "",
                "quack_frames": [f.name for f in frames if "/quack/" in f.filename],
            }
        cu_k = kwargs.get("cu_seqlens_k")
        rows = (cu_k.shape[0] - 1, A.shape[0]) if cu_k is not None else (A.shape[0],)
        return A.new_empty(*rows, B.shape[-1])

    # prime_ops looks QuACK's gemm up on every call (prime_ops.quack._gemm)
    gemm_interface.gemm = recording_gemm
    for name in names:
        case = QUACK_CASES[name]
        with FakeTensorMode():
            dev = torch.device("cuda")
            bf16 = dict(dtype=torch.bfloat16, device=dev)
            x = torch.empty(case.m, case.k, **bf16)
            grad = torch.empty(case.m, case.n, **bf16)
            if case.counts:
                w = torch.empty(len(case.counts), case.n, case.k, **bf16)
                offsets = torch.empty(len(case.counts), dtype=torch.int32, device=dev)
                steps = {
                    "forward": (prime_quack._quack_grouped, (x, w, offsets)),
                    "backward": (prime_quack._quack_grouped_backward, (grad, x, w, offsets)),
                }
                fakes = {
                    "forward": torch.ops.quack.prime_grouped_linear(x, w, offsets),
                    "backward": torch.ops.quack.prime_grouped_linear_backward(grad, x, w, offsets),
                }
            else:
                w = torch.empty(case.n, case.k, **bf16)
                bias = torch.empty(case.n, **bf16) if case.bias else None
                steps = {
                    "forward": (prime_quack._quack_linear, (x, w, bias)),
                    "backward": (prime_quack._quack_linear_backward, (grad, x, w)),
                }
                fakes = {
                    "forward": torch.ops.quack.prime_linear(x, w, bias),
                    "backward": torch.ops.quack.prime_linear_backward(grad, x, w),
                }
            for step, (fn, args) in steps.items():
                calls.clear()
                t0 = time.perf_counter()
                got = fn(*args)
                row = {"case": name, "arch": arch, "step": step}
                row["s"] = round(time.perf_counter() - t0, 2)
                row["calls"] = list(calls)
                as_tuple = lambda t: t if isinstance(t, tuple) else (t,)  # noqa: E731
                row["outputs"] = [_meta(*as_tuple(got)), _meta(*as_tuple(fakes[step]))]
                print(json.dumps(row), flush=True)


def _layout(value):
    """A tensor as [shape, stride, dtype]; other values as they are."""
    if hasattr(value, "shape") and hasattr(value, "stride"):
        return [list(value.shape), list(value.stride()), str(value.dtype).removeprefix("torch.")]
    return value


def _meta(*tensors) -> list:
    return [[list(t.shape), str(t.dtype).removeprefix("torch."), t.device.type] for t in tensors]


def main(argv) -> None:
    library, arch, *names = argv + [""] * (2 - len(argv))
    if library not in ("fa4", "quack") or arch not in FA4_ARCH_ENV:
        sys.exit(f"usage: python cases.py {{fa4,quack}} {{{','.join(FA4_ARCH_ENV)}}} [CASE...]")
    if library == "quack":
        _quack_host(arch, names or list(QUACK_CASES))
    else:
        every = {**FA4_CASES, **FA4_REFUSED}
        _fa4_compile(arch, names or [n for n, c in every.items() if arch in c.arches])


if __name__ == "__main__":
    main(sys.argv[1:])
