"""``explain``: capture a model with the comera backend, run it once, and report every rewrite."""

from __future__ import annotations

from typing import Any

import torch

from comera_compile.options import CompileOptions
from comera_compile.report import Report, collecting


def _options_of_compiled(model: Any) -> Any:
    """The ``options=`` a model was compiled with (``torch.compile(m, backend="comera", options=...)``)."""
    callback = getattr(getattr(model, "dynamo_ctx", None), "callback", None)
    for _ in range(4):  # unwrap Dynamo's callback wrappers down to torch's _TorchCompileWrapper
        if callback is None:
            break
        kwargs = getattr(callback, "kwargs", None)
        if isinstance(kwargs, dict):
            return kwargs.get("options")
        callback = getattr(callback, "_torchdynamo_orig_backend", None) or getattr(callback, "compiler_fn", None)
    return None


def explain(model: Any, *example_args: Any, options: Any = None, **example_kwargs: Any) -> Report:
    """Compile ``model`` with the comera backend, run it once on the example inputs, and report.

    ``model`` may be a module, a function, or a model already wrapped by ``torch.compile`` (its
    comera options are reused unless ``options=`` is given). The run happens in the caller's grad
    mode, so call it under ``torch.no_grad()`` to see the inference rewrite.

    Returns a :class:`~comera_compile.report.Report`: ``print(report)`` shows, per graph, every rewrite
    applied, every candidate left alone with the reason, and the graph before and after;
    ``report.rewrites``, ``report.skipped`` and ``report.graphs`` hold the same as data, and
    ``report.output`` the model's output.
    """
    from comera_compile.backend import _compile

    target = model
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        target = model._orig_mod
        if options is None:
            options = _options_of_compiled(model)
    opts = CompileOptions.from_user(options)

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return _compile(gm, example_inputs, opts)

    report = Report()
    compiled = torch.compile(target, backend=backend)
    with collecting(report):
        report.output = compiled(*example_args, **example_kwargs)
    return report
