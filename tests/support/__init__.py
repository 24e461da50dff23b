"""Helpers shared by the test modules (no tests here): the model zoo, the exactness check,
multi-process launching, CLI hardening helpers and small DAG models with their plans."""
