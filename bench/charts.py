#!/usr/bin/env python3
"""The book's charts: reads bench/results.tsv and writes one SVG bar chart per chart name (ours
against PyTorch, each pair labelled with its values and their ratio), and bench/curves.tsv
and writes one SVG line chart per chart name (loss curves), into book/src/images/<chart>.svg.
Python's standard library only; the output depends on the data files alone, so CI re-runs it
with --check and fails if a committed SVG differs.

    python3 bench/charts.py           # rewrite the SVGs
    python3 bench/charts.py --check   # exit 1 if a committed SVG is not what the data gives
"""

import sys
from pathlib import Path
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench" / "results.tsv"
CURVES = ROOT / "bench" / "curves.tsv"
OUT = ROOT / "book" / "src" / "images"
COLUMNS = ["chart", "run", "ours", "pytorch", "pytorch_setup", "unit", "gpu", "date"]
TITLES = {
    "throughput": "Training throughput: burn-megatron against PyTorch (same GPUs, same call)",
    "scaling": "Data-parallel scaling efficiency: burn-megatron against PyTorch",
    "fp8_curve": "FP8 against bf16: validation loss of a 350M GPT on text it does not repeat",
    "fp8_blockwise_curve": "FP8 blockwise scaling against bf16: the same 350M GPT and corpus",
}
OURS, THEIRS = "#d9480f", "#868e96"
# Line colours and dashes of a curve chart's runs, in the data file's order: ours in our
# colour, PyTorch's in grey; the second of each pair dashed.
LINES = [(OURS, ""), (OURS, "6 4"), (THEIRS, ""), (THEIRS, "6 4"), ("#1971c2", ""), ("#1971c2", "6 4")]

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


def read_curves():
    """{chart: {run: [(step, value)]}} from bench/curves.tsv, runs in the file's order."""
    curves = {}
    for number, line in enumerate(CURVES.read_text().split("\n"), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 4:
            sys.exit(f"{CURVES}:{number}: {len(fields)} fields, expected 4")
        chart_name, run, step, value = fields
        curves.setdefault(chart_name, {}).setdefault(run, []).append((int(step), float(value)))
    return curves


def curve_chart(name, runs):
    """One SVG line chart: a line per run, steps across, values up, a legend on the right."""
    width, height, left, top, plot_w, plot_h = 900, 420, 60, 50, 520, 320
    points = [p for run in runs.values() for p in run]
    (x0, x1) = (0, max(step for step, _ in points))
    lo, hi = min(v for _, v in points), max(v for _, v in points)
    pad = (hi - lo) * 0.05
    lo, hi = lo - pad, hi + pad

    def x(step):
        return left + plot_w * (step - x0) / (x1 - x0)

    def y(value):
        return top + plot_h * (hi - value) / (hi - lo)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="10" y="22" font-size="15" font-weight="bold">{escape(TITLES.get(name, name))}</text>',
    ]
    ticks = 6
    for i in range(ticks + 1):
        value = lo + (hi - lo) * i / ticks
        out.append(f'<text x="{left - 6}" y="{y(value) + 4:.1f}" text-anchor="end">{value:.2f}</text>')
        out.append(
            f'<line x1="{left}" y1="{y(value):.1f}" x2="{left + plot_w}" y2="{y(value):.1f}" stroke="#e9ecef"/>'
        )
    out.append(f'<line x1="{left}" y1="{top + plot_h}" x2="{left + plot_w}" y2="{top + plot_h}" stroke="#495057"/>')
    out.append(f'<line x1="{left}" y1="{top}" x2="{left}" y2="{top + plot_h}" stroke="#495057"/>')
    steps = sorted({step for step, _ in points})
    for step in steps:
        out.append(f'<text x="{x(step):.1f}" y="{top + plot_h + 16}" text-anchor="middle">{step}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{top + plot_h + 34}" text-anchor="middle">step</text>')
    for i, (run, values) in enumerate(runs.items()):
        color, dash = LINES[i % len(LINES)]
        path = " ".join(f"{x(step):.1f},{y(value):.1f}" for step, value in values)
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dashes}/>')
        ly = top + 10 + i * 20
        out.append(
            f'<line x1="{left + plot_w + 20}" y1="{ly}" x2="{left + plot_w + 50}" y2="{ly}" '
            f'stroke="{color}" stroke-width="2"{dashes}/>'
        )
        out.append(f'<text x="{left + plot_w + 56}" y="{ly + 4}">{escape(run)}</text>')
    out.append(f'<text x="10" y="{height - 10}" fill="#495057">Data: bench/curves.tsv.</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    check = sys.argv[1:] == ["--check"]
    if sys.argv[1:] not in ([], ["--check"]):
        print(__doc__)
        return 2
    bars = {}
    for row in read_rows():
        bars.setdefault(row["chart"], []).append(row)
    charts = {name: chart(name, rows) for name, rows in bars.items()}
    charts.update({name: curve_chart(name, runs) for name, runs in read_curves().items()})
    stale = []
    for name, svg in charts.items():
        path = OUT / f"{name}.svg"
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
        print(f"{len(charts)} charts match bench/results.tsv and bench/curves.tsv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
