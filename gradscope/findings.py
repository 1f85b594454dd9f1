"""The :class:`Finding` value type shared by checks, reports, watch and the CLI, with its kinds and
severities as named constants (code names them through these; :class:`Finding` refuses any other)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass

from gradscope._format import one_line, plural
from gradscope.errors import InputValueError

__all__ = [
    "Finding", "SEVERITIES", "KINDS", "sort_findings", "severity_counts", "ERROR", "WARNING", "INFO",
    "UNUSED_PARAMETER", "DETACHED_BRANCH", "INPLACE_HAZARD", "NONE_GRAD", "NONFINITE_GRAD", "NON_SCALAR_ROOT",
    "NO_GRAD_ROOT", "FREED_GRAPH", "CARRIED_GRAPH", "RETAINED_GRAPH", "GRAPH_WITHOUT_BACKWARD", "NOT_OPTIMIZED",
    "NONFINITE_PARAM",
]  # fmt: skip

# -- severities, most severe first ------------------------------------------------------------------
ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITIES = (ERROR, WARNING, INFO)

# -- kinds (stable strings: tests, users and saved reports match on them; the README lists them) ------
UNUSED_PARAMETER = "unused-parameter"  #: a trainable parameter the roots never reach
DETACHED_BRANCH = "detached-branch"  #: parameters cut off by .detach() / .data / no_grad / a round trip
INPLACE_HAZARD = "inplace-hazard"  #: a saved tensor written in place: backward() will raise
NONE_GRAD = "none-grad"  #: watch(): a parameter got no gradient this step
NONFINITE_GRAD = "nonfinite-grad"  #: watch(): a gradient with NaN/Inf, and the op that made it
NON_SCALAR_ROOT = "non-scalar-root"  #: backward() on a non-scalar needs a gradient argument
NO_GRAD_ROOT = "no-grad-root"  #: a root without grad_fn: backward() will raise
FREED_GRAPH = "freed-graph"  #: a graph whose saved tensors a backward already freed
CARRIED_GRAPH = "carried-graph"  #: watch(): a graph of an earlier step reached this step's backward
RETAINED_GRAPH = "retained-graph"  #: watch(): graphs of earlier forwards kept alive by a variable
GRAPH_WITHOUT_BACKWARD = "graph-without-backward"  #: watch(): a training forward with no backward
NOT_OPTIMIZED = "not-optimized"  #: watch(): a parameter with gradients that no stepping optimizer holds
NONFINITE_PARAM = "nonfinite-param"  #: watch(): a parameter already NaN/Inf before a forward

#: The stable finding kinds, in the order findings of one severity are listed.
KINDS = (
    UNUSED_PARAMETER,
    DETACHED_BRANCH,
    INPLACE_HAZARD,
    NONE_GRAD,
    NONFINITE_GRAD,
    NONFINITE_PARAM,
    NON_SCALAR_ROOT,
    NO_GRAD_ROOT,
    FREED_GRAPH,
    CARRIED_GRAPH,
    RETAINED_GRAPH,
    GRAPH_WITHOUT_BACKWARD,
    NOT_OPTIMIZED,
)


@dataclass(frozen=True, slots=True)
class Finding:
    """One diagnosis: what is wrong, where, and how to fix it.

    Attributes:
        kind: one of :data:`KINDS` (anything else raises :class:`~gradscope.errors.InputValueError`).
        severity: one of :data:`SEVERITIES`: ``"error"``, ``"warning"`` or ``"info"``.
        message: a full sentence that names the cause and the fix.
        node: the graph node id the finding is about, or None.
        params: qualified names of the parameters concerned.
        location: ``"file.py:123"`` where the cause happened, when known.
    """

    kind: str
    severity: str
    message: str
    node: str | None = None
    params: tuple[str, ...] = ()
    location: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InputValueError(f"unknown finding kind {one_line(self.kind)}; the kinds are: {', '.join(KINDS)}.")
        if self.severity not in SEVERITIES:
            raise InputValueError(
                f"unknown severity {one_line(self.severity)}; the severities are: {', '.join(SEVERITIES)}."
            )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["params"] = list(self.params)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Finding:
        return cls(
            d["kind"], d["severity"], d["message"], d.get("node"), tuple(d.get("params") or ()), d.get("location")
        )

    def __str__(self) -> str:
        where = f" [{self.location}]" if self.location else ""
        return f"{self.severity}: {self.kind}{where}: {self.message}"


def severity_counts(findings: Iterable[Finding]) -> str:
    """``"1 error, 2 warnings"`` in the order the severities first occur (empty: no finding).

    Example:
        >>> severity_counts([Finding(UNUSED_PARAMETER, ERROR, "m"), Finding(NONE_GRAD, WARNING, "m"),
        ...                  Finding(NONE_GRAD, WARNING, "n")])
        '1 error, 2 warnings'
    """
    counts: dict[str, int] = {}
    for f in findings:
        counts[f.severity] = counts.get(f.severity, 0) + 1
    return ", ".join(plural(n, s) for s, n in counts.items())


def sort_findings(findings) -> list[Finding]:
    """Most severe first; ties broken by kind, node and parameters so the order is deterministic."""
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    return sorted(
        findings,
        key=lambda f: (
            rank.get(f.severity, 9),
            KINDS.index(f.kind) if f.kind in KINDS else 99,
            _node_key(f.node),
            f.params,
        ),
    )


def _node_key(node) -> tuple:
    if node is None:
        return (0, 0)
    text = str(node)
    return (1, int(text[1:])) if text[:1] == "n" and text[1:].isdigit() else (2, text)
