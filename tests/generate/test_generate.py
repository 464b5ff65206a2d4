"""Greedy and beam search: cache == no cache, beam == exhaustive search, batching invariance."""

import itertools

import pytest
import torch

from qkv.data import Tokenizer
from qkv.dispatch import UNTUNED_DECODE
from qkv.generate import _repeats, beam_search, greedy_search, translate
from qkv.kernels._native import int8_ops, native_level, native_status
from qkv.kernels.int8 import quantize_linears
from qkv.models import Seq2SeqTransformer, TransformerConfig
from qkv.models.incremental import IncrementalDecoder

# Tiny models: extra threads only add synchronisation on this shared 2-core machine.
torch.set_num_threads(1)


def model_(vocab=40, **kw):
    torch.manual_seed(kw.pop("seed", 0))
    cfg = TransformerConfig(
        src_vocab_size=vocab, tgt_vocab_size=vocab, d_model=32, n_heads=4, d_ff=64,
        **{"dropout": 0.0, **kw},
    )  # fmt: skip
    return Seq2SeqTransformer(cfg).eval()


SRC = torch.tensor([[5, 6, 7, 8, 9, 2], [10, 11, 2, 0, 0, 0], [12, 13, 14, 2, 0, 0]])


@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rope"])
def test_greedy_with_cache_equals_without(positional):
    model = model_(positional=positional, seed=1)
    fast = greedy_search(model, SRC, max_new_tokens=15, ignore_eos=True)
    slow = greedy_search(model, SRC, max_new_tokens=15, ignore_eos=True, use_cache=False)
    assert fast.shape == (3, 15)
    assert torch.equal(fast, slow)


def test_greedy_stops_at_eos_and_pads():
    model = model_(seed=2)
    with torch.no_grad():  # make </s> the most likely token after 3 steps
        model.decoder.out.weight.data[2] *= 0
    out = greedy_search(model, SRC, max_new_tokens=10)
    for row in out.tolist():
        if 2 in row:
            assert all(t == 0 for t in row[row.index(2) + 1 :])


def test_beam_of_one_is_greedy():
    model = model_(seed=3)
    greedy = greedy_search(model, SRC, max_new_tokens=8)
    beam = beam_search(model, SRC, beam_size=1, max_new_tokens=8)
    T = max(greedy.shape[1], beam.shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, T - t.shape[1]))  # noqa: E731
    assert torch.equal(pad(greedy), pad(beam))


def sequence_logprob(model, src, seq):
    """Sum of log p(token) for ``seq`` (ending in </s>) given one source sentence."""
    tgt_in = torch.tensor([[1, *seq[:-1]]])
    logp = model(src, tgt_in).log_softmax(-1)[0]
    return float(sum(logp[i, t] for i, t in enumerate(seq)).detach())


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_wide_beam_equals_exhaustive_search(alpha):
    V, L = 5, 3
    model = model_(vocab=V, seed=4)
    src = torch.tensor([[3, 4, 2]])
    best, best_seq = float("-inf"), None
    for n in range(1, L + 1):  # every sequence: n-1 non-</s> tokens, then </s>
        for prefix in itertools.product([t for t in range(V) if t != 2], repeat=n - 1):
            seq = [*prefix, 2]
            score = sequence_logprob(model, src, seq) / n**alpha
            if score > best:
                best, best_seq = score, seq
    out = beam_search(model, src, beam_size=V**L, length_penalty=alpha, max_new_tokens=L)
    got = out[0].tolist()
    got = got[: got.index(2) + 1]
    assert got == best_seq


def test_batched_translation_equals_one_by_one():
    tok = Tokenizer.train(["a dog runs", "the boy trains the puppy"] * 10, vocab_size=280)
    model = model_(vocab=tok.vocab_size, seed=5)
    sentences = ["a dog", "the boy trains the puppy today", "runs", "a puppy runs"]
    for beam in (1, 3):
        batched = translate(model, tok, sentences, beam_size=beam, max_tokens=10_000)
        single = [translate(model, tok, [s], beam_size=beam)[0] for s in sentences]
        assert batched == single


