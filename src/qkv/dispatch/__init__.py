"""Which attention path runs, and why: the ``backend=`` choice, made once per call signature.

- :mod:`~qkv.dispatch.case`: what the dispatcher looks at (:class:`Case`, :func:`describe`).
- :mod:`~qkv.dispatch.rules`: the measured rule table of ``backend="auto"`` (its docstring
  holds the tables) and :func:`choose`, :func:`explain_dispatch`.
- :mod:`~qkv.dispatch.cache`: :func:`decide`, the decision remembered per call signature
  with how to run it (the fast paths).
- :mod:`~qkv.dispatch.torch_adapter`: qkv's options as PyTorch SDPA arguments.
"""

from qkv.dispatch.cache import _DECISIONS as _DECISIONS
from qkv.dispatch.cache import OPTIONS as OPTIONS
from qkv.dispatch.cache import _decide as _decide
from qkv.dispatch.cache import decide
from qkv.dispatch.case import Case, describe
from qkv.dispatch.case import _bias_bound as _bias_bound
from qkv.dispatch.case import _logit_bound as _logit_bound
from qkv.dispatch.rules import BACKENDS, Decision, choose, explain_dispatch
from qkv.dispatch.rules import FUSED_AREA as FUSED_AREA
from qkv.dispatch.rules import FUSED_EXTRAS as FUSED_EXTRAS
from qkv.dispatch.rules import FUSED_GRAD_TK as FUSED_GRAD_TK
from qkv.dispatch.rules import FUSED_WINDOW_RATIO as FUSED_WINDOW_RATIO
from qkv.dispatch.rules import HUGE_LOGITS as HUGE_LOGITS
from qkv.dispatch.rules import SMALL_MASKED as SMALL_MASKED
from qkv.dispatch.rules import UNTUNED_DECODE as UNTUNED_DECODE
from qkv.dispatch.rules import UNTUNED_LEVELS as UNTUNED_LEVELS
from qkv.dispatch.rules import UNTUNED_WINDOW_RATIO as UNTUNED_WINDOW_RATIO
from qkv.dispatch.rules import WINDOW_RATIO as WINDOW_RATIO
from qkv.dispatch.rules import WINDOW_RATIO_LOW as WINDOW_RATIO_LOW
from qkv.dispatch.rules import _fused_reason as _fused_reason
from qkv.dispatch.rules import extras_decision as extras_decision
from qkv.dispatch.rules import invalid as invalid
from qkv.dispatch.rules import log_decision as log_decision
from qkv.dispatch.rules import logger as logger
from qkv.dispatch.torch_adapter import torch_sdpa

__all__ = [
    "BACKENDS", "Case", "Decision", "choose", "decide", "describe", "explain_dispatch",
    "torch_sdpa",
]  # fmt: skip
