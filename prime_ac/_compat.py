"""Every private torch name prime_ac uses, each behind a feature test, in one place.

prime_ac supports torch 2.9 up to the newest release. Each name below says which torch versions
need it and which public API would replace it; the rest of the package imports from here only.
Nothing here changes torch's global state except :func:`redirect_hops`, which registers rules for
prime_ac's own mode classes (keyed by those classes, so no other mode sees them).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint as _checkpoint

# TorchDispatchMode is public in practice but lives in a private module (2.9-2.14); the pytree
# helpers likewise. Public replacement: torch.utils.pytree for the helpers (2.7+ has a public
# module), none yet for the mode class.
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

__all__ = [
    "COMPILED_OFFLOAD",
    "CachingSACMode",
    "CHECKPOINT_RESPECTS_HOOKS",
    "FSDP_ALL_GATHER_COPY_IN",
    "SAC_IGNORED_OPS",
    "DispatchMode",
    "HigherOrderOperator",
    "INDUCTOR_COMPILED_CODE",
    "OpOverload",
    "TorchDispatchMode",
    "detach",
    "dispatch_op_names",
    "is_compiled_module",
    "is_composite_implicit",
    "is_top_mode",
    "is_traceable_wrapper_subclass",
    "is_tracing",
    "enable_compiled_offload",
    "own_code_getter",
    "proxy_mode",
    "recompile_limit",
    "operator_parts",
    "redirect_hops",
    "region_mode",
    "sac_context",
    "sac_hops",
    "schema_is_mutable",
    "set_eval_frame",
    "storage_id",
    "storage_key",
    "tree_flatten",
    "tree_leaves",
    "top_saved_tensors_hooks",
    "tree_unflatten",
    "version",
    "without_top_mode",
    "written_arguments",
    "attach_oom_observer",
    "saved_tensor_values",
    "SAVED_TENSOR_DATA",
    "set_allocation_label",
]

# FSDP2 (fully_shard) passes each all-gather's flat output buffer through this op of its private
# "fsdp" namespace (torch 2.9-2.14). The buffer is communication scratch, never an activation, but
# it can outlive the forward: on torch 2.9.1 with gloo it was still alive, though FSDP had dropped
# it, when about one forward in ten returned (the audit then counted it as held). Named as a
# string, so a torch without the op never matches. Public replacement: none (fully_shard exposes
# no hook for its buffers).
FSDP_ALL_GATHER_COPY_IN = "fsdp::all_gather_copy_in"

# torch.ops.<ns>.<op>.<overload> objects. Public replacement: none (the types live in torch._ops
# in every release 2.9-2.14).
OpOverload = torch._ops.OpOverload
HigherOrderOperator = torch._ops.HigherOrderOperator

# torch 2.10+ wraps the __torch_dispatch__ of every TorchDispatchMode subclass in
# torch._disable_dynamo (TorchDispatchMode.__init_subclass__, unless the class's
# _should_skip_dynamo() is False): several microseconds of Python per operator, the largest part
# of a mode's cost. prime_ac's modes opt out and keep what the wrapper guarantees (dynamo never
# evaluates frames inside the handler) with two C calls to set_eval_frame around it (torch 2.0+).
# Public replacement: none.
_eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
set_eval_frame = getattr(_eval_frame, "set_eval_frame", lambda callback: None)


class DispatchMode(TorchDispatchMode):
    """A TorchDispatchMode without torch's per-operator dynamo wrapper (see above).

    Subclasses call :data:`set_eval_frame` around their handler themselves. Like torch's own SAC
    modes they ignore compile internals: compiled code inside a region stays compiled.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


_MODE_KEYS = getattr(torch._C, "_TorchDispatchModeKey", None)
_TRACING_MODE_KEYS = tuple(
    key
    for key in (getattr(_MODE_KEYS, "PROXY", None), getattr(_MODE_KEYS, "FUNCTIONAL", None))
    if key is not None
)


