"""Saving a tensorized model the way ``save_pretrained`` does, with its TT layout beside the weights.

A ``save_pretrained``-style method (transformers' ``PreTrainedModel.save_pretrained``) writes the
state_dict, which holds a tensorized layer's cores and gates, but nothing records which layers are
tensor trains, in which format and at which ranks. :func:`save_with_layout` writes ``comera_tt.json``
(:func:`tt_layout`: every layer's name, the modules sharing it,
format, modes, core shapes and gate sizes, so ranks after pruning) next to the method's files, and
stores a TT that several modules share once, under its first module (safetensors refuses tensors
shared between modules). :func:`keep_layout_on_save` makes the model's own ``save_pretrained`` do
that, so whatever calls it (transformers' ``Trainer`` saving a checkpoint or ``trainer.save_model()``)
writes a directory that ``comera_compile.hf.from_pretrained`` reloads, still tensorized.

Every layer of the file carries ``checksums``: for each of its fields, a digest of the value saved
(:func:`layout_checksums`). The weights cannot tell every layout apart (a square layer transposed, a
bottleneck without its activation), so :func:`read_layout` recomputes the digests from the file's
fields and refuses a layer whose fields disagree with them, naming the file, the layer and the field.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import warnings
from typing import Any, Callable

from torch import nn

from comera_compile.tensorize.config import ACTIVATIONS, INITS
from comera_compile.tensorize.parametrization import iter_tt_layers
from comera_compile.tt import FORMATS, TTSpec, ranks_from_shapes

TT_FILE = "comera_tt.json"
TT_FORMAT = 1
TT_MARK = ".parametrizations.weight.0."  # in the state_dict key of every core and gate
CHECKSUMS = "checksums"  # the field of a layer that holds the digests of its other fields


def tt_layout(model: nn.Module) -> list[dict]:
    """Every tensorized layer of ``model`` as a JSON-able dict: its name, the modules sharing it,
    its format, modes and the actual core shapes and gate sizes (ranks after any pruning)."""
    out = []
    for layer in iter_tt_layers(model):
        p = layer.param
        out.append({
            "fqn": layer.fqn, "shared_with": list(layer.shared_with), "kind": p.kind, "fmt": p.fmt,
            "row_modes": list(p.row_modes), "col_modes": list(p.col_modes), "rows": p.rows, "cols": p.cols,
            "transpose": bool(p.transpose), "core_shapes": [list(s) for s in p.core_shapes],
            "gate_sizes": list(p.gate_sizes), "init": p.init, "init_error": p.init_error, "svd_tol": p.svd_tol,
            "requires_grad": bool(p.core_flat.requires_grad), "activation": p.activation,
        })
    return out


def save_with_layout(root: nn.Module, save: Callable[..., Any], save_directory: str | os.PathLike,
                     state_dict: dict | None = None, **kwargs: Any) -> None:
    """``save(root, save_directory, state_dict=..., **kwargs)`` (an unbound ``save_pretrained``), then
    ``comera_tt.json`` where ``root`` has TT layers. ``state_dict`` defaults to ``root.state_dict()``;
    the entries of a TT's other modules are dropped, its cores copied out of their flat Parameter. A
    model without TT layers is saved as ``save`` saves it, and a stale ``comera_tt.json`` in the
    directory is removed. With ``is_main_process=False`` no file is written here."""
    main = kwargs.get("is_main_process", True)
    layout = tt_layout(root)
    if not layout:
        save(root, save_directory, **({} if state_dict is None else {"state_dict": state_dict}), **kwargs)
        path = os.path.join(save_directory, TT_FILE)
        if main and os.path.exists(path):  # a layout from an earlier tensorized save into this directory
            os.remove(path)
        return
    state = root.state_dict() if state_dict is None else state_dict
    drop = tuple(f"{other}{TT_MARK}" for entry in layout for other in entry["shared_with"])
    prefixes = tuple(f"{entry['fqn']}{TT_MARK}" for entry in layout)
    state = {k: (v.detach().clone() if k.startswith(prefixes) else v)
             for k, v in state.items() if not k.startswith(drop)}
    save(root, save_directory, state_dict=state, **kwargs)
    if main:
        layers = [{**entry, CHECKSUMS: layout_checksums(entry)} for entry in layout]
        with open(os.path.join(save_directory, TT_FILE), "w", encoding="utf-8") as f:
            json.dump({"format_version": TT_FORMAT, "layers": layers}, f, indent=1)


class LayoutSaving:
    """``model.save_pretrained`` after :func:`keep_layout_on_save`: the class's method through
    :func:`save_with_layout`. It holds the module the way a bound method does (``__self__``,
    ``__func__``), so ``copy.deepcopy`` rebinds it to the copy."""

    def __init__(self, module: nn.Module, func: Callable[..., Any]) -> None:
        self.__self__, self.__func__ = module, func

    def __call__(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        if args:  # positional arguments after the directory, by the method's own parameter names
            names = [p.name for p in list(inspect.signature(self.__func__).parameters.values())[2:]
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if len(args) > len(names):
                raise TypeError(f"{type(self.__self__).__name__}.save_pretrained takes at most {len(names) + 1} "
                                f"positional arguments after self; got {len(args) + 1}")
            kwargs.update(zip(names, args))
        save_with_layout(self.__self__, self.__func__, save_directory, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.__func__.__get__(self.__self__))

    def __repr__(self) -> str:
        return f"<save_pretrained of {type(self.__self__).__name__}, with its TT layout>"


def keep_layout_on_save(root: nn.Module) -> None:
    """Make ``root.save_pretrained(...)`` write the TT layout too (:class:`LayoutSaving` on the
    instance); nothing for a module whose class has no ``save_pretrained`` or that already has one
    on the instance (ours, or a user's own, which is left as it is)."""
    func = getattr(type(root), "save_pretrained", None)
    if callable(func) and "save_pretrained" not in root.__dict__:
        root.save_pretrained = LayoutSaving(root, func)


# ----------------------------------------------------------------------------------------------
# Reading comera_tt.json back: every field checked, against its checksum and its type
# ----------------------------------------------------------------------------------------------


def layout_checksums(entry: dict) -> dict[str, str]:
    """``{field: digest}`` for every field of a layer's layout entry but ``checksums``: the first 16
    hex digits of the SHA-256 of ``field=`` and the value as canonical JSON. Written with the layout
    and recomputed from the file's fields by :func:`read_layout`."""
    return {field: _digest(field, value) for field, value in entry.items() if field != CHECKSUMS}


def _digest(field: str, value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(f"{field}={text}".encode()).hexdigest()[:16]


def read_layout(path: str) -> list[dict]:
    """The layers of the ``comera_tt.json`` at ``path``, checked: JSON of this ``format_version``;
    every layer's fields equal to the values saved (its ``checksums``), present, of their types and
    describing one tensor train. Anything else raises ValueError naming the file, the layer and the
    field. A file saved before checksums were written loads with a warning."""
    layers = _read_layers(path)
    unchecked = [entry.get("fqn") for entry in layers if CHECKSUMS not in entry]
    out = []
    for i, entry in enumerate(layers):
        where = f"{path}: layers[{i}]" + (f" ('{entry['fqn']}')" if isinstance(entry.get("fqn"), str) else "")
        if CHECKSUMS in entry:
            _verify_checksums(entry, where)
        elif len(unchecked) < len(layers):
            raise ValueError(f"{where}: field '{CHECKSUMS}' is missing, which the file's other layers have (a save "
                             "writes it for every layer): the file was edited after saving. Restore the file, or "
                             "save the model again.")
        fields = {k: v for k, v in entry.items() if k != CHECKSUMS}
        _check_fields(fields, where)
        _check_tensor_train(fields, where)
        out.append(fields)
    if unchecked:
        warnings.warn(f"{path}: layer(s) {unchecked} have no checksums (the file was saved by a comera_compile "
                      "that did not write them): an edit of their format, modes, transpose or activation cannot be "
                      "detected and would load a different model. Check the file, then save the model again "
                      "(cc.hf.save_pretrained, or its own save_pretrained after tensorize_) to add them.",
                      UserWarning, stacklevel=3)
    return out


def _read_layers(path: str) -> list[dict]:
    """The file's ``layers``: a non-empty list of JSON objects, in a file of this ``format_version``."""
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if not text.strip():
        raise ValueError(f"{path} is empty (a save that was interrupted?); save the model again")
    try:
        saved = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno} of "
                         f"{text.count(chr(10)) + 1}): it is truncated or was edited; save the model again") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds a JSON {type(saved).__name__}; a {TT_FILE} is an object with the fields "
                         "'format_version' and 'layers'")
    if saved.get("format_version") != TT_FORMAT:
        raise ValueError(f"{path}: field 'format_version' is {saved.get('format_version')!r}; this comera_compile "
                         f"reads format_version {TT_FORMAT}")
    layers = saved.get("layers")
    if not isinstance(layers, list) or not layers:
        got = "is missing" if "layers" not in saved else f"is {json.dumps(layers)[:80]}"
        raise ValueError(f"{path}: field 'layers' {got}; valid: a non-empty list of the tensorized layers")
    bad = [i for i, entry in enumerate(layers) if not isinstance(entry, dict)]
    if bad:
        raise ValueError(f"{path}: layers{bad} are not JSON objects (a layer is an object of fields such as 'fqn', "
                         f"'fmt' and 'core_shapes'), got {layers[bad[0]]!r}"[:400])
    return layers


