"""A ranker's history as a figure (matplotlib, an optional dependency)."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

__all__ = ["plot_history"]


def plot_history(path: str, history: Sequence[dict[str, Any]], layers: Sequence[str], *, dense_params: int,
                 target_compression: float, switch_step: int | None = None,
                 losses: Iterable[tuple[int, float]] | None = None) -> None:
    """Ranks per layer (``layers``: their names), model size / compression and the penalty weight
    over the steps of ``history`` (``RankAdaptation.history``), saved to ``path``. ``losses``:
    optional ``(step, loss)`` pairs to add."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("RankAdaptation.plot needs matplotlib: pip install matplotlib") from None
    if not history:
        raise ValueError("RankAdaptation.plot: no history yet (no optimizer step was taken)")
    steps = [h["step"] for h in history]
    n_panels = 3 if losses is None else 4
    fig, axes = plt.subplots(n_panels, 1, figsize=(8, 2.6 * n_panels), sharex=True)
    for fqn in layers:
        series = [sum(h["ranks"][fqn]) / max(len(h["ranks"][fqn]), 1) for h in history]
        axes[0].plot(steps, series, label=fqn, lw=1)
    axes[0].set_ylabel("mean internal rank")
    if len(layers) <= 12:
        axes[0].legend(fontsize=6, ncol=2)
    axes[1].plot(steps, [h["compression"] for h in history], label="compression (actual)")
    axes[1].plot(steps, [dense_params / max(h["effective_params"], 1) for h in history],
                 ls="--", label="compression (gates >= threshold)")
    axes[1].axhline(target_compression, color="gray", ls=":", label="target")
    axes[1].set_ylabel("dense / params")
    axes[1].legend(fontsize=7)
    axes[2].semilogy(steps, [max(h["gamma"], 1e-30) for h in history])
    axes[2].set_ylabel("penalty weight")
    if switch_step is not None:
        for ax in axes:
            ax.axvline(switch_step, color="red", ls=":", lw=0.8)
    if losses is not None:
        xs, ys = zip(*losses)
        axes[3].plot(xs, ys, lw=0.8)
        axes[3].set_ylabel("loss")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
