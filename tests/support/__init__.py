"""Shared test helpers (imported by tests, never by product code or scripts)."""
