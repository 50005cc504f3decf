"""prime-rl's ``[trainer.model.ac]`` tables as its configs and examples write them, with where
each came from, and the keys of prime-rl's newest ``ActivationCheckpointConfig``.

Read from PrimeIntellect-ai/prime-rl with tomllib (every ``*.toml``, every ``model.ac`` table)
at commit 559b44772 (2026-08-21, the tree prime-rl's switch was tried on), plus the tables
prime-rl's newer SFT recipe scripts generate and its older docs show. ``expect`` is what
ACConfig.from_dict must do with each: the fields it loads as, or a pattern of its error.
"""

from __future__ import annotations

TREE = "PrimeIntellect-ai/prime-rl@559b44772"

# src/prime_rl/configs/trainer.py, the newest version (the one defining ActivationCheckpointMode):
# BaseConfig forbids other keys, so preserve_rng_state is refused there.
NEWEST_KEYS = ("mode", "freq", "targets", "layer_modes", "recompute_engram")
NEWEST_MODES = ("full_moe", "full", "projections", "attention", "matmul", "selective")

TABLES: list[dict] = [
    {
        "table": {"freq": 1},
        "sources": [
            f"{TREE}:{path}"
            for path in (
                "configs/basic/alphabet-sort/rl.toml",
                "examples/advanced/glm-5.2/swe-llmd.toml",
                "examples/advanced/glm-5.2/swe.toml",
                "examples/advanced/intellect-3.1/rl.toml",
                "examples/advanced/minimax-m2.5/swe.toml",
                "examples/advanced/qwen3-30b-a3b/math.toml",
                "examples/advanced/qwen3-30b-a3b/swe.toml",
                "examples/advanced/qwen3-30b-a3b/tool.toml",
                "examples/basic/alphabet-sort/rl.toml",
                "examples/vlm_sft/sft.toml",  # [model.ac]
            )
        ],
        "expect": {"mode": "full", "freq": 1, "targets": None, "layer_modes": None},
    },
    {
        "table": {},
        "sources": [
            f"{TREE}:{path}"
            for path in (
                "configs/debug/concurrency.toml",
                "examples/advanced/glm-4.5-air/search.toml",
                "examples/advanced/glm-4.5-air/swe.toml",
                "examples/advanced/glm-4.5-air/terminal.toml",
                "examples/advanced/nemotron-3-super/swe.toml",
            )
        ],
        "expect": {"mode": "full", "freq": 1, "targets": None, "layer_modes": None},
    },
    {
        # the newest class loads it and reads targets only in "selective": ignored
        "table": {"mode": "full", "freq": 1, "targets": ["norm"]},
        "sources": ["prime-rl's Qwen3.5 VLM SFT recipe scripts ([model.ac], five in the index)"],
        "expect": {"mode": "full", "freq": 1, "targets": None, "layer_modes": None},
    },
    {
        # an older release's module targets where they are read: the newest class would match
        # no operator with them and keep only the mandatory set
        "table": {"mode": "selective", "targets": ["norm", "attn_proj", "linear_attn"]},
        "sources": [f"{TREE}:examples/vlm_sft_moe/sft.toml"],
        "expect": "parts of each layer",
    },
    {
        "table": {"mode": "selective", "targets": ["norm"], "freq": 1},
        "sources": ["prime-rl's docs of the release with module targets (docs/.../ac.md)"],
        "expect": "parts of each layer",
    },
    {
        # the newest class's layer_modes replace mode and freq: freq is ignored there
        "table": {"mode": "selective", "freq": 2, "layer_modes": ["full", "none", "matmul"]},
        "sources": ["src/prime_rl/configs/trainer.py (newest): layer_modes' docstring"],
        "expect": {"mode": "selective", "freq": 1, "layer_modes": ("full", "none", "matmul")},
    },
    {
        "table": {"mode": "full", "preserve_rng_state": False},
        "sources": ["docs/migration.md before this round (prime-rl's newest class forbids it)"],
        "expect": {"mode": "full", "preserve_rng_state": False},
    },
]
