"""Held-out agreement against training tokens over a chain of eagle3_device runs (each
continuing the last one's drafter): one plot and one table from their report.json files.

    python scripts/plot_device_runs.py --out docs/bench/eagle3-gpu-smollm2 run1/report.json run2/report.json ...
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", help="report.json of each run, in training order")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    before, rows = {}, []
    for index, path in enumerate(args.reports):
        report = json.loads(Path(path).read_text())
        for point in report["points"]:
            name = point["drafter"] if index == 0 else f"{point['drafter']} (continued)"
            chain = point["drafter"]
            rows.append({"run": index + 1, "labels": chain, "lr": report["args"]["lr"],
                         "tokens": before.get(chain, 0) + point["tokens"], "at": point["at"], "name": name,
                         **{k: v for k, v in point.items() if k.startswith("top1")}})
        for chain in {p["drafter"] for p in report["points"]}:
            before[chain] = before.get(chain, 0) + max(p["tokens"] for p in report["points"] if p["drafter"] == chain)
    (out / "points.json").write_text(json.dumps(rows, indent=2))
    table = ["| run | labels | peak lr | tokens so far | held-out top-1, step 1 / 2 / 3 |", "| --- | --- | --- | --- | --- |"]
    table += [f"| {r['run']} | {r['labels']} | {r['lr']:g} | {r['tokens'] / 1e6:.1f}M | "
              f"{r['top1_step1']:.3f} / {r['top1_step2']:.3f} / {r['top1_step3']:.3f} |" for r in rows]
    (out / "points.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(12, 3.2), sharey=True)
    for k, axis in enumerate(axes, start=1):
        for labels in dict.fromkeys(r["labels"] for r in rows):
            mine = [r for r in rows if r["labels"] == labels]
            axis.plot([r["tokens"] / 1e6 for r in mine], [r[f"top1_step{k}"] for r in mine], "o-", label=labels)
        axis.set_title(f"draft step {k}")
        axis.set_xlabel("training tokens (millions)")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("held-out top-1 agreement")
    axes[0].legend()
    figure.suptitle("EAGLE-3 trained on a GPU (eagle3_device), runs continuing each other")
    figure.tight_layout()
    figure.savefig(out / "points.png", dpi=110)


if __name__ == "__main__":
    main()