def is_tracing() -> bool:
    """True while torch.compile (AOTAutograd) or export traces a checkpointed region.

    ``torch.compiler.is_compiling()`` says so from torch 2.10 on; torch 2.9 calls a region's
    ``context_fn`` during AOTAutograd tracing with it False, so the proxy and functional
    infra modes (``torch._C._get_dispatch_mode``, 2.1-2.14) are checked too: what torch's own
    SAC mode checks. Public replacement: ``torch.compiler.is_compiling()`` once 2.9 is dropped.
    """
    if torch.compiler.is_compiling():
        return True
    return any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODE_KEYS)


# Operators torch's own selective checkpointing lets through uncounted (detach, which autograd
# inserts a different number of times in forward and recompute; metadata queries). A module
# constant without underscore, but undocumented: present 2.4-2.14. Fallback: detach alone.
SAC_IGNORED_OPS: frozenset = frozenset(
    getattr(_checkpoint, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default})
)

# torch's own SAC mode classes. prime_ac asks which higher-order operators have a rule registered
# for them, to register the same redirect for its own modes (the dispatcher looks rules up by
# exact mode type); compiled regions (prime_ac.compiled) give the forward one that
# create_selective_checkpoint_contexts makes a subclass marking offloaded nodes. Same names
# 2.4-2.14. Public replacement: none (create_selective_checkpoint_contexts takes no subclass).
CachingSACMode = _checkpoint._CachingTorchDispatchMode
_TORCH_SAC_MODES = tuple(
    cls
    for cls in (
        getattr(_checkpoint, "_CachingTorchDispatchMode", None),
        getattr(_checkpoint, "_CachedTorchDispatchMode", None),
    )
    if cls is not None
)

# The registry of higher-order operators by name (torch._ops._higher_order_ops, 2.1-2.14) and each
# one's per-mode rules (python_key_table). Public replacement: none.
_HOP_REGISTRY: dict[str, Any] = getattr(torch._ops, "_higher_order_ops", {})
_redirected: dict[type, int] = {}


def redirect_hops(mode_class: type) -> None:
    """Let ``mode_class`` handle every higher-order operator torch's SAC modes handle.

    torch registers, per such operator, ``hop.py_impl(mode)(lambda mode, *a, **k:
    mode.__torch_dispatch__(hop, [], a, k))`` for its two SAC modes; the same rule is registered
    here for ``mode_class``. Operators imported later are picked up on the next call (cheap when
    the registry did not grow). Global because torch's registry is.
    """
    size = len(_HOP_REGISTRY)
    if _redirected.get(mode_class) == size:
        return
    for hop in sac_hops():
        if mode_class not in hop.python_key_table:
            hop.py_impl(mode_class)(_redirect(hop))
    _redirected[mode_class] = size


def _redirect(hop: Any):
    def rule(mode: Any, *args: Any, **kwargs: Any) -> Any:
        return mode.__torch_dispatch__(hop, [], args, kwargs)

    return rule


# Detaching a kept output below autograd with the ADInplaceOrView key re-enabled, so a view keeps
# sharing its base's version counter and a cached view comes back without autograd metadata
# (what torch's own SAC does, 2.4-2.14). Public replacement: none.
_ad_inplace_or_view = torch._C.DispatchKey.ADInplaceOrView
_exclude_key_guard = torch._C._SetExcludeDispatchKeyGuard


def detach(t: torch.Tensor) -> torch.Tensor:
    """A detached alias of ``t`` that shares its version counter."""
    with _exclude_key_guard(_ad_inplace_or_view, False):
        return t.detach()


def storage_id(t: torch.Tensor) -> int | None:
    """Identity of ``t``'s storage (views share it), or None for tensors without one.

    ``UntypedStorage._cdata`` is the StorageImpl address, stable while the storage lives (what
    torch's own StorageWeakRef hashes; 2.0-2.14). Public replacement: none that is this cheap.
    """
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # sparse, wrapper subclasses without storage
        return None


def version(t: torch.Tensor) -> int:
    """``t``'s in-place version counter (Tensor._version, every release)."""
    return t._version


