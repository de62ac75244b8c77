"""Plot end-to-end benchmark reports: tok/s against prompt length, prefill and decode, one
line per engine; several reports (e.g. the ten lengths against HF, then the long rows) merge
into one plot, a later report's rows replacing an earlier one's. Needs matplotlib
(`pip install -e '.[bench]'`).

    python -m sparrow.bench.plot bench-out/e2e.json --out docs/e2e.png
    python -m sparrow.bench.plot docs/bench/e2e-long.json docs/bench/e2e-hf.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("reports", nargs="+", help="JSON written by `python -m sparrow.bench.e2e`")
    p.add_argument("--out", default=None, help="PNG path (default: beside the last report)")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reports = [json.loads(Path(r).read_text()) for r in args.reports]
    batch1: dict[str, dict] = {}
    for report in reports:
        for engine, rows in report["batch1"].items():
            batch1.setdefault(engine, {}).update(rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in zip(
        axes, ("prefill_tok_s", "decode_tok_s"), ("prefill", "decode"), strict=True
    ):
        for engine, rows in batch1.items():
            lengths = sorted(int(n) for n in rows)
            ax.plot(lengths, [rows[str(n)][key] for n in lengths], marker="o", label=engine)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="prompt tokens",
            ylabel="tok/s",
            title=f"{title}, batch 1",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    commits = ", ".join(sorted({r["commit"] for r in reports}))
    fig.suptitle(f"{reports[-1]['model']} on {reports[-1]['gpu']} ({commits})", fontsize=9)
    fig.tight_layout()
    out = Path(args.out) if args.out else Path(args.reports[-1]).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
