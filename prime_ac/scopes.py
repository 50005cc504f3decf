"""Scoped targets and tags: which call of an operator to keep, not every call of it.

A plain target (``"aten::mm"``) names an operator everywhere in a block. Three more forms name
some of its calls (the grammar is in docs/checkpointing.md, "Scoped targets and tags"):

- ``"<scope>/<target>"`` keeps the calls made inside a submodule of the block whose path,
  relative to the block, ends with ``<scope>`` (dotted, ``*`` is one segment):
  ``"attention/aten::mm"``, ``"feed_forward.w1/aten::mm"``, ``"experts.*.w2/aten::mm"``;
- ``"!<scope>/<target>"`` forces those calls to replay;
- ``"tag:<name>"`` keeps the tensors model code marked with :func:`tag` (and
  ``"<scope>/tag:<name>"``, ``"!<scope>/tag:<name>"`` likewise);
- ``"region:<glob>"`` keeps a ``torch_remat.region`` call whose name matches the shell pattern
  (``"region:attention.*"``) whole, ``"!region:<glob>"`` replays every call inside it: a
  torchtitan model's declared regions, with no prime_ac edit (:mod:`prime_ac.remat`).

``/``, ``!`` and ``tag:`` never occur in the ``ns::op.overload`` grammar, so every string has
one reading. Precedence: mandatory > forced replay > scoped keep > unscoped keep.

The scope comes from forward hooks on the wrapped blocks' submodules, installed only for a
policy with scoped targets (:class:`ScopeTracker`); the per-call decision is then a dictionary
lookup keyed by ``(operator, scope)``. Under torch.compile the policy reads the scope from the
traced node's module stack instead, so both see the same module and decide the same.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from prime_ac._compat import is_tracing
from prime_ac.remat import current_region, region_names, remat_available, track_region_names
from prime_ac.targets import Target, TargetSet, operator_key

__all__ = [
    "TAG_OP",
    "ScopeRules",
    "ScopeTracker",
    "ScopedTarget",
    "parse_target",
    "retrack",
    "scope_problems",
    "split_targets",
    "tag",
    "untrack",
]

_SEGMENT = r"(?:[A-Za-z0-9_\-]+|\*)"
_SCOPE = re.compile(rf"{_SEGMENT}(?:\.{_SEGMENT})*")
_TAG = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_SCOPED_FORMS = (
    "'<scope>/<target>' (keep), '!<scope>/<target>' (force replay) or 'tag:<name>', where "
    "<scope> is a dotted submodule path relative to the block ('attention', "
    "'feed_forward.w1', '*' for one segment) and <target> an operator target or 'tag:<name>' "
    "(e.g. 'attention/aten::mm', '!feed_forward.w1/aten::mm', 'tag:attn_out')"
)


# --- grammar ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScopedTarget:
    """A target that names some calls: by module scope, as a forced replay, or by tag."""

    operator: Target | None  # None for a tag
    tag: str | None = None
    scope: tuple[str, ...] = ()  # () = anywhere in the block
    replay: bool = False
    region: str | None = None  # a torch_remat region name pattern: every call inside it

    @classmethod
    def parse(cls, text: str) -> ScopedTarget:
        body = text[1:] if text.startswith("!") else text
        if body.startswith("region:"):  # before "/": remat.name_scope joins names with "/"
            if not body[7:].strip():
                raise ValueError(
                    f"invalid region target {text!r}: name a torch_remat region (a shell "
                    "pattern over remat.region names, e.g. 'region:attention.*')"
                )
            return cls(None, None, (), text.startswith("!"), body[7:])
        scope: tuple[str, ...] = ()
        if "/" in body:
            prefix, _, body = body.partition("/")
            if not _SCOPE.fullmatch(prefix) or "/" in body:
                raise ValueError(
                    f"invalid scoped target {text!r}: the scope {prefix!r} must be a dotted "
                    f"submodule path; expected {_SCOPED_FORMS}"
                )
            scope = tuple(prefix.split("."))
        elif text.startswith("!"):
            raise ValueError(
                f"invalid target {text!r}: '!' forces replay inside a scope, and an operator left "
                f"out of targets already replays everywhere: write '!<scope>/{body}', e.g. "
                f"'!feed_forward/{body}'"
            )
        if _is_tag(body):
            name = body[4:]
            if not _TAG.fullmatch(name):
                raise ValueError(
                    f"invalid tag target {text!r}: the tag name {name!r} must be an identifier "
                    "(letters, digits, '_', '.', '-'), as given to prime_ac.tag(tensor, name)"
                )
            return cls(None, name, scope, text.startswith("!"))
        try:
            operator = Target.parse(body)
        except ValueError as error:
            raise ValueError(f"invalid scoped target {text!r}: {error}") from None
        return cls(operator, None, scope, text.startswith("!"))

    def __str__(self) -> str:
        if self.region is not None:
            return ("!" if self.replay else "") + "region:" + self.region
        what = f"tag:{self.tag}" if self.operator is None else str(self.operator)
        where = ".".join(self.scope) + "/" if self.scope else ""
        return ("!" if self.replay else "") + where + what

    def names(self, key: tuple[str, str, str | None], tag_name: str | None) -> bool:
        """Whether this target names operator ``key`` (or the tag ``tag_name``), scope aside."""
        if self.region is not None:
            return False  # decided by the regions a call is in (ScopeRules.decide)
        if self.operator is None:
            return tag_name is not None and tag_name == self.tag
        t = self.operator
        return (
            key[0] == t.namespace
            and (t.op is None or key[1] == t.op)
            and (t.overload is None or key[2] == t.overload)
        )

    def within(self, path: tuple[str, ...]) -> bool:
        """Whether a call in the submodule at ``path`` (relative to the block) is in scope:
        some module enclosing it has a path ending with the scope, i.e. the scope's segments
        occur consecutively in ``path``."""
        return not self.scope or any(self.ends(path[:end]) for end in range(1, len(path) + 1))

    def ends(self, path: tuple[str, ...]) -> bool:
        """Whether ``path`` ends with the scope (``*`` matching any one segment)."""
        n = len(self.scope)
        return 0 < n <= len(path) and all(
            p in ("*", s) for p, s in zip(self.scope, path[len(path) - n :], strict=True)
        )


def _is_tag(text: str) -> bool:
    # one colon: "tag::op" stays an operator of a namespace called "tag"
    return text.startswith("tag:") and not text.startswith("tag::")


def parse_target(text: Any) -> Target | ScopedTarget:
    """A plain :class:`~prime_ac.targets.Target`, or a :class:`ScopedTarget` for the forms that
    contain ``/``, ``!`` or ``tag:``."""
    if isinstance(text, str) and (
        "/" in text or text.startswith(("!", "region:")) or _is_tag(text)
    ):
        return ScopedTarget.parse(text)
    return Target.parse(text)


def split_targets(texts: Iterable[str]) -> tuple[list[str], list[ScopedTarget]]:
    """``(plain target strings, scoped targets)``, every string validated."""
    if isinstance(texts, str):
        TargetSet(texts)  # raises the error that says to write a list
    plain, scoped = [], []
    for text in texts:
        parsed = parse_target(text)
        if isinstance(parsed, ScopedTarget):
            scoped.append(parsed)
        else:
            plain.append(text)
    return plain, scoped


# --- tags ---------------------------------------------------------------------------------------


@torch.library.custom_op("prime_ac::tag", mutates_args=())
def _tag_op(x: torch.Tensor, name: str) -> torch.Tensor:
    """A copy of ``x`` that the checkpoint policy sees as a call named ``name``."""
    return x.clone()


@_tag_op.register_fake
def _(x: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(x)


_tag_op.register_autograd(lambda ctx, grad: (grad, None))

TAG_OP = torch.ops.prime_ac.tag.default
_is_compiling = torch.compiler.is_compiling

# The tag names some policy keeps or replays. Global because ``tag`` is called from model code,
# which holds no policy, and because torch.compile must guard on it: a frozenset read as a
# global is a guarded constant, so compiled code recompiles when a new policy adds names.
_tagged: frozenset[str] = frozenset()


def tag(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Mark ``tensor`` so that a ``"tag:<name>"`` target keeps it (or ``"!…/tag:<name>"``
    replays it).

    Returns ``tensor`` itself until a policy naming the tag is built in this process (a set
    lookup, no dispatch), so model code can tag freely. From then on, returns a copy made by the
    operator
    ``prime_ac::tag``, which the policy keeps or replays like any operator call, in eager and
    compiled code alike; its gradient passes through unchanged.

    Example::

        out = prime_ac.tag(self.wo(attn), "attn_out")
        prime_ac.checkpoint_blocks(model, mode="selective", targets=["tag:attn_out"])
    """
    if name not in _tagged:
        return tensor
    return _tag_op(tensor, name)


