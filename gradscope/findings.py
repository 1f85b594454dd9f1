"""The :class:`Finding` value type shared by checks, reports, watch and the CLI."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Finding", "SEVERITIES", "KINDS", "sort_findings"]

SEVERITIES = ("error", "warning", "info")

#: The stable finding kinds (tests and users match on these strings).
KINDS = (
    "unused-parameter",
    "detached-branch",
    "inplace-hazard",
    "none-grad",
    "nonfinite-grad",
    "non-scalar-root",
    "no-grad-root",
    "freed-graph",
    "carried-graph",
    "retained-graph",
    "graph-without-backward",
)


@dataclass(frozen=True, slots=True)
class Finding:
    """One diagnosis: what is wrong, where, and how to fix it.

    Attributes:
        kind: one of :data:`KINDS`.
        severity: ``"error"``, ``"warning"`` or ``"info"``.
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
