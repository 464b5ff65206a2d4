"""Captured attention maps: the shared type, how qkv's models are recorded, and what is made
from the maps alone (head statistics, files, the explorer page).

Below both :mod:`qkv.hf` (whose recorder builds these maps for transformers models) and
:mod:`qkv.inspect` (which loads models, draws and switches heads off), so that neither
imports the other for the data type:

- :mod:`qkv.capture.maps`: :class:`AttentionMaps` (per layer ``(H, Tq, Tk)`` with tokens),
  :func:`merge_steps`, the token labels both recorders use;
- :mod:`qkv.capture.record`: the recording hooks of :class:`~qkv.MultiHeadAttention`
  (:func:`recording`, :func:`capture`, :func:`capture_steps`) and the layer selection
  (:func:`select_modules`: indices, exact names or globs) that :mod:`qkv.hf` shares;
- :mod:`qkv.capture.stats`: what each head does, in numbers (:func:`head_stats`,
  :func:`pronoun_probe`);
- :mod:`qkv.capture.export`: one head's map as SVG, JSON or CSV (``AttentionMaps.to_*``);
- :mod:`qkv.capture.page`: the explorer as one self-contained page
  (``AttentionMaps._repr_html_``, ``qkv view``), from the front-end's files read as data.

The usual entry point is :mod:`qkv.inspect`, which re-exports these names.
"""

from qkv.capture.maps import AttentionMaps, merge_steps
from qkv.capture.record import (
    Record,
    Recorder,
    attention_modules,
    capture,
    capture_steps,
    recording,
    select_modules,
)
from qkv.capture.stats import HeadStats, ProbeRow, head_scores, head_stats, pronoun_probe

__all__ = [
    "AttentionMaps",
    "HeadStats",
    "ProbeRow",
    "Record",
    "Recorder",
    "attention_modules",
    "capture",
    "capture_steps",
    "head_scores",
    "head_stats",
    "merge_steps",
    "pronoun_probe",
    "recording",
    "select_modules",
]