def _name_tags(scoped: Iterable[ScopedTarget]) -> None:
    global _tagged
    names = {t.tag for t in scoped if t.tag is not None}
    if not names <= _tagged:
        _tagged = _tagged | names


# --- scope tracking ------------------------------------------------------------------------------


class ScopeTracker:
    """The submodule path the running operator is in, from forward hooks on the blocks.

    Paths are relative to their block and interned as small ints (``0`` is the block itself), so
    that a decision can be cached per ``(operator, scope id)``. Blocks of the same structure share
    ids. One tracker per policy; the stack is the module nesting of the forward (or recompute)
    running now.

    ``scopes`` limits the hooks to the submodules whose path ends with one of them (a hook costs
    microseconds per module call). That loses nothing: a call's decision depends on the scopes
    ending at its enclosing modules, and the innermost hooked one's path holds all of those.
    ``None`` hooks every submodule (the audit, which reports each call's full path).
    """

    def __init__(self, scopes: Iterable[ScopedTarget] | None = None) -> None:
        self.scopes = None if scopes is None else tuple(scopes)
        self.stack: list[int] = []
        self.paths: list[tuple[str, ...]] = [()]
        self._ids: dict[tuple[str, ...], int] = {(): 0}
        # str(id(module)) -> scope id: how compiled code's module stack names a module
        self._modules: dict[str, int] = {}
        self._handles: weakref.WeakKeyDictionary[nn.Module, tuple[list, list]] = (
            weakref.WeakKeyDictionary()
        )

    def scope_id(self, path: tuple[str, ...]) -> int:
        sid = self._ids.get(path)
        if sid is None:
            sid = self._ids[path] = len(self.paths)
            self.paths.append(path)
        return sid

    def current(self) -> int:
        """The scope id of the operator running now (eager)."""
        return self.stack[-1] if self.stack else 0

    def compiled(self) -> int:
        """The scope id of the node being traced (torch.compile): dynamo records each node's
        enclosing modules in ``nn_module_stack``, keyed by ``str(id(module))`` (torch 2.4+)."""
        from torch.fx.traceback import get_current_meta

        stack = (get_current_meta() or {}).get("nn_module_stack") or {}
        for key in reversed(list(stack)):
            sid = self._modules.get(key)
            if sid is not None:
                return sid
        return 0

    def track(self, block: nn.Module) -> None:
        """Install the hooks on ``block``'s submodules (once)."""
        if block in self._handles:
            return
        handles, keys = [], []
        for name, module in block.named_modules():
            path = tuple(name.split("."))
            if module is block or (
                self.scopes is not None and not any(t.ends(path) for t in self.scopes)
            ):
                continue
            sid = self.scope_id(path)
            keys.append(str(id(module)))
            self._modules[keys[-1]] = sid
            handles.append(module.register_forward_pre_hook(_Enter(self, sid)))
            handles.append(module.register_forward_hook(_Exit(self), always_call=True))
        self._handles[block] = (handles, keys)

    def untrack(self, block: nn.Module) -> None:
        handles, keys = self._handles.pop(block, ((), ()))
        for handle in handles:
            handle.remove()
        for key in keys:
            self._modules.pop(key, None)

    def path(self) -> str:
        """The dotted path (relative to its block) of the submodule running now; ``""`` for the
        block's own code."""
        return ".".join(self.paths[self.current()])

    @contextmanager
    def tracking(self, blocks: Iterable[nn.Module]) -> Iterator[ScopeTracker]:
        """Track ``blocks`` within the context only (the audit's module paths)."""
        added = [block for block in blocks if block not in self._handles]
        for block in added:
            self.track(block)
        try:
            yield self
        finally:
            for block in added:
                self.untrack(block)

    def __reduce__(self) -> tuple[Any, ...]:
        # A copy (deepcopy, pickle) of a tracked model starts afresh: its own stack, no hooks
        # (the copied blocks install theirs again: :func:`retrack`).
        return (ScopeTracker, (self.scopes,))


