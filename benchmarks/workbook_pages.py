"""Render a report workbook as LibreOffice prints it, to look at the pages (issue 28).

    python benchmarks/workbook_pages.py reports/example/demo.xlsx [--out DIR] [--dpi 80]

Converts the .xlsx to PDF with LibreOffice (headless), then each page to a PNG with pdftoppm, and
prints the page count per sheet and the paths. Open the PNGs and look: no header drawn over the
first data row, no text running into a neighbour, no "###" for a number too wide for its column.

The sheet of each page is read from the page's header, which zero_bench's workbook sets to the
sheet's name ("&A"); a page without one counts as "(no header)".

Needs `soffice` (Debian: apt-get install libreoffice-calc-nogui) and pdftoppm / pdftotext
(poppler-utils); exits 2 with the reason when one is missing.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

TOOLS = {"soffice": "apt-get install -y libreoffice-calc-nogui", "pdftoppm": "apt-get install -y poppler-utils",
         "pdftotext": "apt-get install -y poppler-utils"}


def missing_tools() -> list[str]:
    return [f"{tool} not found (install: {how})" for tool, how in TOOLS.items() if not shutil.which(tool)]


def to_pdf(xlsx: Path, out: Path) -> Path:
    # A private profile: a desktop LibreOffice (or a second conversion) holding the default one
    # makes a headless conversion exit 0 without writing anything.
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(["soffice", f"-env:UserInstallation=file://{profile}", "--headless", "--convert-to", "pdf",
                        "--outdir", str(out), str(xlsx)], check=True, capture_output=True, timeout=300)
    pdf = out / f"{xlsx.stem}.pdf"
    if not pdf.is_file():
        raise RuntimeError(f"LibreOffice wrote no {pdf.name} into {out}")
    return pdf


def page_sheets(pdf: Path, sheets: list[str]) -> list[str]:
    """Each page's sheet: the first line of its text that is a sheet's name (the page header)."""
    text = subprocess.run(["pdftotext", "-layout", str(pdf), "-"], check=True, capture_output=True,
                          text=True).stdout
    names = []
    for page in text.split("\f")[:-1] if text.endswith("\f") else text.split("\f"):
        lines = [x.strip() for x in page.splitlines() if x.strip()]
        names.append(next((x.split(" - page")[0] for x in lines[:3] if x.split(" - page")[0] in sheets),
                          "(no header)"))
    return names


def to_pngs(pdf: Path, out: Path, dpi: int) -> list[Path]:
    for old in out.glob("page-*.png"):
        old.unlink()
    subprocess.run(["pdftoppm", "-r", str(dpi), "-png", str(pdf), str(out / "page")], check=True, timeout=300)
    return sorted(out.glob("page-*.png"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("xlsx", type=Path)
    ap.add_argument("--out", type=Path, help="folder for the PDF and PNGs (default: <xlsx stem>_pages beside it)")
    ap.add_argument("--dpi", type=int, default=80)
    args = ap.parse_args(argv)
    problems = missing_tools() + ([] if args.xlsx.is_file() else [f"{args.xlsx}: no such file"])
    if problems:
        print("workbook_pages: " + "; ".join(problems), file=sys.stderr)
        return 2
    import openpyxl

    sheets = openpyxl.load_workbook(args.xlsx, read_only=True).sheetnames
    out = args.out or args.xlsx.with_name(f"{args.xlsx.stem}_pages")
    out.mkdir(parents=True, exist_ok=True)
    pdf = to_pdf(args.xlsx.resolve(), out)
    pages = page_sheets(pdf, sheets)
    pngs = to_pngs(pdf, out, args.dpi)
    counts = Counter(pages)
    print(f"{pdf}: {len(pages)} page(s)")
    for name in sheets + [n for n in counts if n not in sheets]:
        first = pages.index(name) + 1 if name in pages else None
        print(f"  {name:32s} {counts.get(name, 0):3d} page(s)" + (f", from page {first}" if first else ""))
    for i, png in enumerate(pngs):
        print(f"  {png}  ({pages[i] if i < len(pages) else '?'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
