"""A PNG of the training and validation log-loss and the validation AUC per epoch,
drawn with matplotlib, with the epoch the demo keeps marked.

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
    *,
    val_loss: Sequence[float] = (),
    best_epoch: int | None = None,
    title: str | None = None,
) -> Figure:
    """Two panels: log-loss (training per step and epoch mean, validation per epoch:
    where the two part, the model overfits) and validation AUC (+ reference), the kept
    (best validation) epoch marked on both; `title` above both (the data set, the kept
    model's test result)."""
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(fig)
    a, b = fig.subplots(1, 2)
    epochs = np.arange(1, len(train_loss) + 1)
    if len(step_loss):
        x = np.linspace(0, len(train_loss), len(step_loss) + 1)[1:]
        a.plot(x, step_loss, color="0.75", lw=0.8, label="training, per step")
    a.plot(epochs, train_loss, "o-", color="C0", label="training, epoch mean")
    if len(val_loss):
        a.plot(epochs, val_loss, "s-", color="C3", label="validation")
    a.set(xlabel="epoch", ylabel="log-loss", title="log-loss, training and validation")
    b.plot(epochs, val_auc, "o-", color="C1", label="embedmesh DLRM")
    if reference_auc is not None:
        b.axhline(reference_auc, color="0.5", ls="--", label=f"RecBole LR, test: {reference_auc}")
    b.set(xlabel="epoch", ylabel="AUC", title="validation AUC")
    if best_epoch is not None:
        for ax in (a, b):
            ax.axvline(best_epoch, color="k", ls=":", lw=1, label=f"kept: epoch {best_epoch}")
        b.plot([best_epoch], [val_auc[best_epoch - 1]], "*", color="k", ms=12, zorder=3)
    a.legend()
    b.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_history(path: Path, *args, **kwargs) -> Path:
    """Write the PNG of `history_figure(*args, **kwargs)` to `path` (folders created);
    returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    history_figure(*args, **kwargs).savefig(path, dpi=DPI)
    return path
