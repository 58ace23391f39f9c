"""Which trainer-library versions an adapter supports: the range its extra pins in
odb-core's installed metadata (pyproject's `[hf]`, `[accelerate]`, `[lightning]`),
or the adapter's own fallback when odb-core was installed without it."""

from __future__ import annotations


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