# Traced code skips the hooks: dynamo refuses a checkpointed region that mutates state from
# outside it (a graph break), and the traced policy reads the node's module stack anyway.
# Objects, not closures, so that a copied hook still names a tracker (a copy of it), and
# :func:`retrack` can tell prime_ac's hooks from the model's own.
class _Enter:
    __slots__ = ("push", "sid", "tracker")

    def __init__(self, tracker: ScopeTracker, sid: int) -> None:
        self.tracker, self.sid, self.push = tracker, sid, tracker.stack.append

    def __call__(self, module: nn.Module, args: Any) -> None:
        if not _is_compiling():
            self.push(self.sid)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Enter, (self.tracker, self.sid))


class _Exit:
    __slots__ = ("pop", "tracker")

    def __init__(self, tracker: ScopeTracker) -> None:
        self.tracker, self.pop = tracker, tracker.stack.pop

    def __call__(self, module: nn.Module, args: Any, out: Any) -> None:
        if not _is_compiling():
            self.pop()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Exit, (self.tracker,))


def untrack(block: nn.Module) -> None:
    """Remove every scope hook prime_ac installed on ``block``.

    The hooks are found on the block's modules, and each names its tracker: no registry of
    trackers is needed, even for a block whose settings no longer name the policy it had
    (swapped by another wrapper since).
    """
    trackers = {
        hook.tracker
        for module in block.modules()
        for hooks in (module._forward_pre_hooks, module._forward_hooks)
        for hook in hooks.values()
        if isinstance(hook, (_Enter, _Exit))
    }
    for tracker in trackers:
        tracker.untrack(block)


