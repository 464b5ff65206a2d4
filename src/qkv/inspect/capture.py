"""The recording of qkv's attention modules (``capture``, ``capture_steps``, ``recording``)
lives in :mod:`qkv.capture.record` (below both :mod:`qkv.hf` and :mod:`qkv.inspect`, which
use it); this module keeps the old import path.
"""

from qkv.capture.record import (
    Heads,
    Record,
    Recorder,
    attention_modules,
    capture,
    capture_steps,
    recording,
    select_modules,
)

__all__ = [
    "Heads",
    "Record",
    "Recorder",
    "attention_modules",
    "capture",
    "capture_steps",
    "recording",
    "select_modules",
]
