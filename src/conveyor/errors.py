"""Uniform error messages: name the argument, the rule, and the value given."""
from __future__ import annotations


def bad_value(arg: str, expected: str, got) -> ValueError:
    return ValueError(f"{arg}: expected {expected}, got {got!r}")


def bad_type(arg: str, expected: str, got) -> TypeError:
    return TypeError(f"{arg}: expected {expected}, got {got!r}")
