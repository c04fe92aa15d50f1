"""The test suite: tiers unit, integration, e2e, deploy, dev; helpers in support/ (tests/README.md)."""
