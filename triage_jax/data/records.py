"""The one record type every task source yields, and the error raised on bad data files."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MathExample:
    """A prompt (the final user-message text, template already applied) and its ground-truth answer."""

    prompt: str
    ground_truth: str
    source: str
    uid: str


class DataError(ValueError):
    """A data file is unusable: missing, unreadable, or too many malformed rows."""


@dataclasses.dataclass
class LoadStats:
    """What a loader saw: rows read, rows kept, rows skipped as malformed (with the first reasons), duplicates."""

    path: str
    rows: int = 0
    kept: int = 0
    malformed: int = 0
    duplicates: int = 0
    conflicting_duplicates: int = 0
    malformed_reasons: list[str] = dataclasses.field(default_factory=list)

    @property
    def malformed_fraction(self) -> float:
        return self.malformed / self.rows if self.rows else 0.0

    def record_malformed(self, row_index: int, reason: str, keep: int = 5) -> None:
        self.malformed += 1
        if len(self.malformed_reasons) < keep:
            self.malformed_reasons.append(f"row {row_index}: {reason}")


@dataclasses.dataclass
class LoadResult:
    """Examples from one file plus the loader's counts (for logging and for the malformed-row threshold)."""

    examples: list[MathExample]
    stats: LoadStats
