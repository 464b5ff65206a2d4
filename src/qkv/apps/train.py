"""Train a :class:`~qkv.models.Seq2SeqTransformer` for translation: ``qkv train``.

Label-smoothed cross-entropy, AdamW with linear warmup then inverse-square-root decay,
token-bucketed batches, gradient clipping, deterministic seeds. Every ``--checkpoint-minutes``
(and at each epoch end, at ``--max-minutes``, on SIGINT/SIGTERM) the whole state goes to
``OUT/last`` atomically: weights, optimizer, step, data position, RNG. ``--resume OUT``
continues exactly. The best model by validation BLEU is kept in ``OUT/best``.

A directory that already holds a run is never trained into by accident: ``--out`` there is
refused unless ``--overwrite`` (start over: the old run is deleted once the new one is
validated and starts writing) or ``--resume`` (continue it, into the same directory, with
the model, data and training options it was started with: a resume that gives another
value for one of them is refused, never ignored). A ``trainer.pt`` or ``model.safetensors``
that cannot be read is a :class:`~qkv.loading.ModelLoadError` naming the file.

    qkv train --out /work/runs/enfr --max-minutes 55
    torchrun --nproc_per_node 2 -m qkv train --out runs/ddp ...   # data parallel
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from qkv.apps.cli_args import (
    Parser,
    device,
    float_range,
    int_range,
    nonneg_int,
    output_dir,
    positive_int,
    probability,
    threads,
)
from qkv.data import Tokenizer, collate, encode_pairs, epoch_order, make_batches, multi30k
from qkv.data.augment import present_tense_pairs
from qkv.data.corpus import read_parallel
from qkv.data.noise import noise_pairs
from qkv.distributed.ddp import World, all_reduce_sum, init_distributed
from qkv.loading import ModelLoadError, load_safetensors_into
from qkv.models import Seq2SeqTransformer, TransformerConfig, save_pretrained
from qkv.models.io import resolve_dir
from qkv.translate import GENERATION_FILE

__all__ = ["train", "train_step", "lr_at", "evaluate_loss", "add_parser", "parse_args"]

STATE_FILE = "trainer.pt"
# arguments a resumed run may change; everything else comes from the checkpoint
# (and --augment: switching augmentation on later fine-tunes a run on the larger data)
RESUMABLE = ("max_minutes", "max_steps", "epochs", "checkpoint_minutes", "threads", "no_progress",
             "augment")  # fmt: skip
# the options that shape the model (and its vocabulary): fixed for the life of a run. Their
# parser default is None, so that a resume can tell an option given from one left out;
# a new run gets these defaults (_settle).
MODEL_DEFAULTS: dict[str, object] = {
    "vocab_size": 8000, "d_model": 256, "heads": 4, "kv_heads": None, "d_ff": 1024,
    "layers": 3, "enc_layers": None, "dec_layers": None, "dropout": 0.2, "post_ln": False,
    "positional": "sinusoidal",
}  # fmt: skip
# the options of the data, the optimisation and the evaluation: fixed for the life of a run
# too (a resume that gives another value is refused, never ignored); parser default None as
# above, these defaults filled in for a new run (_settle)
RUN_DEFAULTS: dict[str, object] = {
    "data": None, "src": "en", "tgt": "fr", "train_files": None, "val_files": None,
    "train_limit": None, "val_limit": None, "lr": 1e-3, "warmup": 150, "weight_decay": 1e-4,
    "label_smoothing": 0.1, "clip": 1.0, "max_tokens": 3072, "bf16": False, "seed": 1,
    "val_bleu": 300, "final_validate": True, "keep_epochs": 8, "average": 5, "device": None,
}  # fmt: skip
# what a run directory holds (save_pretrained's .old: a save interrupted between renames)
RUN_ENTRIES = ("last", "last.old", "best", "best.old", "log.jsonl", "epochs")


def lr_at(step: int, lr: float, warmup: int) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then ``lr · √(warmup / step)``."""
    step = max(step, 1)
    if step <= warmup:
        return lr * step / max(warmup, 1)
    return lr * math.sqrt(warmup / step)