# SelectiveCheckpointContext takes ``op_output`` in newer releases (2.13, 2.14) and only
# ``is_recompute`` in older ones (2.9). Public class, version-dependent signature: feature-tested.
_SAC_CONTEXT_HAS_OUTPUT = (
    "op_output" in inspect.signature(_checkpoint.SelectiveCheckpointContext).parameters
)


def sac_context(out: Any) -> Any:
    """The context a user policy callable receives for a forward call that returned ``out``."""
    if _SAC_CONTEXT_HAS_OUTPUT:
        return _checkpoint.SelectiveCheckpointContext(is_recompute=False, op_output=out)
    return _checkpoint.SelectiveCheckpointContext(is_recompute=False)


def written_arguments(op: Any) -> tuple[tuple[int, str], ...] | None:
    """``(position, name)`` of each argument ``op`` writes, ``()`` when it writes none.

    None means "unknown": a higher-order operator that mutates its inputs
    (``triton_kernel_wrapper_mutation``), whose every tensor argument counts as written.
    """
    if isinstance(op, OpOverload):
        return tuple(
            (i, a.name)
            for i, a in enumerate(op._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    return None if "mutation" in getattr(op, "_name", "") else ()


def schema_is_mutable(op: Any) -> bool:
    """True when ``op``'s schema writes an argument (OpOverload._schema, every release)."""
    return isinstance(op, OpOverload) and op._schema.is_mutable


def returns_alias(op: Any) -> bool:
    """True when ``op``'s schema returns an argument or a view of one (``view``, ``t``,
    ``split``, ``add_``, ``mm.out``): its result shares the argument's storage."""
    return isinstance(op, OpOverload) and any(r.alias_info is not None for r in op._schema.returns)


def returns_nothing(op: Any) -> bool:
    """True when ``op``'s schema returns nothing (``-> ()``, an out= custom op's)."""
    return isinstance(op, OpOverload) and not op._schema.returns


# The dispatcher's operator table and kernel lookup (torch._C, every release 2.9-2.14), for the
# target reports. Public replacement: none.
def dispatch_op_names() -> set[str]:
    """Every registered overload: ``ns::op`` for a ``.default`` overload, ``ns::op.name`` else."""
    return set(torch._C._dispatch_get_all_op_names())


def is_composite_implicit(op: Any) -> bool:
    """True when ``op`` decomposes before any dispatch mode sees it."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def operator_parts(op: Any) -> tuple[str, str, str]:
    """``(namespace, op, overload)`` of an OpOverload (OpOverload._opname/_overloadname, every
    release; public ``op.name()`` joins them and drops ``default``)."""
    return op.namespace, op._opname, op._overloadname


def sac_hops() -> list[Any]:
    """The higher-order operators torch's own SAC modes have a rule for (see redirect_hops)."""
    return [
        hop
        for hop in list(_HOP_REGISTRY.values())
        if any(m in getattr(hop, "python_key_table", {}) for m in _TORCH_SAC_MODES)
    ]


# torch 2.13+ keys a kept inductor_compiled_code call by its compiled callable, so that a cache
# hit skipping one compiled region in the recompute cannot shift another region's results
# (pytorch gh-175258). The higher-order operator and its side table live in
# torch._higher_order_ops.wrap (2.13-2.14; absent before). Public replacement: none.
_wrap = getattr(getattr(torch, "_higher_order_ops", None), "wrap", None)
INDUCTOR_COMPILED_CODE = getattr(_wrap, "inductor_compiled_code", None)
_resolve_inductor_callable = getattr(_wrap, "_resolve_inductor_callable", None)


def storage_key(op: Any, args: tuple) -> Any:
    """The key a kept call of ``op`` is stored under: ``op``, or ``(op, compiled region id)``."""
    if op is INDUCTOR_COMPILED_CODE and args and _resolve_inductor_callable is not None:
        return (op, _resolve_inductor_callable(args[0]).idx)
    return op


def top_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The innermost ``(pack, unpack)`` saved-tensor hooks in effect, or None.

    torch._C._autograd._top_saved_tensors_default_hooks (2.0-2.14), what saved_tensors_hooks
    pushes onto. Public replacement: none (torch.autograd.graph can push hooks, not read them).
    """
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


def region_mode(kinds: tuple[type, ...]) -> Any:
    """The innermost dispatch mode in effect that is an instance of ``kinds``, or None.

    torch.utils._python_dispatch._get_current_dispatch_mode_stack (2.0-2.14). Public
    replacement: none (a mode can be entered, not found).
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = _get_current_dispatch_mode_stack()
    return next((m for m in reversed(modes) if isinstance(m, kinds)), None)


def is_top_mode(mode: Any) -> bool:
    """Whether ``mode`` is the innermost dispatch mode in effect (same private name as
    :func:`region_mode`)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    modes = _get_current_dispatch_mode_stack()
    return bool(modes) and modes[-1] is mode


@contextlib.contextmanager
def without_top_mode(mode: Any) -> Iterator[None]:
    """Run the body with ``mode``, the innermost dispatch mode, taken off the stack.

    torch.utils._python_dispatch._pop_mode_temporarily (2.0-2.14). Public replacement: none.
    """
    from torch.utils._python_dispatch import (
        _get_current_dispatch_mode_stack,
        _pop_mode_temporarily,
    )

    stack = _get_current_dispatch_mode_stack()
    if not stack or stack[-1] is not mode:
        inner = type(stack[-1]).__name__ if stack else "none"
        raise RuntimeError(
            f"prime_ac.keep: the call runs under another dispatch mode ({inner}) entered inside "
            "the checkpointed block, which prime_ac cannot step around: enter it outside the "
            "block, or call the function without prime_ac.keep"
        )
    with _pop_mode_temporarily():
        yield


# torch 2.14+: checkpoint(..., respect_saved_tensors_hooks=) (pytorch#190581); its default None
# warns (FutureWarning) when a user's saved_tensors_hooks surround torch's selective checkpoint.
CHECKPOINT_RESPECTS_HOOKS = (
    "respect_saved_tensors_hooks" in inspect.signature(_checkpoint.checkpoint).parameters
)


def _returning(value: Any) -> Callable[[], Any]:
    def get() -> Any:
        return value

    return get


def own_code_getter(value: Any) -> Callable[[], Any]:
    """A function of no arguments returning ``value``, with a code object of its own.

    dynamo guards a function it reads by its ``__code__`` alone (torch 2.9-2.14:
    ``CLOSURE_MATCH``) and takes one as a constant in a checkpoint's ``context_fn`` partial,
    where torch 2.9 takes no object of a user class: a partial holding this function is traced
    by every supported torch and compiles one graph per function. Public replacement: none.
    """
    template = _returning(value)
    return types.FunctionType(
        template.__code__.replace(),  # an equal but distinct code object
        template.__globals__,
        template.__name__,
        None,
        template.__closure__,
    )


# Whether autograd's SavedTensor shows what it holds without unpacking it (``.data``);
# without it the saves outside checkpointed blocks cannot be read safely.
SAVED_TENSOR_DATA = hasattr(torch._C._autograd.SavedTensor, "data")


def saved_tensor_values(node: Any) -> list[Any]:
    """What autograd node ``node`` saved, as packed (never unpacked): a tensor, or what a pack
    hook returned (a checkpoint's holder, an offload's record). Unpacking would run a
    checkpoint's recompute, so this reads ``SavedTensor.data`` behind the node's
    ``_raw_saved_*`` attributes (torch 2.0-2.14; a node whose saves were freed by a backward
    gives nothing). Public replacement: none (``_saved_*`` unpacks)."""
    names = _raw_saved_names.get(type(node))
    if names is None:
        names = _raw_saved_names[type(node)] = tuple(
            n for n in dir(node) if n.startswith("_raw_saved_")
        )
    found = []
    for name in names:
        try:
            value = getattr(node, name)
        except RuntimeError:  # released by a backward that ran through the node
            continue
        for saved in value if isinstance(value, (list, tuple)) else (value,):
            data = getattr(saved, "data", None)
            if data is not None:
                found.append(data)
    return found


_raw_saved_names: dict[type, tuple[str, ...]] = {}


def set_allocation_label(label: str) -> bool:
    """Attach ``label`` to the CUDA caching allocator's later allocations ("" clears it), as
    they appear in ``torch.cuda.memory._snapshot()``'s traces; False where this torch cannot
    (a CPU build, a release without it, or a CUDA build with no usable GPU, where the call
    would raise initialising CUDA). ``torch._C._cuda_setMemoryMetadata`` (what
    ``torch.cuda.memory._set_memory_metadata`` calls). Public replacement: none."""
    setter = getattr(torch._C, "_cuda_setMemoryMetadata", None)
    if setter is None or not torch.cuda.is_available():
        return False
    setter(label)
    return True


def attach_oom_observer(observer: Callable[..., None]) -> bool:
    """Have the CUDA caching allocator call ``observer(device, alloc, device_allocated,
    device_free)`` before it raises out of memory (CUDA builds,
    ``torch._C._cuda_attach_out_of_memory_observer``; it cannot be detached). False on a CPU
    build. Public replacement: none."""
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        return False
    attach(observer)
    return True


def proxy_mode() -> Any:
    """The proxy mode tracing now (make_fx, AOTAutograd), or None: whose graph a compiled
    region's nodes go into. torch.fx.experimental.proxy_tensor.get_proxy_mode (2.3-2.14).
    Public replacement: none."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode()


def _has_compiled_offload() -> bool:
    import importlib.util

    import torch._functorch.config as functorch_config

    try:
        found = importlib.util.find_spec("torch._functorch._activation_offloading") is not None
    except ImportError:
        return False
    return found and hasattr(functorch_config, "enable_activation_offloading")


# torch's compile-side activation offload (2.13-2.14): a pass after the partitioner that moves
# saved values marked meta["should_offload"] to pinned host memory (ao::offload / ao::reload /
# ao::wait_tensor on a side stream), enabled by torch._functorch.config flags. Absent in 2.9.
# Public replacement: none (pytorch#185015 would lower MUST_CPU_OFFLOAD by itself).
COMPILED_OFFLOAD: bool = _has_compiled_offload()


def enable_compiled_offload() -> None:
    """Turn torch's compile-side offload on, with its side stream, sunk waits and prefetched
    reloads, and its pinned-buffer pool (entered once, for the process): the flags act only on
    nodes marked ``should_offload``, which only prime_ac marks. A flag the user set stays."""
    import torch._functorch.config as config

    if not config.enable_activation_offloading:
        config.enable_activation_offloading = True
        config.activation_offload_separate_stream = True
        config.activation_offload_sink_wait = True
        config.activation_reload_prefetch = True
    from torch._functorch._activation_offloading import offload_ops

    # what entering offload_ops.pinned_memory_pool() sets, for the process (a context left open
    # would be closed at interpreter exit, after its module is torn down)
    if hasattr(offload_ops, "_pool_enabled"):
        offload_ops._pool_enabled = True


def recompile_limit() -> int | None:
    """dynamo's graphs per code object (``recompile_limit``; ``cache_size_limit`` before 2.6)."""
    config = torch._dynamo.config
    return getattr(config, "recompile_limit", getattr(config, "cache_size_limit", None))


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` runs compiled: ``module.compile()`` (nn.Module's
    ``_compiled_call_impl``, 2.2-2.14) or ``torch.compile(module)`` (an ``OptimizedModule``,
    torch._dynamo.eval_frame, 2.0-2.14). Public replacement: none."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    dynamo = getattr(torch, "_dynamo", None)
    optimized = getattr(getattr(dynamo, "eval_frame", None), "OptimizedModule", None)
    return optimized is not None and isinstance(module, optimized)
