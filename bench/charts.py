#!/usr/bin/env python3
"""The performance page's charts: reads bench/results.tsv and writes one SVG bar chart per
chart name (ours against PyTorch, each pair labelled with its values and their ratio) into
book/src/images/<chart>.svg. Python's standard library only; the output depends on the data
file alone, so CI re-runs it with --check and fails if a committed SVG differs.

    python3 bench/charts.py           # rewrite the SVGs
    python3 bench/charts.py --check   # exit 1 if a committed SVG is not what the data gives
"""

import sys
from pathlib import Path
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench" / "results.tsv"
OUT = ROOT / "book" / "src" / "images"
COLUMNS = ["chart", "run", "ours", "pytorch", "pytorch_setup", "unit", "gpu", "date"]
TITLES = {
    "throughput": "Training throughput: burn-megatron against PyTorch (same GPUs, same call)",
    "scaling": "Data-parallel scaling efficiency: burn-megatron against PyTorch",
}
OURS, THEIRS = "#d9480f", "#868e96"

WIDTH, LABEL_W, BAR_W, ROW_H, BAR_H, TOP = 900, 300, 380, 58, 18, 62


def read_rows():
    rows = []
    for number, line in enumerate(DATA.read_text().split("\n"), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != len(COLUMNS):
            sys.exit(f"{DATA}:{number}: {len(fields)} fields, expected {len(COLUMNS)}")
        row = dict(zip(COLUMNS, fields))
        row["ours"], row["pytorch"] = float(row["ours"]), float(row["pytorch"])
        rows.append(row)
    return rows


def number(value):
    return f"{value:.1f}"


def chart(name, rows):
    """One SVG: a row per run, our bar above PyTorch's. Throughputs of different models differ
    by 15x, so each row's bars share that row's scale (the longer one fills the width); the
    scaling chart's percentages share one scale, 0 to 100."""
    height = TOP + ROW_H * len(rows) + 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="10" y="22" font-size="15" font-weight="bold">{escape(TITLES.get(name, name))}</text>',
        f'<rect x="10" y="36" width="12" height="12" fill="{OURS}"/>'
        f'<text x="27" y="46">burn-megatron</text>',
        f'<rect x="130" y="36" width="12" height="12" fill="{THEIRS}"/>'
        f'<text x="147" y="46">PyTorch (its setup in brackets)</text>',
    ]
    for i, row in enumerate(rows):
        y = TOP + i * ROW_H
        scale = 100.0 if row["unit"].startswith("%") else max(row["ours"], row["pytorch"])
        ratio = row["ours"] / row["pytorch"]
        out.append(f'<text x="10" y="{y + 14}" font-weight="bold">{escape(row["run"])}</text>')
        out.append(
            f'<text x="10" y="{y + 30}" fill="#495057">{escape(row["gpu"])}, {escape(row["date"])}</text>'
        )
        for j, (value, color, label) in enumerate(
            [
                (row["ours"], OURS, f'{number(row["ours"])} {row["unit"]}'),
                (row["pytorch"], THEIRS, f'{number(row["pytorch"])} ({row["pytorch_setup"]})'),
            ]
        ):
            by = y + j * (BAR_H + 2)
            width = BAR_W * value / scale
            out.append(
                f'<rect x="{LABEL_W}" y="{by}" width="{width:.1f}" height="{BAR_H}" fill="{color}"/>'
            )
            out.append(f'<text x="{LABEL_W + width + 5:.1f}" y="{by + 13}">{escape(label)}</text>')
        verdict = "ratio" if not row["unit"].startswith("%") else "ours ÷ PyTorch"
        out.append(
            f'<text x="{WIDTH - 10}" y="{y + 14}" text-anchor="end" font-weight="bold">'
            f"{ratio:.2f}×</text>"
        )
        out.append(
            f'<text x="{WIDTH - 10}" y="{y + 30}" text-anchor="end" fill="#495057">{verdict}</text>'
        )
    note = (
        "Each row's bars share that row's scale."
        if not rows[0]["unit"].startswith("%")
        else "Throughput on N GPUs as a percentage of N times one GPU's."
    )
    out.append(f'<text x="10" y="{height - 14}" fill="#495057">{escape(note)} Data: bench/results.tsv.</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    check = sys.argv[1:] == ["--check"]
    if sys.argv[1:] not in ([], ["--check"]):
        print(__doc__)
        return 2
    charts = {}
    for row in read_rows():
        charts.setdefault(row["chart"], []).append(row)
    stale = []
    for name, rows in charts.items():
        path = OUT / f"{name}.svg"
        svg = chart(name, rows)
        if check:
            if not path.is_file() or path.read_text() != svg:
                stale.append(str(path.relative_to(ROOT)))
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            path.write_text(svg)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"stale: {', '.join(stale)}: run python3 bench/charts.py and commit the SVGs")
        return 1
    if check:
        print(f"{len(charts)} charts match bench/results.tsv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