def train_step(
    model: nn.Module,
    batch,
    optimizer: torch.optim.Optimizer,
    *,
    label_smoothing: float = 0.1,
    clip: float | None = 1.0,
    world: World | None = None,
    bf16: bool = False,
) -> tuple[float, int]:
    """One update. Returns ``(summed loss of this rank, global target tokens)``.

    The loss is summed over tokens and divided by the global token count (× world size, as
    DDP averages over ranks), so N ranks equal one process with the union of their batches.
    ``bf16``: autocast the forward pass to bfloat16 (AMX/AVX512-BF16 CPUs, GPUs); the
    weights, optimizer and loss stay float32.
    """
    world = world or World()
    cfg = model.module.cfg if hasattr(model, "module") else model.cfg
    n_local = batch.n_tokens
    n_global = all_reduce_sum(n_local, world)
    device_type = batch.src.device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(batch.src, batch.tgt_in)  # (B, T, V)
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), batch.tgt_out.reshape(-1),
        ignore_index=cfg.pad_id, label_smoothing=label_smoothing, reduction="sum",
    )  # fmt: skip
    optimizer.zero_grad(set_to_none=True)
    (loss_sum * (world.size / max(n_global, 1.0))).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return float(loss_sum.detach()), int(n_global)


@torch.no_grad()
def evaluate_loss(model: nn.Module, examples, batches) -> float:
    """Mean per-token negative log-likelihood (no smoothing) over ``batches``."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for index in batches:
        b = collate(examples, index).to(next(model.parameters()).device)
        logits = model(b.src, b.tgt_in)
        total += float(
            F.cross_entropy(
                logits.flatten(0, 1), b.tgt_out.flatten(), ignore_index=0, reduction="sum"
            )
        )
        n += b.n_tokens
    model.train(was_training)
    return total / max(n, 1)


def bleu_chrf(hyps: list[str], refs: list[str]) -> tuple[float, float]:
    """sacreBLEU (13a tokenisation of detokenised, cased text) and chrF."""
    import sacrebleu

    return sacrebleu.corpus_bleu(hyps, [refs]).score, sacrebleu.corpus_chrf(hyps, [refs]).score


def load_pairs(args, split: str) -> list[tuple[str, str]]:
    files = args.train_files if split == "train" else args.val_files
    if files:
        pairs = read_parallel(*files)
    elif split != "train" and args.train_files and not args.val_files:
        raise ValueError("--train-files needs --val-files too")
    else:
        pairs = multi30k(split, args.src, args.tgt, args.data)
    limit = args.train_limit if split == "train" else args.val_limit
    pairs = pairs[:limit] if limit else pairs
    augment = getattr(args, "augment", "none")
    if split == "train" and augment in ("present", "present+noise"):
        pairs = pairs + present_tense_pairs(pairs)
    if split == "train" and augment in ("noise", "present+noise"):
        pairs = pairs + noise_pairs(pairs, seed=args.seed)
    return pairs


def build_config(args, vocab_size: int) -> TransformerConfig:
    return TransformerConfig(
        src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, d_model=args.d_model,
        n_heads=args.heads, n_kv_heads=args.kv_heads, d_ff=args.d_ff,
        n_encoder_layers=args.enc_layers or args.layers, n_decoder_layers=args.dec_layers or args.layers,
        dropout=args.dropout, norm_first=not args.post_ln, positional=args.positional,
        tie_embeddings=True, share_src_tgt_embeddings=True, max_len=256,
    )  # fmt: skip


def save_epoch(model: nn.Module, directory: Path, epoch: int, *, keep: int) -> Path:
    """Weights at the end of ``epoch`` as ``directory/epoch-NNN.safetensors`` (the last
    ``keep`` are kept): the inputs of checkpoint averaging (:func:`qkv.models.average`)."""
    from safetensors.torch import save_model

    directory.mkdir(parents=True, exist_ok=True)
    target = directory / f"epoch-{epoch:03d}.safetensors"
    tmp = target.with_name(target.name + ".tmp")
    save_model(model, str(tmp))  # handles the tied embeddings
    os.replace(tmp, target)
    for old in sorted(directory.glob("epoch-*.safetensors"))[:-keep]:
        old.unlink()
    return target


def average_epochs(model: nn.Module, files: list[Path]) -> nn.Module:
    """A copy of ``model`` holding the mean of the weights in ``files`` (checkpoint averaging:
    the mean of the last epochs usually translates better than any one of them)."""
    import copy

    from safetensors.torch import load_model

    avg = copy.deepcopy(model)
    total = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in avg.state_dict().items()}
    for f in files:
        load_model(avg, str(f))
        for k, v in avg.state_dict().items():
            total[k] += v.double()
    with torch.no_grad():
        for k, v in avg.state_dict().items():
            v.copy_(total[k] / len(files))
    return avg


# the notes' sentence in each Multi30k language: the summary's example command
EXAMPLE = {"en": "The boy trains the puppy.", "fr": "Le garçon entraîne le chiot.",
           "de": "Der Junge trainiert den Welpen."}  # fmt: skip


def summary(result: dict, out: Path, seconds: float, per_epoch: int, src: str = "en") -> str:
    """What a person wants to read when training ends."""
    why = {"max_minutes": "the time budget ended", "max_steps": "--max-steps reached",
           "epochs": "all epochs done", "signal": "interrupted", "peer": "a peer stopped"}  # fmt: skip
    epochs = result["epoch"] + result["pos"] / max(per_epoch, 1)
    lines = [f"qkv train: done ({why.get(result['stopped'], result['stopped'])}): "
             f"{result['step']} steps, {epochs:.1f} epochs, {seconds / 60:.1f} min"]  # fmt: skip
    b = result["best"]
    if b.get("bleu", -1.0) >= 0:
        at = f"epoch {b['epoch']}" if "epoch" in b else "a validation"
        avg = f", average of the last {b['averaged']} epochs" if b.get("averaged") else ""
        lines.append(f"  best validation BLEU {b['bleu']:.1f} (greedy) at {at}{avg}")
    elif math.isfinite(b.get("val_loss", math.inf)):
        lines.append(f"  best validation loss {b['val_loss']:.3f}")
    else:
        lines.append("  not validated (no epoch ended and --no-final-validate)")
    lines.append(f"  model: {out / 'best'}")
    if result["stopped"] in ("max_minutes", "max_steps", "signal"):
        lines.append(f"  continue: qkv train --resume {out} --max-minutes N")
    example = EXAMPLE.get(src, EXAMPLE["en"])
    lines.append(f'  translate: qkv translate --model {out} "{example}"')
    return "\n".join(lines)


class _Stop:
    """Set by SIGINT/SIGTERM; the loop checkpoints at the next step boundary and exits."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum, frame) -> None:
        if self.requested:  # a second Ctrl-C: leave now (checkpoints are atomic anyway)
            raise KeyboardInterrupt
        self.requested = True


