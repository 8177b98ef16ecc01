"""What the backend did to each graph: the records behind :func:`comera_compile.explain`."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RewriteRecord:
    """One rewrite applied: ``kind`` ("cce", "tt_linear", "tt_embedding" or a custom pass name)."""

    kind: str
    module: str | None
    detail: str = ""
    graph: int = 0

    def __str__(self) -> str:
        where = self.module if self.module is not None else "-"
        return f"[{self.kind}] {where}: {self.detail}" if self.detail else f"[{self.kind}] {where}"


@dataclass
class SkipRecord:
    """One candidate left alone, and why."""

    kind: str
    reason: str
    module: str | None = None
    graph: int = 0

    def __str__(self) -> str:
        where = self.module if self.module is not None else "-"
        return f"[{self.kind}] {where}: {self.reason}"


@dataclass
class GraphReport:
    """The report of one Dynamo graph handed to the backend."""

    index: int
    before: str = ""
    after: str = ""
    gm: torch.fx.GraphModule | None = None
    rewrites: list[RewriteRecord] = field(default_factory=list)
    skipped: list[SkipRecord] = field(default_factory=list)
    passes_run: list[tuple[str, int]] = field(default_factory=list)
    cudagraphs: bool = False  # whether the inner compiler runs this graph under CUDA graphs
    #: Inductor settings handed to the inner compiler beyond its defaults: those the passes asked for,
    #: with the user's ``inductor_config`` over them (empty for another inner compiler).
    inductor_config: dict[str, Any] = field(default_factory=dict)

    def format(self, graphs: bool = False) -> str:
        """The summary (passes, CUDA graphs, rewrites, candidates left alone); ``graphs=True`` adds the
        graph before the passes and the graph handed to the inner compiler."""
        lines = [f"=== graph {self.index} ==="]
        lines.append("passes: " + (", ".join(f"{n} ({c})" for n, c in self.passes_run) or "none"))
        lines.append(f"CUDA graphs: {'on' if self.cudagraphs else 'off'}")
        if self.inductor_config:
            lines.append("Inductor settings: " + ", ".join(f"{k}={v!r}" for k, v in sorted(self.inductor_config.items())))
        lines.append(f"rewrites ({len(self.rewrites)}):")
        lines += [f"  {r}" for r in self.rewrites] or ["  none"]
        lines.append(f"left alone ({len(self.skipped)}):")
        lines += [f"  {s}" for s in self.skipped] or ["  none"]
        if graphs:
            lines.append("--- before ---")
            lines.append(self.before.rstrip())
            lines.append("--- after ---")
            lines.append(self.after.rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


@dataclass
class Report:
    """Everything the backend did during one :func:`comera_compile.explain` run."""

    graph_reports: list[GraphReport] = field(default_factory=list)
    output: Any = None
    graph_breaks: list[str] = field(default_factory=list)  # Dynamo's reasons, one line each, during the run

    @property
    def graphs(self) -> list[torch.fx.GraphModule]:
        """The rewritten ``torch.fx.GraphModule`` of every graph."""
        return [g.gm for g in self.graph_reports if g.gm is not None]

    @property
    def rewrites(self) -> list[RewriteRecord]:
        return [r for g in self.graph_reports for r in g.rewrites]

    @property
    def skipped(self) -> list[SkipRecord]:
        return [s for g in self.graph_reports for s in g.skipped]

    def format(self, graphs: bool = False) -> str:
        """The report as text: per graph, every rewrite and every candidate left alone with the reason;
        ``graphs=True`` adds each graph before and after the passes (``str(report)`` is the summary)."""
        head = (f"comera explain: {len(self.graph_reports)} graph(s), {len(self.rewrites)} rewrite(s), "
                f"{len(self.skipped)} candidate(s) left alone")
        if self.graph_breaks:
            head += f"\ngraph breaks ({len(self.graph_breaks)}):\n" + "\n".join(f"  {b}" for b in self.graph_breaks)
        if not graphs and any(g.before or g.after for g in self.graph_reports):
            head += "\n(report.show(graphs=True) also prints each graph before and after the passes)"
        return "\n\n".join([head] + [g.format(graphs) for g in self.graph_reports])

    def show(self, graphs: bool = False) -> None:
        """Print :meth:`format`: the summary, or with ``graphs=True`` the graphs too."""
        print(self.format(graphs))

    def __str__(self) -> str:
        return self.format()

    __repr__ = __str__


class _Collectors(threading.local):
    def __init__(self) -> None:
        self.stack: list[Report] = []


_collectors = _Collectors()


def active_report() -> Report | None:
    """The report an enclosing :func:`explain` collects into, if any."""
    return _collectors.stack[-1] if _collectors.stack else None


class collecting:
    """Context manager: the report of every graph the backend compiles inside it goes into ``report``
    (a new :class:`Report` when none is given), e.g. around ``trainer.train()`` or a training loop:

        with comera_compile.report.collecting() as report:
            trainer.train()
        print(report)   # what the backend did to each graph it compiled

    Unlike :func:`comera_compile.explain` it runs nothing itself. ``report.graph_breaks`` lists
    Dynamo's graph breaks while the block ran (its counters are the process's: a compile in another
    thread meanwhile counts too); a graph compiled before the block (or not recompiled inside it) is
    not in the report.
    """

    def __init__(self, report: Report | None = None) -> None:
        self.report = Report() if report is None else report
        self._breaks_before: dict[str, int] = {}

    def __enter__(self) -> Report:
        self._breaks_before = graph_break_counts()
        _collectors.stack.append(self.report)
        return self.report

    def __exit__(self, *exc: Any) -> None:
        _collectors.stack.remove(self.report)
        self.report.graph_breaks.extend(new_graph_breaks(self._breaks_before))


def graph_break_counts() -> dict[str, int]:
    """Dynamo's graph-break counters now: reason -> count."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def new_graph_breaks(before: dict[str, int]) -> list[str]:
    """Dynamo's graph-break reasons recorded since ``before`` (:func:`graph_break_counts`): the first
    line, and the debug context line that names the call, each with its count."""
    found = []
    for reason, count in graph_break_counts().items():
        if count > before.get(reason, 0):
            lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
            context = [line for line in lines[1:] if line.startswith("Developer debug context")]
            text = "; ".join(lines[:1] + context)
            found.append(f"{text[:300]} (x{count - before.get(reason, 0)})")
    return found
