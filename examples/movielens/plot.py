"""A PNG of training loss and validation AUC per epoch, drawn with matplotlib.

matplotlib comes with the `examples` extra (`pip install -e '.[examples]'`).
The object-oriented API (`Figure` + the Agg canvas) is used, so no pyplot
state or global backend is touched.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

FIGSIZE = (10, 4.2)  # inches; at DPI, a 1000 x 420 PNG
DPI = 100


def history_figure(
    train_loss: Sequence[float],
    val_auc: Sequence[float],
    step_loss: Sequence[float] = (),
    reference_auc: float | None = None,
) -> Figure:
    """Two panels: training loss (per step and epoch mean), validation AUC (+ reference)."""
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    a, b = fig.subplots(1, 2)
    epochs = np.arange(1, len(train_loss) + 1)
    if len(step_loss):
        x = np.linspace(0, len(train_loss), len(step_loss) + 1)[1:]
        a.plot(x, step_loss, color="0.75", lw=0.8, label="per step")
    a.plot(epochs, train_loss, "o-", color="C0", label="epoch mean")
    a.set(xlabel="epoch", ylabel="log-loss", title="training loss")
    a.legend()
    b.plot(epochs, val_auc, "o-", color="C1", label="embedmesh DLRM")
    if reference_auc is not None:
        b.axhline(reference_auc, color="0.5", ls="--", label=f"RecBole LR, test: {reference_auc}")
    b.set(xlabel="epoch", ylabel="AUC", title="validation AUC")
    b.legend()
    fig.tight_layout()
    return fig


def plot_history(
    path: Path,
    train_loss: Sequence[float],
    val_auc: Sequence[float],
    step_loss: Sequence[float] = (),
    reference_auc: float | None = None,
) -> Path:
    """Write the PNG of `history_figure(...)` to `path` (folders created); returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    history_figure(train_loss, val_auc, step_loss, reference_auc).savefig(path, dpi=DPI)
    return path