def run_entries(directory: Path) -> list[str]:
    """The entries of a training run found in ``directory`` (empty: no run there)."""
    return [name for name in RUN_ENTRIES if (directory / name).exists()]


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_dirs(args: argparse.Namespace) -> None:
    """``--out``, ``--resume`` and ``--overwrite`` agree, and ``--out`` is no other run:
    checked before anything is read or written."""
    overwrite = bool(getattr(args, "overwrite", False))
    if args.resume:
        if overwrite:
            raise ValueError("--resume continues a run and --overwrite starts a new one: "
                             "give one of them")  # fmt: skip
        if args.out and Path(args.out).resolve() != Path(args.resume).resolve():
            raise ValueError(
                f"--resume {args.resume} writes into the run it continues; --out {args.out} "
                "names another directory (leave --out out)"
            )
        return
    if args.out and not overwrite:
        found = run_entries(Path(args.out))
        if found:
            raise ValueError(
                f"--out {args.out} already holds a training run ({', '.join(found)}): continue "
                f"it with --resume {args.out}, or start over with --overwrite (deletes it)"
            )


def _shown(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return "none" if value is None else str(value)


def _fixed_options(args: argparse.Namespace, saved: dict) -> dict:
    """Check that the model, data and training options given to a resume are the run's: a
    ``ValueError`` names each one that differs (run's value, given value) beside
    ``--resume``. Options left out never differ."""
    effective = {"kv_heads": "heads", "enc_layers": "layers", "dec_layers": "layers"}
    differ = []
    for k, default in {**MODEL_DEFAULTS, **RUN_DEFAULTS}.items():
        given = getattr(args, k, None)
        if given is None:
            continue
        have = saved.get(k, default)
        if have is None and k in effective:  # "default: --heads" (--layers): that value
            have = saved.get(effective[k], MODEL_DEFAULTS[effective[k]])
        if given != have:
            differ.append(f"{_option(k)} (the run has {_shown(have)}, given {_shown(given)})")
    if differ:
        raise ValueError(f"--resume {args.resume}: a run keeps the model, data and training "
                         f"options it was started with; these options differ: "
                         f"{'; '.join(differ)} (leave them out to resume, or start a new run "
                         "with another --out)")  # fmt: skip
    return saved


# what trainer.pt holds (train's checkpoint()), each checked before it is used
STATE_FIELDS = {"args": dict, "optimizer": dict, "step": int, "epoch": int, "pos": int,
                "elapsed": (int, float), "best": dict, "rng": torch.Tensor}  # fmt: skip


def read_state(path: Path) -> dict:
    """A run's ``trainer.pt``, read with ``weights_only=True`` (no code runs); a file that
    cannot be read or holds anything else is a :class:`~qkv.loading.ModelLoadError`
    naming it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, random bytes, refused by weights_only
        msg = " ".join(str(e).split())
        raise ModelLoadError(path, f"not a trainer state, truncated or damaged "
                                   f"({type(e).__name__}: {msg[:200]})") from None  # fmt: skip
    if not isinstance(state, dict):
        raise ModelLoadError(path, f"must hold a dict, got {type(state).__name__}")
    for key, kind in STATE_FIELDS.items():
        if key not in state:
            raise ModelLoadError(path, f"missing key {key!r}")
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise ModelLoadError(path, f"{key!r} is a {type(state[key]).__name__}")
    if not all(isinstance(k, str) for k in state["args"]):
        raise ModelLoadError(path, "'args' must map option names to values")
    return state


def _restore(path: Path, what: str, restore) -> None:
    """``restore()``, a part of ``path`` put back into the run; its failure (a state that
    does not fit the model) is a :class:`~qkv.loading.ModelLoadError` naming the file."""
    try:
        restore()
    except (ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
        msg = " ".join(str(e).split())
        raise ModelLoadError(path, f"{what} does not fit the run ({msg[:200]})") from None


def _clear_run(out: Path) -> None:
    """--overwrite: delete the old run's entries (and half-written saves), nothing else
    (other files in the directory are the user's)."""
    for name in RUN_ENTRIES:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def train(args: argparse.Namespace) -> dict:
    """Run training as ``args`` say (see ``qkv train --help``); returns the final metrics."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _check_dirs(args)
    # decided by this command line, never by a checkpoint's saved args (a resumed run that
    # was started with --overwrite must not delete itself)
    overwrite = bool(getattr(args, "overwrite", False)) and not args.resume
    state = None
    if args.resume:
        last = resolve_dir(Path(args.resume) / "last")
        if not (last / STATE_FILE).is_file():
            raise FileNotFoundError(f"nothing to resume: {last / STATE_FILE} is missing")
        state = read_state(last / STATE_FILE)
        saved = _fixed_options(args, dict(state["args"]))
        for k in RESUMABLE:
            if getattr(args, k, None) is not None:
                saved[k] = getattr(args, k)
        saved["resume"], saved["out"], saved["overwrite"] = args.resume, args.resume, False
        args = argparse.Namespace(**saved)
    world = init_distributed()
    stop = _Stop()  # installed early: a Ctrl-C during setup stops at the first step boundary
    if world.is_main:
        previous = signal.signal(signal.SIGINT, stop), signal.signal(signal.SIGTERM, stop)
    if not args.out:
        raise ValueError("--out DIR is required (or --resume DIR)")
    if getattr(args, "augment", "none").startswith("present") and args.src != "en":
        raise ValueError(f"--augment present rewrites English sources; --src is {args.src!r}")
    out = Path(args.out)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    torch.manual_seed(args.seed)

    train_pairs, val_pairs = load_pairs(args, "train"), load_pairs(args, "val")
    if state is not None:
        tokenizer = Tokenizer.load(last / "tokenizer.json")
    else:
        tokenizer = Tokenizer.train(
            [s for p in train_pairs for s in p], vocab_size=args.vocab_size
        )  # deterministic: every rank learns the same vocabulary
    train_ex = encode_pairs(tokenizer, train_pairs)
    val_ex = encode_pairs(tokenizer, val_pairs)
    batches = make_batches(train_ex, args.max_tokens)
    val_batches = make_batches(val_ex, args.max_tokens)

    cfg = build_config(args, tokenizer.vocab_size)
    model = Seq2SeqTransformer(cfg)
    device = torch.device(getattr(args, "device", None) or "cpu")
    if device.type == "cuda" and world.distributed:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", world.rank)))
        torch.cuda.set_device(device)
    step, epoch, pos, elapsed_before = 0, 0, 0, 0.0
    best: dict = {"bleu": -1.0, "val_loss": float("inf")}
    if state is not None:  # a broken file: a ModelLoadError naming it
        load_safetensors_into(model, last / "model.safetensors")
    model.to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9, weight_decay=args.weight_decay
    )
    if state is not None:  # state follows the parameters' device
        _restore(last / STATE_FILE, "the optimizer state",
                 lambda: optimizer.load_state_dict(state["optimizer"]))  # fmt: skip
        step, epoch, pos = state["step"], state["epoch"], state["pos"]
        elapsed_before, best = state["elapsed"], dict(state["best"])
        _restore(last / STATE_FILE, "the random state", lambda: torch.set_rng_state(state["rng"]))
    ddp = model
    if world.distributed:
        ids = [device.index] if device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    model.train()

    def checkpoint() -> None:
        if not world.is_main:
            return
        snapshot = {
            "args": vars(args), "optimizer": optimizer.state_dict(), "step": step,
            "epoch": epoch, "pos": pos, "elapsed": elapsed_before + time.monotonic() - t0,
            "best": best, "rng": torch.get_rng_state(),
        }  # fmt: skip
        extra = {STATE_FILE: lambda p: torch.save(snapshot, p)}
        save_pretrained(model, out / "last", tokenizer=tokenizer, extra=extra)

    def validate(m: nn.Module) -> dict:
        val_loss = evaluate_loss(m, val_ex, val_batches)
        record = {"epoch": epoch, "step": step, "val_loss": round(val_loss, 4)}
        if args.val_bleu:
            from qkv.generate import translate

            n = args.val_bleu if args.val_bleu > 0 else len(val_pairs)
            hyps = translate(m, tokenizer, [s for s, _ in val_pairs[:n]])
            record["val_bleu"], record["val_chrf"] = bleu_chrf(hyps, [t for _, t in val_pairs[:n]])
            record["val_bleu_sentences"] = min(n, len(val_pairs))
            m.train()
        return record

    def save_best(m: nn.Module) -> None:
        gen = {"src": args.src, "tgt": args.tgt, "beam": 1, "length_penalty": 1.0}
        write = lambda p: p.write_text(json.dumps(gen, indent=2) + "\n")  # noqa: E731
        save_pretrained(m, out / "best", tokenizer=tokenizer, extra={GENERATION_FILE: write})

    def keep_if_best(m: nn.Module, record: dict) -> None:
        nonlocal best
        if "val_bleu" in record:
            better = record["val_bleu"] > best["bleu"]
        else:
            better = record["val_loss"] < best["val_loss"]
        if better:
            best = {"bleu": record.get("val_bleu", -1.0), "val_loss": record["val_loss"],
                    "epoch": record["epoch"], "step": record["step"],
                    "averaged": len(record.get("averaged", []))}  # fmt: skip
            save_best(m)

    def log(record: dict) -> None:
        with open(out / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), flush=True)

    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if overwrite:  # everything is validated and built: the old run goes now
            _clear_run(out)
        for stale in out.glob(".*.tmp-*"):  # half-written saves of a killed run
            shutil.rmtree(stale, ignore_errors=True)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"qkv train: {len(train_ex)} pairs, {len(batches)} batches/epoch, "
              f"vocab {tokenizer.vocab_size}, {n_params / 1e6:.2f}M parameters, "
              f"world {world.size}, threads {torch.get_num_threads()}", flush=True)  # fmt: skip
    from tqdm import tqdm

    t0 = time.monotonic()
    last_ckpt = t0
    budget = args.max_minutes * 60 if args.max_minutes else float("inf")
    per_epoch = len(batches) // world.size
    reason = "epochs"
    record: dict = {}
    while epoch < args.epochs:
        order = epoch_order(len(batches), args.seed, epoch)
        bar = tqdm(total=per_epoch, initial=pos, desc=f"epoch {epoch}", dynamic_ncols=True,
                   disable=not world.is_main or bool(args.no_progress), mininterval=2.0)  # fmt: skip
        loss_acc, tok_acc, tok_t0 = 0.0, 0, time.monotonic()
        while pos < per_epoch:
            reason = "signal" if stop.requested else "epochs"
            if args.max_steps and step >= args.max_steps:
                reason = "max_steps"
            elif elapsed_before + time.monotonic() - t0 >= budget:
                reason = "max_minutes"
            halt = reason != "epochs"
            if world.distributed:
                halt = all_reduce_sum(float(halt), world) > 0
                reason = "peer" if halt and reason == "epochs" else reason
            if halt:
                break
            batch = collate(train_ex, batches[order[pos * world.size + world.rank]]).to(device)
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step + 1, args.lr, args.warmup)
            loss, n = train_step(ddp, batch, optimizer, label_smoothing=args.label_smoothing,
                                 clip=args.clip, world=world, bf16=getattr(args, "bf16", False))  # fmt: skip
            step, pos = step + 1, pos + 1
            loss_acc += loss * world.size
            tok_acc += n
            bar.update(1)
            if step % 10 == 0:
                dt = time.monotonic() - tok_t0
                left = budget - (elapsed_before + time.monotonic() - t0)
                bar.set_postfix(loss=f"{loss_acc / max(tok_acc, 1):.3f}", tok_s=f"{tok_acc / dt:.0f}",
                                lr=f"{lr_at(step, args.lr, args.warmup):.1e}",
                                left=f"{left / 60:.1f}m" if left < 1e9 else "-")  # fmt: skip
            if time.monotonic() - last_ckpt >= args.checkpoint_minutes * 60:
                checkpoint()
                last_ckpt = time.monotonic()
        bar.close()
        if pos < per_epoch:  # stopped inside the epoch
            break
        epoch, pos = epoch + 1, 0
        if world.is_main:
            record = validate(model)
            record["train_loss"] = round(loss_acc / max(tok_acc, 1), 4)
            record["elapsed_min"] = round((elapsed_before + time.monotonic() - t0) / 60, 2)
            keep_if_best(model, record)
            log(record)
            if getattr(args, "keep_epochs", 0):
                save_epoch(model, out / "epochs", epoch, keep=args.keep_epochs)
        checkpoint()
        last_ckpt = time.monotonic()
        world.barrier()
    if pos > 0 and reason in ("max_minutes", "max_steps") and world.is_main and args.final_validate:
        record = validate(model)  # the budget ended mid-epoch: the model may beat the last best
        record["elapsed_min"] = round((elapsed_before + time.monotonic() - t0) / 60, 2)
        keep_if_best(model, record)
        log({**record, "final": True})
    if pos > 0 or reason != "epochs":
        checkpoint()
    n_avg = getattr(args, "average", 0)
    snapshots = sorted((out / "epochs").glob("epoch-*.safetensors"))[-n_avg:] if n_avg > 1 else []
    if world.is_main and len(snapshots) > 1 and reason != "signal":
        averaged = average_epochs(model, snapshots)
        record = {**validate(averaged), "averaged": [p.stem for p in snapshots]}
        keep_if_best(averaged, record)
        log(record)
    if world.is_main and not (out / "best").exists():
        save_best(model)
    world.barrier()
    result = {**record, "step": step, "epoch": epoch, "pos": pos, "stopped": reason, "best": best}
    if world.is_main:
        seconds = elapsed_before + time.monotonic() - t0
        print(summary(result, out, seconds, per_epoch, args.src), flush=True)
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
    return result


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train an encoder-decoder translation model (Multi30k)",
        description="Train a translation model. The defaults are the recipe of the models "
        "qkv ships; --max-minutes sets the budget.",
    )
    d = p.add_argument_group("data", "fixed for the life of a run, but --augment")
    d.add_argument("--data", help="Multi30k directory (default: $QKV_DATA, else "
                   "../shared/data/multi30k, else ~/.cache/qkv/multi30k from `qkv data fetch`)")  # fmt: skip
    run_dflt = lambda k: f"(default: {RUN_DEFAULTS[k]})"  # noqa: E731
    d.add_argument("--src", help=f"source language {run_dflt('src')}")
    d.add_argument("--tgt", help=f"target language {run_dflt('tgt')}")
    d.add_argument("--train-files", nargs=2, metavar=("SRC", "TGT"), help="plain parallel text")
    d.add_argument("--val-files", nargs=2, metavar=("SRC", "TGT"), help="plain parallel text")
    d.add_argument("--train-limit", type=positive_int,
                   help="use only the first N training pairs (default: all)")  # fmt: skip
    d.add_argument("--val-limit", type=positive_int, help="use only the first N validation pairs")
    d.add_argument("--augment", choices=["none", "present", "noise", "present+noise"],
                   default=None,
                   help="present: add English sources rewritten from 'is/are Ving' to the simple "
                   "present (targets kept; English sources only); noise: add pairs joined two "
                   "by two and sources with a typo or in lower case (qkv.data.noise; targets "
                   "kept) (default: none)")  # fmt: skip
    # model options: default None (a resume tells given from left out), filled by _settle
    dflt = lambda k: f"(default: {MODEL_DEFAULTS[k]})"  # noqa: E731
    d.add_argument("--vocab-size", type=int_range(260, 1_000_000),
                   help=f"joint BPE vocabulary {dflt('vocab_size')}")  # fmt: skip
    m = p.add_argument_group("model", "fixed for the life of a run: --resume takes them from "
                             "the run (giving another value is an error)")  # fmt: skip
    m.add_argument("--d-model", type=int_range(2, 65536), help=f"width {dflt('d_model')}")
    m.add_argument("--heads", type=int_range(1, 1024), help=f"attention heads {dflt('heads')}")
    m.add_argument("--kv-heads", type=int_range(1, 1024), help="key/value heads (default: --heads)")
    m.add_argument("--d-ff", type=int_range(1, 1 << 20),
                   help=f"feed-forward width {dflt('d_ff')}")  # fmt: skip
    m.add_argument("--layers", type=int_range(1, 256),
                   help=f"encoder and decoder layers {dflt('layers')}")  # fmt: skip
    m.add_argument(
        "--enc-layers", type=int_range(1, 256), help="encoder layers (default: --layers)"
    )
    m.add_argument(
        "--dec-layers", type=int_range(1, 256), help="decoder layers (default: --layers)"
    )
    m.add_argument("--dropout", type=probability, help=f"dropout everywhere {dflt('dropout')}")
    m.add_argument("--post-ln", action="store_true", default=None,
                   help="post-LN (paper) instead of pre-LN")  # fmt: skip
    m.add_argument("--positional", choices=["sinusoidal", "learned", "rope"],
                   help=f"positions {dflt('positional')}")  # fmt: skip
    o = p.add_argument_group("optimisation", "fixed for the life of a run too")
    o.add_argument("--lr", type=float_range(0.0, 10.0, lo_open=True),
                   help=f"peak learning rate {run_dflt('lr')}")  # fmt: skip
    o.add_argument("--warmup", type=nonneg_int, help=f"warmup steps {run_dflt('warmup')}")
    o.add_argument("--weight-decay", type=float_range(0.0, 10.0),
                   help=f"AdamW weight decay {run_dflt('weight_decay')}")  # fmt: skip
    o.add_argument("--label-smoothing", type=probability,
                   help=f"label smoothing {run_dflt('label_smoothing')}")  # fmt: skip
    o.add_argument("--clip", type=float_range(0.0),
                   help=f"gradient-norm clipping {run_dflt('clip')}")  # fmt: skip
    o.add_argument("--max-tokens", type=positive_int,
                   help=f"tokens per batch (per rank) {run_dflt('max_tokens')}")  # fmt: skip
    o.add_argument("--bf16", action="store_true", default=None,
                   help="bfloat16 autocast for the forward pass")  # fmt: skip
    o.add_argument("--seed", type=nonneg_int, help=f"random seed {run_dflt('seed')}")
    r = p.add_argument_group("run")
    r.add_argument(
        "--out", type=output_dir, help="run directory (OUT/last, OUT/best, OUT/log.jsonl)"
    )
    r.add_argument("--resume", help="continue the run in this directory exactly (it writes "
                   "there; the model, data and optimisation options are the run's: another "
                   "value is an error; the length of the run, --checkpoint-minutes, --threads, "
                   "--no-progress and --augment may change)")  # fmt: skip
    r.add_argument("--overwrite", action="store_true",
                   help="--out holds a run: delete it and start a new one")  # fmt: skip
    r.add_argument("--epochs", type=positive_int, default=None,
                   help="epochs at most (default: 100)")  # fmt: skip
    r.add_argument("--max-steps", type=positive_int, default=None, help="stop after N updates")
    r.add_argument("--max-minutes", type=float_range(0.0), default=None, help="wall-clock budget")
    r.add_argument("--checkpoint-minutes", type=float_range(0.0), default=None,
                   help="minutes between checkpoints (default: 5)")  # fmt: skip
    r.add_argument("--val-bleu", type=int_range(-1),
                   help="validation sentences decoded (greedy) for BLEU each epoch (-1 all, "
                   f"0 none) {run_dflt('val_bleu')}")  # fmt: skip
    r.add_argument("--final-validate", action=argparse.BooleanOptionalAction,
                   help="validate (and maybe keep as best) when the budget ends mid-epoch "
                   f"{run_dflt('final_validate')}")  # fmt: skip
    r.add_argument("--keep-epochs", type=nonneg_int,
                   help="keep the weights of the last N epochs in OUT/epochs (0: none) "
                   f"{run_dflt('keep_epochs')}")  # fmt: skip
    r.add_argument("--average", type=nonneg_int,
                   help="at the end, average the last N epochs' weights; the average becomes "
                   f"OUT/best if its val BLEU is higher (0: off) {run_dflt('average')}")  # fmt: skip
    r.add_argument("--device", default=None, type=device,
                   help="cpu (default) or cuda; DDP uses LOCAL_RANK")  # fmt: skip
    r.add_argument("--threads", type=threads, default=None, help="torch threads (default: all)")
    r.add_argument("--no-progress", action="store_true", default=None, help="no progress bar")
    p.set_defaults(func=_main)


def _settle(args: argparse.Namespace) -> argparse.Namespace:
    """Defaults that apply to a new run only (a resumed run keeps its saved ones)."""
    if not args.resume:
        for k, default in {**MODEL_DEFAULTS, **RUN_DEFAULTS}.items():
            if getattr(args, k, None) is None:
                setattr(args, k, default)
        args.epochs = 100 if args.epochs is None else args.epochs
        args.augment = args.augment or "none"
        args.checkpoint_minutes = (
            5.0 if args.checkpoint_minutes is None else args.checkpoint_minutes
        )
    args.__dict__.pop("func", None)
    args.__dict__.pop("command", None)
    return args


def _main(args: argparse.Namespace) -> int:
    result = train(_settle(args))  # errors: one stderr line, exit 2 (qkv.apps.cli_args.run_command)
    # stopped by SIGINT/SIGTERM after its checkpoint: 130, which run_command reports as
    # "qkv train: interrupted" (the handler took the signal: no KeyboardInterrupt says so)
    return 130 if result["stopped"] == "signal" else 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``qkv train`` arguments from a list (for scripts and tests)."""
    parser = Parser(prog="qkv")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return _settle(parser.parse_args(["train", *argv]))
