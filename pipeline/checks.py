"""Named checks and their report: pass / fail / skip (with a reason), rendered as JUnit XML for CI."""

from __future__ import annotations

import enum
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field


class Status(enum.StrEnum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"


class CheckResult(BaseModel):
    name: str
    status: Status
    message: str = ""
    details: dict[str, Any] = Field(default_factory=dict)
    seconds: float = 0.0


class CheckFailed(Exception):
    """Raised inside a check body to fail it with a message."""

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.details = details


class CheckSkipped(Exception):
    def __init__(self, reason: str, **details: Any) -> None:
        super().__init__(reason)
        self.details = details


class ValidationReport(BaseModel):
    target: str
    checks: list[CheckResult] = Field(default_factory=list)
    context: dict[str, Any] = Field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.status != Status.FAIL for c in self.checks)

    def run(self, name: str, body: Callable[[], tuple[str, dict[str, Any]] | str | None]) -> CheckResult:
        """Run one check body: returning means pass; CheckFailed/CheckSkipped mean fail/skip."""
        t0 = time.perf_counter()
        try:
            out = body()
            message, details = (out if isinstance(out, tuple) else (out or "ok", {}))
            result = CheckResult(name=name, status=Status.PASS, message=message, details=details)
        except CheckFailed as exc:
            result = CheckResult(name=name, status=Status.FAIL, message=str(exc), details=exc.details)
        except CheckSkipped as exc:
            result = CheckResult(name=name, status=Status.SKIP, message=str(exc), details=exc.details)
        result.seconds = round(time.perf_counter() - t0, 3)
        self.checks.append(result)
        return result


def write_junit(reports: list[ValidationReport], path: Path) -> None:
    """One <testsuite> per target, one <testcase> per check (failure / skipped elements as JUnit expects)."""
    suites = ET.Element("testsuites", name="quantyard validate")
    totals = {"tests": 0, "failures": 0, "skipped": 0}
    for report in reports:
        failures = sum(c.status == Status.FAIL for c in report.checks)
        skipped = sum(c.status == Status.SKIP for c in report.checks)
        suite = ET.SubElement(suites, "testsuite", name=report.target, tests=str(len(report.checks)),
                              failures=str(failures), errors="0", skipped=str(skipped),
                              time=f"{sum(c.seconds for c in report.checks):.3f}")
        for check in report.checks:
            case = ET.SubElement(suite, "testcase", classname=f"quantyard.validate.{report.target}",
                                 name=check.name, time=f"{check.seconds:.3f}")
            if check.status == Status.FAIL:
                ET.SubElement(case, "failure", message=check.message, type="QualityGate").text = _detail(check)
            elif check.status == Status.SKIP:
                ET.SubElement(case, "skipped", message=check.message)
            else:
                ET.SubElement(case, "system-out").text = check.message
        totals["tests"] += len(report.checks)
        totals["failures"] += failures
        totals["skipped"] += skipped
    for k, v in totals.items():
        suites.set(k, str(v))
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def _detail(check: CheckResult) -> str:
    lines = [check.message] + [f"{k}: {v}" for k, v in check.details.items()]
    return "\n".join(lines)
