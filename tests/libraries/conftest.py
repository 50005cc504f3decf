"""tests/libraries: prime_ops' CUDA call sites driven into the real kernel libraries' host code
on a machine without a GPU (CUDA fake tensors, no launch). They run in .venv-libs, made by
scripts/test_libraries.sh with the real ``[all]`` extras beside the CPU torch; elsewhere each
module skips and says so. The report header names the library versions the run checked."""

import importlib.metadata

DISTRIBUTIONS = ("flash-attn-4", "quack-kernels", "nvidia-cutlass-dsl", "torch")


def pytest_report_header(config):
    found = []
    for name in DISTRIBUTIONS:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} (not installed)")
    return "libraries: " + ", ".join(found)
