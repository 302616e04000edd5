"""Plot loss curves of runs logged by train.py --loss_log into one PNG.

    python examples/nanogpt/plot_losses.py out/nncompile.jsonl out/lightning.jsonl \\
        --labels nncompile lightning -o curves.png
"""
from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--labels", nargs="+")
    ap.add_argument("-o", "--output", default="curves.png")
    args = ap.parse_args()
    labels = args.labels or args.logs
    fig, ax = plt.subplots(figsize=(8, 5))
    for path, label, style in zip(args.logs, labels, ["-", "--", ":", "-."] * 4):
        records = [json.loads(line) for line in open(path)]
        train = {r["step"]: r["train_loss"] for r in records if "train_loss" in r}
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        ax.plot(list(train), list(train.values()), style, label=f"{label} train", alpha=0.8)
        if val:
            ax.plot(*zip(*val), style, marker="o", label=f"{label} val")
            print(f"{label}: final val loss {val[-1][1]:.4f} at step {val[-1][0]}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
