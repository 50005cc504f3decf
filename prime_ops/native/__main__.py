"""``python -m prime_ops.native``: build the native kernels (see :mod:`prime_ops.native.build`)."""

from prime_ops.native.build import main

main()