def _verify_checksums(entry: dict, where: str) -> None:
    """Raise unless every field of ``entry`` has the digest its ``checksums`` saved, and no more."""
    saved = entry[CHECKSUMS]
    if not isinstance(saved, dict):
        raise ValueError(f"{where}: field '{CHECKSUMS}' must map each field of the layer to its checksum, got "
                         f"{saved!r}"[:300])
    now = layout_checksums(entry)
    changed = [f for f in now if f in saved and saved[f] != now[f]]
    missing = [f for f in saved if f not in now]
    added = [f for f in now if f not in saved]
    if changed or missing or added:
        parts = ([f"field(s) {_quoted(changed)} differ from the values saved (now "
                  f"{', '.join(f'{f}={json.dumps(entry[f])}' for f in changed)})"] if changed else []) + \
                ([f"field(s) {_quoted(missing)} are missing"] if missing else []) + \
                ([f"field(s) {_quoted(added)} were not saved"] if added else [])
        raise ValueError(f"{where}: {'; '.join(parts)[:600]}: the file was edited after saving (its '{CHECKSUMS}' "
                         "hold a digest of every field as saved), and would load a model other than the one saved. "
                         "Restore the file, or save the model again.")


def _quoted(fields: list[str]) -> str:
    return ", ".join(f"'{f}'" for f in fields)


