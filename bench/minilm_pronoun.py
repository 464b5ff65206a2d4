"""Which all-MiniLM-L6-v2 heads send *it* to *animal* / *street*, on the notes' sentence and on
its "too wide" variant (where *it* is the street). Prints the numbers behind the README and
draws docs/minilm_pronoun.png.

    PYTHONPATH=src python bench/minilm_pronoun.py [--png docs/minilm_pronoun.png]
"""

from __future__ import annotations

import argparse
import os

os.environ["HF_HUB_OFFLINE"] = "1"

from matplotlib import rc_context  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from qkv.apps.tour import PRONOUN, WIDE  # noqa: E402
from qkv.inspect import capture, pronoun_probe  # noqa: E402
from qkv.inspect.fonts import font_families  # noqa: E402
from qkv.inspect.loaders import load  # noqa: E402
from qkv.inspect.plot import save  # noqa: E402

HEADS = [(3, 1), (4, 0), (5, 11), (5, 1)]  # drawn: see the printed table for why
CANDS = ["animal", "street"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--png", default="docs/minilm_pronoun.png")
    args = ap.parse_args()
    loaded = load("minilm")
    runs = {}
    for name, text in (("tired", PRONOUN), ("too wide", WIDE)):
        tokens, inputs = loaded.encode(text)
        maps = capture(loaded.model, *inputs, tokens=tokens)
        probe = {(int(r.layer.split(".")[2]), r.head): r for r in pronoun_probe(maps, "it", CANDS)}
        runs[name] = (tokens, maps, probe)

    t, w = runs["tired"][2], runs["too wide"][2]
    print("head   | tired: animal street | too wide: animal street | Δ(animal−street)")
    for key in sorted(t, key=lambda k: (w[k].scores["animal"] - w[k].scores["street"])
                      - (t[k].scores["animal"] - t[k].scores["street"]))[:10]:  # fmt: skip
        a, b = t[key].scores, w[key].scores
        d = (b["animal"] - b["street"]) - (a["animal"] - a["street"])
        print(f"L{key[0]}H{key[1]:<3} |        {a['animal']:.3f}  {a['street']:.3f} |"
              f"           {b['animal']:.3f}  {b['street']:.3f} | {d:+.3f}")  # fmt: skip
    flips = [k for k in t if t[k].best != w[k].best]
    print(f"heads whose preferred candidate flips: {len(flips)} of {len(t)}")
    for k in sorted(flips):
        a, b = t[k].scores, w[k].scores
        print(f"  L{k[0]}H{k[1]}: animal {a['animal']:.3f} → {b['animal']:.3f}, "
              f"street {a['street']:.3f} → {b['street']:.3f}")  # fmt: skip
    for name, (_, _, p) in runs.items():
        votes = {c: sum(r.best == c for r in p.values()) for c in CANDS}
        print(f"{name}: heads preferring animal {votes['animal']}, street {votes['street']}")

    with rc_context({"font.family": font_families(), "font.size": 7}):
        fig = Figure(figsize=(3.1 * len(HEADS), 6.4), layout="constrained")
        axes = fig.subplots(2, len(HEADS), squeeze=False)
        for r, (name, (tokens, maps, _)) in enumerate(runs.items()):
            it = tokens.index("it")
            for c, (layer, head) in enumerate(HEADS):
                ax = axes[r][c]
                ax.imshow(maps.select(layer, head).numpy(), cmap="viridis", vmin=0, vmax=1)
                ax.add_patch(Rectangle((-0.5, it - 0.5), len(tokens), 1, fill=False, ec="red"))
                ax.set_xticks(range(len(tokens)), tokens, rotation=70, ha="right", fontsize=6)
                ax.set_yticks(range(len(tokens)), tokens if c == 0 else [], fontsize=6)
                s = runs[name][2][(layer, head)].scores
                ax.set_title(f"L{layer} H{head} · {name}\nit→animal {s['animal']:.2f}  "
                             f"it→street {s['street']:.2f}", fontsize=7)  # fmt: skip
        fig.suptitle("all-MiniLM-L6-v2: rows = queries, columns = keys; red = the row of 'it'",
                     fontsize=8)  # fmt: skip
        fig.dpi = 80
        save(fig, args.png)
    print(f"picture: {args.png} ({os.path.getsize(args.png) // 1024} KB)")


if __name__ == "__main__":
    main()
