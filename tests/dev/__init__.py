"""Tests of the repository and its maintainer tools: layout rules, mutation testing."""
