"""Tolerance profiles for tap-diff (package data: one TOML file per profile)."""
