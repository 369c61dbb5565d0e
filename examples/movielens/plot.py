"""A PNG of training loss and validation AUC per epoch.

matplotlib is used when it is installed; otherwise a small built-in renderer
(numpy + zlib, a 5x7 bitmap font) draws the same two panels, so the demo
needs no plotting dependency.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np


def plot_history(path: Path, train_loss: Sequence[float], val_auc: Sequence[float],
                 step_loss: Sequence[float] = (), reference_auc: float = None) -> str:
    """Write the PNG; returns which renderer drew it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _builtin_png(path, train_loss, val_auc, step_loss, reference_auc)
        return "built-in"
    epochs = np.arange(1, len(train_loss) + 1)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    if len(step_loss):
        x = np.linspace(0, len(train_loss), len(step_loss) + 1)[1:]
        a.plot(x, step_loss, color="0.75", lw=0.8, label="per step")
    a.plot(epochs, train_loss, "o-", label="epoch mean")
    a.set(xlabel="epoch", ylabel="log-loss", title="training loss")
    a.legend()
    b.plot(epochs, val_auc, "o-", color="C1", label="embedmesh DLRM")
    if reference_auc is not None:
        b.axhline(reference_auc, color="0.5", ls="--", label=f"RecBole LR, test: {reference_auc}")
    b.set(xlabel="epoch", ylabel="AUC", title="validation AUC")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return "matplotlib"


# ---------------------------------------------------------------------------
# Built-in renderer