def test_translate_runs_in_eval_mode_and_gives_the_training_mode_back():
    tok = Tokenizer.train(["a dog runs", "the boy trains the puppy"] * 10, vocab_size=280)
    model = model_(vocab=tok.vocab_size, seed=5, dropout=0.5)
    sentences = ["a dog", "the boy trains the puppy today"]
    expected = translate(model, tok, sentences)  # eval mode: no dropout
    model.train()
    for beam in (1, 3):
        got = translate(model, tok, sentences, beam_size=beam)
        assert model.training and all(m.training for m in model.modules())
        if beam == 1:
            assert got == expected  # dropout off while translating
    # mixed modes come back as they were, module by module
    model.eval()
    model.decoder.train()
    modes = [m.training for m in model.modules()]
    assert translate(model, tok, sentences) == expected
    assert [m.training for m in model.modules()] == modes


def test_bad_inputs():
    model = model_()
    with pytest.raises(TypeError, match="integer tensor"):
        greedy_search(model, torch.randn(1, 3))
    with pytest.raises(ValueError, match="beam_size must be >= 1"):
        beam_search(model, SRC, beam_size=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        greedy_search(model, SRC, max_new_tokens=0)
    with pytest.raises(TypeError, match="list of str"):
        translate(model, None, "a single string")


def test_translate_and_evaluate_cli(tmp_path, capsys, monkeypatch):
    import io

    from qkv.apps.cli import main
    from qkv.models import save_pretrained

    tok = Tokenizer.train(["a dog runs", "le chien court"] * 10, vocab_size=280)
    save_pretrained(model_(vocab=tok.vocab_size, seed=6), tmp_path / "m", tokenizer=tok)
    assert main(["translate", "--model", str(tmp_path / "m"), "a dog", "runs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    monkeypatch.setattr("sys.stdin", io.StringIO("a dog\nruns\n"))
    assert main(["translate", "--model", str(tmp_path / "m"), "--beam", "2"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    (tmp_path / "src.txt").write_text("a dog\nruns\n")
    (tmp_path / "ref.txt").write_text("le chien\ncourt\n")
    files = ["--files", str(tmp_path / "src.txt"), str(tmp_path / "ref.txt")]
    assert main(["evaluate", "--model", str(tmp_path / "m"), *files, "--json"]) == 0
    out = capsys.readouterr().out
    assert "BLEU" in out and "chrF" in out and '"sentences": 2' in out


# --- the incremental decoder (the fast path greedy/beam take) --------------------------------

RAGGED = torch.tensor([[5, 6, 7, 8, 9, 2], [10, 11, 2, 0, 0, 0], [12, 13, 14, 2, 0, 0]])


def general_path(model):
    """Force ``model.decode`` with its DecoderCache: an inspection hook the fast path refuses."""
    model.decoder.layers[0].self_attn.head_mask = torch.ones(model.cfg.n_heads)
    return model


@pytest.mark.parametrize(
    "kw",
    [
        dict(positional="sinusoidal"),
        dict(positional="learned", norm_first=False),
        dict(positional="rope", n_kv_heads=2),
        dict(positional="sinusoidal", n_kv_heads=1, activation="gelu"),
    ],
)
def test_incremental_decoder_equals_model_decode(kw):
    from qkv.models.incremental import IncrementalDecoder

    model = model_(seed=7, **kw)
    dec = IncrementalDecoder.for_model(model)
    assert dec is not None
    K, T = 3, 6
    src = RAGGED
    g = torch.Generator().manual_seed(0)
    tgt = torch.randint(3, 40, (src.shape[0] * K, T), generator=g)
    tgt[:, 0] = 1
    with torch.inference_mode():
        mask = model.src_mask(src)
        memory = model.encode(src, mask)
        fast = dec.encode(src, mask)  # the real tokens' vectors; zeros where padding is
        real = mask[:, 0, 0]  # (B, S)
        torch.testing.assert_close(fast[real], memory[real], atol=1e-5, rtol=1e-5)
        assert not real.all() and bool((fast[~real] == 0).all())
        want = model.decode(
            tgt, memory.repeat_interleave(K, 0), mask.repeat_interleave(K, 0)
        )  # (B·K, T, V), teacher forcing, no cache
        state = dec.start(memory, mask, beams=K, max_steps=T)
        got = torch.stack([dec.step(state, tgt[:, t]) for t in range(T)], 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positional", ["sinusoidal", "learned", "rope"])
def test_beam_with_cache_equals_without(positional):
    model = model_(positional=positional, seed=8)
    for K in (1, 3):
        fast = beam_search(model, SRC, beam_size=K, max_new_tokens=9)
        slow = beam_search(model, SRC, beam_size=K, max_new_tokens=9, use_cache=False)
        assert torch.equal(fast, slow)


def test_fast_path_equals_general_path_greedy_and_beam():
    fast_model, slow_model = model_(seed=9), general_path(model_(seed=9))
    from qkv.models.incremental import IncrementalDecoder

    assert IncrementalDecoder.for_model(slow_model) is None  # the hook sends it the long way
    for K in (1, 4):
        fast = beam_search(fast_model, RAGGED, beam_size=K, max_new_tokens=12)
        slow = beam_search(slow_model, RAGGED, beam_size=K, max_new_tokens=12)
        assert torch.equal(fast, slow)
    fast = greedy_search(fast_model, RAGGED, max_new_tokens=12)
    assert torch.equal(fast, greedy_search(slow_model, RAGGED, max_new_tokens=12))


def test_prepared_weights_follow_weight_changes():
    from qkv.models.incremental import IncrementalDecoder

    model = model_(seed=10)
    first = IncrementalDecoder.for_model(model)
    assert IncrementalDecoder.for_model(model) is first  # prepared once
    before = greedy_search(model, SRC, max_new_tokens=6, ignore_eos=True)
    with torch.no_grad():
        model.decoder.layers[-1].ffn.w_2.weight.mul_(-3.0)  # in place: a new version
    assert IncrementalDecoder.for_model(model) is not first
    after = greedy_search(model, SRC, max_new_tokens=6, ignore_eos=True)
    assert torch.equal(after, greedy_search(model, SRC, max_new_tokens=6, ignore_eos=True,
                                            use_cache=False))  # fmt: skip
    assert not torch.equal(before, after)


def test_min_new_tokens_blocks_eos():
    for seed in range(100):  # a random model that ends some sentence within 4 tokens
        model = model_(seed=seed)
        free = greedy_search(model, SRC, max_new_tokens=4)
        if (free == 2).any():
            break
    assert (free == 2).any()
    held = greedy_search(model, SRC, max_new_tokens=10, min_new_tokens=7)
    assert held.shape[1] >= 7 and (held[:, :7] != 2).all()
    ended = [row.index(2) + 1 for row in held.tolist() if 2 in row]
    assert all(n >= 8 for n in ended)
    beam = beam_search(model, SRC, beam_size=3, max_new_tokens=10, min_new_tokens=7)
    assert beam.shape[1] >= 7 and (beam[:, :7] != 2).all()
    fixed = beam_search(model, SRC, beam_size=3, max_new_tokens=7, min_new_tokens=7)
    assert fixed.shape == (3, 7) and (fixed != 2).all()
    with pytest.raises(ValueError, match="min_new_tokens"):
        greedy_search(model, SRC, min_new_tokens=-1)


def test_bf16_cache_stays_close_to_fp32():
    from qkv.models.incremental import IncrementalDecoder

    model = model_(seed=11)
    dec = IncrementalDecoder.for_model(model)
    tok = torch.tensor([1, 1, 1])
    with torch.inference_mode():
        mask = model.src_mask(SRC)
        memory = dec.encode(SRC, mask)
        states = [dec.start(memory, mask, max_steps=5, cache_dtype=dt)
                  for dt in (None, torch.bfloat16)]  # fmt: skip
        for t in range(5):
            a, b = (dec.step(s, tok + t) for s in states)
    assert states[1].caches[0].keys.dtype == torch.bfloat16
    # keys/values rounded to bf16 (relative error 2^-8) move the logits by about that much
    err = (a - b).abs().max() / a.abs().max()
    assert 0 < err < 2e-2
    out = greedy_search(model, SRC, max_new_tokens=5, cache_dtype=torch.bfloat16)
    assert out.shape[0] == 3 and out.dtype == torch.long


def test_a_source_with_no_visible_token_decodes_like_the_reference():
    model = model_(seed=12)
    src = torch.tensor([[5, 6, 2], [0, 0, 0]])  # the second sentence is all padding
    for K in (1, 2):
        fast = beam_search(model, src, beam_size=K, max_new_tokens=5)
        assert torch.equal(fast, beam_search(model, src, beam_size=K, max_new_tokens=5,
                                             use_cache=False))  # fmt: skip


def test_prepared_weights_stay_off_the_model():
    import copy
    import gc
    import pickle
    import weakref

    model = model_(seed=13)
    beam_search(model, SRC, beam_size=2, max_new_tokens=3)  # prepares (packed weights, M > 1)
    clone = copy.deepcopy(model)  # nothing opaque on the model
    assert torch.equal(beam_search(clone, SRC, beam_size=2, max_new_tokens=3),
                       beam_search(model, SRC, beam_size=2, max_new_tokens=3))  # fmt: skip
    pickle.dumps(model)
    ref = weakref.ref(model)
    del model, clone
    gc.collect()
    assert ref() is None  # the prepared copy does not keep the model alive


@pytest.mark.parametrize("fast", [True, False])
def test_greedy_drops_finished_sentences_and_still_equals_uncached(fast):
    """With the cache, a sentence that ended leaves the batch (later steps run only the rest):
    the tokens equal uncached decoding, for sentences ending at different steps (by </s> and
    by their length limits), on the prepared decoder and on the general path."""
    src = torch.tensor([[5, 6, 7, 8, 9, 2], [10, 11, 2, 0, 0, 0], [12, 13, 14, 2, 0, 0],
                        [7, 2, 0, 0, 0, 0], [9, 8, 7, 6, 5, 2]])  # fmt: skip
    ended_at = set()
    for seed in range(4):
        model = model_(seed=seed)
        with torch.no_grad():  # </s> likely enough to end some sentences early
            model.decoder.embed.embedding.weight.data[2] *= 1.5 + seed
        if not fast:  # an inspection switch sends decoding down the general path
            model.decoder.layers[0].self_attn.head_mask = torch.ones(model.cfg.n_heads)
        assert (IncrementalDecoder.for_model(model) is not None) == fast
        cached = greedy_search(model, src)
        assert torch.equal(cached, greedy_search(model, src, use_cache=False))
        ended_at |= set(((cached != 0).sum(1)).tolist())
    assert len(ended_at) >= 3  # sentences did finish at different steps


@pytest.mark.parametrize("fast", [True, False])
def test_beam_drops_finished_sentences_and_still_equals_uncached(fast, monkeypatch):
    """Beam search: a sentence whose search ended leaves the batch (its beams are no longer
    computed); the result equals uncached decoding and each sentence searched alone."""
    src = torch.tensor([[5, 6, 7, 8, 9, 2], [10, 11, 2, 0, 0, 0], [12, 13, 14, 2, 0, 0],
                        [7, 2, 0, 0, 0, 0], [9, 8, 7, 6, 5, 2]])  # fmt: skip
    rows_per_step = []
    step = IncrementalDecoder.step
    monkeypatch.setattr(IncrementalDecoder, "step",
                        lambda self, state, tokens: rows_per_step.append(len(tokens))
                        or step(self, state, tokens))  # fmt: skip
    shrank = 0
    for seed in range(4):
        model = model_(seed=seed)
        with torch.no_grad():  # </s> likely enough to end some sentences early
            model.decoder.embed.embedding.weight.data[2] *= 1.5 + seed
        if not fast:
            model.decoder.layers[0].self_attn.head_mask = torch.ones(model.cfg.n_heads)
        rows_per_step.clear()
        cached = beam_search(model, src, beam_size=3, max_new_tokens=14)
        if fast:
            shrank += len(set(rows_per_step[1:])) > 1  # fewer rows once sentences finished
        assert torch.equal(cached, beam_search(model, src, beam_size=3, max_new_tokens=14,
                                               use_cache=False))  # fmt: skip
        for b in range(src.shape[0]):
            one = beam_search(model, src[b : b + 1], beam_size=3, max_new_tokens=14)
            n = one.shape[1]
            assert torch.equal(cached[b, :n], one[0]) and bool((cached[b, n:] == 0).all())
    assert not fast or shrank >= 2


def test_repeated_searches_reuse_the_cache_memory():
    """The prepared decoder keeps its caches' buffers between calls (no memory handed back to
    the OS and faulted in again): later searches take them, of other batch sizes and beam
    widths too, and give the same tokens as a search on fresh memory."""
    model = model_(seed=5)
    expected = {K: beam_search(model, RAGGED, beam_size=K, max_new_tokens=12) for K in (1, 4)}
    greedy = greedy_search(model, SRC, max_new_tokens=9)
    pool = IncrementalDecoder.for_model(model).pool
    held = pool.nbytes
    assert held > 0
    for _ in range(2):
        for K in (4, 1):
            assert torch.equal(beam_search(model, RAGGED, beam_size=K, max_new_tokens=12),
                               expected[K])  # fmt: skip
        assert torch.equal(greedy_search(model, SRC, max_new_tokens=9), greedy)
    assert pool.nbytes == held  # nothing new was needed: the same buffers went round


def _nonzero_biases(model):
    """Random biases and norm parameters (the model starts with zeros and ones there, which
    a path that dropped a bias or a norm's affine part would pass unnoticed)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _quantized(model):
    """Every linear of ``model`` in int8, or the test skipped where the int8 kernel is not
    compiled (the compiled step and encoder take int8 only from it)."""
    if int8_ops() is None:
        pytest.skip(f"no compiled int8 kernel: {native_status()}")
    return quantize_linears(model)


class _Counted:
    """The fused step, counting its calls (it is a compiled class: not patchable)."""

    def __init__(self, fused):
        self.fused, self.calls = fused, 0

    def step(self, *args):
        self.calls += 1
        return self.fused.step(*args)


def _auto_decodes_fp32() -> bool:
    """Whether "auto" gives fp32 queries to the decode kernel on this kernel level (the
    compiled step always does, rounding them to bf16 over a bf16 cache; torch does not)."""
    level = native_level()
    return level not in UNTUNED_DECODE or torch.float32 in UNTUNED_DECODE[level][1]


@pytest.mark.parametrize(
    "kw",
    [
        dict(positional="sinusoidal", norm_first=False),
        dict(positional="learned", n_kv_heads=2, activation="gelu"),
        dict(positional="sinusoidal", n_kv_heads=1, activation="relu"),
    ],
)
@pytest.mark.parametrize("cache_dtype", [None, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("int8", [False, True])
def test_fused_step_equals_the_python_loop(kw, cache_dtype, K, int8):
    """The compiled decoder step (one call per step) gives the logits of the Python loop it
    replaces, step by step: one row per sentence, then (K > 1) beams expanded and reordered
    through the rows table, and a sentence leaving the batch (the cache rows stay where they
    are). With every linear in int8 (quantize_linears) both run the same int8 kernel."""
    model = _nonzero_biases(model_(seed=12, **kw))
    if int8:
        model = _quantized(model)
    dec = IncrementalDecoder.for_model(model)
    assert dec is not None and dec.fused is not None
    counted = _Counted(dec.fused)
    T = 7
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        mask = model.src_mask(RAGGED)
        memory = dec.encode(RAGGED, mask)
        states = [dec.start(memory, mask, beams=1, max_steps=T, cache_dtype=cache_dtype)
                  for _ in range(2)]  # fmt: skip
        tokens = torch.randint(3, 40, (RAGGED.shape[0],), generator=g)
        for t in range(T):
            if t == 1 and K > 1:
                for s in states:
                    s.expand(K)
                tokens = tokens.repeat_interleave(K)
            if t >= 2 and K > 1:  # follow random beams of each sentence
                n = tokens.shape[0] // K
                rows = (torch.arange(n)[:, None] * K + torch.randint(0, K, (n, K), generator=g))
                for s in states:
                    s.reorder(rows.view(-1))
            if t == 4:  # the middle sentence finished
                keep = torch.tensor([0, 2])
                for s in states:
                    s.keep(keep)
                tokens = tokens.view(-1, K)[keep].reshape(-1)
            logits = []
            for s, fused in zip(states, (counted, None)):
                dec.fused = fused
                logits.append(dec.step(s, tokens))
            # a bf16 cache rounds keys and values whose fp32 values differ in the last bit
            # (the norms' summation order) to neighbouring bf16 values (2^-8 apart)
            tol = 1e-5 if cache_dtype is None else 1e-3
            # on levels where auto gives fp32 queries to torch, the Python loop does not round
            # them to bf16 over a bf16 cache as the compiled step's decode kernel does
            paths_differ = cache_dtype == torch.bfloat16 and not _auto_decodes_fp32()
            if paths_differ:
                tol = 1e-2
            if not int8 and cache_dtype != torch.int8:
                torch.testing.assert_close(logits[0], logits[1], atol=tol, rtol=tol)
            else:  # such a difference in a linear's input, or in a key or value stored as
                # int8 rows, can move it to the next int8 level (1/255 of the row's range): a
                # hypothesis' logits then differ by up to a few 1e-3 (logits ~ N(0, 1) here);
                # all others stay within fp32 rounding
                diff = (logits[0] - logits[1]).abs()
                median = 1e-2 if paths_differ else 1e-5
                assert float(diff.max()) < 0.05 and float(diff.median()) < median, diff
            tokens = torch.randint(3, 40, tokens.shape, generator=g)
    assert counted.calls == T  # every step
    dec.fused = counted.fused


def test_fused_step_is_not_used_where_it_does_not_apply():
    assert IncrementalDecoder.for_model(model_(positional="rope")).fused is None
    model = model_()
    for layer in model.decoder.layers:
        layer.self_attn.backend = "torch"
    assert IncrementalDecoder.for_model(model).fused is None


@pytest.mark.parametrize(
    "kw",
    [
        dict(positional="sinusoidal", norm_first=False),
        dict(positional="learned", n_kv_heads=2, activation="gelu"),
        dict(positional="sinusoidal", n_kv_heads=1, activation="relu"),
    ],
)
@pytest.mark.parametrize("S", [6, 23])  # the decode kernel (<= 16 queries), PyTorch's SDPA
@pytest.mark.parametrize("int8", [False, True])
def test_fused_encoder_equals_model_encode(kw, S, int8):
    """The encoder in one compiled call gives model.encode's vectors at the real tokens and
    zeros at padding (also with every linear in int8); a source with no visible token and
    bad ids take the Python layers."""
    model = _nonzero_biases(model_(seed=13, **kw))
    if int8:
        model = _quantized(model)
    dec = IncrementalDecoder.for_model(model)
    assert dec is not None and dec.fused_encoder is not None
    g = torch.Generator().manual_seed(S)
    src = torch.randint(3, 40, (3, S), generator=g)
    src[1, S // 2 :] = 0  # padding
    src[2, 1:] = 0
    with torch.inference_mode():
        mask = model.src_mask(src)
        got = dec._encode_fused(src, mask)
        assert got is not None
        real = mask[:, 0, 0]
        torch.testing.assert_close(got[real], model.encode(src, mask)[real], atol=1e-5,
                                   rtol=1e-5)  # fmt: skip
        assert bool((got[~real] == 0).all())
        assert torch.equal(dec.encode(src, mask), got)
        empty = src.clone()
        empty[0] = 0  # nothing visible in sentence 0
        assert dec._encode_fused(empty, model.src_mask(empty)) is None
        with pytest.raises(ValueError, match="ids must lie in"):
            dec.encode(src + 100, mask)


def _has_repeat(seq: list[int], n: int) -> bool:
    seq = [t for t in seq if t not in (0, 2)]  # what was written, up to </s>
    grams = [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)]
    return len(grams) != len(set(grams))


def test_repeats_names_the_token_after_each_earlier_occurrence():
    hist = torch.tensor([[5, 6, 7, 5, 6], [5, 6, 7, 8, 9], [4, 4, 4, 4, 4]])
    rows, toks = _repeats(hist, 3)  # last 2 tokens (5, 6) came before, then 7; (4, 4): then 4
    assert sorted(zip(rows.tolist(), toks.tolist())) == [(0, 7), (2, 4), (2, 4), (2, 4)]
    assert _repeats(hist[1:2], 3) is None and _repeats(hist[:, :2], 3) is None
    rows, toks = _repeats(hist, 2)  # last token 6 came before, then 7; 4: then 4 (four times)
    assert sorted(zip(rows.tolist(), toks.tolist())) == [(0, 7)] + [(2, 4)] * 4
    with pytest.raises(ValueError, match="no_repeat_ngram"):
        greedy_search(model_(), SRC, no_repeat_ngram=1)


@pytest.mark.parametrize("n", [2, 3])
def test_no_repeated_ngram_greedy_and_beam_cached_or_not(n):
    """A random model loops; with the guard no output repeats an n-gram, the cached paths
    equal the uncached ones, and a beam of one is greedy."""
    model = model_(seed=5)
    plain = greedy_search(model, RAGGED, max_new_tokens=30)
    assert any(_has_repeat(r, n) for r in plain.tolist())  # it does loop without the guard
    for K in (1, 3):
        fast = beam_search(model, RAGGED, beam_size=K, max_new_tokens=30, no_repeat_ngram=n)
        slow = beam_search(model, RAGGED, beam_size=K, max_new_tokens=30, no_repeat_ngram=n,
                           use_cache=False)  # fmt: skip
        assert torch.equal(fast, slow)
        assert not any(_has_repeat(r, n) for r in fast.tolist())
    greedy = greedy_search(model, RAGGED, max_new_tokens=30, no_repeat_ngram=n)
    assert torch.equal(greedy, greedy_search(model, RAGGED, max_new_tokens=30,
                                             no_repeat_ngram=n, use_cache=False))  # fmt: skip
    assert not any(_has_repeat(r, n) for r in greedy.tolist())
    beam1 = beam_search(model, RAGGED, beam_size=1, max_new_tokens=30, no_repeat_ngram=n)
    T = max(greedy.shape[1], beam1.shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, T - t.shape[1]))  # noqa: E731
    assert torch.equal(pad(greedy), pad(beam1))


def test_the_guard_keeps_the_models_log_probabilities():
    """Beam search with the guard scores its hypotheses as the model does (no renormalising
    over the tokens left): each kept hypothesis' score is its log-probability / length^alpha."""
    model = model_(seed=6)
    src = SRC[:1]
    ids, scores = beam_search(model, src, beam_size=4, max_new_tokens=12, no_repeat_ngram=2,
                              n_best=4, length_penalty=1.0)  # fmt: skip
    for seq, sc in zip(ids[0].tolist(), scores[0].tolist()):
        if sc == float("-inf"):
            continue
        seq = seq[: seq.index(2) + 1]
        assert not _has_repeat(seq, 2)
        assert sc == pytest.approx(sequence_logprob(model, src, seq) / len(seq), abs=1e-4)
