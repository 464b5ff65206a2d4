"""See inside attention: capture maps, score heads, switch heads off, draw and browse them.

>>> from qkv.inspect import capture, head_stats            # doctest: +SKIP
>>> maps = capture(model, ids, tokens=tokens)  # layer × head × Tq × Tk  # doctest: +SKIP
>>> head_stats(maps)[0].prev  # previous-token score  # doctest: +SKIP

Pictures (``qkv.inspect.plot``, matplotlib) and the HTML viewer (``qkv.inspect.html``) are
imported on first use. The maps, their recording, statistics and files live one layer down,
in :mod:`qkv.capture` (shared with :mod:`qkv.hf`); they are re-exported here.
"""

from qkv.capture.maps import AttentionMaps, merge_steps
from qkv.capture.record import attention_modules, capture, capture_steps, recording
from qkv.capture.stats import HeadStats, ProbeRow, head_scores, head_stats, pronoun_probe
from qkv.inspect.ablate import AblationResult, ablate, ablation_scan, heads_off

__all__ = [
    "AblationResult",
    "AttentionMaps",
    "HeadStats",
    "ProbeRow",
    "ablate",
    "ablation_scan",
    "attention_modules",
    "capture",
    "capture_steps",
    "head_scores",
    "head_stats",
    "heads_off",
    "merge_steps",
    "pronoun_probe",
    "recording",
]
