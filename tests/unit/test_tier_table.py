"""The table that ends scripts/test.sh (tests/tier_table.py): counts read from each tier's
JUnit report, failed names listed, and the exit status 1 when a tier failed or ran nothing."""

from pathlib import Path

import pytest

from tests import tier_table

CASES = {
    "pass": "",
    "fail": "<failure message='x'/>",
    "error": "<error message='x'/>",
    "skip": "<skipped message='x'/>",
}


def report(path: Path, outcomes: list[str]) -> None:
    cases = "".join(
        f'<testcase classname="tests.unit.test_a" name="t{i}[{o}]">{CASES[o]}</testcase>'
        for i, o in enumerate(outcomes)
    )
    path.write_text(f'<testsuites><testsuite name="pytest">{cases}</testsuite></testsuites>')


def tiers(folder: Path, *rows: tuple[str, int, list[str] | None, str]) -> None:
    lines = []
    for i, (name, rc, outcomes, note) in enumerate(rows):
        if outcomes is not None:
            report(folder / f"{i}.xml", outcomes)
        lines.append(
            f"{name}\t{rc}\t{7 * i}\t{f'{i}.xml' if outcomes is not None else ''}\t{note}\n"
        )
    (folder / "tiers.tsv").write_text("".join(lines))


def test_every_tier_passed(tmp_path, capsys):
    tiers(
        tmp_path,
        ("units", 0, ["pass", "pass", "skip"], ""),
        ("not here", 0, None, "not run: no C compiler"),
    )
    assert tier_table.main(tmp_path) == 0
    out = capsys.readouterr().out
    assert "units" in out and " 2 " in out and "failed:" not in out
    assert "2 of 2 tiers passed" in out


@pytest.mark.parametrize(
    "rows,bad",
    [
        ([("units", 1, ["pass", "fail", "error"], "")], "units"),
        ([("recipe", 5, [], "")], "recipe"),  # collected nothing
        ([("x4", 0, ["skip", "skip"], "")], "x4"),  # ran no test
        ([("crash", 1, ["pass"], "")], "crash"),  # a rank died: exit status only
        (
            [("units", 0, ["pass"], ""), ("other path", 1, None, "FAILED: did not change")],
            "other path",
        ),
    ],
)
def test_a_failed_tier_fails_the_run_and_is_named(tmp_path, capsys, rows, bad):
    tiers(tmp_path, *rows)
    assert tier_table.main(tmp_path) == 1
    out = capsys.readouterr().out
    assert out.rstrip().endswith(f"failed: {bad}")


def test_the_failed_tests_are_listed_under_the_table(tmp_path, capsys):
    tiers(tmp_path, ("units", 1, ["pass", "fail", "error", "skip"], ""))
    tier_table.main(tmp_path)
    out = capsys.readouterr().out
    table, names = out.split("failed:\n")
    assert "units" in table.splitlines()[2] and table.splitlines()[2].split()[1:4] == [
        "1",
        "2",
        "1",
    ]
    assert "[units] tests/unit/test_a.py::t1[fail]" in names
    assert "[units] tests/unit/test_a.py::t2[error]" in names
