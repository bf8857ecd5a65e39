"""What ``save_compact()``'s pack hook did: tensors and bytes by the form they were kept in, and report()'s words."""

from __future__ import annotations

from collections import Counter

# Why a tensor was saved as it is: save_compact.kept_by_reason's keys, and the words report() uses.
_REASONS = {
    "not_activation": "not an activation output",
    "not_replayed": "not rebuilt from its BatchNorm (and not mostly zeros)",
    "unsupported": "unsupported type",
    "too_small": "too small",
    "too_few_zeros": "too few zeros",
}

# The forms a tensor may be kept in other than as it is (each form's ``kind``), in report()'s
# and repr's order: report()'s label, what it counts, and how the form holds it.
_KINDS = {
    "replayed": ("replayed", "tensor", " (rebuilt from their BatchNorm's input)"),
    "compacted": ("compacted", "tensor", ""),
    "concatenated": ("concatenations", "tensor", " (each the one before it, shared, and what it adds)"),
    "pooled": ("max-pool outputs", "tensor", " (gathered from the pool's input at its indices)"),
    "remade": ("remade", "tensor", " (the ops that made them, run again on inputs the graph keeps)"),
    "narrowed": ("narrowed", "integer tensor", " (max-pool indices and the like, in a narrower integer type)"),
    "two_valued": ("two-valued", "tensor",
                   " (zeros and one other value, such as dropout's noise or mask, as a bitmap)"),
}
_AS_IT_IS = "kept"  # the kind of the tensors saved as they are


