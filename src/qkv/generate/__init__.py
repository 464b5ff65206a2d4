"""Decoding: greedy and beam search for :class:`~qkv.models.Seq2SeqTransformer` (batched), and
:func:`generate` to continue prompts of a :class:`~qkv.models.CausalLM`.

Both encode the source (or fill the prompt's caches) once and decode incrementally, one token
per sentence (and beam) per step, on a prepared decoder where it runs the model
(:class:`~qkv.models.incremental.IncrementalDecoder`,
:class:`~qkv.models.lm_decoder.LMDecoder`). ``use_cache=False`` recomputes the whole prefix
every step: the slow reference that the cached paths must equal, token for token.

Which file holds what:

* ``greedy.py``: :func:`greedy_search`, the most likely token at every step;
* ``beam.py``: :func:`beam_search`, ``beam_size`` hypotheses per sentence, ``n_best``;
* ``text.py``: :func:`translate`, sentences in, sentences out (batched by length);
* ``lm.py``: :func:`generate`, a causal LM's continuation, greedy or sampled;
* ``_steps.py``: the next-token logits step by step that greedy and beam search share;
* ``_ngram.py``: the ``no_repeat_ngram`` guard (banned tokens, beam candidates without them);
* ``_repeat.py``: :class:`RepeatGuard`, no pattern written three times in a row ("gigigi");
* ``_common.py``: argument checks, length limits, eval mode for a call, the argmax.

Shapes: ``src (B, S)`` → generated ids ``(B, T)`` (after ``<s>``; ``</s>`` then ``<pad>``).
"""

# _repeats (imported by the tests) and IncrementalDecoder (bench/int8_translate.py) stay
# reachable here, as they were from generate.py
from qkv.generate._ngram import _repeats as _repeats
from qkv.generate._repeat import RepeatGuard
from qkv.generate.beam import beam_search
from qkv.generate.greedy import greedy_search
from qkv.generate.lm import generate
from qkv.generate.text import translate
from qkv.models.incremental import IncrementalDecoder as IncrementalDecoder

__all__ = ["greedy_search", "beam_search", "translate", "generate", "RepeatGuard"]
