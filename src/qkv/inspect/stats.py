"""The head statistics (``head_stats``, ``head_scores``, ``pronoun_probe``) live in
:mod:`qkv.capture.stats` (next to the maps they read, so that the notebook page can show
them); this module keeps the old import path.
"""

from qkv.capture.stats import (
    SCORES,
    SPECIAL_TOKENS,
    HeadStats,
    ProbeRow,
    head_scores,
    head_stats,
    is_special,
    normalize_token,
    pronoun_probe,
)

__all__ = [
    "SCORES",
    "SPECIAL_TOKENS",
    "HeadStats",
    "ProbeRow",
    "head_scores",
    "head_stats",
    "is_special",
    "normalize_token",
    "pronoun_probe",
]
