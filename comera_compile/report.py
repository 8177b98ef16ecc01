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

    def __str__(self) -> str:
        lines = [f"=== graph {self.index} ==="]
        lines.append("passes: " + (", ".join(f"{n} ({c})" for n, c in self.passes_run) or "none"))
        lines.append(f"CUDA graphs: {'on' if self.cudagraphs else 'off'}")
        lines.append(f"rewrites ({len(self.rewrites)}):")
        lines += [f"  {r}" for r in self.rewrites] or ["  none"]
        lines.append(f"left alone ({len(self.skipped)}):")
        lines += [f"  {s}" for s in self.skipped] or ["  none"]
        lines.append("--- before ---")
        lines.append(self.before.rstrip())
        lines.append("--- after ---")
        lines.append(self.after.rstrip())
        return "\n".join(lines)


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

    def __str__(self) -> str:
        head = (f"comera explain: {len(self.graph_reports)} graph(s), {len(self.rewrites)} rewrite(s), "
                f"{len(self.skipped)} candidate(s) left alone")
        if self.graph_breaks:
            head += f"\ngraph breaks ({len(self.graph_breaks)}):\n" + "\n".join(f"  {b}" for b in self.graph_breaks)
        return "\n\n".join([head] + [str(g) for g in self.graph_reports])

    __repr__ = __str__


class _Collectors(threading.local):
    def __init__(self) -> None:
        self.stack: list[Report] = []


_collectors = _Collectors()


def active_report() -> Report | None:
    """The report an enclosing :func:`explain` collects into, if any."""
    return _collectors.stack[-1] if _collectors.stack else None


class collecting:
    """Context manager: graph reports made by the backend inside it go into ``report``."""

    def __init__(self, report: Report) -> None:
        self.report = report

    def __enter__(self) -> Report:
        _collectors.stack.append(self.report)
        return self.report

    def __exit__(self, *exc: Any) -> None:
        _collectors.stack.remove(self.report)
