"""Draft sources and the registry that builds one from a spec string.

A spec is `NAME` or `NAME:ARG` ("prompt_lookup", "prompt_lookup:max_ngram=4,min_ngram=2",
"draft_file:PATH", "head:DIR", "first:prompt_lookup+head:DIR", "select:prompt_lookup+draft_file:F+head:DIR"). Registering a new source is one line: map its
name to a factory `(arg: str | None, target) -> DraftSource`, either here in SOURCES as a lazy "module:function"
string (imported only when used, so optional dependencies stay optional) or from the source's own module:

    SOURCES["head"] = "models.heads:head_source"       # here
    register_source("draft_file", draft_file_source)   # or there
"""

from __future__ import annotations

from importlib import import_module
from typing import Callable

from inference.sources.base import Draft, DraftContext, DraftSource
from models.errors import DraftheadsError

Factory = Callable[[str | None, object], DraftSource]


def parse_kwargs(arg: str | None, spec: str, allowed: dict[str, type]) -> dict:
    """'a=1,b=2' -> {'a': 1, 'b': 2}, typed by `allowed`; unknown keys or bad values are user errors."""
    kwargs = {}
    for item in filter(None, (arg or "").split(",")):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in allowed:
            raise DraftheadsError(f"draft source '{spec}': '{item}' is not KEY=VALUE with KEY in {sorted(allowed)}")
        try:
            kwargs[key] = allowed[key](value.strip())
        except ValueError:
            raise DraftheadsError(f"draft source '{spec}': {key}={value!r} is not a valid {allowed[key].__name__}") from None
    return kwargs


def path_and_options(arg: str | None) -> tuple[str, str]:
    """'PATH,key=value,...' (draft_file, head) -> (PATH, 'key=value,...'); either may be empty."""
    path, _, options = (arg or "").partition(",")
    return path, options


def prompt_lookup_source(arg: str | None, target) -> DraftSource:
    from inference.sources.prompt_lookup import PromptLookup

    spec = f"prompt_lookup:{arg}"
    try:
        return PromptLookup(**parse_kwargs(arg, spec, {"max_ngram": int, "min_ngram": int}))
    except ValueError as e:
        raise DraftheadsError(f"draft source '{spec}': {e}") from None


SOURCES: dict[str, Factory | str] = {
    "prompt_lookup": prompt_lookup_source,
    "draft_file": "inference.sources.draft_file:draft_file_source",
    "head": "inference.sources.dspark:head_source",  # dspark / dflash checkpoints get confidences; others draft_head
    "first": "inference.sources.first:first_source",  # first:A+B: the first source with a non-empty draft
    "select": "inference.sources.select:select_source",  # select:A+B: the source with the most tokens per second
}


def register_source(name: str, factory: Factory | str) -> None:
    SOURCES[name] = factory


PATH_SOURCES = ("head", "draft_file")  # sources whose argument starts with a path: 'PATH,key=value,...'


def leaf_specs(spec: str) -> list[tuple[str, str]]:
    """(name, arg) of every single source in a spec: the parts of first:/select:, or the spec itself."""
    name, _, arg = spec.partition(":")
    if name in ("first", "select"):
        from inference.sources.first import parts

        return [leaf_specs(part)[0] for part in parts(arg, name)]  # parts are single sources ('+' splits them)
    return [(name, arg)]


def source_paths(spec: str) -> list[str]:
    """The files and directories a source reads (a head's directory, a draft file), in every part of a combination."""
    return [path_and_options(arg)[0] for name, arg in leaf_specs(spec) if name in PATH_SOURCES and arg]


def source_layer_ids(spec: str) -> list[int] | None:
    """The target layers a source reads features from: the first head's recorded layer ids ('head:DIR'), else None
    (the default). Load the target with these, or a head trained on other layers is refused."""
    heads = [arg for name, arg in leaf_specs(spec) if name == "head" and arg]
    if not heads:
        return None
    from models.checkpoint import read_draft_config

    ids = read_draft_config(path_and_options(heads[0])[0])["target"]["layer_ids"]
    return list(ids) if ids else None  # a peer's draft that names none reads the engines' default layers


def build_source(spec: str, target) -> DraftSource:
    """A DraftSource from 'NAME' or 'NAME:ARG' (see module docstring)."""
    name, sep, arg = spec.partition(":")
    factory = SOURCES.get(name)
    if factory is None:
        raise DraftheadsError(
            f"unknown draft source '{spec}'; known sources: {', '.join(sorted(SOURCES))} "
            "(write NAME or NAME:ARG, e.g. prompt_lookup:max_ngram=3)"
        )
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        try:
            factory = getattr(import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise DraftheadsError(f"draft source '{name}' is registered as '{SOURCES[name]}' but cannot be "
                                  f"loaded ({e}); check that module is installed") from None
    return factory(arg if sep else None, target)


__all__ = ["Draft", "DraftContext", "DraftSource", "SOURCES", "build_source", "register_source", "source_layer_ids", "source_paths",
           "parse_kwargs"]
