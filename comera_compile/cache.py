"""Cache safety: Inductor's on-disk caches must never serve a graph built by older code of ours.

The AOTAutograd / FX graph caches key on the rewritten graph, not on our ops' Python fake,
autograd or kernel code (after a change to a backward formula a warm cache served the old gradient). A no-op ``CustomGraphPass`` whose ``uuid()`` hashes
this package's sources enters Inductor's cache key, so any change to them changes the key.

The AOTAutograd cache refuses (bypasses) a Dynamo graph that calls a Python function it does not
know, and the ``tensor_network`` pass puts the TT executor's functions there (``group_outputs``,
``project``, ``lookup``, which AOTAutograd traces into aten ops). They are marked cacheable for our
compiles only, each keyed on the same source hash: a warm process skips AOTAutograd and Inductor
as it does for a plain Inductor graph, and a change to their code changes the key.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from comera_compile.fx_utils import iter_graph_modules

_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


def hash_sources(roots: list[str]) -> str:
    """sha256 over the relative paths and contents of every ``.py`` file under ``roots``."""
    digest = hashlib.sha256()
    for root in sorted(roots):
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    digest.update(os.path.relpath(path, root).encode())
                    with open(path, "rb") as f:
                        digest.update(f.read())
    return digest.hexdigest()


# environment variables read while a graph is traced: they change the traced joint graph (whether the btt
# blocks op's backward recomputes its intermediate; AOTAutograd's CSE then merges that recompute with the
# forward's op, so the compiled graphs agree today), so they enter the cache key rather than rely on that
TRACE_ENV = ("COMERA_BTT_KEEP",)


def trace_settings() -> str:
    """The values of :data:`TRACE_ENV` now, as one string of the cache key (read at each call)."""
    return ";".join(f"{name}={os.environ.get(name, '').strip()}" for name in TRACE_ENV)


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """The hash of comera_compile's sources (passes and kernels included) and torch's version."""
    # this package's folder, and the folders of passes/ and kernels/ (namespace packages: no __file__)
    roots = {os.path.dirname(os.path.abspath(__file__))}
    roots |= {folder for name in ("comera_compile.passes", "comera_compile.kernels")
              for folder in importlib.import_module(name).__path__}
    return hash_sources(sorted(roots)) + "-torch" + torch.__version__


class SourceKeyedPass(CustomGraphPass):
    """A post-grad pass that runs ``inner`` (a user's pass, if any) and keys the cache on our code."""

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.inner is not None:
            self.inner(graph)

    def uuid(self) -> Any:
        inner_uuid = None
        if self.inner is not None:
            inner_uuid = self.inner.uuid() if hasattr(self.inner, "uuid") else None
            if inner_uuid is None:  # an un-keyed user pass: make the graph uncacheable, as Inductor does
                return None
        return ("comera_compile", source_fingerprint(), inner_uuid, trace_settings())


def graph_functions(gm: torch.fx.GraphModule) -> list[str]:
    """Qualified names of this package's Python functions that ``gm`` or a subgraph calls."""
    names = set()
    for _, sub in iter_graph_modules(gm):
        for node in sub.graph.nodes:
            target = node.target
            if (node.op == "call_function" and callable(target) and not isinstance(target, _OPS)
                    and getattr(target, "__module__", "").startswith("comera_compile.")):
                names.add(f"{target.__module__}.{target.__name__}")
    return sorted(names)


def inductor_config_patches(user_patches: dict[str, Any],
                            gm: torch.fx.GraphModule | None = None) -> dict[str, Any]:
    """Config patches for ``compile_fx`` that add our cache key (composed with a user's pass) and,
    given the graph, mark the functions of ours it calls cacheable under that key."""
    from torch._inductor import config as inductor_config

    patches = dict(user_patches)
    existing = patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
    if isinstance(existing, SourceKeyedPass):
        existing = existing.inner
    patches["post_grad_custom_post_pass"] = SourceKeyedPass(existing)
    functions = graph_functions(gm) if gm is not None else []
    current = getattr(inductor_config, "unsafe_marked_cacheable_functions", None)  # a torch without it: no cache
    if functions and current is not None:
        marked = dict(patches.get("unsafe_marked_cacheable_functions", current))
        marked.update((name, source_fingerprint()) for name in functions)
        patches["unsafe_marked_cacheable_functions"] = marked
    return patches
