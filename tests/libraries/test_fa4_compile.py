"""prime_ops' FA4 calls through the real flash-attn-4 host code, compiled for SM90 and SM100.

``prime_rl_attn::flash_attn_4_varlen``'s own kernel (and its backward's) runs under
``FakeTensorMode`` with CUDA fake tensors: prime_ops' checks, then FA4's ``_flash_attn_fwd`` /
``_flash_attn_bwd`` with every host assert, then FA4's CuTe DSL compile for the architecture FA4
is told (``FLASH_ATTENTION_ARCH``, ``CUTE_DSL_ARCH``). FA4 skips the launch itself under a fake
mode (``flash_attn.cute.testing.is_fake_mode``), so nothing here replaces any code. Each
architecture compiles in its own process (tests/libraries/cases.py), both at once, into FA4's
persistent compile cache (``$TMPDIR/prime-ops-fa4-cache``, or the folder
``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR`` names): a later run loads what an earlier one compiled
from the same FA4 sources.
"""

from __future__ import annotations

import pytest

from libraries import cases

FA4 = cases.require("flash-attn-4", cases.FA4_VERSIONS)

COMPILED = [
    pytest.param(arch, name, id=f"fa4-{FA4}-{arch}-{name}")
    for name, case in cases.FA4_CASES.items()
    for arch in case.arches
]
REFUSED = [
    pytest.param(arch, name, id=f"fa4-{FA4}-{arch}-{name}")
    for name, case in cases.FA4_REFUSED.items()
    for arch in case.arches
]


@pytest.fixture(scope="module")
def fa4():
    return cases.Runs("fa4", cases.FA4_ARCH_ENV)


@pytest.mark.parametrize(("arch", "name"), COMPILED)
def test_prime_ops_call_compiles_in_fa4(fa4, arch, name, record_property):
    """FA4 compiles (or loads from its cache) one new kernel for the forward (and one for the
    backward) of the call, for the architecture asked for, and returns what prime_ops' fake says
    the op returns."""
    case = cases.FA4_CASES[name]
    row = fa4.row(arch, case=name)
    assert row["fa4_arch"] == int(arch.removeprefix("sm_"))
    assert row["compiled"] == {"fwd": 1, "bwd": int(case.backward)}
    tokens = sum(case.lengths)
    got, fake = row["fwd"]
    assert got == fake
    assert got == [
        [[tokens, case.h, case.dv], "bfloat16", "cuda"],
        [[case.h, tokens], "float32", "cuda"],
    ]
    if case.backward:
        got, fake = row["bwd"]
        assert got == fake
        assert [shape for shape, _, _ in got] == [
            [tokens, case.h, case.d],
            [tokens, case.hkv, case.d],
            [tokens, case.hkv, case.dv],
        ]
    record_property("compile_s", row["fwd_s"] + row.get("bwd_s", 0.0))


@pytest.mark.parametrize(("arch", "name"), REFUSED)
def test_calls_fa4_refuses_never_reach_a_launch(fa4, arch, name):
    """FA4 itself refuses these; prime_ops refuses first, naming the backend, the arch and the
    rule, in its fake (so also while tracing) and its kernel alike: the head dims, and the SM100
    head-dim-256 backward with softcap (where the installed FA4 refuses it: from 4.0.0b39 on,
    FA4 and prime_ops both take it)."""
    case = cases.FA4_REFUSED[name]
    row = fa4.row(arch, case=name)
    if case.softcap and FA4 not in cases.FA4_HD256_NO_SOFTCAP:
        assert row["fa4"] == row["prime_ops"] == row["prime_ops_kernel"] == ""
        return
    assert row["fa4"].startswith("AssertionError: ")
    refusal = row["prime_ops"]
    if case.softcap:
        assert "softcap" in row["fa4"]
        assert row["prime_ops_kernel"] == refusal  # the fake and the kernel check alike
        assert "softcap=5.0" in refusal and "FLASH_ATTENTION_HD256_GENERIC_BWD=1" in refusal
    assert refusal.startswith("ValueError: backend 'fa4' cannot run head dims")
    assert f"SM{arch.removeprefix('sm_')}" in refusal


def test_softcap_hdim256_backward_runs_on_fa4s_general_kernel():
    """With ``FLASH_ATTENTION_HD256_GENERIC_BWD=1`` FA4 compiles the softcap backward for head
    dims (256, 256) on SM100 in its general kernel, and prime_ops lets it through."""
    runs = cases.Runs(
        "fa4",
        ["sm_100"],
        names=["hdim256_softcap_bwd_sm100"],
        env={"FLASH_ATTENTION_HD256_GENERIC_BWD": "1"},
    )
    row = runs.row("sm_100", case="hdim256_softcap_bwd_sm100")
    assert row["fa4"] == row["prime_ops"] == row["prime_ops_kernel"] == ""


def test_head_dim_rules_match_fa4():
    """prime_ops.attn.flash.fa4_head_dims accepts exactly the head dims FA4's own
    ``_validate_head_dims`` accepts for bf16, on SM90, SM100 and SM110."""
    from flash_attn.cute import interface

    from prime_ops.attn import flash

    dims = (1, 7, 8, 16, 64, 72, 120, 128, 136, 192, 200, 248, 256, 264, 512, 520)
    differ = []
    for arch in (90, 100, 110):
        for d in dims:
            for dv in dims:
                try:
                    interface._validate_head_dims(d, dv, arch // 10, 8)
                    fa4_accepts = True
                except AssertionError:
                    fa4_accepts = False
                try:
                    flash.fa4_head_dims(d, dv, arch, backward=False)
                    ours = True
                except ValueError:
                    ours = False
                if ours != fa4_accepts:
                    differ.append((arch, d, dv, fa4_accepts))
    assert not differ, f"(arch, d, dv, FA4 accepts) where prime_ops differs: {differ}"