def retrack(block: nn.Module, policy: Any) -> None:
    """After a copy (deepcopy, unpickling) of ``block``: drop the scope hooks copied with its
    submodules, which no tracker knows, and install ``policy``'s (a policy or None) afresh."""
    for module in block.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, hook in hooks.items() if isinstance(hook, (_Enter, _Exit))]:
                del hooks[key]
                module._forward_hooks_always_called.pop(key, None)
    scoped = getattr(policy, "scoped", None)
    if scoped is not None and scoped.needs_scope:
        scoped.tracker.track(block)


# --- decisions ----------------------------------------------------------------------------------


class ScopeRules:
    """The scoped, forced-replay and tag targets of one policy, and their per-call decisions.

    ``plain`` is the policy's unscoped targets: a call that no scoped target decides falls back to
    them (lowest precedence).
    """

    def __init__(self, scoped: Iterable[ScopedTarget], plain: TargetSet):
        self.targets = tuple(scoped)
        self.plain = plain
        self.needs_scope = any(t.scope for t in self.targets)
        self.needs_region = any(t.region is not None for t in self.targets)
        self.tracker = ScopeTracker([t for t in self.targets if t.scope])
        self._stack = self.tracker.stack
        self._decisions: dict[tuple[int, str | None, int, int], bool] = {}
        self._regions: dict[int, bool] = {}  # keeps_region, per region id
        _name_tags(self.targets)
        if self.needs_region:
            track_region_names()

    def __reduce__(self) -> tuple[Any, ...]:
        # decisions are keyed by id(operator), and the tracker holds hooks: a copy starts afresh
        return (ScopeRules, (self.targets, self.plain))

    def involves(self, key: tuple[str, str, str | None]) -> bool:
        """Whether calls of operator ``key`` are decided per call (scope or tag)."""
        if self.needs_region:  # a region target names every operator called inside it
            return True
        if key == ("prime_ac", "tag", "default"):
            return any(t.operator is None for t in self.targets)
        return any(t.operator is not None and t.names(key, None) for t in self.targets)

    def keeps(self, op: Any, args: tuple, sid: int, rid: int = 0) -> bool:
        """Whether the call of ``op`` with ``args`` in scope ``sid`` (and torch_remat regions
        ``rid``, :mod:`prime_ac.remat`) is kept: a dict lookup once the (operator, tag, scope,
        regions) was seen."""
        name = args[1] if op is TAG_OP else None
        key = (id(op), name, sid, rid)  # operators are process-lifetime singletons: id() is fast
        decision = self._decisions.get(key)
        if decision is None:
            path = self.tracker.paths[sid]
            decision = self._decisions[key] = self.decide(
                operator_key(op), path, name, region_names(rid)
            )
        return decision

    def keeps_region(self, rid: int) -> bool:
        """Whether the torch_remat region call with names ``rid`` is kept whole: a region target
        names one of them and no forced-replay region target does."""
        decision = self._regions.get(rid)
        if decision is None:
            names = region_names(rid)
            named = [
                t
                for t in self.targets
                if t.region is not None and any(fnmatchcase(r, t.region) for r in names)
            ]
            decision = self._regions[rid] = bool(named) and not any(t.replay for t in named)
        return decision

    def keeps_here(self, op: Any, args: tuple) -> bool:
        """:meth:`keeps` in the scope the eager forward or recompute is in now (the per-call
        path of prime_ac's own modes, so :meth:`keeps` is inlined)."""
        stack = self._stack
        sid = stack[-1] if stack else 0
        rid = current_region() if self.needs_region else 0
        decision = self._decisions.get((id(op), args[1] if op is TAG_OP else None, sid, rid))
        return self.keeps(op, args, sid, rid) if decision is None else decision

    def keeps_now(self, op: Any, args: tuple) -> bool:
        """:meth:`keeps` where the code runs: inside a submodule, eager code has the hooks'
        stack; traced code (torch.compile) has its node's module stack."""
        tracing = is_tracing()
        if self.needs_region and tracing:
            raise NotImplementedError(
                f"prime_ac: region targets ({', '.join(str(t) for t in self.targets)}) read the "
                "torch_remat.region calls of an eager forward; torch.compile traces them away. "
                "Run these blocks eagerly, or name the operators instead "
                "('<scope>/<target>', docs/checkpointing.md)"
            )
        stack = self._stack
        if stack:
            return self.keeps(op, args, stack[-1], current_region() if self.needs_region else 0)
        return self.keeps(op, args, self.tracker.compiled() if tracing else 0)

    def decide(
        self,
        key: tuple[str, str, str | None],
        path: tuple[str, ...],
        tag_name: str | None = None,
        regions: tuple[str, ...] = (),
    ) -> bool:
        """Keep a call of operator ``key`` (or of the tag ``tag_name``) in the submodule at
        ``path``, inside the torch_remat regions ``regions``? Forced replay beats any keep;
        otherwise any matching target keeps it."""
        named = [
            t
            for t in self.targets
            if (t.names(key, tag_name) and t.within(path))
            or (t.region is not None and any(fnmatchcase(r, t.region) for r in regions))
        ]
        if any(t.replay for t in named):
            return False
        return bool(named) or (tag_name is None and self.plain.matches(key))

    def __iter__(self):
        return iter(str(t) for t in self.targets)


def scope_problems(
    scoped: Iterable[ScopedTarget], blocks: Iterable[nn.Module]
) -> list[tuple[str, str]]:
    """``(target, reason)`` for each scoped target whose scope matches no submodule of any of
    ``blocks``, or whose operator no dispatch mode can see (like an unknown operator)."""
    paths = {
        tuple(name.split("."))
        for block in blocks
        for name, module in block.named_modules()
        if module is not block
    }
    problems = []
    for target in scoped:
        if target.region is not None and not remat_available():
            problems.append(
                (
                    str(target),
                    "names a torch_remat region, and torch_remat is not installed "
                    "(pip install torch-remat): no call is inside one",
                )
            )
        elif target.scope and not any(target.within(p) for p in paths):
            problems.append((str(target), "names a scope that matches no submodule of a block"))
        elif target.operator is not None:
            reason = target.operator.problem()
            if reason is not None:
                problems.append((str(target), reason))
    return problems
