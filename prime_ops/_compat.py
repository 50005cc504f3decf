"""Every private or version-dependent torch name prime_ops uses, in one place.

prime_ops supports torch 2.9 to 2.14. Each name below says which releases need it and which
public API would replace it; the rest of prime_ops imports these names from here and nowhere else,
so a torch upgrade that moves one of them breaks this file only. The Python ops work on every
supported release; only the native kernels (:mod:`prime_ops.native`, LibTorch stable ABI) need
2.10, and one compile setting differs on 2.9 (``COMPILE_NEEDS_DYNAMIC_OUTPUT_SHAPE_OPS``). This
module imports torch only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch.compile traces ops with FakeTensors, whose values the cu_seqlens checks must not read.
# Private in torch 2.9-2.14 (torch._subclasses); torch.compiler.is_compiling() is the public half
# of the test but misses a bare FakeTensorMode (register_fake, opcheck).
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = [
    "COMPILE_NEEDS_DYNAMIC_OUTPUT_SHAPE_OPS",
    "all_gather_single",
    "assert_async",
    "is_fake",
    "reduce_scatter_single",
    "registered_op_names",
    "resolve_process_group",
]

# Custom op schemas carry a process group as its name (a str); the ops turn it back into the
# group. Private in torch 2.9-2.14 (torch's own functional collectives use it the same way); no
# public lookup from a group name exists yet.
resolve_process_group = _resolve_process_group

# A device-side assertion that costs no host sync (fails at the next synchronisation). Private in
# torch 2.9-2.14; torch._check is the public alternative but syncs on a tensor condition.
assert_async = torch._assert_async

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to the *_single names and
# made the old ones deprecated wrappers that warn on every call. Feature test, not a version
# check: the new public names where they exist, the old public names on torch 2.9-2.12.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# A custom op whose fake allocates a data-dependent size (all_to_all_single with tensor splits)
# compiles with fullgraph=True only if torch._dynamo.config.capture_dynamic_output_shape_ops is
# True on torch 2.9; from 2.10 fullgraph=True turns it on (pytorch/pytorch#163123). Checked on
# 2.9.1 (refused) and 2.13.0 / 2.14.1 (traced). Without fullgraph the op graph-breaks on every
# version unless the flag is set. Public (documented) flag; version check since it is a default.
COMPILE_NEEDS_DYNAMIC_OUTPUT_SHAPE_OPS = torch.__version__ < (2, 10)

# Autograd's clamp gradient at the bounds: passed up to torch 2.13, zero from 2.14 on (x == max
# gives 1 on 2.13, 0 on 2.14). Spelled-out backwards that must equal eager autograd follow it.
CLAMP_GRAD_PASSES_AT_BOUNDS = torch.__version__ < (2, 14)


def registered_op_names() -> set[str]:
    """Every operator the dispatcher knows, as ``"ns::name"``.

    Private in torch 2.9-2.14 (``torch._C``). The public probe, ``hasattr(torch.ops.ns, name)``,
    asks about one name at a time and caches a lookup that fails.
    """
    return set(torch._C._dispatch_get_all_op_names())