def _is_int(v: Any, low: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= low


def _ints(v: Any, low: int) -> bool:
    return isinstance(v, list) and bool(v) and all(_is_int(x, low) for x in v)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_KINDS = ("Linear", "Embedding", "Conv1D")
# field: (its check, what it must be); "activation" alone may be missing (files saved before it existed)
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "fqn": (lambda v: isinstance(v, str) and bool(v), "a module name (a non-empty string)"),
    "shared_with": (lambda v: isinstance(v, list) and all(isinstance(x, str) and x for x in v),
                    "a list of module names"),
    "kind": (lambda v: v in _KINDS, f"one of {list(_KINDS)}"),
    "fmt": (lambda v: v in FORMATS, f"one of {list(FORMATS)}"),
    "row_modes": (lambda v: _ints(v, 1), "a non-empty list of positive ints"),
    "col_modes": (lambda v: _ints(v, 1), "a non-empty list of positive ints"),
    "rows": (lambda v: _is_int(v, 1), "a positive int"),
    "cols": (lambda v: _is_int(v, 1), "a positive int"),
    "transpose": (lambda v: isinstance(v, bool), "true or false"),
    "core_shapes": (lambda v: isinstance(v, list) and bool(v) and all(_ints(s, 0) for s in v),
                    "a non-empty list of core shapes (lists of ints >= 0)"),
    "gate_sizes": (lambda v: isinstance(v, list) and all(_is_int(x, 0) for x in v), "a list of ints >= 0"),
    "init": (lambda v: v in INITS, f"one of {list(INITS)}"),
    "init_error": (lambda v: v is None or _is_number(v), "a number or null"),
    "svd_tol": (lambda v: v is None or (_is_number(v) and v >= 0), "a number >= 0 or null"),
    "requires_grad": (lambda v: isinstance(v, bool), "true or false"),
    "activation": (lambda v: v in ACTIVATIONS, f"null or one of {list(ACTIVATIONS[1:])}"),
}