class _Stats:
    """What a save_compact's pack hook did: its _Packer counts here, the context reads it.

    By kind (a key of ``_KINDS``, or ``"kept"``): ``count`` distinct tensors (those kept as they
    are: ``kept_by_reason``), ``nbytes`` their bytes, ``held`` the bytes their forms hold. Of those
    kept as they are, ``outside`` and ``outside_bytes``: what is held outside the graph anyway
    (parameters, buffers, inputs and views of them), all counted as ``not_activation``; report()
    lists them apart."""

    __slots__ = ("count", "nbytes", "held", "replay_misses", "kept_by_reason", "outside", "outside_bytes", "ops",
                 "op_bytes", "op_misses")

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.nbytes: Counter[str] = Counter()
        self.held: Counter[str] = Counter()
        self.replay_misses = 0
        self.kept_by_reason = dict.fromkeys(_REASONS, 0)
        self.outside = self.outside_bytes = 0
        # Remade tensors by the op that remakes them (a form's ``op_name``): tensors, their bytes, and
        # the checks that failed (those tensors kept as they are).
        self.ops: Counter[str] = Counter()
        self.op_bytes: Counter[str] = Counter()
        self.op_misses: Counter[str] = Counter()

    def add(self, kind: str, nbytes: int, held: int, op: str | None = None) -> None:
        """Count a tensor of `nbytes` bytes, kept as `kind` in `held` bytes (remade by `op`, if any)."""
        self.count[kind] += 1
        self.nbytes[kind] += nbytes
        self.held[kind] += held
        if op is not None:
            self.ops[op] += 1
            self.op_bytes[op] += nbytes

    def keep(self, reason: str, nbytes: int, outside: bool = False) -> None:
        """Count a tensor of `nbytes` bytes, saved as it is for `reason`; `outside`: held outside the graph
        (a parameter, a view of one, another leaf that requires grad)."""
        self.keep_many(reason, 1, nbytes, int(outside), nbytes if outside else 0)

    def keep_many(self, reason: str, tensors: int, nbytes: int, outside: int, outside_bytes: int) -> None:
        """keep() of `tensors` tensors of `nbytes` bytes in all, `outside` of them (of `outside_bytes` bytes)
        held outside the graph (hooks._Packer.native's counts)."""
        self.kept_by_reason[reason] += tensors
        self.nbytes[_AS_IT_IS] += nbytes
        self.held[_AS_IT_IS] += nbytes
        self.outside += outside
        self.outside_bytes += outside_bytes

    def held_outside(self, tensors: int, nbytes: int) -> None:
        """Count `tensors` tensors of `nbytes` bytes in all, counted as saved as they are (not activations),
        as held outside the graph."""
        self.outside += tensors
        self.outside_bytes += nbytes

    def moved(self, reason: str, kind: str, nbytes: int, held: int) -> None:
        """Move a tensor of `nbytes` bytes, counted as saved as it is for `reason`, to `kind`, held in `held` bytes."""
        self.kept_by_reason[reason] -= 1
        self.nbytes[_AS_IT_IS] -= nbytes
        self.held[_AS_IT_IS] -= nbytes
        self.add(kind, nbytes, held)

    def freed(self, kind: str, nbytes: int) -> None:
        """Let the forms of `kind` hold `nbytes` bytes fewer (a Widened form that reads its cast's input
        instead of its copy)."""
        self.held[kind] -= nbytes

    @property
    def kept(self) -> int:
        """Distinct tensors saved as they are."""
        return sum(self.kept_by_reason.values())

    def counts(self) -> dict[str, int]:
        """Distinct tensors by kind, in report()'s order, those kept as they are last."""
        return {**{kind: self.count[kind] for kind in _KINDS}, _AS_IT_IS: self.kept}

    def report(self) -> str:
        """What the hooks did, in words (see save_compact's documentation): the headline and the lines
        count what the graph holds for the step (activation memory); what is held outside it comes apart."""
        total, held = sum(self.nbytes.values()) - self.outside_bytes, sum(self.held.values()) - self.outside_bytes
        n = sum(self.counts().values()) - self.outside
        share = f" ({100 * held / total:.1f}%)" if total else ""
        lines = [f"relu_ext.save_compact: {_tensors(n, 'tensor')} saved for backward, {_size(total)}, "
                 f"held in {_size(held)}{share}"]
        for kind, (label, noun, how) in _KINDS.items():
            k = self.count[kind]
            misses = {"replayed": self.replay_misses, "remade": sum(self.op_misses.values())}.get(kind, 0)
            if k or misses or kind == "compacted":  # (compacted: always said)
                line = (f"  {label}: {_tensors(k, noun)}, {_size(self.nbytes[kind])} held in "
                        f"{_size(self.held[kind])}{how}")
                if kind == "replayed":
                    line += f"; {misses} verification miss{'es' * (misses != 1)}"
                if kind == "remade" and (self.ops or self.op_misses):
                    line += "; by op: " + ", ".join(
                        f"{op} {self.ops[op]} ({_size(self.op_bytes[op])}"
                        + (f", {self.op_misses[op]} missed" if self.op_misses[op] else "") + ")"
                        for op in sorted(self.ops | self.op_misses, key=lambda o: -self.op_bytes[o]))
                lines.append(line)
        reasons = dict(self.kept_by_reason, not_activation=self.kept_by_reason["not_activation"] - self.outside)
        why = ", ".join(f"{k} {_REASONS[r]}" for r, k in reasons.items() if k)
        lines.append(f"  kept as they are: {_tensors(self.kept - self.outside, 'tensor')}, "
                     f"{_size(self.nbytes[_AS_IT_IS] - self.outside_bytes)}" + (f": {why}" if why else ""))
        if self.outside:
            lines.append(f"  held outside the graph: {_tensors(self.outside, 'tensor')}, {_size(self.outside_bytes)} "
                         "(parameters, buffers, inputs and views of them)")
        return "\n".join(lines)


def _tensors(n: int, noun: str) -> str:
    """`n` `noun`s, in words ("1 tensor", "2 tensors")."""
    return f"{n} {noun}{'s' * (n != 1)}"


def _size(n: int) -> str:
    """`n` bytes in words, in the largest unit under 1024 of it (GiB at most)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable
