"""Names a user types, checked where they are given: the valid names and the closest match.

Every name a user writes (an algorithm, a client backend, a model, a
partition scheme, a data set, a keyword of a constructor or function, a TOML
table or key, a command-line flag or subcommand) is checked against the names
that exist, and a misspelling is answered with the closest valid one
(:func:`difflib.get_close_matches`, or the same name in another case) and the
list of valid names:

    unknown algorithm 'FedAvgg'; did you mean 'FedAvg'? (valid: ADMM, BayesADMM, ...)
    FedAvg() got an unexpected keyword argument 'learning_rat'; did you mean 'learning_rate'? (valid: ...)

:class:`CheckedKeywords` gives a class this keyword check in ``__new__`` (before
the dataclass's own ``__init__``), so every subclass (the algorithms, the client
backends) rejects an unknown keyword with the same message, whatever its fields
are; an alias field is a valid keyword like any other. :func:`checked_keywords`
does the same for a function, :func:`module_getattr` for a module's attributes.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import __future__
import inspect
from typing import Iterable, Optional


def closest(name, valid: Iterable[str]) -> Optional[str]:
    """The valid name closest to ``name`` (same name in another case first), or None when none is close."""
    valid = [str(v) for v in valid]
    if not isinstance(name, str):
        return None
    folded = {v.lower().replace("-", "_"): v for v in valid}
    key = name.lower().replace("-", "_")
    if key in folded:
        return folded[key]
    match = difflib.get_close_matches(key, list(folded), n=1, cutoff=0.6)
    return folded[match[0]] if match else None


def hint(name, valid: Iterable[str]) -> str:
    """``"; did you mean 'x'? (valid: a, b, c)"``: the suffix of an unknown-name message."""
    valid = sorted({str(v) for v in valid}, key=str.lower)
    best = closest(name, valid)
    guess = f"; did you mean {best!r}?" if best is not None else ";"
    return f"{guess} (valid: {', '.join(valid)})"


def unknown(what: str, name, valid: Iterable[str], where: str = "") -> str:
    """``"unknown <what> 'name'[ in <where>]; did you mean ...? (valid: ...)"``."""
    return f"unknown {what} {name!r}{' in ' + where if where else ''}{hint(name, valid)}"


def check_name(what: str, name, valid: Iterable[str], where: str = "") -> None:
    """ValueError naming the closest valid name unless ``name`` is one of ``valid``."""
    valid = list(valid)
    if name not in valid:
        raise ValueError(unknown(what, name, valid, where))


def unexpected_keyword(owner: str, key: str, valid: Iterable[str]) -> TypeError:
    """The TypeError of an unknown keyword argument of ``owner(...)``, with the closest valid keyword."""
    return TypeError(f"{owner}() got an unexpected keyword argument {key!r}{hint(key, valid)}")


def keywords(fn, named_only: bool = False) -> Optional[frozenset]:
    """The keyword arguments ``fn`` (a function or class) accepts; None when it takes ``**kwargs``
    (unless ``named_only``: then its named parameters only)."""
    if isinstance(fn, type) and dataclasses.is_dataclass(fn):
        return frozenset(f.name for f in dataclasses.fields(fn) if f.init)
    sig = inspect.signature(fn)
    params = sig.parameters.values()
    if not named_only and any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_keywords(owner: str, given: Iterable[str], valid: Optional[Iterable[str]]) -> None:
    """TypeError for the first keyword in ``given`` not in ``valid`` (nothing when ``valid`` is None)."""
    if valid is None:
        return
    valid = set(valid)
    for key in given:
        if key not in valid:
            raise unexpected_keyword(owner, key, valid)


class CheckedKeywords:
    """A base class whose constructor rejects unknown keyword arguments with the closest valid one.

    The check runs in ``__new__``, before the (dataclass-generated) ``__init__``,
    against the subclass's own init fields, so it holds for every subclass.
    """

    def __new__(cls, *args, **kwargs):
        if kwargs:
            check_keywords(cls.__name__, kwargs, _class_keywords(cls))
        return super().__new__(cls)


@functools.lru_cache(maxsize=None)
def _class_keywords(cls) -> Optional[frozenset]:
    if dataclasses.is_dataclass(cls):
        return keywords(cls)
    return keywords(cls.__init__)


def checked_keywords(fn):
    """Decorate ``fn`` so that an unknown keyword argument names the closest valid one."""
    valid = keywords(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        check_keywords(fn.__name__, kwargs, valid)
        return fn(*args, **kwargs)

    return wrapper


def public_names(namespace: dict, kind=None) -> list:
    """The public names of a module namespace (of type ``kind`` when given: e.g. the Algorithm subclasses)."""
    out = []
    for k, v in namespace.items():
        if k.startswith("_") or inspect.ismodule(v) or isinstance(v, __future__._Feature):
            continue
        if kind is not None and not (isinstance(v, type) and issubclass(v, kind) and v is not kind):
            continue
        out.append(k)
    return out


def module_getattr(module_name: str, namespace: dict, what: str, kind=None):
    """A module ``__getattr__`` whose AttributeError names the closest public name of the module."""

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        valid = public_names(namespace, kind)
        raise AttributeError(f"module {module_name!r} has no {what} {name!r}{hint(name, valid)}")

    return __getattr__


__all__ = ["closest", "hint", "unknown", "check_name", "unexpected_keyword", "keywords", "check_keywords",
           "CheckedKeywords", "checked_keywords", "public_names", "module_getattr"]