def _check_fields(fields: dict, where: str) -> None:
    """Every field of a layer known, present and of its type (the valid choices named)."""
    unknown = [f for f in fields if f not in _FIELDS]
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {_quoted(unknown)} (a file of a newer comera_compile?); "
                         f"the fields of a layer are {list(_FIELDS)}")
    missing = [f for f in _FIELDS if f not in fields and f != "activation"]
    if missing:
        raise ValueError(f"{where}: field(s) {_quoted(missing)} are missing; the fields of a layer are {list(_FIELDS)}")
    for field, value in fields.items():
        check, valid = _FIELDS[field]
        if not check(value):
            raise ValueError(f"{where}: field '{field}' is {json.dumps(value)[:200]}; valid: {valid}")


def _check_tensor_train(fields: dict, where: str) -> None:
    """``fmt``, the modes, ``rows``/``cols`` and ``core_shapes`` describe one tensor train, whose
    internal ranks ``gate_sizes`` are; an ``activation`` sits in a ``"tt"`` Linear."""
    fmt, row, col, shapes = fields["fmt"], fields["row_modes"], fields["col_modes"], fields["core_shapes"]
    described = f"'fmt' {fmt!r} with 'row_modes' {row}, 'col_modes' {col}"
    try:
        spec = TTSpec(fmt, row, col, ranks_from_shapes(fmt, shapes), fields["rows"], fields["cols"],
                      fields["transpose"])
    except ValueError as e:
        raise ValueError(f"{where}: fields {described}, 'rows' {fields['rows']}, 'cols' {fields['cols']} and "
                         f"'core_shapes' {shapes} do not describe one tensor train ({e}): the file was edited "
                         "or is damaged") from None
    want = [list(s) for s in spec.core_shapes]
    if shapes != want:
        raise ValueError(f"{where}: field 'core_shapes' is {shapes}; {described} at ranks {list(spec.ranks)} has "
                         f"cores of shapes {want}: the file was edited or is damaged")
    if fields["gate_sizes"] != list(spec.gate_sizes):
        raise ValueError(f"{where}: field 'gate_sizes' is {fields['gate_sizes']}; the internal ranks of "
                         f"'core_shapes' are {list(spec.gate_sizes)}: the file was edited or is damaged")
    if fields.get("activation") is not None and (fmt != "tt" or fields["kind"] == "Embedding"):
        raise ValueError(f"{where}: field 'activation' is {fields['activation']!r}, which needs 'fmt' 'tt' and a "
                         f"Linear or Conv1D 'kind'; got 'fmt' {fmt!r}, 'kind' {fields['kind']!r}")