_FONT = {  # 5x7 glyphs, '#' = ink
    "0": [".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."],
    "1": ["..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."],
    "2": [".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"],
    "3": ["####.", "....#", "....#", ".###.", "....#", "....#", "####."],
    "4": ["...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."],
    "5": ["#####", "#....", "####.", "....#", "....#", "#...#", ".###."],
    "6": [".###.", "#....", "#....", "####.", "#...#", "#...#", ".###."],
    "7": ["#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."],
    "8": [".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."],
    "9": [".###.", "#...#", "#...#", ".####", "....#", "....#", ".###."],
    ".": [".....", ".....", ".....", ".....", ".....", ".##..", ".##.."],
    "-": [".....", ".....", ".....", "#####", ".....", ".....", "....."],
    " ": ["....."] * 7,
    "A": [".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"],
    "C": [".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."],
    "E": ["#####", "#....", "#....", "####.", "#....", "#....", "#####"],
    "H": ["#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"],
    "I": [".###.", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."],
    "L": ["#....", "#....", "#....", "#....", "#....", "#....", "#####"],
    "N": ["#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#", "#...#"],
    "O": [".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."],
    "P": ["####.", "#...#", "#...#", "####.", "#....", "#....", "#...."],
    "R": ["####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"],
    "S": [".####", "#....", "#....", ".###.", "....#", "....#", "####."],
    "T": ["#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."],
    "U": ["#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."],
    "V": ["#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."],
    "G": [".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".###."],
    "B": ["####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."],
    "D": ["####.", "#...#", "#...#", "#...#", "#...#", "#...#", "####."],
    "M": ["#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"],
    "K": ["#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"],
}


class _Canvas:
    def __init__(self, w: int, h: int):
        self.img = np.full((h, w, 3), 255, np.uint8)

    def rect(self, x0, y0, x1, y1, color):
        h, w, _ = self.img.shape
        x0, x1 = max(0, int(x0)), min(w, int(x1))
        y0, y1 = max(0, int(y0)), min(h, int(y1))
        if x0 < x1 and y0 < y1:
            self.img[y0:y1, x0:x1] = color

    def line(self, x0, y0, x1, y1, color, width=2):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for t in np.linspace(0, 1, n):
            x, y = x0 + t * (x1 - x0), y0 + t * (y1 - y0)
            self.rect(x - width / 2, y - width / 2, x + width / 2 + 0.5, y + width / 2 + 0.5,
                      color)

    def dashed(self, x0, y, x1, color):
        for x in range(int(x0), int(x1), 10):
            self.rect(x, y, min(x + 6, x1), y + 1, color)

    def text(self, x, y, s, color=(40, 40, 40), scale=2, anchor="left"):
        s = s.upper()
        width = len(s) * 6 * scale
        if anchor == "center":
            x -= width / 2
        elif anchor == "right":
            x -= width
        for i, ch in enumerate(s):
            glyph = _FONT.get(ch, _FONT[" "])
            for r, row in enumerate(glyph):
                for c, v in enumerate(row):
                    if v == "#":
                        px = x + (i * 6 + c) * scale
                        self.rect(px, y + r * scale, px + scale, y + (r + 1) * scale, color)

    def png(self) -> bytes:
        h, w, _ = self.img.shape
        raw = b"".join(b"\x00" + self.img[r].tobytes() for r in range(h))

        def chunk(tag, data):
            body = tag + data
            return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _panel(cv: _Canvas, x0, y0, w, h, series, title, ref=None):
    """series: [(xs, ys, color, marker)] in data units; axes box at (x0, y0, w, h)."""
    xs_all = np.concatenate([np.asarray(s[0], float) for s in series])
    ys_all = np.concatenate([np.asarray(s[1], float) for s in series] +
                            ([np.asarray([ref])] if ref is not None else []))
    xmin, xmax = 0.0, max(1.0, float(xs_all.max()))
    ymin, ymax = float(ys_all.min()), float(ys_all.max())
    pad = (ymax - ymin) * 0.1 or 0.01
    ymin, ymax = ymin - pad, ymax + pad
    sx = lambda v: x0 + (v - xmin) / (xmax - xmin) * w  # noqa: E731
    sy = lambda v: y0 + h - (v - ymin) / (ymax - ymin) * h  # noqa: E731
    axis = (60, 60, 60)
    cv.line(x0, y0 + h, x0 + w, y0 + h, axis, 1)
    cv.line(x0, y0, x0, y0 + h, axis, 1)
    cv.text(x0 + w / 2, y0 - 26, title, anchor="center")
    for k in range(5):
        v = ymin + (ymax - ymin) * k / 4
        cv.line(x0 - 5, sy(v), x0, sy(v), axis, 1)
        cv.text(x0 - 8, sy(v) - 7, f"{v:.3f}", scale=2, anchor="right")
    step = max(1, int(np.ceil(xmax / 10)))
    for e in range(0, int(xmax) + 1, step):
        cv.line(sx(e), y0 + h, sx(e), y0 + h + 5, axis, 1)
        cv.text(sx(e), y0 + h + 9, str(e), anchor="center")
    cv.text(x0 + w / 2, y0 + h + 30, "EPOCH", anchor="center")
    if ref is not None:
        cv.dashed(x0, sy(ref), x0 + w, (150, 150, 150))
        cv.text(x0 + w - 4, sy(ref) + 6, f"RECBOLE LR TEST {ref}", color=(120, 120, 120), scale=1,
                anchor="right")
    for xs, ys, color, marker in series:
        pts = [(sx(a), sy(b)) for a, b in zip(xs, ys)]
        for (a0, b0), (a1, b1) in zip(pts[:-1], pts[1:]):
            cv.line(a0, b0, a1, b1, color, 2 if marker else 1)
        if marker:
            for a, b in pts:
                cv.rect(a - 4, b - 4, a + 4, b + 4, color)


def _builtin_png(path: Path, train_loss, val_auc, step_loss, reference_auc):
    cv = _Canvas(1000, 420)
    epochs = np.arange(1, len(train_loss) + 1)
    series = []
    if len(step_loss):
        x = np.linspace(0, len(train_loss), len(step_loss) + 1)[1:]
        series.append((x, np.asarray(step_loss), (190, 190, 190), False))
    series.append((epochs, np.asarray(train_loss), (31, 119, 180), True))
    _panel(cv, 110, 50, 360, 300, series, "TRAINING LOSS")
    _panel(cv, 610, 50, 360, 300, [(epochs, np.asarray(val_auc), (255, 127, 14), True)],
           "VALIDATION AUC", ref=reference_auc)
    path.write_bytes(cv.png())
