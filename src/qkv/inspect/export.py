"""One head's map as SVG, JSON or CSV (``head_map``, ``to_svg``, ``to_json``, ``to_csv``) lives
in :mod:`qkv.capture.export` (next to the maps, for ``AttentionMaps.to_*``); this module keeps
the old import path.
"""

from qkv.capture.export import (
    FORMAT,
    MAX_EXPORT_TOKENS,
    PICTURE_MAX_SIDE,
    ExportTooLarge,
    HeadMap,
    head_map,
    to_csv,
    to_json,
    to_svg,
    xml_text,
)

__all__ = [
    "FORMAT",
    "MAX_EXPORT_TOKENS",
    "PICTURE_MAX_SIDE",
    "ExportTooLarge",
    "HeadMap",
    "head_map",
    "to_csv",
    "to_json",
    "to_svg",
    "xml_text",
]
