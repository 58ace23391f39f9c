"""Which trainer-library versions an adapter supports: the range its extra pins in
odb-core's installed metadata (pyproject's `[hf]`, `[accelerate]`, `[lightning]`),
or the adapter's own fallback when odb-core was installed without it."""

from __future__ import annotations

from typing import Any


def extra_range(package: str, extra: str, fallback: str) -> str:
    """The version specifier of `package` in odb-core's `extra`, else `fallback`."""
    try:
        from importlib.metadata import PackageNotFoundError, requires

        from packaging.requirements import Requirement

        for line in requires("odb-core") or []:
            req = Requirement(line)
            if (
                req.name == package
                and req.marker is not None
                and req.marker.evaluate({"extra": extra})
                and str(req.specifier)
            ):
                return str(req.specifier)
    except (PackageNotFoundError, ImportError, ValueError):
        pass
    return fallback


def in_range(version: str, spec: str) -> bool:
    """`version` satisfies `spec`; an unparsable version does not."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) in SpecifierSet(spec)
    except InvalidVersion:
        return False


def warn_once(warned: set[str], key: str, message: str, stacklevel: int = 4) -> None:
    """`warnings.warn(message)` the first time `key` is seen in `warned`."""
    import warnings

    if key not in warned:
        warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=stacklevel)


def check_version(
    package: str,
    version: str,
    *,
    extra: str,
    fallback: str,
    missing: list[str],
    relies: str,
    warned: set[str],
) -> bool:
    """An adapter's version gate: raise `ConfigError` when the trainer library lacks a
    member the adapter relies on (`missing`), warn once when `version` is outside the
    supported range (the `extra`'s, else `fallback`); True when inside it."""
    from odb_core.errors import ConfigError

    spec = extra_range(package, extra, fallback)
    fix = f"`pip install 'odb-core[{extra}]'` ({package}{spec})"
    if missing:
        raise ConfigError(
            f"{package} {version} has no {', '.join(missing)}, which the odb-core {extra} "
            f"adapter relies on (its PRIVATE_MEMBERS); install a supported version: {fix}"
        )
    ok = in_range(version, spec)
    if not ok:
        warn_once(
            warned,
            f"version:{version}",
            f"{package} {version} is outside the range the odb-core {extra} adapter is "
            f"tested with ({spec}); it relies on {relies}: install a supported one, {fix}",
        )
    return ok


def deprecated_names(module: str, names: dict[str, tuple[str, object]]) -> Any:
    """A module `__getattr__` that serves each old name in `names` (old -> (new name,
    object)) with a `DeprecationWarning` naming the new one."""
    import warnings

    def __getattr__(name: str) -> Any:
        if name in names:
            new, obj = names[name]
            warnings.warn(
                f"{module}.{name} is deprecated: use {new}", DeprecationWarning, stacklevel=2
            )
            return obj
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
