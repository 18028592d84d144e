"""The table that ends scripts/test.sh: one row per tier, from each tier's JUnit report.

``python -m tests.tier_table DIR`` reads ``DIR/tiers.tsv`` (name, exit status, seconds,
report file, note: one line per tier, as the script wrote them) and the reports, prints the
table and the failed tests' names, and exits 1 if any tier failed or ran no test.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple


class Tier(NamedTuple):
    name: str
    passed: int
    failed: list[str]
    skipped: int
    seconds: int
    status: str


def test_id(classname: str, name: str) -> str:
    """pytest's id of a JUnit test case (``tests.unit.test_x[.Class]`` -> the file's path)."""
    parts = classname.split(".")
    module = next((i for i, p in enumerate(parts) if p.startswith("test_")), len(parts) - 1)
    return "::".join(["/".join(parts[: module + 1]) + ".py", *parts[module + 1 :], name])


def read_report(path: Path) -> tuple[int, list[str], int]:
    """(passed, failed test ids, skipped) of a pytest JUnit report; a missing or unreadable
    report counts as nothing run."""
    try:
        cases = ET.parse(path).getroot().iter("testcase")
    except (OSError, ET.ParseError):
        return 0, [], 0
    passed, failed, skipped = 0, [], 0
    for case in cases:
        outcome = {child.tag for child in case}
        name = test_id(case.get("classname", ""), case.get("name", ""))
        if outcome & {"failure", "error"}:
            failed.append(name)
        elif "skipped" in outcome:
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def read_tier(line: str, folder: Path) -> Tier:
    name, rc, seconds, report, note = line.rstrip("\n").split("\t")
    passed, failed, skipped = read_report(folder / report) if report else (0, [], 0)
    if note:
        status = note
    elif failed or rc != "0":
        status = f"FAILED (exit status {rc})"
    elif passed == 0:
        status = "FAILED: ran no test"
    else:
        status = "ok"
    return Tier(name, passed, failed, skipped, int(seconds), status)


def failed(tier: Tier) -> bool:
    return tier.status.startswith("FAILED")


def table(tiers: list[Tier]) -> str:
    head = ("tier", "passed", "failed", "skipped", "seconds", "result")
    rows = [head] + [
        (t.name, str(t.passed), str(len(t.failed)), str(t.skipped), str(t.seconds), t.status)
        for t in tiers
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            cell.ljust(w) if i in (0, 5) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(folder: Path) -> int:
    tiers = [read_tier(line, folder) for line in (folder / "tiers.tsv").open()]
    print(table(tiers))
    names = [(t.name, test) for t in tiers for test in t.failed]
    if names:
        print("\nfailed:")
        print("\n".join(f"  [{tier}] {test}" for tier, test in names))
    bad = [t.name for t in tiers if failed(t)]
    print(
        f"\ntest: {len(tiers) - len(bad)} of {len(tiers)} tiers passed"
        + (f"; failed: {', '.join(bad)}" if bad else "")
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
