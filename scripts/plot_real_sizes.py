"""Plots of bench_real_sizes.py's records: each file's forward against its rows (ours and
llama.cpp's batches, over one row) and decode's share of the machine's read bandwidth.

    python scripts/plot_real_sizes.py docs/bench/real-sizes/sizes.jsonl --out docs/bench/real-sizes/real-sizes.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    records = [json.loads(line) for line in args.records.read_text().splitlines() if line.strip()]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rows_ax, bw_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, r in enumerate(records):
        name = r["file"].removesuffix(".gguf")
        color = f"C{i}"
        for side, style in (("ours", "-"), ("lcpp", ":")):
            curve = {int(n): v for n, v in r.get(f"{side}_x_one_row", {}).items()}
            if curve:
                label = f"{name} ({'vocabspec' if side == 'ours' else 'llama.cpp'})"
                rows_ax.plot(list(curve), list(curve.values()), style, marker="o", color=color, label=label)
    rows_ax.set(xscale="log", yscale="log", xlabel="rows in one forward", ylabel="time over one row",
                title="A forward against its rows (2 threads)")
    rows_ax.legend(fontsize=6)
    names = [r["file"].removesuffix(".gguf") for r in records]
    shares = [r["roofline"]["decode_of_bandwidth"] for r in records]
    lcpp = [r["roofline"]["decode_of_bandwidth"] * r["lcpp_tg"] / r["ours_tg"] for r in records]
    x = range(len(records))
    bw_ax.bar([i - 0.2 for i in x], shares, 0.4, label="vocabspec")
    bw_ax.bar([i + 0.2 for i in x], lcpp, 0.4, label="llama.cpp")
    bw_ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=7)
    bw_ax.set(ylabel="decode's bytes a second / read bandwidth", ylim=(0, 1.05),
              title="Decode against the memory bandwidth")
    bw_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
