"""Hypothesis profiles and the size limits of drawn cases, per device and profile.

Choose a profile with Hypothesis's own ``--hypothesis-profile`` (or ``FLASHVERIFY_PROFILE``; ``dev`` is
the default):

``ci``        derandomized, no example database, bounded: the same examples every run
``dev``       random examples, remembered failures (the local example database)
``thorough``  many more examples and larger shapes, for nightly runs
``gpu``       derandomized, shapes as large as each worker's GPU memory budget holds (Nk up to 8192,
              and decode steps on KV caches of up to 128k keys)

Every profile keeps Hypothesis's health checks on. A case is a handful of drawn scalars (shapes,
flags, a seed) and its tensors are built from the seed inside the property, so drawing stays fast at
any size: HealthCheck.too_slow (with deadline=None: 30 s of drawing over the first 10 examples) fires
only on a generation bug.

What a failure prints is about the kernel: every failure file and failure message carries the case and
its one-line replay command (``python -m verify.replay``), so Hypothesis's ``@reproduce_failure`` blob is
off (``print_blob=False``) and its explain phase, whose "Explanation" lists lines of the suite's own
files, is left out of ``phases``. ``report_multiple_bugs`` stays on: when one test finds several
distinct failures, each gets its own failure file with its own shrunk case (``verify/failures.py``), so
none is hidden behind the first.

On a GPU the size limits below are ceilings: ``verify/gpu.py`` fits them to each worker's memory budget
(under the ``gpu`` profile ``max_scores`` and ``max_len`` come from the budget alone).
"""

from __future__ import annotations

import os

from hypothesis import Phase, settings

from strategies.attention import Limits

# Every phase but explain (see above).
PHASES = tuple(p for p in Phase if p is not Phase.explain)
PROFILES = {
    "ci": dict(derandomize=True, database=None, max_examples=20, deadline=None, print_blob=False, phases=PHASES),
    "dev": dict(max_examples=25, deadline=None, print_blob=False, phases=PHASES),
    "thorough": dict(max_examples=300, deadline=None, print_blob=False, phases=PHASES),
    "gpu": dict(derandomize=True, database=None, max_examples=15, deadline=None, print_blob=False, phases=PHASES),
}
for _name, _kwargs in PROFILES.items():
    settings.register_profile(_name, **_kwargs)
settings.load_profile(os.environ.get("FLASHVERIFY_PROFILE", "dev"))

# On CPU the ``plain`` shape class stays short (40) and the boundary classes (``long``, ``wide_head``,
# ``decode``, the tile classes; strategies/attention.py) reach lengths and head dims past 128, with
# B = H = 1 where the length is long, so what switches on at 64 or 128 keys or head dims is drawn.
_CPU = dict(max_len=136, max_head_dim=136, short_len=40, short_head_dim=40)
LIMITS = {
    ("cpu", "ci"): Limits(**_CPU),
    ("cpu", "dev"): Limits(**_CPU),
    ("cpu", "thorough"): Limits(max_len=256, max_head_dim=256, short_len=96, short_head_dim=72, max_tiles=400),
    ("cpu", "gpu"): Limits(max_len=256, max_head_dim=256, short_len=96, short_head_dim=72, max_tiles=400,
                           max_context=2 ** 17),
    ("cuda", "ci"): Limits(max_len=256, max_head_dim=256, short_len=256, short_head_dim=128, max_tiles=4096),
    ("cuda", "dev"): Limits(max_len=256, max_head_dim=256, short_len=256, short_head_dim=128, max_tiles=4096),
    ("cuda", "thorough"): Limits(max_len=2048, max_head_dim=256, short_len=2048, short_head_dim=256,
                                 max_tiles=2 ** 16, max_scores=2 ** 26),
    # max_scores: the float64 reference and its bound hold about twenty [B, H, Nq, Nk] tensors. Under
    # the gpu profile max_scores and max_len are replaced by what the worker's budget holds
    # (verify/gpu.py: limits_within); the values here are used only where no budget is known.
    # Multi-query attention's large groups (up to 64 query heads on one KV head) under the gpu profile.
    # Decode steps on KV caches of up to 128k keys (the ``long_context`` class), as many as the budget's
    # rows hold.
    # The compile-time choices (tiles, head-dim classes, causal, the variants switched on, layout) from a pool
    # of 24 configurations shared by every property of a kernel and dtype (strategies/compile_pool.py): a
    # Triton kernel compiled for one example serves many, where compiling was most of a GPU run's time.
    ("cuda", "gpu"): Limits(max_len=8192, max_head_dim=256, short_len=8192, short_head_dim=256,
                            max_tiles=2 ** 20, max_scores=2 ** 25, max_group=64, max_batch_heads=64,
                            max_context=2 ** 17, compile_pool=24),
}


def profile_name(config) -> str:
    """The Hypothesis profile of this pytest run."""
    return config.getoption("hypothesis_profile", default=None) or os.environ.get("FLASHVERIFY_PROFILE", "dev")


def limits_for(device_type: str, profile: str) -> Limits:
    """The size limits of drawn cases on ``device_type`` (``cpu`` or ``cuda``) under ``profile``."""
    return LIMITS.get((device_type, profile), LIMITS[(device_type, "dev")])
